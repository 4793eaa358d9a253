"""A run's numbers as one hash, wall-clock times left out: two runs of the same preset and seed are the same
computation exactly when their fingerprints agree. Used to show that a refactor changed no number.

    python scripts/run_fingerprint.py RUN_DIR                 # hashes of metrics.jsonl's records and the weights
    python scripts/run_fingerprint.py RUN_DIR --against OTHER  # and the first record where two runs differ
    python scripts/run_fingerprint.py RUN_DIR --write tests/fingerprints/toy.json --command "..."  # commit them
    python scripts/run_fingerprint.py RUN_DIR --check tests/fingerprints/toy.json   # within 1e-5 of them?

The records kept are every metrics.jsonl record less its wall-clock fields (names containing "seconds"); the
weights are the policy's safetensors files (model/) of the checkpoint `latest` points to. A committed
fingerprint (--write) holds the records themselves and each weight tensor's sum and sum of squares; --check
compares a run with it, numbers within RELATIVE (strings, keys and counts exactly), and names the first
difference. tests/test_fingerprint.py checks the toy and smoke runs against theirs: a change that moves a number
says so in its commit, where it rewrites the file with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import sys
from pathlib import Path


def timeless(value):
    """value without any key that names a wall-clock time, recursively."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"{path}: {e.strerror or e}") from e
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(timeless(json.loads(line)))
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path} line {n} is not JSON ({e})") from e
    return out


def weights_digest(run_dir: Path) -> str:
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else (pointer.resolve().name if pointer.exists() else "")
    folder = root / name
    # the policy's files only: trainer.safetensors (optimizer, RNG) is the checkpoint's, not the weights'
    files = sorted((folder / "model").rglob("*.safetensors")) if name and folder.is_dir() else []
    if not files:
        raise SystemExit(f"{root}: no checkpoint with safetensors weights behind 'latest'")
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(f.read_bytes())
    return f"{name}:{h.hexdigest()[:16]}"


def digest(recs: list[dict]) -> str:
    return hashlib.sha256(json.dumps(recs, sort_keys=True).encode()).hexdigest()[:16]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    for n, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            keys = sorted(k for k in {*x, *y} if x.get(k) != y.get(k))
            return f"record {n} ({x.get('type')}): {', '.join(keys[:8])}"
    return None if len(a) == len(b) else f"record counts differ: {len(a)} vs {len(b)}"


RELATIVE = 1e-5
ABSOLUTE = 1e-9  # numbers that should be 0 (a zero-variance group's advantage) differ by rounding alone


def weight_sums(run_dir: Path) -> dict[str, list[float]]:
    """Per tensor of the latest checkpoint's weights: [sum, sum of squares] in float64."""
    from safetensors.torch import load_file

    root = run_dir / "checkpoints"
    folder = root / weights_digest(run_dir).split(":")[0]
    out = {}
    for f in sorted((folder / "model").rglob("*.safetensors")):
        for name, t in sorted(load_file(str(f)).items()):
            t = t.double()
            out[f"{f.relative_to(folder).as_posix()}:{name}"] = [float(t.sum()), float((t * t).sum())]
    return out


def fingerprint(run_dir: Path, command: list[str] | None = None) -> dict:
    return {"command": command or [], "records": records(run_dir), "weights": weight_sums(run_dir)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def difference(a, b, where: str = "") -> str | None:
    """Where `b` departs from `a` (numbers within RELATIVE, everything else exactly), or None."""
    if _number(a) and _number(b):
        same = math.isclose(a, b, rel_tol=RELATIVE, abs_tol=ABSOLUTE) or (math.isnan(a) and math.isnan(b))
        return None if same else f"{where}: {a!r} vs {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))[:6]} in one only"
        return next((d for k in a if (d := difference(a[k], b[k], f"{where}.{k}" if where else k))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := difference(x, y, f"{where}[{i}]"))),
                    None)
    same = a == b and isinstance(a, bool) == isinstance(b, bool)  # a flag is not the number 1
    return None if same else f"{where}: {a!r} vs {b!r}"


def check(run_dir: Path, committed: Path) -> str | None:
    """The first difference between a run and a committed fingerprint, or None."""
    try:
        expected = json.loads(committed.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{committed}: not a readable fingerprint ({e})") from e
    got = fingerprint(run_dir)
    for part in ("records", "weights"):
        d = difference(expected[part], got[part], part)
        if d:
            return d
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--against", type=Path, help="a second run directory to compare with")
    p.add_argument("--write", type=Path, help="write the run's fingerprint (records, weight sums) to this file")
    p.add_argument("--check", type=Path, help="compare the run with this committed fingerprint")
    p.add_argument("--command", default=None, help="with --write: the command that made the run, one quoted string")
    args = p.parse_args(argv)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        found = fingerprint(args.run_dir, shlex.split(args.command or ""))
        args.write.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n")
        print(f"wrote {args.write}")
        return 0
    if args.check:
        d = check(args.run_dir, args.check)
        print(f"matches {args.check}" if d is None else f"differs from {args.check}: {d}")
        return 0 if d is None else 1
    mine = records(args.run_dir)
    print(f"{args.run_dir}: {len(mine)} records {digest(mine)}, weights {weights_digest(args.run_dir)}")
    if args.against is None:
        return 0
    other = records(args.against)
    print(f"{args.against}: {len(other)} records {digest(other)}, weights {weights_digest(args.against)}")
    diff = first_difference(mine, other)
    same_weights = weights_digest(args.run_dir).split(":")[1] == weights_digest(args.against).split(":")[1]
    print("identical" if diff is None and same_weights else f"differ: {diff or 'weights'}")
    return 0 if diff is None and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
