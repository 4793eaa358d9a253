"""Convert checkpoints written before checkpoints were pickle-free (they hold trainer.pt) to the current layout
(trainer.safetensors + trainer.json), once.

    python scripts/tools/convert_checkpoints.py --trust-legacy-checkpoint RUN_DIR \
        [RUN_DIR | CHECKPOINTS | EPOCH_DIR ...]

A trainer.pt is a pickle, and loading a pickle can run code: convert only folders holding checkpoints you wrote
(hence the flag, as train_recam.py's --config.trust_legacy_checkpoint=True, which converts the checkpoint a run
resumes from). Even then it is read with torch's weights-only unpickler, so a file holding more than tensors and
plain data is refused, not run. Each checkpoint's manifest is checked first; every other file is kept byte for
byte and the converted folder is swapped in whole (recam.infra.checkpoint.convert_legacy). Exit status 1 when a
checkpoint could not be converted (each named in one line), else 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from recam.infra.checkpoint import CheckpointCorrupt, convert_legacy_folder, epoch_of  # noqa: E402


def checkpoint_folders(path: Path) -> list[Path]:
    """The epoch_NNNN folders `path` names: itself, those in it, or those in its checkpoints/ folder."""
    if epoch_of(path) is not None:
        return [path]
    inner = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return sorted(p for p in inner.glob("epoch_*") if p.is_dir() and epoch_of(p) is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="run folders, checkpoints folders or checkpoint folders")
    ap.add_argument("--trust-legacy-checkpoint", action="store_true",
                    help="required: these checkpoints are yours (a trainer.pt is a pickle)")
    args = ap.parse_args(argv)
    if not args.trust_legacy_checkpoint:
        ap.error("a trainer.pt is a pickle, which can run code: pass --trust-legacy-checkpoint to convert folders "
                 "holding only checkpoints you wrote")
    failed = 0
    for folder in args.folders:
        found = checkpoint_folders(folder)
        if not found:
            print(f"{folder}: no epoch_NNNN checkpoint folder here", file=sys.stderr)
            failed += 1
        for ckpt in found:
            try:
                print(f"{ckpt}: {'converted' if convert_legacy_folder(ckpt) else 'already pickle-free'}")
            except CheckpointCorrupt as e:
                print(f"{ckpt}: not converted: {' '.join(str(e).split())}", file=sys.stderr)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
