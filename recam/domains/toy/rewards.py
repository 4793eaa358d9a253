"""The toy domain's analytic rewards, in a registry of their own (the camera rewards in rewards.REWARDS never see
points, and these never see videos).

A reward is fn(points (b, 2), conditions: list[ToyCondition], width) -> (scores (b,) float32 in [0, 1], details).
"""

from __future__ import annotations

import torch

from recam.engine.advantages import weighted_mean


def _targets(conditions: list) -> torch.Tensor:
    return torch.stack([c.target for c in conditions]).float()


def target_reward(points: torch.Tensor, conditions: list, width: float) -> tuple[torch.Tensor, dict]:
    """exp(-|x - c|^2 / width^2): 1 on the target, ~0 a few widths away."""
    d2 = ((points.float() - _targets(conditions)) ** 2).sum(1)
    return torch.exp(-d2 / width**2), {"distance": d2.sqrt()}


def near_reward(points: torch.Tensor, conditions: list, width: float) -> tuple[torch.Tensor, dict]:
    """The fraction of samples within one width of the target, as a 0/1 per sample: a coarser view of the same
    goal, reported beside `target` so that a gain is not only a few samples moving a little."""
    d2 = ((points.float() - _targets(conditions)) ** 2).sum(1)
    return (d2 <= width**2).float(), {}


TOY_REWARDS = {"target": target_reward, "near": near_reward}


class ToyReward:
    """Weighted toy rewards plus `avg` (weight-0 rewards are not computed; `report` ones are, outside avg)."""

    def __init__(self, weights: dict[str, float], width: float, report: tuple[str, ...] = ()):
        unknown = sorted((set(weights) | set(report)) - set(TOY_REWARDS))
        if unknown:
            raise ValueError(f"unknown toy rewards {unknown}; known: {sorted(TOY_REWARDS)}")
        self.weights = {k: w for k, w in weights.items() if w > 0}
        if not self.weights:
            raise ValueError(f"toy reward weights need a positive entry, got {weights}")
        self.report = tuple(r for r in report if r not in self.weights)
        self.width = width

    def __call__(self, points: torch.Tensor, conditions: list) -> tuple[dict[str, torch.Tensor], dict]:
        if points.shape != (len(conditions), 2):
            raise ValueError(f"expected points ({len(conditions)}, 2), got {tuple(points.shape)}")
        scores, details = {}, {}
        for name in (*self.weights, *self.report):
            s, d = TOY_REWARDS[name](points, conditions, self.width)
            scores[name] = s.float()
            details.update({f"{name}/{k}": v for k, v in d.items()})
        scores["avg"] = weighted_mean(scores, self.weights)
        return scores, details
