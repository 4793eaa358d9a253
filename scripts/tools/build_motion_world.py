"""Build a motion preset's synthetic worlds into its world cache (motion.world_cache) on many processes, before the
runs that read them: on a fresh machine (a GPU window) the first training process would otherwise build its 4,096
training motions one after another in its first epoch.

    python scripts/tools/build_motion_world.py --preset motion_tiny_gpu --workers 16

Builds the train, held-out and (when the preset selects a checkpoint) validation splits as the motion domain does,
and prints the seconds each took; a world already in the cache is read, not rebuilt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.grpo import get_config  # noqa: E402
from recam.domains.motion.world import MotionWorld  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="motion_tiny_gpu")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    c = get_config(args.preset)
    cache = c.motion.get("world_cache", "")
    if not cache or c.data.source != "synthetic":
        raise SystemExit(f"{args.preset} has no synthetic world cache (motion.world_cache={cache!r})")
    d = c.data
    splits = [("train", d.num_train_conditions), ("held_out", d.num_heldout_conditions)]
    if c.eval.select_by:
        splits.append(("validation", d.num_val_conditions))
    for split, n in splits:
        start = time.perf_counter()
        MotionWorld(split, n, d.seed, cache_dir=cache).build_all(args.workers)
        print(f"{split}: {n} motions in {time.perf_counter() - start:.1f} s ({cache})")


if __name__ == "__main__":
    main()
