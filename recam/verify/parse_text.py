"""Reading of plain-text training logs carrying `[GRPO Debug]` lines into epochs of sampling facts.

Logs are read as earlier GRPO codebases print them: numpy and torch reprs with or without commas, values spanning
several lines, dicts / Counter / defaultdict with str or int keys, rank and timestamp prefixes, several ranks
printing the same epoch, per-condition lines in their common phrasings. `DEBUG_LOG_FORMS` lists every form read,
with an example (the table in docs/guide.md is built from it).

Reading goes through three small layers, each of which says why it gave up instead of guessing:
  lines -> records  a tagged line's text after the tag, plus the untagged lines that continue a value it left
                    open (unbalanced brackets, or a key with nothing after it yet);
  record -> items   a tokenizer and a recursive-descent reader (`recam.verify.text_grammar`) turn
                    `key: value, key=value ...` into (normalised key, Python value) pairs, values being the reprs
                    Python, numpy and torch print;
  items -> facts    a table maps the normalised keys onto the sampling facts the checks compare.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from recam.verify.core import Unreadable, _excerpt, _float, _int, _short
from recam.verify.text_grammar import _Elided, _norm_key, _open, _read_items, _Tok, _tokenize

TAG = "[GRPO Debug]"
_TAG_RE = re.compile(r"\[\s*GRPO[ _-]?Debug\s*\]", re.I)

# What the text-log reader accepts, with an example of each; the table in docs/guide.md and a test are built on this.
DEBUG_LOG_FORMS: tuple[tuple[str, str], ...] = (
    ("tag anywhere in the line, after any prefix (timestamp, logger fields, rank)",
     "2025-06-01 12:00:01,123 - INFO - [GRPO Debug] Unique conditions: 16"),
    ("rank prefixes: `[rank0]:` (torchrun, also on continuation lines), `[Rank 3]`, `[default0]:`, `3: ` (srun -l)",
     "[2025-06-01 12:00:01] [Rank 3] [GRPO Debug] Advantages shape: (64, 18)"),
    ("epoch stated in the prefix or the body (`Epoch 3`, `epoch 3:`, `Epoch 3/10`), or only inferable from the order",
     "[GRPO Debug] Epoch 3"),
    ("numpy arrays without commas, wrapped over several lines (continuations carry no tag)",
     "[GRPO Debug] Gathered dataset_indices: [19928 16416 24708\n 16416 24708 19928]"),
    ("Python lists with commas; nested lists (flattened)", "[GRPO Debug] Gathered dataset indices: [3, 5, 3, 5]"),
    ("torch reprs with device / dtype, over several lines",
     "[GRPO Debug] Gathered dataset_indices: tensor([19928, 16416,\n        16416, 19928], device='npu:0')"),
    ("numpy `array([...], dtype=int64)` and numpy 2 scalars `np.int64(5)`",
     "[GRPO Debug] Count per condition: {np.int64(19928): 2, np.int64(16416): 2}"),
    ("dicts with str or int keys, pprint'ed over several lines",
     "[GRPO Debug] Count per condition: {'16416': 2,\n '19928': 2}"),
    ("`Counter({...})`, `defaultdict(<class 'int'>, {...})`, `OrderedDict([(k, v), ...])` or `OrderedDict({...})`",
     "[GRPO Debug] Count per condition: defaultdict(<class 'int'>, {3: 2, 5: 2})"),
    ("value on the line after its key (`key:` then a pprint'ed dict)",
     "[GRPO Debug] Count per condition:\n{3: 2, 5: 2}"),
    ("shapes as tuples, lists or `torch.Size([...])`", "[GRPO Debug] Advantages shape: torch.Size([64, 18])"),
    ("`Unique conditions` / `Number of unique conditions`; `k` / `group size`",
     "[GRPO Debug] Number of unique conditions: 16, k=4"),
    ("per-condition lines: `name = value` or `name: value` pairs after `Condition <id>`",
     "[GRPO Debug] Condition 16416: samples=4, advantage mean=-0.0000, std=0.9996"),
    ("per-condition lines without separators after the id",
     "[GRPO Debug] condition 16416 advantage mean: 0.0001 std: 1.0000"),
    ("per-condition stats as one dict", "[GRPO Debug] Advantage per condition: {3: {'count': 2, 'mean': 0.0, "
                                        "'std': 1.0}}"),
    ("keys in any case, with `_` or spaces, `nan` / `inf`, several `key: value` pairs per line",
     "[GRPO Debug] epoch 3: GATHERED_DATASET_INDICES: [3 5 3 5]"),
    ("the batch arithmetic: replicas (`num_replicas`, `world_size`, `num_processes`), per-device `batch_size`, "
     "`num_batches_per_epoch` (or a `global_batch_size`), `num_train_timesteps`; like k, the last value printed "
     "before an epoch's end holds for it", "[GRPO Debug] num_replicas: 8, batch_size: 2, num_batches_per_epoch: 4"),
    ("the samples gathered (`gathered samples`, `total samples`) and reward shapes (`rewards['avg'] shape`, "
     "`reward avg shape`, `reward shapes: {'avg': (64, 18), ...}`)",
     "[GRPO Debug] Gathered samples: 64, rewards['avg'] shape: (64, 18)"),
    ("several ranks printing the same epoch: duplicates that agree are accepted, ones that disagree fail", ""),
    ("progress bars (`\\r`, `|###| 3/10 [00:01<00:02, 2.1it/s]`), warnings and other output in between", ""),
)

_ELIDED_REASON = ("printed with '...' (numpy and torch elide long arrays; print them in full, e.g. "
                  "np.set_printoptions(threshold=sys.maxsize) / torch.set_printoptions(profile='full'))")


# Normalised keys (after dropping leading filler words) -> the fact they state.
_FILLERS = ("gathered ", "all ", "global ", "total ", "the ", "number of ", "num ", "no of ", "nb ", "final ")
_FIELD_NAMES = {
    "indices": ("dataset indices", "dataset index", "dataset idx", "indices", "prompt indices", "condition indices",
                "dataset indexes", "indexes"),
    "unique": ("unique conditions", "unique condition", "unique prompts", "unique dataset indices", "unique indices",
               "conditions unique"),
    "counts": ("count per condition", "counts per condition", "count per prompt", "counts per prompt",
               "samples per condition", "samples per prompt", "copies per condition", "condition counts", "counts",
               "count per dataset index", "counts per dataset index", "per condition count", "per condition counts"),
    "shape": ("advantages shape", "advantage shape", "advantages size", "adv shape", "advantages tensor shape"),
    "k": ("k", "group size", "generations", "samples per group"),
    "per_condition": ("advantage per condition", "advantages per condition", "advantage stats per condition",
                      "per condition advantage", "per condition advantages", "advantage stats"),
    "epoch": ("epoch",),
    "subject": ("condition", "cond", "condition id", "prompt", "prompt id", "group", "group id"),
    "samples": ("samples", "samples gathered", "samples per epoch", "gathered samples count"),
    # the run's batch arithmetic (RUN_SETTINGS): the keys after the fillers are dropped ("num_replicas" -> "replicas")
    "replicas": ("replicas", "processes", "world size", "gpus", "npus", "devices", "ranks"),  # not "workers": loaders
    "batch": ("batch size", "per device batch size", "per device batch", "batch size per device", "sample batch size",
              "local batch size", "batch per device", "per replica batch size", "batch size per replica",
              "per gpu batch size", "batch size per gpu", "samples per device"),
    "batches": ("batches per epoch", "batches", "sample batches per epoch", "sampling batches per epoch",
                "sample batches", "sampling batches"),
    # not a bare "t": a log may print the current timestep under it
    "timesteps": ("timesteps", "train timesteps", "trained timesteps", "training timesteps"),
}
# keys whose filler word is what they mean: looked up before the fillers are dropped ("global batch size" is the
# samples of one sampling batch over all replicas, not a per-device batch size)
_RAW_FIELD_NAMES = {"global_batch": ("global batch size", "total batch size", "global batch")}
_FIELDS = {name: fld for fld, names in _FIELD_NAMES.items() for name in names}
_RAW_FIELDS = {name: fld for fld, names in _RAW_FIELD_NAMES.items() for name in names}
# run settings rather than epoch facts: like k, the last value printed before an epoch's end holds for it
RUN_SETTINGS = ("k", "replicas", "batch", "batches", "global_batch", "timesteps")
# `rewards avg shape`, `reward shape`, `reward shapes` (a dict of them); `rewards['avg'] shape` reads as an item
# `rewards` holding ['avg'] followed by an item `shape`
_REWARD_SHAPE = re.compile(r"^rewards?(?: (.+?))? shapes?$")
_STATS = {**{n: "samples" for n in ("samples", "count", "n", "copies", "size", "sample count")},
          **{n: "mean" for n in ("mean", "advantage mean", "advantages mean", "adv mean", "mean advantage")},
          **{n: "std" for n in ("std", "advantage std", "advantages std", "adv std", "std advantage", "stdev")}}
_SAMPLING_WORDS = re.compile(r"indic|index|count|unique|condition|sample|\[\s*\d", re.I)
# Fields that carry what was sampled; one of indices / counts must be read for an epoch to be verified.
SAMPLING_FIELDS = ("indices", "counts")


def _strip_fillers(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for f in _FILLERS:
            if key.startswith(f) and len(key) > len(f):
                key, changed = key[len(f):], True
    return key


def _as_int(v: Any) -> int:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    i = _int(v)
    if i is None:
        raise ValueError(f"{_excerpt(repr(v), 40)} is not an integer")
    return i


def _as_float(v: Any) -> float:
    f = _float(v)
    if f is None:
        raise ValueError(f"{_excerpt(repr(v), 40)} is not a number")
    return f


def _cond_id(v: Any) -> int | str | None:
    """A condition id as printed: a number, or a string (digits read as the number they spell)."""
    if isinstance(v, str):
        s = v.strip()
        return int(s) if re.fullmatch(r"-?\d+", s) else (s or None)
    return _int(v)


def _flat(v: Any) -> list:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"not a list but {_excerpt(repr(v), 40)}")
    out = []
    for x in v:
        out += _flat(x) if isinstance(x, (list, tuple)) else [x]
    return out


def _as_indices(v: Any) -> list[int]:
    out = []
    for x in _flat(v):
        i = _int(x)
        if i is None:
            raise ValueError(f"holds {_excerpt(repr(x), 30)}, not only integers")
        out.append(i)
    return out


def _as_counts(v: Any) -> dict:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if not isinstance(v, dict):
        raise ValueError(f"not a dict but {_excerpt(repr(v), 40)}")
    out: dict = {}
    for key, c in v.items():
        cid = _cond_id(key)
        if cid is None:
            raise ValueError(f"key {_excerpt(repr(key), 30)} is not a condition id")
        out[cid] = _as_int(c)
    return out


def _as_shape(v: Any) -> tuple[int, ...]:
    if isinstance(v, _Elided):
        raise ValueError(_ELIDED_REASON)
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,)
    if not isinstance(v, (list, tuple)) or not v:
        raise ValueError(f"not a shape but {_excerpt(repr(v), 40)}")
    return tuple(_as_int(x) for x in v)


def _as_stats(v: Any) -> dict[str, float]:
    if not isinstance(v, dict):
        raise ValueError(f"not a dict of stats but {_excerpt(repr(v), 40)}")
    out = {}
    for name, x in v.items():
        stat = _STATS.get(_strip_fillers(_norm_key([str(name)])))
        if stat is not None:
            out[stat] = _as_int(x) if stat == "samples" else _as_float(x)
    return out


@dataclass
class _Record:
    """One tagged statement (its line and the continuation lines it spans) turned into facts."""

    line: int
    end: int
    stream: int | None
    text: str
    epoch: int | None = None
    facts: list[tuple[str, Any]] = field(default_factory=list)
    bad: list[tuple[str | None, str]] = field(default_factory=list)  # (field or None, reason)
    ignored: list[str] = field(default_factory=list)


def _fact_of(fld: str | None, key: str, subject: Any) -> str | None:
    """Which fact an unreadable value was meant to state (None: none the checks use)."""
    if fld in ("indices", "unique", "counts", "shape", "samples", "reward_shape", *RUN_SETTINGS):
        return fld
    if fld in ("subject", "per_condition") or (subject is not None and key in _STATS):
        return "cond"
    return None


def _reward_name(value: Any) -> str | None:
    """The name in `rewards['avg']` (read as the list ['avg']), None for anything else."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0].strip():
        return value[0].strip()
    return None


def _interpret(rec: _Record, items: list[tuple[str, str, Any]], stop: tuple[str, str] | None) -> None:
    subject = None
    reward_name = None  # `rewards['avg']`, waiting for the `shape` item after it
    for key, printed, value in items:
        raw_field = _RAW_FIELDS.get(key)
        key = _strip_fillers(key)
        fld = raw_field or _FIELDS.get(key)
        shape_of = _REWARD_SHAPE.match(key)
        named, reward_name = reward_name, None
        try:
            if key in ("reward", "rewards") and _reward_name(value) is not None:
                reward_name = _reward_name(value)
            elif named is not None and key in ("shape", "shapes", "size"):
                rec.facts.append(("reward_shape", (named, _as_shape(value))))
            elif shape_of and isinstance(value, dict):
                for name, shape in value.items():
                    rec.facts.append(("reward_shape", (str(name), _as_shape(shape))))
            elif shape_of:
                rec.facts.append(("reward_shape", ((shape_of.group(1) or "").replace(" ", "_"), _as_shape(value))))
            elif fld in ("samples", "replicas", "batch", "batches", "global_batch", "timesteps") and subject is None:
                if _int(value) is None and not isinstance(value, _Elided):
                    rec.ignored.append(key)  # a list, a string, a fraction: not the count these names mean here
                else:
                    rec.facts.append((fld, _as_int(value)))
            elif fld == "subject" and not isinstance(value, (list, tuple, dict)) and _cond_id(value) is not None:
                subject = _cond_id(value)
                rec.facts.append(("cond", (subject, {})))
            elif subject is not None and key in _STATS:
                stat = _STATS[key]
                rec.facts.append(("cond", (subject, {stat: _as_int(value) if stat == "samples" else
                                                     _as_float(value)})))
            elif fld == "epoch":
                rec.epoch = _as_int(value)
            elif fld == "indices":
                rec.facts.append(("indices", _as_indices(value)))
            elif fld == "unique":
                rec.facts.append(("unique", _as_int(value)))
            elif fld == "counts" and (isinstance(value, (int, float)) and not isinstance(value, bool)):
                rec.facts.append(("k", _as_int(value)))  # "samples per prompt: 4" is the group size
            elif fld == "counts":
                rec.facts.append(("counts", _as_counts(value)))
            elif fld == "shape":
                rec.facts.append(("shape", _as_shape(value)))
            elif fld == "k":
                rec.facts.append(("k", _as_int(value)))
            elif fld == "per_condition":
                if isinstance(value, _Elided) or not isinstance(value, dict):
                    raise ValueError(_ELIDED_REASON if isinstance(value, _Elided) else "not a dict")
                for cid, stats in value.items():
                    if _cond_id(cid) is None:
                        raise ValueError(f"key {_excerpt(repr(cid), 30)} is not a condition id")
                    rec.facts.append(("cond", (_cond_id(cid), _as_stats(stats))))
            else:
                rec.ignored.append(key)
        except ValueError as e:
            what = "reward_shape" if shape_of or named is not None else _fact_of(fld, key, subject)
            rec.bad.append((what, f"'{printed}' {e}"))
    if stop is not None:
        printed, reason = stop
        key = _strip_fillers(_norm_key(printed.split())) if printed else ""
        rec.bad.append((_fact_of(_FIELDS.get(key), key, subject), reason))
    if not items and stop is None:
        rec.bad.append((None, "no `key: value` after the tag"))


_RANK_PREFIX = re.compile(r"(?<![A-Za-z])(?:rank|default)\s*[:=#]?\s*(\d+)", re.I)
_SRUN_PREFIX = re.compile(r"^\s*(\d+):\s*$")
_EPOCH_PREFIX = re.compile(r"(?<![A-Za-z])epoch\s*[:=#]?\s*(\d+)", re.I)
_CONT_RANK = re.compile(r"^\s*\[?\s*(?:rank|default)\s*(\d+)\s*\]?\s*:?", re.I)


@dataclass
class _Pending:
    line: int
    end: int
    stream: int | None
    srun: bool
    prefix_epoch: int | None
    parts: list[str]
    tokens: list[_Tok]


def _strip_continuation(seg: str, pending: dict) -> tuple[Any, str] | None:
    """(stream, text) when an untagged line may continue an open value, None when it is some other output."""
    m = _CONT_RANK.match(seg)
    if m:  # torchrun prefixes every line of a process, continuations included
        rank = int(m.group(1))
        return (rank, seg[m.end():]) if rank in pending else None
    for stream, p in pending.items():
        if p.srun and seg.lstrip().startswith(f"{stream}:"):
            return stream, seg.lstrip()[len(f"{stream}:"):]
    # a logger prefixes only a message's first line: an unprefixed line continues the one open value, if one
    plain = [s for s, p in pending.items() if not p.srun]
    return (plain[0], seg) if len(plain) == 1 else None


def _records(text: str) -> tuple[list[_Record], int]:
    """Tagged statements with their continuation lines, in order; also the number of tagged lines."""
    out: list[_Record] = []
    pending: dict[Any, _Pending] = {}
    raw = text.split("\n")
    last = max((i for i, s in enumerate(raw, 1) if s.strip()), default=0)
    n_tagged = 0

    def finish(p: _Pending, truncated: str | None) -> None:
        rec = _Record(p.line, p.end, p.stream, _excerpt(TAG + " " + p.parts[0].strip()), p.prefix_epoch)
        items, stop = _read_items(p.tokens)
        if truncated and stop is None:
            stop = ("", f"value not closed ({truncated})")
        elif truncated:
            stop = (stop[0], f"{stop[1]}; {truncated}")
        _interpret(rec, items, stop)
        if rec.epoch is None:
            rec.epoch = p.prefix_epoch
        out.append(rec)

    for no, line in enumerate(raw, 1):
        for seg in line.split("\r"):  # progress bars redraw with \r: each redraw is its own piece
            m = _TAG_RE.search(seg)
            if m:
                n_tagged += 1
                prefix, body = seg[:m.start()], seg[m.end():]
                rank = _RANK_PREFIX.search(prefix)
                srun = _SRUN_PREFIX.match(prefix)
                stream = int(rank.group(1)) if rank else (int(srun.group(1)) if srun else None)
                ep = _EPOCH_PREFIX.search(prefix)
                if stream in pending:
                    finish(pending.pop(stream), f"the next [GRPO Debug] line, {no}, came first: truncated?")
                p = _Pending(no, no, stream, bool(srun and not rank), int(ep.group(1)) if ep else None, [body],
                             _tokenize(body))
                if _open(p.tokens):
                    pending[stream] = p
                else:
                    finish(p, None)
                continue
            if not pending or not seg.strip():
                continue
            routed = _strip_continuation(seg, pending)
            if routed is None:
                continue
            stream, rest = routed
            toks = _tokenize(rest)
            if not toks or any(t.kind == "other" for t in toks):
                continue  # a progress bar, a warning, a log line: not part of a printed value
            p = pending[stream]
            p.parts.append(rest)
            p.tokens += toks
            p.end = no
            if not _open(p.tokens):
                finish(pending.pop(stream), None)
    for p in pending.values():
        finish(p, "the log ends first" + ("" if p.end < last else ": last line of the log"))
    out.sort(key=lambda r: r.line)
    return out, n_tagged


@dataclass
class DebugEpoch:
    """What one epoch's [GRPO Debug] lines said; a fact never printed (or not readable) stays None."""

    order: int
    epoch: int | None = None
    indices: list[int] | None = None
    unique: int | None = None
    counts: dict | None = None
    shape: tuple[int, ...] | None = None
    k: int | None = None
    samples: int | None = None  # the samples the log says were gathered (checked against the indices and arithmetic)
    reward_shapes: dict = field(default_factory=dict)  # reward name ("" when unnamed) -> shape as printed
    settings: dict = field(default_factory=dict)  # RUN_SETTINGS other than k -> the value holding for this epoch
    cond_stats: dict = field(default_factory=dict)  # condition id -> {"samples", "mean", "std"} as printed
    lines: list[int] = field(default_factory=list)
    sources: dict[str, list[int]] = field(default_factory=dict)  # fact -> lines that stated it
    unread: list[tuple[str, int, str]] = field(default_factory=list)  # (fact, line, reason) not readable
    conflicts: list[str] = field(default_factory=list)  # repeated statements (other ranks) that disagree
    explicit: bool = False

    @property
    def label(self) -> int:
        return self.epoch if self.epoch is not None else self.order

    def sampled_counts(self) -> dict | None:
        """Copies per condition: from the gathered indices when read, else from the printed counts."""
        if self.indices is not None:
            return dict(Counter(self.indices))
        return dict(self.counts) if self.counts is not None else None

    def n_samples(self) -> int | None:
        c = self.sampled_counts()
        return sum(c.values()) if c is not None else None


@dataclass
class DebugLog:
    epochs: list[DebugEpoch]
    unreadable: list[Unreadable]
    debug_lines: int
    explicit_epochs: bool
    ignored: dict[str, int] = field(default_factory=dict)  # keys read but not used -> how many lines
    k_values: list[tuple[int, int]] = field(default_factory=list)  # (line, k) as printed
    setting_values: list[tuple[int, str, int]] = field(default_factory=list)  # (line, setting, value): not k


def _count_diff(a: dict, b: dict) -> list[str]:
    ids = sorted({*a, *b} - {i for i in a if i in b and a[i] == b[i]}, key=str)
    return [f"{i} ({a.get(i, 0)} vs {b.get(i, 0)})" for i in ids]


def _disagreement(fld: str, old: Any, new: Any) -> str:
    if fld == "indices":
        diff = _count_diff(dict(Counter(old)), dict(Counter(new)))
        return (f"conditions {_short(diff, 6)}" if diff else
                f"same conditions and copies, different order or length ({len(old)} vs {len(new)})")
    if fld == "counts":
        return f"conditions {_short(_count_diff(old, new), 6)}"
    return f"{old} vs {new}"


def _put(ep: DebugEpoch, fld: str, value: Any, line: int) -> None:
    if fld == "reward_shape":
        name, shape = value
        if name in ep.reward_shapes and ep.reward_shapes[name] != shape:
            ep.conflicts.append(f"reward {name or '(unnamed)'} shape: {ep.reward_shapes[name]} here, {shape} on line "
                                f"{line}")
        ep.reward_shapes.setdefault(name, shape)
        _source(ep, f"reward shape {name}", line)
        return
    if fld == "cond":
        cid, stats = value
        have = ep.cond_stats.setdefault(cid, {})
        for stat, x in stats.items():
            if stat in have and not (have[stat] == x or (math.isnan(have[stat]) and math.isnan(x))):
                ep.conflicts.append(f"condition {cid} {stat}: {have[stat]} here, {x} on line {line}")
            have.setdefault(stat, x)
        _source(ep, f"cond {cid}", line)
        return
    old = getattr(ep, fld)
    if old is None:
        setattr(ep, fld, value)
    elif old != value:
        first = ep.sources[fld][0]
        ep.conflicts.append(f"{fld} on line {line} disagrees with line {first}: {_disagreement(fld, old, value)}")
    _source(ep, fld, line)


def _source(ep: DebugEpoch, fact: str, line: int) -> None:
    lines = ep.sources.setdefault(fact, [])
    if not lines or lines[-1] != line:  # one line may state several stats of one condition
        lines.append(line)


def _fields_of(rec: _Record) -> set[str]:
    out = {f"cond {v[0]}" if f == "cond" else f"reward shape {v[0]}" if f == "reward_shape" else f
           for f, v in rec.facts if f not in RUN_SETTINGS}
    return out | {f for f, _ in rec.bad if f not in (None, "cond", "reward_shape", *RUN_SETTINGS)}


def parse_debug_log(text: str) -> DebugLog:
    """[GRPO Debug] statements grouped into epochs.

    A statement with an epoch number (in its prefix or body) goes to that epoch, and so do the unnumbered ones
    after it (of the same rank, or of any rank when its own never stated a number). Without numbers, each rank's
    statements are grouped by order: a statement joins that rank's current epoch unless that rank already stated
    the same fact in it, which starts the rank's next epoch; the ranks' n-th epochs are then one epoch, whose
    repeated facts must agree. `k` is a run setting, not an epoch fact: the last one printed before an epoch's
    end applies to it.
    """
    records, n_tagged = _records(text)
    epochs: dict[int, DebugEpoch] = {}
    current: dict[Any, int] = {}
    numbered: dict[Any, bool] = {}
    started: dict[Any, int] = {}
    stated: dict[tuple[Any, int], set] = {}
    unreadable: list[Unreadable] = []
    ignored: Counter = Counter()
    k_values: list[tuple[int, int]] = []
    setting_values: list[tuple[int, str, int]] = []
    explicit = False
    latest: int | None = None  # the last epoch number stated by any rank

    def epoch_for(label: int, is_explicit: bool) -> DebugEpoch:
        if label not in epochs:
            epochs[label] = DebugEpoch(order=len(epochs), epoch=label if is_explicit else None, explicit=is_explicit)
        return epochs[label]

    for rec in records:
        if rec.bad:
            unreadable.append(Unreadable(rec.line, "; ".join(reason for _, reason in rec.bad), rec.text))
        ignored.update(rec.ignored)
        k_values += [(rec.line, v) for f, v in rec.facts if f == "k"]
        setting_values += [(rec.line, f, v) for f, v in rec.facts if f in RUN_SETTINGS and f != "k"]
        fields = _fields_of(rec)
        s = rec.stream
        if rec.epoch is not None:
            explicit = True
            label, current[s], numbered[s], latest = rec.epoch, rec.epoch, True, rec.epoch
            is_explicit = True
        elif not fields:
            # unreadable before its key was known, but it speaks of what was sampled: it may not leave its
            # epoch a clean pass, so it joins the epoch this rank (or the log) is in
            label = current.get(s, latest)
            if rec.bad and label in epochs and _SAMPLING_WORDS.search(rec.text):
                epochs[label].unread += [("unrecognised", rec.line, reason) for _, reason in rec.bad]
            continue
        elif numbered.get(s):
            label, is_explicit = current[s], True
        elif latest is not None:
            # e.g. `[rank0] ... epoch 3 ...` then unprefixed lines, or an unprefixed `Epoch 3` then rank lines
            label, is_explicit = latest, True
        else:
            if s not in current or stated.get((s, current[s]), set()) & fields:
                current[s] = started.get(s, 0)
                started[s] = current[s] + 1
            label, is_explicit = current[s], False
        ep = epoch_for(label, is_explicit)
        stated.setdefault((s, label), set()).update(fields)
        for fld, value in rec.facts:
            if fld not in RUN_SETTINGS:
                _put(ep, fld, value, rec.line)
        for fld, reason in rec.bad:
            if fld not in (None, *RUN_SETTINGS):
                ep.unread.append((fld, rec.line, reason))
            elif fld is None and _SAMPLING_WORDS.search(rec.text):
                ep.unread.append(("unrecognised", rec.line, reason))
        ep.lines += list(range(rec.line, rec.end + 1))

    ordered = sorted(epochs.values(), key=lambda e: e.order)
    distinct_k = {k for _, k in k_values}
    for ep in ordered:
        last_line = max(ep.lines, default=0)
        before = [k for line, k in k_values if line <= last_line]
        # one value printed anywhere holds for the whole run; if it changed, the latest one before counts
        ep.k = before[-1] if before else (next(iter(distinct_k)) if len(distinct_k) == 1 else None)
        ep.settings = _settings_for(setting_values, last_line)
    return DebugLog(ordered, unreadable, n_tagged, explicit, dict(ignored), k_values, setting_values)


def _settings_for(values: list[tuple[int, str, int]], last_line: int) -> dict:
    """The run settings holding for an epoch that ends at `last_line`, as k's: the last value printed before its end,
    else the one value printed anywhere (a setting printed with several values and none before is left out)."""
    out = {}
    for name in {n for _, n, _ in values}:
        before = [v for line, n, v in values if n == name and line <= last_line]
        distinct = {v for _, n, v in values if n == name}
        if before:
            out[name] = before[-1]
        elif len(distinct) == 1:
            out[name] = next(iter(distinct))
    return out


def has_debug_tag(text: str) -> bool:
    return _TAG_RE.search(text) is not None
