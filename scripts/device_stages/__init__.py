"""The device check's stages (scripts/device_check.py runs them), one module each: its sizes for a GPU run and for
--tiny, its time cap (SIZES, CAP: seconds per mode), the keys its entry of device_check.json always holds (KEYS),
and run(device, size, ctx) -> that entry. The driver runs each in a process of its own under its cap.

  peak.py      a measured matmul: what MFU is read against
  recam.py     the ReCam transformer at Wan2.1-T2V-1.3B size through the engine's rollout and GRPO objective
  vae.py       the Wan VAE encoding and decoding one clip
  motion.py    MDM's size through the engine's rollout and GRPO objective
  fsdp.py      one smoke epoch through config/accelerate/fsdp.yaml
  learning.py  presets tiny_gpu and motion_tiny_gpu run by scripts/train_recam.py, across GPU windows (bundle.py:
               what a run brings back and continues from)
  timing.py    the timing helpers they share; report.py what the driver writes besides (device_check.md)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Context:
    """What a stage may need besides its device and size."""

    work: Path  # a temporary folder of the stage's own, removed after it
    out_dir: Path  # --out: where device_check.json and the learning runs go
    cap: float  # the stage's time cap, seconds (the driver kills it there; the learning stage splits it)
    peak_tflops: float | None = None  # the peak stage's, for MFU
    resume: Path | None = None  # --resume: a previous check's --out whose learning runs continue
