"""Hypothesis strategies for the wire fuzz test: well-formed and mutated requests for every RPC.

Requests are built from the protobuf descriptors, so every RPC and field of both services is
covered without a list kept by hand. Fields whose meaning matters (job ids, plan epochs, run
ids, addresses, tensors, JSON) draw from pools that mix the real job's values with junk, so
validation past the first check is exercised. ``make_safe`` rewrites the few requests that are
*valid* state changes of the real job (closing or training it, taking its stages, applying a
complete state, injecting data for a run the coordinator will use): the fuzzer must leave that
job as it found it, so that any change it sees is a bug.

Sizes are bounded on purpose: a tensor header is only made consistent (so that a receiver
allocates its buffer) up to ``MAX_ALLOC_BYTES``, or beyond the receiver's limit (so it must be
refused), and model arguments that count layers stay small, because a server that trusts them
allocates per layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from pipesvc.core.config import config_from_proto
from pipesvc.core.limits import Limits
from pipesvc.core.tensor_codec import decode, encode, encode_frames, named_frames, read_named_frames
from pipesvc.errors import PipesvcError
from pipesvc.storage.checkpoint import OPTIM_PREFIX
from pipesvc.v1 import common_pb2, coordinator_pb2, stage_pb2
from pipesvc.wire.protocol import WIRE_PROTOCOL

LIMITS = Limits()
CODEC_LIMITS = LIMITS.codec()
MAX_ALLOC_BYTES = 64 << 10
"""Largest tensor the fuzzer lets a server allocate (a consistent header up to this size)."""

Strategy = st.SearchStrategy


# -- the real job and the RPC table -------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What the fuzzer knows about the cluster and its one real job."""

    job_id: str
    plan_epoch: int
    coordinator: str
    stages: tuple[str, ...]
    state: dict[str, torch.Tensor] = dataclasses.field(repr=False)
    """The real job's state_dict: names, shapes and dtypes of every tensor."""
    in_features: int
    hidden_features: int
    out_features: int


@dataclass(frozen=True)
class Rpc:
    """One method of CoordinatorService or StageService."""

    service: str
    method: MethodDescriptor

    @property
    def id(self) -> str:
        short = "coordinator" if self.service.endswith("CoordinatorService") else "stage"
        return f"{short}.{self.method.name}"

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def request_streaming(self) -> bool:
        return bool(self.method.client_streaming)

    @property
    def response_streaming(self) -> bool:
        return bool(self.method.server_streaming)

    @property
    def request_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.input_type)

    @property
    def response_class(self) -> type[Message]:
        return message_factory.GetMessageClass(self.method.output_type)


def _rpcs(file: Any, service: str) -> list[Rpc]:
    described = file.services_by_name[service]
    return [Rpc(described.full_name, method) for method in described.methods]


COORDINATOR_RPCS = _rpcs(coordinator_pb2.DESCRIPTOR, "CoordinatorService")
STAGE_RPCS = _rpcs(stage_pb2.DESCRIPTOR, "StageService")


# -- value pools ---------------------------------------------------------------------------------

U32 = (0, 1, 2, 3, 4, 5, 8, 1024, 1025, 65536, 65537, 2**31 - 1, 2**31, 2**32 - 1)
U64 = (0, 1, 2, 3, 4, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
I64 = (0, 1, 2, -1, 2**31, 2**63 - 1, -(2**63))
ENUM_EXTRA = (-1, 3, 11, 99, 2**31 - 1, -(2**31))
DOUBLES = (0.0, -0.0, 1.0, -1.0, 0.25, 1e-300, 5e-324, 1e308, math.inf, -math.inf, math.nan)
TEXTS = ("", " ", "x", "\x00", "é中😀", "\u202e\u200b", "0", "-1", "a" * 300, "\n\t")
MODEL_NAMES = (
    "mlp",
    "gpt",
    "cnn",
    "",
    "MLP",
    "resnet",
    "os.path",
    "../models/x",
    "pipesvc.models.gpt",
    "/tmp/m.py",
    "a" * 65,
    "mlp\x00",
    "mlp ",
)
JUNK_PORTS_UP_TO = 9
"""Junk stage addresses use loopback ports 1..9: refused at once, and never someone else's."""

# Element sizes of the wire dtypes (see common.proto); unknown values count as 4 bytes.
ITEMSIZE = {1: 4, 2: 8, 3: 2, 4: 2, 5: 8, 6: 4, 7: 2, 8: 1, 9: 1, 10: 1}
TORCH_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
SMALL_DIMS = (0, 1, 2, 3, 4, 6, 8, 10)
HUGE_DIMS = (-1, 2**31, 2**31 + 1, 2**62, 2**63 - 1, -(2**63))
OVER_LIMIT_SHAPES = ((1,) * 9, (2**31 + 1,), (2**16, 2**16, 2), (2**31, 4), (2**40,), (0, 2**40))
"""Shapes a receiver must refuse before allocating: too many dimensions, elements or bytes."""


def sometimes(one_in: int) -> Strategy[bool]:
    """True about once in ``one_in`` draws (shrinks to False).

    Hypothesis favours small integers, so ``integers(0, n) == 0`` would be true far more often.
    """
    return st.sampled_from((False,) * (one_in - 1) + (True,))


def ints(pool: Sequence[int], low: int, high: int) -> Strategy[int]:
    return st.one_of(st.sampled_from(pool), st.integers(low, high))


def texts() -> Strategy[str]:
    return st.one_of(st.sampled_from(TEXTS), st.text(max_size=12))


def job_ids(t: Target) -> Strategy[str]:
    near = ("", "nope", t.job_id + "x", t.job_id[:-1], t.job_id.upper(), " " + t.job_id)
    # Half of them name the real job, so validation past the job lookup is exercised.
    return st.one_of(st.just(t.job_id), st.just(t.job_id), st.sampled_from(near), texts())


def epochs(t: Target) -> Strategy[int]:
    return st.one_of(st.just(t.plan_epoch), st.just(t.plan_epoch), ints(U64, 0, 2**64 - 1))


def run_ids() -> Strategy[int]:
    return ints((0, 1, 2, 3, 2**63, 2**64 - 1), 0, 2**64 - 1)


def addresses(t: Target) -> Strategy[str]:
    valid = (
        "127.0.0.1:1",
        "127.0.0.1:2",
        "localhost:3",
        "[::1]:4",
        "127.0.0.1:\u0661",  # an Arabic-Indic digit: str.isdigit() and int() accept it
        t.coordinator,
        *t.stages,
    )
    invalid = (
        "",
        "127.0.0.1",
        "127.0.0.1:",
        ":1",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:-1",
        "127.0.0.1:1x",
        "127.0.0.1:\u00b2",  # a superscript two: str.isdigit() accepts it, int() does not
        "127.0.0.1: 1",
        "unix:/tmp/x",
    )
    return st.one_of(st.sampled_from(valid), st.sampled_from(invalid), texts())


def tensor_names(t: Target) -> Strategy[str]:
    junk = (
        "",
        "0",
        "0.weight",
        "4.weight",
        "9.weight",
        "-1.weight",
        ".weight",
        "0..weight",
        "a.b",
        "\u00b2.bias",
        "\u0663.bias",
        "99999999999999999999.weight",
        "3.bias\x00",
        f"{OPTIM_PREFIX}0.0.weight.momentum_buffer",
        f"{OPTIM_PREFIX}3.bias.step",
        f"{OPTIM_PREFIX}3.bias",
        f"{OPTIM_PREFIX}9.weight.x",
        OPTIM_PREFIX,
    )
    return st.one_of(st.sampled_from(sorted(t.state)), st.sampled_from(junk), texts())


# -- JSON fields ---------------------------------------------------------------------------------

# Model arguments that count layers or blocks stay small: a factory trusts them and builds a
# spec per layer (see the module docstring). Sizes may be huge: they are built on meta.
_COUNT_ARGS = ("num_layers", "num_blocks", "num_heads")
_SIZE_ARGS = (
    "in_features",
    "hidden_features",
    "out_features",
    "vocab_size",
    "block_size",
    "embed_dim",
    "in_channels",
    "image_size",
    "num_classes",
)
_ODD_VALUES = (None, True, 2.5, "4", [], {}, -1, 0)


def _json_scalars() -> Strategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from((0, 1, -1, 3, 2**31, 2**64, 10**30)),
        st.floats(),
        st.text(max_size=8),
    )


def _json_values() -> Strategy[Any]:
    return st.recursive(
        _json_scalars(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )


@st.composite
def model_args(draw: st.DrawFn) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(_COUNT_ARGS + _SIZE_ARGS), max_size=4, unique=True)):
        if key in _COUNT_ARGS:
            args[key] = draw(st.sampled_from((1, 2, 3, 4, 8, *_ODD_VALUES)))
        else:
            args[key] = draw(
                st.sampled_from((1, 2, 3, 6, 10, 16, 2**31, 2**63 - 1, 2**64, *_ODD_VALUES))
            )
    if draw(st.booleans()):
        args["channels"] = draw(
            st.one_of(
                st.lists(st.sampled_from((1, 3, 4, 0, -1, 2**31)), max_size=4),
                st.sampled_from(_ODD_VALUES),
            )
        )
    if draw(st.booleans()):
        args["dropout"] = draw(st.sampled_from((*DOUBLES, 0.5, 2, "0.1")))
    if draw(st.booleans()):
        args.update(draw(st.dictionaries(st.text(max_size=6), _json_values(), max_size=2)))
    return args


_BAD_JSON = (
    "{}",
    "null",
    "[]",
    "1",
    '"x"',
    "{",
    "[" * 100_000,
    '{"a":' * 3000,
    "\ufeff{}",
    "{} {}",
    '{"num_layers": 1e400}',
    '{"name": NaN}',
    '{"\\ud800": 1}',
    '{"dropout": "\\ud800"}',
    '{"name": "sgd", "\\udfff": 1}',
)


def model_args_json() -> Strategy[str]:
    return st.one_of(model_args().map(json.dumps), st.sampled_from(_BAD_JSON), texts(), st.just(""))


@st.composite
def optimizer_spec(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if not draw(sometimes(5)):
        spec["name"] = draw(st.sampled_from(("sgd", "adam", "adamw", "rmsprop", "", None, 1)))
    keys = ("lr", "momentum", "weight_decay", "betas", "eps", "params", "foreach", "fused")
    for key in draw(st.lists(st.sampled_from(keys), max_size=3, unique=True)):
        spec[key] = draw(st.one_of(st.sampled_from((*DOUBLES, 0.1, [0.9, 0.99])), _json_values()))
    return spec


def optimizer_json() -> Strategy[str]:
    return st.one_of(optimizer_spec().map(json.dumps), st.sampled_from(_BAD_JSON), texts())


@st.composite
def job_specs(draw: st.DrawFn, t: Target) -> common_pb2.JobSpec:
    """A valid spec for a job like the real one, with some fields replaced by fuzz."""
    spec = common_pb2.JobSpec(
        model="mlp",
        model_args_json=json.dumps({"num_layers": 4}),
        seed=0,
        num_stages=2,
        num_microbatches=4,
        schedule="1f1b",
        optimizer_json=json.dumps({"name": "sgd", "lr": 0.1}),
        loss="mse",
        partition="uniform",
    )
    return draw(noisy(st.just([spec]), t))[0]


# -- tensors -------------------------------------------------------------------------------------


def consistent_bytes(dtype: int, shape: Sequence[int]) -> int | None:
    """The header num_bytes a receiver accepts, if allocating it is safe; else None."""
    numel = math.prod(shape)
    size = numel * ITEMSIZE.get(dtype, 4)
    if size < 0 or size >= 2**64:
        return None
    if size <= MAX_ALLOC_BYTES or size > LIMITS.max_tensor_bytes:
        return size
    return None


@st.composite
def headers(draw: st.DrawFn, t: Target) -> common_pb2.TensorHeader:
    known = st.sampled_from(range(1, 11))
    dtype = draw(st.one_of(known, known, st.sampled_from((0, *ENUM_EXTRA))))
    shape = draw(
        st.one_of(
            st.lists(st.sampled_from(SMALL_DIMS), max_size=4),
            st.sampled_from(OVER_LIMIT_SHAPES).map(list),
            st.lists(st.sampled_from(SMALL_DIMS + HUGE_DIMS), max_size=10),
        )
    )
    fitting = consistent_bytes(dtype, shape)
    num_bytes = draw(
        st.one_of(
            st.just(fitting if fitting is not None else 1),
            st.sampled_from((0, 1, 4, MAX_ALLOC_BYTES + 1, 2**63, 2**64 - 1)),
        )
    )
    num_frames = draw(
        st.one_of(st.just(1), st.sampled_from((0, 2, 3, 2**16, 2**16 + 1, 2**32 - 1)))
    )
    return common_pb2.TensorHeader(
        dtype=dtype, shape=shape, num_bytes=num_bytes, num_frames=num_frames
    )


@st.composite
def torch_tensors(
    draw: st.DrawFn, t: Target, shapes: Sequence[tuple[int, ...]] | None = None
) -> torch.Tensor:
    """Real tensors, mostly of shapes the model takes, of any wire dtype."""
    batch = draw(st.sampled_from((8, 4, 1, 2, 3, 5)))
    if shapes is None:
        shapes = (
            (batch, t.in_features),
            (batch, t.out_features),
            (batch, t.hidden_features),
            (batch,),
            (),
            (0, t.in_features),
            (batch, t.in_features, 1),
            (batch, 2, t.in_features),
            (batch, t.in_features + 1),
        )
    shape = draw(st.one_of(st.sampled_from(shapes[:2]), st.sampled_from(shapes)))
    dtype = draw(st.one_of(st.just(torch.float32), st.sampled_from(TORCH_DTYPES)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=gen).to(dtype)
        special = draw(st.sampled_from((None, math.nan, math.inf, 1e30)))
        if special is not None and tensor.numel():
            tensor.view(-1)[0] = special
    elif dtype == torch.bool:
        tensor = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        tensor = torch.randint(0, 5, shape, generator=gen).to(dtype)
    return tensor


def payloads(size: int) -> Strategy[bytes]:
    """``size`` bytes: drawn directly when short, else zeros or seeded noise."""
    if size <= 64:
        return st.binary(min_size=size, max_size=size)
    return st.one_of(
        st.just(bytes(size)),
        st.integers(0, 2**32 - 1).map(lambda seed: random.Random(seed).randbytes(size)),
    )


@st.composite
def tensors(draw: st.DrawFn, t: Target) -> common_pb2.Tensor:
    kind = draw(st.sampled_from(("real", "real", "header", "missing")))
    if kind == "real":
        message = encode(draw(torch_tensors(t)))
        slip = draw(st.sampled_from(("none", "none", "short", "long", "frames", "dtype")))
        if slip == "short":
            message.data = message.data[:-1]
        elif slip == "long":
            message.data += b"\x00"
        elif slip == "frames":
            message.header.num_frames = draw(st.sampled_from((0, 2)))
        elif slip == "dtype":
            message.header.dtype = draw(st.sampled_from(range(11)))
        return message
    if kind == "missing":
        return common_pb2.Tensor(data=draw(st.binary(max_size=32)))
    header = draw(headers(t))
    size = header.num_bytes if header.num_bytes <= MAX_ALLOC_BYTES else 8
    return common_pb2.Tensor(header=header, data=draw(payloads(size)))


# -- generic messages from descriptors -----------------------------------------------------------

_U = FieldDescriptor


def _named_pool(name: str, t: Target) -> Strategy[Any] | None:
    pools: dict[str, Callable[[], Strategy[Any]]] = {
        "job_id": lambda: job_ids(t),
        "plan_epoch": lambda: epochs(t),
        "run_id": run_ids,
        "address": lambda: addresses(t),
        "downstream_address": lambda: addresses(t),
        "model": lambda: st.one_of(st.sampled_from(MODEL_NAMES), texts()),
        "models": lambda: st.lists(st.one_of(st.sampled_from(MODEL_NAMES), texts()), max_size=3),
        "model_args_json": model_args_json,
        "optimizer_json": optimizer_json,
        "schedule": lambda: st.one_of(st.sampled_from(("1f1b", "gpipe", "GPIPE", "")), texts()),
        "loss": lambda: st.one_of(st.sampled_from(("mse", "cross_entropy", "l1", "")), texts()),
        "partition": lambda: st.one_of(
            st.sampled_from(("uniform", "parameters", "random", "")), texts()
        ),
        "name": lambda: tensor_names(t),
        "shape": lambda: st.lists(st.sampled_from(SMALL_DIMS + HUGE_DIMS), max_size=10),
        "num_microbatches": lambda: ints(U32, 0, 2**32 - 1),
        "num_stages": lambda: ints(U32, 0, 2**32 - 1),
    }
    make = pools.get(name)
    return make() if make is not None else None


def _scalar(field: FieldDescriptor, t: Target, depth: int) -> Strategy[Any]:
    named = _named_pool(field.name, t)
    if named is not None:
        return named
    kind = field.type
    if kind == _U.TYPE_MESSAGE:
        return messages(field.message_type, t, depth + 1)
    if kind == _U.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from(ENUM_EXTRA))
    if kind == _U.TYPE_STRING:
        return texts()
    if kind == _U.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == _U.TYPE_BOOL:
        return st.booleans()
    if kind in (_U.TYPE_DOUBLE, _U.TYPE_FLOAT):
        return st.one_of(st.sampled_from(DOUBLES), st.floats(width=64))
    if kind in (_U.TYPE_UINT32, _U.TYPE_FIXED32):
        return ints(U32, 0, 2**32 - 1)
    if kind in (_U.TYPE_UINT64, _U.TYPE_FIXED64):
        return ints(U64, 0, 2**64 - 1)
    if kind in (_U.TYPE_INT64, _U.TYPE_SINT64, _U.TYPE_SFIXED64):
        return ints(I64, -(2**63), 2**63 - 1)
    if kind in (_U.TYPE_INT32, _U.TYPE_SINT32, _U.TYPE_SFIXED32):
        return ints((0, 1, -1, 2**31 - 1, -(2**31)), -(2**31), 2**31 - 1)
    raise AssertionError(f"no strategy for field {field.full_name} of type {kind}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == _U.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def field_values(field: FieldDescriptor, t: Target, depth: int = 0) -> Strategy[Any]:
    """Values for one field: a list for repeated fields (``shape`` and ``models`` are lists),
    a dict for map fields."""
    if _is_map(field):
        entry = field.message_type.fields_by_name
        return st.dictionaries(
            _scalar(entry["key"], t, depth), _scalar(entry["value"], t, depth), max_size=3
        )
    value = _scalar(field, t, depth)
    if field.is_repeated and field.name not in ("shape", "models"):
        return st.lists(value, max_size=3)
    return value


def set_field(message: Message, field: FieldDescriptor, value: Any) -> None:
    message.ClearField(field.name)
    if _is_map(field):
        entries = getattr(message, field.name)
        for key, item in value.items():
            if isinstance(item, Message):
                entries[key].CopyFrom(item)
            else:
                entries[key] = item
    elif field.is_repeated:
        getattr(message, field.name).extend(value)
    elif field.type == _U.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _special(descriptor: Descriptor, t: Target) -> Strategy[Message] | None:
    if descriptor.full_name == "pipesvc.v1.Tensor":
        return tensors(t)
    if descriptor.full_name == "pipesvc.v1.TensorHeader":
        return headers(t)
    if descriptor.full_name == "pipesvc.v1.JobSpec":
        return job_specs(t)
    return None


@st.composite
def _random_message(draw: st.DrawFn, descriptor: Descriptor, t: Target, depth: int) -> Message:
    message = message_factory.GetMessageClass(descriptor)()
    if depth > 3:
        return message
    for field in descriptor.fields:
        if draw(st.booleans()):
            set_field(message, field, draw(field_values(field, t, depth)))
    return message


def messages(descriptor: Descriptor, t: Target, depth: int = 0) -> Strategy[Message]:
    """Any message of this type: special strategies for tensors and specs, else random fields."""
    special = _special(descriptor, t)
    if special is not None:
        return special
    return _random_message(descriptor, t, depth)


@st.composite
def noisy(draw: st.DrawFn, base: Strategy[list[Message]], t: Target) -> list[Message]:
    """Messages from ``base``, one of them with about one field in five replaced by fuzz."""
    out = list(draw(base))
    if not out:
        return out
    index = draw(st.integers(0, len(out) - 1))
    copy = type(out[index])()
    copy.CopyFrom(out[index])
    for field in copy.DESCRIPTOR.fields:
        if draw(sometimes(5)):
            set_field(copy, field, draw(field_values(field, t)))
    out[index] = copy
    return out


# -- streams of frames ---------------------------------------------------------------------------

_PERTURBATIONS = (
    "none",
    "drop",
    "dtype",
    "shape",
    "extra",
    "duplicate",
    "rename",
    "corrupt",
    "truncate",
    "swap",
)


def _perturb_frames(draw: st.DrawFn, frames: list[Any], how: str) -> list[Any]:
    if not frames:
        return frames
    index = draw(st.integers(0, len(frames) - 1))
    if how == "corrupt":
        frame = type(frames[index])()
        frame.CopyFrom(frames[index])
        change = draw(st.sampled_from(("index", "data", "bytes", "no_header", "frames")))
        if change == "index":
            frame.frame_index = draw(st.sampled_from(((frame.frame_index + 1) % 2**32, 2**32 - 1)))
        elif change == "data":
            frame.data = frame.data + b"\x01"
        elif change == "bytes":
            frame.header.num_bytes = (frame.header.num_bytes + 4) % 2**64
        elif change == "no_header":
            frame.ClearField("header")
        else:
            frame.header.num_frames = draw(st.sampled_from((0, 2**16 + 1)))
        frames[index] = frame
    elif how == "truncate":
        frames = frames[:index]
    elif how == "swap" and len(frames) > 1:
        other = draw(st.integers(0, len(frames) - 1))
        frames[index], frames[other] = frames[other], frames[index]
    return frames


@st.composite
def state_frames(draw: st.DrawFn, t: Target) -> list[common_pb2.TensorFrame]:
    """A state_dict like the real job's, streamed in frames, with at most one fault."""
    keys = draw(st.permutations(sorted(t.state)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    items = [(k, torch.randn(t.state[k].shape, generator=gen)) for k in keys]
    how = draw(st.sampled_from(_PERTURBATIONS))
    victim = draw(st.integers(0, len(items) - 1))
    name, tensor = items[victim]
    if how == "drop":
        del items[victim]
    elif how == "dtype":
        items[victim] = (name, tensor.to(draw(st.sampled_from(TORCH_DTYPES[1:]))))
    elif how == "shape":
        items[victim] = (name, draw(st.sampled_from((tensor[:1], tensor.unsqueeze(0)))))
    elif how == "extra":
        items.append((draw(tensor_names(t)), tensor))
    elif how == "duplicate":
        items.append((name, tensor))
    elif how == "rename":
        items[victim] = (draw(tensor_names(t)), tensor)
    frame_bytes = draw(st.sampled_from((1 << 20, 64, 40, 7)))
    frames = [f for k, v in items for f in named_frames(k, v, frame_bytes)]
    return _perturb_frames(draw, frames, how)


@st.composite
def _framed_requests(draw: st.DrawFn, t: Target, request_type: type[Message]) -> list[Message]:
    # Mostly a near-complete state for the real job: the all-or-nothing rule is tested there.
    job_id = draw(st.one_of(st.just(t.job_id), job_ids(t)))
    if not draw(sometimes(3)):
        frames = draw(state_frames(t))
    else:
        frames = draw(st.lists(messages(common_pb2.TensorFrame.DESCRIPTOR, t), max_size=4))
    requests = [request_type(job_id=job_id, frame=f) for f in frames]
    if requests and "step" in request_type.DESCRIPTOR.fields_by_name and draw(sometimes(3)):
        requests[0].step = draw(ints(U64, 0, 2**64 - 1))
    if requests and draw(sometimes(5)):
        requests[draw(st.integers(0, len(requests) - 1))].job_id = draw(job_ids(t))
    return requests


@st.composite
def data_frames(draw: st.DrawFn, t: Target) -> list[stage_pb2.DataFrame]:
    """Activation and gradient frames, mostly well-formed, some of the real job."""
    frames: list[stage_pb2.DataFrame] = []
    for _ in range(draw(st.integers(0, 3))):
        ident = stage_pb2.MicrobatchId(
            job_id=t.job_id,
            plan_epoch=t.plan_epoch,
            run_id=0,
            microbatch_index=draw(ints((0, 1, 3, 2**32 - 1), 0, 2**32 - 1)),
            direction=stage_pb2.ACTIVATION,
        )
        if draw(sometimes(3)):
            ident = draw(messages(stage_pb2.MicrobatchId.DESCRIPTOR, t))
        kind = draw(st.sampled_from(("tensor", "over-limit", "header")))
        if kind == "tensor":
            shape = (draw(st.sampled_from((2, 1, 0))), t.hidden_features)
            tensor = draw(torch_tensors(t, shapes=(shape, (2, t.out_features), (2,))))
            header, chunks = encode_frames(tensor, draw(st.sampled_from((1 << 20, 16, 5))))
            for index, data in enumerate(chunks):
                frame = stage_pb2.DataFrame(id=ident, frame_index=index, data=data)
                if index == 0:
                    frame.header.CopyFrom(header)
                frames.append(frame)
            continue
        if kind == "over-limit":
            # A tensor the receiver must refuse from its header alone, before any allocation.
            dtype = draw(st.sampled_from(range(1, 11)))
            shape = draw(st.sampled_from(OVER_LIMIT_SHAPES))
            size = math.prod(shape) * ITEMSIZE[dtype]
            header = common_pb2.TensorHeader(
                dtype=dtype, shape=shape, num_bytes=min(size, 2**64 - 1), num_frames=1
            )
        else:
            header = draw(headers(t))
        size = header.num_bytes if header.num_bytes <= MAX_ALLOC_BYTES else 8
        frames.append(
            stage_pb2.DataFrame(
                id=ident,
                header=header,
                frame_index=draw(st.sampled_from((0, 1))),
                data=draw(payloads(size)),
            )
        )
    return _perturb_frames(draw, frames, draw(st.sampled_from(("none", "corrupt", "truncate"))))


# -- requests per RPC ----------------------------------------------------------------------------


@st.composite
def run_steps(draw: st.DrawFn, t: Target) -> stage_pb2.RunStepRequest:
    """A run as the coordinator sends it to one rank: counts that agree, so the tensors and
    the run id are checked too."""
    m = draw(st.sampled_from((1, 2, 4, 0)))
    first, train = draw(st.booleans()), draw(st.booleans())
    inputs = [draw(tensors(t)) for _ in range(m if first else 0)]
    targets = [draw(tensors(t)) for _ in range(m if train and not first else 0)]
    return stage_pb2.RunStepRequest(
        job_id=draw(job_ids(t)),
        plan_epoch=draw(epochs(t)),
        run_id=draw(run_ids()),
        mode=stage_pb2.TRAIN if train else stage_pb2.INFER,
        num_microbatches=m,
        inputs=inputs,
        targets=targets,
        loss_weights=[draw(st.sampled_from((1.0 / max(m, 1), *DOUBLES))) for _ in targets],
    )


@st.composite
def payloads_beside(draw: st.DrawFn, strategy: Strategy[Message]) -> Message:
    """A request of ``strategy`` with some of its tensors' bytes moved into its ``payloads``
    field, as the client and coordinator send them (see [Note: payload wire]), sometimes
    named wrong: an index past the end or the neighbour's, or data left in the Tensor too."""
    message: Any = draw(strategy)
    if not draw(st.booleans()):
        return message  # type: ignore[no-any-return]
    names = [n for n in ("inputs", "targets") if n in message.DESCRIPTOR.fields_by_name]
    found = [getattr(message, name) for name in names]
    tensors: list[Any] = [t for f in found for t in ([f] if isinstance(f, Message) else f)]
    payloads = message.payloads
    for tensor in tensors:
        if not tensor.HasField("header") or not draw(st.booleans()):
            continue
        payloads.append(tensor.data)
        tensor.payload = len(payloads) - 1 + draw(st.sampled_from((0, 0, 0, 1, 5)))
        if not draw(sometimes(5)):
            tensor.ClearField("data")
    if draw(sometimes(5)):
        payloads.append(b"spare")
    return message  # type: ignore[no-any-return]


@st.composite
def controls(
    draw: st.DrawFn,
    t: Target,
    runs: Strategy[stage_pb2.RunStepRequest],
    commits: Strategy[stage_pb2.CommitRequest],
    aborts: Strategy[stage_pb2.AbortRequest],
) -> stage_pb2.ControlRequest:
    """One message of a Control stream: a run (its payloads moved beside it, as the
    coordinator sends them), a commit, an abort or nothing, under an id that may repeat."""
    message = stage_pb2.ControlRequest(id=draw(st.sampled_from((1, 2, 3, 0, 2**64 - 1))))
    kind = draw(st.sampled_from(("run", "commit", "abort", "none")))
    if kind == "run":
        run = draw(runs)
        message.payloads.extend(run.payloads)
        run.ClearField("payloads")
        message.run.CopyFrom(run)
    elif kind == "commit":
        message.commit.CopyFrom(draw(commits))
    elif kind == "abort":
        message.abort.CopyFrom(draw(aborts))
    return message


def _one(strategy: Strategy[Message]) -> Strategy[list[Message]]:
    return strategy.map(lambda m: [m])


def _bases(t: Target) -> dict[str, Strategy[list[Message]]]:
    """Well-formed requests of each RPC, aimed at the real job where it has one."""
    c, s = coordinator_pb2, stage_pb2
    job = job_ids(t)
    kinds = st.one_of(st.sampled_from((1, 2, 0)), st.sampled_from(ENUM_EXTRA))
    runs = payloads_beside(run_steps(t))
    commits = st.builds(
        s.CommitRequest,
        job_id=job,
        plan_epoch=epochs(t),
        run_id=run_ids(),
        grad_scale=st.sampled_from(DOUBLES),
    )
    aborts = st.builds(s.AbortRequest, job_id=job, plan_epoch=epochs(t), run_id=run_ids())
    return {
        "coordinator.RegisterStage": _one(
            st.builds(
                c.RegisterStageRequest,
                address=addresses(t),
                device=st.sampled_from(("cpu", "cuda:0", "")),
                memory_bytes=ints(U64, 0, 2**64 - 1),
                models=st.lists(st.sampled_from(MODEL_NAMES), max_size=3),
                protocol=st.sampled_from((0, WIRE_PROTOCOL, WIRE_PROTOCOL + 1)),
                version=st.sampled_from(("", "0.0.1", "x" * 300)),
            )
        ),
        "coordinator.ListStages": st.just([c.ListStagesRequest()]),
        "coordinator.CreateJob": _one(st.builds(c.CreateJobRequest, spec=job_specs(t))),
        "coordinator.GetJob": _one(st.builds(c.GetJobRequest, job_id=job)),
        "coordinator.TrainStep": _one(
            payloads_beside(
                st.builds(c.TrainStepRequest, job_id=job, inputs=tensors(t), targets=tensors(t))
            )
        ),
        "coordinator.Forward": _one(
            payloads_beside(st.builds(c.ForwardRequest, job_id=job, inputs=tensors(t)))
        ),
        "coordinator.Train": st.lists(
            payloads_beside(
                st.builds(c.TrainStepRequest, job_id=job, inputs=tensors(t), targets=tensors(t))
            ),
            max_size=3,
        ),
        "coordinator.GetState": _one(st.builds(c.GetJobStateRequest, job_id=job, kind=kinds)),
        "coordinator.LoadState": _framed_requests(t, c.LoadJobStateRequest),
        "coordinator.CloseJob": _one(st.builds(c.CloseJobRequest, job_id=job)),
        "stage.Describe": _one(
            st.builds(
                s.DescribeRequest,
                model=st.sampled_from(MODEL_NAMES),
                model_args_json=model_args_json(),
            )
        ),
        "stage.Assign": _one(
            st.builds(
                s.AssignRequest,
                job_id=job,
                plan_epoch=epochs(t),
                spec=job_specs(t),
                stage=st.builds(
                    common_pb2.PlanStage,
                    start_layer=ints(U32, 0, 8),
                    end_layer=ints(U32, 0, 8),
                    rank=ints(U32, 0, 3),
                    address=addresses(t),
                ),
                num_stages=ints(U32, 0, 3),
                downstream_address=addresses(t),
            )
        ),
        "stage.RunStep": _one(runs),
        "stage.Commit": _one(commits),
        "stage.Abort": _one(aborts),
        "stage.Control": st.lists(controls(t, runs, commits, aborts), min_size=0, max_size=4),
        "stage.GetState": _one(st.builds(s.GetStateRequest, job_id=job, kind=kinds)),
        "stage.LoadState": _framed_requests(t, s.LoadStateRequest),
        "stage.ApplyState": _one(st.builds(s.ApplyStateRequest, job_id=job, apply=st.booleans())),
        "stage.Release": _one(st.builds(s.ReleaseRequest, job_id=job)),
        "stage.Info": st.just([s.InfoRequest()]),
        "stage.Exchange": data_frames(t),
    }


def requests(rpc: Rpc, t: Target) -> Strategy[list[Message]]:
    """Well-formed requests for ``rpc``: the base ones, with field noise, or fully random."""
    size = (0, 4) if rpc.request_streaming else (1, 1)
    randoms = st.lists(messages(rpc.method.input_type, t), min_size=size[0], max_size=size[1])
    base = _bases(t).get(rpc.id, randoms)  # an RPC added since: fuzzed from its descriptor
    return st.one_of(base, noisy(base, t), randoms)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def mutated(draw: st.DrawFn, payload: bytes) -> bytes:
    """``payload`` changed on the wire: bytes flipped, inserted, deleted or cut off (which
    mostly breaks the encoding), or fields appended that keep it parseable (an unknown field,
    the message again, which protobuf merges, or a varint where a field expects bytes)."""
    buf = bytearray(payload)
    ops = st.tuples(
        st.sampled_from(("unknown", "again", "retype", "flip", "insert", "delete", "truncate")),
        st.integers(0, 2**16),
        st.integers(0, 255),
    )
    for op, position, byte in draw(st.lists(ops, min_size=1, max_size=3)):
        i = position % (len(buf) + 1)
        if op == "unknown":
            number = draw(st.sampled_from((15, 99, 2**29 - 1)))
            buf += _varint(number << 3) + _varint(position) if byte % 2 else b""
            buf += _varint(number << 3 | 2) + _varint(1) + bytes([byte])
        elif op == "again":
            buf += payload
        elif op == "retype":
            buf += _varint(1 << 3) + _varint(position)  # field 1 as a varint
        elif op == "insert":
            buf.insert(i, byte)
        elif op == "truncate":
            del buf[i:]
        elif not buf or i == len(buf):
            continue
        elif op == "flip":
            buf[i] ^= 1 << (byte % 8)
        else:
            del buf[i]
    return bytes(buf)


# -- keeping the real job intact -----------------------------------------------------------------


def _junk_id(job_id: str) -> str:
    return f"not-{job_id}"


def _would_train(request: coordinator_pb2.TrainStepRequest, t: Target) -> bool:
    """Whether the batch fits the real job (a valid step, which the fuzzer must not run)."""
    payloads = [memoryview(p) for p in request.payloads]
    try:
        x = decode(request.inputs, CODEC_LIMITS, payloads)
        y = decode(request.targets, CODEC_LIMITS, payloads)
    except PipesvcError:
        return False
    return (
        x.dtype == torch.float32
        and x.dim() >= 2
        and x.shape[-1] == t.in_features
        and tuple(y.shape) == (*x.shape[:-1], t.out_features)
    )


def _may_assign(request: stage_pb2.AssignRequest) -> bool:
    """Whether an Assign might succeed: a stage takes any job it is given (dropping the real
    one), so only Assigns that fail are fuzzed past their first checks."""
    if not request.job_id:
        return False
    try:
        config_from_proto(request.spec)
    except PipesvcError:
        return False
    return request.stage.start_layer != request.stage.end_layer


def _loads_full_state(requests: list[Message | None], t: Target) -> bool:
    """Whether a coordinator LoadState stream is a complete, valid state for the real job
    (its state_dict, plus optimizer state for its parameters if any).

    Only the part before the first message the server cannot parse counts: the server may
    treat that failure as the end of the stream.
    """
    prefix: list[Any] = []
    for request in requests:
        if request is None:
            break
        prefix.append(request)
    if not prefix or any(r.job_id != t.job_id for r in prefix):
        return False
    try:
        loaded = list(read_named_frames((r.frame for r in prefix), CODEC_LIMITS))
    except PipesvcError:
        return False
    names = [name for name, _ in loaded]
    weights = {k: v for k, v in loaded if not k.startswith(OPTIM_PREFIX)}
    if len(set(names)) != len(names) or set(weights) != set(t.state):
        return False
    if any(v.shape != t.state[k].shape or v.dtype != t.state[k].dtype for k, v in weights.items()):
        return False
    for key, value in loaded:
        if key.startswith(OPTIM_PREFIX):
            param = key[len(OPTIM_PREFIX) :].rpartition(".")[0]
            if param not in t.state or (value.dim() and value.shape != t.state[param].shape):
                return False
    return True


def _safe_address(address: str, t: Target) -> bool:
    host, sep, port = address.rpartition(":")
    if address in (t.coordinator, *t.stages) or not sep:
        return True
    try:
        number = int(port)
    except ValueError:
        return True
    if not port.isdigit() or not host or number > 65535 or number == 0:
        return True  # the coordinator refuses it
    return host in ("127.0.0.1", "localhost", "[::1]") and number <= JUNK_PORTS_UP_TO


def _safe_message(rpc_id: str, request: Any, t: Target) -> bool:
    """False for a request that is a valid change of the real job (or dials a stranger)."""
    real = getattr(request, "job_id", None) == t.job_id
    if rpc_id in ("coordinator.CloseJob", "stage.Release"):
        return not real
    if rpc_id == "stage.Assign":
        return not _may_assign(request)
    if rpc_id in ("coordinator.TrainStep", "coordinator.Train"):
        return not (real and _would_train(request, t))
    if rpc_id == "stage.Control":
        kind = request.WhichOneof("kind")
        inner = {"run": "stage.RunStep", "commit": "stage.Commit", "abort": "stage.Abort"}
        return kind is None or _safe_message(inner[kind], getattr(request, kind), t)
    if rpc_id in ("stage.RunStep", "stage.Abort"):
        # Run ids belong to the coordinator: a run the stage accepts, or an abort of one,
        # uses up ids the coordinator will send. Run 0 is never one of them.
        return not (real and request.plan_epoch == t.plan_epoch and request.run_id != 0)
    if rpc_id == "stage.Exchange":
        ident = request.id
        return not (
            ident.job_id == t.job_id and ident.plan_epoch == t.plan_epoch and ident.run_id != 0
        )
    if rpc_id == "coordinator.RegisterStage":
        return _safe_address(request.address, t)
    return True


def _make_message_safe(rpc_id: str, request: Any, t: Target) -> None:
    if rpc_id == "stage.Assign":
        # An empty layer range is refused after every other check.
        request.stage.end_layer = request.stage.start_layer
    elif rpc_id == "stage.Control":
        getattr(request, request.WhichOneof("kind")).run_id = 0
    elif rpc_id in ("stage.RunStep", "stage.Abort"):
        request.run_id = 0
    elif rpc_id == "stage.Exchange":
        request.id.run_id = 0
    elif rpc_id == "coordinator.RegisterStage":
        request.address = "127.0.0.1:1"
    else:
        request.job_id = _junk_id(request.job_id)


def make_safe(rpc: Rpc, payloads: list[bytes], t: Target) -> list[bytes]:
    """The payloads, with each valid change of the real job turned into a harmless request.

    A payload the server cannot parse is left alone: it never reaches a servicer.
    """
    parsed = parse_all(rpc, payloads)
    out = list(payloads)
    for i, request in enumerate(parsed):
        if request is not None and not _safe_message(rpc.id, request, t):
            _make_message_safe(rpc.id, request, t)
            out[i] = request.SerializeToString()
    if rpc.id == "coordinator.LoadState" and _loads_full_state(parsed, t):
        for i, request in enumerate(parsed):
            if request is not None:
                request.job_id = _junk_id(request.job_id)
                out[i] = request.SerializeToString()
    return out


def parse_all(rpc: Rpc, payloads: list[bytes]) -> list[Message | None]:
    """Each payload parsed as the request type, or None where it does not parse."""
    parsed: list[Message | None] = []
    for payload in payloads:
        try:
            parsed.append(rpc.request_class.FromString(payload))
        except DecodeError:
            parsed.append(None)
    return parsed
