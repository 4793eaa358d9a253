"""A run's numbers, wall-clock times left out, as a regression that holds on another machine and still catches a
change: used to show that a refactor changed no number, and (committed) that a change which moves numbers says so.

    python scripts/tools/run_fingerprint.py RUN_DIR                  # hashes of metrics.jsonl's records and the weights
    python scripts/tools/run_fingerprint.py RUN_DIR --against OTHER  # bit-identical? else the first record that differs
    python scripts/tools/run_fingerprint.py --write tests/fingerprints/toy.json --command "scripts/train_recam.py ..."
    python scripts/tools/run_fingerprint.py RUN_DIR --check tests/fingerprints/toy.json  # within the tolerances?

The records kept are every metrics.jsonl record less its wall-clock fields (names containing "seconds"); the
weights are the policy's safetensors files (model/) of the checkpoint `latest` points to, each tensor kept as its
dtype, shape, norm and a sketch: SKETCH projections on fixed +-1 vectors, so that |sketch difference| / |sketch|
estimates the tensor's relative change |a - b| / |a| (a Johnson-Lindenstrauss sketch; a sum alone misses most
changes).

--write runs the command (from the repository root, with --config.run_dir set) once per entry of SETTINGS: the
command as given, and under other CPU kernel paths (ATEN_CPU_CAPABILITY), another BLAS code path
(MKL_CBWR, ONEDNN_MAX_CPU_ISA) and another thread count, which is what another machine changes.
The first run's records and weights are committed; the others give every quantity's largest deviation, and its
tolerance is that deviation times MARGIN (with floors: float32 resolution is never a change; see tolerance()).
The file records the host, the settings, the command that wrote it, and per quantity the observed deviations and
the tolerance chosen.

--check compares a run with a committed file: strings, keys, ids, ints, flags and list lengths exactly; a float
x against the committed e within atol + rtol * |e| of its quantity (the metric's name: its key path with list
indices, numeric keys such as condition ids and split prefixes such as "rows/eval/" folded together); a weight
tensor within its relative sketch difference.
tests/test_fingerprint.py checks the toy run and tests/test_checkpoint_integrity.py the smoke run: a change that
moves a number fails there until its commit rewrites the file (--write) with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORMAT = 2

# Each setting: the environment it adds and the torch thread count. "reference" is the committed run; the others
# take other floating-point paths through the same computation, as another CPU would: ATen's vectorised kernels
# (scalar "default"; AVX2 instead of AVX-512), MKL's kernels (MKL_CBWR=COMPATIBLE, its SSE2 path, where another
# CPU would get another AVX path: MKL_ENABLE_INSTRUCTIONS is not honoured on this AMD host) with oneDNN held to
# AVX2, and a second thread (reductions split differently). A capability the CPU lacks falls back to the best
# it has. Another CPU changes several paths at once, and their effects compound: AVX2 ATen kernels and MKL's
# compatible path together moved the smoke run's weights 21 times further than either did alone, and failed its
# fingerprint in the suite (docs/results.md), so two combinations are measured too.
_BLAS = {"MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SETTINGS: dict[str, tuple[dict[str, str], int]] = {
    "reference": ({}, 1),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, 1),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    "blas-compatible": (_BLAS, 1),
    "threads-2": ({}, 2),
    "aten-avx2+blas-compatible": ({"ATEN_CPU_CAPABILITY": "avx2", **_BLAS}, 1),
    "aten-default+threads-2": ({"ATEN_CPU_CAPABILITY": "default"}, 2),
}
# cleared before a setting's own are set, so that the reference is the plain path whatever the caller exported
PATH_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                  "OMP_NUM_THREADS", "MKL_NUM_THREADS")

MARGIN = 20.0  # tolerance / largest observed deviation: room for a CPU further from this one than the settings
# ~80 float32 ulps: a quantity that no setting moved here still passes through networks and reductions of
# thousands of float32 terms on another CPU (at 1e-6, one that had never moved failed at 1.8e-5 under a
# combination of paths)
RTOL_FLOOR = 1e-5
SMALL = 0.1  # below this fraction of a quantity's scale a value's rounding is judged in absolute terms
WEIGHT_FLOOR = 1e-5  # relative change of a float32 tensor that is rounding alone (the same reasoning)
SKETCH = 16  # projections per tensor: the relative change is estimated to about 1/sqrt(16) = 25%


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


def _latest(run_dir: Path) -> tuple[str, Path, list[Path]]:
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else (pointer.resolve().name if pointer.exists() else "")
    folder = root / name
    # the policy's files only: trainer.safetensors (optimizer, RNG) is the checkpoint's, not the weights'
    files = sorted((folder / "model").rglob("*.safetensors")) if name and folder.is_dir() else []
    if not files:
        raise SystemExit(f"{root}: no checkpoint with safetensors weights behind 'latest'")
    return name, folder, files


def weights_digest(run_dir: Path) -> str:
    name, folder, files = _latest(run_dir)
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


# ---- weights: norm and sketch ----

def _signs(n: int, row: int):
    """A fixed +-1 vector of length n: splitmix64 of (row, index) in integer arithmetic, so it is the same on every
    machine and library version (a seeded random generator promises no such thing)."""
    import numpy as np

    z = np.arange(n, dtype=np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (row + 1)) % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(63)).astype(np.float64) * 2.0 - 1.0


def tensor_summary(t) -> dict:
    """dtype, shape, float64 norm and SKETCH signed projections of one tensor."""
    w = t.detach().cpu().double().reshape(-1).numpy()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "norm": float(math.sqrt(w @ w)),
            "sketch": [float(_signs(w.size, r) @ w) for r in range(SKETCH)]}


def weight_summaries(run_dir: Path) -> dict[str, dict]:
    """Per tensor of the latest checkpoint's weights ("file:name"): its tensor_summary."""
    from safetensors.torch import load_file

    _, folder, files = _latest(run_dir)
    return {f"{f.relative_to(folder).as_posix()}:{name}": tensor_summary(t)
            for f in files for name, t in sorted(load_file(str(f)).items())}


def sketch_change(expected: dict, got: dict) -> float:
    """|got's sketch - expected's| / |expected's|: the tensor's estimated relative change (0 when both are 0)."""
    delta = math.sqrt(sum((g - e) ** 2 for e, g in zip(expected["sketch"], got["sketch"], strict=True)))
    size = math.sqrt(sum(e * e for e in expected["sketch"]))
    return delta / size if size else (0.0 if delta == 0 else math.inf)


def fingerprint(run_dir: Path) -> dict:
    return {"records": records(run_dir), "weights": weight_summaries(run_dir)}


# ---- the numbers of the records, by quantity ----

def _float(v) -> bool:
    return isinstance(v, float)


def _name(key: str) -> str:
    """A dict key as part of a quantity's name: numeric keys (condition ids) are data, folded into '*'; a metric's
    split or source prefix ('rows/eval/', 'rewards/', 'details/cam_score/') is dropped, so that one metric
    (cam_score, distance, psnr) is one quantity wherever it is logged: its rounding is that of one computation."""
    return "*" if key.lstrip("-").isdigit() else key.rsplit("/", 1)[-1]


def floats(recs: list[dict]):
    """(where, quantity, value) for every float in the records: where names the one number
    (records[3].rewards/cam_score[1]), quantity the kind of number it is (cam_score), whose tolerance it is judged
    by: the names of the dict keys on its path (see _name), list indices left out."""
    def walk(v, where, path):
        if isinstance(v, dict):  # in key order: a committed file's keys are sorted, a run's are in logging order
            for k, x in sorted(v.items()):
                yield from walk(x, f"{where}.{k}", f"{path}.{_name(k)}" if path else _name(k))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                yield from walk(x, f"{where}[{i}]", path)
        elif _float(v):
            yield where, path, v

    for n, r in enumerate(recs):
        yield from walk(r, f"records[{n}]", "")


def _structure(a, b, where: str):
    """Where b's structure departs from a's: keys, list lengths, types, strings, ints and flags exactly; floats
    are left to the tolerances (only that both are floats)."""
    if _float(a) and _float(b):
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            yield f"{where}: keys {sorted(set(a) ^ set(b))[:6]} in one only"
            return
        for k in a:
            yield from _structure(a[k], b[k], f"{where}.{k}" if where else k)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{where}: {len(a)} vs {len(b)} items"
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _structure(x, y, f"{where}[{i}]")
    elif not (a == b and type(a) is type(b)):  # an int is not the float 1.0, a flag not the number 1
        yield f"{where}: {a!r} vs {b!r}"


def _layout(run: dict) -> dict:
    """Each weight tensor's dtype and shape: compared exactly, like the records' structure."""
    return {name: {"dtype": t["dtype"], "shape": t["shape"]} for name, t in run["weights"].items()}


def within(expected: float, got: float, tol: dict) -> bool:
    if math.isnan(expected) or math.isnan(got) or math.isinf(expected) or math.isinf(got):
        return expected == got or (math.isnan(expected) and math.isnan(got))
    return abs(got - expected) <= tol["atol"] + tol["rtol"] * abs(expected)


# ---- tolerances from measured deviations ----

def deviations(reference: dict, other: dict, setting: str = "") -> tuple[list, dict]:
    """(where, quantity, value, |deviation|) of each of other's floats from reference's, and per tensor its sketch
    change. The two must agree in structure: a setting that changes a count or a string is a finding, not noise."""
    found = next(_structure(reference["records"], other["records"], "records"), None) or next(
        _structure(_layout(reference), _layout(other), "weights"), None)
    if found:
        raise SystemExit(f"setting {setting or '?'} changed the run's structure, not only its rounding: {found}")
    rows = []
    for (where, quantity, x), (_, _, y) in zip(floats(reference["records"]), floats(other["records"]), strict=True):
        if math.isfinite(x) and math.isfinite(y):
            rows.append((where, quantity, x, abs(y - x)))
        elif not (x == y or (math.isnan(x) and math.isnan(y))):
            raise SystemExit(f"setting {setting or '?'}: {where} is {x!r} in the reference and {y!r} here")
    tensors = {name: sketch_change(s, other["weights"][name]) for name, s in reference["weights"].items()}
    return rows, tensors


def tolerance(pairs: list[tuple[float, float]], margin: float = MARGIN) -> dict:
    """atol + rtol * |value| covering every observed (value, deviation) pair `margin` times over. rtol from the
    relative deviations of values within a decade of the quantity's scale (its largest |value|); atol from the
    deviations of the values below that, which is where rounding is absolute (a mean advantage, a loss near 0:
    their rounding scales with the summands, not with the mean), and at least what rtol allows at a tenth of the
    scale, so a value that happened not to move here is not held tighter than its neighbours."""
    scale = max((abs(x) for x, _ in pairs), default=0.0)
    rel = max((d / abs(x) for x, d in pairs if x and abs(x) >= SMALL * scale), default=0.0)
    small = max((d for x, d in pairs if abs(x) < SMALL * scale), default=0.0)
    rtol = max(margin * rel, RTOL_FLOOR)
    return {"atol": max(margin * small, SMALL * scale * rtol), "rtol": rtol,
            "observed_abs": max((d for _, d in pairs), default=0.0), "observed_rel": rel, "scale": scale}


def measure(reference: dict, others: dict[str, dict], margin: float = MARGIN) -> dict:
    """The tolerances of every quantity and tensor of `reference`, from the runs in `others` (setting -> run),
    each with what was observed: the largest deviations, and where the one nearest its tolerance was."""
    seen: dict[str, list] = {q: [] for _, q, _ in floats(reference["records"])}  # (setting, where, value, dev)
    changes: dict[str, list] = {name: [] for name in reference["weights"]}  # (relative change, setting)
    for setting, run in others.items():
        rows, tensors = deviations(reference, run, setting)
        for where, q, x, d in rows:
            seen[q].append((setting, where, x, d))
        for name, change in tensors.items():
            changes[name].append((change, setting))
    out_records = {}
    for q, found in sorted(seen.items()):
        largest: dict[str, tuple[float, float]] = {}  # per number, the largest deviation any setting showed
        for _, where, x, d in found:
            largest[where] = (x, max(d, largest.get(where, (x, 0.0))[1]))
        tol = {k: float(f"{v:.3g}") for k, v in tolerance(list(largest.values()), margin).items()}
        nearest = max(found, default=None, key=lambda f: f[3] / (tol["atol"] + tol["rtol"] * abs(f[2]) or 1.0))
        out_records[q] = {**tol, "worst": f"{nearest[0]} at {nearest[1]}" if nearest and nearest[3] else ""}
    out_weights = {}
    for name, found in sorted(changes.items()):
        change, setting = max(found, default=(0.0, ""))
        out_weights[name] = {"max_change": float(f"{max(margin * change, WEIGHT_FLOOR):.3g}"),
                             "observed": float(f"{change:.3g}"), "worst": setting if change else ""}
    return {"records": out_records, "weights": out_weights}


# ---- checking a run against a committed file ----

def load(committed: Path) -> dict:
    """A committed fingerprint, or a one-line SystemExit naming the file and what is wrong with it."""
    try:
        found = json.loads(committed.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{committed}: not a readable fingerprint ({e})") from e
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        got = found.get("format") if isinstance(found, dict) else type(found).__name__
        raise SystemExit(f"{committed}: format {got!r}, this tool reads format {FORMAT} (rewrite it with --write)")
    for field, kind in (("command", list), ("records", list), ("weights", dict), ("tolerances", dict)):
        if not isinstance(found.get(field), kind):
            raise SystemExit(f"{committed}: field '{field}' missing or not a {kind.__name__}")
    for part in ("records", "weights"):
        if not isinstance(found["tolerances"].get(part), dict):
            raise SystemExit(f"{committed}: field 'tolerances.{part}' missing or not a dict")
    for q, tol in found["tolerances"]["records"].items():
        if not (isinstance(tol, dict) and all(isinstance(tol.get(k), (int, float)) and tol[k] >= 0
                                              for k in ("atol", "rtol"))):
            raise SystemExit(f"{committed}: field 'tolerances.records.{q}' needs numbers atol >= 0 and rtol >= 0")
    for name, summary in found["weights"].items():
        if not (isinstance(summary, dict) and isinstance(summary.get("sketch"), list)
                and len(summary["sketch"]) == SKETCH and isinstance(summary.get("dtype"), str)
                and isinstance(summary.get("shape"), list)):
            raise SystemExit(f"{committed}: field 'weights.{name}' needs a dtype, a shape and a sketch of {SKETCH} "
                             f"numbers")
        tol = found["tolerances"]["weights"].get(name)
        if not (isinstance(tol, dict) and isinstance(tol.get("max_change"), (int, float))):
            raise SystemExit(f"{committed}: field 'tolerances.weights.{name}' needs a number max_change")
    return found


def differences(expected: dict, got: dict, source: str = "the fingerprint") -> list[str]:
    """Every place where the run `got` departs from the committed `expected` (see the module's docstring)."""
    out = list(_structure(expected["records"], got["records"], "records"))
    if not out:
        tolerances = expected["tolerances"]["records"]
        for (where, quantity, e), (_, _, g) in zip(floats(expected["records"]), floats(got["records"]), strict=True):
            tol = tolerances.get(quantity)
            if tol is None:
                raise SystemExit(f"{source}: field 'tolerances.records' has no entry for {quantity} ({where})")
            if not within(e, g, tol):
                allowed = tol["atol"] + tol["rtol"] * abs(e)
                out.append(f"{where}: {e!r} vs {g!r} (off by {abs(g - e):.3g}, {quantity} allows {allowed:.3g})")
    structural = list(_structure(_layout(expected), _layout(got), "weights"))
    out += structural
    if not structural:
        for name, summary in expected["weights"].items():
            change, allowed = sketch_change(summary, got["weights"][name]), expected["tolerances"]["weights"][name]
            if change > allowed["max_change"]:
                out.append(f"weights.{name}: changed by {change:.3g} of its norm (allows {allowed['max_change']:.3g})")
    return out


def check(run_dir: Path, committed: Path) -> str | None:
    """The first difference between a run and a committed fingerprint, or None."""
    found = differences(load(committed), fingerprint(run_dir), str(committed))
    return found[0] if found else None


# ---- running a command under a setting ----

def with_threads(command: list[str], threads: int) -> list[str]:
    kept = [a for a in command if not a.startswith("--config.num_threads=")]
    return [*kept, f"--config.num_threads={threads}"]


def run_under(command: list[str], run_dir: Path, env: dict[str, str] | None = None, threads: int | None = None,
              timeout: float = 1800) -> None:
    """Run a train_recam.py command line (relative to the repository root) into run_dir with `env` added to a
    plain environment (no PATH_VARIABLES) and, given threads, that many torch threads; else the command's own."""
    argv = command if threads is None else with_threads(command, threads)
    environ = {k: v for k, v in os.environ.items() if k not in PATH_VARIABLES}
    environ.update(env or {}, OMP_NUM_THREADS=str(threads or 1))
    if (threads or 1) > 1:  # OpenMP threads that spin while they wait make a loaded 2-core host 5-10x slower
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    p = subprocess.run([sys.executable, *argv, f"--config.run_dir={run_dir}"], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{' '.join(f'{k}={v}' for k, v in (env or {}).items())} {shlex.join(argv)} "
                         f"exited {p.returncode}: {tail}".strip())


def _host() -> str:
    import platform

    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor() or platform.machine())
    return (f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}), Python {platform.python_version()}")


def write(target: Path, command: list[str], runs: Path | None = None) -> dict:
    """Run `command` under every setting, and write the reference's fingerprint with the measured tolerances."""
    with tempfile.TemporaryDirectory(prefix="fingerprint_") as scratch:
        base = runs or Path(scratch)
        found = {}
        for setting, (env, threads) in SETTINGS.items():
            print(f"running {setting} ...", flush=True)
            run_under(command, base / setting, env, None if setting == "reference" else threads)
            found[setting] = fingerprint(base / setting)
    reference = found.pop("reference")
    tolerances = measure(reference, found)
    moved = {}
    for setting, run in found.items():
        rows, tensors = deviations(reference, run, setting)
        moved[setting] = (f"{sum(1 for *_, d in rows if d)} of {len(rows)} floats moved, tensors by up to "
                          f"{max(tensors.values(), default=0.0):.3g} of their norm")
    tolerances["how"] = (
        f"Measured on {_host()}. The command ran once per setting (its env added to a plain one, torch threads = "
        f"OMP_NUM_THREADS = threads); the reference's records and weights are committed. A float may differ from "
        f"the committed e by atol + rtol * |e| of its quantity (the metric's name: key path, list indices and "
        f"split prefixes dropped, so cam_score is one quantity in rewards/, eval/ and rows/): rtol = {MARGIN:g} x "
        f"the largest relative deviation any setting showed on the quantity's values within a decade of its scale "
        f"(its largest |value|; at least {RTOL_FLOOR:g}), atol = {MARGIN:g} x the largest absolute deviation of "
        f"its values below that (at least rtol x {SMALL:g} x scale). A tensor may change by {MARGIN:g} x its "
        f"largest observed relative change (at least {WEIGHT_FLOOR:g}), as estimated by its {SKETCH}-projection "
        f"sketch. observed_abs / observed_rel are the largest deviations measured, worst is the setting and number "
        f"that came nearest its tolerance.")
    tolerances["settings"] = {name: {"env": env, "threads": threads} for name, (env, threads) in SETTINGS.items()}
    for setting, line in moved.items():
        tolerances["settings"][setting]["moved"] = line
    tolerances["margin"] = MARGIN
    tolerances["written_by"] = shlex.join(["python", "scripts/tools/run_fingerprint.py", "--write", target.as_posix(),
                                           "--command", shlex.join(command)])
    out = {"format": FORMAT, "command": command, "tolerances": tolerances, **reference}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, nargs="?")
    p.add_argument("--against", type=Path, help="a second run directory to compare with")
    p.add_argument("--write", type=Path, help="run --command under every setting and write its fingerprint here")
    p.add_argument("--command", default=None, help="with --write: the train_recam.py command, one quoted string")
    p.add_argument("--runs", type=Path, help="with --write: keep the runs in this folder (default: a temporary one)")
    p.add_argument("--check", type=Path, help="compare the run with this committed fingerprint")
    args = p.parse_args(argv)
    if args.write:
        if not args.command:
            p.error("--write needs --command (the run to fingerprint, run here under every setting)")
        out = write(args.write, shlex.split(args.command), args.runs)
        loosest = sorted(out["tolerances"]["records"].items(), key=lambda kv: -kv[1]["rtol"])[:5]
        print(f"wrote {args.write}; loosest rtol: " + ", ".join(f"{q} {t['rtol']:.2g}" for q, t in loosest))
        return 0
    if args.run_dir is None:
        p.error("RUN_DIR is needed unless --write")
    if args.check:
        found = differences(load(args.check), fingerprint(args.run_dir), str(args.check))
        print(f"matches {args.check}" if not found else f"differs from {args.check} in {len(found)} places:")
        for line in found[:20]:
            print(f"  {line}")
        return 0 if not found else 1
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
