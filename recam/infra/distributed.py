"""Devices and cross-process collectives.

Device preference is npu > cuda > cpu; torch_npu is imported only when installed.
"""

from __future__ import annotations

import contextlib
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


# ---------------------------------------------------------------------------------------------------------------
# FSDP (v1): the policy as accelerate wraps it under config/accelerate/fsdp.yaml. Outside a forward each process
# holds a shard of every parameter, so what reads or writes whole weights (checkpoints, resume) gathers them first,
# on every process at once: these are collectives.


def fsdp_root(module: torch.nn.Module):
    """`module` when it is an FSDP (v1) root, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return module if isinstance(module, FullyShardedDataParallel) else None


def forward_module(prepared: torch.nn.Module, unwrapped: torch.nn.Module) -> torch.nn.Module:
    """The module the policy's forward passes go through: the FSDP root when accelerate wrapped the policy in one,
    else the unwrapped module (sampling without DDP's hooks). Under FSDP every forward must enter at the root:
    called through the unwrapped module, each wrapped block would initialise as a root of its own on the first
    (sampling) pass and refuse the first training pass, and the root's own parameters would stay sharded."""
    return prepared if fsdp_root(prepared) is not None else unwrapped


def whole_weights(net: torch.nn.Module, write: bool = False):
    """Context, entered by every process: inside it the unwrapped policy holds its whole parameters, so its
    state_dict and load_state_dict (and peft's adapter functions) work as without FSDP. `write=False`: on the main
    process only (saving); `write=True`: on every process, and what is loaded is written back to the shards on exit
    (resuming). A no-op unless `net` is an FSDP root. The whole weights sit in device memory meanwhile: torch 2.13's
    offload_to_cpu crashed inside state_dict here (a CPU run over gloo)."""
    root = fsdp_root(net)
    if root is None:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(root, writeback=write, rank0_only=not write)


FSDP_OPTIMIZER_LAYOUT = "fsdp-flat"  # marks a checkpoint's optimizer state gathered by whole_optimizer_state
FSDP_PREFIX = "_fsdp_wrapped_module."  # what FSDP puts into the module names below it


def _clean_name(name: str) -> str:
    return name.replace(FSDP_PREFIX, "")


def _shard_sizes(local: int, device) -> list[int]:
    """Every process's element count of one parameter, in rank order."""
    n = torch.tensor([local], device=device)
    sizes = [torch.zeros_like(n) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(sizes, n)
    return [int(x) for x in sizes]


def _gather_flat(piece: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The pieces of one flattened tensor (rank r holds sizes[r] elements), concatenated in rank order."""
    buf = torch.zeros(max(sizes), dtype=piece.dtype, device=piece.device)
    buf[: piece.numel()] = piece.flatten()
    out = [torch.empty_like(buf) for _ in sizes]
    torch.distributed.all_gather(out, buf)
    return torch.cat([o[:n] for o, n in zip(out, sizes, strict=True)]).cpu()


def _named_trainable(root, optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    names = {id(q): _clean_name(n) for n, q in root.named_parameters()}
    return [(names[id(q)], q) for group in optimizer.param_groups for q in group["params"]]


def whole_optimizer_state(net: torch.nn.Module, optimizer) -> dict | None:
    """Every process: the optimizer's state for whole parameters, or None unless `net` is an FSDP root
    (optimizer.state_dict() is then the whole state already).

    With FSDP's original parameters, each process's optimizer holds, per parameter, the slice of its flattened
    values that falls in the process's shard: contiguous, in rank order. So a state tensor's whole (flattened)
    value is those slices concatenated. Gathered here rather than by FSDP.optim_state_dict, which (torch 2.13,
    gloo) returned Adam's exp_avg_sq under exp_avg too."""
    root = fsdp_root(net)
    if root is None:
        return None
    named = _named_trainable(root, optimizer)
    keys = [sorted(optimizer.state.get(q, {})) for _, q in named]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, keys)  # a process whose slice is empty may hold no state
    state = {}
    for i, (name, q) in enumerate(named):
        sizes = _shard_sizes(q.numel(), q.device)
        mine = optimizer.state.get(q, {})
        entry = {}
        for key in sorted({k for rank_keys in everyone for k in rank_keys[i]}):
            value = mine.get(key)
            if key == "step":  # AdamW's count (build_policy's optimizer), the same on every process
                counts = [None] * len(sizes)
                torch.distributed.all_gather_object(counts, None if value is None else value.cpu())
                entry[key] = next(x for x in counts if x is not None)
            else:
                piece = value if value is not None else torch.zeros(0, dtype=q.dtype, device=q.device)
                entry[key] = _gather_flat(piece, sizes)
        state[name] = entry
    name_of = {id(q): name for name, q in named}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(q)] for q in g["params"]]}
              for g in optimizer.param_groups]
    return {"layout": FSDP_OPTIMIZER_LAYOUT, "state": state, "param_groups": groups}


def load_optimizer_state(net: torch.nn.Module, optimizer, state: dict) -> None:
    """Every process: load what whole_optimizer_state (under FSDP) or optimizer.state_dict() (otherwise) gave;
    under FSDP each process takes its own slices back."""
    root = fsdp_root(net)
    if root is None:
        if state.get("layout") == FSDP_OPTIMIZER_LAYOUT:
            raise ValueError("this checkpoint's optimizer state was saved under FSDP: resume it with FSDP")
        optimizer.load_state_dict(state)
        return
    if state.get("layout") != FSDP_OPTIMIZER_LAYOUT:
        raise ValueError("this checkpoint's optimizer state was saved without FSDP: resume it without FSDP")
    named = _named_trainable(root, optimizer)
    rank = torch.distributed.get_rank()
    local, index = {}, {}
    for i, (name, q) in enumerate(named):
        index[name] = i
        sizes = _shard_sizes(q.numel(), q.device)
        start = sum(sizes[:rank])
        saved = state["state"].get(name)
        if saved is None or q.numel() == 0:
            continue
        local[i] = {k: v if v.ndim == 0 else v[start:start + q.numel()].clone() for k, v in saved.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in state["param_groups"]]
    optimizer.load_state_dict({"state": local, "param_groups": groups})


def sum_over_shards(net: torch.nn.Module):
    """A function summing a tensor over processes when `net` is sharded over several (FSDP), else None."""
    if fsdp_root(net) is None or torch.distributed.get_world_size() == 1:
        return None

    def total(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        torch.distributed.all_reduce(t)
        return t
    return total


def clip_gradients(accelerator, net: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the policy's gradient to `max_norm` (its whole norm), returning the norm before clipping. FSDP's own
    clip when `net` is an FSDP root (each process holds shards: the norm is summed over them), else accelerate's."""
    root = fsdp_root(net)
    if root is not None:
        return root.clip_grad_norm_(max_norm)
    return accelerator.clip_grad_norm_(net.parameters(), max_norm)


def union_over_processes(names: list[str], world_size: int) -> list[str]:
    """Every process: the names any process gave, sorted (each process's own list when there is one process)."""
    if world_size == 1:
        return names
    from accelerate.utils import gather_object

    return sorted({name for listed in gather_object([names]) for name in listed})


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
