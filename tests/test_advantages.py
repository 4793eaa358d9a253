import pytest
import torch

from recam.engine.advantages import broadcast_over_timesteps, group_advantages, nonzero_group_mask


def _loop_advantages(rewards, ids, std_mode, eps, unbiased=False):
    out = torch.zeros_like(rewards, dtype=torch.float64)
    r_all = rewards.double()
    for g in set(ids.tolist()):
        m = ids == g
        r = r_all[m]
        if bool((r == r[0]).all()):
            continue
        if std_mode == "group":
            denom = r.std(unbiased=unbiased) + eps
        elif std_mode == "global":
            denom = r_all.std(unbiased=unbiased) + eps
        else:
            denom = 1.0
        out[m] = (r - r.mean()) / denom
    return out.float()


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("std_mode", ["group", "global", "none"])
@pytest.mark.parametrize("groups,k,seed", [(1, 2, 0), (4, 4, 1), (16, 4, 2), (7, 3, 3), (32, 8, 4)])
def test_vectorised_matches_loop(std_mode, groups, k, seed, unbiased):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups * k, generator=g)
    ids = torch.arange(groups).repeat_interleave(k)[torch.randperm(groups * k, generator=g)] * 7 + 3
    adv, stats = group_advantages(rewards, ids, std_mode, 1e-4, unbiased)
    torch.testing.assert_close(adv, _loop_advantages(rewards, ids, std_mode, 1e-4, unbiased), atol=1e-5, rtol=1e-5)
    assert stats["trained_prompt_num"].item() == groups and stats["group_size"].item() == k


def test_group_mean_zero_std_one_and_constant_group_exactly_zero():
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7, 0.7, 0.7, 0.7, 0.1, 0.1, 0.1, 0.1])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    adv, stats = group_advantages(rewards, ids, eps=0.0)
    assert abs(adv[:4].mean().item()) < 1e-6 and abs(adv[:4].std(unbiased=False).item() - 1) < 1e-5
    assert torch.equal(adv[4:], torch.zeros(8))
    assert stats["zero_std_ratio"].item() == pytest.approx(2 / 3)
    assert nonzero_group_mask(adv, ids).tolist() == [True] * 4 + [False] * 8


def test_permutation_invariance_and_hand_value():
    rewards = torch.tensor([1.0, 3.0, 10.0, 20.0])
    ids = torch.tensor([5, 5, 9, 9])
    adv, stats = group_advantages(rewards, ids, eps=0.0)
    assert adv.tolist() == [-1.0, 1.0, -1.0, 1.0]  # population std of {1, 3} is 1
    assert stats["reward_std_mean"].item() == pytest.approx((1 + 5) / 2)
    perm = torch.tensor([3, 0, 2, 1])
    adv_p, _ = group_advantages(rewards[perm], ids[perm], eps=0.0)
    assert torch.equal(adv_p, adv[perm])


def test_unbiased_std_is_bessel_corrected_and_keeps_the_logged_std():
    """advantage.unbiased_std (MixGRPO's torch .std()): the group of {1, 3} has std sqrt(2) with n - 1, 1 without; the
    logged reward_std_mean stays the population std either way."""
    rewards, ids = torch.tensor([1.0, 3.0, 10.0, 20.0]), torch.tensor([5, 5, 9, 9])
    adv, stats = group_advantages(rewards, ids, eps=0.0, unbiased=True)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / 2**0.5)
    assert stats["reward_std_mean"].item() == pytest.approx((1 + 5) / 2)
    single, _ = group_advantages(torch.tensor([0.5, 0.1, 0.9]), torch.tensor([0, 1, 1]), unbiased=True)
    assert single[0].item() == 0.0 and bool(torch.isfinite(single).all())  # a group of one: advantage 0


def test_broadcast_shape_and_bad_input():
    a = broadcast_over_timesteps(torch.tensor([1.0, -1.0]), 5)
    assert a.shape == (2, 5) and a[1].eq(-1).all()
    with pytest.raises(ValueError, match="must both be"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(torch.rand(4), torch.tensor([0, 0, 1, 1]), std_mode="batch")
