"""Run scripts/train_recam.py with the policy wrapped in PyTorch FSDP (v1), one process on the CPU over gloo.

accelerate refuses its FSDP plugin without an accelerator, but torch's FSDP itself runs on the CPU, and the
wrapping is what the trainer must get right: every forward through the root instance, never the unwrapped module
(each wrapped block would initialise as a root of its own on the first sampling pass and refuse the training one).
The wrapping is the one config/accelerate/fsdp.yaml asks for: one unit per WanTransformerBlock, original
parameters kept. Usage: python tests/fsdp_cpu_run.py PORT [train_recam.py arguments ...]
"""

import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import recam.engine.trainer as trainer  # noqa: E402

built = trainer.build_policy


def build_fsdp_policy(*args, **kwargs):
    policy, reference, optimizer, ema = built(*args, **kwargs)
    wrapped = FullyShardedDataParallel(policy, auto_wrap_policy=ModuleWrapPolicy({WanTransformerBlock}),
                                       device_id=torch.device("cpu"), use_orig_params=True)
    # the optimizer over the wrapped module's parameters, with the hyperparameters the engine chose
    g = optimizer.param_groups[0]
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=g["lr"], betas=g["betas"],
                                  eps=g["eps"], weight_decay=g["weight_decay"])
    return wrapped, reference, optimizer, ema


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    trainer.build_policy = build_fsdp_policy
    sys.argv = [str(ROOT / "scripts" / "train_recam.py"), *sys.argv[2:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if dist.is_initialized():  # the trainer ends the group itself when it finishes
            dist.destroy_process_group()
