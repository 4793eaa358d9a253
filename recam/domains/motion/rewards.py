"""Motion rewards: how well a generated motion matches its caption, and how physically plausible it is.

Both are generator-independent. They read what the motion domain decodes -- an object with `features` (B, T, 263)
in HumanML3D units (de-normalised), `joints` (B, T, 22, 3) in metres and `lengths` (B,), frames at or after a
sample's length being padding (recam.domains.motion.domain.MotionSamples) -- and the conditions' captions; never
the policy, its text encoder or its feature normalisation. So the reward cannot be moved by changing the
generator's conditioning, only by changing the motion.

- motion_alignment: cosine similarity of the motion's embedding to its caption's in a contrastive text/motion
  retrieval evaluator (recam.domains.motion.evaluator.TextMotionEvaluator, trained by
  scripts/pretrain/train_motion_evaluator.py; folder `motion.evaluator`), mapped from [-1, 1] to [0, 1] by
  (cos + 1) / 2.
- motion_retrieval: how well the motion picks its own caption out of a crowd, the probability
  e^(s_own / tau) / (e^(s_own / tau) + 31 * mean_j e^(s_j / tau)) with s the evaluator's cosines and the s_j those of a
  fixed pool of training captions (its own text excluded): the chance of retrieving its caption from a pool of 32
  typical ones, R-precision's question. A raw cosine can be raised by moving every motion towards a hub of the
  embedding that is near all captions at once; this cannot, since the negatives rise with it. The pool is given by
  the domain (`set_negative_captions`): without it the reward refuses to score.
- motion_physics: recam.domains.motion.physics.physics_reward on the joints (foot skating, floating, ground
  penetration, jitter; scales `motion.physics_*`), in [0, 1].

A motion with a non-finite value in its real frames scores NaN under both (a failed score, excluded from the
advantages), never a number.

The three are built in like the modules under rewards/ (recam/domains/__init__.py declares this module to the
registry): validation knows their names and kind before the motion domain loads, and this module is imported only
when one of them is used (or the motion domain loads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recam.domains.motion.evaluator import TextMotionEvaluator, similarity
from recam.domains.motion.physics import PhysicsRewardConfig, physics_reward, valid_frames
from rewards import Reward, register_reward

RETRIEVAL_POOL = 32  # candidates of a retrieval, the own caption included: T2M's R-precision pool


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


class MotionRetrieval(MotionAlignment):
    """Retrieval probability of the own caption against RETRIEVAL_POOL - 1 typical negatives (module docstring);
    details: the raw cosine (text_motion_cosine) and the negatives' mean cosine (negative_cosine)."""

    def __init__(self, evaluator: TextMotionEvaluator, source: str = "", temperature: float = 0.1):
        super().__init__(evaluator, source)
        if not temperature > 0:
            raise ValueError(f"motion.retrieval_temperature must be > 0, got {temperature!r}")
        self.temperature = temperature
        self.negatives: list[str] = []
        self._negative_emb: torch.Tensor | None = None
        self._position: dict[str, int] = {}  # a negative caption's column

    def describe(self) -> str:
        return (f"retrieval probability among {RETRIEVAL_POOL} (temperature {self.temperature:g}, "
                f"{len(self.negatives)} negative captions), {super().describe()}")

    @torch.no_grad()
    def set_negative_captions(self, captions: list[str]) -> None:
        self.negatives = list(dict.fromkeys(c for c in captions if c.strip()))
        if len(self.negatives) < 2:
            raise ValueError(f"motion_retrieval needs at least 2 distinct negative captions, got {len(self.negatives)}")
        self._negative_emb = F.normalize(self.evaluator.encode_text(self.negatives).float(), dim=-1)
        self._position = {n: j for j, n in enumerate(self.negatives)}

    @torch.no_grad()
    def __call__(self, motions, conditions: list) -> tuple[torch.Tensor, dict]:
        if self._negative_emb is None:
            raise RuntimeError("motion_retrieval has no negative captions: the domain sets them "
                               "(set_negative_captions) before the first score")
        _, details = super().__call__(motions, conditions)
        own = details["text_motion_cosine"]
        features, lengths = motions.features.float(), torch.as_tensor(motions.lengths).long()
        real = valid_frames(lengths, features.shape[0], features.shape[1], features.device)
        features = torch.where(real[:, :, None], torch.nan_to_num(features), torch.zeros((), dtype=features.dtype))
        motion = F.normalize(self.evaluator.encode_motion(features, lengths).float(), dim=-1)
        negatives = self._negative_emb.to(motion.device)
        cos = motion @ negatives.T  # (B, M), on the motions' device
        own = own.to(motion.device)
        # a condition's own caption is not its negative: one lookup per condition (comparing every caption with
        # every negative was 67 million string comparisons per 16,384-sample update)
        weight = torch.ones_like(cos)
        rows = [b for b, c in enumerate(conditions) if c.caption in self._position]
        if rows:
            weight[rows, [self._position[conditions[b].caption] for b in rows]] = 0.0
        # mean over the negatives of exp(s_j / tau), relative to exp(s_own / tau) for stability
        rel = torch.exp((cos - own[:, None]) / self.temperature) * weight
        mean_rel = rel.sum(1) / weight.sum(1).clamp_min(1.0)
        prob = 1.0 / (1.0 + (RETRIEVAL_POOL - 1) * mean_rel)
        prob = torch.where(torch.isfinite(own), prob, torch.full_like(prob, float("nan")))
        negative = (cos * weight).sum(1) / weight.sum(1).clamp_min(1.0)
        return prob.cpu(), {"text_motion_cosine": own.cpu(), "negative_cosine": negative.cpu()}


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


@register_reward("motion_alignment", scores="motion")
def build_motion_alignment(config=None, device=None) -> Reward:
    """Needs the run's config: the evaluator is read from `motion.evaluator` (a folder, never downloaded)."""
    if config is None or "motion" not in config or not config.motion.evaluator:
        raise ValueError("motion_alignment needs motion.evaluator, the folder of a trained retrieval evaluator "
                         "(scripts/pretrain/train_motion_evaluator.py)")
    return MotionAlignment(TextMotionEvaluator.load(config.motion.evaluator), config.motion.evaluator)


@register_reward("motion_retrieval", scores="motion")
def build_motion_retrieval(config=None, device=None) -> Reward:
    """Like motion_alignment (motion.evaluator), with motion.retrieval_temperature; the domain gives the negatives."""
    if config is None or "motion" not in config or not config.motion.evaluator:
        raise ValueError("motion_retrieval needs motion.evaluator, the folder of a trained retrieval evaluator "
                         "(scripts/pretrain/train_motion_evaluator.py)")
    return MotionRetrieval(TextMotionEvaluator.load(config.motion.evaluator), config.motion.evaluator,
                           config.motion.retrieval_temperature)


@register_reward("motion_physics", scores="motion")
def build_motion_physics(config=None, device=None) -> Reward:
    return MotionPhysics(physics_config(config))
