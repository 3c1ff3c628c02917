"""Job configuration: what a client asks for, validated before anything is planned."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pipesvc.core.limits import MAX_MICROBATCHES
from pipesvc.core.loss import check_loss
from pipesvc.core.model_args import INPUT_DTYPES, MAX_INPUT_DIMS, check_model_args
from pipesvc.core.optim import DEFAULT_OPTIMIZER, check_optimizer
from pipesvc.core.planning.partition import get_partition
from pipesvc.core.schedule import check_virtual_stages, get_schedule
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import common_pb2

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


def _default_optimizer() -> dict[str, Any]:
    return dict(DEFAULT_OPTIMIZER)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """Everything that defines a job; checked in ``__post_init__``."""

    model: str
    """A registered model name."""
    model_args: Mapping[str, Any] = field(default_factory=dict)
    """JSON-typed keyword arguments of the model factory."""
    seed: int = 0
    """Seed of the deterministic per-layer initialisation."""
    num_stages: int = 2
    """Stages the model is split over."""
    num_microbatches: int = 4
    """Micro-batches per step."""
    schedule: str = "1f1b"
    """A registered pipeline schedule (``pipesvc.core.schedule.schedule_names()``: ``gpipe``,
    ``1f1b`` and any registered with ``register_schedule``)."""
    optimizer: Mapping[str, Any] = field(default_factory=_default_optimizer)
    """``{"name": "sgd" | "adam" | "adamw", **torch keyword arguments}``, or ``{"name":
    "none"}`` for an inference job (``create_job(optimizer=None)``: weights only)."""
    loss: str = "cross_entropy"
    """``cross_entropy`` or ``mse``, mean-reduced."""
    partition: str = "parameters"
    """A registered partition method (``pipesvc.core.planning.partition.partition_names()``):
    ``parameters`` (balance parameter counts), ``uniform`` (equal layer counts), ``memory`` (balance
    each stage's memory estimate against its budget), ``throughput`` (the fastest step from the
    stages' measured speeds: balanced by parameters for the first steps, then measured and
    re-planned, and again when the cluster changes; see [Note: settling] in
    ``pipesvc.core.settle``), or any registered
    with ``register_partition``."""
    rebalance: bool = False
    """Measure the stages every ``REBALANCE_EVERY`` steps too (and when the step time changes)
    and move to the throughput plan when it is clearly better (see [Note: settling] in
    ``pipesvc.core.settle``)."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm over all stages to this value; None for no clipping."""
    checkpoint_every: int | None = None
    """Checkpoint every this many steps (0: only at start and after loading state); None: as
    often as keeps checkpoints within 2% of the training time, at least 10 steps apart (see
    [Note: checkpoint cadence] in ``pipesvc.core.cadence``). Recovery replays the steps since
    the newest checkpoint from the coordinator's step log."""
    input_shape: tuple[int, ...] | None = None
    """Shape of one micro-batch's input, batch dimension first (e.g. ``(8, 128)`` for 8
    sequences of 128 tokens). With it the planner counts the activations each stage keeps
    for its backward in its memory estimate; without it they are left out."""
    input_dtype: str = "float32"
    """Dtype of that input (``int64`` for token ids)."""
    trainable: tuple[str, ...] | None = None
    """Glob patterns (``fnmatch``) over parameter names, the keys of ``Job.state_dict()`` (a
    Hugging Face model's own names): only matching parameters train; the rest get no
    gradient and no optimizer state. None: every parameter trains."""
    wire_dtype: str | Mapping[str, str | None] | None = None
    """How activations and gradients cross the links between stages: ``bfloat16`` or
    ``float16`` (cast, and cast back on arrival), ``int8`` or ``int4`` (blockwise absmax, one
    float32 scale per 64 elements; see [Note: blockwise quantization] in ``pipesvc.core.quant``),
    or per role, ``{"activations": "int8", "gradients": "bfloat16"}`` (a role left out or None
    crosses exact). The layers still compute in ``precision``; the result equals one process
    that applies the same codec at the same stage boundaries (see [Note: wire dtype] in
    ``pipesvc.stage.compute.runtime``). None: the compute dtype (bfloat16 under the bf16 precisions,
    which refuse float16). ``"auto"``: exact until the job is measured, then int8 activations
    and bfloat16 gradients on the links between hosts whose measured rate makes them the
    bottleneck, exact elsewhere, chosen at a re-plan and kept in the plan (see [Note:
    automatic codecs] in ``pipesvc.core.link_codecs``). Kept in its canonical text form: a
    codec's name, ``"auto"``, or ``"activations=int8,gradients=bfloat16"`` when the roles
    differ (``wire_codecs`` reads it)."""
    virtual_stages: int = 1
    """Layer ranges each stage holds (see [Note: virtual stages] in
    ``pipesvc.core.schedule``): the model is cut into ``num_stages * virtual_stages`` ranges
    and stage ``r`` holds ranges ``r, r + num_stages, ...``; needs a schedule that interleaves
    (``interleaved-1f1b``). More than 1 shrinks the bubble about that many times, for that many
    times the sends between stages."""
    data_parallel: int = 1
    """Replicas of the pipeline (data parallel): ``num_stages * data_parallel`` stages train,
    each replica its share of every batch, and each stage's gradients are summed with the
    stages of the same rank in the other replicas before the commit (see [Note: replicas] in
    ``pipesvc.coordinator.replicas``). ``num_microbatches`` is per replica: a step is cut into
    ``num_microbatches * data_parallel`` micro-batches."""
    min_replicas: int | None = None
    """When a stage is lost and no spare can replace it, the job drops the replicas that lost
    stages down to this many, and the survivors share the whole batch; None: no replica is
    ever dropped (``data_parallel``)."""
    precision: str = "fp32"
    """``fp32``; ``bf16-mixed`` (float32 weights and optimizer state, layers under bfloat16
    autocast, bfloat16 between stages); or ``bf16`` (weights, gradients and optimizer state in
    bfloat16). See [Note: precision] in ``pipesvc.stage.compute.runtime``."""
    name: str | None = None
    """What the job is called where models are named: the ``model`` of the coordinator's
    OpenAI-compatible HTTP API (``pipesvc.coordinator.serve_http``); unique among the
    coordinator's open jobs. None: the job is known by its id only."""
    prefill_chunk: int | None = None
    """Generation: prompt tokens per chunk of a long prompt's prefill, whose chunks flow through
    the stages like micro-batches so the first token comes sooner (see [Note: chunked
    prefill] in ``pipesvc.coordinator.session``); 0: every prompt at once. None: 256."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not _MODEL_NAME.fullmatch(self.model):
            raise InvalidArgumentError(
                f"model {self.model!r} is not a model name; expected a registered name such as "
                "'gpt' (module and file paths are never accepted)"
            )
        if self.name is not None and not (
            isinstance(self.name, str) and _JOB_NAME.fullmatch(self.name)
        ):
            raise InvalidArgumentError(
                f"job name {self.name!r} is not a name; expected 1 to 128 letters, digits and "
                "'._:/-', starting with a letter or digit (e.g. 'my-llama')"
            )
        check_model_args(self.model_args)
        if not isinstance(self.rebalance, bool):
            raise InvalidArgumentError(f"rebalance must be a bool; got {self.rebalance!r}")
        for name in (
            "seed",
            "num_stages",
            "num_microbatches",
            "checkpoint_every",
            "data_parallel",
            "min_replicas",
            "virtual_stages",
            "prefill_chunk",
        ):
            value = getattr(self, name)
            if value is None and name in ("checkpoint_every", "min_replicas", "prefill_chunk"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgumentError(f"{name} must be an int; got {value!r}")
        if not 0 <= self.seed < 2**63:
            raise InvalidArgumentError(f"seed ({self.seed}) must be in [0, 2**63)")
        if not 1 <= self.num_stages <= 1024:
            raise InvalidArgumentError(f"num_stages ({self.num_stages}) must be in [1, 1024]")
        self._check_replicas()
        if self.checkpoint_every is not None and not 0 <= self.checkpoint_every < 2**31:
            raise InvalidArgumentError(
                f"checkpoint_every ({self.checkpoint_every}) must be in [0, 2**31)"
            )
        if self.prefill_chunk is not None and not 0 <= self.prefill_chunk <= 2**20:
            raise InvalidArgumentError(
                f"prefill_chunk ({self.prefill_chunk}) must be in [0, 2**20] tokens (0: whole "
                "prompts)"
            )
        if not 1 <= self.num_microbatches <= MAX_MICROBATCHES:
            raise InvalidArgumentError(
                f"num_microbatches ({self.num_microbatches}) must be in [1, {MAX_MICROBATCHES}]"
            )
        get_schedule(self.schedule)
        self._check_virtual_stages()
        get_partition(self.partition)
        check_loss(self.loss)
        if not isinstance(self.optimizer, Mapping):
            raise InvalidArgumentError(f"optimizer must be a mapping; got {self.optimizer!r}")
        check_optimizer(self.optimizer)
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
        if self.clip_grad_norm is not None and not (
            isinstance(self.clip_grad_norm, int | float)
            and not isinstance(self.clip_grad_norm, bool)
            and math.isfinite(self.clip_grad_norm)
            and self.clip_grad_norm > 0
        ):
            raise InvalidArgumentError(
                f"clip_grad_norm ({self.clip_grad_norm!r}) must be a positive finite number"
            )

    @property
    def wire_codecs(self) -> tuple[str | None, str | None]:
        """(activations, gradients): the codec each crosses links in, None for exact (the
        compute dtype; under the bf16 precisions that is bfloat16, so never None). Under
        ``"auto"``, the exact ones: what a link has until its plan fixes its codecs."""
        codecs = wire_roles(self.wire_dtype)
        if self.precision == "fp32":
            return codecs
        return (codecs[0] or "bfloat16", codecs[1] or "bfloat16")

    @property
    def step_microbatches(self) -> int:
        """Micro-batches a training step is cut into: ``num_microbatches`` per replica."""
        return self.num_microbatches * self.data_parallel

    @property
    def total_stages(self) -> int:
        """Stages the job takes: ``num_stages`` per replica."""
        return self.num_stages * self.data_parallel

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

    def _check_replicas(self) -> None:
        if not 1 <= self.data_parallel <= MAX_REPLICAS:
            raise InvalidArgumentError(
                f"data_parallel ({self.data_parallel}) must be in [1, {MAX_REPLICAS}]"
            )
        if self.num_stages * self.data_parallel > 1024:
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

    def model_args_json(self) -> str:
        """``model_args`` as a JSON object."""
        return json.dumps(dict(self.model_args), sort_keys=True)

    def optimizer_json(self) -> str:
        """``optimizer`` as a JSON object."""
        return json.dumps(dict(self.optimizer), sort_keys=True)


def parse_json_object(text: str, field_name: str) -> dict[str, Any]:
    """Parses ``text`` as a JSON object (the wire form of model arguments and optimizers).

    Raises:
        InvalidArgumentError: not valid JSON or not an object.
    """
    try:
        value = json.loads(text) if text else {}
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgumentError(f"{field_name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidArgumentError(
            f"{field_name} must be a JSON object; got {type(value).__name__}"
        )
    return value


_JSON_ON_THE_WIRE = ("model_args", "optimizer")
"""Mapping fields the wire carries as JSON text, in ``<name>_json``."""
_EMPTY_ON_THE_WIRE_MEANS_DEFAULT = ("input_dtype", "precision", "data_parallel", "virtual_stages")
"""Fields added to the wire after the first clients: an older client's spec leaves them empty."""


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


def wire_field_name(name: str) -> str:
    """The ``JobSpec`` field that carries the JobConfig field ``name``."""
    return f"{name}_json" if name in _JSON_ON_THE_WIRE else name


def _to_plain(value: Any) -> Any:
    """A field's JSON-ready form: mappings as dicts, tuples as lists."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def config_to_dict(config: JobConfig) -> dict[str, Any]:
    """``config`` as a JSON-ready dict (for manifests and the state database), one key per field
    in declaration order."""
    return {f.name: _to_plain(getattr(config, f.name)) for f in fields(JobConfig)}


def config_from_dict(values: Mapping[str, Any]) -> JobConfig:
    """A validated JobConfig from ``config_to_dict``'s form.

    Raises:
        InvalidArgumentError: unknown or invalid fields.
    """
    try:
        lists = {
            k: tuple(values[k])
            for k in ("input_shape", "trainable")
            if isinstance(values.get(k), list)
        }
        return JobConfig(**{**values, **lists})
    except TypeError as exc:
        raise InvalidArgumentError(f"job configuration {dict(values)!r}: {exc}") from exc


def config_to_proto(config: JobConfig) -> common_pb2.JobSpec:
    """The wire form of ``config``; a None field (``clip_grad_norm``, ``input_shape``) is left
    unset."""
    spec = common_pb2.JobSpec()
    for f in fields(JobConfig):
        value = getattr(config, f.name)
        if f.name in _JSON_ON_THE_WIRE:
            setattr(spec, wire_field_name(f.name), json.dumps(dict(value), sort_keys=True))
        elif isinstance(value, tuple):
            getattr(spec, f.name).extend(value)
        elif value is not None:
            setattr(spec, f.name, value)
    return spec


def config_from_proto(spec: common_pb2.JobSpec) -> JobConfig:
    """A validated JobConfig from its wire form.

    Raises:
        InvalidArgumentError: any field is invalid.
    """
    values: dict[str, Any] = {}
    wire_fields = common_pb2.JobSpec.DESCRIPTOR.fields_by_name
    for f in fields(JobConfig):
        wire_name = wire_field_name(f.name)
        wire = wire_fields[wire_name]
        value = getattr(spec, wire_name)
        if f.name in _JSON_ON_THE_WIRE:
            values[f.name] = parse_json_object(value, wire_name)
        elif wire.is_repeated:
            values[f.name] = tuple(value) or None
        elif wire.has_presence and not spec.HasField(wire_name):  # type: ignore[arg-type]
            values[f.name] = None
        elif f.name in _EMPTY_ON_THE_WIRE_MEANS_DEFAULT and not value:
            values[f.name] = f.default
        else:
            values[f.name] = value
    return JobConfig(**values)
