"""Landmark PnP: camera poses in the synthetic world, from its coloured landmarks of known 3D position.

Per frame, each landmark of the condition's scene is found by its colour (a colour-closeness weighted centroid),
and the camera pose is solved from the 2D-3D correspondences with OpenCV's PnP (SQPnP, then Levenberg-Marquardt
refinement). The poses are in the scene's world frame, which is the first source camera's: the landmarks pin it,
so unlike SfM this estimator sees an absolute trajectory (a mirrored move is a mirrored estimate). Real footage has
no landmarks: every frame fails with reason "scene_has_too_few_landmarks".

The estimate's `parallax` is rewards.pose.centre_parallax of the PnP poses, with the scene's depth (the median
depth of its landmarks in the first placed frame) as the scale: the landmarks fix the poses' unit, so translation
relative to depth is measured directly, along the view axis too, where the landmarks' image shift at 32 px is
under a pixel.
"""

from __future__ import annotations

import math
import time

import cv2
import numpy as np

from rewards.pose import PoseEstimate, centre_parallax, register_estimator

MIN_LANDMARKS = 4
COLOUR_RADIUS = 0.6  # RGB distance (in [0, 1] units) within which a pixel votes for a landmark colour
MIN_MASS = 0.3  # total vote weight a landmark needs to count as found
MAX_SPREAD_FRACTION = 0.1  # votes spread wider than this fraction of the frame are not one blob (noise, tint)
# A blob with this share of its votes on the frame's outermost pixels is cut by the edge: its centroid sits inside
# the frame of where the landmark projects, which PnP turned into a translation that pans and tilts do not have
# (docs/results.md, "A camera asked to stand still").
MAX_BORDER_SHARE = 0.02


def find_landmarks(frame: np.ndarray, colors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sub-pixel image positions of coloured landmarks in one frame, or in each of a stack of frames.

    frame (..., H, W, 3) in [0, 1]; colors (L, 3). Each pixel votes for the landmark colour it is nearest to, with
    weight (1 - d / COLOUR_RADIUS)^2 for RGB distance d; a blob's votes are symmetric about its centre, so
    the weighted centroid is an unbiased estimate of where the landmark projects, unless the frame's edge cuts the
    blob (MAX_BORDER_SHARE): such a landmark is not found.
    Returns uv (..., L, 2) (u = column, v = row; NaN where not found) and found (..., L) bool. A video's frames go
    in as one stack: per frame, numpy's call overhead on 32 x 32 pixels was most of the reward's cost.
    """
    h, w = frame.shape[-3:-1]
    d = np.linalg.norm(frame[..., :, :, None, :] - colors, axis=-1)  # (..., H, W, L)
    weight = np.clip(1.0 - d / COLOUR_RADIUS, 0.0, None) ** 2
    weight *= d.argmin(-1)[..., None] == np.arange(len(colors))
    vv, uu = np.mgrid[0:h, 0:w]
    pixels = (-3, -2)
    mass = weight.sum(pixels)
    safe = np.where(mass > 0, mass, 1.0)
    u_c = (weight * uu[..., None]).sum(pixels) / safe
    v_c = (weight * vv[..., None]).sum(pixels) / safe
    du, dv = uu[..., None] - u_c[..., None, None, :], vv[..., None] - v_c[..., None, None, :]
    spread = np.sqrt((weight * (du**2 + dv**2)).sum(pixels) / safe)
    rows, cols = weight[..., [0, -1], :, :], weight[..., 1:-1, :, :][..., [0, -1], :]
    border = rows.sum(pixels) + cols.sum(pixels)
    found = (mass >= MIN_MASS) & (spread <= MAX_SPREAD_FRACTION * max(h, w)) & (border <= MAX_BORDER_SHARE * mass)
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


def estimate_video(frames: np.ndarray, K: np.ndarray, landmarks: np.ndarray, colors: np.ndarray) -> PoseEstimate:
    """frames (F, H, W, 3) uint8; landmarks (L, 3) world; colors (L, 3) in [0, 1]."""
    start = time.perf_counter()
    F = len(frames)
    poses, ok, reasons = np.full((F, 3, 4), np.nan), np.zeros(F, bool), []
    if len(landmarks) < MIN_LANDMARKS:  # real footage: no known 3D landmarks, so no frame is estimable
        return PoseEstimate.failed(F, "scene_has_too_few_landmarks", "landmarks")
    uvs, founds = find_landmarks(np.asarray(frames, np.float64) / 255.0, colors)
    found_counts = founds.sum(-1)
    for f, (uv, found) in enumerate(zip(uvs, founds, strict=True)):
        pose, reason = estimate_pose(uv, found, landmarks, K)
        reasons.append(reason)
        if pose is not None:
            poses[f], ok[f] = pose, True
    parallax = math.nan
    if ok.any():
        ref = poses[np.flatnonzero(ok)[0]]
        parallax = centre_parallax(poses, ok, float(np.median((landmarks @ ref[:, :3].T + ref[:, 3])[:, 2])))
    return PoseEstimate(poses=poses, ok=ok, reasons=reasons, method="landmarks",
                        video_reason=None if ok.any() else "no_frame_estimated",
                        confidence={"landmarks_found_mean": float(np.mean(found_counts)),
                                    "frames_ok": float(ok.sum()), "parallax": parallax},
                        seconds={"pnp": time.perf_counter() - start}, parallax=parallax)


class LandmarkEstimator:
    """PnP against each condition's landmarks (conditions need `landmarks` and `landmark_colors` tensors)."""

    name = "landmarks"

    def estimate(self, videos, intrinsics, conditions) -> list[PoseEstimate]:
        return [estimate_video(v, np.asarray(K, np.float64), c.landmarks.double().cpu().numpy(),
                               c.landmark_colors.double().cpu().numpy())
                for v, K, c in zip(videos, intrinsics, conditions, strict=True)]

    def describe(self) -> str:
        return "landmark PnP (synthetic world)"


@register_estimator("landmarks")
def build_landmarks(cam_config=None) -> LandmarkEstimator:
    return LandmarkEstimator()
