"""Moving whole-model state between a stream of named frames and a job's stages.

Loading routes each tensor to the stage holding its layer, over one LoadState stream per stage,
with at most a few frames in flight; then every stage applies what it staged, or none does.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from pipesvc.coordinator.stage_calls import StageStub, call_all, call_stage
from pipesvc.coordinator.stage_registry import StageRegistry
from pipesvc.core.plan import PipelineStage, servers_of
from pipesvc.errors import InvalidArgumentError, PipesvcError
from pipesvc.storage.checkpoint import OPTIM_PREFIX, layer_of
from pipesvc.v1 import common_pb2, stage_pb2

FRAMES_IN_FLIGHT = 16


def _describe_key(
    name: str, layers: Sequence[stage_pb2.LayerDescription]
) -> tuple[int, list[int] | None]:
    """The key's layer and its tensor's shape (None for optimizer state, checked by the stage).

    Raises:
        InvalidArgumentError: the key names no tensor of the model.
    """
    try:
        layer = layer_of(name)
    except InvalidArgumentError:
        layer = -1
    if not 0 <= layer < len(layers):
        raise InvalidArgumentError(
            f"state key {name!r} does not start with a layer index below {len(layers)}"
        )
    names = {t.name: list(t.shape) for t in layers[layer].tensors}
    if name.startswith(OPTIM_PREFIX):
        param = name[len(OPTIM_PREFIX) :].split(".", 1)[1].rpartition(".")[0]
        if param in names:
            return layer, None
    else:
        rest = name.split(".", 1)[1] if "." in name else ""
        if rest in names:
            return layer, names[rest]
    raise InvalidArgumentError(f"state key {name!r} is not a tensor of layer {layer}")


def load_into_stages(
    registry: StageRegistry,
    job_id: str,
    plan: Sequence[PipelineStage],
    layers: Sequence[stage_pb2.LayerDescription],
    frames: Iterable[common_pb2.TensorFrame],
    *,
    timeout_s: float,
    step: int | None = None,
    pool: futures.ThreadPoolExecutor,
) -> int:
    """Streams a full state (optionally with optimizer state) into the stages; all or none.

    Returns how many tensors were loaded.

    Raises:
        InvalidArgumentError: unknown or missing keys, or a shape or dtype mismatch.
    """
    expected = {f"{layer.index}.{t.name}" for layer in layers for t in layer.tensors}
    # One stream per stage server, by its index among the plan's servers (with replicas,
    # several servers hold each layer, and every one of them gets its tensors; with virtual
    # stages, one server holds several ranges).
    entries = list(plan)
    plan = servers_of(entries)
    index_of = {s.address: i for i, s in enumerate(plan)}
    queues = {i: queue.Queue[Any](maxsize=FRAMES_IN_FLIGHT) for i in range(len(plan))}

    def feed(index: int) -> Iterator[stage_pb2.LoadStateRequest]:
        while (frame := queues[index].get()) is not None:
            yield stage_pb2.LoadStateRequest(job_id=job_id, frame=frame)

    def load(index: int) -> stage_pb2.LoadStateResponse:
        return call_stage(
            registry, plan[index], lambda stub: stub.LoadState, feed(index), timeout_s
        )

    calls = {i: pool.submit(load, i) for i in range(len(plan))}

    def put(index: int, item: common_pb2.TensorFrame | None) -> None:
        # A stage that refused the stream stops reading: never block on its queue.
        while not calls[index].done():
            try:
                queues[index].put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        error = calls[index].exception()
        if item is not None and error is not None:
            raise error

    seen: set[str] = set()
    failure: BaseException | None = None
    try:
        _route(frames, entries, index_of, layers, put, seen)
    except PipesvcError as exc:
        failure = exc
    finally:
        for index in queues:
            put(index, None)
    futures.wait(calls.values())
    failure = failure or next((c.exception() for c in calls.values() if c.exception()), None)
    missing = sorted(expected - seen)
    # Applied only when every key arrived and every stream ended well; discarded otherwise.
    check_failure = _apply_staged(
        registry,
        job_id,
        plan,
        complete=failure is None and not missing,
        step=step,
        timeout_s=timeout_s,
    )
    failure = failure or check_failure
    if failure is not None:
        raise failure
    if missing:
        raise InvalidArgumentError(f"state_dict is missing {len(missing)} keys, e.g. {missing[:5]}")
    return len(seen)


def _apply_staged(
    registry: StageRegistry,
    job_id: str,
    servers: Sequence[PipelineStage],
    *,
    complete: bool,
    step: int | None,
    timeout_s: float,
) -> PipesvcError | None:
    """The second phase of a load: when the state streamed was ``complete``, every stage checks
    what it staged, and only if all checks pass does every stage apply it (setting ``step``,
    if given); otherwise every stage discards it.

    Returns the check that failed, if any (nothing was applied then).
    """
    failure: PipesvcError | None = None
    if complete:
        # Every stage checks what it staged before any stage applies: all or none.
        check = stage_pb2.ApplyStateRequest(job_id=job_id, check=True)
        try:
            call_all(registry, servers, lambda stub, s: (stub.ApplyState, check), timeout_s)
        except PipesvcError as exc:
            failure = exc
    apply = complete and failure is None

    def apply_request(
        stub: StageStub, stage: PipelineStage
    ) -> tuple[
        grpc.UnaryUnaryMultiCallable[stage_pb2.ApplyStateRequest, stage_pb2.ApplyStateResponse],
        stage_pb2.ApplyStateRequest,
    ]:
        request = stage_pb2.ApplyStateRequest(job_id=job_id, apply=apply)
        if apply and step is not None:
            request.step = step
        return stub.ApplyState, request

    call_all(registry, servers, apply_request, timeout_s)
    return failure


def _route(
    frames: Iterable[common_pb2.TensorFrame],
    plan: Sequence[PipelineStage],
    index_of: dict[str, int],
    layers: Sequence[stage_pb2.LayerDescription],
    put: Callable[[int, common_pb2.TensorFrame], None],
    seen: set[str],
) -> None:
    current: tuple[str, list[int]] | None = None
    for frame in frames:
        if frame.frame_index == 0:
            layer, shape = _describe_key(frame.name, layers)
            if shape is not None and list(frame.header.shape) != shape:
                raise InvalidArgumentError(
                    f"state tensor {frame.name} has shape {list(frame.header.shape)}; "
                    f"the model's is {shape}"
                )
            if frame.name in seen:
                raise InvalidArgumentError(f"state key {frame.name!r} sent twice")
            seen.add(frame.name)
            holders = [index_of[s.address] for s in plan if s.start_layer <= layer < s.end_layer]
            current = (frame.name, holders)
        if current is None or current[0] != frame.name:
            raise InvalidArgumentError(f"frame {frame.frame_index} of {frame.name!r} alone")
        for index in current[1]:
            put(index, frame)
