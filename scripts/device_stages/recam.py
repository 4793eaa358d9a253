"""recam: the ReCam transformer at Wan2.1-T2V-1.3B size (published config, random init), frozen bf16 base, LoRA and
gradient checkpointing as preset recam_wan_1_3b_8npu sets them, text embeddings of umT5's shape, source and target
latents of an 81 x 480 x 832 clip (16 x 21 x 60 x 104), k copies of one condition, through the engine's own rollout
and GRPO objective (the calls the trainer makes): seconds per sampling step and per trained step (policy forward +
backward, reference forward, log-probs, KL), peak memory, MFU, the first trained step's |ratio - 1| under bf16 and
fp16 autocast, adapter save and load, and the epoch time the preset's step counts imply. Random weights time
exactly like trained ones.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from scripts.device_stages import Context
from scripts.device_stages.timing import autocast, forward_flops, median_time, peak_gib, reset_peak, timed

SIZES = {
    "full": {"model": "wan21_1_3b", "latent": (16, 21, 60, 104), "text": (512, 4096), "sample_steps": 2,
             "trained_steps": 1, "ratio_samples": 2, "repeats": 1},
    "tiny": {"model": "tiny", "latent": (16, 3, 8, 8), "text": (8, 32), "sample_steps": 3, "trained_steps": 2,
             "ratio_samples": 2, "repeats": 5},
}
CAP = {"full": 180, "tiny": 90}
# always there (mfu and mfu_sampling only when the peak stage ran first; first_step_ratio_dev_<dtype>_error beside a
# dtype the device cannot run, whose value is then None)
KEYS = ("k", "train_batch", "latent_shape", "text_shape", "dtype", "mixed_precision", "lora_rank",
        "gradient_checkpointing", "guidance_passes", "parameters", "trainable_parameters", "forward_tflop",
        "sampling_step_s", "sampling_peak_memory_gib", "trained_step_s", "peak_memory_gib", "forward_alone_s",
        "train_passes_alone_s", "first_step_ratio_dev_bf16", "first_step_ratio_dev_fp16", "first_step_ratio_dev",
        "clip_range", "adapter_save_s", "adapter_load_s", "adapter_mib", "epoch_s_implied", "epoch_implied_from")


def recam_model_config(name: str) -> dict:
    from recam.domains.camera.model import wan21_1_3b_config

    if name == "wan21_1_3b":
        return wan21_1_3b_config()
    return {**wan21_1_3b_config(), "num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32,
            "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 64}


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    peak_tflops, work = ctx.peak_tflops, ctx.work
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
