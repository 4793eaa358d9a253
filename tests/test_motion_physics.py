"""Physics metrics of motions: against per-sample loop implementations and on hand-made motions whose values are
known (a sliding stance, a floating or sunk body, a jittering joint, a clean stationary stance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recam.domains.motion import physics
from recam.domains.motion.skeleton import FPS, rest_pose

T = 30


def stance(frames: int = T, lift: float = 0.0) -> torch.Tensor:
    """The rest pose standing still (1, frames, 22, 3), raised by `lift` metres."""
    pose = torch.as_tensor(rest_pose(), dtype=torch.float64).clone()
    pose[:, 1] += lift
    return pose[None, None].repeat(1, frames, 1, 1)


def slide(joints: torch.Tensor, speed: float, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The whole body translated along x at `speed` m/s during transitions start..stop-1, still otherwise."""
    frames = joints.shape[1]
    stop = frames - 1 if stop is None else stop
    steps = torch.zeros(frames, dtype=torch.float64)
    steps[start + 1 : stop + 1] = speed / FPS
    out = joints.clone()
    out[..., 0] += steps.cumsum(0)[None, :, None]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Independent per-sample loop implementations (plain Python floats over numpy arrays).


def loop_skating(joints: np.ndarray, length: int, window: int) -> float:
    if length < 2:
        return math.nan
    speeds = []
    for t in range(length - 1):
        row = []
        for j in (10, 11):
            dx = joints[t + 1, j, 0] - joints[t, j, 0]
            dz = joints[t + 1, j, 2] - joints[t, j, 2]
            row.append(math.sqrt(dx * dx + dz * dz) * FPS)
        speeds.append(row)
    count = 0
    for t in range(length - 1):
        skates = False
        for f, j in enumerate((10, 11)):
            grounded = joints[t, j, 1] < 0.05 and joints[t + 1, j, 1] < 0.05
            fast = speeds[t][f] > 0.5
            if window > 1:
                lo, hi = max(0, t - window // 2), min(length - 2, t + window // 2)
                mean = sum(speeds[s][f] for s in range(lo, hi + 1)) / (hi - lo + 1)
                fast = fast and mean > 0.5
            skates = skates or (grounded and fast)
        count += skates
    return count / (length - 1)


def loop_floor(joints: np.ndarray, length: int) -> tuple[float, float]:
    above = below = 0.0
    for t in range(length):
        low = min(joints[t, j, 1] for j in range(22))
        above += max(low, 0.0)
        below += max(-low, 0.0)
    return above / length, below / length


def loop_jitter(joints: np.ndarray, length: int) -> float:
    if length < 4:
        return math.nan
    total, count = 0.0, 0
    for t in range(length - 3):
        for j in range(22):
            d = joints[t + 3, j] - 3 * joints[t + 2, j] + 3 * joints[t + 1, j] - joints[t, j]
            total += math.sqrt(float(d @ d))
            count += 1
    return total / count * FPS**3


def random_motions(batch: int, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Motions whose feet hover around the contact height and move around the skating speed, so every branch of
    the skating rule is exercised; padded frames hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    steps = torch.randn(batch, frames, 22, 3, generator=gen, dtype=torch.float64) * 0.03
    joints = steps.cumsum(1)
    joints[..., 1] = torch.rand(batch, frames, 22, generator=gen, dtype=torch.float64) * 0.12 - 0.02
    lengths = torch.randint(1, frames + 1, (batch,), generator=gen)
    lengths[0] = frames
    for b in range(batch):
        joints[b, lengths[b] :] = 1e3 * torch.randn(frames - lengths[b], 22, 3, generator=gen, dtype=torch.float64)
    return joints, lengths


@pytest.mark.parametrize("window", [1, 5])
def test_skating_matches_loop(window):
    joints, lengths = random_motions(12, 25, seed=window)
    got = physics.foot_skating_ratio(joints, lengths, window=window)
    for b in range(len(lengths)):
        want = loop_skating(joints[b].numpy(), int(lengths[b]), window)
        if math.isnan(want):
            assert math.isnan(got[b])
        else:
            assert got[b].item() == pytest.approx(want, abs=1e-12)
    # The random motions do skate, and smoothing only ever removes skating transitions.
    assert (got[lengths >= 2] > 0).any()
    plain = physics.foot_skating_ratio(joints, lengths, window=1)
    ok = lengths >= 2
    assert bool((got[ok] <= plain[ok]).all())


def test_floor_and_jitter_match_loop():
    joints, lengths = random_motions(10, 20, seed=7)
    fl = physics.floating(joints, lengths)
    pen = physics.ground_penetration(joints, lengths)
    jit = physics.jitter(joints, lengths)
    for b in range(len(lengths)):
        arr, n = joints[b].numpy(), int(lengths[b])
        above, below = loop_floor(arr, n)
        assert fl[b].item() == pytest.approx(above, abs=1e-12)
        assert pen[b].item() == pytest.approx(below, abs=1e-12)
        want = loop_jitter(arr, n)
        assert math.isnan(want) == math.isnan(jit[b].item())
        if not math.isnan(want):
            assert jit[b].item() == pytest.approx(want, rel=1e-12)


def test_clean_stationary_stance_scores_one():
    reward, metrics = physics.physics_reward(stance())
    for name in ("skating", "skating_avg5", "floating", "penetration", "jitter"):
        assert metrics[name].item() == pytest.approx(0.0, abs=1e-12), name
    assert reward.item() == pytest.approx(1.0, abs=1e-9)


def test_sliding_stance_skates():
    fast = slide(stance(), speed=1.0)
    assert physics.foot_skating_ratio(fast).item() == pytest.approx(1.0)
    assert physics.foot_skating_ratio(fast, window=5).item() == pytest.approx(1.0)
    # Under the speed threshold, or with the feet lifted above the contact height, nothing skates.
    assert physics.foot_skating_ratio(slide(stance(), speed=0.4)).item() == 0.0
    assert physics.foot_skating_ratio(slide(stance(lift=0.06), speed=1.0)).item() == 0.0
    # A slide over transitions 10..19 of 29.
    part = slide(stance(), speed=1.0, start=10, stop=20)
    assert physics.foot_skating_ratio(part).item() == pytest.approx(10 / (T - 1))
    reward, _ = physics.physics_reward(fast)
    assert reward.item() == pytest.approx(math.exp(-1.0 / physics.PhysicsRewardConfig().skating_scale), rel=1e-9)


def test_one_transition_spike_skates_only_without_smoothing():
    spike = slide(stance(), speed=1.0, start=12, stop=13)
    assert physics.foot_skating_ratio(spike).item() == pytest.approx(1 / (T - 1))
    # The centred 5-transition mean there is 1.0 / 5 = 0.2 m/s.
    assert physics.foot_skating_ratio(spike, window=5).item() == 0.0
    # At a clip's edge the window shrinks to 3 transitions: 1.0 / 3 < 0.5, still no skating.
    edge = slide(stance(), speed=1.0, start=0, stop=1)
    assert physics.foot_skating_ratio(edge, window=5).item() == 0.0
    # Transitions 0 and 1 at 0.9 m/s: transition 0 averages {0, 1, 2} to 0.6 > 0.5 and skates (zero padding would
    # give 0.36 and miss it), transition 1 averages {0, 1, 2, 3} to 0.45 and does not.
    edge2 = slide(stance(), speed=0.9, start=0, stop=2)
    assert physics.foot_skating_ratio(edge2, window=5).item() == pytest.approx(1 / (T - 1))


def test_one_foot_sliding_counts_each_transition_once():
    joints = stance()
    joints[:, :, 10, 0] += torch.arange(T, dtype=torch.float64) * (1.0 / FPS)
    assert physics.foot_skating_ratio(joints).item() == pytest.approx(1.0)
    joints[:, :, 11, 0] += torch.arange(T, dtype=torch.float64) * (2.0 / FPS)
    assert physics.foot_skating_ratio(joints).item() == pytest.approx(1.0)


def test_floating_and_sunk_bodies():
    up = stance(lift=0.1)
    assert physics.floating(up).item() == pytest.approx(0.1)
    assert physics.ground_penetration(up).item() == 0.0
    sunk = stance(lift=-0.03)
    assert physics.ground_penetration(sunk).item() == pytest.approx(0.03)
    assert physics.floating(sunk).item() == 0.0
    assert physics.floating(up, tolerance=0.04).item() == pytest.approx(0.06)
    # Floating half the time: mean over frames.
    half = stance()
    half[:, : T // 2, :, 1] += 0.2
    assert physics.floating(half).item() == pytest.approx(0.1)
    reward, _ = physics.physics_reward(up)
    assert reward.item() == pytest.approx(math.exp(-0.1 / 0.05), rel=1e-9)
    reward, _ = physics.physics_reward(sunk)
    assert reward.item() == pytest.approx(math.exp(-0.03 / 0.05), rel=1e-9)


def test_jitter_hand_values():
    # One joint alternating +-a along x: every third difference is 8a long; the mean runs over 22 joints.
    a = 0.01
    joints = stance()
    joints[0, :, 20, 0] += a * (-1.0) ** torch.arange(T, dtype=torch.float64)
    assert physics.jitter(joints).item() == pytest.approx(8 * a / 22 * FPS**3)
    # The whole body on x = k s^3 (s in seconds) has a jerk of 6k; constant velocity and acceleration have none.
    k = 0.7
    s = torch.arange(T, dtype=torch.float64) / FPS
    cubic = stance()
    cubic[..., 0] += (k * s**3)[None, :, None]
    assert physics.jitter(cubic).item() == pytest.approx(6 * k, rel=1e-6)
    quadratic = stance()
    quadratic[..., 2] += (3.0 * s**2 + s)[None, :, None]
    assert physics.jitter(quadratic).item() == pytest.approx(0.0, abs=1e-6)


def test_padding_is_never_read():
    joints = slide(stance(), 1.0, start=3, stop=9)
    joints[0, :, 7, 1] -= 0.01 * torch.arange(T, dtype=torch.float64)
    length = 17
    padded = joints.clone()
    padded[0, length:] = math.nan
    lengths = torch.tensor([length])
    got = physics.physics_metrics(padded, lengths)
    want = physics.physics_metrics(joints[:, :length])
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert got[name].item() == pytest.approx(want[name].item(), abs=1e-12), name
    r_got, _ = physics.physics_reward(padded, lengths)
    r_want, _ = physics.physics_reward(joints[:, :length])
    assert r_got.item() == pytest.approx(r_want.item())


def test_non_finite_motion_is_nan_never_zero():
    joints = stance().repeat(3, 1, 1, 1)
    joints[1, 5, 3, 0] = math.nan
    joints[2, 0, 0, 1] = math.inf
    reward, metrics = physics.physics_reward(joints)
    assert reward[0].item() == pytest.approx(1.0)
    assert torch.isnan(reward[1:]).all()
    for name, values in metrics.items():
        assert torch.isnan(values[1:]).all(), name
        assert torch.isfinite(values[0]), name


def test_too_short_clips_are_nan():
    joints = stance()
    metrics = physics.physics_metrics(joints, torch.tensor([3]))
    assert torch.isnan(metrics["jitter"]).all() and torch.isfinite(metrics["skating"]).all()
    metrics = physics.physics_metrics(joints, torch.tensor([1]))
    assert torch.isnan(metrics["skating"]).all() and metrics["floating"].item() == 0.0
    metrics = physics.physics_metrics(joints, torch.tensor([0]))
    assert torch.isnan(metrics["floating"]).all()


def test_reward_is_the_documented_product_and_bounded():
    joints, lengths = random_motions(8, 20, seed=3)
    lengths = lengths.clamp(min=4)
    config = physics.PhysicsRewardConfig(skating_scale=0.2, jitter_scale=500.0)
    reward, m = physics.physics_reward(joints, lengths, config)
    want = (
        torch.exp(-m["skating"] / 0.2)
        * torch.exp(-m["floating"] / 0.05)
        * torch.exp(-m["penetration"] / 0.05)
        * torch.exp(-m["jitter"] / 500.0)
    )
    torch.testing.assert_close(reward, want)
    assert bool(((reward >= 0) & (reward <= 1)).all())


def test_input_validation():
    with pytest.raises(ValueError, match="shape"):
        physics.jitter(torch.zeros(1, 5, 21, 3))
    with pytest.raises(ValueError, match="lengths"):
        physics.jitter(stance(), torch.tensor([T + 1]))
    with pytest.raises(ValueError, match="lengths"):
        physics.jitter(stance(), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="window"):
        physics.foot_skating_ratio(stance(), window=4)
    # float32 input is accepted (the metrics compute in float64).
    assert physics.physics_reward(stance().float())[0].item() == pytest.approx(1.0)
