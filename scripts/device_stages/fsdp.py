"""fsdp: one smoke epoch through config/accelerate/fsdp.yaml on one GPU (skipped on the CPU: accelerate's FSDP plugin
needs an accelerator)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from scripts.device_stages import Context

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"full": {}, "tiny": {}}
CAP = {"full": 45, "tiny": 30}
KEYS = ("exit", "seconds", "checkpoint")  # on an accelerator; on the CPU the entry is {"skipped": why}


FSDP_ON_CPU = ("accelerate's FSDP plugin refuses a machine without an accelerator ('There are currently no available "
               "devices found'), so config/accelerate/fsdp.yaml cannot run on the CPU; this stage runs it on one GPU")


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    """One smoke epoch through `accelerate launch --config_file config/accelerate/fsdp.yaml` on one process: the
    wrapping, the LoRA-free full fine-tune and the sealed checkpoints under FSDP."""
    if device.type == "cpu":
        return {"skipped": FSDP_ON_CPU}
    work = ctx.work
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
