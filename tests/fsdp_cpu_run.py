"""Run scripts/train_recam.py with the policy wrapped in PyTorch FSDP (v1) on CPU processes over gloo; launch it
with torchrun (`python -m torch.distributed.run --nproc_per_node N tests/fsdp_cpu_run.py <train_recam.py args>`).

accelerate refuses its FSDP plugin without an accelerator, but torch's FSDP itself runs on the CPU, and what the
trainer must get right is the same: every forward through the root, parameters gathered for checkpoints and
resume. The wrapping is the one config/accelerate/fsdp.yaml asks for: one unit per WanTransformerBlock, original
parameters kept, full sharding (FSDP falls back to no sharding on one process). accelerate, which would wrap the
policy in DDP for CPU processes, is told to leave an FSDP root as it is.
"""

import runpy
import sys
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_wan import WanTransformerBlock
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import recam.engine.trainer as trainer  # noqa: E402

built = trainer.build_policy
prepare_model = accelerate.Accelerator.prepare_model


def build_fsdp_policy(*args, **kwargs):
    policy, reference, optimizer, ema = built(*args, **kwargs)
    wrapped = FullyShardedDataParallel(policy, auto_wrap_policy=ModuleWrapPolicy({WanTransformerBlock}),
                                       device_id=torch.device("cpu"), use_orig_params=True)
    # the optimizer over the wrapped module's parameters, with the hyperparameters the engine chose
    g = optimizer.param_groups[0]
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=g["lr"], betas=g["betas"],
                                  eps=g["eps"], weight_decay=g["weight_decay"])
    return wrapped, reference, optimizer, ema


def keep_fsdp(self, model, *args, **kwargs):
    return model if isinstance(model, FullyShardedDataParallel) else prepare_model(self, model, *args, **kwargs)


if __name__ == "__main__":
    dist.init_process_group("gloo")  # torchrun's environment
    trainer.build_policy = build_fsdp_policy
    accelerate.Accelerator.prepare_model = keep_fsdp
    sys.argv = [str(ROOT / "scripts" / "train_recam.py"), *sys.argv[1:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if dist.is_initialized():  # the trainer ends the group itself when it finishes
            dist.destroy_process_group()
