"""Phase hooks: what hangs off the GRPO phases without being the algorithm (a reward kept as a constraint,
a critic trained on the samples, fault injection for tests). Every method is optional; the trainer calls them
in list order at the named phase.
"""

from __future__ import annotations

import os
import signal

import torch

from recam.engine.advantages import weighted_mean
from recam.engine.constraint import dual_step


class Hook:
    #: key under which state_dict() is stored in a checkpoint's state.json (None: stateless)
    state_key: str | None = None

    def adjust_scores(self, scores, rank: int, batch_size: int):
        """This process's Scores (recam.engine.containers), batches of batch_size concatenated."""
        return scores

    def adjust_rewards(self, rewards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gathered rewards (name -> (N,)) before advantages are computed."""
        return rewards

    def epoch_record(self, rollouts, groups, dataset) -> dict:
        """Extra fields for this epoch's record (after advantages, before the update)."""
        return {}

    def before_step(self, global_step: int, model) -> None: ...

    def after_step(self, global_step: int) -> None: ...

    def epoch_done(self, groups) -> None:
        """A healthy epoch was trained (it is about to be checkpointed)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class ConstraintHook(Hook):
    """reward.constraint: that reward enters avg with a Lagrange multiplier as its weight, stepped per epoch
    against a floor set by the base's first-epoch mean minus a slack (recam.engine.constraint.dual_step)."""

    state_key = "reward_constraint"

    def __init__(self, name: str, weights: dict[str, float], slack: float, lr: float, max_weight: float):
        self.name, self.weights, self.slack, self.lr, self.max_weight = name, weights, slack, lr, max_weight
        self.weight, self.threshold = float(weights[name]), None

    def adjust_rewards(self, rewards):
        if self.threshold is None:  # the first epoch's samples are the base's: they set the floor
            self.threshold = float(rewards[self.name].nanmean()) - self.slack
        return {**rewards, "avg": weighted_mean(rewards, {**self.weights, self.name: self.weight})}

    def epoch_record(self, rollouts, groups, dataset) -> dict:
        return {"constraint_weight": self.weight, "constraint_threshold": self.threshold}

    def epoch_done(self, groups) -> None:
        self.weight = dual_step(self.weight, float(groups.rewards[self.name].nanmean()), self.threshold, self.lr,
                                self.max_weight)

    def state_dict(self) -> dict:
        return {"weight": self.weight, "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        self.weight, self.threshold = state["weight"], state["threshold"]


class FaultInjectionHook(Hook):
    """debug.*: a destructive weight perturbation before one optimizer step (once, so a rollback replaying the
    step sees a healthy model), SIGKILL after one, and failed rewards at chosen slots of every sampling batch
    (slot = process rank * batch size + position, so a slot names the same sample whatever the process count),
    for the guard's, resume's and exclusion's tests."""

    def __init__(self, blowup_at_step: int, sigkill_at_step: int, fail_reward_slots: tuple[int, ...] = ()):
        self.blowup_at_step, self.sigkill_at_step, self.injected = blowup_at_step, sigkill_at_step, False
        self.fail_reward_slots = fail_reward_slots

    def adjust_scores(self, scores, rank, batch_size):
        mine = [slot - rank * batch_size for slot in self.fail_reward_slots if slot // batch_size == rank]
        if not mine:
            return scores
        failed = torch.zeros_like(scores.valid, dtype=torch.bool).view(-1, batch_size)
        failed[:, mine] = True
        failed = failed.view(-1)
        rewards = {k: torch.where(failed, torch.full_like(v, float("nan")), v) for k, v in scores.rewards.items()}
        return type(scores)(rewards, scores.valid & ~failed, scores.seconds, scores.details)

    def before_step(self, global_step, model) -> None:
        if global_step == self.blowup_at_step and not self.injected:
            inject_blowup(model)
            self.injected = True

    def after_step(self, global_step) -> None:
        if global_step == self.sigkill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


@torch.no_grad()
def inject_blowup(model) -> None:
    """Like a diverged update: every weight moved by 5 standard normal units."""
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g).to(p) * 5.0)


def run_hooks(domain_hooks, weights: dict, reward_config, debug_config) -> list[Hook]:
    """A run's hooks in calling order: the domain's, the reward constraint's (reward.constraint), and the fault
    injection's when a debug.* fault is asked for (a run without one carries no test machinery)."""
    hooks, r, d = list(domain_hooks), reward_config, debug_config
    if r.constraint:
        hooks.append(ConstraintHook(r.constraint, weights, r.constraint_slack, r.constraint_lr,
                                    r.constraint_max_weight))
    slots = tuple(int(x) for x in d.fail_reward_slots.split(",") if x.strip())
    if d.inject_blowup_at_step >= 0 or d.sigkill_at_step >= 0 or slots:
        hooks.append(FaultInjectionHook(d.inject_blowup_at_step, d.sigkill_at_step, slots))
    return hooks
