"""Pretrain the motion domain's tiny base: an MDM-layout x0 predictor (tiny_config: latent 64, 3 layers) and its own
word-level text encoder, trained jointly on the synthetic text-to-motion world's train split.

Objective (MDM's, per sample; x0 = the normalised reference features, zero after the clip's length):
    t ~ U{0 .. diffusion_steps - 1} on the cosine schedule (alpha-bar a_t), noise ~ N(0, I),
    x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise,
    loss = mean over the real frames' features of (model(x_t, t, text, padding mask) - x0)^2.
Padded frames of x_t are noise over zero data, exactly what sampling sees there once the domain zeroes the x0
prediction at padded frames; they get no attention (mask_frames) and no loss. The caption is dropped (replaced by
the model's unconditional token) with probability --text-dropout (MDM: 0.1), which classifier-free guidance needs.

Text encoder: a word-level embedding + bidirectional GRU (recam.domains.motion.domain.WordTextEncoder), its
vocabulary the training captions', trained by the same loss. It is deliberately not the retrieval evaluator's text
tower: the alignment reward reads that evaluator, and a policy conditioned on the reward's own text features could
raise the reward by matching those features rather than the caption.

Evaluation (every --eval-every steps and at the end, on held-out captions, never used to choose weights): the x0
loss at fixed timesteps and noise, and deterministic DDIM samples (--eval-steps, guidance --guidance) scored by the
physics reward and, with --evaluator, by the alignment reward and R-precision in that evaluator's embedding.

Writes <out>/config.json + diffusion_pytorch_model.safetensors (the model), <out>/text_encoder/, motion_base.json
(schedule, frame masking, prediction, data: what the GRPO domain checks) and provenance.json (command, seed, git
commit, wall time, numbers). Deterministic for a given --seed and --threads.

    python scripts/pretrain/pretrain_motion_base.py --out checkpoints/motion_tiny_base \
        --evaluator checkpoints/motion_evaluator
    python scripts/pretrain/pretrain_motion_base.py --out /tmp/base --steps 10 --num-train-conditions 64 --eval-every 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
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
from recam.domains.motion.domain import (  # noqa: E402
    MotionSplit,
    WordTextConfig,
    WordTextEncoder,
    cosine_alphas_cumprod,
    guided_x0,
    motion_samples,
    no_dropout,
    one_attention_path,
    save_base,
)
from recam.domains.motion.model import MotionDiffusionModel, from_mdm_layout, tiny_config, to_mdm_layout  # noqa: E402
from recam.domains.motion.rewards import MotionAlignment, MotionPhysics  # noqa: E402
from recam.domains.motion.world import MotionWorld, reference_mean_std  # noqa: E402
from recam.engine.rollout import deterministic_sample  # noqa: E402
from recam.engine.scheduler import DDIMScheduler  # noqa: E402


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:  # not a checkout, or git missing: provenance says so
        return None


def stack(split: MotionSplit, indices) -> tuple[list, torch.Tensor, torch.Tensor]:
    """(items, x0 (b, 263, 1, 196) normalised in MDM layout, lengths (b,))."""
    items = [split[int(i)] for i in indices]
    feats = torch.stack([torch.as_tensor(np.asarray(it.features), dtype=torch.float32) for it in items])
    return items, to_mdm_layout(feats).contiguous(), torch.tensor([int(it.length) for it in items])


def x0_loss(model, text_encoder, items, x0, lengths, t, noise, alphas, drop, mask_frames: bool) -> torch.Tensor:
    """Mean squared x0 error over the real frames' features (module docstring)."""
    a = alphas[t].float().view(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    padding = torch.arange(x0.shape[-1])[None, :] >= lengths[:, None]
    text = text_encoder([it.caption for it in items])
    pred = model(xt, t, text, drop_text=drop, padding_mask=padding if mask_frames else None)
    real = (~padding)[:, None, None, :].float()
    return (((pred - x0) ** 2) * real).sum() / (real.sum() * x0.shape[1])


@torch.no_grad()
def evaluate(model, text_encoder, split: MotionSplit, alphas, args, mean, std, alignment) -> dict:
    """Held-out x0 loss (fixed t and noise per condition) and the scores of deterministic guided samples."""
    model.eval()
    text_encoder.eval()
    scheduler = DDIMScheduler(alphas.float(), args.eval_steps, 0.0, "sample")
    physics = MotionPhysics()
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, scores, embeddings = [], {"motion_physics": [], "motion_alignment": []}, []
    for start in range(0, len(split), args.batch_size):
        items, x0, lengths = stack(split, range(start, min(start + args.batch_size, len(split))))
        b = len(items)
        t = torch.randint(0, len(alphas), (b,), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        losses.append(float(x0_loss(model, text_encoder, items, x0, lengths, t, noise, alphas,
                                    torch.zeros(b, dtype=torch.bool), args.mask_frames)) * b)
        padding = torch.arange(x0.shape[-1])[None, :] >= lengths[:, None]
        text = text_encoder.encode([it.caption for it in items])
        real = (~padding)[:, None, None, :]

        def denoise(x, tt, text=text, padding=padding, real=real):
            with one_attention_path(model):
                out = guided_x0(model, x, tt, text, args.guidance, padding if args.mask_frames else None)
            return torch.where(real, out, torch.zeros(())).contiguous()
        final = deterministic_sample(denoise, torch.randn(x0.shape, generator=gen), scheduler)
        motions = motion_samples(from_mdm_layout(final), lengths, mean, std)
        scores["motion_physics"] += physics(motions, items)[0].tolist()
        if alignment is not None:
            scores["motion_alignment"] += alignment(motions, items)[0].tolist()
            e = alignment.evaluator
            embeddings.append((e.encode_text([it.caption for it in items]),
                               e.encode_motion(torch.nan_to_num(motions.features), lengths)))
    out = {"heldout_x0_loss": sum(losses) / len(split)}
    out.update({f"sample_{k}": float(np.nanmean(v)) for k, v in scores.items() if v})
    if embeddings:
        text = torch.cat([e[0] for e in embeddings]).numpy()
        motion = torch.cat([e[1] for e in embeddings]).numpy()
        tops = ev.r_precision(text, motion, min(ev.R_PRECISION_POOL, len(text)))
        out.update({"sample_r_precision_top1": float(tops[0]), "sample_r_precision_top3": float(tops[2])})
    model.train()
    text_encoder.train()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output base folder")
    p.add_argument("--seed", type=int, default=0, help="initialisation, batches, timesteps, noise, text dropout")
    p.add_argument("--data-seed", type=int, default=0, help="the world's seed (the GRPO runs' data.seed)")
    p.add_argument("--num-train-conditions", type=int, default=4096)
    p.add_argument("--num-eval-conditions", type=int, default=64, help="held-out captions evaluated")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--text-dropout", type=float, default=0.1, help="caption dropped with this probability (MDM 0.1)")
    p.add_argument("--diffusion-steps", type=int, default=1000, help="cosine schedule length (motion.diffusion_steps)")
    p.add_argument("--mask-frames", action=argparse.BooleanOptionalAction, default=True,
                   help="padded frames get no attention (motion.mask_frames)")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-steps", type=int, default=20, help="DDIM steps of the evaluation samples")
    p.add_argument("--guidance", type=float, default=2.5, help="classifier-free guidance of the evaluation samples")
    p.add_argument("--evaluator", type=str, default="", help="retrieval evaluator folder: alignment of the samples")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--save-every", type=int, default=500,
                   help="write <out>/resume/state.pt every this many steps (0: never), so a run cut short resumes")
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>/resume/state.pt when it exists (same arguments), bit for bit")
    p.add_argument("--stop-at", type=int, default=0,
                   help="stop after this many steps with the resume state written (a long run split over sessions)")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "eval_every", "num_eval_conditions", "eval_steps", "diffusion_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.text_dropout < 1:
        p.error("--text-dropout must be in [0, 1)")
    if args.save_every < 0 or args.stop_at < 0:
        p.error("--save-every and --stop-at must be >= 0")
    return args


# arguments that may differ between the stages of one resumed run: they do not change what is computed
STAGE_ARGS = ("threads", "save_every", "resume", "stop_at")


def resume_file(out: Path) -> Path:
    return Path(out) / "resume" / "state.pt"


def save_state(out: Path, state: dict) -> None:
    """Write the resume state atomically: a run killed while writing keeps the previous state intact."""
    path = resume_file(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(out: Path, args: argparse.Namespace) -> dict | None:
    """The resume state of an earlier stage of this run, or None; refused when it was made with other arguments."""
    path = resume_file(out)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data only: no code
    except Exception as e:  # noqa: BLE001 - a torn or foreign file: say which and why
        raise SystemExit(f"{path}: cannot read the resume state ({type(e).__name__}: {e})") from None
    mine = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in STAGE_ARGS}
    theirs = {k: v for k, v in state["args"].items() if k not in STAGE_ARGS}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise SystemExit(f"{path} was written with other arguments ({diff}); resume with the same ones or use "
                         "another --out")
    return state


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # initialisation and the model's dropout
    mean, std = reference_mean_std()
    train = MotionSplit(MotionWorld("train", args.num_train_conditions, args.data_seed))
    heldout = MotionSplit(MotionWorld("held_out", args.num_eval_conditions, args.data_seed))
    sizes = tiny_config()
    sizes["cond_mask_prob"] = args.text_dropout
    model = MotionDiffusionModel(**sizes)
    text_encoder = WordTextEncoder.from_captions([train[i].caption for i in range(len(train))],
                                                 WordTextConfig(text_dim=sizes["text_dim"]))
    alignment = MotionAlignment(ev.TextMotionEvaluator.load(args.evaluator), args.evaluator) if args.evaluator \
        else None
    alphas = cosine_alphas_cumprod(args.diffusion_steps)
    params = [*model.parameters(), *text_encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)

    def lr_at(step):  # linear warmup, then cosine to 5 % of the peak
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        frac = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    order, cursor = torch.randperm(len(train), generator=gen), 0
    history, losses, first, seconds_before = [], [], 0, 0.0
    state = load_state(args.out, args) if args.resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        text_encoder.load_state_dict(state["text_encoder"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])  # the model's dropout
        order, cursor, first = state["order"], state["cursor"], state["step"]
        history, losses, seconds_before = state["history"], state["losses"], state["seconds"]
        print(f"resumed from {resume_file(args.out)} at step {first}", flush=True)

    def snapshot(step: int) -> dict:
        return {"model": model.state_dict(), "text_encoder": text_encoder.state_dict(), "optimizer": opt.state_dict(),
                "generator": gen.get_state(), "torch_rng": torch.get_rng_state(), "order": order, "cursor": cursor,
                "step": step, "history": history, "losses": losses, "seconds": seconds_before + time.time() - t0,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    model.train()
    text_encoder.train()
    for step in range(first, args.steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=gen), 0
        items, x0, lengths = stack(train, order[cursor:cursor + args.batch_size].tolist())
        cursor += args.batch_size
        t = torch.randint(0, args.diffusion_steps, (len(items),), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        drop = model.random_text_drop(len(items), generator=gen, device="cpu")
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = x0_loss(model, text_encoder, items, x0, lengths, t, noise, alphas, drop, args.mask_frames)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # GRPO runs the model without dropout: the samples are measured the same way, on a copy
            probe = no_dropout(MotionDiffusionModel(**sizes))
            probe.load_state_dict(model.state_dict())
            report = {"step": step + 1, "train_loss": float(np.mean(losses[-args.eval_every:])),
                      **evaluate(probe, text_encoder, heldout, alphas, args, mean, std, alignment)}
            history.append(report)
            print(json.dumps(report), flush=True)
        done = step + 1
        if done < args.steps and ((args.save_every and done % args.save_every == 0) or done == args.stop_at):
            save_state(args.out, snapshot(done))
        if done == args.stop_at and done < args.steps:
            print(f"stopped at step {done} of {args.steps}; continue with the same command and --resume", flush=True)
            return {"stopped_at": done}
    opt.zero_grad(set_to_none=True)
    model.eval()
    text_encoder.eval()
    meta = {"diffusion_steps": args.diffusion_steps, "noise_schedule": "cosine", "prediction": "x0",
            "mask_frames": args.mask_frames, "data": "synthetic", "data_seed": args.data_seed,
            "text_dropout": args.text_dropout,
            "text_encoder": "word-level embedding + bidirectional GRU, trained jointly with the model"}
    save_base(args.out, model, text_encoder, meta)
    final = history[-1]
    provenance = {
        "command": shlex.join(["python", "scripts/pretrain/pretrain_motion_base.py", *(sys.argv[1:] if argv is None
                                                                             else argv)]),
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git_commit": git_commit(),
        "wall_time_s": seconds_before + time.time() - t0,  # over every stage of a resumed run
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "text_encoder_parameters": sum(p.numel() for p in text_encoder.parameters()),
        "vocabulary_size": len(text_encoder.vocab),
        "num_train_conditions": len(train),
        "final_train_loss": final["train_loss"],
        "final_eval": {k: v for k, v in final.items() if k not in ("step", "train_loss")},
        "history": history,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    resume_file(args.out).unlink(missing_ok=True)  # the run is complete: the base folder holds weights only
    with contextlib.suppress(OSError):
        resume_file(args.out).parent.rmdir()
    print(json.dumps({k: provenance[k] for k in ("wall_time_s", "final_train_loss", "final_eval")}, indent=2))
    return provenance


if __name__ == "__main__":
    main()
