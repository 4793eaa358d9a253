"""Parsing of `metrics.jsonl` as `recam.infra.runlog` writes it (step / epoch / eval records, one JSON object a line).

Unparsable lines are kept aside with the reason, never fatal; what a torn line still shows of itself (its record
type and epoch) is kept too, so that the checks can fail the epoch it belonged to.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from recam.verify.core import Unreadable, _excerpt


@dataclass
class ParsedLog:
    records: list[dict]
    lines: list[int]
    unreadable: list[Unreadable]
    # (line, record type, epoch) recovered from the text of unparsable lines, where it shows them
    lost: list[tuple[int, str | None, int | None]] = field(default_factory=list)


_LOST_TYPE = re.compile(r'"type"\s*:\s*"(\w+)"')
_LOST_EPOCH = re.compile(r'"epoch"\s*:\s*(-?\d+)\b')


def parse_jsonl(text: str) -> ParsedLog:
    """Records of a metrics.jsonl with their line numbers; unparsable lines are kept aside, never fatal.

    What an unparsable line was (its "type" and "epoch", when the text still shows them) is kept in `lost`, so
    that a torn epoch record fails its epoch instead of vanishing from the verification.
    """
    records, lines, bad, lost = [], [], [], []
    raw = text.splitlines()
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    for no, line in enumerate(raw, 1):
        s = line.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            reason = ("torn last line (the run was probably killed mid-write)" if no == last
                      else f"not valid JSON ({e.msg}, column {e.colno})")
            bad.append(Unreadable(no, reason, _excerpt(s)))
            kind, epoch = _LOST_TYPE.search(s), _LOST_EPOCH.search(s)
            lost.append((no, kind.group(1) if kind else None, int(epoch.group(1)) if epoch else None))
            continue
        if not isinstance(obj, dict):
            bad.append(Unreadable(no, f"a JSON {type(obj).__name__}, not a record", _excerpt(s)))
            continue
        records.append(obj)
        lines.append(no)
    return ParsedLog(records, lines, bad, lost)


def looks_like_jsonl(text: str) -> bool:
    for line in text.splitlines():
        if line.strip():
            return line.lstrip().startswith("{")
    return False
