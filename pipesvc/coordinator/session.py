"""A generation session as the coordinator keeps it: the tokens so far, the padding mask, the
parts its rows are split into, and what the stages have cached (no gRPC here).

[Note: generation on the coordinator] A session's rows are split into parts once (micro-batches,
so the prompt's prefill runs pipelined, and so do the decode steps of a batch of rows). Each step
is one GENERATE run: the first step, and any step after the stages lost their caches (a new plan
epoch after a recovery, an expired or released cache), sends every token so far with ``fresh``
caches; the others send only the newest token of each row, whose keys and values the stages add
to their caches. The last stage returns each row's next-token logits; the coordinator picks the
tokens (``pipesvc.core.sampling``), so a replay after a fault sees the same tokens and the same
generator state, and the client sees the tokens it would have seen without the fault. Positions
are those ``transformers``' ``generate`` uses: the running count of real tokens in the row
(``cumsum(mask) - 1``), so left-padded rows number their tokens from 0. A model without caches
gets the whole sequence every step.

[Note: chunked prefill] A long prompt runs through the stages in chunks of the job's
``prefill_chunk`` tokens (``PREFILL_CHUNK`` by default; at most ``MAX_CHUNKS`` of them), each a
micro-batch of its own, so the stages overlap: the first stage computes chunk 2 while the
second computes chunk 1, and the first token comes after about one chunk's time per stage plus
the whole prompt's time on the slowest stage, not the whole prompt's time on every stage one
after another. Chunk 1 starts the part's cache (fresh, or from a kept prefix), every later
chunk extends it (the stages run a run's micro-batches in order, so on every stage chunk ``j``
finds chunks ``1..j-1`` in the cache), with the padding mask up to its own end and its own
positions; the next token comes from the last chunk's logits. Only models whose caches have a
layout (``fuses_caches``) are chunked: the stages can cut those back if the run fails.

[Note: chunks between decode steps] A run returns when all its micro-batches have, so a session
decoding beside a long prompt would wait for the prompt's whole prefill for its next token.
When a run holds a session's decode step, every prompt in it sends only its first chunk (per
part): the run takes one chunk's time, the prompt's cache on every stage holds the columns up
to ``reach``, no token is made for it (``advance`` returns None), and its next run extends
that cache with the next chunk, beside the next decode step. With no session decoding, a
prompt sends all its chunks in one run, so they overlap across the stages. A prompt cut over
runs keeps no prefix (a kept prefix is copied from a cache's first run); a lost cache or a new
plan epoch replays it from its first column like any session.

[Note: decode steps on the stages] Between two decode steps the stages wait for the coordinator:
the last stage's reply, the next run planned and sent, the first stage's request read, several
milliseconds of thread hand-offs a step against a step's 20-60 ms of compute. When every session
of a run is decoding without log-probabilities in one micro-batch, the run
takes up to the job's ``decode_steps`` (``DECODE_STEPS`` by default) steps on the stages: the
last stage picks each row's token (for sessions that sample, see [Note: sampling on the last
stage]) and sends it back up the pipeline, on the links' gradient
direction (which generation leaves idle), each stage passing it on, and the first stage runs
the next step on it; each stage derives a step's side inputs from the first step's (the padding
mask one real column longer a step, the positions one further). The last stage returns the
tokens of every step, and the coordinator takes them one step at a time as if each had been
its own run, so the tokens, the caches and every guarantee are those of single steps: the run
takes at most as many steps as the session nearest its token limit has left, a session that
ends before the run's last step (its end-of-sequence token) drops the rest, along with its
caches, and a failed run is undone on every stage like any. Rows that finished inside a
multi-row session are fed their own next token rather than the end-of-sequence token the
coordinator reports for them: their caches differ, their tokens do not, and no row reads
another's. The cost is in when tokens reach their readers: a run's tokens arrive together.

[Note: sampling on the last stage] A run of several decode steps cannot wait for the coordinator
to sample, so the last stage samples: the run carries, per session, its rows of the micro-batch
(in the order of its parts, as the coordinator joins them), its settings and its generator's
state (``RunStepRequest.sampling``); the last stage draws each step's tokens with the very code
the coordinator uses (``Sampling.choose`` over the session's rows at once, from a generator set
to that state; ``sampling.choose_rows``) and returns each generator's state after the run. The
coordinator takes the tokens and, once the run succeeded, the states (``advance_generator``):
a session draws exactly the numbers it would have drawn in runs of one step, and a failed run
changes no state, so a replay draws them again. Sessions that ask for log-probabilities keep a
run a step (the figures need each step's logits on the coordinator).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import torch

from pipesvc.coordinator.prefixes import Prefix
from pipesvc.core.microbatch import DECODE_SIDE_INPUTS, CacheRef, MicrobatchCaches, RunBatch
from pipesvc.core.sampling import (
    RowsSampling,
    Sampling,
    TokenLogprobs,
    check_top_logprobs,
    generator_from,
    generator_state,
    token_logprobs,
)
from pipesvc.errors import InternalError, InvalidArgumentError

MAX_NEW_TOKENS = 1 << 16
"""Most tokens one session may generate."""
PREFILL_CHUNK = 256
"""Prompt tokens per chunk of a chunked prefill (see [Note: chunked prefill])."""
MAX_CHUNKS = 16
"""Chunks of one part at most: longer prompts get longer chunks."""
DECODE_STEPS = 4
"""Decode steps a run takes on the stages by default (see [Note: decode steps on the
stages])."""


@dataclass(frozen=True, slots=True)
class Made:
    """One step of a session: the new token of every row (``[B]``), and their
    log-probabilities when the session asked for them (see [Note: log-probabilities] in
    ``pipesvc.core.sampling``)."""

    tokens: torch.Tensor
    logprobs: TokenLogprobs | None = None
    more: bool = False
    """The session's next step was made already when this one was taken (a run of several
    steps makes them at once): a reader may take it without waiting."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSupport:
    """What the job's model offers generation (from a stage's Describe)."""

    kv_cache: bool
    side_inputs: tuple[str, ...]
    fuses_caches: bool = False
    """Decode steps of several sessions can share a micro-batch (see [Note: fused decode] in
    ``pipesvc.stage.compute.fused_cache``)."""
    max_positions: int = 0
    """The most positions the model takes, prompt and new tokens together (0: no limit)."""


def check_length(prompt_length: int, max_new_tokens: int, max_positions: int) -> None:
    """Refuses a session that would run past the model's positions, before any token (else it
    would fail at the first position past the end, after streaming the tokens before it).
    A left-padded prompt counts its padding: the stages' caches hold it.

    Raises:
        InvalidArgumentError: ``prompt_length + max_new_tokens`` exceeds ``max_positions``.
    """
    if max_positions and prompt_length + max_new_tokens > max_positions:
        raise InvalidArgumentError(
            f"the prompt's {prompt_length} tokens + max_new_tokens {max_new_tokens} = "
            f"{prompt_length + max_new_tokens} positions exceed the model's maximum of "
            f"{max_positions}; ask for at most {max(max_positions - prompt_length, 0)} new "
            "tokens or shorten the prompt"
        )


def check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The prompt's mask (ones when none is given), checked against the ids.

    Raises:
        InvalidArgumentError: the ids are not a non-empty ``[B, T]`` integer tensor, or the mask
            does not fit them, or a row has no token.
    """
    if input_ids.dim() != 2 or input_ids.numel() == 0 or input_ids.is_floating_point():
        raise InvalidArgumentError(
            f"input_ids of shape {list(input_ids.shape)} and dtype {input_ids.dtype}: expected a "
            "non-empty [batch, length] tensor of token ids"
        )
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if list(attention_mask.shape) != list(input_ids.shape):
        raise InvalidArgumentError(
            f"attention_mask of shape {list(attention_mask.shape)} must have the input ids' "
            f"shape {list(input_ids.shape)}"
        )
    if attention_mask.is_floating_point() or not bool(
        ((attention_mask == 0) | (attention_mask == 1)).all()
    ):
        raise InvalidArgumentError("attention_mask must be bool or integer and hold only 0 and 1")
    if not bool(attention_mask.bool().any(dim=1).all()):
        raise InvalidArgumentError("every row of the prompt needs at least one token (mask 1)")
    return attention_mask.to(torch.long)


class Session:
    """One generation session (see [Note: generation on the coordinator])."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        parts: int,
        sampling: Sampling,
        support: ModelSupport,
        eos_token_id: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        logprobs: int | None = None,
    ) -> None:
        mask = check_prompt(input_ids, attention_mask)
        if logprobs is not None:
            check_top_logprobs(logprobs)
        if bool((mask == 0).any()) and "attention_mask" not in support.side_inputs:
            raise InvalidArgumentError(
                "this model reads no attention_mask, so the prompt's rows must all have the same "
                "length (no padding)"
            )
        self.id = uuid.uuid4().hex
        self.tokens = input_ids.to(torch.long)
        self.mask = mask
        self.prompt_length = input_ids.shape[1]
        self.sampling = sampling
        self.support = support
        self.eos_token_id = eos_token_id
        self.generator = sampling.generator()
        self.logprobs = logprobs
        """How many of the most likely tokens' log-probabilities each step reports beside
        its own token's (None: no log-probabilities)."""
        self.last_logprobs: TokenLogprobs | None = None
        """The log-probabilities of the tokens ``advance`` made last (None unless asked)."""
        self.finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        self.rows = list(torch.tensor_split(torch.arange(input_ids.shape[0]), parts))
        self.cached = 0
        """Positions whose keys and values the stages hold (0: none)."""
        self.epoch: int | None = None
        """The plan epoch those caches were built in."""
        self.source: Prefix | None = None
        """A kept prefix its first run starts its cache from (see [Note: prefix index] in
        ``prefixes.py``)."""
        self.keep: Prefix | None = None
        """What of its prompt the stages keep after its first run."""
        self.prefix_epoch: int | None = None
        """The plan epoch ``source`` and ``keep`` were chosen in."""
        self.prefill_chunk = prefill_chunk
        """Prompt tokens per chunk of the prefill (0: the whole prompt at once)."""
        self.batch_parts: list[int] = []
        """The part of each micro-batch of the last ``next_batch`` (several for a chunked
        prefill, see [Note: chunked prefill])."""
        self.reach: int | None = None
        """The column the last ``next_batch``'s micro-batches ran to when they held only the
        first chunks of a prompt (see [Note: chunks between decode steps]); None when they
        ran to the sequence's end."""

    @property
    def one_row(self) -> bool:
        """One row without padding in one part: the sessions whose prompts prefixes serve."""
        return len(self.rows) == 1 and self.tokens.shape[0] == 1 and bool(self.mask.all())

    @property
    def done(self) -> bool:
        """Every row has produced its end-of-sequence token."""
        return bool(self.finished.all())

    def invalidate(self) -> None:
        """The stages hold no caches for this session: the next step replays every token
        (from the first: a prefix it was to start from may be what was lost)."""
        self.cached = 0
        self.source = None

    def decodes(self, epoch: int) -> bool:
        """Its next step is a decode step (one new position per row) in plan epoch ``epoch``."""
        return self.cached > 0 and self.epoch == epoch and self.tokens.shape[1] - self.cached == 1

    def next_batch(self, epoch: int, *, max_chunks: int = 0) -> RunBatch:
        """The run of the next step in plan epoch ``epoch``; of a prompt in chunks, only the
        first ``max_chunks`` (0: all; see [Note: chunks between decode steps])."""
        cached = self.support.kv_cache and self.cached > 0 and self.epoch == epoch
        source = self.source if self.support.kv_cache and not cached else None
        keep = self.keep if self.support.kv_cache and not cached else None
        start = self.cached if cached else source.positions if source is not None else 0
        chunks = self._chunks(start)
        self.reach = None
        if max_chunks and len(chunks) > max_chunks:
            chunks = chunks[:max_chunks]
            self.reach = chunks[-1][1]
            # A prefix is kept after the run that holds it whole: none for a prompt cut
            # over runs (the stages keep copies only of a cache's first run).
            keep = self.keep = None
        positions = (self.mask.cumsum(dim=-1) - 1).masked_fill(self.mask == 0, 0)
        side_names = set(self.support.side_inputs)
        inputs, side = [], []
        caches: list[MicrobatchCaches] = []
        self.batch_parts = []
        for part, rows in enumerate(self.rows):
            for a, b in chunks:
                self.batch_parts.append(part)
                inputs.append(self.tokens[rows, a:b].contiguous())
                entry = {}
                if "attention_mask" in side_names:
                    entry["attention_mask"] = self.mask[rows, :b].contiguous()
                if "position_ids" in side_names:
                    entry["position_ids"] = positions[rows, a:b].contiguous()
                side.append(entry)
                if not self.support.kv_cache:
                    continue
                starts = a == start and not cached
                ref = CacheRef(
                    self.id,
                    part,
                    fresh=starts,
                    rows=len(rows),
                    positions=b - a,
                    source=source.name if source is not None and starts else "",
                    source_positions=source.positions if source is not None and starts else 0,
                    keep_as=keep.name if keep is not None and starts else "",
                    keep_positions=keep.positions if keep is not None and starts else 0,
                )
                caches.append((ref,))
        return RunBatch(inputs=inputs, side=side if side_names else [], caches=caches)

    @property
    def wants_logits(self) -> bool:
        """Its steps need the last stage's logits, not only its arg-max: it samples, or it
        reports log-probabilities."""
        return not self.sampling.greedy or self.logprobs is not None

    def advance_generator(self, state: bytes) -> None:
        """Sets its generator to ``state``, where the last stage left it after a run of several
        decode steps (see [Note: sampling on the last stage]).

        Raises:
            InvalidArgumentError: not a generator state.
        """
        self.generator = generator_from(state)

    def _chunks(self, start: int) -> list[tuple[int, int]]:
        """The column ranges of the next run's micro-batches of one part: the whole rest of
        the sequence, or a long prompt in chunks (see [Note: chunked prefill])."""
        end, chunk = int(self.tokens.shape[1]), self.prefill_chunk
        if not self.support.fuses_caches or not chunk or end - start <= chunk:
            return [(start, end)]
        width = max(chunk, -(-(end - start) // MAX_CHUNKS))
        return [(a, min(a + width, end)) for a in range(start, end, width)]

    def advance(self, logits: list[torch.Tensor], epoch: int) -> torch.Tensor | None:
        """Takes the next-token logits of each part (``[rows, vocab]``, in order), or for a
        greedy session the tokens the last stage picked (``[rows]``); returns the new token of
        every row (end-of-sequence once a row has finished), or None after a run that held
        only the first chunks of its prompt (the stages cached them; no token yet)."""
        if self.reach is not None:
            self.cached, self.reach = self.reach, None
            self.epoch = epoch
            return None
        scores = torch.cat(logits, dim=0)
        if scores.dim() == 1:  # tokens the last stage chose (see [Note: decode steps on the
            # stages] and [Note: sampling on the last stage])
            chosen = scores.to(torch.long)
        else:
            chosen = self.sampling.choose(scores, self.generator)
        if self.logprobs is not None:
            self.last_logprobs = token_logprobs(scores, chosen, self.logprobs)
        if self.eos_token_id is not None:
            chosen = chosen.masked_fill(self.finished, self.eos_token_id)
            self.finished |= chosen == self.eos_token_id
        self.cached = self.tokens.shape[1]
        self.epoch = epoch
        self.tokens = torch.cat([self.tokens, chosen[:, None]], dim=1)
        self.mask = torch.cat([self.mask, torch.ones_like(chosen)[:, None]], dim=1)
        return chosen


Source = tuple[int, int, int]
"""Where a part's next-token logits come from: (micro-batch, first row, end row)."""


@dataclass(frozen=True, slots=True)
class StepRun:
    """One GENERATE run of several sessions' steps, and where each part's logits come from."""

    batch: RunBatch
    sources: list[list[Source]]
    """Per session, per part."""

    def logits(self, outputs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Each session's part logits, from the last stage's outputs of each micro-batch."""
        return [[outputs[mb][a:b] for mb, a, b in parts] for parts in self.sources]

    def steps(self, outputs: list[torch.Tensor]) -> list[list[list[torch.Tensor]]]:
        """Each session's part logits (or tokens) of each step of the run, in order (see
        [Note: decode steps on the stages]: a run of several steps returns ``[steps, rows]``
        tokens)."""
        if self.batch.decode_steps == 1:
            return [[parts] for parts in self.logits(outputs)]
        steps = self.batch.decode_steps
        if len(outputs) != 1 or outputs[0].dim() != 2 or outputs[0].shape[0] != steps:
            raise InternalError(
                f"the last stage returned {[list(o.shape) for o in outputs]} for a run of "
                f"{steps} decode steps; expected one [steps, rows] tensor of tokens (a stage "
                "built before decode steps on the stages? create the job with decode_steps=1)"
            )
        return [
            [[outputs[mb][step, a:b] for mb, a, b in parts] for step in range(steps)]
            for parts in self.sources
        ]


@dataclass(frozen=True, slots=True)
class _Part:
    session: int
    part: int
    inputs: torch.Tensor
    side: dict[str, torch.Tensor]
    caches: tuple[CacheRef, ...]


def plan_step(
    sessions: list[Session], epoch: int, *, fuse: bool = False, steps: int = 1
) -> StepRun:
    """The run of one step of each of ``sessions`` in plan epoch ``epoch``: each part is a
    micro-batch, or with ``fuse`` the parts that start their caches (prompts, replays) share
    one micro-batch and the parts that extend theirs by one position share another (see
    [Note: fused decode] in ``pipesvc.stage.compute.fused_cache``). Up to ``steps`` steps
    when every part decodes in one micro-batch and none asks for log-probabilities (see
    [Note: decode steps on the stages])."""
    alone: list[_Part] = []
    starting: list[_Part] = []
    extending: list[_Part] = []
    sources: list[list[Source]] = []
    # See [Note: chunks between decode steps].
    max_chunks = 1 if any(s.decodes(epoch) for s in sessions) else 0
    for index, session in enumerate(sessions):
        batch = session.next_batch(epoch, max_chunks=max_chunks)
        chunked = len(batch.inputs) > len(session.rows)
        sources.append([(0, 0, 0)] * len(session.rows))
        for mb, part in enumerate(session.batch_parts):
            entry = _Part(
                index,
                part,
                batch.inputs[mb],
                batch.side[mb] if batch.side else {},
                batch.caches[mb] if batch.caches else (),
            )
            if (
                not fuse
                or not entry.caches
                or chunked  # chunks go in order, each alone (see [Note: chunked prefill])
                or entry.caches[0].source
                or entry.caches[0].keep_as
            ):
                alone.append(entry)  # a prefix to start from or keep: one row, its own
            elif entry.caches[0].fresh:
                starting.append(entry)
            elif entry.inputs.shape[1] == 1:
                extending.append(entry)
            else:
                alone.append(entry)
    groups = [[entry] for entry in alone] + [g for g in (starting, extending) if g]
    inputs, side = [], []
    caches: list[MicrobatchCaches] = []
    for mb, group in enumerate(groups):
        row = 0
        for entry in group:
            sources[entry.session][entry.part] = (mb, row, row + entry.inputs.shape[0])
            row += entry.inputs.shape[0]
        width = max(e.inputs.shape[1] for e in group)
        inputs.append(torch.cat([_left_pad(e.inputs, width) for e in group]))
        side.append(_fused_side([e.side for e in group], width))
        caches.append(tuple(ref for e in group for ref in e.caches))
    has_side = any(side)
    has_caches = any(caches)
    greedy = not any(s.wants_logits for s in sessions)
    sampling: list[RowsSampling] = []
    if (
        steps > 1
        and all(s.logprobs is None for s in sessions)
        and len(groups) == 1
        and not starting
        and all(_extends(entry) for entry in groups[0])
        and {name for entry in side for name in entry} <= DECODE_SIDE_INPUTS
    ):
        caches = [tuple(dataclasses.replace(ref, positions=steps) for ref in caches[0])]
        if not greedy:  # see [Note: sampling on the last stage]
            sampling = [
                RowsSampling(
                    tuple((a, b) for _, a, b in parts),
                    s.sampling,
                    b"" if s.sampling.greedy else generator_state(s.generator),
                )
                for s, parts in zip(sessions, sources, strict=True)
            ]
    else:
        steps = 1
    batch = RunBatch(
        inputs=inputs,
        side=side if has_side else [],
        caches=caches if has_caches else [],
        greedy=greedy,
        decode_steps=steps,
        sampling=sampling,
    )
    return StepRun(batch, sources)


def _extends(entry: _Part) -> bool:
    """A part that extends its cache by one position and keeps no prefix."""
    if len(entry.caches) != 1 or entry.inputs.shape[1] != 1:
        return False
    ref = entry.caches[0]
    return not ref.fresh and not ref.keep_as and not ref.source


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (``[rows, w]``) with zeros before its columns, ``width`` wide."""
    return torch.nn.functional.pad(t, (width - t.shape[1], 0)) if t.shape[1] < width else t


def _fused_side(sides: list[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    """The side inputs of parts fused into one micro-batch ``width`` new positions wide: rows
    one after another, ``position_ids`` left-padded with zeros to ``width`` and
    ``attention_mask`` left-padded with zeros to the widest (their caches are stacked the same
    way on the stages)."""
    if len(sides) == 1:
        return sides[0]
    fused = {}
    for name in sides[0]:
        tensors = [s[name] for s in sides]
        if name == "attention_mask":
            widest = max(t.shape[1] for t in tensors)
            tensors = [_left_pad(t, widest) for t in tensors]
        elif name == "position_ids":
            tensors = [_left_pad(t, width) for t in tensors]
        fused[name] = torch.cat(tensors)
    return fused
