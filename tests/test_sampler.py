from collections import Counter

import pytest
import torch

from recam.engine.sampler import KRepeatBatchSampler, global_batch_indices


def _replicas(world=8, batch=2, k=4, seed=0, dataset=100, bpe=3, start=0):
    return [KRepeatBatchSampler(dataset, batch, k, world, r, seed, bpe, start_batch=start) for r in range(world)]


def test_each_condition_exactly_k_times_across_replicas():
    samplers = _replicas()
    iters = [iter(s) for s in samplers]
    for _ in range(30):  # 10 epochs x 3 batches
        batch = [i for it in iters for i in next(it)]
        counts = Counter(batch)
        assert len(batch) == 16
        assert len(counts) == 16 // 4 == 4
        assert set(counts.values()) == {4}


def test_eight_replicas_two_per_device_k4_four_batches_gives_16_conditions_per_epoch():
    samplers = _replicas(world=8, batch=2, k=4, bpe=4, dataset=50)
    for epoch in range(5):
        seen = Counter()
        for b in range(4):
            pos = epoch * 4 + b
            batch = [i for s in samplers for i in s.batch_at(pos)]
            assert set(Counter(batch).values()) == {4}
            seen.update(batch)
        assert len(seen) == 16 and set(seen.values()) == {4}  # distinct conditions within an epoch


def test_reproducible_and_depends_on_seed_epoch_batch():
    a = global_batch_indices(100, 4, 4, seed=3, epoch=2, batch_index=1, batches_per_epoch=3)
    b = global_batch_indices(100, 4, 4, seed=3, epoch=2, batch_index=1, batches_per_epoch=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, global_batch_indices(100, 4, 4, seed=4, epoch=2, batch_index=1, batches_per_epoch=3))
    assert not torch.equal(a, global_batch_indices(100, 4, 4, seed=3, epoch=3, batch_index=1, batches_per_epoch=3))


def test_prefetch_and_resume_do_not_change_batches():
    # A DataLoader that prefetches several batches ahead reads the same stream: positions, not epochs, decide.
    s = KRepeatBatchSampler(40, 8, 4, 1, 0, seed=0, batches_per_epoch=2)
    loader = torch.utils.data.DataLoader(list(range(40)), batch_sampler=s, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(6)]
    assert got == [s.batch_at(p) for p in range(6)]
    resumed = KRepeatBatchSampler(40, 8, 4, 1, 0, seed=0, batches_per_epoch=2, start_batch=3)
    assert next(iter(resumed)) == got[3]


def test_small_dataset_wraps_with_distinct_conditions_per_batch():
    for pos in range(20):
        g = global_batch_indices(5, 4, 2, seed=0, epoch=pos // 3, batch_index=pos % 3, batches_per_epoch=3)
        assert set(Counter(g.tolist()).values()) == {2} and len(set(g.tolist())) == 4


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="must divide"):
        KRepeatBatchSampler(10, 3, 4, 1, 0, 0, 1)
    with pytest.raises(ValueError, match="distinct"):
        global_batch_indices(3, 4, 2, 0, 0, 0, 1)


@pytest.mark.parametrize("world,batch,k", [(4, 8, 4), (2, 8, 8), (3, 12, 4), (1, 8, 4)])
def test_a_process_batch_of_a_multiple_of_k_holds_whole_groups_with_their_copies_together(world, batch, k):
    # the unit of the advantages' centring stays on one process, where the noise scale can measure it whole
    samplers = _replicas(world=world, batch=batch, k=k, bpe=3, dataset=200)
    for pos in range(9):
        for s in samplers:
            mine = s.batch_at(pos)
            assert set(Counter(mine).values()) == {k}
            assert all(len(set(mine[i:i + k])) == 1 for i in range(0, batch, k))  # a group's copies in a row


def test_groups_span_processes_only_where_the_process_batch_is_not_a_multiple_of_k():
    # k = 4 over processes of 2 samples: each condition's copies on two processes, still k in all
    samplers = _replicas(world=4, batch=2, k=4, bpe=2, dataset=50)
    for pos in range(4):
        per_rank = [s.batch_at(pos) for s in samplers]
        assert set(Counter(i for b in per_rank for i in b).values()) == {4}
        assert all(len(set(b)) == 1 for b in per_rank)
