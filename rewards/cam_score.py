"""cam_score: camera accuracy of a generated video, estimated without looking at the generator.

Per frame, each landmark of the condition's scene is found by its colour (a colour-closeness weighted
centroid), and the camera pose is solved from the 2D-3D correspondences with OpenCV's PnP (SQPnP, then
Levenberg-Marquardt refinement). The estimated trajectory is compared with the target trajectory:

- RotErr: geodesic angle acos((tr(R_est^T R_gt) - 1) / 2) in degrees, mean over frames;
- TransErr: distance between camera centres after scale alignment, divided by the scene depth (the
  distance from the first source camera to the scene centre), mean over frames. Only scale is aligned
  (s* = argmin sum ||s C_est - C_gt||^2, clamped to [0.5, 2]): the landmarks pin the world frame's
  orientation, and a Sim(3) rotation would let a mirrored trajectory (truck left instead of right) score
  as perfect, which is exactly the error this reward must see;
- CamMC: L2 norm of the difference of the 12 [R|t] values, mean over frames.

Score per frame: exp(-RotErr / ROT_SCALE_DEG) * exp(-TransErr / TRANS_SCALE); a frame whose pose cannot be
estimated (fewer than MIN_LANDMARKS landmarks found, PnP failure, non-finite pixels) scores 0 and is counted
with its reason. The sample's score is the mean over frames, in [0, 1]. The function never raises on a bad
video; errors are NaN where no frame could be estimated.
"""

from __future__ import annotations

import math
from collections import Counter

import cv2
import numpy as np
import torch

from rewards import Reward, register_reward

ROT_SCALE_DEG = 10.0  # a 10 degree rotation error costs a factor e
TRANS_SCALE = 0.1  # 10% of the scene depth costs a factor e
MIN_LANDMARKS = 4
COLOUR_RADIUS = 0.6  # RGB distance (in [0, 1] units) within which a pixel votes for a landmark colour
MIN_MASS = 0.3  # total vote weight a landmark needs to count as found
MAX_SPREAD_FRACTION = 0.1  # votes spread wider than this fraction of the frame are not one blob (noise, tint)


def find_landmarks(frame: np.ndarray, colors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sub-pixel image positions of coloured landmarks in one frame.

    frame (H, W, 3) in [0, 1]; colors (L, 3). Each pixel votes for the landmark colour it is nearest to, with
    weight (1 - d / COLOUR_RADIUS)^2 for RGB distance d; a blob's votes are symmetric about its centre, so
    the weighted centroid is an unbiased estimate of where the landmark projects.
    Returns uv (L, 2) (u = column, v = row; NaN where not found) and found (L,) bool.
    """
    h, w, _ = frame.shape
    d = np.linalg.norm(frame[:, :, None, :] - colors[None, None], axis=-1)  # (H, W, L)
    nearest = d.argmin(-1)
    weight = np.clip(1.0 - d / COLOUR_RADIUS, 0.0, None) ** 2
    weight *= nearest[..., None] == np.arange(len(colors))
    vv, uu = np.mgrid[0:h, 0:w]
    mass = weight.sum((0, 1))
    safe = np.where(mass > 0, mass, 1.0)
    u_c = (weight * uu[..., None]).sum((0, 1)) / safe
    v_c = (weight * vv[..., None]).sum((0, 1)) / safe
    spread = np.sqrt((weight * ((uu[..., None] - u_c) ** 2 + (vv[..., None] - v_c) ** 2)).sum((0, 1)) / safe)
    found = (mass >= MIN_MASS) & (spread <= MAX_SPREAD_FRACTION * max(h, w))
    uv = np.stack([u_c, v_c], -1)
    uv[~found] = np.nan
    return uv, found


def estimate_pose(uv: np.ndarray, found: np.ndarray, landmarks: np.ndarray, K: np.ndarray):
    """World-to-camera (3, 4) pose from found landmarks by PnP, or (None, reason)."""
    if found.sum() < MIN_LANDMARKS:
        return None, "too_few_landmarks"
    obj = landmarks[found].astype(np.float64)
    img = uv[found].astype(np.float64)
    ok, rvec, tvec = cv2.solvePnP(obj, img, K, None, flags=cv2.SOLVEPNP_SQPNP)
    if not ok:
        return None, "pnp_failed"
    rvec, tvec = cv2.solvePnPRefineLM(obj, img, K, None, rvec, tvec)
    R, _ = cv2.Rodrigues(rvec)
    pose = np.concatenate([R, tvec.reshape(3, 1)], 1)
    if not np.isfinite(pose).all() or ((obj @ R.T + tvec.reshape(1, 3))[:, 2] <= 0).any():
        return None, "pnp_failed"
    return pose, None


def rotation_error_deg(R_est: np.ndarray, R_gt: np.ndarray) -> float:
    cos = (np.trace(R_est.T @ R_gt) - 1.0) / 2.0
    return math.degrees(math.acos(float(np.clip(cos, -1.0, 1.0))))


def trajectory_errors(est: list, gt: np.ndarray, scene_depth: float) -> dict:
    """Per-frame errors of estimated poses (list of (3, 4) or None) against gt (F, 3, 4); None frames -> NaN."""
    F = gt.shape[0]
    ok = np.array([p is not None for p in est])
    rot, trans, cammc = np.full(F, np.nan), np.full(F, np.nan), np.full(F, np.nan)
    if not ok.any():
        return {"rot": rot, "trans": trans, "cammc": cammc, "scale": float("nan")}
    centre = lambda P: -P[:, :3].T @ P[:, 3]
    c_est = np.stack([centre(est[f]) for f in range(F) if ok[f]])
    c_gt = np.stack([centre(gt[f]) for f in range(F) if ok[f]])
    denom = float((c_est**2).sum())
    scale = float(np.clip((c_est * c_gt).sum() / denom, 0.5, 2.0)) if denom > 1e-8 else 1.0
    for n, f in enumerate(np.flatnonzero(ok)):
        rot[f] = rotation_error_deg(est[f][:, :3], gt[f][:, :3])
        trans[f] = np.linalg.norm(scale * c_est[n] - c_gt[n]) / scene_depth
        cammc[f] = np.linalg.norm(est[f] - gt[f])
    return {"rot": rot, "trans": trans, "cammc": cammc, "scale": scale}


def score_video(video: np.ndarray, cond) -> dict:
    """video (F, H, W, 3) in [0, 1]; cond a recam.domains.camera.world.Condition. Per-sample score and details."""
    landmarks = cond.landmarks.double().numpy()
    colors = cond.landmark_colors.double().numpy()
    K = cond.intrinsics.double().numpy()
    gt = cond.target_cams.double().numpy()
    est, reasons = [], Counter()
    if len(landmarks) < MIN_LANDMARKS:  # real footage: no known 3D landmarks, so no frame is estimable
        est = [None] * len(video)
        reasons["scene_has_too_few_landmarks"] = len(video)
        depth = float("nan")
    else:
        depth = float(np.linalg.norm(landmarks.mean(0)))
        for frame in video:
            if not np.isfinite(frame).all():
                est.append(None)
                reasons["non_finite_pixels"] += 1
                continue
            uv, found = find_landmarks(frame, colors)
            pose, reason = estimate_pose(uv, found, landmarks, K)
            est.append(pose)
            if reason:
                reasons[reason] += 1
    err = trajectory_errors(est, gt, depth)
    per_frame = np.exp(-err["rot"] / ROT_SCALE_DEG) * np.exp(-err["trans"] / TRANS_SCALE)
    per_frame = np.where(np.isfinite(per_frame), per_frame, 0.0)
    mean = lambda x: float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")
    return {"score": float(per_frame.mean()), "rot_err": mean(err["rot"]), "trans_err": mean(err["trans"]),
            "cammc": mean(err["cammc"]), "frames_ok": int(sum(p is not None for p in est)),
            "failed_frames": int(sum(p is None for p in est)), "fail_reasons": dict(reasons)}


def cam_score(videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
    """Camera accuracy in [0, 1] of videos (B, 3, F, H, W) in [-1, 1] against their conditions' target cameras."""
    frames = ((videos.detach().float().cpu().permute(0, 2, 3, 4, 1) + 1.0) / 2.0).numpy()  # (B, F, H, W, 3)
    rows = [score_video(frames[b], conditions[b]) for b in range(len(conditions))]
    reasons = Counter()
    for r in rows:
        reasons.update(r["fail_reasons"])
    details = {k: torch.tensor([r[k] for r in rows], dtype=torch.float32)
               for k in ("rot_err", "trans_err", "cammc", "frames_ok", "failed_frames")}
    details["fail_reason"] = dict(reasons)
    return torch.tensor([r["score"] for r in rows], dtype=torch.float32), details


@register_reward("cam_score")
def build_cam_score(config=None) -> Reward:
    """cam_score has nothing to configure or hold: the reward object is the pure function itself."""
    return cam_score
