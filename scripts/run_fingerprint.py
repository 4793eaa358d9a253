"""A run's numbers as one hash, wall-clock times left out: two runs of the same preset and seed are the same
computation exactly when their fingerprints agree. Used to show that a refactor changed no number.

    python scripts/run_fingerprint.py RUN_DIR                 # hashes of metrics.jsonl's records and the weights
    python scripts/run_fingerprint.py RUN_DIR --against OTHER  # and the first record where two runs differ

The records kept are every metrics.jsonl record less its wall-clock fields (names containing "seconds"); the
weights are the safetensors files of the checkpoint `latest` points to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
    files = sorted(folder.rglob("*.safetensors")) if name and folder.is_dir() else []
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--against", type=Path, help="a second run directory to compare with")
    args = p.parse_args(argv)
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
