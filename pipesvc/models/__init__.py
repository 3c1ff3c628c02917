"""Model registry and built-in models; importing it registers ``mlp``, ``gpt`` and ``cnn``.

A model is a registered factory returning unbuilt ``LayerSpec``s, so a stage builds only its
own layer range, with weights identical to a local ``build(name, seed=..., **args)``.
``layer_rng`` and ``seeded_forward`` reproduce a job's dropout masks in one process (see
[Note: training randomness] in ``pipesvc.models.rng``).
"""

from __future__ import annotations

from pipesvc.core.model_args import check_model_args
from pipesvc.models import cnn, gpt, mlp
from pipesvc.models.hf import register_hf_model
from pipesvc.models.registry import (
    CacheLayout,
    CacheTensors,
    LayerInfo,
    LayerSpec,
    ModelDescription,
    ModelFeatures,
    TensorInfo,
    build,
    build_layer,
    build_layers,
    describe,
    import_model_modules,
    known_models,
    layer_seed,
    layer_specs,
    model_export,
    model_features,
    register_model,
    tied_parameters,
)
from pipesvc.models.rng import (
    batch_statistics,
    dropout_seed,
    layer_rng,
    seeded_forward,
    uses_rng,
)

__all__ = [
    "CacheLayout",
    "CacheTensors",
    "LayerInfo",
    "LayerSpec",
    "ModelDescription",
    "ModelFeatures",
    "TensorInfo",
    "batch_statistics",
    "build",
    "build_layer",
    "build_layers",
    "check_model_args",
    "describe",
    "dropout_seed",
    "import_model_modules",
    "known_models",
    "layer_rng",
    "layer_seed",
    "layer_specs",
    "model_export",
    "model_features",
    "register_hf_model",
    "register_model",
    "seeded_forward",
    "tied_parameters",
    "uses_rng",
]

del cnn, gpt, mlp
