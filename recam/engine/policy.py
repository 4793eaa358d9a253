"""The policy a run trains, and what it is pulled toward: LoRA on the domain's network (the reference is the same
network with the adapter off), or the whole network trained against a frozen copy; its optimizer and EMA."""

from __future__ import annotations

import copy

import torch

from recam.infra.distributed import fsdp_root
from recam.infra.lora import add_lora


def build_policy(domain, model_config, train_config, device):
    """(policy, reference, optimizer, ema) from config.model and config.train; reference None with LoRA (the adapter
    is switched off instead) or without a KL term, ema None unless train.ema."""
    m, t = model_config, train_config
    policy, reference = domain.build_policy(), None
    if m.lora_rank > 0:
        add_lora(policy, m.lora_rank, m.lora_alpha, [x.strip() for x in m.lora_targets.split(",") if x.strip()] or None)
    elif t.beta > 0:
        reference = copy.deepcopy(policy).requires_grad_(False).eval().to(device)
    if m.gradient_checkpointing:  # recompute block activations in the backward: memory for time
        policy.enable_gradient_checkpointing()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=t.learning_rate,
                                  betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                                  eps=t.adam_epsilon)
    ema = None
    if t.ema:
        from diffusers.training_utils import EMAModel
        # decay min((1 + s) / (10 + s), ema_decay) at the s-th update, the ramp of the references' EMAModuleWrapper
        # (flow_grpo/ema.py get_current_decay, which DiffusionNFT and AWM copy; their first update is s = 1).
        # diffusers' own count starts one update later (its first update copies); update_after_step=-1 aligns them
        ema = EMAModel(policy.parameters(), decay=t.ema_decay, update_after_step=-1)
    return policy, reference, optimizer, ema


def refuse_sharded_copies(policy, world_size: int, train_config, ema, frozen_models: dict) -> None:
    """Under FSDP with more than one process the policy exists only as shards: a copy of it (EMA's shadow weights,
    an objective's old policy) would be a copy of shards. Refused, naming the field."""
    if fsdp_root(policy) is None or world_size == 1:
        return
    copies = [f"train.ema={train_config.ema}"] if ema is not None else []
    copies += [f"its {name} (train.objective={train_config.objective!r})" for name in frozen_models]
    if copies:
        raise ValueError(f"FSDP shards the policy, and {', '.join(copies)} would copy shards: run it with DDP "
                         "(config/accelerate/gpu_8.yaml, npu_8.yaml or deepspeed_zero2.yaml) or turn it off")
