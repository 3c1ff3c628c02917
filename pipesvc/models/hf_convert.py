"""Tensor names and layouts of a model in memory vs. in its published checkpoint files.

[Note: stored layouts] ``transformers`` 5 keeps a mixture-of-experts layer's experts as one
stacked tensor (``mlp.experts.gate_up_proj`` of shape ``[experts, 2 * inner, hidden]``), while
published checkpoints (and ``save_pretrained``) hold one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``), sometimes under an older module name (Mixtral's
``block_sparse_moe``). ``transformers`` describes the difference as data per ``model_type``
(its conversion mapping): renamings, and merges that stack per-expert tensors and concatenate
projections. ``Layout`` is that data, read once; a stage reading its layers' tensors by byte
range asks ``sources`` which stored tensors make one model tensor and ``combine`` builds it,
and an export writes the model's tensors back as the files hold them (``to_stored``), so the
exported directory has the layout ``save_pretrained`` writes. Conversions other than
renaming, stacking and concatenating are refused by name when the layout is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipesvc.errors import InvalidArgumentError

_PLAIN = re.compile(r"^[\w.]+$")
"""A pattern that is a plain dotted name (``.`` in transformers' patterns matches itself
there); patterns with other regex syntax are left to ``transformers``' own loader."""


@dataclass(frozen=True, slots=True)
class Merge:
    """Stored tensors ``prefix + source`` (``*``: each expert's index) -> the model tensor
    ``prefix + target``: each source stacked over experts along ``stack_dim``, then the
    sources concatenated along ``cat_dim``."""

    sources: tuple[str, ...]
    target: str
    stack_dim: int | None
    cat_dim: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "sources": list(self.sources),
            "target": self.target,
            "stack_dim": self.stack_dim,
            "cat_dim": self.cat_dim,
        }


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model's tensors are stored (see [Note: stored layouts]); empty: as in memory."""

    renamings: tuple[tuple[str, str], ...] = ()
    """(stored, in memory) name parts."""
    merges: tuple[Merge, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form, what an export description carries."""
        return {
            "renamings": [list(pair) for pair in self.renamings],
            "merges": [merge.as_dict() for merge in self.merges],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any] | None) -> Layout:
        if not data:
            return Layout()
        return Layout(
            renamings=tuple((str(a), str(b)) for a, b in data.get("renamings", ())),
            merges=tuple(
                Merge(
                    sources=tuple(str(s) for s in m["sources"]),
                    target=str(m["target"]),
                    stack_dim=m["stack_dim"],
                    cat_dim=m["cat_dim"],
                )
                for m in data.get("merges", ())
            ),
        )

    def stored_name(self, name: str) -> str:
        """``name`` (in memory) as the files name it, renamings applied."""
        for stored, memory in self.renamings:
            name = name.replace(memory, stored)
        return name

    def sources(
        self, name: str, exists: Callable[[str], bool]
    ) -> tuple[list[str], Callable[[list[torch.Tensor]], torch.Tensor]] | None:
        """The stored tensors that make the model tensor ``name`` and how to combine them
        (in that order), or None when no merge makes it. ``exists`` says whether the files
        hold a name (the number of experts is how many the files hold)."""
        for merge in self.merges:
            if not name.endswith(merge.target):
                continue
            prefix = name[: -len(merge.target)]
            groups: list[list[str]] = []
            for source in merge.sources:
                group: list[str] = []
                while True:
                    wanted = prefix + source.replace("*", str(len(group)))
                    found = next((n for n in (wanted, self.stored_name(wanted)) if exists(n)), None)
                    if found is None:
                        break
                    group.append(found)
                if not group:
                    return None
                groups.append(group)
            sizes = [len(g) for g in groups]
            return [n for g in groups for n in g], _combiner(merge, sizes)
        return None

    def to_stored(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors as its files hold them: merged tensors split back per expert and
        projection, every name renamed (what ``save_pretrained`` writes)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            merge = next((m for m in self.merges if name.endswith(m.target)), None)
            if merge is None:
                out[self.stored_name(name)] = tensor
                continue
            prefix = name[: -len(merge.target)]
            parts = (
                list(tensor.chunk(len(merge.sources), dim=merge.cat_dim))
                if merge.cat_dim is not None
                else [tensor]
            )
            for source, part in zip(merge.sources, parts, strict=True):
                if merge.stack_dim is None:
                    out[self.stored_name(prefix + source)] = part.contiguous()
                    continue
                for index, expert in enumerate(part.unbind(merge.stack_dim)):
                    stored = self.stored_name(prefix + source.replace("*", str(index)))
                    out[stored] = expert.contiguous()
        return out


def _combiner(merge: Merge, sizes: list[int]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        parts, start = [], 0
        for size in sizes:
            group = tensors[start : start + size]
            start += size
            if merge.stack_dim is not None:
                parts.append(torch.stack(group, dim=merge.stack_dim))
            else:
                parts.append(group[0])
        if merge.cat_dim is not None:
            return torch.cat(parts, dim=merge.cat_dim)
        return parts[0]

    return combine


def layout_of(model_type: str) -> Layout:
    """The stored layout of ``model_type`` from ``transformers``' conversion mapping.

    Raises:
        InvalidArgumentError: the mapping holds a conversion other than renaming, stacking
            and concatenating (named in the message).
    """
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers before 5: checkpoints are stored as in memory
        return Layout()
    rules = get_checkpoint_conversion_mapping(model_type) or []
    renamings: list[tuple[str, str]] = []
    merges: list[Merge] = []
    for rule in rules:
        kind = type(rule).__name__
        sources = list(getattr(rule, "source_patterns", []))
        targets = list(getattr(rule, "target_patterns", []))
        if kind == "WeightRenaming":
            if len(sources) == 1 and len(targets) == 1 and _PLAIN.match(sources[0] + targets[0]):
                renamings.append((sources[0], targets[0]))
            continue  # a regex renaming (prefixes of multimodal models): not a part we read
        ops = [type(op).__name__ for op in getattr(rule, "operations", [])]
        stack = cat = None
        for op in getattr(rule, "operations", []):
            name = type(op).__name__
            if name == "MergeModulelist" and stack is None:
                stack = int(op.dim)
            elif name == "Concatenate" and cat is None and op.num_shards_attribute is None:
                cat = int(op.dim)
            else:
                raise InvalidArgumentError(
                    f"model_type {model_type!r} stores {targets} through conversions {ops}; "
                    "pipesvc reads renamed, stacked and concatenated tensors only"
                )
        if len(targets) != 1 or not all("*" in s or stack is None for s in sources):
            raise InvalidArgumentError(
                f"model_type {model_type!r}: a conversion from {sources} to {targets} is not "
                "one pipesvc reads (expected per-expert sources and one target)"
            )
        merges.append(Merge(tuple(sources), targets[0], stack, cat))
    return Layout(tuple(renamings), tuple(merges))
