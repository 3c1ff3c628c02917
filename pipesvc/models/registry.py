"""The model registry: named factories of unbuilt layers, and seeded building of any layer range.

[Note: deterministic init] Layer ``i`` is built under a CPU generator seeded by
``layer_seed(seed, i)`` alone, so a stage that builds ``[start, end)`` gets exactly the weights
of layers ``start..end-1`` of ``build(name, seed=seed, **args)``. Module constructors draw from
torch's global CPU generator, so builds in this process are serialised by ``_RNG_LOCK``; other
threads must not draw from the global CPU generator while a layer is being built (a training
call of a stochastic layer takes the same lock, see [Note: training randomness] in
``pipesvc.models.rng``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from pipesvc.core.model_args import INPUT_DTYPES, MAX_INPUT_DIMS, check_model_args
from pipesvc.errors import InternalError, InvalidArgumentError, UnknownModelError
from pipesvc.models.carry import CarrySpec
from pipesvc.models.rng import RNG_LOCK as _RNG_LOCK
from pipesvc.name_registry import Registry

ModelFactory = Callable[..., list["LayerSpec"]]
"""A factory takes JSON-typed keyword arguments and returns the model's unbuilt layers."""

_FactoryT = TypeVar("_FactoryT", bound=ModelFactory)

MODEL_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")
"""Model names; no dots or slashes, so a name can never look like a module or a path."""

_FACTORIES: Registry[ModelFactory] = Registry("model", MODEL_NAME_PATTERN)


class LayerSpec:
    """One unbuilt layer: a builder and the arguments to call it with."""

    __slots__ = ("args", "builder", "kwargs")

    def __init__(self, builder: Callable[..., nn.Module], *args: object, **kwargs: object) -> None:
        self.builder = builder
        self.args = args
        self.kwargs = kwargs

    def build(self) -> nn.Module:
        """Returns a new module from ``builder(*args, **kwargs)``, on the current default device."""
        return self.builder(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.builder, "__qualname__", repr(self.builder))
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"LayerSpec({name}, {', '.join(parts)})" if parts else f"LayerSpec({name})"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """One ``state_dict`` entry of a layer."""

    name: str
    """Name relative to the layer, e.g. ``"weight"`` or ``"0.bias"``."""
    shape: tuple[int, ...]
    dtype: str
    """Without the ``torch.`` prefix, e.g. ``"float32"``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerInfo:
    """Sizes of one layer, measured without allocating it."""

    index: int
    num_parameters: int
    parameter_bytes: int
    """Bytes of the parameters alone (buffers are listed in ``tensors`` but not counted)."""
    tensors: tuple[TensorInfo, ...]
    """The layer's ``state_dict`` entries: parameters and buffers."""
    trainable_bytes: int | None = None
    """Bytes of the parameters that train (``requires_grad``): gradients and optimizer state
    are kept for these only. None: all of them."""
    activation_bytes: int = 0
    """Bytes autograd keeps for the layer's backward per micro-batch (storages of the tensors
    it saves, its own parameters and buffers excluded), measured when ``describe`` is given an
    input shape; 0 otherwise. A tensor saved by two neighbouring layers counts in both, so a
    sum over layers errs high."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDescription:
    """The layers of a model as built with given arguments."""

    name: str
    layers: tuple[LayerInfo, ...]

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def parameter_counts(self) -> list[int]:
        """Parameters per layer, in layer order (the planner's input)."""
        return [layer.num_parameters for layer in self.layers]


def register_model(name: str) -> Callable[[_FactoryT], _FactoryT]:
    """Returns a decorator that registers a model factory under ``name``.

    Raises:
        InvalidArgumentError: ``name`` does not match ``MODEL_NAME_PATTERN``, or is already
            registered to a different function.
    """
    _FACTORIES.check_name(name)

    def decorator(factory: _FactoryT) -> _FactoryT:
        _FACTORIES.register(name, factory)
        return factory

    return decorator


def model_export(name: str, model_args: Mapping[str, object]) -> dict[str, object] | None:
    """How model ``name`` maps to its own format (a JSON object), or None if it has none.

    A factory may carry an ``export`` attribute: a function of the model arguments returning
    that object; Hugging Face models return ``{"format": "huggingface", "config": ...,
    "keys": {"{layer}.{name}": key}, ...}`` (see ``pipesvc.models.hf``).

    Raises:
        UnknownModelError: ``name`` is not registered.
    """
    layer_specs(name, model_args)  # checks the name and the arguments
    hook = getattr(_FACTORIES.get(name), "export", None)
    if hook is None:
        return None
    result: dict[str, object] = hook(**model_args)
    return result


def tied_parameters(name: str, model_args: Mapping[str, object]) -> list[tuple[str, ...]]:
    """The groups of global keys (``"{layer}.{name}"``) whose parameters model ``name`` ties
    (see [Note: tied parameters] in ``pipesvc.core.tying``); empty if it ties none.

    A factory may carry a ``tied`` attribute: a function of the model arguments returning them.

    Raises:
        UnknownModelError: ``name`` is not registered.
    """
    hook = getattr(_FACTORIES.get(name), "tied", None)
    if hook is None:
        return []
    return [tuple(group) for group in hook(**model_args)]


CacheTensors = dict[Hashable, tuple[torch.Tensor, torch.Tensor]]
"""A cache's keys and values by layer, each ``[rows, heads, length, head_dim]``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheLayout:
    """How a model's generation cache shows its tensors, so a stage can stack several
    sessions' caches into one micro-batch and split them again (see [Note: fused decode] in
    ``pipesvc.stage.compute.fused_cache``)."""

    tensors: Callable[[Any], CacheTensors]
    """The cache's keys and values by layer (every layer it holds, all of one length)."""
    build: Callable[[CacheTensors], Any]
    """A cache holding these keys and values."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFeatures:
    """What a model's layers take beside the activations."""

    side_inputs: tuple[str, ...] = ()
    """Side inputs some layer reads (see [Note: side inputs] in ``pipesvc.core.microbatch``)."""
    new_cache: Callable[[], Any] | None = None
    """Makes an empty key/value cache for generation, passed as ``cache`` to the layers that
    set ``uses_cache``; None when the model has no cache (generation recomputes)."""
    cache_layout: CacheLayout | None = None
    """How to stack and split its caches; None when sessions cannot share a micro-batch (the
    model also needs to read ``attention_mask``, which hides the stacking's padding)."""
    max_positions: int | None = None
    """The most positions the model takes (a prompt and its new tokens together; a learned
    position table's size, a config's ``max_position_embeddings``); None when unbounded.
    Generation refuses a request past it before any token."""
    carry: CarrySpec | None = None
    """The vector a training micro-batch carries beside its activations, whose total adds a
    term to the loss (see [Note: carried vector] in ``pipesvc.models.carry``); None: none."""

    @property
    def fuses_caches(self) -> bool:
        """Whether decode steps of several sessions can share a micro-batch."""
        return self.cache_layout is not None and "attention_mask" in self.side_inputs


def model_features(name: str, model_args: Mapping[str, object]) -> ModelFeatures:
    """The side inputs and the generation cache of model ``name``: a factory may carry
    ``side_inputs`` (a tuple of names), ``new_cache`` (a function of the model arguments
    returning a function that makes a cache), ``cache_layout`` (a function of the model
    arguments returning a ``CacheLayout`` or None), ``max_positions`` (a function of the
    model arguments returning an int or None) and ``carry`` (a function of the model
    arguments returning a ``CarrySpec`` or None).

    Raises:
        UnknownModelError: ``name`` is not registered.
    """
    factory = _FACTORIES.get(name, _unknown_model)
    cache_hook = getattr(factory, "new_cache", None)
    layout_hook = getattr(factory, "cache_layout", None)
    positions_hook = getattr(factory, "max_positions", None)
    carry_hook = getattr(factory, "carry", None)
    return ModelFeatures(
        side_inputs=tuple(getattr(factory, "side_inputs", ())),
        new_cache=cache_hook(**model_args) if cache_hook is not None else None,
        cache_layout=layout_hook(**model_args) if layout_hook is not None else None,
        max_positions=positions_hook(**model_args) if positions_hook is not None else None,
        carry=carry_hook(**model_args) if carry_hook is not None else None,
    )


def known_models() -> list[str]:
    """Returns the registered model names, sorted."""
    return sorted(_FACTORIES.names())


def _unknown_model(name: object, known: tuple[str, ...]) -> UnknownModelError:
    return UnknownModelError(f"unknown model {name!r}; known models: {', '.join(sorted(known))}")


def layer_specs(name: str, model_args: Mapping[str, object]) -> list[LayerSpec]:
    """Returns the unbuilt layers of model ``name`` with ``model_args``; builds nothing.

    Raises:
        UnknownModelError: ``name`` is not registered.
        InvalidArgumentError: the arguments are not JSON-typed, do not fit the factory's
            signature, are rejected by the factory, or give no layers.
        InternalError: the factory returned something other than a list of ``LayerSpec``.
    """
    factory = _FACTORIES.get(name, _unknown_model)
    check_model_args(model_args)
    _bind_args(name, factory, model_args)
    try:
        specs = factory(**model_args)
    except InvalidArgumentError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"model {name!r} rejected its arguments: {exc}") from exc
    if not isinstance(specs, list | tuple) or not all(isinstance(s, LayerSpec) for s in specs):
        raise InternalError(f"model {name!r} factory must return a list of LayerSpec")
    if not specs:
        raise InvalidArgumentError(
            f"model {name!r} with arguments {dict(model_args)} has no layers"
        )
    return list(specs)


def _bind_args(name: str, factory: ModelFactory, model_args: Mapping[str, object]) -> None:
    params = inspect.signature(factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = [p.name for p in params if p.kind in kinds]
    unexpected = sorted(set(model_args) - set(accepted))
    missing = [p.name for p in params if p.kind in kinds and p.default is p.empty]
    missing = [m for m in missing if m not in model_args]
    if unexpected or missing:
        problem = (
            f"unexpected argument(s) {', '.join(map(repr, unexpected))}"
            if unexpected
            else f"missing argument(s) {', '.join(map(repr, missing))}"
        )
        raise InvalidArgumentError(
            f"model {name!r}: {problem}; accepted arguments: {', '.join(accepted) or '(none)'}"
        )


def layer_seed(seed: int, index: int) -> int:
    """Returns the init seed of layer ``index``: a stable hash of ``(seed, index)``.

    The result lies in [0, 2**63) and is the same in every process, platform and run.
    """
    digest = hashlib.blake2b(f"pipesvc.layer:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_layer(
    spec: LayerSpec, *, seed: int, index: int, device: torch.device | str | None = None
) -> nn.Module:
    """Builds one layer on the CPU from ``layer_seed(seed, index)``, then moves it to ``device``.

    The global RNG state is left unchanged.

    Raises:
        InvalidArgumentError: the builder raised ``TypeError`` or ``ValueError``.
    """
    with _RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        module = _construct(spec, index, torch.device("cpu"))
    return module if device is None else module.to(device)


def _construct(spec: LayerSpec, index: int, default_device: torch.device) -> nn.Module:
    try:
        with default_device:
            return spec.build()
    except InvalidArgumentError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"building layer {index} ({spec!r}) failed: {exc}") from exc
    except (RuntimeError, MemoryError) as exc:
        # Absurd sizes from request arguments (e.g. a layer of 2**63 features) end here.
        raise InvalidArgumentError(
            f"building layer {index} ({spec!r}) failed; are the model arguments sane? {exc}"
        ) from exc


def build_layers(
    name: str,
    model_args: Mapping[str, object],
    *,
    seed: int,
    start_layer: int,
    end_layer: int,
    device: torch.device | str | None = None,
) -> list[nn.Module]:
    """Builds layers ``[start_layer, end_layer)`` of a model, and no others.

    Raises:
        UnknownModelError: ``name`` is not registered.
        InvalidArgumentError: bad arguments, or not ``0 <= start_layer < end_layer <= num_layers``.
    """
    specs = layer_specs(name, model_args)
    if not 0 <= start_layer < end_layer <= len(specs):
        raise InvalidArgumentError(
            f"layer range [{start_layer}, {end_layer}) of model {name!r} must satisfy "
            f"0 <= start_layer < end_layer <= num_layers ({len(specs)})"
        )
    return [
        build_layer(specs[i], seed=seed, index=i, device=device)
        for i in range(start_layer, end_layer)
    ]


def build(name: str, *, seed: int = 0, **model_args: object) -> nn.Sequential:
    """Builds the whole model locally; ``state_dict`` keys are ``"{layer}.{param}"``.

    Raises:
        UnknownModelError: ``name`` is not registered.
        InvalidArgumentError: the arguments are invalid.
    """
    specs = layer_specs(name, model_args)
    return nn.Sequential(*(build_layer(s, seed=seed, index=i) for i, s in enumerate(specs)))


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Runs ``module`` on ``x`` (meta tensors) and sums the storages autograd saves."""
    own = {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    return y, sum(saved.values())


def describe(
    name: str,
    model_args: Mapping[str, object],
    *,
    input_shape: Sequence[int] | None = None,
    input_dtype: str = "float32",
) -> ModelDescription:
    """Describes every layer's tensors by building it on the meta device (no memory used).

    With ``input_shape`` (one micro-batch's input, batch dimension first) a forward pass on the
    meta device also measures each layer's ``activation_bytes``.

    Raises:
        UnknownModelError: ``name`` is not registered.
        InvalidArgumentError: the arguments are invalid, or the layers do not accept an input
            of that shape and dtype.
    """
    x: torch.Tensor | None = None
    if input_shape:
        dtype = INPUT_DTYPES.get(input_dtype)
        if dtype is None:
            raise InvalidArgumentError(
                f"input_dtype {input_dtype!r} is not supported; expected one of "
                f"{', '.join(INPUT_DTYPES)}"
            )
        shape = tuple(input_shape)
        if not 1 <= len(shape) <= MAX_INPUT_DIMS or not all(1 <= d <= 2**40 for d in shape):
            raise InvalidArgumentError(
                f"input_shape {list(shape)} must have 1 to {MAX_INPUT_DIMS} dimensions, each in "
                "[1, 2**40]"
            )
        x = torch.empty(shape, dtype=dtype, device="meta")
        if x.is_floating_point():
            x.requires_grad_(True)
    layers = []
    for index, spec in enumerate(layer_specs(name, model_args)):
        with _RNG_LOCK, torch.random.fork_rng(devices=[]):
            module = _construct(spec, index, torch.device("meta"))
        activation_bytes = 0
        if x is not None:
            in_shape = list(x.shape)
            try:
                x, activation_bytes = _saved_bytes(module, x)
            except (RuntimeError, IndexError, ValueError, TypeError) as exc:
                raise InvalidArgumentError(
                    f"layer {index} of {name!r} does not accept an input of shape {in_shape} and "
                    f"dtype {str(x.dtype).removeprefix('torch.')}: {exc}"
                ) from exc
        tensors = tuple(
            TensorInfo(name=key, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for key, t in module.state_dict().items()
        )
        params = list(module.parameters())
        layers.append(
            LayerInfo(
                index=index,
                num_parameters=sum(p.numel() for p in params),
                parameter_bytes=sum(p.numel() * p.element_size() for p in params),
                trainable_bytes=sum(
                    p.numel() * p.element_size() for p in params if p.requires_grad
                ),
                tensors=tensors,
                activation_bytes=activation_bytes,
            )
        )
    return ModelDescription(name=name, layers=tuple(layers))


def import_model_modules(modules: Sequence[str]) -> list[str]:
    """Imports operator-named modules that register models; never call with request data.

    Returns:
        The model names newly registered by these imports, sorted.

    Raises:
        InvalidArgumentError: a module cannot be imported.
    """
    before = set(known_models())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise InvalidArgumentError(f"cannot import model module {module!r}: {exc}") from exc
    return sorted(set(known_models()) - before)
