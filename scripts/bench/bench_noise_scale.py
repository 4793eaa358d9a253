"""What measuring the gradient noise scale (train.noise_scale, recam.engine.noise_scale) costs an update, on the tiny
presets: one epoch's samples are drawn and scored once, then the update over them is timed with the measurement on
and off, alternating (on, off, off, on, ...) so that the machine's load hits both alike.

    python scripts/bench/bench_noise_scale.py                                   # tiny_cpu and motion_tiny_cpu, 5 rounds
    python scripts/bench/bench_noise_scale.py --presets motion_tiny_cpu --repeats 9 --out noise_bench.json

Per preset it prints the median seconds of an update with and without it, their ratio, and, timed inside the same
updates, the seconds spent in the measurement itself (the gradient snapshots and norms after each micro-batch and
the step's estimate): the ratio of medians carries the machine's noise, the direct time does not. The target is at
most 5% of an update. The training order that keeps groups together serves the update either way and is not
counted; its seconds are printed beside.

Measured on this repository's 2-core CPU machine, shared (load average 5 to 7), 5 rounds; tiny_cpu on torch's 2
threads, motion_tiny_cpu on its preset's 1:

    | preset          | samples (micro x step) | update off s | update on s | on / off | measurement s (share) |
    | tiny_cpu        | 128 (8 x 16)           | 93.9         | 96.7        | 1.030    | 0.081 (0.09%)         |
    | motion_tiny_cpu | 64 (8 x 4)             | 12.70        | 12.74       | 1.003    | 0.018 (0.14%)         |

The updates themselves varied by +-20% between rounds with the load, so the ratio of medians is within that noise;
the time spent inside the measurement is a thousandth of an update.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from config.grpo import get_config  # noqa: E402
from recam.engine import noise_scale  # noqa: E402
from scripts.measure.at_base import trainer_at_base  # noqa: E402


class Stopwatch:
    """Seconds spent in the measurement's calls, summed (NoiseScale.probe and finish_step, StepProbe's snapshots)."""

    def __init__(self):
        self.seconds = 0.0
        self.originals = []

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        self.originals.append((owner, name, original))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self.originals):
            setattr(owner, name, original)


def bench(preset: str, repeats: int) -> dict:
    config = get_config(preset)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    with trainer_at_base(config) as trainer, contextlib.redirect_stdout(io.StringIO()):
        rollouts = trainer.sample(0)
        groups = trainer.advantages(rollouts, trainer.score())
        P = trainer.world_size
        t0 = time.perf_counter()
        units = noise_scale.group_units(groups.index.view(P, -1))
        noise_scale.group_order(units, torch.Generator().manual_seed(0))
        order_s = time.perf_counter() - t0
        watch = Stopwatch()
        watch.wrap(trainer.noise, "probe")
        watch.wrap(trainer.noise, "finish_step")
        watch.wrap(noise_scale.StepProbe, "after_micro_batch")
        times = {True: [], False: []}
        inside = []
        try:
            trainer.update(rollouts, groups, {})  # warm-up: first-call allocations count for neither
            for r in range(repeats):
                for enabled in ((True, False) if r % 2 == 0 else (False, True)):
                    trainer.noise.enabled = enabled
                    watch.seconds = 0.0
                    t0 = time.perf_counter()
                    trainer.update(rollouts, groups, {})
                    times[enabled].append(time.perf_counter() - t0)
                    if enabled:
                        inside.append(watch.seconds)
                        record = trainer.noise.record()  # the estimate of the last update measured
        finally:
            watch.restore()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"preset": preset, "samples": len(rollouts.states), "micro_batch": config.train.batch_size,
            "micro_batches_per_step": config.train.gradient_accumulation_steps,
            "threads": torch.get_num_threads(), "repeats": repeats, "update_on_s": on, "update_off_s": off,
            "ratio": on / off, "measurement_s": statistics.median(inside),
            "measurement_share": statistics.median(inside) / off, "group_order_s": order_s,
            "update_on_all_s": times[True], "update_off_all_s": times[False], "measurement_all_s": inside,
            "last_estimate": {k: record[k] for k in ("gradient_noise_scale", "update_consistent_share",
                                                     "noise/small_batches", "noise/reason")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny_cpu,motion_tiny_cpu", help="comma-separated config/grpo.py presets")
    ap.add_argument("--repeats", type=int, default=5, help="updates timed with the measurement on, and as many off")
    ap.add_argument("--out", default="", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    rows = [bench(p, args.repeats) for p in args.presets.split(",") if p]
    print("| preset | samples (micro-batch x per step) | update off s | update on s | on / off | measurement s "
          "(share of update) | group order s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['samples']} ({r['micro_batch']} x {r['micro_batches_per_step']}) | "
              f"{r['update_off_s']:.3f} | {r['update_on_s']:.3f} | {r['ratio']:.4f} | {r['measurement_s']:.4f} "
              f"({100 * r['measurement_share']:.2f}%) | {r['group_order_s']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
