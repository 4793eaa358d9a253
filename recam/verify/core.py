"""What a verification produces, and small helpers every part of it shares.

Parsing turns text into plain Python data; every check is a function over that data (no I/O) returning a
`Check` with a status (pass / warn / fail), the numbers it compared and a short explanation. A `Report` is the
checks of one log, with the lines that could not be read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PASS, WARN, FAIL = "pass", "warn", "fail"
_RANK = {PASS: 0, WARN: 1, FAIL: 2}


def worst(statuses) -> str:
    """The most severe of pass / warn / fail (pass for none)."""
    out = PASS
    for s in statuses:
        if _RANK[s] > _RANK[out]:
            out = s
    return out


@dataclass
class Check:
    """One verified property: `name` is stable (tests and tools key on it), `epoch` None means the whole run."""

    name: str
    status: str
    numbers: dict = field(default_factory=dict)
    detail: str = ""
    epoch: int | None = None
    table: list[dict] | None = None


@dataclass
class Unreadable:
    line: int
    reason: str
    text: str


@dataclass
class Report:
    source: str
    kind: str
    checks: list[Check]
    unreadable: list[Unreadable]
    epochs: list[int]
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def failing(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def find(self, name: str, epoch: int | None = None, any_epoch: bool = False) -> list[Check]:
        """Checks named `name` (of one epoch, or of every epoch when any_epoch)."""
        return [c for c in self.checks if c.name == name and (any_epoch or c.epoch == epoch)]

    def summary(self) -> dict[str, dict]:
        """Per check name: overall status and the epochs where it failed or warned."""
        out: dict[str, dict] = {}
        for c in self.checks:
            row = out.setdefault(c.name, {"status": PASS, "fail": [], "warn": [], "scopes": 0})
            row["status"] = worst([row["status"], c.status])
            row["scopes"] += 1
            if c.status != PASS:
                row[c.status].append("run" if c.epoch is None else c.epoch)
        return out


# ----------------------------------------------------------------------------------------------------------
# small helpers


def _excerpt(text: str, n: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n] + "…"


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    return None


def _float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _close(a: float, b: float, tol: float) -> bool:
    """|a - b| <= tol, relative for magnitudes above 1 (reward means of large rewards)."""
    if math.isnan(a) or math.isnan(b):
        return False
    return abs(a - b) <= tol * max(1.0, abs(b))


def _array(v: Any) -> np.ndarray | None:
    """Nested lists as float64, None when ragged or not numeric (the shape check reports those)."""
    if v is None or isinstance(v, (str, dict)):
        return None
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return a


def _short(values: list, n: int = 12) -> str:
    shown = ", ".join(str(v) for v in values[:n])
    return shown + (f", … (+{len(values) - n})" if len(values) > n else "")


def _get(config: dict | None, section: str, key: str) -> Any:
    if not isinstance(config, dict):
        return None
    sec = config.get(section)
    return sec.get(key) if isinstance(sec, dict) else None
