"""Pretrain the ReCam-Tiny base model with the rectified-flow objective on the synthetic world.

Objective (per sample, x0 = ground-truth target render, noise ~ N(0, I)):
    x_sigma = (1 - sigma) x0 + sigma noise,  v_target = noise - x0,
    loss = mean over (C, F, H, W) of (v_theta(x_sigma, sigma, source, cams) - v_target)^2,
computed on the target half only (the model returns only that half).

sigma sampling (``--sigma-sampling``):
    logit_normal (default): sigma = sigmoid(n), n ~ N(0, 1) as in SD3 / Wan training. It puts most
        samples at mid noise where the velocity is hardest to predict, while both ends still get
        some mass; a small uniform share (10 %) is mixed in so that sigma near 1 (where GRPO's
        first sampling steps live) and near 0 are not starved.
    uniform: sigma ~ U(0, 1).

Evaluation: deterministic Euler ODE sampling (``--eval-ode-steps`` steps, sigmas linspace 1 -> 0) on
held-out conditions from the world's held-out split, reporting the MSE of the samples to the
ground-truth renders and, when rewards/cam_score.py exists, the mean cam_score of the samples and of
the ground-truth renders.

Writes ``<out>/config.json`` + ``<out>/diffusion_pytorch_model.safetensors`` (diffusers
save_pretrained) and ``<out>/provenance.json``.

Example (the committed checkpoint's exact command is in its provenance.json):
    python scripts/pretrain/pretrain_base.py --out checkpoints/recam_tiny_base --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from recam.domains.camera.model import ReCamTransformer3DModel, tiny_config  # noqa: E402
from recam.domains.camera.world import SyntheticWorld, collate_conditions  # noqa: E402

CAM_SCORE_FILE = ROOT / "rewards" / "cam_score.py"


def sample_sigmas(n: int, mode: str, generator: torch.Generator, uniform_share: float = 0.1) -> torch.Tensor:
    """Training noise levels, (n,) in (0, 1). See the module docstring for the two modes."""
    if mode == "uniform":
        return torch.rand(n, generator=generator)
    if mode == "logit_normal":
        sig = torch.sigmoid(torch.randn(n, generator=generator))
        use_uniform = torch.rand(n, generator=generator) < uniform_share
        return torch.where(use_uniform, torch.rand(n, generator=generator), sig)
    raise ValueError(f"unknown sigma sampling mode {mode!r}; use 'logit_normal' or 'uniform'")


def flow_matching_loss(
    model: ReCamTransformer3DModel,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    source_video: torch.Tensor,
    source_cams: torch.Tensor,
    target_cams: torch.Tensor,
    detail_weight: float = 0.0,
) -> torch.Tensor:
    """Rectified-flow MSE on the target half, each pixel weighted by detail_weights(x0, detail_weight).

    Args: x0, noise, source_video (B, 3, F, H, W); sigma (B,); cams (B, F, 3, 4).
    Returns: scalar loss.
    """
    s = sigma.view(-1, 1, 1, 1, 1)
    x_sigma = (1 - s) * x0 + s * noise
    pred = model(x_sigma, sigma, source_video, source_cams, target_cams)
    err = (pred - (noise - x0)) ** 2
    if detail_weight == 0:
        return torch.mean(err)
    return torch.mean(err * detail_weights(x0, detail_weight))


def detail_weights(x0: torch.Tensor, strength: float) -> torch.Tensor:
    """Per-pixel loss weights (B, 1, F, H, W) that are 1 + strength x the pixel's share of its frame's detail.

    Detail is the pixel's distance (summed over channels) from its 3 x 3 neighbourhood mean: the landmarks a camera
    is read from are a few pixels each, so under the plain mean squared error they are a few percent of the loss and
    a base can lower it by rendering the background better while it misplaces them. The detail is normalised to
    mean 1 per frame, so the weights' mean is 1 + strength in any frame with detail (a flat frame weighs 1).
    """
    b, c, f, h, w = x0.shape
    frames = x0.transpose(1, 2).reshape(b * f, c, h, w)
    local = F.avg_pool2d(frames, 3, stride=1, padding=1, count_include_pad=False)
    detail = (frames - local).abs().sum(1, keepdim=True)
    scale = detail.mean(dim=(2, 3), keepdim=True)
    # below 1e-6 a frame's "detail" is rounding error, which normalising would blow up into weights
    detail = torch.where(scale > 1e-6, detail / scale.clamp_min(1e-6), torch.zeros_like(detail))
    return (1 + strength * detail).reshape(b, f, 1, h, w).transpose(1, 2)


@torch.no_grad()
def euler_ode_sample(
    model: ReCamTransformer3DModel,
    noise: torch.Tensor,
    source_video: torch.Tensor,
    source_cams: torch.Tensor,
    target_cams: torch.Tensor,
    num_steps: int,
) -> torch.Tensor:
    """Deterministic Euler sampling from sigma = 1 to 0: x <- x + (sigma_next - sigma) v.

    Args: noise (B, 3, F, H, W) starting point at sigma = 1; other inputs as for the model.
    Returns: (B, 3, F, H, W) sample at sigma = 0.
    """
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    x = noise
    for i in range(num_steps):
        sigma = sigmas[i].expand(x.shape[0])
        v = model(x, sigma, source_video, source_cams, target_cams)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def render_conditions(world: SyntheticWorld, desc: str) -> tuple[list, list[int]]:
    """Render every condition of a world; returns (conditions, indices skipped).

    Scenes whose landmark placement fails (the world raises RuntimeError "could not place ...") are
    skipped and counted rather than aborting a 25-minute run; the count lands in provenance.json.
    """
    conditions, skipped = [], []
    for i in tqdm(range(len(world)), desc=desc):
        try:
            conditions.append(world[i])
        except RuntimeError as err:
            if "could not place" not in str(err):
                raise
            skipped.append(i)
    if skipped:
        print(f"warning: {desc}: skipped {len(skipped)} conditions whose scene could not be built: {skipped}")
    if not conditions:
        raise RuntimeError(f"{desc}: no condition could be rendered")
    return conditions, skipped


def stack_batch(conditions: list) -> dict:
    batch = collate_conditions(conditions)
    for key in ("source_video", "source_cams", "target_cams", "target_video"):
        batch[key] = batch[key].float()
    return batch


def evaluate(
    model: ReCamTransformer3DModel,
    eval_conditions: list,
    batch_size: int,
    ode_steps: int,
    seed: int,
    with_cam_score: bool,
) -> dict:
    """ODE-sample every held-out condition once (fixed noise) and score it."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    sq_err, n_elems = 0.0, 0
    gen_scores, gt_scores = [], []
    for start in range(0, len(eval_conditions), batch_size):
        conds = eval_conditions[start : start + batch_size]
        batch = stack_batch(conds)
        gt = batch["target_video"]
        noise = torch.randn(gt.shape, generator=gen)
        device = next(model.parameters()).device
        video = euler_ode_sample(
            model, *(t.to(device) for t in (noise, batch["source_video"], batch["source_cams"], batch["target_cams"])),
            ode_steps,
        ).cpu()
        sq_err += torch.sum((video - gt) ** 2).item()
        n_elems += gt.numel()
        if with_cam_score:
            from rewards.cam_score import cam_score

            gen_scores.append(cam_score(video.clamp(-1, 1), conds)[0])
            gt_scores.append(cam_score(gt, conds)[0])
    model.train(was_training)
    result = {"mse_to_ground_truth": sq_err / n_elems, "num_conditions": len(eval_conditions)}
    if with_cam_score:
        gen_all = torch.cat([torch.as_tensor(s, dtype=torch.float64) for s in gen_scores])
        gt_all = torch.cat([torch.as_tensor(s, dtype=torch.float64) for s in gt_scores])
        result["cam_score_generated"] = gen_all.mean().item()
        result["cam_score_ground_truth"] = gt_all.mean().item()
    return result


def measure_timings(model: ReCamTransformer3DModel, batch_size: int = 8, repeats: int = 5) -> dict:
    """Seconds per batched forward (no grad) and per forward+backward at the model's working size."""
    f, size = 8, 32
    x = torch.randn(batch_size, 3, f, size, size)
    sigma = torch.rand(batch_size)
    cams = torch.randn(batch_size, f, 3, 4)
    args = (x, sigma, x.clone(), cams, cams.clone())
    with torch.no_grad():
        model(*args)
        start = time.perf_counter()
        for _ in range(repeats):
            model(*args)
        fwd = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        model(*args).square().mean().backward()
    fwd_bwd = (time.perf_counter() - start) / repeats
    model.zero_grad(set_to_none=True)
    return {"batch_size": batch_size, "forward_s": fwd, "forward_backward_s": fwd_bwd}


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def lr_at(step: int, total: int, base_lr: float, warmup: int, final_fraction: float) -> float:
    """Linear warmup then cosine decay to final_fraction * base_lr."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def init_provenance(folder: Path | None) -> dict | None:
    """What a continued run starts from: the folder, its command and the optimizer steps behind it."""
    if folder is None:
        return None
    prov_file = Path(folder) / "provenance.json"
    try:
        prov = json.loads(prov_file.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--init-from {folder}: cannot read {prov_file} ({err}); a base without provenance "
                         "cannot say what budget it had") from None
    steps = prov.get("total_steps", prov.get("args", {}).get("steps"))
    if not isinstance(steps, int):
        raise SystemExit(f"--init-from {folder}: {prov_file} records no step count")
    return {"folder": str(folder), "command": prov.get("command"), "total_steps": steps,
            "git_commit": prov.get("git_commit")}


STATE_DIR = "train_state"
# arguments that may differ between a run and its resumption: where and how fast it runs, not what it computes
RESUMABLE_ANYWHERE = ("threads", "device", "state_every", "resume", "timing_repeats")


def save_state(out: Path, model, optimizer, gen: torch.Generator, perm: torch.Tensor, info: dict) -> None:
    """Write everything a run needs to continue bit for bit into out/train_state, replacing the last one only once the
    new one is complete (a crash mid-write leaves the previous state)."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for idx, entry in opt["state"].items():
        for key, value in entry.items():
            tensors[f"opt.{idx}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["generator"] = gen.get_state()
    tensors["perm"] = perm.contiguous()
    tmp = out / f"{STATE_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "state.safetensors")
    (tmp / "state.json").write_text(json.dumps({**info, "param_groups": opt["param_groups"]}, indent=1) + "\n")
    final = out / STATE_DIR
    old = out / f"{STATE_DIR}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_state(out: Path, model, optimizer, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Restore out/train_state into model and optimizer; returns (generator state, data order, info). Refuses, by
    name, a state saved with other arguments and a state that cannot be read."""
    folder = out / STATE_DIR
    try:
        info = json.loads((folder / "state.json").read_text())
        tensors = load_file(folder / "state.safetensors")
    except (OSError, ValueError, SafetensorError) as err:
        raise SystemExit(f"--resume: cannot read {folder} ({err})") from None
    now = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in RESUMABLE_ANYWHERE}
    was = {k: v for k, v in info["args"].items() if k not in RESUMABLE_ANYWHERE}
    if now != was:
        diff = sorted(k for k in set(now) | set(was) if now.get(k) != was.get(k))
        raise SystemExit(f"--resume: {folder} was saved with other arguments ({', '.join(diff)}); rerun with its own "
                         "or start a new --out")
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": info["param_groups"]})
    return tensors["generator"], tensors["perm"], info


def load_base(folder: Path, add_rays: bool = False) -> ReCamTransformer3DModel:
    """A base folder's model; with add_rays, a base without the ray pathway gains one, zero-initialised."""
    if not add_rays:
        return ReCamTransformer3DModel.from_pretrained(folder)
    config = {k: v for k, v in ReCamTransformer3DModel.load_config(folder).items() if not k.startswith("_")}
    config["plucker_rays"] = True
    model = ReCamTransformer3DModel(**config)
    weights = Path(folder) / "diffusion_pytorch_model.safetensors"
    missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
    if unexpected or any(".ray_encoder." not in k for k in missing):
        raise SystemExit(f"--init-from {folder}: {weights} does not match the model (missing "
                         f"{[k for k in missing if '.ray_encoder.' not in k]}, unexpected {unexpected})")
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (weights, config, provenance)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--final-lr-fraction", type=float, default=0.05)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-train-conditions", type=int, default=2048)
    p.add_argument("--num-eval-conditions", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-ode-steps", type=int, default=10)
    p.add_argument("--sigma-sampling", choices=("logit_normal", "uniform"), default="logit_normal")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timing-repeats", type=int, default=5,
                   help="batch-8 forward / forward+backward repeats timed at the end (0: skip timing)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override tiny_config()'s number of DiT blocks (default: keep it)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue from this base folder's weights (a longer budget in stages); its sizes win over "
                        "--num-layers, and provenance records it with the steps it had")
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="weight each pixel's loss by 1 + this x its share of the frame's detail (detail_weights); "
                        "0: the plain mean squared error")
    p.add_argument("--train-on-eval", action="store_true",
                   help="train on the evaluated held-out conditions themselves (their ground truth): an upper bound "
                        "on how far any training can move the evaluation in a budget, not a base to use")
    p.add_argument("--plucker-rays", action="store_true",
                   help="give the model the ray pathway (ReCamTransformer3DModel's plucker_rays); with --init-from, a "
                        "base without one gets it zero-initialised, so training starts from that base's exact outputs")
    p.add_argument("--device", default="cpu",
                   help="torch device to train on (cuda, npu, ...); batches and noise are drawn on the CPU, so a run's "
                        "draws do not depend on it")
    p.add_argument("--state-every", type=int, default=0,
                   help="every N steps write <out>/train_state (weights, AdamW moments, the data order and noise "
                        "generator, losses and evaluations; safetensors + JSON, replaced atomically); 0: never")
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>/train_state on the same schedule (the arguments must match the saved "
                        "ones but for --threads, --device, --state-every and --resume)")
    p.add_argument("--keep-eval-checkpoints", action="store_true",
                   help="also save the model at every evaluation under <out>/eval_step_<N>/")
    args = p.parse_args(argv)
    if args.state_every < 0:
        raise SystemExit(f"--state-every must be >= 0, got {args.state_every}")
    for name in ("steps", "batch_size", "num_train_conditions", "num_eval_conditions", "eval_every",
                 "eval_ode_steps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    with_cam_score = CAM_SCORE_FILE.is_file()
    print(f"cam_score evaluation: {'on' if with_cam_score else 'off (rewards/cam_score.py missing)'}")

    eval_world = SyntheticWorld("heldout", num_conditions=args.num_eval_conditions, seed=args.seed)
    train_world = eval_world if args.train_on_eval else SyntheticWorld(
        "train", num_conditions=args.num_train_conditions, seed=args.seed)
    # Rendering is done once up front: the world is deterministic per index, and re-rendering every
    # step would cost more CPU than the model itself at this size.
    train_conditions, train_skipped = render_conditions(train_world, "render train")
    eval_conditions, eval_skipped = render_conditions(eval_world, "render held-out")
    train = stack_batch(train_conditions)
    n_train = train["target_video"].shape[0]

    init = init_provenance(args.init_from)
    if args.init_from is not None:
        model = load_base(args.init_from, add_rays=args.plucker_rays)
    else:
        config = tiny_config()
        if args.num_layers is not None:
            config["num_layers"] = args.num_layers
        model = ReCamTransformer3DModel(**config, plucker_rays=args.plucker_rays)
    device = torch.device(args.device)
    model.to(device).train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"ReCam-Tiny parameters: {num_params}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    gen = torch.Generator().manual_seed(args.seed + 1)
    losses: list[float] = []
    evals: list[dict] = []
    perm, cursor = torch.randperm(n_train, generator=gen), 0
    first, seconds_before = 0, 0.0
    if args.resume and (args.out / STATE_DIR).exists():
        gen_state, perm, info = load_state(args.out, model, optimizer, args)
        gen.set_state(gen_state)
        first, cursor, losses, evals = info["step"], info["cursor"], info["losses"], info["evals"]
        seconds_before = info["seconds"]
        print(f"resumed {args.out / STATE_DIR} at step {first} of {args.steps}")
    elif args.resume:
        print(f"--resume: no {args.out / STATE_DIR} yet; starting at step 0")
    run_start = time.time()
    bar = tqdm(range(first, args.steps), desc="pretrain", initial=first, total=args.steps)
    for step in bar:
        if cursor + args.batch_size > n_train:
            perm, cursor = torch.randperm(n_train, generator=gen), 0
        idx = perm[cursor : cursor + args.batch_size]
        cursor += args.batch_size

        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup_steps, args.final_lr_fraction)
        x0 = train["target_video"][idx]
        noise = torch.randn(x0.shape, generator=gen)
        sigma = sample_sigmas(len(idx), args.sigma_sampling, gen)
        loss = flow_matching_loss(
            model, *(t.to(device) for t in (x0, noise, sigma, train["source_video"][idx], train["source_cams"][idx],
                                            train["target_cams"][idx])),
            detail_weight=args.detail_weight,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")

        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            result = evaluate(model, eval_conditions, args.batch_size, args.eval_ode_steps, args.seed + 2,
                              with_cam_score)
            result["step"] = step + 1
            result["train_loss_last50"] = float(np.mean(losses[-50:]))
            evals.append(result)
            tqdm.write(json.dumps(result))
            if args.keep_eval_checkpoints:
                model.save_pretrained(args.out / f"eval_step_{step + 1:06d}")
        if args.state_every and ((step + 1) % args.state_every == 0 or step + 1 == args.steps):
            args.out.mkdir(parents=True, exist_ok=True)
            info = {"step": step + 1, "cursor": cursor, "losses": losses, "evals": evals,
                    "seconds": seconds_before + time.time() - run_start,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
            save_state(args.out, model, optimizer, gen, perm, info)

    model.cpu()
    timings = measure_timings(model, repeats=args.timing_repeats) if args.timing_repeats > 0 else None
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    provenance = {
        "command": " ".join(shlex.quote(a) for a in ["python", "scripts/pretrain/pretrain_base.py", *argv]),
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "git_commit": git_commit(),
        "wall_time_s": time.time() - t_start,
        "training_seconds": seconds_before + time.time() - run_start,  # over every resumption
        "num_parameters": num_params,
        # a staged budget: the weights this run started from, and every optimizer step behind the result
        "init_from": init,
        "total_steps": args.steps + (init["total_steps"] if init else 0),
        # the sample shape the base learned (recam/domains/camera/checks.py refuses synthetic data of another size)
        "trained_sample": {"num_frames": train_world.num_frames, "size": train_world.size},
        "num_train_conditions_used": len(train_conditions),
        "skipped_train_indices": train_skipped,
        "skipped_eval_indices": eval_skipped,
        "final_train_loss": float(np.mean(losses[-50:])),
        "final_eval": evals[-1],
        "eval_history": evals,
        "timings_2_threads" if args.threads == 2 else "timings": timings,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
    }
    (args.out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps({k: provenance[k] for k in ("wall_time_s", "final_train_loss", "final_eval")}, indent=2))
    return provenance


if __name__ == "__main__":
    main()
