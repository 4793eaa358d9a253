"""What the device check's stages measure with: wall seconds with the device's queue drained, peak memory, and the
FLOPs of a call (torch's FlopCounterMode), so that every stage times the same way."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode


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
