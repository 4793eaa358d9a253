"""--config.plugins: modules of the user's own, imported before validation, so that what they register (rewards,
with rewards.register_reward) is known to validation and to the run without editing the project. The entry points
(scripts/train_recam.py, scripts/at_base.py) call `import_plugins` first."""

from __future__ import annotations

import importlib

from config.validate import ConfigError


def plugin_modules(config) -> list[str]:
    """The module names in config.plugins (comma-separated; '' = none)."""
    raw = config.get("plugins", "")
    if not isinstance(raw, str):
        raise ConfigError(f"plugins must be a comma-separated string of module names, got {raw!r}")
    return [name.strip() for name in raw.split(",") if name.strip()]


def import_plugins(config) -> list[str]:
    """Import every module of config.plugins, in order; the names imported. A module that fails to import is a
    one-line ConfigError naming it and why."""
    names = plugin_modules(config)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever the user's module raises, the run cannot start
            hint = " (is its folder on PYTHONPATH, or its package installed?)" if isinstance(e, ImportError) else ""
            message = " ".join(str(e).split())
            raise ConfigError(f"plugins: cannot import {name!r}: {type(e).__name__}: {message}{hint}") from e
    return names
