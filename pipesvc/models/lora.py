"""LoRA adapters on a stage's layers, through peft: only the adapters train.

[Note: LoRA on stages] A job names the adapters in its model arguments (``lora={"r": 8,
"lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}``, peft's ``LoraConfig`` fields);
each stage adds them to the layers it builds with peft's ``inject_adapter_in_model`` and freezes
every other parameter, so frozen weights get no gradient and no optimizer state and nothing of
them crosses the network. Adapters are created while the layer is built, so their initial
values come from the layer's init seed (see [Note: deterministic init]) and every stage that
builds a layer builds the same adapters. A layer with no targeted module (the embedding, the
head) is frozen whole. Only a whitelist of ``LoraConfig`` fields is accepted from a request.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pipesvc.errors import InvalidArgumentError

LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")
"""The ``LoraConfig`` fields a request may set; the rest keep peft's defaults."""
ADAPTER_MARK = "lora_"
"""Every adapter parameter's name contains this."""


def check_lora(args: Mapping[str, object]) -> dict[str, object]:
    """Checks a request's LoRA arguments; returns them as ``LoraConfig`` keyword arguments.

    Raises:
        InvalidArgumentError: an unknown field, or a value of the wrong type or range.
    """
    if not isinstance(args, Mapping):
        raise InvalidArgumentError(f"lora must be a mapping of LoraConfig fields, got {args!r}")
    unknown = sorted(set(args) - set(LORA_FIELDS))
    if unknown:
        raise InvalidArgumentError(
            f"lora field(s) {', '.join(map(repr, unknown))} are not accepted; expected some "
            f"of {', '.join(LORA_FIELDS)}"
        )
    r = args.get("r", 8)
    if type(r) is not int or not 1 <= r <= 4096:
        raise InvalidArgumentError(f"lora r ({r!r}) must be an int in [1, 4096]")
    alpha = args.get("lora_alpha", 8)
    if type(alpha) not in (int, float) or not 0 < float(alpha) <= 1e6:  # type: ignore[arg-type]
        raise InvalidArgumentError(f"lora lora_alpha ({alpha!r}) must be a number in (0, 1e6]")
    dropout = args.get("lora_dropout", 0.0)
    if type(dropout) not in (int, float) or not 0 <= float(dropout) < 1:  # type: ignore[arg-type]
        raise InvalidArgumentError(f"lora lora_dropout ({dropout!r}) must be in [0, 1)")
    targets = args.get("target_modules")
    if not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise InvalidArgumentError(
            f"lora target_modules ({targets!r}) must be a non-empty list of module names, "
            'e.g. ["q_proj", "v_proj"]'
        )
    if type(args.get("use_rslora", False)) is not bool:
        raise InvalidArgumentError(f"lora use_rslora ({args.get('use_rslora')!r}) must be a bool")
    return dict(args)


def _targets(layer: nn.Module, targets: list[str]) -> bool:
    # peft's rule for a list: a module matches if its name is a target or ends in ".target".
    return any(
        name == t or name.endswith(f".{t}") for name, _ in layer.named_modules() for t in targets
    )


def add_lora(layer: nn.Module, args: Mapping[str, object]) -> nn.Module:
    """Adds LoRA adapters to ``layer`` where ``args["target_modules"]`` match and freezes every
    other parameter (see [Note: LoRA on stages])."""
    kwargs = check_lora(args)
    targets = kwargs["target_modules"]
    assert isinstance(targets, list)
    if _targets(layer, targets):
        from peft import LoraConfig, inject_adapter_in_model  # optional dependency

        inject_adapter_in_model(LoraConfig(**kwargs), layer)
    for name, param in layer.named_parameters():
        param.requires_grad_(ADAPTER_MARK in name)
    return layer
