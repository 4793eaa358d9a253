"""The one way names are registered (policy losses, KL estimators, objectives, domains, rewards): a decorator that
adds to a dict and refuses a duplicate or an empty name."""

from __future__ import annotations

from collections.abc import Callable


def registrar(table: dict, kind: str, name: str) -> Callable:
    """Decorator adding the decorated function or class to `table` under `name`; `kind` names it in errors."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(obj):
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = obj
        return obj

    return decorator
