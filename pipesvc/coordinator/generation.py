"""A job's text generation: its sessions, their steps through the job's batcher, the model's
support for caches, and releasing a session's caches (see [Note: generation on the
coordinator] in ``session.py`` and [Note: continuous batching] in ``batcher.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

import torch

from pipesvc.coordinator.batcher import StepBatcher, TokenStream
from pipesvc.coordinator.prefixes import PrefixIndex
from pipesvc.coordinator.replicas import RunReplies
from pipesvc.coordinator.session import (
    DECODE_STEPS,
    MAX_NEW_TOKENS,
    PREFILL_CHUNK,
    Made,
    ModelSupport,
    Session,
    check_length,
    plan_step,
)
from pipesvc.coordinator.stage_calls import call_stage
from pipesvc.coordinator.stage_group import StageGroup
from pipesvc.core.config import JobConfig
from pipesvc.core.microbatch import RunBatch
from pipesvc.core.sampling import Sampling
from pipesvc.core.tensor_codec import decode
from pipesvc.errors import (
    InternalError,
    InvalidArgumentError,
    PipesvcError,
    SessionCacheLostError,
)
from pipesvc.observe.metrics import Metrics
from pipesvc.v1 import stage_pb2

logger = logging.getLogger(__name__)

Resilient = Callable[[Callable[[], Any], str], Any]
"""Runs an attempt under the job's lock, recovering from lost stages and retrying."""
RunPhase = Callable[
    [stage_pb2.RunMode.ValueType, RunBatch, Callable[[], None]], tuple[int, RunReplies]
]
"""One run on the job's stages (carrying its pending commit), calling the last argument once
the stages have it."""


class JobGeneration:
    """The generation sessions of one job."""

    def __init__(
        self,
        *,
        job_id: str,
        config: JobConfig,
        group: StageGroup,
        resilient: Resilient,
        run: RunPhase,
        metrics: Metrics,
        orphans: bool = False,
    ) -> None:
        self._job_id = job_id
        self._config = config
        self._group = group
        self._resilient = resilient
        self._run = run
        self._metrics = metrics
        self._support: ModelSupport | None = None
        self._orphans = orphans
        """The stages may hold caches of sessions that ended with a previous coordinator."""
        self.batcher = StepBatcher(
            self._steps,
            on_token=self._count_token,
            steps=DECODE_STEPS if config.decode_steps is None else config.decode_steps,
            release=self._release_session,
            evict=self._evict,
        )
        self.prefixes = PrefixIndex()
        """The prompt prefixes the stages keep (see [Note: prefix index] in prefixes.py)."""
        self._prefix_lock = threading.Lock()

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        *,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        logprobs: int | None = None,
        on_open: Callable[[Callable[[], None]], None] | None = None,
    ) -> Generator[Made, None, None]:
        """Generates up to ``max_new_tokens`` tokens after the prompt from the job's committed
        weights; yields each step's new token of every row (``[B]``) as it is made (see
        [Note: generation on the coordinator]), with their log-probabilities and those of
        the ``logprobs`` most likely tokens when ``logprobs`` is given (see
        [Note: log-probabilities] in ``pipesvc.core.sampling``). Each step holds the job for
        one run only, so training steps and other sessions go in between. The session's
        caches are released on every stage when the iterator ends or is closed. ``on_open``
        gets, once the session is open, a function that any thread may call when its reader is
        gone: the session takes no further step and a wait in the iterator ends.

        Raises:
            InvalidArgumentError: the prompt, the mask or the sampling settings do not fit.
            ResourceExhaustedError: a stage's KV budget would be exceeded.
        """
        if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidArgumentError(
                f"max_new_tokens ({max_new_tokens}) must be in [1, {MAX_NEW_TOKENS}]"
            )
        parts = min(
            self._config.num_microbatches, int(input_ids.shape[0]) if input_ids.dim() else 1
        )
        support = self._model_support()
        if input_ids.dim() == 2:  # other shapes are refused by Session, with what is expected
            check_length(int(input_ids.shape[1]), max_new_tokens, support.max_positions)
        session = Session(
            input_ids,
            attention_mask,
            parts=max(1, parts),
            sampling=sampling,
            support=support,
            eos_token_id=eos_token_id,
            prefill_chunk=(
                PREFILL_CHUNK if self._config.prefill_chunk is None else self._config.prefill_chunk
            ),
            logprobs=logprobs,
        )
        self._metrics.inc("generation_sessions_total")
        stream = self.batcher.open(session, max_new_tokens)
        try:
            if on_open is not None:
                on_open(lambda: self._leave(stream))
            while (made := self.batcher.next(stream)) is not None:
                yield made
        finally:
            self.batcher.close(stream)  # and drops its caches on every stage

    def _leave(self, stream: TokenStream) -> None:
        if self.batcher.leave(stream):
            logger.info(
                "job %s: a session's client went away after %d of its tokens; it takes no "
                "further step",
                self._job_id,
                stream.steps,
            )

    def _count_token(self, first: bool, seconds: float, rows: int) -> None:
        name = "time_to_first_token_seconds" if first else "time_per_output_token_seconds"
        self._metrics.observe(name, seconds)
        self._metrics.inc("generated_tokens_total", float(rows))

    def _steps(
        self, sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        """Up to ``most`` steps of every session in one GENERATE run (see [Note: continuous
        batching], and [Note: decode steps on the stages] in session.py for more than one),
        recovering from lost stages like any run; ``during`` is called once the stages have
        it. Per session: each step's part logits (or tokens), and the plan epoch."""
        result: list[tuple[list[list[torch.Tensor]], int]] = self._resilient(
            lambda: self._generate_once(sessions, during, most), "generation step"
        )
        return result

    def _generate_once(
        self, sessions: list[Session], during: Callable[[], None], most: int
    ) -> list[tuple[list[list[torch.Tensor]], int]]:
        epoch = self._group.epoch
        # One decode micro-batch: it costs about the same for 1 row as for many (the weights
        # are read either way), so splitting it to overlap the stages costs more than it saves.
        fuse = self._model_support().fuses_caches
        self.release_orphans()
        for session in sessions:
            self._choose_prefixes(session, epoch)
        while True:
            run = plan_step(sessions, epoch, fuse=fuse, steps=most)
            try:
                _, replies = self._run(stage_pb2.GENERATE, run.batch, during)
                break
            except SessionCacheLostError as exc:
                # A stage no longer holds these sessions (idle too long, or released), and
                # every stage put the run's sessions back as they were (see [Note: session
                # runs] in ``pipesvc.stage.compute.sessions``): they replay their tokens, the others
                # take their step as planned. Each session replays at most once here.
                lost = [s for s in sessions if s.id in exc.sessions and (s.cached or s.source)]
                if not lost:
                    raise
                for session in lost:
                    if session.source is not None:  # a stage may have dropped the prefix
                        with self._prefix_lock:
                            self.prefixes.forget(session.source.name)
                    logger.info(
                        "job %s: session %s lost its caches; replaying its tokens",
                        self._job_id,
                        session.id,
                    )
                    session.invalidate()
                    self._metrics.inc("generation_replays_total")
        self._prefixes_after(sessions, epoch)
        outputs = [decode(t) for t in replies.outputs]
        taken = run.steps(outputs)
        if run.batch.sampling:  # see [Note: sampling on the last stage] in session.py
            states = list(replies.by_replica[0][-1].generator_states)
            if len(states) != len(sessions):
                raise InternalError(
                    f"the last stage returned {len(states)} generator states for a run of "
                    f"{len(sessions)} sampling sessions"
                )
            for session, state in zip(sessions, states, strict=True):
                if not session.sampling.greedy:
                    session.advance_generator(state)
        return [(steps, epoch) for steps in taken]

    def _choose_prefixes(self, session: Session, epoch: int) -> None:
        """Chooses, before each run of plan epoch ``epoch`` until a session's first run is
        done, the kept prefix it starts from and what of its prompt to keep. Chosen again when
        the epoch changed before that run (a recovery): the stages of the new plan hold no
        prefix of the old one, and may hold one kept since."""
        if session.cached or session.prefix_epoch == epoch:
            return
        if not (session.support.fuses_caches and session.one_row):
            return  # only caches that can be cut and copied, of one-row prompts
        with self._prefix_lock:
            session.source = self.prefixes.find(session.tokens[0], epoch)
            session.keep = self.prefixes.to_keep(session.tokens[0], epoch)
        session.prefix_epoch = epoch

    def _prefixes_after(self, sessions: list[Session], epoch: int) -> None:
        """After a run: counts the sessions that started from a kept prefix, and indexes the
        prefixes the stages kept (releasing on the stages those it pushes out)."""
        evicted: list[str] = []
        for session in sessions:
            if session.cached:  # not its first run: no prefix in it
                continue
            if session.source is not None:
                self._metrics.inc("prefix_hits_total")
                self._metrics.inc("prefix_tokens_reused_total", float(session.source.positions))
                session.source = None
            if session.keep is not None:
                with self._prefix_lock:
                    evicted += self.prefixes.kept(session.tokens[0], session.keep, epoch)
                session.keep = None
        for name in evicted:
            self._release(name)

    def _model_support(self) -> ModelSupport:
        """Whether the model keeps caches and which side inputs it reads (asked once)."""
        if self._support is None:
            reply = call_stage(
                self._group.registry,
                self._group.plan[0],
                lambda stub: stub.Describe,
                stage_pb2.DescribeRequest(
                    model=self._config.model, model_args_json=self._config.model_args_json()
                ),
                self._group.deadlines.control_s,
            )
            self._support = ModelSupport(
                kv_cache=reply.kv_cache,
                side_inputs=tuple(reply.side_inputs),
                fuses_caches=reply.fuses_caches,
                max_positions=reply.max_positions,
            )
        return self._support

    def release_orphans(self) -> None:
        """After a coordinator restart, once, before any run of this coordinator's sessions (on
        the job's lock): drops every session's caches on the stages, orphans of the sessions
        that ended with the old coordinator, which would hold the KV budgets until they expire.

        Raises:
            PipesvcError: a stage could not be told (tried again on the next call).
        """
        if not self._orphans:
            return
        request = stage_pb2.ReleaseSessionRequest(job_id=self._job_id, all_sessions=True)
        replies = self._group.call_all(
            lambda stub: stub.ReleaseSession, lambda _: request, self._group.deadlines.control_s
        )
        self._orphans = False
        freed = sum(r.freed_bytes for r in replies)
        if freed:
            logger.info(
                "job %s: released orphaned sessions' caches (%d bytes)", self._job_id, freed
            )

    def _evict(self, session: Session) -> None:
        """Drops a waiting session's caches on every stage, so that it replays its tokens when
        it goes on (see [Note: waiting for room] in batcher.py)."""
        self._release(session.id)
        session.invalidate()
        self._metrics.inc("generation_evictions_total")

    def _release_session(self, session: Session) -> None:
        """Drops the session's caches on every stage of the plan (best effort: a stage that
        is gone or busy drops them when they expire)."""
        self._release(session.id)

    def _release(self, name: str) -> None:
        """Drops a session's caches, or a kept prefix, on every stage of the plan (best
        effort)."""
        request = stage_pb2.ReleaseSessionRequest(job_id=self._job_id, session=name)
        for stage in list(self._group.servers):
            try:
                call_stage(
                    self._group.registry,
                    stage,
                    lambda stub: stub.ReleaseSession,
                    request,
                    self._group.deadlines.health_s,
                )
            except PipesvcError as exc:
                logger.info(
                    "job %s: session %s not released on %s: %s",
                    self._job_id,
                    name,
                    stage.address,
                    exc,
                )
