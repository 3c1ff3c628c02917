"""A job's configuration by concern: each section a frozen dataclass that checks its own fields.

[Note: configuration sections] ``JobConfig`` is the flat record a user writes, the wire carries
and the state database keeps: one keyword per setting, as ``create_job`` takes them. Its checks
live here, one section per concern, each of which can be read off a config
(``Parallelism.of(config)``) and passed on alone:

- ``ModelSpec``: which model, built how, fed what, training which parameters;
- ``Parallelism``: stages, micro-batches, schedule, replicas and how layers are cut;
- ``Optimization``: loss, optimizer and gradient clipping;
- ``Checkpointing``: how often a checkpoint is taken;
- ``Numerics``: the compute precision and the codecs between hosts;
- ``Serving``: the job's name and how long prompts are cut.

Every field of ``JobConfig`` belongs to exactly one section (a test checks it), and
``JobConfig.__post_init__`` builds each section once, in this order, so the first check that
fails names its value. No gRPC here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from pipesvc.core.limits import MAX_DECODE_STEPS, MAX_MICROBATCHES
from pipesvc.core.loss import check_loss
from pipesvc.core.model_args import INPUT_DTYPES, MAX_INPUT_DIMS, check_model_args
from pipesvc.core.optim import check_optimizer
from pipesvc.core.planning.partition import get_partition
from pipesvc.core.schedule import check_virtual_stages, get_schedule
from pipesvc.errors import InvalidArgumentError

_MODEL_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
"""A job's name: what HTTP clients pass as ``model`` (``meta-llama/Llama-3.2-1B`` fits)."""

MAX_TRAINABLE_PATTERNS = 256
MAX_REPLICAS = 64
"""Most replicas a job's pipeline may have."""
MAX_VIRTUAL_STAGES = 16
"""Most layer ranges one stage may hold."""
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
"""How a job's layers compute and store numbers (``JobConfig.precision``)."""
WIRE_DTYPES = ("bfloat16", "float16", "int8", "int4")
"""Codecs activations and gradients may cross links in (``JobConfig.wire_dtype``): two float
dtypes and two blockwise quantizations (see [Note: blockwise quantization] in
``pipesvc.core.quant``)."""
WIRE_AUTO = "auto"
"""``JobConfig.wire_dtype`` that compresses only the links between hosts that are the
bottleneck, by measurement (see [Note: automatic codecs] in ``pipesvc.core.link_codecs``)."""
WIRE_ROLES = ("activations", "gradients")
"""What crosses a link: the forward's activations and the backward's gradients."""


def _check_ints(section: object, names: tuple[str, ...], *, optional: tuple[str, ...] = ()) -> None:
    for name in names:
        value = getattr(section, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be an int; got {value!r}")


S = TypeVar("S", bound="_Section")


class _Section:
    """What every section shares: being read off a ``JobConfig`` (or any object with its
    fields)."""

    __slots__ = ()

    @classmethod
    def of(cls: type[S], config: object) -> S:
        """This section of ``config``, checked.

        Raises:
            InvalidArgumentError: a field of this section is invalid.
        """
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: getattr(config, name) for name in names})


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec(_Section):
    """Which model, built how, fed what, and which of its parameters train."""

    model: str
    model_args: Mapping[str, Any]
    seed: int
    input_shape: tuple[int, ...] | None
    input_dtype: str
    trainable: tuple[str, ...] | None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not _MODEL_NAME.fullmatch(self.model):
            raise InvalidArgumentError(
                f"model {self.model!r} is not a model name; expected a registered name such as "
                "'gpt' (module and file paths are never accepted)"
            )
        check_model_args(self.model_args)
        _check_ints(self, ("seed",))
        if not 0 <= self.seed < 2**63:
            raise InvalidArgumentError(f"seed ({self.seed}) must be in [0, 2**63)")
        self._check_input()
        if self.trainable is not None and not (
            isinstance(self.trainable, tuple)
            and 1 <= len(self.trainable) <= MAX_TRAINABLE_PATTERNS
            and all(isinstance(g, str) and 1 <= len(g) <= 256 for g in self.trainable)
        ):
            raise InvalidArgumentError(
                f"trainable ({self.trainable!r}) must be 1 to {MAX_TRAINABLE_PATTERNS} glob "
                "patterns of 1 to 256 characters over parameter names, e.g. ('*.mlp.*',)"
            )

    def _check_input(self) -> None:
        if self.input_dtype not in INPUT_DTYPES:
            raise InvalidArgumentError(
                f"input_dtype {self.input_dtype!r} is not supported; expected one of "
                f"{', '.join(INPUT_DTYPES)}"
            )
        if self.input_shape is None:
            return
        shape = self.input_shape
        if (
            not isinstance(shape, tuple)
            or not 1 <= len(shape) <= MAX_INPUT_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
            or math.prod(shape) > 2**40
        ):
            raise InvalidArgumentError(
                f"input_shape {shape!r} must be a tuple of 1 to {MAX_INPUT_DIMS} positive ints "
                "(batch dimension first) of at most 2**40 elements"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Serving(_Section):
    """What generation and the HTTP API need: the job's name, how long prompts are cut and how
    many decode steps a run takes."""

    name: str | None
    prefill_chunk: int | None
    decode_steps: int | None

    def __post_init__(self) -> None:
        if self.name is not None and not (
            isinstance(self.name, str) and _JOB_NAME.fullmatch(self.name)
        ):
            raise InvalidArgumentError(
                f"job name {self.name!r} is not a name; expected 1 to 128 letters, digits and "
                "'._:/-', starting with a letter or digit (e.g. 'my-llama')"
            )
        counts = ("prefill_chunk", "decode_steps")
        _check_ints(self, counts, optional=counts)
        if self.decode_steps is not None and not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise InvalidArgumentError(
                f"decode_steps ({self.decode_steps}) must be in [1, {MAX_DECODE_STEPS}] steps "
                "per run (1: one step per run)"
            )
        if self.prefill_chunk is not None and not 0 <= self.prefill_chunk <= 2**20:
            raise InvalidArgumentError(
                f"prefill_chunk ({self.prefill_chunk}) must be in [0, 2**20] tokens (0: whole "
                "prompts)"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism(_Section):
    """How the model is spread: stages, micro-batches, schedule, replicas, virtual stages, and
    how the layers are cut and re-cut."""

    num_stages: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    data_parallel: int
    min_replicas: int | None
    partition: str
    rebalance: bool

    def __post_init__(self) -> None:
        if not isinstance(self.rebalance, bool):
            raise InvalidArgumentError(f"rebalance must be a bool; got {self.rebalance!r}")
        _check_ints(
            self,
            ("num_stages", "num_microbatches", "data_parallel", "min_replicas", "virtual_stages"),
            optional=("min_replicas",),
        )
        if not 1 <= self.num_stages <= 1024:
            raise InvalidArgumentError(f"num_stages ({self.num_stages}) must be in [1, 1024]")
        self._check_replicas()
        if not 1 <= self.num_microbatches <= MAX_MICROBATCHES:
            raise InvalidArgumentError(
                f"num_microbatches ({self.num_microbatches}) must be in [1, {MAX_MICROBATCHES}]"
            )
        get_schedule(self.schedule)
        self._check_virtual_stages()
        get_partition(self.partition)

    @property
    def step_microbatches(self) -> int:
        """Micro-batches a training step is cut into: ``num_microbatches`` per replica."""
        return self.num_microbatches * self.data_parallel

    @property
    def total_stages(self) -> int:
        """Stages the job takes: ``num_stages`` per replica."""
        return self.num_stages * self.data_parallel

    def _check_replicas(self) -> None:
        if not 1 <= self.data_parallel <= MAX_REPLICAS:
            raise InvalidArgumentError(
                f"data_parallel ({self.data_parallel}) must be in [1, {MAX_REPLICAS}]"
            )
        if self.total_stages > 1024:
            raise InvalidArgumentError(
                f"num_stages x data_parallel ({self.num_stages} x {self.data_parallel}) must be "
                "at most 1024 stages"
            )
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.data_parallel:
            raise InvalidArgumentError(
                f"min_replicas ({self.min_replicas}) must be in [1, data_parallel "
                f"({self.data_parallel})] or None"
            )
        if self.data_parallel > 1 and (self.partition == "throughput" or self.rebalance):
            raise InvalidArgumentError(
                f"partition {self.partition!r} with rebalance={self.rebalance} and "
                f"data_parallel ({self.data_parallel}): re-planning a replicated job is not "
                "supported; use partition 'parameters', 'uniform' or 'memory' without rebalance"
            )

    def _check_virtual_stages(self) -> None:
        check_virtual_stages(self.schedule, self.virtual_stages)
        if self.virtual_stages == 1:
            return
        if self.virtual_stages > MAX_VIRTUAL_STAGES:
            raise InvalidArgumentError(
                f"virtual_stages ({self.virtual_stages}) must be at most {MAX_VIRTUAL_STAGES}"
            )
        if self.num_stages < 2:
            raise InvalidArgumentError(
                f"virtual_stages ({self.virtual_stages}) needs num_stages >= 2 (the chunks of "
                f"one stage feed each other through the next stage); got {self.num_stages}"
            )
        if self.num_microbatches * self.virtual_stages > MAX_MICROBATCHES:
            raise InvalidArgumentError(
                f"num_microbatches x virtual_stages ({self.num_microbatches} x "
                f"{self.virtual_stages}) must be at most {MAX_MICROBATCHES}"
            )
        if self.partition not in ("parameters", "uniform") or self.rebalance:
            raise InvalidArgumentError(
                f"partition {self.partition!r} (rebalance={self.rebalance}) with virtual_stages "
                f"({self.virtual_stages}): interleaved plans are cut by 'parameters' or "
                "'uniform', without rebalance"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Checkpointing(_Section):
    """How often the job's state is checkpointed (see [Note: checkpoint cadence])."""

    checkpoint_every: int | None

    def __post_init__(self) -> None:
        _check_ints(self, ("checkpoint_every",), optional=("checkpoint_every",))
        if self.checkpoint_every is not None and not 0 <= self.checkpoint_every < 2**31:
            raise InvalidArgumentError(
                f"checkpoint_every ({self.checkpoint_every}) must be in [0, 2**31)"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Optimization(_Section):
    """What a step minimizes and how: the loss, the optimizer and gradient clipping."""

    loss: str
    optimizer: Mapping[str, Any]
    clip_grad_norm: float | None

    def __post_init__(self) -> None:
        check_loss(self.loss)
        if not isinstance(self.optimizer, Mapping):
            raise InvalidArgumentError(f"optimizer must be a mapping; got {self.optimizer!r}")
        check_optimizer(self.optimizer)
        if self.clip_grad_norm is not None and not (
            isinstance(self.clip_grad_norm, int | float)
            and not isinstance(self.clip_grad_norm, bool)
            and math.isfinite(self.clip_grad_norm)
            and self.clip_grad_norm > 0
        ):
            raise InvalidArgumentError(
                f"clip_grad_norm ({self.clip_grad_norm!r}) must be a positive finite number"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Numerics(_Section):
    """How numbers are kept and sent: the compute precision and the codecs between hosts.
    ``wire_dtype`` is canonical once built (``canonical_wire``)."""

    precision: str
    wire_dtype: str | Mapping[str, str | None] | None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InvalidArgumentError(
                f"precision {self.precision!r} is not supported; expected one of "
                f"{', '.join(PRECISIONS)}"
            )
        object.__setattr__(self, "wire_dtype", canonical_wire(self.wire_dtype))
        if self.precision != "fp32" and "float16" in self.wire_codecs:
            raise InvalidArgumentError(
                f"wire_dtype {self.wire_dtype!r} with precision {self.precision!r}: the bf16 "
                "precisions cannot send float16 (its 5 exponent bits would clip bfloat16 "
                "values); use 'bfloat16', 'int8' or 'int4'"
            )

    @property
    def wire_codecs(self) -> tuple[str | None, str | None]:
        """(activations, gradients): the codec each crosses links in, None for exact (the
        compute dtype; under the bf16 precisions that is bfloat16, so never None). Under
        ``"auto"``, the exact ones: what a link has until its plan fixes its codecs."""
        return wire_codecs(self.precision, self.wire_dtype)


SECTIONS: tuple[type[_Section], ...] = (
    ModelSpec,
    Serving,
    Parallelism,
    Checkpointing,
    Optimization,
    Numerics,
)
"""Every section, in the order a config's checks run."""


def canonical_wire(value: object) -> str | None:
    """``JobConfig.wire_dtype`` in its text form (a name, or ``activations=..,gradients=..``).

    Raises:
        InvalidArgumentError: an unknown codec or role, or a value of the wrong type.
    """
    expected = (
        f"expected one of {', '.join(WIRE_DTYPES)}, {WIRE_AUTO!r} or None, or a mapping of "
        f"{WIRE_ROLES}"
    )
    if value is None:
        return None
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in WIRE_ROLES)
        if unknown:
            raise InvalidArgumentError(
                f"wire_dtype has no role {unknown[0]!r}; the roles are {', '.join(WIRE_ROLES)}"
            )
        roles = tuple(value.get(r) for r in WIRE_ROLES)
        for codec in roles:
            if codec is not None and codec not in WIRE_DTYPES:
                raise InvalidArgumentError(
                    f"wire_dtype codec {codec!r} is not supported; {expected}"
                )
        if roles[0] == roles[1]:
            return roles[0]
        return ",".join(f"{r}={c or 'exact'}" for r, c in zip(WIRE_ROLES, roles, strict=True))
    if isinstance(value, str):
        if value in WIRE_DTYPES or value == WIRE_AUTO:
            return value
        if "=" in value:  # the text form of a mapping (from the wire or a database row)
            pairs = [part.partition("=") for part in value.split(",")]
            return canonical_wire({k: (None if c == "exact" else c) for k, _, c in pairs})
    raise InvalidArgumentError(f"wire_dtype {value!r} is not supported; {expected}")


def wire_codecs(
    precision: str, wire_dtype: str | Mapping[str, str | None] | None
) -> tuple[str | None, str | None]:
    """(activations, gradients) codecs of a canonical ``wire_dtype`` under ``precision`` (see
    ``Numerics.wire_codecs``)."""
    codecs = wire_roles(wire_dtype)
    if precision == "fp32":
        return codecs
    return (codecs[0] or "bfloat16", codecs[1] or "bfloat16")


def wire_roles(text: str | Mapping[str, str | None] | None) -> tuple[str | None, str | None]:
    """(activations, gradients) of a canonical ``wire_dtype`` (``"auto"`` and ``"exact"``:
    both exact)."""
    if text is None or isinstance(text, Mapping):
        assert text is None, "wire_dtype is canonical after __post_init__"
        return (None, None)
    if text in (WIRE_AUTO, "exact"):
        return (None, None)
    if "=" not in text:
        return (text, text)
    codecs = dict(part.split("=") for part in text.split(","))
    a, g = (codecs[r] for r in WIRE_ROLES)
    return (None if a == "exact" else a, None if g == "exact" else g)
