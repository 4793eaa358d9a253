"""The reward registry: register, find (built-in modules by reading their decorators, without importing them),
look up and build rewards by name. `rewards` re-exports all of it; see its docstring for what a reward is.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

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
               if path.name not in ("__init__.py", "registry.py")]
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
