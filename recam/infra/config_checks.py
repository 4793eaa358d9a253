"""The config checks every layer may use: the error a config value that cannot work raises, and the range checks
that name the field. config/validate.py checks the fields every domain reads with them; a domain checks its own
(recam/domains/camera/checks.py) and a reward the ranges of its settings (FieldChecks, handed to its `check`), and
none of them needs an import of config/.
"""

from __future__ import annotations

import math

import ml_collections


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _get(config: ml_collections.ConfigDict, field: str):
    node = config
    for part in field.split("."):
        node = node[part]
    return node


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_int(config, field: str, low: int | None = None, high: int | None = None, why: str = "") -> None:
    """`field` must be an integer in [low, high] (None: unbounded); the message names the field and the range."""
    value = _get(config, field)
    ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    rng = "" if low is None and high is None else " " + _interval(low, high, False, False)
    _require(ok, f"{field} must be an integer{rng}, got {value!r}" + (f" ({why})" if why else ""))


def check_number(config, field: str, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False, allow_inf: bool = False, why: str = "") -> None:
    """`field` must be a number in the interval (open or closed ends), finite unless `allow_inf`."""
    value = _get(config, field)
    ok = _is_number(value) and (allow_inf or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    rng = _interval(low, high, low_open, high_open)
    _require(ok, f"{field} must be a {'' if allow_inf else 'finite '}number {rng}, got {value!r}"
             + (f" ({why})" if why else ""))


def check_choice(config, field: str, choices) -> None:
    value = _get(config, field)
    _require(value in tuple(choices), f"{field}={value!r} unknown; use one of {list(choices)}")


def check_bool(config, fields) -> None:
    for field in fields:
        value = _get(config, field)
        _require(isinstance(value, bool), f"{field} must be True or False, got {value!r}")


def check_nonempty_str(config, field: str, why: str = "") -> None:
    value = _get(config, field)
    _require(isinstance(value, str) and value.strip() != "",
             f"{field} must be a non-empty string, got {value!r}" + (f" ({why})" if why else ""))


class FieldChecks:
    """The checks above bound to one config, handed to a reward's `check` (rewards.register_reward): a reward states
    the ranges of its own config section in its module, and that module needs no import of config/."""

    def __init__(self, config: ml_collections.ConfigDict, num_processes: int | None = None):
        self.config = config
        self.num_processes = num_processes  # the launch's process count, where the caller knows it

    def require(self, cond: bool, msg: str) -> None:
        _require(cond, msg)

    def integer(self, field: str, low: int | None = None, high: int | None = None, why: str = "") -> None:
        check_int(self.config, field, low, high, why)

    def number(self, field: str, low: float | None = None, high: float | None = None, low_open: bool = False,
               high_open: bool = False, allow_inf: bool = False, why: str = "") -> None:
        check_number(self.config, field, low, high, low_open, high_open, allow_inf, why)

    def choice(self, field: str, choices) -> None:
        check_choice(self.config, field, choices)

    def boolean(self, *fields: str) -> None:
        check_bool(self.config, fields)

    def nonempty_str(self, field: str, why: str = "") -> None:
        check_nonempty_str(self.config, field, why)

    def url(self, field: str) -> None:
        value = _get(self.config, field)
        _require(isinstance(value, str) and value.startswith(("http://", "https://")),
                 f"{field} must start with http:// or https://, got {value!r}")


def eval_report_rewards(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """Rewards scored at evaluation besides the weighted ones (eval.report_rewards, comma-separated)."""
    return tuple(n.strip() for n in config.eval.report_rewards.split(",") if n.strip())
