"""peak: a measured matmul (bf16 on an accelerator, fp32 on the CPU), `peak_tflops`: what MFU is read against."""

from __future__ import annotations

import statistics

import torch

from scripts.device_stages import Context
from scripts.device_stages.timing import timed

SIZES = {"full": {"n": 8192, "iters": 20}, "tiny": {"n": 256, "iters": 5}}
CAP = {"full": 15, "tiny": 30}
KEYS = ("peak_tflops", "dtype", "n", "median_s")


def run(device: torch.device, size: dict, ctx: Context) -> dict:
    """TFLOP/s of an n x n matmul: bf16 on an accelerator (what the models run in), fp32 on the CPU."""
    n = size["n"]
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    a @ b  # warm-up (kernel selection)
    seconds = statistics.median(timed(lambda: a @ b, device) for _ in range(size["iters"]))
    return {"peak_tflops": 2 * n**3 / seconds / 1e12, "dtype": str(dtype).removeprefix("torch."), "n": n,
            "median_s": seconds}
