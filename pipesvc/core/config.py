"""Job configuration: what a client asks for, validated before anything is planned."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pipesvc.core.job_sections import SECTIONS, Numerics, wire_codecs
from pipesvc.core.optim import DEFAULT_OPTIMIZER
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import common_pb2


def _default_optimizer() -> dict[str, Any]:
    return dict(DEFAULT_OPTIMIZER)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """Everything that defines a job, one keyword per setting as ``create_job`` takes them;
    checked by concern in ``__post_init__`` (see [Note: configuration sections] in
    ``pipesvc.core.job_sections``)."""

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
    ``1f1b``, ``zb-h1``, ``interleaved-1f1b`` and any registered with ``register_schedule``)."""
    optimizer: Mapping[str, Any] = field(default_factory=_default_optimizer)
    """``{"name": "sgd" | "adam" | "adamw", **torch keyword arguments}``, or ``{"name":
    "none"}`` for an inference job (``create_job(optimizer=None)``: weights only)."""
    loss: str = "cross_entropy"
    """``cross_entropy``, ``mse`` or ``causal_lm`` (cross-entropy of each position against the
    next token, for causal language models), mean-reduced."""
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
    ``pipesvc.stage.compute.wire_casts``). None: the compute dtype (bfloat16 under the bf16
    precisions, which refuse float16). ``"auto"``: exact until the job is measured, then int8
    activations and bfloat16 gradients on the links between hosts whose measured rate makes
    them the bottleneck, exact elsewhere, chosen at a re-plan and kept in the plan (see [Note:
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
    decode_steps: int | None = None
    """Generation: decode steps the stages run per run without the coordinator (when no
    session of the run asks for log-probabilities), the last stage handing each step's tokens
    to the first (see [Note: decode steps on the stages] in ``pipesvc.coordinator.session``);
    1: one step per run. None: 4."""

    def __post_init__(self) -> None:
        # Each concern checks its own fields (see [Note: configuration sections]).
        for section in SECTIONS:
            checked = section.of(self)
            if isinstance(checked, Numerics):  # keeps wire_dtype in its canonical form
                object.__setattr__(self, "wire_dtype", checked.wire_dtype)

    @property
    def wire_codecs(self) -> tuple[str | None, str | None]:
        """(activations, gradients): the codec each crosses links in, None for exact (the
        compute dtype; under the bf16 precisions that is bfloat16, so never None). Under
        ``"auto"``, the exact ones: what a link has until its plan fixes its codecs."""
        return wire_codecs(self.precision, self.wire_dtype)

    @property
    def step_microbatches(self) -> int:
        """Micro-batches a training step is cut into: ``num_microbatches`` per replica."""
        return self.num_microbatches * self.data_parallel

    @property
    def total_stages(self) -> int:
        """Stages the job takes: ``num_stages`` per replica."""
        return self.num_stages * self.data_parallel

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
