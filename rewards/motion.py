"""Motion rewards: how well a generated motion matches its caption, and how physically plausible it is.

Both are generator-independent. They read what the motion domain decodes -- an object with `features` (B, T, 263)
in HumanML3D units (de-normalised), `joints` (B, T, 22, 3) in metres and `lengths` (B,), frames at or after a
sample's length being padding (recam.domains.motion.domain.MotionSamples) -- and the conditions' captions; never
the policy, its text encoder or its feature normalisation. So the reward cannot be moved by changing the
generator's conditioning, only by changing the motion.

- motion_alignment: cosine similarity of the motion's embedding to its caption's in a contrastive text/motion
  retrieval evaluator (recam.domains.motion.evaluator.TextMotionEvaluator, trained by
  scripts/train_motion_evaluator.py; folder `motion.evaluator`), mapped from [-1, 1] to [0, 1] by (cos + 1) / 2.
- motion_physics: recam.domains.motion.physics.physics_reward on the joints (foot skating, floating, ground
  penetration, jitter; scales `motion.physics_*`), in [0, 1].

A motion with a non-finite value in its real frames scores NaN under both (a failed score, excluded from the
advantages), never a number.
"""

from __future__ import annotations

import torch

from recam.domains.motion.evaluator import TextMotionEvaluator, similarity
from recam.domains.motion.physics import PhysicsRewardConfig, physics_reward, valid_frames
from rewards import Reward, register_reward

MOTION_REWARDS = ("motion_alignment", "motion_physics")


def _check_motions(motions, conditions: list) -> None:
    for name in ("features", "joints", "lengths"):
        if not hasattr(motions, name):
            raise TypeError(f"motion rewards score decoded motions (features, joints, lengths), got "
                            f"{type(motions).__name__}: is this reward used outside the motion domain?")
    if motions.features.shape[0] != len(conditions):
        raise ValueError(f"{motions.features.shape[0]} motions but {len(conditions)} conditions")


def finite_motions(features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B,) bool: every value of a sample's real frames (t < length) is finite; padding is never read."""
    real = valid_frames(lengths, features.shape[0], features.shape[1], features.device)
    return (torch.isfinite(features).all(dim=-1) | ~real).all(dim=1)


class MotionAlignment:
    """(cos(text, motion) + 1) / 2 in the evaluator's embedding; details: the raw cosine (text_motion_cosine)."""

    def __init__(self, evaluator: TextMotionEvaluator, source: str = ""):
        self.evaluator = evaluator.eval().requires_grad_(False)
        self.source = source

    def describe(self) -> str:
        return (f"retrieval evaluator {self.source or '(in memory)'}, vocabulary {len(self.evaluator.vocab)} words, "
                f"embedding {self.evaluator.config.embed_dim}-d")

    @torch.no_grad()
    def __call__(self, motions, conditions: list) -> tuple[torch.Tensor, dict]:
        _check_motions(motions, conditions)
        features, lengths = motions.features.float(), torch.as_tensor(motions.lengths).long()
        finite = finite_motions(features, lengths)
        # a non-finite motion's rows and every padded frame are zeroed before encoding: whatever they hold must not
        # reach the embedding (NaN times a zero mask is still NaN)
        real = valid_frames(lengths, features.shape[0], features.shape[1], features.device)
        keep = real & finite[:, None]
        features = torch.where(keep[:, :, None], features, torch.zeros((), dtype=features.dtype))
        text = self.evaluator.encode_text([c.caption for c in conditions])
        motion = self.evaluator.encode_motion(features, lengths)
        cos = similarity(text, motion).cpu().float()
        cos = torch.where(finite, cos, torch.full_like(cos, float("nan")))
        return (cos + 1.0) / 2.0, {"text_motion_cosine": cos}


class MotionPhysics:
    """physics_reward of the decoded joints; details: each physics metric per sample."""

    def __init__(self, config: PhysicsRewardConfig | None = None):
        self.config = config or PhysicsRewardConfig()

    def describe(self) -> str:
        c = self.config
        return (f"exp(-skating / {c.skating_scale:g} - floating / {c.floating_scale:g} - penetration / "
                f"{c.penetration_scale:g} - jitter / {c.jitter_scale:g})")

    @torch.no_grad()
    def __call__(self, motions, conditions: list) -> tuple[torch.Tensor, dict]:
        _check_motions(motions, conditions)
        reward, metrics = physics_reward(motions.joints, torch.as_tensor(motions.lengths).long(), self.config)
        return reward.float(), {k: v.float() for k, v in metrics.items()}


def physics_config(config) -> PhysicsRewardConfig:
    """PhysicsRewardConfig from the run's `motion.physics_*` fields (the defaults without a motion section)."""
    if config is None or "motion" not in config:
        return PhysicsRewardConfig()
    m = config.motion
    return PhysicsRewardConfig(skating_scale=m.physics_skating_scale, floating_scale=m.physics_floating_scale,
                               penetration_scale=m.physics_penetration_scale, jitter_scale=m.physics_jitter_scale)


@register_reward("motion_alignment")
def build_motion_alignment(config=None) -> Reward:
    """Needs the run's config: the evaluator is read from `motion.evaluator` (a folder, never downloaded)."""
    if config is None or "motion" not in config or not config.motion.evaluator:
        raise ValueError("motion_alignment needs motion.evaluator, the folder of a trained retrieval evaluator "
                         "(scripts/train_motion_evaluator.py)")
    return MotionAlignment(TextMotionEvaluator.load(config.motion.evaluator), config.motion.evaluator)


@register_reward("motion_physics")
def build_motion_physics(config=None) -> Reward:
    return MotionPhysics(physics_config(config))
