"""Several weights of one preset's model on the preset's own held-out evaluation: each one's metrics, and each
one's change from the first, paired over the held-out conditions (the same conditions and noise for all).

    python scripts/measure/heldout_compare.py --preset tiny_cpu checkpoints/recam_tiny_base /tmp/oracle/lr1e-4 \
        --metric eval/cam_score --metric eval/placed_fraction --metric eval/rot_err_placed_mean

Made for the camera's oracle (issue 62): the base fine-tuned by supervision toward the ground truth
(scripts/pretrain/pretrain_base.py --init-from checkpoints/recam_tiny_base) at GRPO's sample budget, read on the
endpoint GRPO is judged on. Each folder is passed as model.pretrained; nothing is trained.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")


def evaluate(preset: str, model: Path, conditions: int | None) -> dict:
    import torch

    from config.grpo import get_config
    from scripts.measure.at_base import trainer_at_base

    config = get_config(preset)
    config.num_threads = 1
    config.model.pretrained = str(model)
    if conditions:
        config.data.num_heldout_conditions = conditions
    torch.set_num_threads(1)
    with trainer_at_base(config) as trainer:
        trainer.model.eval()
        return trainer.evaluator.evaluate_split(trainer.heldout, "base", "eval", None)


def table(names: list[str], summaries: list[dict], metrics: list[str]) -> str:
    from recam.infra.reports import eval_change

    lines = ["| weights | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for i, (name, s) in enumerate(zip(names, summaries, strict=True)):
        cells = []
        for m in metrics:
            v = s.get(m, math.nan)
            cell = f"{v:.4f}" if isinstance(v, (int, float)) else "n/a"
            if i:
                d, h, _ = eval_change(summaries[0], s, m)
                cell += f" ({d:+.4f} ± {h:.4f})" if math.isfinite(h) else f" ({d:+.4f})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    n = summaries[0].get("eval/num_conditions")
    return "\n".join(lines) + f"\n\n({n} held-out conditions; in brackets the change from {names[0]}, paired over " \
                              "them, ± a 95% t half-width)\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path,
                    help="model folders (diffusers save_pretrained), the first the base")
    ap.add_argument("--preset", default="tiny_cpu")
    ap.add_argument("--metric", action="append", default=[])
    ap.add_argument("--conditions", type=int, default=None, help="held-out conditions (default: the preset's)")
    args = ap.parse_args(argv)
    for m in args.models:
        if not (m / "config.json").is_file():
            raise SystemExit(f"{m}: no config.json (not a saved model folder)")
    summaries = [evaluate(args.preset, m, args.conditions) for m in args.models]
    metrics = args.metric or ["eval/cam_score", "eval/placed_fraction", "eval/rot_err_placed_mean",
                              "eval/trans_err_placed_mean", "eval/fidelity"]
    text = table([str(m) for m in args.models], summaries, metrics)
    print(text)
    return text


if __name__ == "__main__":
    main()
