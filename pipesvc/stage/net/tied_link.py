"""The swap of tied gradients between two stages (see [Note: tied parameters] in
``pipesvc.core.tying``).

For each pair of stages that share tied groups, the higher rank calls ``SwapTiedGradients`` on
the lower one at the end of its training run, streaming its partial sums; the lower rank's
handler (``answer``) keeps them until its own run is done, then answers with its own. Calls
only go to lower ranks and an answer waits only for its own stage's run, so swaps cannot wait
on each other in a cycle. Every wait is bounded by ``timeout_s`` and ends early when the run is
aborted (``abort`` also cancels a call in flight).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import grpc
import torch

from pipesvc.core.tensor_codec import CodecLimits, named_frames, read_named_frames
from pipesvc.core.tying import StageTies
from pipesvc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PipelineTimeoutError,
    StepAbortedError,
)
from pipesvc.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from pipesvc.wire.rpc_status import rpc_errors

Shape = tuple[tuple[int, ...], torch.dtype]


def _read(
    frames: Iterable[common_pb2.TensorFrame],
    limits: CodecLimits,
    expected: Mapping[int, Shape],
    source: str,
) -> dict[int, torch.Tensor]:
    """The tensors of a swap, checked against the groups and shapes ``expected`` from it."""
    got: dict[int, torch.Tensor] = {}
    for name, tensor in read_named_frames(frames, limits):
        group = int(name) if name.isdigit() else -1
        if group not in expected or group in got:
            raise InvalidArgumentError(
                f"tied gradient {name!r} from {source}: expected each of groups "
                f"{sorted(expected)} once"
            )
        shape, dtype = expected[group]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise InvalidArgumentError(
                f"tied gradient of group {group} from {source} has shape {list(tensor.shape)} "
                f"and dtype {tensor.dtype}; expected {list(shape)} and {dtype}"
            )
        got[group] = tensor
    if set(got) != set(expected):
        raise InvalidArgumentError(
            f"tied gradients from {source} cover groups {sorted(got)}; expected {sorted(expected)}"
        )
    return got


class TiedLink:
    """This stage's side of the swaps of one job at one plan epoch (``TiedSwap``)."""

    def __init__(
        self,
        *,
        job_id: str,
        epoch: int,
        rank: int,
        ties: StageTies,
        shapes: Mapping[int, Shape],
        addresses: Mapping[int, str],
        dial: Callable[[str], grpc.Channel],
        limits: CodecLimits,
        timeout_s: float,
    ) -> None:
        self._job_id, self._epoch, self._rank = job_id, epoch, rank
        self._ties, self._shapes = ties, dict(shapes)
        self._addresses, self._dial = dict(addresses), dial
        self._limits, self._timeout_s = limits, timeout_s
        self._cond = threading.Condition()
        self._own: tuple[int, dict[int, torch.Tensor]] | None = None
        self._theirs: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # (run, rank) ->
        self._aborted = 0  # every run up to this one is aborted
        self._calls: list[tuple[int, grpc.Call]] = []  # (run, call in flight)

    def _expected(self, peer: int) -> dict[int, Shape]:
        return {g: self._shapes[g] for g in self._ties.groups_with(peer)}

    # -- this stage's run -----------------------------------------------------------------------

    def swap(self, run_id: int, partials: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Hands this stage's partial sums to the peers and returns theirs (``TiedSwap``)."""
        peers = self._ties.peer_ranks()
        with self._cond:
            self._check_live(run_id)
            self._theirs = {k: v for k, v in self._theirs.items() if k[0] >= run_id}
            self._own = (run_id, partials)
            self._cond.notify_all()
        result: dict[int, torch.Tensor] = {}
        for peer in (p for p in peers if p < self._rank):
            result.update(self._call(peer, run_id, partials))
        deadline = time.monotonic() + self._timeout_s
        for peer in (p for p in peers if p > self._rank):
            with self._cond:
                while (run_id, peer) not in self._theirs:
                    self._wait(run_id, deadline, f"rank {peer}'s tied gradients")
                result.update(self._theirs.pop((run_id, peer)))
        return result

    def _check_live(self, run_id: int) -> None:
        if run_id <= self._aborted:
            raise StepAbortedError(f"run {run_id} was aborted during the tied-gradient swap")

    def _wait(self, run_id: int, deadline: float, what: str) -> None:
        """One bounded wait on the condition (held) for ``what`` of run ``run_id``."""
        self._check_live(run_id)
        left = deadline - time.monotonic()
        if left <= 0:
            raise PipelineTimeoutError(f"no {what} for run {run_id} within {self._timeout_s:g} s")
        self._cond.wait(min(left, 0.5))
        self._check_live(run_id)

    def _call(
        self, peer: int, run_id: int, partials: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        address = self._addresses[peer]
        stub = stage_pb2_grpc.StageServiceStub(self._dial(address))

        def frames() -> Iterator[stage_pb2.TiedGradientFrame]:
            for group in self._ties.groups_with(peer):
                for frame in named_frames(str(group), partials[group].detach().cpu()):
                    yield stage_pb2.TiedGradientFrame(
                        job_id=self._job_id,
                        plan_epoch=self._epoch,
                        run_id=run_id,
                        rank=self._rank,
                        frame=frame,
                    )

        where = f"rank {peer} ({address})"
        call = stub.SwapTiedGradients(frames(), timeout=self._timeout_s)
        with self._cond:
            self._calls.append((run_id, call))
        try:
            if run_id <= self._aborted:
                call.cancel()
            with rpc_errors(where):
                return _read(call, self._limits, self._expected(peer), where)
        except InvalidArgumentError:
            call.cancel()
            raise
        finally:
            with self._cond:
                self._calls.remove((run_id, call))
            self._check_live(run_id)

    # -- a peer's call ---------------------------------------------------------------------------

    def answer(
        self, run_id: int, rank: int, frames: Iterable[common_pb2.TensorFrame]
    ) -> dict[int, torch.Tensor]:
        """A higher rank's partial sums of run ``run_id``: kept for this stage's run, whose own
        partial sums for that rank are returned once it has them.

        Raises:
            InvalidArgumentError: ``rank`` shares no tied group with this stage as the caller,
                or the tensors are not the groups and shapes expected (nothing kept).
            StepAbortedError, PipelineTimeoutError: the run was aborted, or this stage's run
                did not end in time.
        """
        if rank <= self._rank or rank not in self._ties.peer_ranks():
            raise InvalidArgumentError(
                f"rank {rank} does not swap tied gradients with rank {self._rank} as the caller"
                f" (this stage's peers: {self._ties.peer_ranks()})"
            )
        theirs = _read(frames, self._limits, self._expected(rank), f"rank {rank}")
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            self._check_live(run_id)
            if self._own is not None and self._own[0] > run_id:
                raise FailedPreconditionError(
                    f"tied gradients of run {run_id} came after run {self._own[0]} began"
                )
            self._theirs[(run_id, rank)] = theirs
            self._cond.notify_all()
            while self._own is None or self._own[0] != run_id:
                self._wait(run_id, deadline, "end of this stage's run")
            own = self._own[1]
        return {g: own[g] for g in self._ties.groups_with(rank)}

    def abort(self, run_id: int) -> None:
        """Ends every wait of runs up to ``run_id`` and cancels their calls in flight."""
        with self._cond:
            self._aborted = max(self._aborted, run_id)
            self._theirs = {k: v for k, v in self._theirs.items() if k[0] > run_id}
            calls = [call for run, call in self._calls if run <= run_id]
            self._cond.notify_all()
        for call in calls:
            call.cancel()
