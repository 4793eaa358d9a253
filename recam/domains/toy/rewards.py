"""The toy domain's analytic rewards, registered in the one reward registry (rewards.REWARDS) as rewards of
"points", the toy domain's sample kind: validation keeps them out of the video and motion domains, and theirs out
of this one. The toy domain's module imports this one, which registers them.

A reward is called as reward(points (b, 2), conditions: list[ToyCondition]) -> (scores (b,) float32 in [0, 1],
details); toy.reward_width sets how near a point must come.
"""

from __future__ import annotations

import torch

from rewards import Reward, register_reward


def _targets(points: torch.Tensor, conditions: list) -> torch.Tensor:
    if points.shape != (len(conditions), 2):
        raise ValueError(f"expected points ({len(conditions)}, 2), got {tuple(points.shape)}")
    return torch.stack([c.target for c in conditions]).float()


def target_reward(points: torch.Tensor, conditions: list, width: float) -> tuple[torch.Tensor, dict]:
    """exp(-|x - c|^2 / width^2): 1 on the target, ~0 a few widths away."""
    d2 = ((points.float() - _targets(points, conditions)) ** 2).sum(1)
    return torch.exp(-d2 / width**2), {"distance": d2.sqrt()}


def near_reward(points: torch.Tensor, conditions: list, width: float) -> tuple[torch.Tensor, dict]:
    """The fraction of samples within one width of the target, as a 0/1 per sample: a coarser view of the same
    goal, reported beside `target` so that a gain is not only a few samples moving a little."""
    d2 = ((points.float() - _targets(points, conditions)) ** 2).sum(1)
    return (d2 <= width**2).float(), {}


def _width(config, name: str) -> float:
    if config is None or "toy" not in config:
        raise ValueError(f"the toy reward {name!r} needs the run's config: its width is toy.reward_width")
    return config.toy.reward_width


@register_reward("target", scores="points")
def build_target(config, device=None) -> Reward:
    width = _width(config, "target")
    return lambda points, conditions: target_reward(points, conditions, width)


@register_reward("near", scores="points")
def build_near(config, device=None) -> Reward:
    width = _width(config, "near")
    return lambda points, conditions: near_reward(points, conditions, width)
