"""Train the text/motion retrieval evaluator (recam.domains.motion.evaluator.TextMotionEvaluator) that the motion
domain's alignment reward and protocol metrics are measured in.

Objective: symmetric InfoNCE between caption and motion embeddings over each batch (`contrastive_loss`, repeated
captions kept out of each other's negatives). Data: the synthetic world's train split (MotionWorld, data seed
--data-seed), or HumanML3D's train split (--source humanml3d --root FOLDER). The evaluator reads raw HumanML3D
features and carries the normalisation it was trained with (the world's reference Mean/Std, or the folder's).

Reported (and written to provenance.json): R-precision top-1/2/3 in shuffled pools of 32 and MM-Dist on the
held-out split (HumanML3D: test) and the validation split (HumanML3D: val), which play no part in training; the
weights saved are the last step's, so neither split chooses them.

Writes <out>/evaluator.json, vocab.json, evaluator.safetensors (TextMotionEvaluator.save) and provenance.json
(command, seed, git commit, wall time, numbers). Deterministic for a given --seed and --threads.

    python scripts/pretrain/train_motion_evaluator.py --out checkpoints/motion_evaluator
    python scripts/pretrain/train_motion_evaluator.py --out /tmp/ev --steps 20 --num-train-conditions 64 \
        --num-eval-conditions 32
    python scripts/pretrain/train_motion_evaluator.py --evaluate checkpoints/motion_grader --data-seed 0

The held-out grader (checkpoints/motion_grader, motion.metric_evaluator's default) is a second evaluator of
another architecture, initialisation and draw of the training data, so that the reported R-precision, MM-Dist and
FID share no weights with the alignment reward GRPO maximises:

    python scripts/pretrain/train_motion_evaluator.py --out checkpoints/motion_grader --arch transformer --seed 1 \
        --data-seed 1

--data-seed redraws the synthetic world's items (nuisances, wording) but not its splits, which are fixed by motion
parameters (recam/domains/motion/world.py): held-out and validation motions stay out of training at any seed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recam.domains.motion import evaluator as ev  # noqa: E402
from recam.domains.motion.domain import MotionSplit  # noqa: E402


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # not a checkout, or git missing: provenance says so
        return None


def git_dirty() -> bool | None:
    """Whether the checkout differs from its commit: a commit alone then does not say what code trained the model."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=30, check=True).stdout.strip())
    except Exception:
        return None


def splits(args) -> tuple[MotionSplit, MotionSplit, MotionSplit, np.ndarray, np.ndarray]:
    """(train, held-out, validation, mean, std): the evaluator trains on the first and is measured on the others."""
    if args.source == "synthetic":
        from recam.domains.motion.world import MotionWorld, reference_mean_std

        mean, std = reference_mean_std()
        return (MotionSplit(MotionWorld("train", args.num_train_conditions, args.data_seed)),
                MotionSplit(MotionWorld("held_out", args.num_eval_conditions, args.data_seed)),
                MotionSplit(MotionWorld("validation", args.num_eval_conditions, args.data_seed)), mean, std)
    from recam.domains.motion.humanml3d import HumanML3DDataset

    train = HumanML3DDataset(args.root, "train")
    return (MotionSplit(train, args.num_train_conditions), MotionSplit(HumanML3DDataset(args.root, "test"),
            args.num_eval_conditions), MotionSplit(HumanML3DDataset(args.root, "val"), args.num_eval_conditions),
            train.mean, train.std)


def raw_batch(split: MotionSplit, indices, mean, std) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(captions, raw features (b, 196, 263) zero after each length, lengths (b,))."""
    items = [split[int(i)] for i in indices]
    feats = np.stack([np.asarray(it.features, dtype=np.float32) for it in items])
    lengths = np.array([int(it.length) for it in items])
    raw = feats * np.asarray(std, dtype=np.float32) + np.asarray(mean, dtype=np.float32)
    raw[np.arange(raw.shape[1])[None, :] >= lengths[:, None]] = 0.0
    return [it.caption for it in items], torch.from_numpy(raw), torch.from_numpy(lengths)


@torch.no_grad()
def retrieval(model: ev.TextMotionEvaluator, split: MotionSplit, mean, std, seed: int, batch: int = 128) -> dict:
    """R-precision top-1/2/3 (pools of 32, or one pool of all when fewer; 20 shuffles from `seed`) and MM-Dist."""
    model.eval()
    text, motion = [], []
    for start in range(0, len(split), batch):
        captions, feats, lengths = raw_batch(split, range(start, min(start + batch, len(split))), mean, std)
        text.append(model.encode_text(captions))
        motion.append(model.encode_motion(feats, lengths))
    text, motion = torch.cat(text).numpy(), torch.cat(motion).numpy()
    pool = min(ev.R_PRECISION_POOL, len(split))
    rng = np.random.default_rng(seed)
    tops = np.mean([ev.r_precision(text[order], motion[order], pool) for order in
                    (rng.permutation(len(split)) for _ in range(ev.REPETITIONS))], axis=0)
    return {"r_precision_top1": float(tops[0]), "r_precision_top2": float(tops[1]),
            "r_precision_top3": float(tops[2]), "mm_dist": ev.matching_score(text, motion), "pool": pool,
            "num_conditions": len(split)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output folder (evaluator files + provenance.json)")
    p.add_argument("--evaluate", type=Path, default=None,
                   help="instead of training, measure this evaluator folder on the held-out and validation splits "
                        "of --data-seed (shuffles from --seed), e.g. two evaluators on the same captions")
    p.add_argument("--seed", type=int, default=0, help="initialisation, batch order and dropout")
    p.add_argument("--source", choices=("synthetic", "humanml3d"), default="synthetic")
    p.add_argument("--root", type=str, default="", help="humanml3d: the HumanML3D folder")
    p.add_argument("--data-seed", type=int, default=0, help="synthetic: the world's seed (the GRPO runs' data.seed)")
    p.add_argument("--num-train-conditions", type=int, default=4096, help="humanml3d: 0 = every train caption")
    p.add_argument("--num-eval-conditions", type=int, default=256, help="held-out and validation captions each")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out / validation reports")
    p.add_argument("--arch", choices=ev.ARCHITECTURES, default="gru",
                   help="EvaluatorConfig.architecture: gru (T2M's layout) or transformer")
    p.add_argument("--embed-dim", type=int, default=128, help="evaluator sizes (EvaluatorConfig)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.source == "humanml3d" and not args.root:
        p.error("--source humanml3d needs --root")
    if (args.out is None) == (args.evaluate is None):
        p.error("give --out (train) or --evaluate FOLDER (measure), not both")
    for name in ("steps", "batch_size", "eval_every", "num_eval_conditions"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, heldout, validation, mean, std = splits(args)
    if args.evaluate is not None:
        model = ev.load_evaluator(args.evaluate)
        report = {"evaluator": str(args.evaluate), "architecture": model.config.architecture,
                  "data": args.source, "data_seed": args.data_seed,
                  "heldout": retrieval(model, heldout, mean, std, args.seed),
                  "validation": retrieval(model, validation, mean, std, args.seed)}
        print(json.dumps(report, indent=2))
        return report
    captions = [train[i].caption for i in range(len(train))]
    model = ev.TextMotionEvaluator.from_captions(captions, word_dim=args.hidden, text_hidden=args.hidden,
                                                 motion_channels=args.hidden, motion_hidden=args.hidden,
                                                 embed_dim=args.embed_dim, architecture=args.arch)
    model.set_feature_stats(np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def lr_at(step):  # linear warmup, then cosine to 5 % of the peak
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        frac = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    order, cursor = torch.randperm(len(train), generator=gen), 0
    history, losses = [], []
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):  # a new epoch: every condition once per pass
            order, cursor = torch.randperm(len(train), generator=gen), 0
        batch = order[cursor:cursor + args.batch_size].tolist()
        cursor += args.batch_size
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = ev.contrastive_loss(model, *raw_batch(train, batch, mean, std))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            report = {"step": step + 1, "train_loss": float(np.mean(losses[-args.eval_every:])),
                      "heldout": retrieval(model, heldout, mean, std, args.seed),
                      "validation": retrieval(model, validation, mean, std, args.seed)}
            history.append(report)
            print(json.dumps(report), flush=True)
    model.eval()
    model.save(args.out)
    final = history[-1]
    provenance = {
        "command": shlex.join(["python", "scripts/pretrain/train_motion_evaluator.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "seed": args.seed,
        "architecture": args.arch,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "wall_time_s": time.time() - t0,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary_size": len(model.vocab),
        "num_train_conditions": len(train),
        "data": args.source if args.source == "synthetic" else f"humanml3d:{args.root}",
        "final_train_loss": final["train_loss"],
        "heldout": final["heldout"],
        "validation": final["validation"],
        "history": history,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps({k: provenance[k] for k in ("wall_time_s", "final_train_loss", "heldout", "validation")},
                     indent=2))
    return provenance


if __name__ == "__main__":
    main()
