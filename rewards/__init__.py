"""Rewards: the one table of rewards for every domain (the registry, rewards/registry.py, re-exported here) and
MultiReward, which combines a run's weighted rewards into the `avg` that drives training.

A reward is registered by decorating its factory, `factory(config, device) -> Reward`:

    @register_reward("cam_score", scores="video")
    def build_cam_score(config=None, device=None) -> Reward: ...

`scores` is the sample kind the reward reads, which a domain names in its `sample_kind` ("video": the camera
domain's decoded frames (B, 3, F, H, W) in [-1, 1]; "motion": the motion domain's MotionSamples; "points": the toy
domain's (B, 2) points). Validation (config/validate.py) refuses a weighted or reported reward whose kind is not the
chosen domain's. A Reward is an object called as `reward(samples, conditions: list) -> (scores (B,), details)`,
optionally with `close()`.

config is the run's ConfigDict (config/base.py: a reward reads its own section, e.g. reward.unified), or None for
rewards that need no configuration; device is the run's accelerator device (None outside a run: scripts, tests),
for a reward that computes on it. Whatever a reward needs (a judge's server and HTTP client, a critic's weights)
lives on the object a factory returns, never in module state, so two runs in one process, or a test next to a run,
cannot see each other's judge or critic. A reward with settings states their ranges in `check(checks)`
(recam/infra/config_checks.py's FieldChecks), run whenever a domain of its kind is validated.

Where rewards come from: the modules directly under rewards/ are imported only when a reward of theirs is asked for
(by name, or by kind when a domain of that kind is validated), found by reading their register_reward decorators,
so choosing one domain never loads another's dependencies and a new module here needs no import list; the motion
domain's rewards (recam/domains/motion/rewards.py) are found and loaded the same way, declared by
recam/domains/__init__.py (add_builtin_rewards); a domain's own rewards module (recam/domains/toy/rewards.py) is
imported by the domain; user code is imported by --config.plugins (config/plugins.py).

A reward scored by a server (the judge, a served pose estimator) names it in a `server` attribute (its URL), so a
run whose server went down can evaluate without it (MultiReward.without_served).

scores are float32 in [0, 1] (the critic's raw score excepted); NaN marks a sample whose score could not be
computed (never a silent 0); details maps names to (B,) tensors or lists. `MultiReward` combines weighted
rewards into `avg`, which drives training, while every key is logged as reward_<key>.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recam.engine.advantages import weighted_mean  # noqa: F401  (avg, what drives training; re-exported)
from rewards.registry import (  # noqa: F401  (the registry is this package's interface)
    REWARDS,
    RegisteredReward,
    Reward,
    RewardFactory,
    _every_name,
    _registered,
    add_builtin_rewards,
    build_reward,
    build_rewards,
    builtin_rewards,
    close_reward,
    get_reward,
    known_rewards,
    register_reward,
    reward_checks,
    reward_kind,
)


class MultiReward:
    """Weighted combination: scores[key] (B,) for each reward of positive weight plus
    scores["avg"] = sum_i w_i s_i / sum_i w_i.

    `report` names rewards that are computed and returned alongside but never enter `avg` (evaluation uses it
    so that, say, a camera-only run still shows its fidelity).

    `rewards` maps names to Reward objects built elsewhere and shared (a domain hands the same judge and critic
    to its training and evaluation MultiRewards); close() leaves them open. Every other name used is built here
    from `config` (and `device`) by its factory, owned, and closed by close().

    A NaN in any weighted reward makes that sample's avg NaN, so a failure can be excluded downstream
    instead of entering the group statistics as a number.
    """

    def __init__(self, weights: dict[str, float], report: tuple[str, ...] = (),
                 rewards: Mapping[str, Reward] | None = None, config=None, device=None):
        unknown = sorted(n for n in {*weights, *report} if _registered(n) is None)
        if unknown:
            raise ValueError(f"unknown reward names {unknown}; known rewards: {_every_name()}")
        if not weights or sum(weights.values()) <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"reward weights must be non-negative with a positive sum, got {weights}")
        self.weights = {name: w for name, w in weights.items() if w > 0}  # weight 0: not computed at all
        self.report = tuple(name for name in report if name not in self.weights)
        shared = dict(rewards or {})
        names = (*self.weights, *self.report)
        owned = build_rewards([n for n in names if n not in shared], config, device)
        self._owned = list(owned.values())
        self.rewards: dict[str, Reward] = {n: shared[n] if n in shared else owned[n] for n in names}

    def __call__(self, samples: Any, conditions: list) -> tuple[dict[str, torch.Tensor], dict]:
        scores, details = {}, {}
        for name, reward in self.rewards.items():
            s, d = reward(samples, conditions)
            if s.shape != (samples.shape[0],):
                raise ValueError(f"reward {name!r} returned shape {tuple(s.shape)}, expected ({samples.shape[0]},)")
            scores[name] = s.float()
            details.update({f"{name}/{k}": v for k, v in d.items()})
        scores["avg"] = weighted_mean(scores, self.weights)
        return scores, details

    def served(self) -> list[str]:
        """The names of the rewards a server scores (a Reward whose `server` attribute names it)."""
        return [name for name, reward in self.rewards.items() if getattr(reward, "server", None)]

    def without_served(self, why: str) -> MultiReward:
        """These rewards with every served one replaced by `Skipped` (NaN, never a call): the same names and
        weights, so a weighted skipped reward leaves `avg` NaN rather than an average of the others that reads
        like the full one. The objects are shared; closing the result closes nothing."""
        skipped = {name: Skipped(why) for name in self.served()}
        new = MultiReward.__new__(MultiReward)
        new.weights, new.report, new._owned = self.weights, self.report, []
        new.rewards = {name: skipped.get(name, reward) for name, reward in self.rewards.items()}
        return new

    def close(self) -> None:
        owned, self._owned = self._owned, []
        for reward in owned:
            close_reward(reward)


class Skipped:
    """A reward not computed, for a stated reason: NaN for every sample (a failure, never a 0) and the reason in
    its details."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
        n = len(conditions)
        return torch.full((n,), float("nan")), {"skipped": [self.why] * n}
