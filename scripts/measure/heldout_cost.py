"""What one held-out evaluation of a preset's base costs, at several held-out counts: the seconds of the trainer's
own held-out pass (Evaluator.evaluate_split: sampling, decoding and scoring every condition), on one thread.

    OMP_NUM_THREADS=1 python scripts/measure/heldout_cost.py --preset tiny_cpu --conditions 32,128 --repeats 3

Per count: the first evaluation, which also renders the synthetic conditions (a run's base evaluation pays that
once, the later evaluations reuse them), then --repeats more, reported with their median. The validation and
training-condition evaluations a run adds beside it are not counted (their counts are settings of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")


def evaluation_seconds(preset: str, conditions: int, repeats: int) -> dict:
    import torch

    from config.grpo import get_config
    from scripts.measure.at_base import trainer_at_base

    config = get_config(preset)
    config.num_threads = 1
    config.data.num_heldout_conditions = conditions
    torch.set_num_threads(1)
    with trainer_at_base(config) as trainer:
        trainer.model.eval()
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            summary = trainer.evaluator.evaluate_split(trainer.heldout, "base", "eval", None)
            times.append(time.perf_counter() - t0)
    if summary["eval/num_conditions"] != conditions:
        raise RuntimeError(f"asked for {conditions} held-out conditions, evaluated {summary['eval/num_conditions']}")
    return {"conditions": conditions, "first_s": times[0], "repeats_s": times[1:],
            "median_s": statistics.median(times[1:]) if repeats else None,
            "eval_batch_size": config.eval.batch_size, "eval_num_steps": config.sample.eval_num_steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny_cpu", help="config/grpo.py preset")
    ap.add_argument("--conditions", default="32,128", help="comma-separated held-out counts")
    ap.add_argument("--repeats", type=int, default=3, help="evaluations after the first, for the median")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    rows = [evaluation_seconds(args.preset, int(n), args.repeats) for n in args.conditions.split(",")]
    print(json.dumps({"preset": args.preset, "cpus": os.cpu_count(), "load_before": load, "load_after":
                      os.getloadavg(), "rows": rows}, indent=1))
    print("| held-out conditions | first evaluation (renders them) s | median of the next s | per condition s |")
    print("|---|---|---|---|")
    for r in rows:
        per = r["median_s"] / r["conditions"] if r["median_s"] is not None else None
        print(f"| {r['conditions']} | {r['first_s']:.2f} | "
              f"{'n/a' if r['median_s'] is None else format(r['median_s'], '.2f')} | "
              f"{'n/a' if per is None else format(per, '.3f')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
