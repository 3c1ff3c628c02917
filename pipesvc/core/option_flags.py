"""Command-line flags generated from the option dataclasses they fill.

[Note: flags from options] A server's settings are frozen dataclasses (``StageOptions``,
``CoordinatorOptions``, ``Deadlines``, ``Limits``); a field that the command line sets carries
``flag(...)`` in its metadata. ``add_flags`` turns each into ``--its-name`` (or the name given)
with the field's default and, as help, the docstring under the field; ``flag_values`` reads
the parsed values back by field name. Each default and each help text is written once, on the
field, and cannot drift from what the server does.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
from collections.abc import Callable
from typing import Any, Protocol

_KEY = "pipesvc.flag"
_NOTE_POINTER = re.compile(r" ?\(see \[" + r"Note: [^\]]+\][^)]*\)")
"""A docstring's pointer to one of the code's notes (useless in a flag's help)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FlagSpec:
    """How one field is set from the command line."""

    name: str | None
    """The flag, e.g. ``--kv-budget``; None: ``--`` and the field's name with dashes."""
    parse: Callable[[str], Any] | None
    """Turns the flag's text into the field's value; None: the default's own type."""
    show: Callable[[Any], str] | None
    """Writes the default as the flag takes it (a byte size as ``256MiB``); None: as is."""
    hidden: bool
    """A flag for tests, left out of ``--help``."""


def flag(
    name: str | None = None,
    *,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    hidden: bool = False,
) -> dict[str, Any]:
    """Field metadata that makes the field a command-line flag (``field(metadata=flag())``)."""
    return {_KEY: FlagSpec(name, parse, show, hidden)}


class _Adds(Protocol):
    def add_argument(self, *names: str, **kwargs: Any) -> Any: ...


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls``.

    Raises:
        KeyError: no such field, or it has no default.
    """
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under the fields of dataclass ``cls``; empty when its source cannot be
    read."""
    try:
        tree = ast.parse(inspect.getsource(cls).strip())
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def help_text(doc: str, *, show_default: bool = True) -> str:
    """A field's docstring as argparse help: its first letter lower-cased (unless it opens an
    acronym such as HOST), pointers to the code's notes left out, the default after it."""
    text = _NOTE_POINTER.sub("", doc).replace("%", "%%").rstrip(".")
    if text[1:2].islower():
        text = text[:1].lower() + text[1:]
    if not show_default:
        return text
    return f"{text} (default %(default)s)" if text else "default %(default)s"


def bytes_text(count: int) -> str:
    """``268435456`` as ``"256MiB"``: a size in the form the byte-size flags take."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


def _specs(cls: type, every_field: bool) -> list[tuple[dataclasses.Field[Any], FlagSpec]]:
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None and every_field:
            spec = FlagSpec(None, None, None, False)
        if spec is not None:
            found.append((f, spec))
    return found


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its error's own message as argparse's (argparse would print only
    "invalid value" for a ValueError)."""

    def parsed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parsed.__name__ = getattr(parse, "__name__", "value")
    return parsed


def add_flags(parser: _Adds, cls: type, *, every_field: bool = False) -> None:
    """Adds a flag for each field of ``cls`` marked with ``flag`` (each field at all with
    ``every_field``), named, typed, defaulted and explained by the field."""
    docs = field_docs(cls)
    for f, spec in _specs(cls, every_field):
        default = field_default(cls, f.name)
        name = spec.name or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name}
        if spec.hidden:
            kwargs["help"] = argparse.SUPPRESS
        else:
            shown = default not in (None, "")  # the docstring says what none means
            kwargs["help"] = help_text(docs.get(f.name, ""), show_default=shown)
        if isinstance(default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _argparse_type(spec.parse) if spec.parse else type(default)
            kwargs["default"] = spec.show(default) if spec.show else default
            kwargs["metavar"] = name.lstrip("-").replace("-", "_").upper()
        parser.add_argument(name, **kwargs)


def flag_values(
    args: argparse.Namespace, cls: type, *, every_field: bool = False
) -> dict[str, Any]:
    """The values ``add_flags``'s flags parsed into, by field name (argparse parses a default
    shown as text as it parses the flag's text)."""
    return {f.name: getattr(args, f.name) for f, _ in _specs(cls, every_field)}
