"""The noise an accelerator draws (KeyedNoise): on the device, step by step, keyed by the sample alone, standard
normal; and the CPU device's noise unchanged (per_sample_noise's streams, bit for bit)."""

import numpy as np
import pytest
import torch
from scipy import stats

from recam.engine.rollout import KeyedNoise, TensorNoise, keyed_uniform_bits, noise_source, per_sample_noise, rollout
from recam.engine.scheduler import FlowMatchScheduler

SHAPE = (3, 5, 7)  # 105 elements: not a power of two, so no row lines up with a chunk by chance


def _all(noise, num_draws):
    return torch.stack([noise.draw(j) for j in range(num_draws)], 1)


def test_a_sample_s_noise_depends_on_its_key_alone_not_on_how_the_batch_is_split():
    keys = [(3, 11, i) for i in range(8)]
    whole = _all(KeyedNoise(keys, 4, SHAPE, "cpu"), 4)
    halves = torch.cat([_all(KeyedNoise(keys[:4], 4, SHAPE, "cpu"), 4),
                        _all(KeyedNoise(keys[4:], 4, SHAPE, "cpu"), 4)])
    ones = torch.cat([_all(KeyedNoise([k], 4, SHAPE, "cpu"), 4) for k in reversed(keys)]).flip(0)
    assert whole.shape == (8, 4, *SHAPE)
    assert torch.equal(whole, halves) and torch.equal(whole, ones)
    # a draw read alone, or read again, is the same draw: nothing depends on the order of reading
    late = KeyedNoise(keys, 4, SHAPE, "cpu")
    assert torch.equal(late.draw(3), whole[:, 3]) and torch.equal(late.draw(3), late.draw(3))


def test_the_chunked_draw_is_the_unchunked_one(monkeypatch):
    keys = [(0, 0, i) for i in range(7)]
    whole = _all(KeyedNoise(keys, 2, SHAPE, "cpu"), 2)
    import recam.engine.rollout as r
    monkeypatch.setattr(r, "_CHUNK", 53 * 3)  # three rows of 53 pairs per launch, so 7 rows take three launches
    assert torch.equal(_all(KeyedNoise(keys, 2, SHAPE, "cpu"), 2), whole)


def test_keyed_noise_is_standard_normal_and_independent_across_samples_draws_and_elements():
    n, draws, shape = 64, 3, (40, 50)
    x = _all(KeyedNoise([(5, 1, i) for i in range(n)], draws, shape, "cpu"), draws).double()
    flat = x.flatten().numpy()  # 384,000 numbers
    se = 1 / np.sqrt(flat.size)
    assert abs(flat.mean()) < 5 * se and abs(flat.std() - 1) < 5 * se * np.sqrt(0.5)
    assert abs(stats.skew(flat)) < 5 * np.sqrt(6 / flat.size)
    assert abs(stats.kurtosis(flat)) < 5 * np.sqrt(24 / flat.size)  # excess kurtosis 0
    assert stats.kstest(flat, "norm").pvalue > 1e-3
    assert np.abs(flat).max() < 6.0  # 24-bit uniforms: the tail is cut at about 5.9 standard deviations

    def corr(a, b):
        return float(np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1])

    bound = 5 / np.sqrt(x[:, 0].numel())
    assert abs(corr(x[:-1, 0], x[1:, 0])) < bound  # neighbouring keys
    assert abs(corr(x[:, 0], x[:, 1])) < bound  # one sample's consecutive draws
    assert abs(corr(x[..., :-1], x[..., 1:])) < bound  # neighbouring elements
    # keys one apart in any field give unrelated streams
    a, b = (KeyedNoise([k], 1, shape, "cpu").draw(0) for k in [(5, 1, 0), (5, 2, 0)])
    assert abs(corr(a, b)) < 5 / np.sqrt(a.numel())


def test_the_hash_is_a_bijection_of_the_counter_for_a_fixed_key():
    counters = torch.arange(1 << 16, dtype=torch.int32)
    key = torch.from_numpy(np.array([12345, 678, 2**32 - 1], dtype=np.uint32).view(np.int32))
    bits = keyed_uniform_bits(counters, key)
    assert bits.dtype == torch.int32 and len(torch.unique(bits)) == len(counters)
    # and its bits are balanced: each of the 32 output bits is set about half the time
    share = torch.stack([(bits >> b) & 1 for b in range(32)]).double().mean(1)
    assert (share - 0.5).abs().max() < 5 * 0.5 / np.sqrt(len(counters))


def test_the_int32_hash_is_lowbias32_computed_by_hand():
    """The in-place int32 passes are the hash's unsigned 32-bit arithmetic, checked against Python integers."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    key = [0xDEADBEEF, 7, 0x80000001]
    counters = [0, 1, 2, 0x7FFFFFFF, 123456789]
    expected = []
    for c in counters:
        x = mix(c ^ key[0])
        x = mix(x ^ key[1])
        expected.append(mix(x ^ key[2]))
    got = keyed_uniform_bits(torch.tensor(counters, dtype=torch.int32),
                             torch.from_numpy(np.array(key, dtype=np.uint32).view(np.int32)))
    assert [int(v) & 0xFFFFFFFF for v in got] == expected


def test_the_initial_draw_comes_from_the_initial_keys_the_steps_from_the_sample_keys():
    keys, starts = [(1, 0, i) for i in range(4)], [(1, 9, i // 2) for i in range(4)]
    noise = KeyedNoise(keys, 3, SHAPE, "cpu", initial_keys=starts)
    assert torch.equal(noise.draw(0), KeyedNoise(starts, 1, SHAPE, "cpu").draw(0))
    assert torch.equal(noise.draw(0)[0], noise.draw(0)[1])  # the k copies of a condition share their start
    assert torch.equal(noise.draw(2), KeyedNoise(keys, 3, SHAPE, "cpu").draw(2))
    with pytest.raises(IndexError):
        noise.draw(3)


def test_the_cpu_device_keeps_the_up_front_streams_bit_for_bit():
    keys, starts = [(0, 2, i) for i in range(5)], [(0, 7, i) for i in range(5)]
    source = noise_source(keys, 4, SHAPE, "cpu", starts)
    expected = per_sample_noise(keys, 4, SHAPE)
    expected[:, 0] = per_sample_noise(starts, 1, SHAPE)[:, 0]
    assert isinstance(source, TensorNoise) and torch.equal(source.noise, expected)


def test_a_rollout_reads_only_the_draws_its_stochastic_steps_use():
    """Motion's rollout reads 1 + T of its S + 1 draws; a keyed source computes no other."""
    read = []

    class Counted(KeyedNoise):
        def draw(self, j):
            read.append(j)
            return super().draw(j)

    sched = FlowMatchScheduler(num_steps=8, shift=3.0, noise_level=0.7, sde_type="sde", num_train_steps=3)
    keys = [(0, 0, i) for i in range(4)]
    out = rollout(lambda x, t: -x, Counted(keys, 9, (6,), "cpu"), sched, start=2)
    assert read == [0, 3, 4, 5] and out.log_probs.shape == (4, 3)
    # the same rollout from the same draws made up front gives the same samples
    up_front = torch.stack([KeyedNoise(keys, 9, (6,), "cpu").draw(j) for j in range(9)], 1)
    assert torch.equal(rollout(lambda x, t: -x, up_front, sched, start=2).final, out.final)


def test_the_host_bench_prices_each_part_and_sums_them(monkeypatch):
    """scripts/bench/bench_update_cpu.py at a small size: the parts it times are there, positive, and the host total is
    their sum (camera: PnP included; motion: no PnP)."""
    from scripts.bench import bench_update_cpu as bench

    noise, records = bench.bench_noise(1, 1, 2), bench.bench_records(1)
    assert set(noise) == set(records) == {"tiny_gpu", "motion_tiny_gpu"}
    assert noise["tiny_gpu"]["read"] == 1 + 5 and noise["motion_tiny_gpu"]["read"] == 1 + 6
    assert records["motion_tiny_gpu"]["samples"] == 16384 and records["tiny_gpu"]["samples"] == 2048
    for row in noise.values():
        assert all(row[k] > 0 for k in ("keys_s", "device_draws_s", "cpu_streams_one_thread_s"))
    host = bench.host_seconds({"noise": noise, "records": records,
                               "landmarks": {"pnp_processes_s": 1.5, "pnp_host_s": 0.25}})
    camera, motion = host["tiny_gpu"], host["motion_tiny_gpu"]
    # the batched torch PnP's host share is the default; OpenCV's processes are the total beside it
    assert camera["pnp"] == 0.25 and "pnp" not in motion
    assert camera["total"] == camera["noise_keys"] + camera["records"] + 0.25
    assert camera["total_opencv"] == pytest.approx(camera["noise_keys"] + camera["records"] + 1.5)
    assert motion["total"] == motion["noise_keys"] + motion["records"]
