"""--config.plugins: modules of the user's own, imported before validation, so that what they register (rewards,
with rewards.register_reward; policy losses, with recam.engine.losses.register_policy_loss) is known to validation
and to the run without editing the project. The entry points (scripts/train_recam.py, scripts/measure/at_base.py) call
`import_plugins` first, then `add_loss_settings`."""

from __future__ import annotations

import difflib
import importlib

from absl import flags

from config.validate import ConfigError

# How a command-line value becomes a setting of each type; absl's, so a plugin loss's setting reads like the
# preset's fields (ml_collections parses those with the same parsers).
_PARSERS = {bool: flags.BooleanParser(), int: flags.IntegerParser(), float: flags.FloatParser(),
            str: flags.ArgumentParser()}


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


def add_loss_settings(config, values: dict[str, str] | None = None) -> list[str]:
    """Add to config.train each setting of the chosen train.policy_loss that it lacks, with the loss's default (a
    plugin's loss brings settings config/base.py cannot list), then set `values` ({field: command-line text}, parsed
    as the field's type). The fields added. A value for a field that is neither in config.train nor a setting of the
    loss, or that does not parse, is a one-line ConfigError naming it."""
    from recam.engine.losses import POLICY_LOSSES, known_policy_losses

    t, name, known = config.train, config.train.policy_loss, known_policy_losses()
    if name not in known:
        raise ConfigError(f"train.policy_loss={name!r} is not registered (your own losses register in a module named "
                          f"by --config.plugins); known: {known}")
    settings = POLICY_LOSSES[name].fields()
    added = [field for field in settings if field not in t]
    with t.unlocked():
        for field in added:
            t[field] = settings[field]
    for field, raw in (values or {}).items():
        if field not in t:
            close = difflib.get_close_matches(field, [*settings, *t.keys()], n=1)
            raise ConfigError(f"train.{field} is not a config field: train has no {field!r}, and "
                              f"train.policy_loss={name!r} has no setting of that name (its settings: {list(settings)})"
                              + (f"; did you mean train.{close[0]}?" if close else ""))
        kind = type(t[field])
        try:
            value = _PARSERS[kind].parse(raw) if kind in _PARSERS else raw
        except ValueError as e:
            raise ConfigError(f"train.{field}={raw!r} must be a {kind.__name__}: {' '.join(str(e).split())}") from e
        t[field] = value
    return added
