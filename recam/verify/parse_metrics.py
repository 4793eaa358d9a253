"""Parsing of `metrics.jsonl` as `recam.infra.runlog` writes it (step / epoch / eval records, one JSON object a line).

Unparsable lines are kept aside with the reason, never fatal; what a torn line still shows of itself (its record
type and epoch) is kept too, so that the checks can fail the epoch it belonged to. A record that follows noise on
its line (bytes written just before it, with no newline of their own) is recovered and said so.
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
    # lines whose record was read from after leading noise (the record is in `records`)
    recovered: list[Unreadable] = field(default_factory=list)


_LOST_TYPE = re.compile(r'"type"\s*:\s*"(\w+)"')
_LOST_EPOCH = re.compile(r'"epoch"\s*:\s*(-?\d+)\b')
_RECORD_START = re.compile(r'\{\s*"type"\s*:')
_DECODER = json.JSONDecoder()


def record_after_noise(line: str) -> tuple[dict, int] | None:
    """(record, characters of noise before it) when `line` ends in one whole JSON record that starts with its
    "type" key (as runlog writes them) after other bytes; None otherwise."""
    for match in _RECORD_START.finditer(line):
        try:
            obj, end = _DECODER.raw_decode(line, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and not line[end:].strip():
            return obj, match.start()
    return None


def parse_jsonl(text: str) -> ParsedLog:
    """Records of a metrics.jsonl with their line numbers; unparsable lines are kept aside, never fatal.

    What an unparsable line was (its "type" and "epoch", when the text still shows them) is kept in `lost`, so
    that a torn epoch record fails its epoch instead of vanishing from the verification.
    """
    records, lines, bad, lost, recovered = [], [], [], [], []
    raw = text.split("\n")  # JSON lines end in \n only: str.splitlines would also break inside noise at \r, \x1c...
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    for no, line in enumerate(raw, 1):
        s = line.strip()
        if not s:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            found = record_after_noise(s)
            if found is not None:
                obj, skipped = found
                recovered.append(Unreadable(no, f"recovered the record after {skipped} character(s) of noise",
                                            _excerpt(s[:skipped])))
                records.append(obj)
                lines.append(no)
                continue
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
    return ParsedLog(records, lines, bad, lost, recovered)


def looks_like_jsonl(text: str) -> bool:
    for line in text.splitlines():
        if line.strip():
            return line.lstrip().startswith("{")
    return False
