"""Reward registry. A reward is `fn(videos (B, 3, F, H, W) in [-1, 1], conditions: list) -> (scores (B,), details)`.

scores are float32 in [0, 1]; NaN marks a sample whose score could not be computed (never a silent 0);
details maps names to (B,) tensors or lists. `MultiReward` combines weighted rewards into `avg`, which drives
training, while every key is logged as reward_<key>.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RewardFn = Callable[..., tuple[torch.Tensor, dict]]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to the registry under `name` (duplicates are an error)."""
    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn
    return decorator


def known_rewards() -> list[str]:
    return sorted(REWARDS)


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {known_rewards()}")
    return REWARDS[name]


class MultiReward:
    """Weighted combination: scores[key] (B,) for each reward of positive weight plus
    scores["avg"] = sum_i w_i s_i / sum_i w_i.

    `report` names rewards that are computed and returned alongside but never enter `avg` (evaluation uses it
    so that, say, a camera-only run still shows its fidelity).

    A NaN in any weighted reward makes that sample's avg NaN, so a failure can be excluded downstream
    instead of entering the group statistics as a number.
    """

    def __init__(self, weights: dict[str, float], report: tuple[str, ...] = ()):
        unknown = sorted((set(weights) | set(report)) - set(REWARDS))
        if unknown:
            raise ValueError(f"unknown reward names {unknown}; known rewards: {known_rewards()}")
        if not weights or sum(weights.values()) <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"reward weights must be non-negative with a positive sum, got {weights}")
        self.weights = {name: w for name, w in weights.items() if w > 0}  # weight 0: not computed at all
        self.report = tuple(name for name in report if name not in self.weights)

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[dict[str, torch.Tensor], dict]:
        scores, details = {}, {}
        for name in (*self.weights, *self.report):
            s, d = REWARDS[name](videos, conditions)
            if s.shape != (videos.shape[0],):
                raise ValueError(f"reward {name!r} returned shape {tuple(s.shape)}, expected ({videos.shape[0]},)")
            scores[name] = s.float()
            details.update({f"{name}/{k}": v for k, v in d.items()})
        scores["avg"] = weighted_mean(scores, self.weights)
        return scores, details


def weighted_mean(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """sum_i w_i s_i / sum_i w_i over the rewards of positive weight: `avg`, the reward that drives training.

    scores: name -> (B,) per-sample rewards; a NaN (a failed score) makes that sample's avg NaN.
    """
    used = {n: w for n, w in weights.items() if w > 0}
    if not used:
        raise ValueError(f"reward weights must have a positive entry, got {weights}")
    return sum(w * scores[n] for n, w in used.items()) / sum(used.values())


def _register_builtin() -> None:
    from rewards import cam_score, fidelity  # noqa: F401  (self-registering)

    for module_name in ("unified", "discriminator"):
        try:
            module = __import__(f"rewards.{module_name}", fromlist=["register"])
        except ModuleNotFoundError:  # optional extras (e.g. httpx) missing: those rewards are simply unavailable
            continue
        module.register(register_reward)


_register_builtin()
