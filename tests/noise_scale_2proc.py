"""Two CPU processes over gloo, launched by tests/test_noise_scale.py with torchrun (`python -m
torch.distributed.run --nproc_per_node 2 tests/noise_scale_2proc.py OUT.json`): recam.engine.noise_scale.NoiseScale
measures a small network's update under DDP and under FSDP as the trainer does (no_sync on every micro-batch but the
last), and each process writes what it got beside the formula applied to gradients computed apart, without the
wrapper: every process's small batches but the last micro-batch's, and the mean gradient over all samples."""

import contextlib
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recam.engine.noise_scale import NoiseScale, two_batch_estimates  # noqa: E402
from recam.infra.distributed import sum_over_shards  # noqa: E402

LOCAL, MICRO = 12, 4  # samples per process, per micro-batch: three micro-batches, the last one synced


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(LOCAL, 4, generator=g), torch.randn(LOCAL, generator=g)


def per_sample_loss(net, x, y) -> torch.Tensor:
    return (net(x).squeeze(1) - y) ** 2


def gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def measured(wrapped, rank: int, world: int) -> list[float]:
    """The trainer's way: weights P / kept per sample, no_sync but on the last micro-batch, probe after each."""
    x, y = data(rank)
    kept = LOCAL * world
    index = torch.arange(LOCAL * world).view(world, LOCAL)  # every sample a group of its own
    keep = torch.ones(world, LOCAL, dtype=torch.bool)
    noise = NoiseScale(True, list(wrapped.parameters()), rank, world, gather=gather,
                       reduce=sum_over_shards(wrapped))
    noise.begin_epoch(index, keep, seed=0)
    chunk = [torch.arange(a, a + MICRO) for a in range(0, LOCAL, MICRO)]
    for c, sel in noise.micro_batches(chunk, keep, rank):
        last = c == len(chunk) - 1
        with contextlib.nullcontext() if last else wrapped.no_sync():
            (per_sample_loss(wrapped, x[sel], y[sel]) * (world / kept)).sum().backward()
    assert len(noise.epoch.g2) == 1, noise.epoch.reasons
    return [noise.epoch.g2[0], noise.epoch.trace[0]]


def expected(rank: int, world: int) -> list[float]:
    """The formula on gradients computed apart: each micro-batch's mean gradient but the last, on every process,
    against the mean gradient over every process's samples."""
    net = network()
    params = list(net.parameters())
    x, y = data(rank)

    def grad(sel, scale):
        return torch.cat([g.flatten() for g in torch.autograd.grad(
            per_sample_loss(net, x[sel], y[sel]).sum() * scale, params)])
    small = torch.stack([grad(torch.arange(a, a + MICRO), 1 / MICRO).pow(2).sum() for a in range(0, LOCAL - MICRO,
                                                                                               MICRO)])
    small = gather(small)
    whole = grad(torch.arange(LOCAL), 1.0)
    dist.all_reduce(whole)
    big = float((whole / (LOCAL * world)).pow(2).sum())
    return list(two_batch_estimates(small.double(), torch.full_like(small, MICRO, dtype=torch.float64), big,
                                    float(LOCAL * world)))


def both(rank: int, world: int) -> dict:
    """Each wrapper lives only in here: it must be freed before its process group is destroyed (as
    scripts/train_recam.py does), or gloo's teardown can abort the process at exit ("terminate called without an
    active exception", about 1 run in 12 on 2 cores)."""
    result = {}
    ddp = DistributedDataParallel(network())
    result["ddp"] = {"got": measured(ddp, rank, world), "expected": expected(rank, world)}
    fsdp = FullyShardedDataParallel(network(), device_id=torch.device("cpu"), use_orig_params=True)
    result["fsdp"] = {"got": measured(fsdp, rank, world), "expected": expected(rank, world)}
    return result


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = both(rank, world)
    gc.collect()
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        out.write_text(json.dumps({w: {str(r): everyone[r][w] for r in range(world)} for w in result}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
