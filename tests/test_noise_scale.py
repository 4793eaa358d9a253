"""The gradient noise scale (recam.engine.noise_scale): the two-batch formulas by hand, the estimator against known
noise scales (independent samples, and groups with centred weights), the group bookkeeping, the None-with-a-reason
cases, and the trainer's records and their resume."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recam.engine.noise_scale import (
    NoiseScale,
    RunningNoise,
    bootstrap_ratio_interval,
    consistent_share,
    expanded_tail,
    group_order,
    group_units,
    groups_across_processes,
    noise_scale,
    two_batch_estimates,
    whole_group_cuts,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.toy_trainer import toy_trainer  # noqa: E402

# tiny tensors on a shared two-core machine: every test on one torch thread (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------------
# the formulas by hand


def test_two_batch_formulas_on_tiny_numbers():
    # the paper's pair: |G_b|^2 = 3 at b = 2, |G_B|^2 = 1.5 at B = 8
    # tr = (3 - 1.5) / (1/2 - 1/8) = 4, |G|^2 = (8 * 1.5 - 2 * 3) / (8 - 2) = 1
    g2, trace = two_batch_estimates(torch.tensor([3.0]), torch.tensor([2.0]), 1.5, 8.0)
    assert (g2, trace) == pytest.approx((1.0, 4.0))
    assert noise_scale(g2, trace) == pytest.approx(4.0)
    assert consistent_share(g2, trace, 8) == pytest.approx(1 / (1 + 4 / 8))
    # two small batches of sizes 2 and 4: mean |G_b|^2 = 2.5 against mean 1/b = 0.375
    # tr = (2.5 - 1.5) / (0.375 - 0.125) = 4, |G|^2 = 1.5 - 4 / 8 = 1
    assert two_batch_estimates(torch.tensor([3.0, 2.0]), torch.tensor([2.0, 4.0]), 1.5, 8.0) == pytest.approx(
        (1.0, 4.0))
    # gradients by hand: small batches of one sample each, [3, 1] and [1, 1]; their mean [2, 1] is the update
    # |G_b|^2 = 10 and 2 (mean 6), |G_B|^2 = 5: tr = (6 - 5) / (1 - 1/2) = 2, |G|^2 = 5 - 2 / 2 = 4
    small = [torch.tensor([3.0, 1.0]), torch.tensor([1.0, 1.0])]
    big = (small[0] + small[1]) / 2
    estimate = two_batch_estimates(torch.stack([s.pow(2).sum() for s in small]), torch.ones(2),
                                   float(big.pow(2).sum()), 2.0)
    assert estimate == pytest.approx((4.0, 2.0))
    assert noise_scale(*estimate) == pytest.approx(0.5)


def test_no_estimate_without_a_small_batch_smaller_than_the_update_and_no_ratio_of_nonpositive_estimates():
    assert two_batch_estimates(torch.tensor([2.0]), torch.tensor([8.0]), 1.5, 8.0) is None  # the update itself
    assert two_batch_estimates(torch.zeros(0), torch.zeros(0), 1.5, 8.0) is None
    assert noise_scale(-0.1, 4.0) is None and noise_scale(1.0, -1.0) is None and noise_scale(None, 1.0) is None
    assert consistent_share(-0.1, 4.0, 8) is None and consistent_share(1.0, 4.0, 0) is None


def test_running_means_are_bias_corrected_exponential_means_kept_apart_and_survive_json():
    r = RunningNoise(decay=0.5)
    assert r.means() == (None, None)
    r.add(1.0, 4.0)
    assert r.means() == pytest.approx((1.0, 4.0))  # bias-corrected: the first estimate itself
    r.add(3.0, 8.0)
    # weights 0.5 and 1 (decay 0.5), normalised: (0.5 * 1 + 3) / 1.5 and (0.5 * 4 + 8) / 1.5
    assert r.means() == pytest.approx((3.5 / 1.5, 10 / 1.5))
    again = RunningNoise()
    again.load_state_dict(json.loads(json.dumps(r.state_dict())))
    assert again == r
    again.load_state_dict(None)  # a checkpoint from before the noise scale: no estimate yet
    assert again.means() == (None, None) and again.steps == 0


# ---------------------------------------------------------------------------------------------------------------
# groups


def test_units_keep_a_condition_together_on_every_process_and_the_order_keeps_units_contiguous():
    # a condition drawn twice in an epoch (a small dataset wraps) is one group of the advantages, one unit here
    assert group_units(torch.tensor([[5, 5, 7, 7, 5, 5]])).tolist() == [0, 0, 1, 1, 0, 0]
    # k = 4 over two processes of 6: rank 0 holds A A A A B B, rank 1 B B C C C C; one order serves both, so the
    # positions one process's group links are linked for all
    assert group_units(torch.tensor([[1, 1, 1, 1, 2, 2], [2, 2, 3, 3, 3, 3]])).tolist() == [0] * 6
    units = torch.arange(6).repeat_interleave(4)
    order = group_order(units, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(24))
    blocks = units[order].view(6, 4)
    assert bool((blocks == blocks[:, :1]).all())  # each group's 4 positions in a row
    assert blocks[:, 0].tolist() != list(range(6))  # groups in a random order


def test_groups_across_processes_counts_only_kept_copies():
    index = torch.tensor([[1, 1, 2, 2], [2, 2, 3, 3]])
    keep = torch.ones(2, 4, dtype=torch.bool)
    assert groups_across_processes(index, keep) == 1
    keep[1, :2] = False  # rank 1's copies of condition 2 failed: the group trains on rank 0 alone
    assert groups_across_processes(index, keep) == 0


def test_cuts_close_every_group_they_opened_and_a_step_that_splits_a_group_has_none():
    units = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3])
    # micro-batches of 3: group 1 straddles the first boundary, the others close
    micro = [torch.tensor([0, 0, 1]), torch.tensor([1, 2, 2]), torch.tensor([3, 3, 3])]
    assert whole_group_cuts(micro, units) == [2, 3]
    assert whole_group_cuts(micro[:2], units) == [2]  # a step of groups 0..2: whole
    assert whole_group_cuts([torch.tensor([0, 0, 1])], units) is None  # group 1 goes on in the next step


# ---------------------------------------------------------------------------------------------------------------
# the estimator against known noise scales


def _estimates_through_the_probe(draw, sizes, repeats, index):
    """Per step: a linear loss sum_i w_i (theta . v_i) over draws v (B, d) = draw(), accumulated micro-batch by
    micro-batch into theta.grad with the trainer's weights 1 / B, measured by NoiseScale as the trainer does (one
    process: its small batches are the runs of micro-batches of whole groups, its big one the step). index: the
    group of each position in training order. Returns the (repeats,) |G|^2 and tr(Sigma) estimates."""
    first = draw()
    theta = torch.nn.Parameter(torch.zeros(first.shape[1], dtype=torch.float64))
    noise = NoiseScale(True, [theta], rank=0, world_size=1)
    B = int(sum(sizes))
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    chunk = [torch.arange(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    keep = torch.ones(B, dtype=torch.bool)
    for r in range(repeats):
        v = first if r == 0 else draw()
        noise.begin_epoch(index.view(1, -1), keep.view(1, -1), seed=0)
        for _, sel in noise.micro_batches(chunk, keep.view(1, -1), 0):
            (theta * v[sel]).sum().mul(1.0 / B).backward()
        theta.grad = None
        assert len(noise.epoch.g2) == 1, noise.epoch.reasons
        if r == 0:
            g2s, traces = [], []
        g2s.append(noise.epoch.g2[0])
        traces.append(noise.epoch.trace[0])
    return torch.tensor(g2s), torch.tensor(traces)


def _within(estimates: torch.Tensor, truth: float, z: float = 4.0, power: float = 0.15) -> tuple[float, float]:
    """(mean, standard error) of i.i.d. per-step estimates, asserting the mean is within z standard errors of the
    truth and that z standard errors are below `power` x truth (else the test could not see a bias that large)."""
    mean, se = float(estimates.mean()), float(estimates.std() / math.sqrt(len(estimates)))
    assert z * se < power * abs(truth), (mean, se, truth)
    assert abs(mean - truth) < z * se, (mean, se, truth)
    return mean, se


def _ratio_within(g2s: torch.Tensor, traces: torch.Tensor, truth: float, z: float = 4.0) -> float:
    """The noise scale as the ratio of the means, within z standard errors (delta method, with the two estimates'
    covariance) of the truth."""
    n = len(g2s)
    g, t = float(g2s.mean()), float(traces.mean())
    cov = torch.cov(torch.stack([g2s, traces])) / n
    ratio = t / g
    se = math.sqrt(max(float(cov[1, 1] - 2 * ratio * cov[0, 1] + ratio ** 2 * cov[0, 0]), 0.0)) / g
    assert abs(ratio - truth) < z * se, (ratio, se, truth)
    return ratio


def test_the_estimator_recovers_the_noise_scale_of_least_squares():
    """Least squares, loss (x . theta - y)^2 / 2 with x ~ N(0, I_d), y = x . theta* + sigma e, at a point theta with
    u = theta - theta*: a sample's gradient is x (x . u - sigma e), of mean u and covariance |u|^2 I + u u^T +
    sigma^2 I (Isserlis), so |G|^2 = |u|^2 and tr(Sigma) = (d + 1) |u|^2 + d sigma^2. With d = 8, |u| = 1, sigma = 1:
    B_simple = 17 samples. Micro-batches of 4 to 16 samples (update of 64): the formula's mean of 1/b_i.

    Tolerance from the number of draws: the 400 steps' estimates are i.i.d., so their mean's standard error is
    their std / sqrt(400); each mean must lie within 4 standard errors of the truth (a false alarm about once in
    16,000 seeds), and 4 standard errors must be under 15% of the truth, so that a bias of that size would show."""
    d, sigma = 8, 1.0
    u = torch.zeros(d, dtype=torch.float64)
    u[0] = 1.0
    gen = torch.Generator().manual_seed(0)
    sizes = [4, 8, 12, 8, 16, 16]

    def draw():
        x = torch.randn(sum(sizes), d, generator=gen, dtype=torch.float64)
        e = torch.randn(sum(sizes), generator=gen, dtype=torch.float64)
        return x * (x @ u - sigma * e)[:, None]  # each sample's gradient at theta

    g2s, traces = _estimates_through_the_probe(draw, sizes, 400, torch.arange(sum(sizes)))
    g2_true, trace_true = 1.0, (d + 1) * 1.0 + d * sigma ** 2
    _within(g2s, g2_true)
    _within(traces, trace_true)
    assert _ratio_within(g2s, traces, trace_true / g2_true) == pytest.approx(17.0, rel=0.15)


def test_groups_with_centred_weights_need_small_batches_of_whole_groups():
    """k copies of a condition whose gradients are G + a_j h + e_j: h is the condition's own direction (drawn per
    group), a_j weights centred within the group (as GRPO's advantages are), e_j each sample's own noise. A group's
    mean is G + mean_j e_j, the h terms cancelling, so in samples tr(Sigma) = k tr Cov(group mean) = d s_e^2 and
    B_simple = d s_e^2 / |G|^2 = 4. Small batches of whole groups recover it (tolerance as above); small batches of
    samples in a random order, splitting groups, see the h terms the update never carries and overstate the noise
    many times over."""
    d, k, groups, s_e, s_h = 16, 4, 16, 0.5, 2.0
    G = torch.zeros(d, dtype=torch.float64)
    G[0] = 1.0
    gen = torch.Generator().manual_seed(1)
    n = k * groups
    group_of = torch.arange(groups).repeat_interleave(k)

    def draw(order):
        a = torch.randn(groups, k, generator=gen, dtype=torch.float64)
        a = (a - a.mean(1, keepdim=True)).flatten()
        h = s_h * torch.randn(groups, d, generator=gen, dtype=torch.float64)[group_of]
        e = s_e * torch.randn(n, d, generator=gen, dtype=torch.float64)
        return (G + a[:, None] * h + e)[order]

    truth = d * s_e ** 2 / 1.0
    sizes = [8] * 8  # two groups per micro-batch when the order keeps groups together
    g2s, traces = _estimates_through_the_probe(lambda: draw(torch.arange(n)), sizes, 400, group_of)
    _within(g2s, 1.0)
    _within(traces, truth)
    assert _ratio_within(g2s, traces, truth) == pytest.approx(4.0, rel=0.15)
    # the per-sample estimator: samples shuffled across micro-batches, each sample counted as its own draw
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    g2s, traces = _estimates_through_the_probe(lambda: draw(shuffled), sizes, 400, torch.arange(n))
    mean, se = float(traces.mean()), float(traces.std() / math.sqrt(len(traces)))
    assert mean > truth + 10 * se and mean > 5 * truth, (mean, se, truth)


# ---------------------------------------------------------------------------------------------------------------
# None, with the reason


def test_no_small_batch_or_groups_across_processes_record_none_with_the_reason():
    p = torch.nn.Parameter(torch.zeros(3))
    keep = torch.ones(8, dtype=torch.bool)
    index = torch.arange(4).repeat_interleave(2)
    alone = NoiseScale(True, [p], rank=0, world_size=1)
    alone.begin_epoch(index.view(1, -1), keep.view(1, -1), seed=0)
    assert alone.probe([torch.arange(8)], keep, 8) is None  # one micro-batch per step: it is the update
    alone.finish_step(None, 8)
    rec = alone.record()
    assert rec["gradient_noise_scale"] is None and rec["update_consistent_share"] is None
    assert "no small batch" in rec["noise/reason"] and rec["noise/update_samples"] == 8
    # two processes, one micro-batch per step: the only one is the synced one
    pair = NoiseScale(True, [p], rank=0, world_size=2)
    pair.begin_epoch(torch.stack([index, index + 4]), torch.ones(2, 8, dtype=torch.bool), seed=0)
    assert pair.probe([torch.arange(8)], keep, 16) is None
    assert "before the last (whose gradient is synced)" in pair.record()["noise/reason"]
    # ... and with two micro-batches the first is a small batch
    assert pair.probe([torch.arange(4), torch.arange(4, 8)], keep, 16) is not None
    # k = 4 on processes of 2 samples: every group on two processes
    spread = NoiseScale(True, [p], rank=0, world_size=2)
    spread.begin_epoch(torch.stack([index // 2 * 2, index // 2 * 2]), torch.ones(2, 8, dtype=torch.bool), seed=0)
    assert spread.probe([torch.arange(4), torch.arange(4, 8)], keep, 16) is None
    rec = spread.record()
    assert rec["gradient_noise_scale"] is None and "more than one process" in rec["noise/reason"]
    off = NoiseScale(False, [p], rank=0, world_size=1)
    off.begin_epoch(index.view(1, -1), keep.view(1, -1), seed=0)
    assert off.probe([torch.arange(4), torch.arange(4, 8)], keep, 8) is None
    assert off.record()["noise/reason"] == "train.noise_scale is off"


# ---------------------------------------------------------------------------------------------------------------
# processes: the small batches are each process's before the sync, the update the synced gradient


def test_two_processes_measure_their_own_small_batches_before_the_sync_against_the_synced_update(tmp_path):
    """tests/noise_scale_2proc.py on two CPU processes over gloo, under DDP and under FSDP (full shard, original
    parameters): each process's estimate equals the formula applied to every process's small batches computed apart
    (without the wrapper) and their mean as the update; the last micro-batch's is left out."""
    out = tmp_path / "result.json"
    with socket.socket() as s:  # a port free now (torchrun's port 0 is not one it accepts)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "tests" / "noise_scale_2proc.py"), str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    for wrapper in ("ddp", "fsdp"):
        for rank in ("0", "1"):
            got, expected = result[wrapper][rank]["got"], result[wrapper][rank]["expected"]
            assert got == pytest.approx(expected, rel=1e-4), (wrapper, rank)
        assert result[wrapper]["0"]["got"] == result[wrapper]["1"]["got"]  # every process records the same


# ---------------------------------------------------------------------------------------------------------------
# the trainer


def _noise_fields(run_dir: Path) -> list[dict]:
    epochs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith(("noise/", "gradient_noise_scale", "update_consistent_share"))}
            for r in epochs if r["type"] == "epoch"]


def _train(run_dir: Path, epochs: int) -> None:
    trainer = toy_trainer(run_dir, settings={"num_epochs": epochs, "eval.freq": 100})
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()


def test_the_toy_run_records_the_noise_scale_every_epoch_and_a_resume_continues_its_running_means(tmp_path):
    """The toy preset: 2 steps per epoch of 2 micro-batches of 32 samples (4 groups of k 8 each), so each step has
    two small batches of whole groups. A run of 2 epochs, and one of 1 resumed for a second, write the same records:
    the resumed epoch's running means go on from the checkpoint's."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _train(whole, 2)
    records = _noise_fields(whole)
    assert len(records) == 2
    for r in records:
        assert math.isfinite(r["gradient_noise_scale"]) and r["gradient_noise_scale"] > 0, r
        assert 0 < r["update_consistent_share"] < 1, r
        assert r["update_consistent_share"] == pytest.approx(
            1 / (1 + r["gradient_noise_scale"] / r["noise/update_samples"]))
        assert r["gradient_noise_scale"] == pytest.approx(r["noise/trace_running"] / r["noise/g2_running"])
        assert r["noise/steps"] == 2 and r["noise/small_batches"] == 4 and r["noise/update_samples"] == 64
    assert [r["noise/steps_running"] for r in records] == [2, 4]
    _train(resumed, 1)
    _train(resumed, 2)  # resumes from epoch 1's checkpoint
    again = _noise_fields(resumed)
    assert len(again) == 2
    for a, b in zip(again, records, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float):
                assert value == pytest.approx(b[key], rel=1e-6), key
            else:
                assert value == b[key], key


# ---------------------------------------------------------------------------------------------------------------
# what the diagnosis and the verifier make of it


def _epoch(epoch: int, g2: float, trace: float, samples: int, reason=None) -> dict:
    """An epoch record's noise fields as the trainer writes them (running means equal to this epoch's)."""
    scale = noise_scale(g2, trace)
    share = consistent_share(g2, trace, samples)
    return {"type": "epoch", "epoch": epoch, "step": epoch + 1, "reward_avg": 0.5,
            "gradient_noise_scale": scale, "update_consistent_share": share, "gradient_noise_scale_epoch": scale,
            "update_consistent_share_epoch": share, "noise/g2": g2, "noise/trace": trace, "noise/g2_running": g2,
            "noise/trace_running": trace, "noise/steps_running": 4 * (epoch + 1), "noise/update_samples": samples,
            "noise/reason": reason}


def test_the_diagnosis_says_what_the_noise_scale_means_and_when_an_update_is_far_below_it():
    from recam.engine.diagnosis import diagnose_run, noise_scale_line

    far = [_epoch(0, 1e-3, 11.0, 128)]  # B_simple = 11,000 samples against updates of 128
    line = noise_scale_line(far)
    assert line.startswith("updates of 128 samples are about 1.2% consistent (KL pull included; noise scale "
                           "~11,000 samples"), line
    assert "epoch 0 alone: no interval" in line  # one epoch: a point value that says it has no interval
    finding = next(f for f in diagnose_run(far) if f.rule == "update_below_noise_scale")
    assert finding.severity == "info" and finding.numbers["gradient_noise_scale"] == pytest.approx(11000)
    assert finding.numbers["update_consistent_share"] == pytest.approx(1 / (1 + 11000 / 128))
    assert "~11,000 samples, 86 times an update" in finding.explanation and "KL pull" in finding.explanation
    near = [_epoch(0, 1.0, 110.0, 64)]
    assert "about 37% consistent (KL pull included; noise scale ~110 samples" in noise_scale_line(near)
    assert not any(f.rule == "update_below_noise_scale" for f in diagnose_run(near))
    unmeasured = [{**_epoch(0, 1.0, 1.0, 8), "gradient_noise_scale": None, "update_consistent_share": None,
                   "noise/reason": "train.noise_scale is off"}]
    assert noise_scale_line(unmeasured) == "gradient noise scale: not measured (train.noise_scale is off)"
    assert noise_scale_line([{"type": "epoch", "epoch": 0}]) is None  # a log from before the noise scale


def _pooled(g2s, trace=0.01, steps=2, samples=128):
    return [{**_epoch(e, g, trace, samples), "noise/steps": steps} for e, g in enumerate(g2s)]


def test_the_run_s_noise_scale_is_a_lower_bound_alone_where_the_g2_interval_contains_0():
    from recam.engine.diagnosis import diagnose_run, noise_scale_line, run_noise_scale
    from recam.infra.stats import t975

    # the pooled |G|^2 is above 0, but its t-interval (by hand) reaches below it: no point value, only the bound
    for g2s in ([4e-6, -1e-6, 3e-6, 2e-6], [-3e-7, 1e-7, -2e-7, -1e-7, 2e-7]):
        n = len(g2s)
        mean, half = np.mean(g2s), t975(n - 1) * np.std(g2s, ddof=1) / np.sqrt(n)
        assert mean - half < 0
        run = run_noise_scale(_pooled(g2s))
        assert run["g2"] == pytest.approx(mean) and run["trace"] == pytest.approx(0.01)
        assert run["g2_half"] == pytest.approx(half)
        assert run["g2_excludes_0"] is False
        assert run["noise_scale"] is None and run["noise_scale_low"] is None and run["noise_scale_high"] is None
        assert run["consistent_share"] is None
        assert run["at_least"] == pytest.approx(0.01 / (mean + half))
        assert run["consistent_share_at_most"] == pytest.approx(1 / (1 + run["at_least"] / 128))
        line = noise_scale_line(_pooled(g2s))
        assert line.startswith("updates of 128 samples are at most ") and "the noise scale is at least" in line
        assert "~" not in line and "contains 0, so no point value" in line, line
        assert f"95% over {n} epochs, {2 * n} steps" in line
        finding = next(f for f in diagnose_run(_pooled(g2s)) if f.rule == "update_below_noise_scale")
        assert finding.numbers["gradient_noise_scale"] is None
        assert finding.numbers["gradient_noise_scale_at_least"] == pytest.approx(run["at_least"])
        assert "at most" in finding.explanation and "~" not in finding.explanation
    # an interval wholly at or below 0 bounds nothing: said so, and no running-means point value slips in
    nothing = _pooled([-3e-6, -2.9e-6, -3.1e-6])
    nothing[-1].update({"noise/g2_running": 1e-6, "gradient_noise_scale": 1e4})  # a running mean above 0
    line = noise_scale_line(nothing)
    assert line.startswith("gradient noise scale: no bound") and "~" not in line, line
    assert not any(f.rule == "update_below_noise_scale" for f in diagnose_run(nothing))


def test_the_run_s_noise_scale_is_a_point_value_with_a_bootstrap_interval_where_g2_is_measured():
    from recam.engine.diagnosis import diagnose_run, noise_scale_line, run_noise_scale

    g2s = [2e-6, 2.2e-6, 1.8e-6, 2.1e-6, 1.9e-6, 2.0e-6]
    run = run_noise_scale(_pooled(g2s))
    assert run["g2_excludes_0"] is True
    assert run["noise_scale"] == pytest.approx(0.01 / np.mean(g2s))
    low, high = bootstrap_ratio_interval(g2s, [0.01] * 6, [2] * 6)
    assert (run["noise_scale_low"], run["noise_scale_high"]) == pytest.approx((low, high))
    assert low < run["noise_scale"] < high
    line = noise_scale_line(_pooled(g2s))
    assert line.startswith(f"updates of 128 samples are about {100 / (1 + 0.01 / np.mean(g2s) / 128):.2g}% "
                           "consistent (the share that repeats between independent updates, KL pull included"), line
    assert "noise scale ~5,000 samples, 95% [" in line and "] by bootstrap over 6 epochs, 12 steps" in line
    finding = next(f for f in diagnose_run(_pooled(g2s)) if f.rule == "update_below_noise_scale")
    assert finding.numbers["gradient_noise_scale"] == pytest.approx(5000)
    assert finding.numbers["gradient_noise_scale_low"] == pytest.approx(low)
    # steps weigh the epochs
    weighted = [{**r, "noise/steps": n} for r, n in zip(_pooled([1e-6, 3e-6]), (3, 1), strict=True)]
    assert run_noise_scale(weighted)["g2"] == pytest.approx((3 * 1e-6 + 3e-6) / 4)


def _loop_bootstrap(g2, trace, weights, rows, tail):
    """The same bootstrap, written as a loop over given resamples: weighted means, their ratio (inf where |G|^2's
    is not above 0), the empirical quantile at tail and 1 - tail (the ceil(q R)-th smallest)."""
    ratios = []
    for row in rows:
        w = sum(weights[i] for i in row)
        g = sum(weights[i] * g2[i] for i in row) / w
        t = max(sum(weights[i] * trace[i] for i in row) / w, 0.0)
        ratios.append(t / g if g > 0 else math.inf)
    ratios.sort()
    return ratios[math.ceil(tail * len(ratios)) - 1], ratios[math.ceil((1 - tail) * len(ratios)) - 1]


def test_the_bootstrap_interval_against_a_loop_and_its_tails_by_hand():
    # Phi(sqrt(12/11) t_11(0.025)) = Phi(1.044466 * -2.200985) = Phi(-2.29885) = 0.010757; many units: 0.025
    assert expanded_tail(12) == pytest.approx(0.010757, abs=2e-6)
    assert expanded_tail(10 ** 6) == pytest.approx(0.025, abs=1e-5)
    rng = np.random.default_rng(7)
    g2 = list(1e-6 + 0.7e-6 * rng.standard_normal(9))
    trace = list(1e-2 * (1 + 0.1 * rng.standard_normal(9)))
    weights = [1, 2, 2, 3, 1, 2, 2, 1, 2]
    got = bootstrap_ratio_interval(g2, trace, weights, resamples=4000, seed=3)
    # the same draws (numpy's generator at the same seed), every other step by hand
    rows = np.random.default_rng(3).integers(0, 9, size=(4000, 9)).tolist()
    assert got == pytest.approx(_loop_bootstrap(g2, trace, weights, rows, expanded_tail(9)), rel=1e-12)
    # other draws: the intervals agree to their Monte Carlo error
    other = random.Random(11)
    rows = [[other.randrange(9) for _ in range(9)] for _ in range(4000)]
    loop = _loop_bootstrap(g2, trace, weights, rows, expanded_tail(9))
    assert got[0] == pytest.approx(loop[0], rel=0.1)
    assert got[1] == pytest.approx(loop[1], rel=0.1) or got[1] == loop[1] == math.inf
    assert bootstrap_ratio_interval(g2, trace, weights, resamples=4000, seed=3) == got  # a fixed seed: deterministic
    # |G|^2 estimates mostly at or below 0: the upper end is open
    assert bootstrap_ratio_interval([-1e-6, 1e-7, -2e-7, 3e-7], [1e-2] * 4)[1] == math.inf
    with pytest.raises(ValueError):
        bootstrap_ratio_interval([1e-6], [1e-2])


@pytest.mark.parametrize("epochs,spread,least", [(12, 0.8, 0.9), (8, 0.5, 0.9), (24, 1.5, 0.9)])
def test_the_bootstrap_interval_covers_the_true_noise_scale(epochs, spread, least):
    """Simulated runs of a known |G|^2 (1e-6) and tr(Sigma) (1e-2; true noise scale 10,000 samples), each epoch's
    estimates noisy around them (|G|^2's standard deviation `spread` times itself, tr(Sigma)'s 10%): the share of 300
    runs whose interval holds 10,000. Measured at these seeds: 95%, 93% and 95% (the plain percentile interval, without
    the expanded tails: 90%, 88%, 95%)."""
    rng = np.random.default_rng(epochs)
    hits = 0
    for _ in range(300):
        g2 = 1e-6 * (1 + spread * rng.standard_normal(epochs))
        trace = 1e-2 * (1 + 0.1 * rng.standard_normal(epochs))
        low, high = bootstrap_ratio_interval(g2, trace, resamples=2000)
        hits += low <= 1e4 <= high
    assert hits / 300 >= least, hits / 300


def test_an_old_record_s_signal_share_is_read_as_the_consistent_share(tmp_path):
    from recam import verify
    from recam.engine.diagnosis import noise_scale_line
    from recam.infra.schema import consistent_share_of

    new = _epoch(0, 1.0, 40.0, 64)
    old = {("update_signal_share" + k.removeprefix("update_consistent_share") if k.startswith("update_consistent")
            else k): v for k, v in new.items()}
    assert "update_consistent_share" not in old and old["update_signal_share"] == pytest.approx(1 / (1 + 40 / 64))
    assert consistent_share_of(old) == consistent_share_of(new) == new["update_consistent_share"]
    assert consistent_share_of(old, epoch=True) == new["update_consistent_share_epoch"]
    assert consistent_share_of({"type": "epoch"}) is None
    assert noise_scale_line([old]) == noise_scale_line([new])
    (check,) = verify.check_noise_scale([old])
    assert check.status == verify.PASS and check.numbers["consistent_share"] == pytest.approx(1 / (1 + 40 / 64))
    (check,) = verify.check_noise_scale([{**old, "update_signal_share": 0.9}])
    assert check.status == verify.FAIL and "epoch 0: update_signal_share 0.9" in check.detail
    assert verify.write_plots([old], tmp_path, "old")  # the plot draws the old name's values


def test_the_verifier_checks_the_noise_fields_against_their_definitions_and_plots_them(tmp_path):
    from recam import verify

    good = [_epoch(0, 1.0, 40.0, 64), _epoch(1, 0.5, 40.0, 64)]
    (check,) = verify.check_noise_scale(good)
    assert check.status == verify.PASS and check.numbers["noise_scale"] == pytest.approx(80.0)
    assert "consistent (KL pull included)" in check.detail
    bad = [good[0], {**good[1], "update_consistent_share": 0.9}]
    (check,) = verify.check_noise_scale(bad)
    assert check.status == verify.FAIL and "epoch 1: update_consistent_share 0.9" in check.detail
    silent = [{**good[0], "gradient_noise_scale": None, "update_consistent_share": None}]
    assert verify.check_noise_scale(silent)[0].status == verify.WARN  # None without the reason
    assert verify.check_noise_scale([{"type": "epoch", "epoch": 0}]) == []
    written = verify.write_plots(good, tmp_path, "run")
    assert ("Gradient noise scale and the update's consistent share over epochs", "run_noise_scale.png") in written
