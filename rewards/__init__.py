"""Reward registry. Each name maps to a factory `factory(config) -> Reward`, and a Reward is an object called as
`reward(videos (B, 3, F, H, W) in [-1, 1], conditions: list) -> (scores (B,), details)`, optionally with `close()`.

Importing this package registers nothing: each reward module registers its own names when imported, and a domain
imports the modules of the rewards it scores (the camera domain: recam/domains/camera/services.py; the motion
domain: recam/domains/motion/domain.py), so choosing one domain never loads another's dependencies.

config is the run's ConfigDict (config/base.py: a reward reads its own section, e.g. reward.unified), or None for
rewards that need no configuration. Whatever a reward needs (a judge's server and HTTP client, a critic's
weights) lives on the object a factory returns, never in module state, so two runs in one process, or a test
next to a run, cannot see each other's judge or critic.

A reward scored by a server (the judge, a served pose estimator) names it in a `server` attribute (its URL), so a
run whose server went down can evaluate without it (MultiReward.without_served).

scores are float32 in [0, 1] (the critic's raw score excepted); NaN marks a sample whose score could not be
computed (never a silent 0); details maps names to (B,) tensors or lists. `MultiReward` combines weighted
rewards into `avg`, which drives training, while every key is logged as reward_<key>.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from recam.engine.advantages import weighted_mean  # noqa: F401  (avg, what drives training; re-exported)
from recam.infra.registry import registrar


class Reward(Protocol):
    """What a factory returns; a reward holding a resource (an HTTP client) also has close()."""

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]: ...


RewardFactory = Callable[[Any], Reward]
REWARDS: dict[str, RewardFactory] = {}


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator adding a reward factory `factory(config) -> Reward` under `name` (duplicates are an error)."""
    return registrar(REWARDS, "reward", name)


def known_rewards() -> list[str]:
    return sorted(REWARDS)


def get_reward(name: str) -> RewardFactory:
    """The factory registered under `name`."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {known_rewards()}")
    return REWARDS[name]


def build_reward(name: str, config=None) -> Reward:
    """A new Reward object for `name`, configured from the run's config (None: the reward's defaults, for the
    rewards that have them)."""
    return get_reward(name)(config)


def close_reward(reward: Reward) -> None:
    close = getattr(reward, "close", None)
    if callable(close):
        close()


def build_rewards(names: Iterable[str], config=None) -> dict[str, Reward]:
    """One Reward object per distinct name, in first-seen order. If a factory fails (a judge that is down), the
    ones already built are closed before the error propagates, so no HTTP client is left open."""
    built: dict[str, Reward] = {}
    try:
        for name in names:
            if name not in built:
                built[name] = build_reward(name, config)
    except BaseException:
        for reward in built.values():
            close_reward(reward)
        raise
    return built


class MultiReward:
    """Weighted combination: scores[key] (B,) for each reward of positive weight plus
    scores["avg"] = sum_i w_i s_i / sum_i w_i.

    `report` names rewards that are computed and returned alongside but never enter `avg` (evaluation uses it
    so that, say, a camera-only run still shows its fidelity).

    `rewards` maps names to Reward objects built elsewhere and shared (a domain hands the same judge and critic
    to its training and evaluation MultiRewards); close() leaves them open. Every other name used is built here
    from `config` by its factory, owned, and closed by close().

    A NaN in any weighted reward makes that sample's avg NaN, so a failure can be excluded downstream
    instead of entering the group statistics as a number.
    """

    def __init__(self, weights: dict[str, float], report: tuple[str, ...] = (),
                 rewards: Mapping[str, Reward] | None = None, config=None):
        unknown = sorted((set(weights) | set(report)) - set(REWARDS))
        if unknown:
            raise ValueError(f"unknown reward names {unknown}; known rewards: {known_rewards()}")
        if not weights or sum(weights.values()) <= 0 or any(w < 0 for w in weights.values()):
            raise ValueError(f"reward weights must be non-negative with a positive sum, got {weights}")
        self.weights = {name: w for name, w in weights.items() if w > 0}  # weight 0: not computed at all
        self.report = tuple(name for name in report if name not in self.weights)
        shared = dict(rewards or {})
        names = (*self.weights, *self.report)
        owned = build_rewards([n for n in names if n not in shared], config)
        self._owned = list(owned.values())
        self.rewards: dict[str, Reward] = {n: shared[n] if n in shared else owned[n] for n in names}

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[dict[str, torch.Tensor], dict]:
        scores, details = {}, {}
        for name, reward in self.rewards.items():
            s, d = reward(videos, conditions)
            if s.shape != (videos.shape[0],):
                raise ValueError(f"reward {name!r} returned shape {tuple(s.shape)}, expected ({videos.shape[0]},)")
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
