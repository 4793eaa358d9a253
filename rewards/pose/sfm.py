"""Structure-from-motion camera poses with pycolmap (CamI2V's protocol: global SfM with known intrinsics).

Per video, in a worker process of its own:

  1. the frames are written as PNGs and SIFT features extracted, with one PINHOLE camera fixed to the condition's
     intrinsics (COLMAP puts pixel centres at +0.5, so cx, cy are shifted by half a pixel);
  2. every pair of frames is matched (exhaustive matching: sequential matching on a short clip loses the long
     baselines that pin the trajectory, and failed silently with clean-looking reprojection errors);
  3. a rotation-only solve (rotation averaging alone on the matches; a fraction of a second for 16 frames), which
     registers frames where a full solve cannot: pure rotation (pan, tilt, roll) and static cameras give no
     baseline to triangulate from, and the full solve then registers few frames or flips them;
  4. the parallax test: how far the matched keypoints of each verified pair land from where the rotation-only
     solve's infinite homography K R_j R_i^T K^-1 sends them. A camera that only rotated explains its matches to
     within a pixel or two; any translation (relative to the scene's depth) leaves parallax. The mean over pairs
     of each pair's median residual, in units of the focal length, is the estimate's `parallax`: what cam_score
     holds against a target that does not translate, since SfM's translations have no scale to compare;
  5. with parallax, the full global solve (GLOMAP: rotation averaging, global positioning, bundle adjustment),
     focal length and principal point held fixed. Without parallax it is skipped: it would not be used.

Which solve is kept (`combine`, a pure function of the worker's numbers):

  - the full solve when the matches show parallax and it registered at least `min_registered_fraction` of the
    frames, triangulated at least `min_points3d` points with a mean reprojection error of at most `max_reproj_px`,
    and its relative rotations are within `max_disagreement_deg` of the rotation-only solve's. That last bound is
    loose (30 deg) on purpose: it catches flipped frames, but with forward motion at low resolution (dolly, zoom
    at 168 px) the rotation-only solve is the worse one, off by 8 to 19 deg from a full solve that fits 440
    points to 0.4 px, so the full solve wins a moderate disagreement;
  - otherwise, with no parallax: the rotation-only solve's rotations with zero translation ("sfm_rotation_only"):
    the camera demonstrably stayed in place, which is a measurement (a target that translates then scores a
    large TransErr), not a gap;
  - otherwise, with parallax but no usable full solve: the rotation-only rotations with the translation unknown
    (has_translation False); cam_score gives an unknown term its worst value, so failing the full solve never
    pays;
  - otherwise no frame is estimated (reason per frame, e.g. "not_registered", "too_few_features").

A worker that crashes or runs past `timeout_s` gives an `unavailable` estimate: the video was not judged, so
cam_score makes it NaN (excluded and retried by the reward runner) rather than scoring it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

import cv2
import numpy as np

from rewards.pose.estimator import PoseEstimate, register_estimator
from rewards.pose.sfm_solve import from_json

_SOLVER = Path(__file__).with_name("sfm_solve.py")
MIN_FEATURES = 30  # mean SIFT features per frame below which a failure is put down to the frames, not the geometry


@dataclass
class SfMSettings:
    """reward.cam.sfm (config/base.py comments each field)."""

    workers: int = 2
    timeout_s: float = 120.0
    threads_per_worker: int = 1
    min_registered_fraction: float = 0.75
    min_points3d: int = 50
    max_disagreement_deg: float = 30.0
    max_reproj_px: float = 2.0
    parallax_px: float = 1.5
    max_features: int = 4096

    def __post_init__(self):
        checks = {"workers": self.workers >= 1, "timeout_s": self.timeout_s > 0,
                  "threads_per_worker": self.threads_per_worker >= 1,
                  "min_registered_fraction": 0 < self.min_registered_fraction <= 1,
                  "min_points3d": self.min_points3d >= 0, "max_disagreement_deg": self.max_disagreement_deg > 0,
                  "max_reproj_px": self.max_reproj_px > 0,
                  "parallax_px": self.parallax_px > 0, "max_features": self.max_features >= 64}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"reward.cam.sfm.{name}={getattr(self, name)!r} is out of range")

    @classmethod
    def from_config(cls, section) -> SfMSettings:
        if section is None:
            return cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section.keys()) - known)
        if unknown:
            raise ValueError(f"reward.cam.sfm has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**{k: section[k] for k in section.keys()})


# ----------------------------------------------------------------------------------------------------------------
# which solve to keep (pure)


def _geodesic_deg(R1: np.ndarray, R2: np.ndarray) -> float:
    cos = (np.trace(R1.T @ R2) - 1.0) / 2.0
    return math.degrees(math.acos(float(np.clip(cos, -1.0, 1.0))))


def rotation_disagreement_deg(full: dict[int, np.ndarray], rotation: dict[int, np.ndarray]) -> float:
    """Mean geodesic angle between the two solves' rotations relative to their first common frame (each solve has
    its own world frame); NaN with fewer than two common frames."""
    common = sorted(set(full) & set(rotation))
    if len(common) < 2:
        return math.nan
    ref = common[0]
    angles = [_geodesic_deg(full[f][:, :3] @ full[ref][:, :3].T, rotation[f] @ rotation[ref].T) for f in common[1:]]
    return float(np.mean(angles))


def combine(result: dict, num_frames: int, settings: SfMSettings) -> PoseEstimate:
    """The PoseEstimate a worker's `solve` result gives (see the module docstring for the rule)."""
    full, rotation = result["full"], result["rotation"]
    need = math.ceil(settings.min_registered_fraction * num_frames)
    disagreement = rotation_disagreement_deg(full, rotation)
    residual = result["residual_px"]
    parallax = not (residual <= settings.parallax_px)  # NaN (nothing to measure it on) counts as parallax
    confidence = {"features": result["features"], "verified_pairs": float(result["pairs"]),
                  "registered_full": float(len(full)), "registered_rotation": float(len(rotation)),
                  "points3d": float(result["points3d"]), "reproj_px": result["reproj_px"],
                  "rotation_residual_px": residual, "disagreement_deg": disagreement,
                  "parallax": result.get("parallax", math.nan)}
    seconds = dict(result["seconds"])
    full_ok = (len(full) >= need and result["points3d"] >= settings.min_points3d
               and result["reproj_px"] <= settings.max_reproj_px
               and (disagreement <= settings.max_disagreement_deg or not rotation))

    poses, ok = np.full((num_frames, 3, 4), np.nan), np.zeros(num_frames, bool)
    if full_ok and parallax:
        for f, P in full.items():
            poses[f], ok[f] = P, True
        method, has_translation = "sfm", True
    else:
        rotations = rotation if len(rotation) >= need else {f: P[:, :3] for f, P in full.items()}
        if len(rotations) < need:
            reason = "too_few_features" if result["features"] < MIN_FEATURES else "not_registered"
            return PoseEstimate.failed(num_frames, reason, "sfm", seconds=seconds, confidence=confidence)
        for f, R in rotations.items():
            poses[f, :, :3], poses[f, :, 3], ok[f] = R, 0.0, True
        method, has_translation = "sfm_rotation_only", not parallax
    reasons = [None if ok[f] else "not_registered" for f in range(num_frames)]
    return PoseEstimate(poses=poses, ok=ok, reasons=reasons, method=method, has_translation=has_translation,
                        confidence=confidence, seconds=seconds, parallax=result.get("parallax", math.nan))


# ----------------------------------------------------------------------------------------------------------------
# worker processes


class SfMEstimator:
    """Runs rewards/pose/sfm_solve.py on each video as its own process, at most `workers` at a time, each killed
    past `timeout_s`. The frames are written as PNGs by this process (COLMAP reads images from disk)."""

    name = "sfm"

    def __init__(self, settings: SfMSettings):
        try:
            import pycolmap  # noqa: F401
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError("reward.cam.estimator='sfm' needs pycolmap: pip install pycolmap") from e
        self.settings = settings

    def describe(self) -> str:
        s = self.settings
        return (f"pycolmap SfM (SIFT, exhaustive matching, global mapping, rotation-only fallback), "
                f"{s.workers} worker process(es), timeout {s.timeout_s:g} s")

    def _start(self, frames: np.ndarray, K: np.ndarray, tmp: Path):
        images = tmp / "images"
        images.mkdir(parents=True)
        for f, frame in enumerate(frames):  # PNG, fast compression: lossless, and JPEG blocks would add features
            cv2.imwrite(str(images / f"{f:05d}.png"), cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR),
                        [cv2.IMWRITE_PNG_COMPRESSION, 1])
        job = {"K": np.asarray(K, np.float64).tolist(), "threads": self.settings.threads_per_worker,
               "max_features": self.settings.max_features, "parallax_px": self.settings.parallax_px}
        (tmp / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.settings.threads_per_worker)}
        return subprocess.Popen([sys.executable, str(_SOLVER), str(tmp)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env)

    def estimate(self, videos, intrinsics, conditions=None) -> list[PoseEstimate]:
        pending = list(enumerate(zip(videos, intrinsics, strict=True)))
        out: list[PoseEstimate | None] = [None] * len(pending)
        running: dict[int, tuple] = {}  # job index -> (process, workdir, start time, write seconds)
        with tempfile.TemporaryDirectory(prefix="recam_sfm_") as root:
            try:
                while pending or running:
                    while pending and len(running) < self.settings.workers:
                        i, (frames, K) = pending.pop(0)
                        t = time.perf_counter()
                        proc = self._start(frames, K, Path(root) / str(i))
                        running[i] = (proc, Path(root) / str(i), t, time.perf_counter() - t)
                    time.sleep(0.02)
                    for i, (proc, workdir, start, write_s) in list(running.items()):
                        elapsed = time.perf_counter() - start
                        if proc.poll() is None and elapsed < self.settings.timeout_s:
                            continue
                        del running[i]
                        out[i] = self._finish(proc, workdir, len(videos[i]), elapsed, write_s)
            finally:
                for proc, *_ in running.values():  # interrupted: no orphan keeps computing
                    proc.kill()
                    proc.wait()
        return out

    def _finish(self, proc, workdir: Path, num_frames: int, elapsed: float, write_s: float) -> PoseEstimate:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
            return PoseEstimate.failed(num_frames, f"sfm_timeout: over {self.settings.timeout_s:g} s", "sfm",
                                       unavailable=True, seconds={"total": elapsed})
        stderr = proc.communicate()[1].decode(errors="replace").strip()
        result_path = workdir / "result.json"
        if proc.returncode != 0 or not result_path.is_file():
            last = stderr.splitlines()[-1] if stderr else "no output"
            return PoseEstimate.failed(num_frames, f"sfm_worker_error: exit {proc.returncode}: {last[:200]}", "sfm",
                                       unavailable=True, seconds={"total": elapsed})
        estimate = combine(from_json(json.loads(result_path.read_text())), num_frames, self.settings)
        estimate.seconds.update(write=write_s, total=elapsed)
        return estimate


@register_estimator("sfm")
def build_sfm(cam_config=None) -> SfMEstimator:
    section = None if cam_config is None else cam_config.get("sfm")
    return SfMEstimator(SfMSettings.from_config(section))

