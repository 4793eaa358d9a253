"""What a learning run of the device check brings back from a GPU window, and how the next window continues it: the
run folder packed small (`pack`), and a packed folder copied back and checked (`carry_over`)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

# what a bundle holds instead of metrics.jsonl: the epoch records carry every sample's rewards, advantages and
# reward details, about 0.9 kB per camera sample and 0.5 kB per motion one at the presets' step counts (CPU runs of
# 64 samples): 1.7 MB per camera update of 2,048 samples, 8 MB per motion update of 16,384, which gzip packs to a
# third (camera) or a quarter (motion)
PACKED_LOG = "metrics.jsonl.gz"


def carry_over(prior: Path, run_dir: Path) -> dict:
    """A previous window's run folder (its bundle) copied to run_dir with its log unpacked, and where it stopped:
    the checkpoint `latest` names, checked against its manifest before anything is read from it. The window's
    training seconds start from that checkpoint's budget, the state the run resumes from (a run killed between an
    epoch's record and its checkpoint logged an epoch the resume drops). A bundle from before checkpoints were
    pickle-free is refused, naming how to convert it."""
    from recam.infra.checkpoint import LEGACY_TRAINER, read_pointer, verify_checkpoint
    from recam.infra.runlog import read_records

    if prior.resolve() != run_dir.resolve():
        # links stay links: the manifest check refuses one leading out of its checkpoint, where a copy of its
        # target would pass as the checkpoint's own file
        shutil.copytree(prior, run_dir, symlinks=True)
    log, packed = run_dir / "metrics.jsonl", run_dir / PACKED_LOG
    if packed.exists():
        if log.exists():
            raise RuntimeError(f"{run_dir} holds both metrics.jsonl and {PACKED_LOG}: which is the run's log is "
                               "not known")
        with gzip.open(packed, "rb") as src, log.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        packed.unlink()
    root = run_dir / "checkpoints"
    name = read_pointer(root)
    if name is None or not (root / name).is_dir():
        raise RuntimeError(f"{prior / 'checkpoints' / 'latest'} names no checkpoint folder there: nothing to continue")
    verify_checkpoint(root / name)  # raises CheckpointCorrupt naming the file
    if (root / name / LEGACY_TRAINER).exists():
        raise RuntimeError(f"{prior / 'checkpoints' / name / LEGACY_TRAINER} is a pickle (written before checkpoints "
                           "were pickle-free): convert the bundle's checkpoints first, with "
                           f"scripts/tools/convert_checkpoints.py --trust-legacy-checkpoint {prior}")
    state = json.loads((root / name / "state.json").read_text())
    seconds = budget_seconds(state)
    if seconds is None:
        raise RuntimeError(f"{root / name / 'state.json'} holds no budget.train_seconds: the run's cumulative cap "
                           "cannot be set from it")
    logged = [r for r in read_records(log) if r.get("type") == "epoch" and r.get("epoch") == state["epoch"] - 1]
    return {"from": str(prior), "checkpoint": name, "epochs": state["epoch"], "step": state["global_step"],
            "train_seconds": float(seconds), "log_train_seconds": logged[-1].get("train_seconds") if logged else None}


def budget_seconds(state: dict) -> float | None:
    seconds = state.get("budget", {}).get("train_seconds")
    return None if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) else float(seconds)


def trained_seconds(run_dir: Path) -> float | None:
    """The cumulative training seconds of the checkpoint `latest` names in run_dir (packed or not): what a resume
    continues from. None where there is no such checkpoint or it holds no budget."""
    from recam.infra.checkpoint import read_pointer

    root = run_dir / "checkpoints"
    name = read_pointer(root) if root.is_dir() else None
    state = root / str(name) / "state.json"
    if name is None or not state.is_file():
        return None
    try:
        return budget_seconds(json.loads(state.read_text()))
    except ValueError:
        return None


def pack(run_dir: Path) -> dict:
    """Leave in run_dir what continuing it needs and what it reports: the checkpoint `latest` names (weights,
    optimizer state, the base's evaluation) and the one `selected` names (the run never prunes it either), the log
    gzipped. A `latest` that names no folder prunes nothing. Returns the bundle's size."""
    from recam.infra.checkpoint import SELECTED, read_pointer

    root = run_dir / "checkpoints"
    latest = read_pointer(root)
    kept = sorted(n for n in {latest, read_pointer(root, SELECTED)} - {None} if (root / n).is_dir())
    out: dict = {"checkpoints": kept}
    if latest not in kept:
        out["pruned"] = f"nothing: {root / 'latest'} names no checkpoint folder"
        out["checkpoints"] = sorted(p.name for p in root.glob("epoch_*") if p.is_dir())
    else:
        for folder in sorted(root.iterdir()):  # epoch_* and the .tmp-* of a save that was killed
            if folder.is_dir() and folder.name not in kept:
                if folder.is_symlink():  # a linked checkpoint: drop the link, never what it points to
                    folder.unlink()
                else:
                    shutil.rmtree(folder)
    log = run_dir / "metrics.jsonl"
    if log.exists():
        with log.open("rb") as src, gzip.open(run_dir / PACKED_LOG, "wb") as dst:
            shutil.copyfileobj(src, dst)
        log.unlink()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size, default=None)
    out.update({"bytes": sum(p.stat().st_size for p in files),
                "largest_file": None if largest is None else str(largest.relative_to(run_dir)),
                "largest_file_bytes": None if largest is None else largest.stat().st_size})
    return out
