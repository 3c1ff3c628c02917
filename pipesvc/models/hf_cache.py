"""Generation caches of Hugging Face models on a stage: ``transformers``' own key/value
caches, one per session part, and how several sessions' caches stack into one batch (no gRPC
here)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError
from pipesvc.models.hf_checkpoint import MODELS_KEPT, checkpoint_of
from pipesvc.models.registry import CacheLayout, CacheTensors


def make_cache(directory: str) -> Any:
    """An empty ``transformers`` key/value cache for the model in ``directory`` (sliding-window
    layers keep only their window), for one generation session's part on one stage."""
    return _cache_maker(directory)()


@functools.lru_cache(maxsize=MODELS_KEPT)
def _cache_maker(directory: str) -> Any:
    """The function ``make_cache`` calls for the model in ``directory``, chosen once (a stage
    makes one per session part and step, and reading the config is not cheap)."""
    from transformers import DynamicCache

    config = checkpoint_of(directory).meta_model.config
    if _full_attention_only(config):
        return DynamicCache  # plain layers, added as blocks use them (and cheap to make)
    try:
        DynamicCache(config=config)
    except TypeError:  # transformers before the config argument
        return DynamicCache
    return functools.partial(DynamicCache, config=config)


def _full_attention_only(config: Any) -> bool:
    """Every block attends to every earlier position (no sliding window, no chunks)."""
    types = getattr(config, "layer_types", None) or ()
    return getattr(config, "sliding_window", None) is None and all(
        t == "full_attention" for t in types
    )


def _cache_tensors(cache: Any) -> CacheTensors:
    """The keys and values of each layer a ``transformers`` cache holds (a stage's cache holds
    only its own blocks')."""
    tensors: CacheTensors = {}
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.numel():
            tensors[index] = (keys, values)
    return tensors


def _cache_from_tensors(directory: str, tensors: CacheTensors) -> Any:
    """A cache holding ``tensors`` themselves (no copy: its layers keep these tensors, which may
    be views of a stacked cache, until their next append makes new ones)."""
    cache = make_cache(directory)
    for index, (keys, values) in tensors.items():
        if not isinstance(index, int):
            raise InvalidArgumentError(f"cache layer {index!r}: expected a block index")
        cache.update(keys[:, :, :0], values[:, :, :0], index)  # the layer, empty
        layer = cache.layers[index]
        if isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys, layer.values = keys, values
        else:  # a cache layer of another shape: its own append (a copy)
            cache.update(keys, values, index)
    return cache


def cache_layout(directory: str) -> CacheLayout | None:
    """How several sessions' caches of the model in ``directory`` stack into one batch (see
    [Note: fused decode] in ``pipesvc.stage.compute.fused_cache``); None for a model with
    sliding-window layers (a window's cache drops old positions, so rows of different lengths do not
    line up) and for a ``transformers`` whose caches keep no per-layer objects."""
    from transformers import DynamicCache

    if not _full_attention_only(checkpoint_of(directory).meta_model.config):
        return None
    if not hasattr(DynamicCache(), "layers"):
        return None
    return CacheLayout(
        tensors=_cache_tensors, build=functools.partial(_cache_from_tensors, directory)
    )
