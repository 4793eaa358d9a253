"""cam_score: camera accuracy of a generated video, from camera poses estimated on its frames by a method that never
looks at the generator (rewards/pose: landmark PnP in the synthetic world, structure-from-motion or a served learned
estimator on real footage).

Errors follow CamI2V's definitions (ZGCTroy/CamI2V at c5d7b2f: evaluation/glomap_evaluation.py L125-145 `metric`,
evaluation/utils/common.py L46-58 `relative_pose`, `normalize_t`). Both trajectories are made relative to a
reference frame (the first frame the estimator placed; frame 0 when it placed it) and their camera centres are
divided by the trajectory's largest centre distance from the reference, so a trajectory's scale (unknowable from
SfM) does not count, its direction does. Per frame f:

  - RotErr_f = geodesic angle between the relative rotations, acos((tr(R_est^T R_gt) - 1) / 2), in degrees
    (CamI2V's code sums radians: divide ours by 57.2958 to compare);
  - TransErr_f = || c_est_f - c_gt_f || between the normalised camera centres (in [0, 2]);
  - CamMC_f = || [R | c]_est - [R | c]_gt || over the 12 values of the relative camera-to-world poses, whose
    translation column is the normalised centre (CamI2V compares camera-to-world matrices).

Reported per video, in every summary (details, eval/ metrics, the run summary):

  - rot_err_sum, trans_err_sum, cammc_sum: CamI2V's sums over the scored frames (frames not sent to a served
    estimator are not scored), the reference frame included at 0. A frame the estimator could not place counts
    at the worst value (RotErr 180 deg, TransErr 2, CamMC sqrt(8 + 2^2): the largest distance between two
    rotations' matrices and two centres in the unit ball), as does a translation it could not recover (TransErr
    2 on every frame but the reference). CamI2V's script has no such case: a video GLOMAP cannot solve raises and
    is skipped, so a checkpoint that breaks SfM more often would show smaller sums; here it shows larger ones;
  - rot_err_placed_mean, trans_err_placed_mean, cammc_placed_mean: means over the placed frames only (NaN when
    none was placed): how good the poses that were recovered are, to be read beside
  - placed_fraction: placed frames over scored frames.

A target that does not translate (largest centre distance below min_target_translation, in the data's units) has
no direction to normalise: CamI2V's TransErr is undefined there (NaN, its sums too) and CamMC compares rotations
only (an unplaced frame then counts at sqrt(8)). The per-frame values are also reported, as the lists
rot_err_per_frame / trans_err_per_frame (None where not measured).

Score per frame: exp(-RotErr_f / rot_scale_deg) * exp(-T_f / trans_scale); the video's score is the mean over its
scored frames other than the reference (whose errors are 0 by construction), in [0, 1]. T_f is:

  - for a target that translates, AlignedTransErr_f, the one departure from CamI2V: the target's centres are
    normalised as above, the estimate's are scaled by the least-squares factor s* = max(0, sum c_est . c_gt /
    sum |c_est|^2) that best fits them to the target's (the scale alignment of the RL papers that align with
    Umeyama), and the error is capped at 2. CamI2V divides an estimate by its own largest distance, which a barely
    moving estimate's noisiest frame decides: a generated video that hardly moves would turn its jitter into
    unit-length, random-direction errors, and the reward into noise. The least-squares fit bounds the error by
    the target's own motion instead (an estimate that does not move, or moves the opposite way, scores as if it
    stood still);
  - for a target that does not translate, min(2, trans_scale * parallax / static_parallax): the estimate's
    `parallax` (rewards.pose.PoseEstimate: how far scene points shift beyond what the frames' rotations explain,
    in units of the focal length, about the translation over the scene's depth) is scale-free where the
    estimated translation is not, so a video that wanders when asked to stand still (or only to turn) scores
    below one that does not. static_parallax is the parallax that costs as much as a TransErr of trans_scale.
    Reported as static_target_parallax (NaN for a target that translates, so its mean is over still targets).

Scoring cannot be gamed by failing. A term that could not be measured takes its worst attainable value: a frame
the estimator could not place scores as RotErr 180 deg and TransErr 2, a translation the estimator could not
recover (a rotation-only solve of a camera that did move) scores TransErr 2, and so does a parallax it could not
measure against a target that stands still. No recovered camera, however wrong, scores below that, so a video
whose camera cannot be recovered never beats a wrong camera. It is not silently 0 either: every such frame is
counted by reason (details "fail_reason") and the video's frames_ok and placed_fraction say how many were
measured.

An estimator that did not answer at all (a served estimator down after its retries, an SfM worker that crashed or
timed out) did not judge the video: the score and the errors are NaN with details failed / failure_reason, so the
reward runner retries and then excludes the sample; a whole batch without an answer stops the run
(RewardServerDown).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from rewards import Reward, register_reward
from rewards.pose import NOT_SENT, PoseEstimate, build_estimator, close_estimator, known_estimators, to_uint8_frames

WORST_ROT_DEG = 180.0
WORST_TRANS = 2.0  # two points within the unit ball are at most 2 apart
WORST_ROT_FROBENIUS = 2.0 * math.sqrt(2.0)  # ||A - B||_F^2 = 6 - 2 tr(A^T B) and tr(A^T B) >= -1 for rotations

# How trajectory_errors judged the translation: against the target's centres, not at all because the estimate has
# none, by the estimate's parallax because the target stands still, or not at all because that was not measured.
SCORED, UNKNOWN, PARALLAX, PARALLAX_UNKNOWN = "scored", "unknown", "parallax", "parallax_unknown"


@dataclass
class CamScoreSettings:
    """reward.cam (config/base.py comments each field)."""

    estimator: str = "landmarks"
    max_frames: int = 16
    rot_scale_deg: float = 10.0
    trans_scale: float = 0.25
    min_target_translation: float = 0.05
    static_parallax: float = 0.02

    def __post_init__(self):
        checks = {"max_frames": self.max_frames >= 2, "rot_scale_deg": self.rot_scale_deg > 0,
                  "trans_scale": self.trans_scale > 0, "min_target_translation": self.min_target_translation >= 0,
                  "static_parallax": self.static_parallax > 0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"reward.cam.{name}={getattr(self, name)!r} is out of range")

    @classmethod
    def from_config(cls, section) -> CamScoreSettings:
        if section is None:
            return cls()
        return cls(**{k: section[k] for k in ("estimator", "max_frames", "rot_scale_deg", "trans_scale",
                                              "min_target_translation", "static_parallax") if k in section})


def to_uint8_frames_torch(frames: torch.Tensor) -> torch.Tensor:
    """rewards.pose.to_uint8_frames in torch on the frames' device, bit for bit: frames float32 in [0, 1] (NaN-free)
    -> uint8, rounding. Every step is one correctly rounded float32 operation (a clamp, a multiply by 255, an
    add of one half) followed by truncation, as numpy does it, so no device can round a level differently."""
    if frames.dtype != torch.float32:
        raise ValueError(f"frames must be float32 (what cam_score quantises), got {frames.dtype}")
    return (frames.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# errors (pure)


def frame_indices(num_frames: int, max_frames: int) -> np.ndarray:
    """At most max_frames evenly spaced frame indices, the first and the last included."""
    return np.unique(np.linspace(0, num_frames - 1, min(num_frames, max_frames)).round().astype(int))


def relative_centres(poses: np.ndarray, ref: int) -> tuple[np.ndarray, np.ndarray]:
    """World-to-camera poses (F, 3, 4) -> rotations relative to frame `ref` (F, 3, 3) and camera centres in the
    reference camera's frame (F, 3), unscaled."""
    R, t = poses[:, :, :3], poses[:, :, 3]
    R_rel = R @ R[ref].T
    t_rel = t - np.einsum("fij,j->fi", R_rel, t[ref])
    return R_rel, -np.einsum("fji,fj->fi", R_rel, t_rel)  # centres = -R_rel^T t_rel


def relative_trajectory(poses: np.ndarray, ref: int, over: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray, float]:
    """World-to-camera poses (F, 3, 4) -> rotations relative to frame `ref` (F, 3, 3), camera centres in the
    reference camera's frame divided by their largest norm over the frames `over` (F,) bool, default all (F, 3),
    and that norm (the trajectory's scale). Both trajectories of a comparison take their scale over the same
    frames, so an estimate missing the last frames is not stretched against a target that has them."""
    R_rel, centres = relative_centres(poses, ref)
    norms = np.linalg.norm(centres, axis=1)
    scale = float(np.nanmax(norms if over is None else norms[over]))
    return R_rel, (centres / scale if scale > 1e-9 else np.zeros_like(centres)), scale


def geodesic_deg(R_est: np.ndarray, R_gt: np.ndarray) -> np.ndarray:
    """(F,) angles in degrees between (F, 3, 3) rotations."""
    cos = (np.einsum("fij,fij->f", R_est, R_gt) - 1.0) / 2.0  # tr(R_est^T R_gt)
    return np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))


def trajectory_errors(est: PoseEstimate, gt: np.ndarray, min_target_translation: float) -> dict:
    """Per-frame errors of an estimate against ground-truth world-to-camera poses gt (F, 3, 4).

    Returns rot, trans (CamI2V's), trans_aligned (the score's, module docstring), cammc (F,) (NaN where not
    measured), ref (the reference frame, -1 when no frame was placed), translation (SCORED | UNKNOWN: the estimate
    has none | PARALLAX: the target does not translate, the estimate's parallax judges the video | PARALLAX_UNKNOWN:
    the target does not translate and the parallax was not measured), target_scale (the target's largest centre
    distance) and parallax (the estimate's)."""
    F = gt.shape[0]
    nan = np.full(F, np.nan)
    placed = np.flatnonzero(est.ok)
    _, c_gt_all, target_scale = relative_trajectory(gt, 0)
    if target_scale < min_target_translation:
        translation = PARALLAX if math.isfinite(est.parallax) else PARALLAX_UNKNOWN
    else:
        translation = SCORED if est.has_translation else UNKNOWN
    common = {"translation": translation, "target_scale": target_scale, "parallax": float(est.parallax)}
    if len(placed) == 0:
        return {"rot": nan, "trans": nan.copy(), "trans_aligned": nan.copy(), "cammc": nan.copy(), "ref": -1,
                **common}
    ref = int(placed[0])
    R_gt, c_gt, _ = relative_trajectory(gt, ref, est.ok)
    placed_poses = np.where(est.ok[:, None, None], est.poses, est.poses[ref])
    R_est, c_est, _ = relative_trajectory(placed_poses, ref, est.ok)
    rot = np.where(est.ok, geodesic_deg(R_est, R_gt), np.nan)
    trans = np.where(est.ok, np.linalg.norm(c_est - c_gt, axis=1), np.nan) if translation == SCORED else nan
    aligned = nan.copy()
    if translation == SCORED:
        raw = relative_centres(placed_poses, ref)[1]
        denom = float((raw[est.ok] ** 2).sum())
        s = max(0.0, float((raw[est.ok] * c_gt[est.ok]).sum()) / denom) if denom > 1e-12 else 0.0
        aligned = np.where(est.ok, np.minimum(np.linalg.norm(s * raw - c_gt, axis=1), WORST_TRANS), np.nan)
    # CamI2V's CamMC compares relative camera-to-world poses: rotation R_rel^T, translation column the centre.
    dc = c_est - c_gt if translation == SCORED else np.zeros_like(c_gt)  # otherwise only rotations compare
    diff = np.concatenate([np.swapaxes(R_est - R_gt, 1, 2), dc[:, :, None]], axis=2)
    cammc = np.where(est.ok, np.linalg.norm(diff.reshape(F, -1), axis=1), np.nan)
    return {"rot": rot, "trans": trans, "trans_aligned": aligned, "cammc": cammc, "ref": ref, **common}


def counted_errors(err: dict, ok: np.ndarray) -> dict[str, np.ndarray]:
    """(F,) RotErr, TransErr, CamMC per frame as the sums count them (module docstring): measured where measured,
    the worst value where a frame was not placed or its translation not recovered, TransErr NaN on every frame for
    a target that does not translate (CamI2V's normalisation is undefined there)."""
    F = len(ok)
    not_ref = np.arange(F) != err["ref"]
    rot = np.where(ok, err["rot"], WORST_ROT_DEG)
    if err["translation"] == SCORED:
        trans = np.where(ok, err["trans"], WORST_TRANS)
        cammc = np.where(ok, err["cammc"], math.hypot(WORST_ROT_FROBENIUS, WORST_TRANS))
    elif err["translation"] == UNKNOWN:  # the reference is the origin of both trajectories: its centre is known
        trans = np.where(ok & ~not_ref, 0.0, WORST_TRANS)
        cammc = np.where(ok, np.hypot(err["cammc"], np.where(not_ref, WORST_TRANS, 0.0)),
                         math.hypot(WORST_ROT_FROBENIUS, WORST_TRANS))
    else:
        trans = np.full(F, np.nan)
        cammc = np.where(ok, err["cammc"], WORST_ROT_FROBENIUS)
    return {"rot": rot, "trans": trans, "cammc": cammc}


def error_summary(err: dict, ok: np.ndarray, scored: np.ndarray) -> dict[str, float]:
    """A video's CamI2V sums over its scored frames, means over its placed frames and placed fraction (module
    docstring). ok, scored (F,) bool; frames not scored count in nothing."""
    counted = counted_errors(err, ok)
    placed = ok & scored
    out = {}
    for name, key in (("rot_err", "rot"), ("trans_err", "trans"), ("cammc", "cammc")):
        out[f"{name}_sum"] = float(counted[key][scored].sum())
        measured = err[key][placed]
        measured = measured[np.isfinite(measured)]
        out[f"{name}_placed_mean"] = float(measured.mean()) if measured.size else math.nan
    out["placed_fraction"] = float(placed.sum() / scored.sum()) if scored.any() else math.nan
    return out


def frame_scores(err: dict, ok: np.ndarray, rot_scale_deg: float, trans_scale: float,
                 static_parallax: float = CamScoreSettings.static_parallax) -> np.ndarray:
    """(F,) per-frame scores, with the worst value for every term that was not measured (module docstring)."""
    rot = np.where(ok, err["rot"], WORST_ROT_DEG)
    if err["translation"] == PARALLAX:
        wander = min(WORST_TRANS, trans_scale * err["parallax"] / static_parallax)
        trans = np.where(ok, wander, WORST_TRANS)
    elif err["translation"] in (UNKNOWN, PARALLAX_UNKNOWN):
        trans = np.full_like(rot, WORST_TRANS)
    else:
        trans = np.where(ok, err["trans_aligned"], WORST_TRANS)
    return np.exp(-rot / rot_scale_deg) * np.exp(-trans / trans_scale)


def video_score(scores: np.ndarray, ref: int, scored: np.ndarray) -> float:
    """Mean over the scored frames (not NOT_SENT) other than the reference (all of them when nothing was placed)."""
    keep = scored.copy()
    if ref >= 0 and keep.sum() > 1:
        keep[ref] = False
    return float(scores[keep].mean())


# ----------------------------------------------------------------------------------------------------------------
# the reward


# error_summary's keys, in the order summaries list them
SUMMARY_KEYS = ("rot_err_sum", "trans_err_sum", "cammc_sum", "rot_err_placed_mean", "trans_err_placed_mean",
                "cammc_placed_mean", "placed_fraction")


class CamScore:
    """The cam_score reward: an estimator (built from reward.cam) and the scoring above."""

    def __init__(self, settings: CamScoreSettings, cam_config=None):
        self.settings = settings
        self.estimator = build_estimator(settings.estimator, cam_config)

    @property
    def server(self) -> str | None:
        """The served estimator's URL; None for an estimator that runs in process."""
        config = getattr(self.estimator, "config", None)
        return getattr(config, "api_root", None)

    def describe(self) -> str:
        inner = self.estimator.describe() if hasattr(self.estimator, "describe") else self.settings.estimator
        return f"{inner}; up to {self.settings.max_frames} frames per video"

    def close(self) -> None:
        close_estimator(self.estimator)

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
        """videos (B, 3, F, H, W) in [-1, 1] -> scores (B,) in [0, 1] (NaN: not judged) and details."""
        s = self.settings
        B, F = videos.shape[0], videos.shape[2]
        idx = frame_indices(F, s.max_frames)
        searches_on = getattr(self.estimator, "searches_on", None)  # the landmark estimator, on an accelerator
        if searches_on is not None and searches_on(videos.device):
            estimated = self._estimate_where_they_are(videos, idx, conditions)
        else:
            estimated = self._estimate_on_host(videos, idx, conditions)
        estimates: list[PoseEstimate] = [PoseEstimate.failed(len(idx), "non_finite_pixels", s.estimator)] * B
        for b, e in estimated.items():
            estimates[b] = e
        return self.score(estimates, [conditions[b].target_cams.double().numpy()[idx] for b in range(B)])

    def _estimate_on_host(self, videos: torch.Tensor, idx: np.ndarray, conditions: list) -> dict[int, PoseEstimate]:
        """Estimates of the videos whose frames `idx` are all finite, by index: frames quantised on the host and
        handed to the estimator one video at a time."""
        frames = ((videos.detach().float().cpu()[:, :, idx].permute(0, 2, 3, 4, 1) + 1.0) / 2.0).numpy()
        todo = np.flatnonzero(np.isfinite(frames).reshape(len(frames), -1).all(1)).tolist()
        return dict(zip(todo, self.estimator.estimate([to_uint8_frames(frames[b]) for b in todo],
                                                      [conditions[b].intrinsics.double().numpy() for b in todo],
                                                      [conditions[b] for b in todo]), strict=True))

    def _estimate_where_they_are(self, videos: torch.Tensor, idx: np.ndarray, conditions: list
                                 ) -> dict[int, PoseEstimate]:
        """_estimate_on_host's estimates, the frames quantised (to_uint8_frames_torch) and handed over as one
        tensor on the videos' device (the estimator's estimate_device_frames): the batch never crosses to the
        host."""
        frames = (videos.detach()[:, :, torch.as_tensor(idx, device=videos.device)].float()
                  .permute(0, 2, 3, 4, 1) + 1.0) / 2.0
        finite = torch.isfinite(frames).flatten(1).all(1)
        todo = torch.nonzero(finite)[:, 0].tolist()
        if len(todo) < len(frames):
            frames = frames[finite]
        return dict(zip(todo, self.estimator.estimate_device_frames(
            to_uint8_frames_torch(frames), [conditions[b].intrinsics.double().numpy() for b in todo],
            [conditions[b] for b in todo]), strict=True))

    def score(self, estimates: list[PoseEstimate], targets: list[np.ndarray]) -> tuple[torch.Tensor, dict]:
        """Scores and details of estimates against target trajectories (F, 3, 4) of the same frames."""
        s = self.settings
        rows, reasons = [], Counter()
        for est, gt in zip(estimates, targets, strict=True):
            reasons.update(r for r in est.reasons if r and r != NOT_SENT)
            scored = np.array([r != NOT_SENT for r in est.reasons])
            err = trajectory_errors(est, gt, s.min_target_translation)
            per_frame = frame_scores(err, est.ok, s.rot_scale_deg, s.trans_scale, s.static_parallax)
            summary = error_summary(err, est.ok, scored)
            if est.unavailable:  # not judged: no error of it may enter a mean
                summary = dict.fromkeys(summary, math.nan)
            static = err["translation"] in (PARALLAX, PARALLAX_UNKNOWN)
            rows.append({
                "score": math.nan if est.unavailable else video_score(per_frame, err["ref"], scored),
                **summary,
                "frames_ok": int(est.ok.sum()), "failed_frames": int((~est.ok).sum()),
                "rotation_only": float(est.method.endswith("rotation_only")),
                "translation_scored": float(err["translation"] == SCORED),
                "static_target_parallax": float(est.parallax) if static and not est.unavailable else math.nan,
                "seconds": float(est.seconds.get("total", sum(est.seconds.values()))),
                "method": est.method, "failure_reason": est.video_reason if est.unavailable else None,
                "translation": err["translation"],
                "rot_err_per_frame": [None if not np.isfinite(x) else round(float(x), 4) for x in err["rot"]],
                "trans_err_per_frame": [None if not np.isfinite(x) else round(float(x), 4) for x in err["trans"]],
                "confidence": {k: float(v) for k, v in est.confidence.items()},
                "stage_seconds": {k: float(v) for k, v in est.seconds.items()},
            })
        details = {k: torch.tensor([r[k] for r in rows], dtype=torch.float32)
                   for k in (*SUMMARY_KEYS, "frames_ok", "failed_frames", "rotation_only", "translation_scored",
                             "static_target_parallax", "seconds")}
        for stage in sorted({k for r in rows for k in r["stage_seconds"]} - {"total"}):
            details[f"seconds_{stage}"] = torch.tensor([r["stage_seconds"].get(stage, math.nan) for r in rows],
                                                       dtype=torch.float32)
        details["failed"] = torch.tensor([est.unavailable for est in estimates], dtype=torch.bool)
        for key in ("method", "failure_reason", "translation", "rot_err_per_frame", "trans_err_per_frame",
                    "confidence"):
            details[key] = [r[key] for r in rows]
        details["fail_reason"] = dict(reasons)
        return torch.tensor([r["score"] for r in rows], dtype=torch.float32), details


def check_settings(checks) -> None:
    """The ranges of reward.cam, its estimators' sections included (recam/infra/config_checks.py's FieldChecks)."""
    checks.choice("reward.cam.estimator", tuple(known_estimators()))
    checks.choice("reward.cam.pnp", ("torch", "opencv"))
    checks.integer("reward.cam.max_frames", 2)
    checks.number("reward.cam.rot_scale_deg", 0, None, low_open=True)
    checks.number("reward.cam.trans_scale", 0, None, low_open=True)
    checks.number("reward.cam.min_target_translation", 0, None)
    checks.number("reward.cam.static_parallax", 0, None, low_open=True,
                  why="parallax, in focal lengths, that costs a still target's frame e^-1")
    for field in ("workers", "threads_per_worker"):
        checks.integer(f"reward.cam.sfm.{field}", 1)
    checks.integer("reward.cam.sfm.min_points3d", 0)
    checks.integer("reward.cam.sfm.max_features", 64)
    checks.number("reward.cam.sfm.min_registered_fraction", 0, 1, low_open=True)
    for field in ("timeout_s", "max_disagreement_deg", "max_reproj_px", "parallax_px"):
        checks.number(f"reward.cam.sfm.{field}", 0, None, low_open=True)
    checks.url("reward.cam.served.base_url")
    checks.integer("reward.cam.served.max_concurrency", 1)
    checks.integer("reward.cam.served.max_frames", 2)
    checks.integer("reward.cam.served.max_retries", 0)
    checks.number("reward.cam.served.timeout_s", 0, None, low_open=True)
    checks.number("reward.cam.served.backoff_s", 0, None)
    checks.choice("reward.cam.served.image_format", ("png", "jpeg"))
    checks.boolean("reward.cam.served.check_health")


@register_reward("cam_score", scores="video", check=check_settings)
def build_cam_score(config=None, device=None) -> Reward:
    """config None (or without reward.cam): landmark PnP with the default scoring."""
    section = None
    if config is not None and "reward" in config and "cam" in config.reward:
        section = config.reward.cam
    return CamScore(CamScoreSettings.from_config(section), section)


# The default reward (landmark PnP, default scoring): it holds no resource, so scripts and tests may share it.
cam_score = CamScore(CamScoreSettings())
