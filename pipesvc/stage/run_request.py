"""The parts of a run request a stage checks before it runs anything: the commit it carries
and the generation caches of its micro-batches (no gRPC here)."""

from __future__ import annotations

from pipesvc.core.limits import MAX_DECODE_STEPS, MAX_MICROBATCHES
from pipesvc.core.microbatch import DECODE_SIDE_INPUTS, CacheRef, MicrobatchCaches
from pipesvc.core.sampling import RowsSampling, Sampling, check_rows, generator_from
from pipesvc.errors import InvalidArgumentError
from pipesvc.stage.compute.engine import Carried
from pipesvc.v1 import stage_pb2


def carried_commit(request: stage_pb2.RunStepRequest) -> Carried | None:
    """The commit a RunStep carries, if any.

    Raises:
        InvalidArgumentError: it has both a scale and ``scale_from_links``.
    """
    if not request.HasField("commit"):
        return None
    carried = request.commit
    scale = carried.grad_scale if carried.HasField("grad_scale") else None
    if scale is not None and carried.scale_from_links:
        raise InvalidArgumentError(
            f"the commit of run {carried.run_id} has grad_scale {scale!r} and scale_from_links;"
            " expected at most one"
        )
    return Carried(
        run_id=carried.run_id,
        grad_scale=scale,
        snapshot=carried.snapshot,
        scale_from_links=carried.scale_from_links,
    )


def cache_refs(
    request: stage_pb2.RunStepRequest, m: int, generating: bool
) -> list[MicrobatchCaches]:
    """The caches of each micro-batch of a run request, checked.

    Raises:
        InvalidArgumentError: caches outside GENERATE, not one entry per micro-batch, a bad
            session id, a part named twice other than as a chunked prefill (later micro-batches
            of their own extending it, see [Note: chunked prefill] in
            ``pipesvc.coordinator.session``), or a fused micro-batch that mixes parts
            starting and extending caches.
    """
    if len(request.caches) not in ((0, m) if generating else (0,)):
        raise InvalidArgumentError(
            f"caches for {len(request.caches)} micro-batches in mode {request.mode}; "
            f"expected {'0 or ' + str(m) if generating else 0}"
        )
    seen: set[tuple[str, int]] = set()
    caches: list[MicrobatchCaches] = []
    steps = max(request.decode_steps, 1)  # an extending part adds a position a step
    for index, entry in enumerate(request.caches):
        if not 1 <= len(entry.refs) <= MAX_MICROBATCHES:
            raise InvalidArgumentError(
                f"micro-batch {index} names {len(entry.refs)} caches; expected 1 to "
                f"{MAX_MICROBATCHES}"
            )
        fused = len(entry.refs) > 1
        for ref in entry.refs:
            if not 1 <= len(ref.session) <= 128:
                raise InvalidArgumentError(
                    f"session id of {len(ref.session)} characters; expected 1 to 128"
                )
            if (ref.session, ref.part) in seen and (ref.fresh or fused or ref.keep_as):
                raise InvalidArgumentError(
                    f"session {ref.session!r} part {ref.part} is named twice in one run, the "
                    "second time starting its cache, fused or keeping a prefix; a part named "
                    "again extends it alone"
                )
            seen.add((ref.session, ref.part))
            check_prefix_ref(ref, fused=fused)
        fresh = {ref.fresh for ref in entry.refs}
        if fused and (
            len(fresh) > 1
            or any(r.rows == 0 or r.positions == 0 for r in entry.refs)
            or (fresh == {False} and any(r.positions != steps for r in entry.refs))
        ):
            raise InvalidArgumentError(
                f"micro-batch {index} fuses {len(entry.refs)} caches; expected all starting "
                f"(fresh) or all extending by {steps} position(s), each over rows > 0 adding "
                "positions > 0; got (fresh, rows, positions) "
                + str([(r.fresh, r.rows, r.positions) for r in entry.refs])
            )
        caches.append(
            tuple(
                CacheRef(
                    r.session,
                    r.part,
                    r.fresh,
                    r.rows,
                    r.positions,
                    r.source,
                    r.source_positions,
                    r.keep_as,
                    r.keep_positions,
                )
                for r in entry.refs
            )
        )
    return caches


def decode_steps(
    request: stage_pb2.RunStepRequest, caches: list[MicrobatchCaches], first: bool, last: bool
) -> int:
    """The decode steps a run request asks for (see [Note: decode steps on the stages] in
    ``pipesvc.coordinator.session``), checked; 1 when it asks for none.

    Raises:
        InvalidArgumentError: more than ``MAX_DECODE_STEPS``, or several steps in a run that
            is not one GENERATE micro-batch of caches that each add a position a step (none
            starting, none keeping a prefix), greedy or sampled as ``sampling`` says, with side
            inputs other than the padding mask and positions, or (first stage) inputs other
            than one token per row.
    """
    steps = max(request.decode_steps, 1)
    if steps == 1:
        return 1
    refs = caches[0] if len(caches) == 1 else ()
    names = {n for entry in request.side_inputs for n in entry.tensors}
    inputs = request.inputs[0].header.shape if first and len(request.inputs) == 1 else None
    if (
        steps > MAX_DECODE_STEPS
        or request.mode != stage_pb2.GENERATE
        or (last and request.greedy == bool(request.sampling))
        or request.num_microbatches != 1
        or not refs
        or any(r.fresh or r.keep_as or r.positions != steps for r in refs)
        or not names <= DECODE_SIDE_INPUTS
        or (first and (inputs is None or len(inputs) != 2 or inputs[1] != 1))
    ):
        raise InvalidArgumentError(
            f"decode_steps ({steps}) must be at most {MAX_DECODE_STEPS}, and above 1 only in "
            "a GENERATE run of one micro-batch, greedy or with sampling for its sessions, "
            "whose caches each extend by that many positions, with side inputs among "
            f"{sorted(DECODE_SIDE_INPUTS)} and one input token per row; got mode "
            f"{request.mode}, greedy {request.greedy} with {len(request.sampling)} "
            f"sampling entries, {request.num_microbatches} "
            f"micro-batch(es), caches {[(r.fresh, r.positions) for r in refs]}, side inputs "
            f"{sorted(names)}"
        )
    return steps


def step_sampling(
    request: stage_pb2.RunStepRequest, caches: list[MicrobatchCaches], steps: int
) -> list[RowsSampling]:
    """How the last stage picks each session's tokens in a run of several decode steps (see
    [Note: sampling on the last stage] in ``pipesvc.coordinator.session``), checked; empty
    when greedy.

    Raises:
        InvalidArgumentError: sampling in a run of one step, settings out of range, a
            generator state that does not load, or row ranges that do not cover the
            micro-batch's rows once.
    """
    if not request.sampling:
        return []
    if steps == 1:
        raise InvalidArgumentError(
            f"sampling for {len(request.sampling)} sessions in a run of one step; the "
            "coordinator samples those"
        )
    plans = []
    for entry in request.sampling:
        sampling = Sampling(
            temperature=entry.temperature,
            top_k=entry.top_k or None,
            top_p=entry.top_p or None,
        )
        rows = tuple((r.start, r.end) for r in entry.rows)
        if not sampling.greedy:
            generator_from(entry.generator_state)  # loads, or says why not
        elif entry.generator_state:
            raise InvalidArgumentError("a greedy session's sampling carries a generator state")
        plans.append(RowsSampling(rows, sampling, entry.generator_state))
    check_rows(plans, sum(ref.rows for ref in caches[0]))
    return plans


def check_prefix_ref(ref: stage_pb2.CacheRef, *, fused: bool) -> None:
    """A cache reference's prefix fields (see [Note: prefix reuse] in
    pipesvc.stage.compute.sessions).

    Raises:
        InvalidArgumentError: a prefix name over 128 characters, a source on a cache that is
            not fresh, or a prefix over several rows, in a fused micro-batch or of 0 positions.
    """
    for name, positions, what in (
        (ref.source, ref.source_positions, "source"),
        (ref.keep_as, ref.keep_positions, "keep_as"),
    ):
        if not name:
            continue
        if len(name) > 128 or positions == 0 or ref.rows != 1 or fused:
            raise InvalidArgumentError(
                f"session {ref.session!r} part {ref.part}: {what} {name[:32]!r} of "
                f"{len(name)} characters at {positions} positions over {ref.rows} row(s)"
                f"{' in a fused micro-batch' if fused else ''}; expected a name of 1 to 128 "
                "characters, positions > 0, one row, not fused"
            )
    if ref.source and not ref.fresh:
        raise InvalidArgumentError(
            f"session {ref.session!r} part {ref.part} names source {ref.source!r} but is not "
            "fresh: only a starting cache starts from a prefix"
        )
