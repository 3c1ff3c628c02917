"""How a Hugging Face causal LM is cut into pipesvc layers, found from its structure.

[Note: recognising a family] No table names the families. A ``transformers`` causal LM fits
when its structure is the one nearly every decoder-only model has:

- a *body*: one child of the ``*ForCausalLM`` holding a ``ModuleList`` of
  ``config.num_hidden_layers`` decoder layers (``model.layers``, ``transformer.h``, ...);
- the *head*: the module ``get_output_embeddings()`` returns, a child of the causal LM;
- the body's other children, taken in the order its constructor registered them: those with
  parameters registered before the list are the embedding side (the token embedding, which
  ``get_input_embeddings()`` names, then for example GPT-2's learned positions), those
  registered after it are the final norm. Children without parameters (rotary tables,
  dropout) go to every layer that runs the body's code (see [Note: the body's own code] in
  ``hf_body.py``).

Anything else is refused with what does not fit: no decoder list, a token embedding outside the
body, parameters outside the body and the head (multi-token prediction layers), parameters on
the body itself. The registration order is how every ``transformers`` decoder-only model is
written (embeddings, layers, norm); a body that registers its final norm before its layers would
be cut wrongly, which the per-family tests against ``transformers`` would show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from pipesvc.errors import InvalidArgumentError

POSITIONS = "positions"
"""The local name of a learned position table (an ``nn.Embedding`` beside the token one)."""

STORED_ALIASES: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt_neox": (("lm_head", "embed_out"),),
}
"""(module path, older name in checkpoints) by ``model_type``: a tensor missing under the
module's path is looked up under the older name (checkpoints written before ``transformers``
renamed the part). Names only, never structure."""


@dataclass(frozen=True, slots=True)
class Family:
    """Where the parts of one causal LM live (dotted paths from the top of the model)."""

    body: str
    """The body: the child that holds the decoder layers."""
    blocks: str
    """The ``ModuleList`` of decoder layers."""
    embed: tuple[tuple[str, str], ...]
    """(local name, path) of the embedding side's parts; the first is the token embedding."""
    norm: tuple[tuple[str, str], ...]
    """(local name, path) of the parts after the decoder layers (the final norm)."""
    head: str
    """The LM head."""
    shared: tuple[str, ...]
    """Paths of the body's children without parameters (rotary tables, dropout)."""
    stored: tuple[tuple[str, str], ...] = ()
    """See ``STORED_ALIASES``."""

    @property
    def embed_path(self) -> str:
        return self.embed[0][1]


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _path_of(model: nn.Module, target: nn.Module) -> str | None:
    return next((name for name, module in model.named_modules() if module is target), None)


def find_family(model: nn.Module, model_type: str = "") -> Family:
    """The parts of ``model`` (a ``*ForCausalLM``, on any device) as pipesvc cuts it.

    Raises:
        InvalidArgumentError: the structure does not fit (see [Note: recognising a family]);
            the message names what does not fit.
    """
    kind = type(model).__name__
    config: Any = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    found = [
        (name, child, list_name)
        for name, child in model.named_children()
        for list_name, inner in child.named_children()
        if isinstance(inner, nn.ModuleList) and len(inner) == count and count
    ]
    if len(found) != 1:
        raise InvalidArgumentError(
            f"{kind} ({model_type!r}) does not fit: expected one child holding a list of "
            f"num_hidden_layers={count} decoder layers; found {len(found)}"
        )
    body_name, body, list_name = found[0]
    ask: Any = getattr(model, "get_output_embeddings", None)
    head = ask() if callable(ask) else None
    head_path = _path_of(model, head) if isinstance(head, nn.Module) else None
    if head_path is None or "." in head_path:
        raise InvalidArgumentError(
            f"{kind} ({model_type!r}) does not fit: expected an LM head as a child of the "
            f"model (get_output_embeddings()); found {head_path!r}"
        )
    ask = getattr(model, "get_input_embeddings", None)
    embedding = ask() if callable(ask) else None
    embed_name = next((n for n, c in body.named_children() if c is embedding), None)
    if embed_name is None:
        raise InvalidArgumentError(
            f"{kind} ({model_type!r}) does not fit: its token embedding "
            f"(get_input_embeddings()) is not a child of the body {body_name!r}"
        )
    outside = [
        name
        for name, child in model.named_children()
        if name not in (body_name, head_path) and _has_parameters(child)
    ]
    if outside:
        raise InvalidArgumentError(
            f"{kind} ({model_type!r}) does not fit: it holds parameters outside its body "
            f"{body_name!r} and head {head_path!r}: {', '.join(outside)}"
        )
    own = [name for name, _ in body.named_parameters(recurse=False)]
    if own:
        raise InvalidArgumentError(
            f"{kind} ({model_type!r}) does not fit: its body holds parameters of its own "
            f"({', '.join(own)}); expected them in its embedding, layers or norm"
        )
    embed, norm, shared = _sort_body_children(body, body_name, list_name, embed_name)
    return Family(
        body=body_name,
        blocks=f"{body_name}.{list_name}",
        embed=embed,
        norm=norm,
        head=head_path,
        shared=shared,
        stored=STORED_ALIASES.get(model_type, ()),
    )


def _sort_body_children(
    body: nn.Module, body_name: str, list_name: str, embed_name: str
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The body's children by where they go, in registration order: the embedding side's
    (local name, path) pairs, the token embedding ``embed_name`` first; those of the final
    norm, after the decoder list ``list_name``; and the paths of the children without
    parameters (see [Note: recognising a family])."""
    embed: list[tuple[str, str]] = [("embed", f"{body_name}.{embed_name}")]
    norm: list[tuple[str, str]] = []
    shared: list[str] = []
    after = False
    for name, child in body.named_children():
        path = f"{body_name}.{name}"
        if name == list_name:
            after = True
        elif name == embed_name:
            continue
        elif not _has_parameters(child):
            shared.append(path)
        elif after:
            norm.append(("norm" if not norm else name, path))
        else:
            local = POSITIONS if isinstance(child, nn.Embedding) else name
            if any(local == taken for taken, _ in embed):
                local = name
            embed.append((local, path))
    return tuple(embed), tuple(norm), tuple(shared)
