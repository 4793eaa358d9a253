"""Device helpers that work the same on Ascend NPU (torch_npu), CUDA and CPU.

torch_npu is imported only when installed (through :func:`recam.infra.distributed.npu_available`), so nothing here
requires it. Device choice itself is :func:`recam.infra.distributed.select_device` (npu > cuda > cpu).
"""

from __future__ import annotations

import contextlib
import resource
import sys

import torch

from recam.infra.distributed import npu_available, select_device

DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def get_device(prefer: str = "auto") -> torch.device:
    """The device to run on; ``prefer`` is "auto" (npu > cuda > cpu), "npu", "cuda" or "cpu"."""
    return select_device(prefer)


def _device_type(device: str | torch.device) -> str:
    # Without torch_npu, torch.device("npu") itself raises, so the type is read off the string first.
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if kind not in DIST_BACKENDS:
        raise ValueError(f"unsupported device type {kind!r}; expected one of {sorted(DIST_BACKENDS)}")
    return kind


def _as_device(device: str | torch.device) -> torch.device:
    if _device_type(device) == "npu" and not npu_available():
        raise RuntimeError("device 'npu' requested but torch_npu is not installed or no NPU is visible")
    return torch.device(device)


def dist_backend(device: str | torch.device) -> str:
    """torch.distributed backend for the device type: hccl (npu), nccl (cuda), gloo (cpu).

    A name lookup only: it does not need the device to be present (launchers ask before any device is set up).
    """
    return DIST_BACKENDS[_device_type(device)]


def device_autocast(device: str | torch.device, dtype: torch.dtype | None):
    """Autocast context for ``device`` in ``dtype``; a no-op context for None or float32 (full precision).

    torch_npu registers "npu" as an autocast device type, so the same ``torch.autocast`` call serves all three.
    """
    device = _as_device(device)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast dtype must be bfloat16, float16, float32 or None, got {dtype}")
    return torch.autocast(device_type=device.type, dtype=dtype)


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels on the device (for honest timings); nothing to wait for on CPU."""
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def _accelerator_module(device: torch.device):
    return torch.cuda if device.type == "cuda" else torch.npu


def reset_peak_memory(device: str | torch.device) -> None:
    """Start a new peak-memory window on an accelerator. On CPU the peak is the process's lifetime peak RSS,
    which the OS does not let a process reset."""
    device = _as_device(device)
    if device.type != "cpu":
        _accelerator_module(device).reset_peak_memory_stats(device)


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        # /proc/self/statm: second field is resident pages.
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


def memory_stats(device: str | torch.device) -> dict:
    """Memory in bytes: ``allocated`` (live tensors; process RSS on CPU), ``reserved`` (caching allocator;
    RSS on CPU), ``peak`` (max allocated since the last reset; peak RSS on CPU), plus ``device`` and
    ``source`` saying where the numbers come from."""
    device = _as_device(device)
    if device.type == "cpu":
        rss = _rss_bytes()
        return {"device": "cpu", "source": "process RSS", "allocated": rss, "reserved": rss,
                "peak": max(_peak_rss_bytes(), rss)}
    mod = _accelerator_module(device)
    return {
        "device": str(device),
        "source": f"torch.{device.type} caching allocator",
        "allocated": int(mod.memory_allocated(device)),
        "reserved": int(mod.memory_reserved(device)),
        "peak": int(mod.max_memory_allocated(device)),
    }
