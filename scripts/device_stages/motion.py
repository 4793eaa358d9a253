"""motion: MDM's size (8 layers, 512 wide) on a batch of 64 x 196 frames with the preset's guidance, through the
engine's own rollout and GRPO objective: seconds per sampling step (50 DDIM steps in the preset) and per trained step,
peak memory, and the passes timed alone."""

from __future__ import annotations

import torch

from scripts.device_stages import Context
from scripts.device_stages.timing import median_time, peak_gib, reset_peak, timed

SIZES = {"full": {"model": "mdm", "batch": 64, "frames": 196, "sample_steps": 5, "trained_steps": 2, "repeats": 3},
         "tiny": {"model": "tiny", "batch": 4, "frames": 196, "sample_steps": 3, "trained_steps": 2, "repeats": 5}}
CAP = {"full": 30, "tiny": 60}
KEYS = ("batch", "frames", "preset_steps", "guidance_scale", "guidance_passes", "parameters", "sampling_step_s",
        "trained_step_s", "train_batch", "peak_memory_gib", "forward_alone_s", "train_passes_alone_s")


def run(device: torch.device, size: dict, ctx: Context) -> dict:
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
