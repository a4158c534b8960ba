"""Name -> function registries for the RL math (advantages, policy losses, aggregations, KL).

Why a registry and not an if/elif chain over strings: a new estimator is one decorated function in
one place, the config's names are checked against what is actually registered, and an unknown name
fails with the list of names that do exist. Registering the same name twice is an error (a silent
override would make "which `grpo` ran?" unanswerable). This module holds no math.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class RegistryError(ValueError):
    """A duplicate registration or a lookup of a name that is not registered."""


class Registry(Generic[F]):
    """A flat mapping from a name to a function of one kind (`kind` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: `@REG.register("grpo")`. Raises RegistryError if `name` is taken or malformed."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise RegistryError(f"{self.kind} name must be a non-empty string without surrounding spaces, got {name!r}")

        def deco(fn: F) -> F:
            if name in self._entries:
                old = self._entries[name]
                raise RegistryError(
                    f"{self.kind} '{name}' is already registered (by {getattr(old, '__module__', '?')}."
                    f"{getattr(old, '__qualname__', old)}); pick another name"
                )
            self._entries[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        """The function registered under `name`; RegistryError listing the registered names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise RegistryError(
                f"unknown {self.kind} {name!r}; registered names: {', '.join(sorted(self._entries)) or '(none)'}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"
