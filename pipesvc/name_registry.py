"""A named registry: the one implementation behind the schedule, partition and model registries.

[Note: registries] Schedules, partition methods and models are each a process-wide map from a
checked name to a function, filled at import time by decorators and read by everything that
names one. The three share the rules kept here: a name must match the registry's pattern, a name
can be registered again only to the same function (re-importing a module is harmless, two
modules claiming one name is an error), and asking for an unknown name lists the known ones.
The lock makes registration from a thread (an operator's model module imported late) safe
against concurrent lookups.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from pipesvc.errors import InvalidArgumentError, PipesvcError

__all__ = ["NAME_RULE", "Registry"]

T = TypeVar("T")

NAME_RULE = "lowercase letters, digits, '_' and '-'; at most 64 characters"
"""How the pipesvc registries' name patterns read in an error message (the default rule)."""


def _identity(value: object) -> object:
    return value


def _where(function: object) -> str:
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(function)


class Registry(Generic[T]):
    """Names mapped to values of type ``T``, in registration order; safe across threads.

    ``kind`` names what is registered in the messages (``"schedule"``, ``"model"``); ``rule``
    says in words what ``pattern`` accepts.
    ``origin`` gives the function a value was registered for, used to tell a repeated
    registration (the same function: accepted) from a clash (another one: refused) and to name
    the holder of a taken name; by default the value itself.
    """

    def __init__(
        self,
        kind: str,
        pattern: re.Pattern[str],
        *,
        origin: Callable[[T], object] = _identity,
        rule: str = NAME_RULE,
    ) -> None:
        self.kind = kind
        self.pattern = pattern
        self.rule = rule
        self._origin = origin
        self._entries: dict[str, T] = {}
        self._lock = threading.Lock()

    def check_name(self, name: object) -> str:
        """Returns ``name`` if it may be registered.

        Raises:
            InvalidArgumentError: ``name`` is not a string matching the pattern.
        """
        if not isinstance(name, str) or self.pattern.fullmatch(name) is None:
            raise InvalidArgumentError(
                f"{self.kind} name {name!r} must match {self.pattern.pattern!r} ({self.rule})"
            )
        return name

    def register(self, name: str, value: T) -> T:
        """Registers ``value`` under ``name`` and returns it.

        Raises:
            InvalidArgumentError: ``name`` does not match the pattern, or is already registered
                for a different function.
        """
        self.check_name(name)
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None and self._origin(existing) is not self._origin(value):
                raise InvalidArgumentError(
                    f"{self.kind} name {name!r} is already registered to "
                    f"{_where(self._origin(existing))}"
                )
            self._entries[name] = value
        return value

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        with self._lock:
            return tuple(self._entries)

    def get(
        self,
        name: object,
        unknown: Callable[[object, tuple[str, ...]], PipesvcError] | None = None,
    ) -> T:
        """The value registered under ``name``.

        ``unknown(name, known_names)`` builds the error for a name not registered; by default
        ``InvalidArgumentError("unknown <kind> 'x'; expected one of a, b")``.

        Raises:
            PipesvcError: ``name`` is not registered (``InvalidArgumentError`` by default); the
                message lists the known names.
        """
        with self._lock:
            found = self._entries.get(name) if isinstance(name, str) else None
            known = tuple(self._entries)
        if found is not None:
            return found
        if unknown is not None:
            raise unknown(name, known)
        raise InvalidArgumentError(
            f"unknown {self.kind} {name!r}; expected one of {', '.join(known)}"
        )

    @contextmanager
    def scratch(self) -> Iterator[Registry[T]]:
        """Restores the registrations made before the block when it exits (for tests)."""
        with self._lock:
            saved = dict(self._entries)
        try:
            yield self
        finally:
            with self._lock:
                self._entries = saved
