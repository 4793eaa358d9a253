"""Group-relative advantages keyed by condition id.

Notation: N samples, G groups (unique conditions), T trained timesteps.
Std is the population std (as Flow-GRPO / numpy), eps added to it (default 1e-4); verl uses Bessel's
correction and 1e-6 instead, which inflates advantages of small groups by sqrt(k / (k - 1)), and MixGRPO's script
Bessel's correction and 1e-8 (torch's default `.std()`): `unbiased=True` (advantage.unbiased_std).
"""

from __future__ import annotations

import numpy as np
import torch

# What the centred reward is divided by: the group's std, the std of all N rewards, or nothing (only centred).
STD_MODES = {
    "group": lambda r, group_std, eps, unbiased: group_std + eps,
    "global": lambda r, group_std, eps, unbiased: r.std(unbiased=unbiased and r.numel() > 1) + eps,
    "none": lambda r, group_std, eps, unbiased: torch.ones_like(r),
}


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_mode: str = "group",
                     eps: float = 1e-4, unbiased: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages (r - mean_g) / (std + eps) within each group.

    Args:
        rewards: (N,) float rewards.
        group_ids: (N,) int64 group key per sample (e.g. dataset index of the condition).
        std_mode: "group" divides by the group's std, "global" by the std of all N rewards, "none" only centres.
        eps: added to the std.
        unbiased: the std with Bessel's correction (divided by n - 1; a group of one keeps std 0), as torch's
            default `.std()` that MixGRPO's script calls; False: the population std (Flow-GRPO's np.std).

    Returns:
        advantages (N,) float32, exactly 0 for samples in groups whose rewards are all equal;
        stats (0-dim tensors): group_size (mean samples per group), trained_prompt_num (G),
        zero_std_ratio (fraction of groups with std 0), reward_std_mean (mean group std, population).
    """
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be (N,)")
    r = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, inverse, r)
    means = sums / counts
    sq = torch.zeros(num_groups, dtype=r.dtype).index_add_(0, inverse, (r - means[inverse]) ** 2)
    stds = (sq / counts).sqrt()
    divisors = (sq / (counts - 1).clamp_min(1)).sqrt() if unbiased else stds
    gmax = torch.full((num_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amax")
    gmin = torch.full((num_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amin")
    constant = gmax == gmin  # exact test: float rounding in the mean must not leak a tiny advantage
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode must be one of {list(STD_MODES)}, got {std_mode!r}")
    adv = (r - means[inverse]) / STD_MODES[std_mode](r, divisors[inverse], eps, unbiased)
    adv = torch.where(constant[inverse], torch.zeros_like(adv), adv)
    stats = {
        "group_size": counts.double().mean().float(),
        "trained_prompt_num": torch.tensor(float(num_groups)),
        "zero_std_ratio": constant.double().mean().float(),
        "reward_std_mean": stds.mean().float(),
    }
    return adv.float(), stats


def permute_within_groups(values: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor,
                          generator: torch.Generator) -> torch.Tensor:
    """The placebo's advantages: each group's kept values shuffled among the group's kept samples.

    values, group_ids, keep: (N,). Excluded samples (keep False) keep their value (0: they are not trained on).
    Each group's multiset of values, and so every group statistic, is unchanged; which sample gets which value is
    a uniform random permutation drawn from `generator`, independent of the samples.
    """
    if not values.shape == group_ids.shape == keep.shape or values.ndim != 1:
        raise ValueError(f"values {tuple(values.shape)}, group_ids {tuple(group_ids.shape)} and keep "
                         f"{tuple(keep.shape)} must all be (N,)")
    out = values.clone()
    # one random key per sample, sorted within (group, kept): the positions a group's kept samples take in that
    # order are a uniform permutation of them, drawn in one pass for every group
    key = torch.rand(values.shape[0], generator=generator, dtype=torch.float64)
    slots = torch.nonzero(keep, as_tuple=True)[0]
    if slots.numel() == 0:
        return out
    g = group_ids[slots]
    by_group = slots[torch.argsort(g, stable=True)]  # kept positions, grouped, in position order within a group
    shuffled = slots[torch.from_numpy(np.lexsort((key[slots].numpy(), g.numpy())))]  # grouped, in key order
    out[by_group] = values[shuffled]
    return out


PLACEBO_STREAM = 0x504C4342  # keeps the placebo's permutations apart from the training order's draws
PLACEBO_BANNER = ("PLACEBO run (advantage.placebo=True): each group's advantages were permuted among its own "
                  "samples; its changes are what training without reward information does")


def placebo_advantages(values: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor, seed: int,
                       epoch: int) -> torch.Tensor:
    """advantage.placebo's advantages for one epoch: permute_within_groups with a draw that depends on the run's seed
    and the epoch alone, so every process (each holds the gathered tensors) draws the same permutation, and an epoch
    redone after a rollback draws its own again."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 7 + PLACEBO_STREAM)
    return permute_within_groups(values, group_ids, keep, generator)


def broadcast_over_timesteps(values: torch.Tensor, num_timesteps: int) -> torch.Tensor:
    """(N,) -> (N, T): one scalar per sample repeated over its trained timesteps (a copy, not a view)."""
    return values[:, None].repeat(1, num_timesteps)


def nonzero_group_mask(advantages: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(N,) bool: samples whose group has at least one non-zero advantage (zero-std groups are dropped)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    has_signal = torch.zeros(int(inverse.max()) + 1, dtype=torch.bool).index_fill_(
        0, inverse[advantages != 0], True)
    return has_signal[inverse]


def weighted_mean(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """sum_i w_i s_i / sum_i w_i over the rewards of positive weight: `avg`, the reward that drives training.

    scores: name -> (B,) per-sample rewards; a NaN (a failed score) makes that sample's avg NaN.
    """
    used = {n: w for n, w in weights.items() if w > 0}
    if not used:
        raise ValueError(f"reward weights must have a positive entry, got {weights}")
    return sum(w * scores[n] for n, w in used.items()) / sum(used.values())


def step_sample_weights(keep: torch.Tensor, positions: torch.Tensor, rank: int) -> torch.Tensor | None:
    """Per-sample loss weights (n,) of process `rank` for one optimizer step, or None when the step keeps nothing.

    keep: (P, n) bool, which samples each process keeps (every process knows all of it after the gather);
    positions: the local sample positions the step covers, the same on every process. Processes' gradients are
    averaged, so weight P / kept on each kept sample makes the step's gradient the mean over its kept samples on
    all processes, and every process computes the same `kept`, so all take the same steps.
    """
    kept = int(keep[:, positions].sum())
    if kept == 0:
        return None
    return keep[rank].float() * (keep.shape[0] / kept)


def trajectory_ids(g_index: torch.Tensor) -> torch.Tensor:
    """(N, 2) int64 [dataset index, copy number]: a key per trajectory that survives shuffles and splits."""
    seen: dict[int, int] = {}
    copies = []
    for i in g_index.tolist():
        copies.append(seen.get(i, 0))
        seen[i] = copies[-1] + 1
    return torch.stack([g_index.long(), torch.tensor(copies, dtype=torch.long)], 1)


def local_slice(gathered: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's (n, ...) block of a tensor gathered from every process in rank order (equal sizes): the
    advantages are normalised over every process's samples, and each process trains on its own."""
    if gathered.shape[0] % world_size:
        raise ValueError(f"gathered size {gathered.shape[0]} is not divisible by world size {world_size}")
    n = gathered.shape[0] // world_size
    return gathered[rank * n:(rank + 1) * n]
