"""Devices and cross-process collectives.

Device preference is npu > cuda > cpu; torch_npu is imported only when installed.
"""

from __future__ import annotations

import importlib.util

import torch


def npu_available() -> bool:
    """True when torch_npu is installed and an Ascend NPU is visible."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return hasattr(torch, "npu") and torch.npu.is_available()


def select_device(prefer: str = "auto") -> torch.device:
    """The device to run on: an explicit `prefer` ("npu"/"cuda"/"cpu"), or auto = npu > cuda > cpu."""
    if prefer == "auto":
        if npu_available():
            return torch.device("npu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if prefer == "npu" and not npu_available():
        raise RuntimeError("device 'npu' requested but torch_npu is not installed or no NPU is visible")
    if prefer == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    return torch.device(prefer)


def forward_module(prepared: torch.nn.Module, unwrapped: torch.nn.Module) -> torch.nn.Module:
    """The module the policy's forward passes go through: the FSDP (v1) root when accelerate wrapped the policy in
    one, else the unwrapped module (sampling without DDP's hooks). Under FSDP every forward must enter at the root:
    called through the unwrapped module, each wrapped block would initialise as a root of its own on the first
    (sampling) pass and refuse the first training pass, and the root's own parameters would stay sharded."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(prepared, FullyShardedDataParallel):
            return prepared
    return unwrapped


def gather_in_rank_order(tensor: torch.Tensor, accelerator) -> torch.Tensor:
    """(n, ...) per process -> (world * n, ...) concatenated in rank order (rank 0 first)."""
    return accelerator.gather(tensor.contiguous())


def use_cpu_if_no_accelerator() -> None:
    """Under a multi-process launch on a machine without GPU/NPU, put accelerate in multi-CPU (gloo) mode.

    accelerate's launcher starts the processes with torchrun but only selects its multi-CPU mode when told
    to; without this every process would think it runs alone and groups would be split across processes.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available() and not npu_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
