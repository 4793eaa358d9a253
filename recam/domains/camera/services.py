"""The camera domain's reward objects, built once per run from its config: the trainer's training and evaluation
rewards and the discriminator's training hook all use the same objects, so there is one judge (health-checked
before any sampling, so a judge that is down fails at start) and one critic (the one that scores is the one
trained)."""

from __future__ import annotations

from recam.infra.config_checks import eval_report_rewards
from rewards import Reward, build_rewards, close_reward


class CameraRewards:
    """Reward objects by name, each built from the run's config on first request and reused after."""

    def __init__(self, config, log, device=None):
        self.config, self.log, self.device = config, log, device
        self._built: dict[str, Reward] = {}

    def get(self, names) -> dict[str, Reward]:
        """name -> Reward for each of `names`, building the ones not built yet (raises on an unknown name and
        when a judge fails its health check)."""
        names = list(dict.fromkeys(names))
        new = build_rewards([n for n in names if n not in self._built], self.config, self.device)
        for name, reward in new.items():
            if hasattr(reward, "describe"):  # a reward with a service or state says what it is
                self.log.detail(f"{name}: {reward.describe()}")
        self._built.update(new)
        return {n: self._built[n] for n in names}

    @property
    def discriminator(self):
        """The critic behind the `discriminator` reward once that reward is built, else None."""
        reward = self._built.get("discriminator")
        return reward.discriminator if reward is not None else None

    def close(self) -> None:
        built, self._built = self._built, {}
        for reward in built.values():
            close_reward(reward)


def used_rewards(config) -> list[str]:
    """The rewards a camera run computes: those of positive weight (training) and eval.report_rewards."""
    weighted = [k for k, w in config.reward.weights.items() if w > 0]
    return list(dict.fromkeys([*weighted, *eval_report_rewards(config)]))
