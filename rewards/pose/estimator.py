"""The pose estimators' interface: what an estimate holds (PoseEstimate), the estimator protocol and its registry,
and the helpers every estimator shares. The built-in estimators import it from here; rewards.pose (the package)
re-exports it and loads them.
"""


from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from recam.infra.registry import registrar

NOT_SENT = "not_sent"  # a frame the estimator was not asked about (a served estimator's frame cap): not scored


@dataclass
class PoseEstimate:
    """One video's estimated camera trajectory.

    poses: (F, 3, 4) float64 world-to-camera; NaN rows where `ok` is False.
    ok: (F,) bool, the frame's pose was estimated.
    reasons: (F,) str or None, why a frame has no pose ("not_registered", "too_few_landmarks", ...).
    method: what produced the poses ("landmarks", "sfm", "sfm_rotation_only", "served").
    has_translation: False when only rotations were estimated (rotation-only solve): the translation part of
        `poses` is then 0 and carries no information, so cam_score scores rotation only.
    video_reason: set when nothing could be estimated for the whole video (no features, server error, ...).
    unavailable: True when the estimator itself did not answer (server down or erroring after its retries, a worker
        that crashed or ran past its timeout): the video was not judged, so cam_score gives the sample NaN
        (excluded from the advantages, retried by the reward runner) instead of a score. False for a video the
        estimator looked at and could not recover, which cam_score scores at its floor.
    confidence: numbers that say how far to trust the estimate (registered frames, 3D points, reprojection
        error, disagreement between solves); logged per video.
    seconds: wall time per stage (e.g. {"extract": .., "match": .., "map": ..}); logged per video.
    parallax: how far the video's camera translated, without a scale: the mean over pairs of placed frames of the
        shift of scene points that the frames' rotations do not explain (the infinite homography's residual), in
        units of the focal length, about sideways translation over scene depth. 0 for a camera that only rotated;
        NaN when the estimator could not measure it. cam_score uses it where poses cannot help: a target that does
        not translate, against which any translation of the video is error however its scale came out.
    """

    poses: np.ndarray
    ok: np.ndarray
    reasons: list[str | None]
    method: str
    has_translation: bool = True
    video_reason: str | None = None
    unavailable: bool = False
    confidence: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    parallax: float = math.nan

    @classmethod
    def failed(cls, num_frames: int, reason: str, method: str, unavailable: bool = False,
               seconds: dict | None = None, confidence: dict | None = None) -> PoseEstimate:
        """No frame estimated, for `reason` (see `unavailable`)."""
        return cls(poses=np.full((num_frames, 3, 4), np.nan), ok=np.zeros(num_frames, bool),
                   reasons=[reason] * num_frames, method=method, video_reason=reason, unavailable=unavailable,
                   confidence=dict(confidence or {}), seconds=dict(seconds or {}))

    @property
    def num_frames(self) -> int:
        return len(self.ok)


# Translation between two frames, relative to the scene's depth, that is not counted as the camera having moved:
# PnP's jitter on the synthetic world's 32 px frames, where a camera that only turned otherwise shows up to about
# this much and a translating one 0.035 more (docs/results.md, "A camera asked to stand still").
STILL_TOLERANCE = 0.005


def centre_parallax(poses: np.ndarray, ok: np.ndarray, scene_depth: float, tolerance: float = STILL_TOLERANCE) -> float:
    """PoseEstimate.parallax from poses of known scale: the mean over pairs of placed frames of the distance between
    their camera centres over scene_depth (in the poses' units), less `tolerance`, floored at 0. Sideways, that is
    the shift of points at that depth in units of the focal length, as SfM measures it from its matches; along the
    view axis it is more than SfM would see. NaN with fewer than two placed frames. poses (F, 3, 4)
    world-to-camera, ok (F,) bool."""
    P = poses[ok]
    if len(P) < 2:
        return math.nan
    centres = -np.einsum("fji,fj->fi", P[:, :, :3], P[:, :, 3])
    i, j = np.triu_indices(len(P), 1)
    return float(np.maximum(np.linalg.norm(centres[i] - centres[j], axis=1) / scene_depth - tolerance, 0.0).mean())


def landmark_parallax_batch(poses: np.ndarray, ok: np.ndarray, landmarks: Sequence[np.ndarray],
                            tolerance: float = STILL_TOLERANCE) -> np.ndarray:
    """centre_parallax of B videos at once, each with its scene depth taken as the landmark estimator takes it (the
    median depth of its landmarks in its first placed frame): poses (B, F, 3, 4), ok (B, F), landmarks per video
    (L_b, 3). (B,) float64, NaN where fewer than two frames are placed. The same numbers as per video up to the
    order of the sums (tests/test_pnp_torch.py); one numpy pass instead of a dozen calls per video."""
    B, F = ok.shape
    L = max((len(p) for p in landmarks), default=0)
    pts = np.full((B, max(L, 1), 3), np.nan)
    for b, p in enumerate(landmarks):
        pts[b, :len(p)] = p
    first = ok.argmax(1)
    ref = poses[np.arange(B), first]  # (B, 3, 4); anything where no frame is placed
    pairs_i, pairs_j = np.triu_indices(F, 1)
    pair_ok = ok[:, pairs_i] & ok[:, pairs_j]
    count = pair_ok.sum(1)
    out = np.full(B, math.nan)
    rows = np.flatnonzero(count > 0)
    if len(rows) == 0:
        return out
    depth = np.einsum("blj,bj->bl", pts[rows], ref[rows, 2, :3]) + ref[rows, 2, 3:4]
    scene = np.nanmedian(depth, 1)
    P = poses[rows]
    centres = -np.einsum("bfji,bfj->bfi", P[..., :3], P[..., 3])
    dist = np.linalg.norm(centres[:, pairs_i] - centres[:, pairs_j], axis=-1)
    terms = np.where(pair_ok[rows], np.maximum(dist / scene[:, None] - tolerance, 0.0), 0.0)
    out[rows] = terms.sum(1) / count[rows]
    return out


class PoseEstimator(Protocol):
    """estimate(videos, intrinsics, conditions) -> one PoseEstimate per video, never raising for a bad video
    (a failure is a PoseEstimate with reasons). `conditions` gives access to what a method may use besides the
    pixels (the landmark estimator reads the synthetic scene's landmarks); SfM and served estimators ignore it.
    An estimator holding resources (worker processes, an HTTP client) also has close()."""

    name: str

    def estimate(self, videos: Sequence[np.ndarray], intrinsics: Sequence[np.ndarray],
                 conditions: Sequence[Any]) -> list[PoseEstimate]: ...


EstimatorFactory = Callable[[Any], PoseEstimator]
ESTIMATORS: dict[str, EstimatorFactory] = {}


def register_estimator(name: str) -> Callable[[EstimatorFactory], EstimatorFactory]:
    """Decorator adding `factory(cam_config) -> PoseEstimator` under `name`; cam_config is config.reward.cam
    (or None for the estimator's defaults)."""
    return registrar(ESTIMATORS, "pose estimator", name)


def known_estimators() -> list[str]:
    return sorted(ESTIMATORS)


def build_estimator(name: str, cam_config=None) -> PoseEstimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown pose estimator {name!r}; known: {known_estimators()}")
    return ESTIMATORS[name](cam_config)


def close_estimator(estimator: PoseEstimator) -> None:
    close = getattr(estimator, "close", None)
    if callable(close):
        close()


def to_uint8_frames(video: np.ndarray) -> np.ndarray:
    """(F, H, W, 3) float in [0, 1] (NaN-free) -> uint8, rounding."""
    return (np.clip(video, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
