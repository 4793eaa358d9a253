"""One video's structure-from-motion, run as its own process by rewards/pose/sfm.py (the module docstring there says
what is solved and why).

Standalone on purpose: it imports numpy and pycolmap only (not torch, not the package), so a worker starts in a
fraction of a second, and a worker that hangs or crashes in native code is killed without touching the trainer.

    python sfm_solve.py WORKDIR      # reads WORKDIR/job.json and WORKDIR/images/*.png, writes WORKDIR/result.json

job.json: {"K": 3x3 list, "threads": int, "max_features": int, "parallax_px": float}. result.json: see `solve`;
frame poses as lists.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np


def _quiet_pycolmap():
    import pycolmap

    pycolmap.logging.minloglevel = 2  # errors only: a training log must not carry COLMAP's per-stage chatter
    pycolmap.logging.stderrthreshold = 2
    return pycolmap


def _poses(reconstructions) -> tuple[dict[int, np.ndarray], int, float]:
    """Frame index -> (3, 4) cam_from_world of the largest reconstruction, its 3D point count and mean reprojection
    error (px)."""
    if not reconstructions:
        return {}, 0, math.nan
    rec = max(reconstructions.values(), key=lambda r: r.num_reg_images())
    poses = {int(Path(im.name).stem): np.asarray(im.cam_from_world().matrix(), np.float64)
             for im in rec.images.values() if im.has_pose}
    err = rec.compute_mean_reprojection_error() if rec.num_points3D() else math.nan
    return poses, int(rec.num_points3D()), float(err)


def rotation_residuals(x1: np.ndarray, x2: np.ndarray, R1: np.ndarray, R2: np.ndarray, K: np.ndarray) -> np.ndarray:
    """(N, 2) pixel offsets of points x2 (N, 2) in a frame with world-to-camera rotation R2 from where the infinite
    homography K R2 R1^T K^-1 sends their matches x1 (N, 2) in a frame with rotation R1. A camera that only rotated
    leaves offsets of localisation noise; a camera that translated leaves parallax (translation over depth)."""
    H = K @ R2 @ R1.T @ np.linalg.inv(K)
    p = np.c_[x1, np.ones(len(x1))] @ H.T
    return x2 - p[:, :2] / p[:, 2:]


def parallax_of_pair(offsets: np.ndarray, K: np.ndarray, floor_px: float = 0.0) -> tuple[float, float]:
    """A pair's median rotation residual in pixels, and what of it exceeds floor_px (the matches' localisation
    noise, which is in pixels whatever the resolution) in units of the focal length: the angle by which rotation
    fails to explain the matches, about the sideways translation over the scene's depth, which does not change with
    the resolution the frames were seen at. offsets (N, 2) from rotation_residuals."""
    px = float(np.median(np.linalg.norm(offsets, axis=1)))
    return px, max(0.0, px - floor_px) / float(np.sqrt(K[0, 0] * K[1, 1]))


def _rotation_residual_px(db_path: Path, rotations: dict[int, np.ndarray], K: np.ndarray,
                          floor_px: float) -> tuple[float, float]:
    """Over the verified pairs of frames the rotations place: the median of the pairs' median rotation residual in
    pixels (the parallax test) and the mean of their parallax beyond floor_px in units of the focal length
    (parallax_of_pair; cam_score's measure of how far the camera wandered: a mean, so that a camera that stays put
    and then jumps is not outvoted by its still pairs). NaN, NaN when no pair has inlier matches."""
    import pycolmap

    db = pycolmap.Database.open(str(db_path))
    try:
        index = {im.image_id: int(Path(im.name).stem) for im in db.read_all_images()}
        keypoints = {iid: db.read_keypoints(iid)[:, :2] for iid in index}
        pairs, geometries = db.read_two_view_geometries()
        residuals, parallaxes = [], []
        for pair_id, geom in zip(pairs, geometries, strict=True):
            id1, id2 = pycolmap.pair_id_to_image_pair(pair_id)
            f1, f2 = index.get(id1), index.get(id2)
            matches = geom.inlier_matches
            if f1 not in rotations or f2 not in rotations or len(matches) < 8:
                continue
            offsets = rotation_residuals(keypoints[id1][matches[:, 0]], keypoints[id2][matches[:, 1]],
                                         rotations[f1], rotations[f2], K)
            px, rel = parallax_of_pair(offsets, K, floor_px)
            residuals.append(px)
            parallaxes.append(rel)
    finally:
        db.close()
    if not residuals:
        return math.nan, math.nan
    return float(np.median(residuals)), float(np.mean(parallaxes))


def solve(workdir: str | Path, K: np.ndarray, threads: int = 1, max_features: int = 4096,
          parallax_px: float = 1.5) -> dict:
    """Both solves on the frames in workdir/images (named by frame index), in this process. K (3, 3) in OpenCV's pixel
    convention.

    Returns plain data (it crosses a process boundary): "full" {frame: (3, 4)}, "rotation" {frame: (3, 3)},
    "points3d", "reproj_px", "residual_px" (the parallax test's pixels), "parallax" (the mean rotation residual
    beyond parallax_px, in units of the focal length: _rotation_residual_px), "features" (mean keypoints per
    frame), "pairs" (verified pairs), "seconds" per stage.
    """
    pycolmap = _quiet_pycolmap()
    workdir = Path(workdir)
    images, db_path = workdir / "images", workdir / "database.db"
    seconds = {}

    colmap_K = K.copy()
    colmap_K[:2, 2] += 0.5
    reader = pycolmap.ImageReaderOptions()
    reader.camera_model = "PINHOLE"
    reader.camera_params = ",".join(str(float(x)) for x in (colmap_K[0, 0], colmap_K[1, 1], colmap_K[0, 2],
                                                              colmap_K[1, 2]))
    extraction = pycolmap.FeatureExtractionOptions()
    extraction.num_threads = threads
    extraction.sift.max_num_features = max_features
    t = time.perf_counter()
    pycolmap.extract_features(db_path, images, camera_mode=pycolmap.CameraMode.SINGLE, reader_options=reader,
                              extraction_options=extraction, device=pycolmap.Device.cpu)
    seconds["extract"] = time.perf_counter() - t

    matching = pycolmap.FeatureMatchingOptions()
    matching.num_threads = threads
    t = time.perf_counter()
    verification = pycolmap.TwoViewGeometryOptions()
    verification.ransac.random_seed = 0  # COLMAP seeds RANSAC from the clock by default: one video, one score
    pycolmap.match_exhaustive(db_path, matching_options=matching, verification_options=verification,
                              device=pycolmap.Device.cpu)
    seconds["match"] = time.perf_counter() - t

    db = pycolmap.Database.open(str(db_path))
    features = float(np.mean([db.num_keypoints_for_image(im.image_id) for im in db.read_all_images()]))
    pairs = int(db.num_verified_image_pairs())
    db.close()

    def mapping_options(rotation_only: bool):
        opts = pycolmap.GlobalPipelineOptions()
        opts.num_threads, opts.random_seed = threads, 0
        mapper = opts.mapper
        mapper.num_threads, mapper.random_seed = threads, 0
        ba = mapper.bundle_adjustment
        ba.refine_focal_length = ba.refine_principal_point = ba.refine_extra_params = False
        if rotation_only:
            mapper.skip_global_positioning = mapper.skip_bundle_adjustment = mapper.skip_retriangulation = True
        # A clip's baselines are short (a pedestal move of a tenth of the scene depth, seen at 224 px, triangulates
        # at under a degree): GLOMAP's defaults for photo collections keep no point there and the solve fails.
        mapper.min_tri_angle_deg = 0.5
        mapper.max_angular_reproj_error_deg = 3.0
        mapper.max_normalized_reproj_error = 0.05
        return opts

    full, points3d, reproj = {}, 0, math.nan
    rotation: dict[int, np.ndarray] = {}
    residual = parallax = math.nan
    if pairs:
        t = time.perf_counter()
        (workdir / "rotation").mkdir(exist_ok=True)
        rot_poses, _, _ = _poses(pycolmap.global_mapping(db_path, images, workdir / "rotation", mapping_options(True)))
        rotation = {f: P[:, :3] for f, P in rot_poses.items() if np.isfinite(P[:, :3]).all()}
        seconds["rotation"] = time.perf_counter() - t
        t = time.perf_counter()
        # The parallax test's threshold is also the floor of the measured parallax: below it SfM calls the camera
        # still (sfm.combine), and noisy frames leave 1.5 px there on a camera that did not move (docs/results.md)
        residual, parallax = (_rotation_residual_px(db_path, rotation, colmap_K, parallax_px) if rotation
                              else (math.nan, math.nan))
        seconds["parallax"] = time.perf_counter() - t
        # A camera that only rotated has nothing to triangulate: the full solve would spend seconds to register
        # few frames or flip them, and its answer would not be used (sfm.combine).
        if not residual <= parallax_px:
            t = time.perf_counter()
            (workdir / "full").mkdir(exist_ok=True)
            full, points3d, reproj = _poses(pycolmap.global_mapping(db_path, images, workdir / "full",
                                                                    mapping_options(False)))
            seconds["map"] = time.perf_counter() - t
    return {"full": full, "rotation": rotation, "points3d": points3d, "reproj_px": reproj, "residual_px": residual,
            "parallax": parallax, "features": features, "pairs": pairs, "seconds": seconds}


def _to_json(result: dict) -> dict:
    out = dict(result)
    out["full"] = {str(f): P.tolist() for f, P in result["full"].items()}
    out["rotation"] = {str(f): R.tolist() for f, R in result["rotation"].items()}
    return out


def from_json(data: dict) -> dict:
    """result.json -> `solve`'s return value (frame keys as ints, poses as arrays; JSON null back to NaN)."""
    out = dict(data)
    out["full"] = {int(f): np.asarray(P, np.float64) for f, P in data["full"].items()}
    out["rotation"] = {int(f): np.asarray(R, np.float64) for f, R in data["rotation"].items()}
    for key in ("reproj_px", "residual_px", "parallax"):
        out[key] = math.nan if data.get(key) is None else float(data[key])
    return out


def main(workdir: str) -> None:
    workdir = Path(workdir)
    job = json.loads((workdir / "job.json").read_text())
    result = solve(workdir, np.asarray(job["K"], np.float64), int(job["threads"]), int(job["max_features"]),
                   float(job["parallax_px"]))
    for key in ("reproj_px", "residual_px", "parallax"):  # JSON has no NaN
        result[key] = None if not math.isfinite(result[key]) else result[key]
    (workdir / "result.json.tmp").write_text(json.dumps(_to_json(result)))
    (workdir / "result.json.tmp").rename(workdir / "result.json")


if __name__ == "__main__":
    main(sys.argv[1])
