"""One prepared check of recam on one accelerator: real-size timings, memory and MFU, and learning at GPU batch sizes.

    python scripts/device_check.py --out runs/device_check              # one NVIDIA GPU, about 8 minutes
    python scripts/device_check.py --out /tmp/device_check --tiny       # every stage at tiny sizes on the CPU
    python scripts/device_check.py --out runs/learning --stages learning --learning-seconds 180
                                                                        # both learning runs, longer: ~10 min
    python scripts/device_check.py --out runs/learning2 --stages learning --learning-seconds 180 \
        --resume runs/learning                                          # the next window continues them

Stages run in order, each under its own time cap, and DIR/device_check.json is rewritten after each one, so a
stage that fails or runs out of time keeps what the earlier ones measured (its entry then says why).
DIR/device_check.md summarises the same numbers.

  peak      a measured matmul (bf16 on an accelerator, fp32 on the CPU): `peak_tflops`, what MFU is read against.
  recam     the ReCam transformer at Wan2.1-T2V-1.3B size (published config, random init), frozen bf16 base, LoRA
            and gradient checkpointing as preset recam_wan_1_3b_8npu sets them, text embeddings of umT5's shape,
            source and target latents of an 81 x 480 x 832 clip (16 x 21 x 60 x 104), k copies of one condition,
            through the engine's own rollout and GRPO objective (the calls the trainer makes): seconds per
            sampling step and per trained step (policy forward + backward, reference forward, log-probs, KL),
            peak memory, MFU, the first trained step's |ratio - 1| under bf16 and fp16 autocast, adapter save and
            load, and the epoch time the preset's step counts imply.
  vae       the Wan VAE from its config (random init) encoding and decoding one 81 x 480 x 832 clip.
  motion    MDM's size (8 layers, 512 wide) on a batch of 64 x 196 frames, 50 DDIM steps with guidance.
  fsdp      one smoke epoch through config/accelerate/fsdp.yaml on one GPU (skipped on the CPU: accelerate's
            FSDP plugin needs an accelerator).
  learning  presets tiny_gpu and motion_tiny_gpu run by scripts/train_recam.py within a time cap each: the
            held-out curve (an evaluation every few updates, drawn in DIR/learning_<domain>.png), the base and
            final scores and the gain with its 95% interval over conditions, seconds per update and the device's
            busy share. The runs add up over GPU windows: --resume DIR continues each run DIR/runs/<preset> of an
            earlier check for --learning-seconds more training seconds, and each run folder is left as a small
            bundle (the checkpoint `latest` names and `selected`'s, metrics.jsonl gzipped) to bring back for that.
  overhead  per stage, the share of its wall time spent outside the model's forward / backward passes (the
            passes timed alone at the same shapes).

Random weights time exactly like trained ones; they only make the learning stage's scores meaningless, which is
why that stage uses the committed embedded bases instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from recam.infra.stats import paired_change  # noqa: E402

# Sizes per mode. "full": the real workload; "tiny": the same code paths at sizes a 2-core CPU runs in seconds.
SIZES = {
    "full": {
        "peak": {"n": 8192, "iters": 20},
        "recam": {"model": "wan21_1_3b", "latent": (16, 21, 60, 104), "text": (512, 4096), "sample_steps": 2,
                  "trained_steps": 1, "ratio_samples": 2, "repeats": 1},
        "vae": {"config": {}, "clip": (3, 81, 480, 832)},
        "motion": {"model": "mdm", "batch": 64, "frames": 196, "sample_steps": 5, "trained_steps": 2, "repeats": 3},
        # eval_freq: a held-out point every 5 updates (one update per epoch), about every 2-3 minutes on the H100
        "learning": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 30, "eval_freq": 5, "overrides": ()},
        # 480 s in all: the whole check fits one 10-minute command with room to spare; each learning run gets
        # half its stage's cap (start-up, evaluations and an epoch that crosses the 30 s budget included)
        "caps": {"peak": 15, "recam": 180, "vae": 40, "motion": 30, "fsdp": 45, "learning": 170},
    },
    "tiny": {
        "peak": {"n": 256, "iters": 5},
        "recam": {"model": "tiny", "latent": (16, 3, 8, 8), "text": (8, 32), "sample_steps": 3, "trained_steps": 2,
                  "ratio_samples": 2, "repeats": 5},
        "vae": {"config": {"base_dim": 8}, "clip": (3, 5, 32, 32)},
        "motion": {"model": "tiny", "batch": 4, "frames": 196, "sample_steps": 3, "trained_steps": 2, "repeats": 5},
        # the GPU presets' code path at smoke size: epochs of 8 samples, a few held-out conditions; a cap below any
        # epoch's time, so that each window (the first, and each --resume) trains exactly one epoch
        "learning": {"presets": ("tiny_gpu", "motion_tiny_gpu"), "seconds": 0.01, "eval_freq": 1, "overrides": {
            "tiny_gpu": ("--config.data.num_train_conditions=16", "--config.sample.num_batches_per_epoch=1",
                         "--config.sample.batch_size=8",
                         "--config.train.batch_size=8", "--config.train.gradient_accumulation_steps=1",
                         "--config.data.num_heldout_conditions=4", "--config.data.num_val_conditions=4",
                         "--config.sample.num_steps=3", "--config.sample.eval_num_steps=3"),
            "motion_tiny_gpu": ("--config.data.num_train_conditions=16", "--config.sample.num_batches_per_epoch=1",
                                "--config.sample.batch_size=8",
                                "--config.train.batch_size=8", "--config.train.gradient_accumulation_steps=1",
                                "--config.sample.num_steps=4",
                                "--config.sample.eval_num_steps=4", "--config.data.num_heldout_conditions=32",
                                "--config.data.num_val_conditions=0", "--config.eval.select_by=",
                                "--config.eval.select_guard=",
                                "--config.motion.eval_repetitions=1", "--config.health.action=warn")}},
        # a stage's cap only ends a hung stage; a machine busy with other jobs (a CI beside training runs) takes
        # two to three times a quiet one's seconds, which a tiny run must survive
        "caps": {"peak": 30, "recam": 90, "vae": 60, "motion": 60, "fsdp": 30, "learning": 200},
    },
}


STAGES = ("peak", "recam", "vae", "motion", "fsdp", "learning")

# per learning run, beyond its training seconds: start-up, the base and final evaluations and the epoch that
# crosses the budget. On the H100 these took about 25 s (camera) and 40 s (motion) besides an epoch of 25-30 s.
LEARNING_MARGIN_S = 90


def set_learning(mode: str, seconds: float | None, presets: str | None) -> None:
    """--learning-seconds / --learning-presets: a longer learning run, or one domain, in a window of its own. The
    stage's cap grows with the training time asked for."""
    size = SIZES[mode]["learning"]
    if presets:
        wanted = tuple(x.strip() for x in presets.split(",") if x.strip())
        unknown = sorted(set(wanted) - set(SCORES))
        if unknown:
            raise SystemExit(f"--learning-presets: unknown {unknown}; choose from {sorted(SCORES)}")
        size["presets"] = wanted
    if seconds is not None:
        if not seconds > 0:  # the runs' num_epochs never ends them: the cap does
            raise SystemExit(f"--learning-seconds must be positive, got {seconds:g}")
        size["seconds"] = seconds
        SIZES[mode]["caps"]["learning"] = len(size["presets"]) * (seconds + LEARNING_MARGIN_S) + 10

# ------------------------------------------------------------------------------------------------------------------
# measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call, the device's queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return statistics.median(timed(fn, device) for _ in range(repeats))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak allocated accelerator memory since reset_peak, GiB (None on the CPU, where torch keeps no such count)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def forward_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matmuls and attention one call runs, counted by torch's FlopCounterMode."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        fn()
    return int(counter.get_total_flops())


def autocast(device: torch.device, dtype: torch.dtype | None):
    return (torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext())


def stage_peak(device: torch.device, n: int, iters: int) -> dict:
    """TFLOP/s of an n x n matmul: bf16 on an accelerator (what the models run in), fp32 on the CPU."""
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    a @ b  # warm-up (kernel selection)
    seconds = statistics.median(timed(lambda: a @ b, device) for _ in range(iters))
    return {"peak_tflops": 2 * n**3 / seconds / 1e12, "dtype": str(dtype).removeprefix("torch."), "n": n,
            "median_s": seconds}


# ------------------------------------------------------------------------------------------------------------------
# the ReCam transformer through the engine's rollout and GRPO objective


def recam_model_config(name: str) -> dict:
    from recam.domains.camera.model import wan21_1_3b_config

    if name == "wan21_1_3b":
        return wan21_1_3b_config()
    return {**wan21_1_3b_config(), "num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32,
            "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 64}


def stage_recam(device: torch.device, size: dict, peak_tflops: float | None, work: Path) -> dict:
    from config import grpo
    from recam.domains.camera.model import ReCamTransformer3DModel
    from recam.engine.objective import GRPOObjective, MicroBatch
    from recam.engine.rollout import rescore, rollout
    from recam.engine.scheduler import FlowMatchScheduler
    from recam.infra.lora import adapter_disabled, add_lora, load_adapter_weights, save_adapter

    preset = grpo.get_config("recam_wan_1_3b_8npu")
    s, t, m = preset.sample, preset.train, preset.model
    k, b = s.k, t.batch_size  # k copies of one condition are sampled together; b of them per trained micro-batch
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: 1.3B random weights on a CPU take long
        model = ReCamTransformer3DModel(**recam_model_config(size["model"])).to(getattr(torch, m.dtype))
        add_lora(model, m.lora_rank, m.lora_alpha,
                 [x.strip() for x in m.lora_targets.split(",") if x.strip()] or None)
    model.enable_gradient_checkpointing()
    c, f, h, w = size["latent"]
    g = torch.Generator(device="cpu").manual_seed(1)
    source = torch.randn(k, c, f, h, w, generator=g).to(device)
    cams = torch.randn(k, f, 3, 4, generator=g).to(device)
    text = torch.randn(k, *size["text"], generator=g).to(device)
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}[preset.mixed_precision]

    def denoiser(dtype, adapter_off=False, net=None):
        net = model if net is None else net

        def velocity(x, sigma):
            with autocast(device, dtype), (adapter_disabled(net) if adapter_off else contextlib.nullcontext()):
                return net(x, sigma, source[: len(x)], cams[: len(x)], cams[: len(x)], text[: len(x)]).float()
        return velocity

    steps, T = size["sample_steps"], size["trained_steps"]
    sched = FlowMatchScheduler(steps, s.shift, s.noise_level, s.sde_type, T, device)
    noise = torch.randn(k, steps + 1, c, f, h, w, generator=g).to(device)
    out: dict = {"k": k, "train_batch": b, "latent_shape": [c, f, h, w], "text_shape": list(size["text"]),
                 "dtype": m.dtype, "mixed_precision": preset.mixed_precision, "lora_rank": m.lora_rank,
                 "gradient_checkpointing": True, "guidance_passes": 1,
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}

    # sampling: the engine's rollout, no gradients, eval mode (as the trainer samples)
    model.eval()
    sigma = sched.model_time(0, k)
    forward = forward_flops(lambda: denoiser(mixed)(noise[:, 0], sigma))  # also the warm-up
    out["forward_tflop"] = forward / 1e12
    reset_peak(device)
    with torch.no_grad():
        seconds = timed(lambda: out.setdefault("_r", rollout(denoiser(mixed), noise, sched)), device)
    r = out.pop("_r")
    out["sampling_step_s"] = seconds / steps
    out["sampling_peak_memory_gib"] = peak_gib(device)

    # one micro-batch of b stored samples through GRPO's objective: per trained step a policy forward and
    # backward, a reference forward (the adapter switched off), log-probs and the KL
    model.train()
    objective = GRPOObjective(t, sched)
    mb = MicroBatch(states=r.states[:b], old_log_probs=r.log_probs[:b], advantages=torch.randn(b, T, generator=g),
                    sample_weight=torch.ones(b), traj_ids=torch.zeros(b, 2, dtype=torch.long),
                    policy=denoiser(mixed), reference=denoiser(mixed, adapter_off=True) if t.beta > 0 else None,
                    inner_epoch=0, module=model)
    reset_peak(device)
    seconds = timed(lambda: objective.accumulate(mb, lambda loss, last: loss.backward()), device)
    out["trained_step_s"] = seconds / T
    out["peak_memory_gib"] = peak_gib(device)
    model.zero_grad(set_to_none=True)
    passes = 4 if t.beta > 0 else 3  # forward + backward (2x) of the policy, and the reference's forward
    if peak_tflops:
        out["mfu_sampling"] = forward / out["sampling_step_s"] / (peak_tflops * 1e12)
        out["mfu"] = passes * forward * b / k / out["trained_step_s"] / (peak_tflops * 1e12)
    # the passes alone, at the same shapes: what the engine adds around them is the overhead
    x0 = noise[:b, 0]
    sig_b = sched.model_time(0, b)

    def bare_train_step():
        denoiser(mixed)(x0, sig_b).square().mean().backward()
        if t.beta > 0:
            with torch.no_grad():
                denoiser(mixed, adapter_off=True)(x0, sig_b)

    model.eval()
    with torch.no_grad():
        out["forward_alone_s"] = median_time(lambda: denoiser(mixed)(noise[:, 0], sigma), device, size["repeats"])
    model.train()
    out["train_passes_alone_s"] = median_time(bare_train_step, device, size["repeats"])
    model.zero_grad(set_to_none=True)

    # the first trained step's ratio: sampled in eval mode without gradients, rescored in train mode with them
    # (log-prob math in fp32 either way), under bf16 autocast over the bf16 base (the preset) and fp16 autocast
    # over an fp16 copy (autocast to fp16 over bf16 weights is not a combination torch runs)
    n = size["ratio_samples"]
    one = sched.with_steps(2).with_train_steps(1)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            net = model if dtype == getattr(torch, m.dtype) else copy.deepcopy(model).to(dtype)
            net.eval()
            with torch.no_grad():
                ro = rollout(denoiser(dtype, net=net), noise[:n, :3], one)
            net.train()
            cur = rescore(denoiser(dtype, net=net), ro.states, one, 0)
            out[f"first_step_ratio_dev_{name}"] = float((cur.log_prob.detach() - ro.log_probs[:, 0]).exp()
                                                        .sub(1).abs().max())
            del net
        except Exception as e:  # noqa: BLE001 - a dtype the device cannot run is a finding, not a crash
            out[f"first_step_ratio_dev_{name}"] = None
            out[f"first_step_ratio_dev_{name}_error"] = f"{type(e).__name__}: {e}"
    out["first_step_ratio_dev"] = out["first_step_ratio_dev_bf16"]
    out["clip_range"] = t.clip_range

    adapter = work / "adapter"
    out["adapter_save_s"] = timed(lambda: save_adapter(model, adapter), device)
    out["adapter_load_s"] = timed(lambda: load_adapter_weights(model, adapter), device)
    out["adapter_mib"] = sum(p.stat().st_size for p in adapter.iterdir()) / 2**20

    # one epoch of the preset on one device: its samples through S sampling steps (measured k at a time) and its
    # trained steps (measured b at a time), inner epochs included; rewards and evaluation not counted
    from config.validate import step_plan

    per_device = s.batch_size * s.num_batches_per_epoch
    T_preset = step_plan(preset).trained_steps
    out["epoch_s_implied"] = (per_device / k * s.num_steps * out["sampling_step_s"]
                              + per_device / b * T_preset * t.num_inner_epochs * out["trained_step_s"])
    out["epoch_implied_from"] = (f"{per_device} samples per device, {s.num_steps} sampling steps, {T_preset} trained "
                                 f"steps, {t.num_inner_epochs} inner epoch(s)")
    return out


# ------------------------------------------------------------------------------------------------------------------
# the Wan VAE


def stage_vae(device: torch.device, size: dict) -> dict:
    from diffusers import AutoencoderKLWan

    from recam.domains.camera.codec import WanVAECodec

    torch.manual_seed(0)
    codec = WanVAECodec(AutoencoderKLWan(**size["config"]).to(device))  # fp32, as the camera domain loads it
    clip = torch.rand(1, *size["clip"], generator=torch.Generator().manual_seed(0)).mul(2).sub(1).to(device)
    reset_peak(device)
    out = {"clip": list(size["clip"])}
    latents = []
    out["encode_s"] = timed(lambda: latents.append(codec.encode(clip)), device)
    out["latent_shape"] = list(latents[0].shape[1:])
    out["decode_s"] = timed(lambda: codec.decode(latents[0]), device)
    out["peak_memory_gib"] = peak_gib(device)
    return out


# ------------------------------------------------------------------------------------------------------------------
# MDM


def stage_motion(device: torch.device, size: dict) -> dict:
    from config import grpo
    from recam.domains.motion.domain import cosine_alphas_cumprod, guided_x0, one_attention_path
    from recam.domains.motion.model import MotionDiffusionModel, mdm_config, tiny_config
    from recam.engine.objective import GRPOObjective, MicroBatch
    from recam.engine.rollout import rollout
    from recam.engine.scheduler import DDIMScheduler

    preset = grpo.get_config("mdm_humanml3d_8npu")
    s, t, mo = preset.sample, preset.train, preset.motion
    torch.manual_seed(0)
    config = {**(mdm_config() if size["model"] == "mdm" else tiny_config()), "dropout": 0.0}
    policy = MotionDiffusionModel(**config).to(device)
    reference = MotionDiffusionModel(**config).to(device).requires_grad_(False)  # the frozen base (no LoRA here)
    reference.load_state_dict(policy.state_dict())
    B, frames, steps, T = size["batch"], size["frames"], size["sample_steps"], size["trained_steps"]
    g = torch.Generator().manual_seed(1)
    text = torch.randn(B, config["text_dim"], generator=g).to(device)

    def denoiser(model):
        def predict(x, t_):
            with one_attention_path(model):
                return guided_x0(model, x, t_, text[: len(x)], mo.guidance_scale, None).float()
        return predict

    sched = DDIMScheduler(cosine_alphas_cumprod(mo.diffusion_steps), steps, mo.eta, "sample", T, device,
                          reduction=mo.log_prob_reduction)
    noise = torch.randn(B, steps + 1, config["njoints"], 1, frames, generator=g).to(device)
    out = {"batch": B, "frames": frames, "preset_steps": s.num_steps, "guidance_scale": mo.guidance_scale,
           "guidance_passes": 1 if mo.guidance_scale == 1.0 else 2,
           "parameters": sum(p.numel() for p in policy.parameters())}
    with torch.no_grad():
        rollout(denoiser(policy), noise[:, :2], sched.with_steps(1).with_train_steps(1))  # warm-up
    reset_peak(device)
    with torch.no_grad():
        seconds = timed(lambda: out.setdefault("_r", rollout(denoiser(policy), noise, sched)), device)
    r = out.pop("_r")
    out["sampling_step_s"] = seconds / steps
    b = B  # the whole batch as one trained micro-batch
    mb = MicroBatch(states=r.states[:b], old_log_probs=r.log_probs[:b], advantages=torch.randn(b, T, generator=g),
                    sample_weight=torch.ones(b), traj_ids=torch.zeros(b, 2, dtype=torch.long),
                    policy=denoiser(policy), reference=denoiser(reference) if t.beta > 0 else None, inner_epoch=0,
                    module=policy)
    objective = GRPOObjective(t, sched)
    # one untimed trained step first: the process's first backward pays its warm-up (the H100 run timed it and
    # read it as 64 % engine overhead), and the passes timed alone below run warm
    objective.accumulate(mb, lambda loss, last: loss.backward())
    policy.zero_grad(set_to_none=True)
    reset_peak(device)
    out["trained_step_s"] = timed(lambda: objective.accumulate(mb, lambda loss, last: loss.backward()), device) / T
    out["train_batch"] = b
    out["peak_memory_gib"] = peak_gib(device)
    policy.zero_grad(set_to_none=True)
    x0, t0 = noise[:B, 0], sched.model_time(0, B)
    with torch.no_grad():
        out["forward_alone_s"] = median_time(lambda: denoiser(policy)(x0, t0), device, size["repeats"])

    def bare_train_step():
        denoiser(policy)(x0, t0).square().mean().backward()
        if t.beta > 0:
            with torch.no_grad():
                denoiser(reference)(x0, t0)

    out["train_passes_alone_s"] = median_time(bare_train_step, device, size["repeats"])
    policy.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------------------------------------------------------
# the FSDP launch config the README offers


FSDP_ON_CPU = ("accelerate's FSDP plugin refuses a machine without an accelerator ('There are currently no available "
               "devices found'), so config/accelerate/fsdp.yaml cannot run on the CPU; this stage runs it on one GPU")


def stage_fsdp(device: torch.device, work: Path) -> dict:
    """One smoke epoch through `accelerate launch --config_file config/accelerate/fsdp.yaml` on one process: the
    wrapping, the LoRA-free full fine-tune and the sealed checkpoints under FSDP."""
    if device.type == "cpu":
        return {"skipped": FSDP_ON_CPU}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "config" / "accelerate" / "fsdp.yaml"), "--num_processes", "1",
           str(ROOT / "scripts" / "train_recam.py"), f"--config={ROOT / 'config' / 'grpo.py'}:smoke",
           f"--config.run_dir={work / 'fsdp'}", "--config.logging.wandb_mode=disabled", "--config.num_epochs=1",
           "--config.eval.freq=100", "--config.eval.num_videos=0"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = {"exit": p.returncode, "seconds": time.perf_counter() - t0}
    if p.returncode != 0:
        raise RuntimeError(f"FSDP smoke run exited {p.returncode}: {(p.stderr or p.stdout)[-2500:]}")
    out["checkpoint"] = sorted(x.name for x in (work / "fsdp" / "checkpoints").glob("epoch_*"))
    return out


# ------------------------------------------------------------------------------------------------------------------
# learning at GPU batch sizes, through scripts/train_recam.py, across GPU windows


# per preset: the held-out score whose gain is reported (paired over the held-out conditions: motion's R-precision
# per caption is its hit rate over the protocol's shuffles), and a second score reported beside it.
SCORES = {"tiny_gpu": ("eval/cam_score", "eval/fidelity"),
          "motion_tiny_gpu": ("eval/r_precision_top3", "eval/motion_alignment")}
NAMES = {"tiny_gpu": "camera", "motion_tiny_gpu": "motion"}

# The learning runs end on their time cap, never on num_epochs (the presets' 12 and 30 epochs would end a run that
# adds up over several windows); one value for every window, so that a resumed run's config differs from its first
# window's only in the cumulative cap.
LEARNING_EPOCHS = 100_000
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
                           f"scripts/convert_checkpoints.py --trust-legacy-checkpoint {prior}")
    state = json.loads((root / name / "state.json").read_text())
    seconds = state.get("budget", {}).get("train_seconds")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        raise RuntimeError(f"{root / name / 'state.json'} holds no budget.train_seconds: the run's cumulative cap "
                           "cannot be set from it")
    logged = [r for r in read_records(log) if r.get("type") == "epoch" and r.get("epoch") == state["epoch"] - 1]
    return {"from": str(prior), "checkpoint": name, "epochs": state["epoch"], "step": state["global_step"],
            "train_seconds": float(seconds), "log_train_seconds": logged[-1].get("train_seconds") if logged else None}


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


def curve_points(evals: list[dict], score: str, beside: str) -> list[dict]:
    """One point per evaluation: `epoch` is the epochs trained (the checkpoint epoch_NNNN evaluated; 0 = the
    base), train_seconds the cumulative training time at it."""
    from recam.infra.checkpoint import epoch_of

    return [{"tag": r.get("tag"), "epoch": epoch_of(Path(str(r.get("checkpoint") or ""))), "step": r.get("step"),
             "train_seconds": r.get("train_seconds"), "score": r.get(score), "beside": r.get(beside)} for r in evals]


def merged_evals(prior: list[dict], now: list[dict], resumed_epochs: int | None) -> list[dict]:
    """The run's evaluations over every window, in training order. A resumed run drops a window's "final"
    evaluation from its log (it evaluates its own end anew); that evaluation stays in the curve when it evaluated
    weights the run continued from (or earlier ones), and any other the log no longer holds is left out."""
    from recam.infra.checkpoint import epoch_of

    def key(r):
        return r.get("tag"), r.get("checkpoint"), r.get("step")

    seen = {key(r) for r in now}
    kept = [r for r in prior if key(r) not in seen and resumed_epochs is not None
            and (epoch_of(Path(str(r.get("checkpoint") or ""))) or 0) <= resumed_epochs]
    both = [*now, *kept]
    return [r for _, r in sorted(enumerate(both), key=lambda x: (x[1].get("train_seconds") or 0.0, x[0]))]


def update_timing(epochs: list[dict]) -> dict:
    """Seconds per update (median over epochs of epoch_seconds / optimizer steps) and the device's busy share:
    medians of seconds_device and seconds_host, and device / (device + host) over the epochs that carry both; None
    for what no epoch record carries."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    per = [r["epoch_seconds"] / len(r["optimizer_steps"]) for r in epochs
           if number(r.get("epoch_seconds")) and r.get("optimizer_steps")]
    timed = [(r["seconds_device"], r["seconds_host"]) for r in epochs
             if number(r.get("seconds_device")) and number(r.get("seconds_host"))]
    total = sum(d + h for d, h in timed)
    return {"seconds_per_update": statistics.median(per) if per else None,
            "seconds_device": statistics.median(d for d, _ in timed) if timed else None,
            "seconds_host": statistics.median(h for _, h in timed) if timed else None,
            "device_share": sum(d for d, _ in timed) / total if total > 0 else None,
            "epochs_device_timed": len(timed)}


def plot_curve(path: Path, title: str, points: list[dict], panels: list[tuple]) -> None:
    """Held-out score against training seconds, one panel per (key, label, base, gain, ci95): the base as a
    horizontal line, the end's paired 95% interval as an error bar at base + gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, label, base, gain, half) in zip(list(getattr(axes, "flat", [axes])), panels, strict=True):
        xy = [(p["train_seconds"], p[key]) for p in points
              if isinstance(p["train_seconds"], (int, float)) and isinstance(p[key], (int, float))]
        ax.plot([x for x, _ in xy], [y for _, y in xy], "o-", color="C0", label="held-out")
        if isinstance(base, (int, float)):
            ax.axhline(base, ls="--", color="grey", label="base")
            if xy and all(isinstance(v, float) and math.isfinite(v) for v in (gain, half)):
                ax.errorbar([xy[-1][0]], [base + gain], yerr=[half], fmt="s", color="C3", capsize=4,
                            label=f"end: {gain:+.4f} +- {half:.4f} (95%)")
        ax.set_xlabel("training seconds")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def learning_result(preset: str, run_dir: Path, prior_evals: list[dict], resumed_epochs: int | None,
                    out_dir: Path) -> dict:
    """What the run's log says: the curve over every window, the end's paired change against the base, the
    seconds per update, and the curve's plot (out_dir/learning_<name>.png)."""
    from recam.infra.runlog import read_records

    records = read_records(run_dir / "metrics.jsonl")
    epochs = [r for r in records if r.get("type") == "epoch"]
    evals = [r for r in records if r.get("type") == "eval"]
    score, beside = SCORES[preset]
    out = {"score": score, "epochs": len(epochs), **update_timing(epochs),
           "samples_per_update": epochs[0]["samples_per_epoch"] / max(1, len(epochs[0]["optimizer_steps"]))
           if epochs else None}
    if not evals:
        return {**out, "curve": []}
    start, end = evals[0], evals[-1]  # the base (a resumed run's log keeps it first) and the newest evaluation
    mean, half, n = paired_change(start.get(f"rows/{score}", []), end.get(f"rows/{score}", []))
    other = paired_change(start.get(f"rows/{beside}", []), end.get(f"rows/{beside}", []))
    points = curve_points(merged_evals(prior_evals, evals, resumed_epochs), score, beside)
    out.update({"train_seconds": end.get("train_seconds"), "base": start.get(score), "final": end.get(score),
                "end": end.get("tag"), "gain": mean, "ci95": half, "conditions": n,
                "beside": {"score": beside, "base": start.get(beside), "final": end.get(beside), "gain": other[0],
                           "ci95": other[1]},
                "curve": points})
    if preset == "motion_tiny_gpu":
        # the score above is the grader's; the reward's own network grades too, beside it, unless it is the grader
        own = end.get("eval/grader_is_reward_net") != 0.0
        out["grader"] = "the reward's own network" if own else "motion.metric_evaluator, independent of the reward"
        out["reward_net_base"] = start.get("eval/reward_net/r_precision_top3")
        out["reward_net_final"] = end.get("eval/reward_net/r_precision_top3")
    plot = out_dir / f"learning_{NAMES[preset]}.png"
    try:
        plot_curve(plot, f"{preset}: held-out score over training ({len(points)} evaluations)", points,
                   [("score", score, start.get(score), mean, half),
                    ("beside", beside, start.get(beside), other[0], other[1])])
        out["plot"] = plot.name  # beside device_check.json
    except Exception as e:  # noqa: BLE001 - a plot that fails leaves the numbers standing, and says why
        out["plot"], out["plot_error"] = None, f"{type(e).__name__}: {e}"
    return out


def run_preset(preset: str, size: dict, out_dir: Path, cap: float, prior: Path | None) -> dict:
    """One learning run in out_dir/runs/<preset>: fresh, or (prior: a previous window's run folder) continued from
    it for `size["seconds"]` more training seconds. Afterwards the folder is packed (`pack`) to come back small."""
    from recam.infra.runlog import read_records

    run_dir = out_dir / "runs" / preset
    out: dict = {"resumed_from": None}
    if run_dir.exists() and (prior is None or prior.resolve() != run_dir.resolve()):
        # train_recam would continue it by itself, from a cap that does not count its earlier seconds
        return {"error": f"{run_dir} exists: continue it with --resume {out_dir}, or choose a new --out"}
    prior_evals, resumed_epochs, earlier = [], None, 0.0
    if prior is not None:
        try:
            carried = carry_over(prior, run_dir)
        except Exception as e:  # noqa: BLE001 - an unusable bundle is this preset's error; the other runs go on
            if prior.resolve() != run_dir.resolve():  # the copy, so that a corrected --resume can use this --out
                shutil.rmtree(run_dir, ignore_errors=True)
            return {"error": f"cannot continue {prior}: {type(e).__name__}: {e}"}
        out["resumed_from"] = carried
        earlier, resumed_epochs = carried["train_seconds"], carried["epochs"]
        prior_evals = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("type") == "eval"]
    out["max_train_seconds"] = earlier + size["seconds"]
    overrides = size["overrides"].get(preset, ()) if isinstance(size["overrides"], dict) else ()
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config={ROOT / 'config' / 'grpo.py'}:{preset}",
           f"--config.run_dir={run_dir}", "--config.logging.wandb_mode=disabled", *overrides,
           f"--config.num_epochs={LEARNING_EPOCHS}", f"--config.eval.freq={size['eval_freq']}",
           "--config.eval.num_videos=0", f"--config.max_train_seconds={out['max_train_seconds']}"]
    out["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cap)
        out["exit"] = p.returncode
        if p.returncode not in (0, 3):
            out["error"] = (p.stderr or p.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        # killed: its checkpoints are whole (written aside, then renamed), so the next window continues from the
        # newest, and what it logged so far is reported
        out["exit"], out["error"] = None, f"did not finish within its cap of {cap:.0f} s"
    out["seconds"] = time.perf_counter() - t0
    if (run_dir / "metrics.jsonl").exists():
        out.update(learning_result(preset, run_dir, prior_evals, resumed_epochs, out_dir))
    if run_dir.exists():
        out["bundle"] = pack(run_dir)
    return out


def stage_learning(size: dict, cap: float, out_dir: Path, resume: Path | None) -> dict:
    out = {}
    per = cap / len(size["presets"])
    for preset in size["presets"]:
        prior = None if resume is None else resume / "runs" / preset
        if prior is not None and not prior.is_dir():
            out[NAMES[preset]] = {**run_preset(preset, size, out_dir, per, None),
                                  "note": f"{prior} does not exist: this run started afresh"}
            continue
        out[NAMES[preset]] = run_preset(preset, size, out_dir, per, prior)
    # what the next window needs brought back: out_dir/runs (the plots and device_check.json besides are small)
    out["bundle_bytes"] = sum(r["bundle"]["bytes"] for r in out.values() if "bundle" in r)
    return out


# ------------------------------------------------------------------------------------------------------------------
# the run


def overhead(results: dict) -> dict:
    """Per stage: the share of a step's wall time outside the model passes timed alone at the same shapes."""
    out = {}
    for stage in ("recam", "motion"):
        r = results.get(stage, {})
        if "sampling_step_s" in r and "forward_alone_s" in r:
            out[f"{stage}_sampling"] = 1 - r["forward_alone_s"] / r["sampling_step_s"]
        if "trained_step_s" in r and "train_passes_alone_s" in r:
            out[f"{stage}_training"] = 1 - r["train_passes_alone_s"] / r["trained_step_s"]
    return out


def attention_backends(device: torch.device) -> dict:
    """Which scaled-dot-product attention kernels torch may pick here (diffusers' Wan attention calls SDPA)."""
    if device.type != "cuda":
        return {"sdpa": "math / CPU kernels"}
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "n/a" if v is None else str(v)


def curve_tables(learning: dict) -> list[str]:
    lines = []
    for name, r in learning.items():
        if not isinstance(r, dict) or not r.get("curve"):
            continue
        lines += [f"### {name}: held-out curve ({r['score']}, beside it {r['beside']['score']})", "",
                  "| tag | epoch | train_seconds | score | beside |", "|---|---|---|---|---|"]
        lines += [f"| {p['tag']} | {fmt(p['epoch'])} | {fmt(p['train_seconds'])} | {fmt(p['score'])} | "
                  f"{fmt(p['beside'])} |" for p in r["curve"]] + [""]
    return lines


def write(out_dir: Path, results: dict) -> None:
    (out_dir / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [f"# Device check: {results['device']}", "",
             f"torch {results['torch']}, mode {results['mode']}, {results.get('wall_s', 0):.0f} s in all", ""]
    for stage in ("peak", "recam", "vae", "motion", "learning", "overhead"):
        r = results.get(stage)
        if r is None:
            continue
        lines += [f"## {stage}", ""]
        flat = {f"{k}.{kk}": vv for k, v in r.items() if isinstance(v, dict) for kk, vv in v.items()}
        flat.update({k: v for k, v in r.items() if not isinstance(v, dict)})
        lines += [f"- {k}: {fmt(v)}" for k, v in flat.items()
                  if k != "traceback" and not k.endswith(".curve")] + [""]
        if stage == "learning":
            lines += curve_tables(r)
    (out_dir / "device_check.md").write_text("\n".join(lines))


def run_stage(name: str, mode: str, work: Path, out_dir: Path, peak_tflops: float | None,
              resume: Path | None = None) -> dict:
    """One stage in this process (the child side of `main`)."""
    size = SIZES[mode]
    device = torch.device("cuda" if torch.cuda.is_available() and mode == "full" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    stages = {
        "peak": lambda: stage_peak(device, **size["peak"]),
        "recam": lambda: stage_recam(device, size["recam"], peak_tflops, work),
        "vae": lambda: stage_vae(device, size["vae"]),
        "motion": lambda: stage_motion(device, size["motion"]),
        "fsdp": lambda: stage_fsdp(device, work),
        "learning": lambda: stage_learning(size["learning"], size["caps"]["learning"] - 10, out_dir, resume),
    }
    return stages[name]()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for device_check.json and device_check.md")
    ap.add_argument("--tiny", action="store_true", help="every stage at tiny sizes, on the CPU")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ", ".join(STAGES))
    ap.add_argument("--learning-seconds", type=float, default=None,
                    help="training seconds per learning run (default 30; the stage's cap follows)")
    ap.add_argument("--learning-presets", default=None,
                    help="comma-separated subset of the learning presets: " + ", ".join(SCORES))
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="a previous check's --out folder: continue each learning run DIR/runs/<preset> there is "
                         "for --learning-seconds more training seconds")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--peak-tflops", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = "tiny" if args.tiny else "full"
    set_learning(mode, args.learning_seconds, args.learning_presets)
    resume = Path(args.resume) if args.resume else None
    if resume is not None and not (resume / "runs").is_dir():
        ap.error(f"--resume {resume}: no runs/ folder there (the --out of a check with the learning stage)")
    if args.stage:  # child: one stage, its result as JSON in a file the parent reads
        with tempfile.TemporaryDirectory() as tmp:
            result = run_stage(args.stage, mode, Path(tmp), out_dir, args.peak_tflops, resume)
        (out_dir / f".stage_{args.stage}.json").write_text(json.dumps(result, default=str))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    results = {"device": device_name(device), "torch": torch.__version__, "mode": mode, "stages": {},
               "attention": attention_backends(device), "torch_compile": "off (recam never compiles)"}
    t_start = time.perf_counter()
    for name in [x.strip() for x in args.stages.split(",") if x.strip()]:
        if name not in STAGES:
            ap.error(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
        cap = SIZES[mode]["caps"][name]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out_dir), "--stage", name,
               *(["--tiny"] if args.tiny else []),
               *(["--learning-seconds", str(args.learning_seconds)] if args.learning_seconds is not None else []),
               *(["--learning-presets", args.learning_presets] if args.learning_presets else []),
               *(["--resume", str(resume)] if resume is not None else []),
               *(["--peak-tflops", str(results["peak_tflops"])] if results.get("peak_tflops") else [])]
        t0 = time.perf_counter()
        staged = out_dir / f".stage_{name}.json"
        staged.unlink(missing_ok=True)
        try:
            # each stage in its own process: its cap is enforced, its peak memory is its own, and an
            # out-of-memory or a crash there leaves the other stages' numbers standing
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=cap)
            if p.returncode == 0 and staged.exists():
                results[name] = json.loads(staged.read_text())
                status = "skipped" if "skipped" in results[name] else "ok"
                if any(isinstance(v, dict) and "error" in v for v in results[name].values()):
                    status = "error"  # a part of it (a learning run) failed: its entry says why
            else:
                results[name], status = {"error": (p.stderr or p.stdout)[-3000:] or f"exit {p.returncode}"}, "error"
        except subprocess.TimeoutExpired:
            results[name], status = {"error": f"did not finish within its cap of {cap} s"}, "timeout"
        staged.unlink(missing_ok=True)
        seconds = time.perf_counter() - t0
        results["stages"][name] = {"status": status, "seconds": seconds, "cap_s": cap}
        if name == "peak" and status == "ok":
            results["peak_tflops"] = results["peak"]["peak_tflops"]
        results["overhead"] = overhead(results)
        results["wall_s"] = time.perf_counter() - t_start
        write(out_dir, results)
        print(f"[device_check] {name}: {status} in {seconds:.1f} s", flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
