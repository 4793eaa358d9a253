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


def _rotation_residual_px(db_path: Path, rotations: dict[int, np.ndarray], K: np.ndarray) -> float:
    """Median over verified pairs of the median distance (px) between matched keypoints and where the rotations'
    infinite homography sends them; NaN when no pair of registered frames has inlier matches."""
    import pycolmap

    db = pycolmap.Database.open(str(db_path))
    try:
        index = {im.image_id: int(Path(im.name).stem) for im in db.read_all_images()}
        keypoints = {iid: db.read_keypoints(iid)[:, :2] for iid in index}
        pairs, geometries = db.read_two_view_geometries()
        residuals = []
        K_inv = np.linalg.inv(K)
        for pair_id, geom in zip(pairs, geometries, strict=True):
            id1, id2 = pycolmap.pair_id_to_image_pair(pair_id)
            f1, f2 = index.get(id1), index.get(id2)
            matches = geom.inlier_matches
            if f1 not in rotations or f2 not in rotations or len(matches) < 8:
                continue
            H = K @ rotations[f2] @ rotations[f1].T @ K_inv
            x1 = np.c_[keypoints[id1][matches[:, 0]], np.ones(len(matches))]
            x2 = keypoints[id2][matches[:, 1]]
            p = x1 @ H.T
            residuals.append(float(np.median(np.linalg.norm(p[:, :2] / p[:, 2:] - x2, axis=1))))
    finally:
        db.close()
    return float(np.median(residuals)) if residuals else math.nan


def solve(workdir: str | Path, K: np.ndarray, threads: int = 1, max_features: int = 4096,
          parallax_px: float = 1.5) -> dict:
    """Both solves on the frames in workdir/images (named by frame index), in this process. K (3, 3) in OpenCV's pixel
    convention.

    Returns plain data (it crosses a process boundary): "full" {frame: (3, 4)}, "rotation" {frame: (3, 3)},
    "points3d", "reproj_px", "residual_px", "features" (mean keypoints per frame), "pairs" (verified pairs),
    "seconds" per stage.
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
    residual = math.nan
    if pairs:
        t = time.perf_counter()
        (workdir / "rotation").mkdir(exist_ok=True)
        rot_poses, _, _ = _poses(pycolmap.global_mapping(db_path, images, workdir / "rotation", mapping_options(True)))
        rotation = {f: P[:, :3] for f, P in rot_poses.items() if np.isfinite(P[:, :3]).all()}
        seconds["rotation"] = time.perf_counter() - t
        t = time.perf_counter()
        residual = _rotation_residual_px(db_path, rotation, colmap_K) if rotation else math.nan
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
            "features": features, "pairs": pairs, "seconds": seconds}


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
    for key in ("reproj_px", "residual_px"):
        out[key] = math.nan if data[key] is None else float(data[key])
    return out


def main(workdir: str) -> None:
    workdir = Path(workdir)
    job = json.loads((workdir / "job.json").read_text())
    result = solve(workdir, np.asarray(job["K"], np.float64), int(job["threads"]), int(job["max_features"]),
                   float(job["parallax_px"]))
    for key in ("reproj_px", "residual_px"):  # JSON has no NaN
        result[key] = None if not math.isfinite(result[key]) else result[key]
    (workdir / "result.json.tmp").write_text(json.dumps(_to_json(result)))
    (workdir / "result.json.tmp").rename(workdir / "result.json")


if __name__ == "__main__":
    main(sys.argv[1])
