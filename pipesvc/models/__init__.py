"""Model registry and built-in models; importing it registers ``mlp``, ``gpt`` and ``cnn``.

A model is a registered factory returning unbuilt ``LayerSpec``s, so a stage builds only its
own layer range, with weights identical to a local ``build(name, seed=..., **args)``.
"""

from __future__ import annotations

from pipesvc.models import cnn, gpt, mlp
from pipesvc.models.registry import (
    LayerInfo,
    LayerSpec,
    ModelDescription,
    TensorInfo,
    build,
    build_layer,
    build_layers,
    check_model_args,
    describe,
    import_model_modules,
    known_models,
    layer_seed,
    layer_specs,
    register_model,
)

__all__ = [
    "LayerInfo",
    "LayerSpec",
    "ModelDescription",
    "TensorInfo",
    "build",
    "build_layer",
    "build_layers",
    "check_model_args",
    "describe",
    "import_model_modules",
    "known_models",
    "layer_seed",
    "layer_specs",
    "register_model",
]

del cnn, gpt, mlp
