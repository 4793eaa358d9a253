"""Domains: what a sample is, its data, model and rewards (recam.engine.domain.Domain).

Built-in domains are named here and imported only when chosen (`domain_class`): the camera domain's SfM stack and
the motion domain's scipy code never load for the other. Importing a domain's module registers it, and its rewards
with it. The lookup lives here, above the engine, because it knows the built-in domains; the engine keeps only the
registry (recam.engine.domain.DOMAINS, register_domain)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from recam.engine.domain import DOMAINS, Domain
from rewards import add_builtin_rewards

BUILTIN_DOMAINS = {
    "camera": "recam.domains.camera.domain",
    "motion": "recam.domains.motion.domain",
    "toy": "recam.domains.toy.domain",
}

# The motion and toy domains' rewards are built in like the modules under rewards/: known by name (and kind) before
# their domain is loaded, so validating a camera run that weights motion_physics names the domain it belongs to,
# and imported only when one of them is used. The reward registry imports nothing of the domains, so they are
# declared to it from here.
add_builtin_rewards("recam.domains.motion.rewards", Path(__file__).parent / "motion" / "rewards.py")
add_builtin_rewards("recam.domains.toy.rewards", Path(__file__).parent / "toy" / "rewards.py")


def known_domains() -> list[str]:
    """Every domain that can be chosen: the built-in ones (named, not imported) and any registered since."""
    return sorted(set(BUILTIN_DOMAINS) | set(DOMAINS))


def domain_class(name: str) -> Callable[..., Domain]:
    """The class (or factory) registered as `name`, importing a built-in domain's module on first use: only the
    chosen domain is loaded, so one domain's dependencies (and rewards) never break another."""
    if name not in DOMAINS and name in BUILTIN_DOMAINS:
        importlib.import_module(BUILTIN_DOMAINS[name])
    if name not in DOMAINS:
        raise ValueError(f"domain: unknown {name!r}; known: {known_domains()}")
    return DOMAINS[name]


def build_domain(config, device, log) -> Domain:
    return domain_class(config.domain)(config, device, log)
