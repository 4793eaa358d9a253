"""Reward registry: the one table of rewards, for every domain.

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

import ast
import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from recam.engine.advantages import weighted_mean  # noqa: F401  (avg, what drives training; re-exported)
from recam.infra.registry import registrar


class Reward(Protocol):
    """What a factory returns; a reward holding a resource (an HTTP client) also has close()."""

    def __call__(self, samples: Any, conditions: list) -> tuple[torch.Tensor, dict]: ...


RewardFactory = Callable[[Any, Any], Reward]


@dataclass(frozen=True)
class RegisteredReward:
    """One entry of REWARDS: how to build the reward, the sample kind it scores, and the checks of its settings."""

    factory: RewardFactory
    scores: str
    check: Callable[[Any], None] | None = None


REWARDS: dict[str, RegisteredReward] = {}


def register_reward(name: str, *, scores: str, check: Callable[[Any], None] | None = None
                    ) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator registering `factory(config, device) -> Reward` under `name` (duplicates are an error), as a reward
    of samples of kind `scores` (a domain's sample_kind). check(checks), optional: the ranges of the reward's own
    config fields, stated with recam/infra/config_checks.py's FieldChecks."""
    if not isinstance(scores, str) or not scores:
        raise ValueError(f"reward {name!r}: scores must name a sample kind (e.g. 'video'), got {scores!r}")
    add = registrar(REWARDS, "reward", name)

    def decorator(factory: RewardFactory) -> RewardFactory:
        add(RegisteredReward(factory, scores, check))
        return factory

    return decorator


# Built-in reward modules outside rewards/ (module name -> its source file), read like the modules here: a
# domain's own rewards that must be known by name before the domain loads. The package that knows the built-in
# domains declares them (recam/domains/__init__.py), since this registry imports nothing of the domains.
_BUILTIN_MODULES: dict[str, Path] = {}


def add_builtin_rewards(module: str, path: Path) -> None:
    """Count the rewards `module` (its source file `path`) registers as built in: found by reading its
    register_reward decorators (builtin_rewards), imported only when one of them is used."""
    if _BUILTIN_MODULES.get(module) != Path(path):
        _BUILTIN_MODULES[module] = Path(path)
        builtin_rewards.cache_clear()


@functools.cache
def builtin_rewards() -> dict[str, tuple[str, str]]:
    """name -> (sample kind, module) of the rewards registered by the modules directly under rewards/ and those
    declared by add_builtin_rewards, read from their source: a module is imported only when one of its rewards is
    used, and validation can name the kind of a reward whose module was never loaded. The name and kind must be
    literal strings for this to see them."""
    found = {}
    sources = [(f"rewards.{path.stem}", path) for path in sorted(Path(__file__).parent.glob("*.py"))
               if path.name != "__init__.py"]
    for module, path in [*sources, *sorted(_BUILTIN_MODULES.items())]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_reward" and node.args):
                continue
            name = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
            kind = next((k.value.value for k in node.keywords
                         if k.arg == "scores" and isinstance(k.value, ast.Constant)), None)
            if isinstance(name, str) and isinstance(kind, str):
                found[name] = (kind, module)
    return found


def _registered(name: str) -> RegisteredReward | None:
    """The entry of `name`, importing its built-in module first if it has not been; None when nothing registers it."""
    if name not in REWARDS and name in builtin_rewards():
        importlib.import_module(builtin_rewards()[name][1])
    return REWARDS.get(name)


def known_rewards(kind: str | None = None) -> list[str]:
    """The registered rewards; with `kind`, those scoring samples of that kind, the built-in ones of it included
    (their modules are imported now). Without it nothing is imported: the names registered so far."""
    if kind is None:
        return sorted(REWARDS)
    for module in sorted({m for k, m in builtin_rewards().values() if k == kind}):
        importlib.import_module(module)
    return sorted(n for n, r in REWARDS.items() if r.scores == kind)


def reward_kind(name: str) -> str | None:
    """The sample kind `name` scores (registered, or declared by a built-in module not imported yet); None when no
    reward has that name."""
    if name in REWARDS:
        return REWARDS[name].scores
    return builtin_rewards().get(name, (None, ""))[0]


def reward_checks(kind: str) -> list[Callable[[Any], None]]:
    """The settings checks of every reward of `kind`: a run of that kind may switch any of them on."""
    return [REWARDS[n].check for n in known_rewards(kind) if REWARDS[n].check is not None]


def _every_name() -> list[str]:
    return sorted(set(REWARDS) | set(builtin_rewards()))


def get_reward(name: str) -> RewardFactory:
    """The factory registered under `name`."""
    entry = _registered(name)
    if entry is None:
        raise ValueError(f"unknown reward {name!r}; known rewards: {_every_name()}")
    return entry.factory


def build_reward(name: str, config=None, device=None) -> Reward:
    """A new Reward object for `name`, configured from the run's config (None: the reward's defaults, for the
    rewards that have them), on `device` where it computes on one."""
    return get_reward(name)(config, device)


def close_reward(reward: Reward) -> None:
    close = getattr(reward, "close", None)
    if callable(close):
        close()


def build_rewards(names: Iterable[str], config=None, device=None) -> dict[str, Reward]:
    """One Reward object per distinct name, in first-seen order. If a factory fails (a judge that is down), the
    ones already built are closed before the error propagates, so no HTTP client is left open."""
    built: dict[str, Reward] = {}
    try:
        for name in names:
            if name not in built:
                built[name] = build_reward(name, config, device)
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
