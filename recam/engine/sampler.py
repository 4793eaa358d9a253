"""k-repeat distributed sampling: every sampling batch holds whole groups of k copies per condition.

The batch for (seed, epoch, batch index) is a pure function of those three numbers and the world size, so
every process computes the same global batch without talking to the others, a resumed run can jump to any
position, and DataLoader prefetching cannot desynchronise group sizes (there is no `set_epoch` to race).

A group's copies sit next to each other in the global batch, so a process whose batch is a multiple of k holds
whole groups: the unit of the advantages' centring stays on one process, where the gradient noise scale can measure
it (recam.engine.noise_scale). The conditions, not the samples, are shuffled.
"""

from __future__ import annotations

import numpy as np
import torch


def _generator(*key: int) -> torch.Generator:
    # SeedSequence mixes the key so nearby (epoch, batch) pairs give unrelated streams.
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed % (2**63))


def global_batch_indices(
    dataset_size: int, conditions_per_batch: int, k: int, seed: int, epoch: int, batch_index: int,
    batches_per_epoch: int,
) -> torch.Tensor:
    """Dataset indices of one global sampling batch: its conditions in a shuffled order, each repeated k times in
    a row (so a slice of the batch that starts at a multiple of k and holds a multiple of k samples is whole groups).

    Conditions are drawn without replacement within an epoch (one permutation per epoch, consecutive
    slices per batch, wrapping when the dataset is smaller than an epoch needs).

    Returns: (M * k,) long, M = conditions_per_batch.
    """
    if dataset_size < conditions_per_batch:
        raise ValueError(f"dataset has {dataset_size} conditions, a batch needs {conditions_per_batch} distinct ones")
    needed = conditions_per_batch * batches_per_epoch
    epoch_gen = _generator(seed, epoch)
    reps = -(-needed // dataset_size)
    order = torch.cat([torch.randperm(dataset_size, generator=epoch_gen) for _ in range(reps)])
    start = batch_index * conditions_per_batch
    chosen = order[start:start + conditions_per_batch]
    if chosen.unique().numel() != conditions_per_batch:
        # A wrap-around slice may repeat a condition; re-draw this batch's conditions distinct.
        chosen = torch.randperm(dataset_size, generator=_generator(seed, epoch, batch_index, 1))[:conditions_per_batch]
    perm = torch.randperm(chosen.numel(), generator=_generator(seed, epoch, batch_index))
    return chosen[perm].repeat_interleave(k)


class KRepeatBatchSampler(torch.utils.data.Sampler):
    """Infinite batch sampler yielding this rank's slice of each global k-repeat batch.

    Global batch = num_replicas * batch_size samples = (num_replicas * batch_size / k) conditions x k copies,
    split into contiguous per-rank slices in rank order: whole groups on each rank when k divides batch_size.
    Position is (epoch, batch index), derived from a running counter that starts at `start_batch` (the checkpointed
    position when resuming).
    """

    def __init__(self, dataset_size: int, batch_size: int, k: int, num_replicas: int, rank: int, seed: int,
                 batches_per_epoch: int, start_batch: int = 0):
        total = num_replicas * batch_size
        if total % k:
            raise ValueError(f"k={k} must divide num_replicas x batch_size = {num_replicas} x {batch_size}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside [0, {num_replicas})")
        self.dataset_size, self.batch_size, self.k = dataset_size, batch_size, k
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.batches_per_epoch = batches_per_epoch
        self.conditions_per_batch = total // k
        self.position = start_batch

    def batch_at(self, position: int) -> list[int]:
        epoch, batch_index = divmod(position, self.batches_per_epoch)
        g = global_batch_indices(self.dataset_size, self.conditions_per_batch, self.k, self.seed, epoch,
                                 batch_index, self.batches_per_epoch)
        return g[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()

    def __iter__(self):
        position = self.position
        while True:
            yield self.batch_at(position)
            position += 1

    def __len__(self) -> int:
        return self.batches_per_epoch
