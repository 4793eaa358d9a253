"""Landmark PnP: camera poses in the synthetic world, from its coloured landmarks of known 3D position.

Per frame, each landmark of the condition's scene is found by its colour (a colour-closeness weighted centroid), and
the camera pose is solved from the 2D-3D correspondences: by default for every frame of a batch at once in torch,
where the landmarks were found (rewards/pose/pnp_torch.py: affine and DLT starts, Levenberg-Marquardt on the
reprojection error), or with reward.cam.pnp="opencv" frame by frame with OpenCV's PnP on the host (SQPnP, then
Levenberg-Marquardt refinement), the reference the torch solve is tested against. The poses are in the scene's world
frame, which is the first source camera's: the landmarks pin it, so unlike SfM this estimator sees an absolute
trajectory (a mirrored move is a mirrored estimate). Real footage has no landmarks: every frame fails with reason
"scene_has_too_few_landmarks".

The estimate's `parallax` is rewards.pose.centre_parallax of the PnP poses, with the scene's depth (the median depth
of its landmarks in the first placed frame) as the scale: the landmarks fix the poses' unit, so translation relative
to depth is measured directly, along the view axis too, where the landmarks' image shift at 32 px is under a pixel.

The search runs two ways: find_landmarks, numpy on one video's frames on the host (the reference), and
find_landmarks_torch, torch on a whole batch on the frames' device, which cam_score uses for videos on an
accelerator (LandmarkEstimator.estimate_device_frames): PnP then runs there too and only the poses cross to the host
(with reward.cam.pnp="opencv", the landmarks' positions cross and PnP runs on a pool of processes). On the frames
cam_score hands over, both give the same numbers to the bit, since PnP's refinement turns a last-bit change of a
centroid into a different pose, and so a different score (tests/test_cam_score.py compares both).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

import cv2
import numpy as np
import torch

from rewards.pose import pnp_torch
from rewards.pose.estimator import PoseEstimate, centre_parallax, landmark_parallax_batch, register_estimator

MIN_LANDMARKS = pnp_torch.MIN_LANDMARKS  # one rule for both solves
COLOUR_RADIUS = 0.6  # RGB distance (in [0, 1] units) within which a pixel votes for a landmark colour
MIN_MASS = 0.3  # total vote weight a landmark needs to count as found
MAX_SPREAD_FRACTION = 0.1  # votes spread wider than this fraction of the frame are not one blob (noise, tint)
# A blob with this share of its votes on the frame's outermost pixels is cut by the edge: its centroid sits inside
# the frame of where the landmark projects, which PnP turned into a translation that pans and tilts do not have
# (docs/results.md, "A camera asked to stand still").
MAX_BORDER_SHARE = 0.02
# find_landmarks_torch's default chunk holds about this many (pixel, video, frame, landmark) float64 values per
# temporary (128 MiB), so thousands of videos' search fits beside a sampler on the same accelerator.
CHUNK_ELEMENTS = 1 << 24


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


def find_landmarks_torch(frames: torch.Tensor, colors: Sequence[np.ndarray], chunk: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """find_landmarks over a batch of videos at once, on the frames' device, in float64.

    frames (B, F, H, W, 3) uint8 (rewards.pose.to_uint8_frames' quantisation) on any device; colors: per video its
    landmark colours (L_b, 3) in [0, 1], float64, L_b may differ between videos. Returns uv (B, F, L, 2) float64 and
    found (B, F, L) bool on the frames' device, L = max L_b: video b's landmarks are its first L_b entries, the rest
    are padding (never found, NaN). Video by video, the numbers are find_landmarks' on frames / 255 (tests compare).
    chunk: videos searched at a time (default: about CHUNK_ELEMENTS values per temporary).
    """
    B, F, H, W, _ = frames.shape
    device = frames.device
    counts = np.array([len(c) for c in colors], dtype=np.int64)
    if frames.dtype != torch.uint8 or len(counts) != B:
        raise ValueError(f"frames must be uint8 with a colour set per video: {frames.dtype}, {B} videos, "
                         f"{len(counts)} colour sets")
    L = int(counts.max(initial=0))
    uv = torch.full((B, F, L, 2), math.nan, dtype=torch.float64, device=device)
    found = torch.zeros((B, F, L), dtype=torch.bool, device=device)
    if B == 0 or L == 0:
        return uv, found
    palette = np.zeros((B, L, 3))
    for b, c in enumerate(colors):
        palette[b, :len(c)] = c
    palette_t = torch.from_numpy(palette).to(device)
    pad = torch.from_numpy(np.arange(L) >= counts[:, None]).to(device)
    # numpy's own uint8 / 255.0, looked up: a device may divide by a scalar as a multiply by its reciprocal, which
    # can land one ulp away and move a pixel's nearest colour at a tie.
    levels = torch.from_numpy(np.arange(256, dtype=np.float64) / 255.0).to(device)
    chunk = chunk or max(1, CHUNK_ELEMENTS // (F * H * W * L))
    for start in range(0, B, chunk):
        part = frames[start:start + chunk]
        pixels_first = part.permute(2, 3, 0, 1, 4).reshape(H * W, *part.shape[:2], 3)  # (P, b, F, 3)
        chunk_uv, chunk_found = _search(levels[pixels_first.long()], palette_t[start:start + chunk],
                                        pad[start:start + chunk], H, W)
        uv[start:start + chunk], found[start:start + chunk] = chunk_uv, chunk_found
    return uv, found


def _in_order_sum(x: torch.Tensor) -> torch.Tensor:
    """x[0] + x[1] + ... + x[-1] over dim 0, added one after another (numpy's order where the summed axes are not
    the inner loop: see _search)."""
    if len(x) == 0:
        return x.new_zeros(x.shape[1:])
    acc = x[0].clone()
    for row in x[1:]:
        acc += row
    return acc


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in numpy's pairwise order (numpy/_core/src/umath/loops_utils.h.src, pairwise_sum), numpy's
    order where the summed axis is the inner loop: under 8 terms one after another; up to 128, eight interleaved
    running sums combined as a tree, then the remainder; above, the two halves (split at a multiple of 8)."""
    n = len(x)
    if n < 8:
        return _in_order_sum(x)
    if n <= 128:
        m = n - n % 8
        r = _in_order_sum(x[:m].reshape(m // 8, 8, *x.shape[1:]))  # r[j] = x[j] + x[j + 8] + ...
        total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for row in x[m:]:
            total = total + row
        return total
    half = n // 2 - (n // 2) % 8
    return _pairwise_sum(x[:half]) + _pairwise_sum(x[half:])


def _beyond_midpoints(s: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether s >= 0 lies above the square of the midpoint between y >= 0 and the next float64 up, and whether it
    lies below that of the midpoint to the next one down: that is, whether sqrt(s) rounds to a float above y, or
    below it. Exact, with plain float64 operations (no fused multiply-add), for y within a few ulps of sqrt(s)
    or s further above: y * y = hi + lo exactly (Dekker's product on Veltkamp's split); s - hi is exact (Sterbenz,
    hi within a factor 2 of s), or else far larger than what it is compared with; and in units of ulp(y)^2 the
    remaining comparison is between integers, which rounding cannot flip, the midpoints' squares differing from
    y^2 +- y ulp(y) by less than a unit. No square root is a midpoint, so there are no ties."""
    up, down = torch.nextafter(y, torch.full_like(y, math.inf)), torch.nextafter(y, torch.zeros_like(y))
    split = y * 134217729.0  # 2^27 + 1
    y_hi = split - (split - y)
    y_lo = y - y_hi
    hi = y * y
    lo = ((y_hi * y_hi - hi) + 2.0 * (y_hi * y_lo)) + y_lo * y_lo
    excess = (s - hi) - lo
    return (excess - y * (up - y)) > 0, ((excess + y * (y - down)) <= 0) & (y > 0)


def _sqrt_nearest(s: torch.Tensor) -> torch.Tensor:
    """sqrt(s) rounded to the nearest float64, as IEEE 754 and numpy define it, for s >= 0 (normal or 0).

    torch's own sqrt is not that everywhere (its CPU float64 sqrt is an ulp off for about 1 value in 80), and an
    ulp in a distance moves a weight, a centroid and, through PnP's refinement, the pose. So the device's sqrt is
    moved an ulp at a time until it is the nearest (_beyond_midpoints)."""
    y = torch.sqrt(s)
    for _ in range(8):
        above, below = _beyond_midpoints(s, y)
        if not bool((above | below).any()):
            return y
        y = torch.where(above, torch.nextafter(y, torch.full_like(y, math.inf)),
                        torch.where(below, torch.nextafter(y, torch.zeros_like(y)), y))
    raise RuntimeError("torch.sqrt is more than 8 ulps from the nearest square root on this device")


def _search(pixels: torch.Tensor, palette: torch.Tensor, pad: torch.Tensor, H: int, W: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """find_landmarks' rule on pixels (P = H * W, b, F, 3) float64 (row-major pixel order first) against palette
    (b, L, 3), pad (b, L) True where a video has fewer landmarks. Returns uv (b, F, L, 2), found (b, F, L).

    Every number is numpy's to the bit: the same operations (the channel sum of the squared distance, a true
    division by the radius), square roots rounded as numpy's are, and each sum over pixels added in the order
    numpy adds it. numpy takes that order from the memory layout of its operands, so it is reproduced for the
    frames cam_score hands to estimate_video: a (F, H, W, 3) view of a (3, F, H, W) video, channels outermost.
    There the weights are laid out landmark by landmark and their sums over a frame's pixels are one pairwise sum
    (_pairwise_sum), as are those over each edge row and column; the spread's terms come out C-contiguous, summed
    pixel after pixel (_in_order_sum). (numpy on C-contiguous frames sums all of them pixel after pixel: its
    centroids then differ from these in the last bits.)"""
    L = palette.shape[1]
    device = pixels.device
    diff = [pixels[..., k, None] - palette[None, :, None, :, k] for k in range(3)]
    sq = diff[0] * diff[0] + diff[1] * diff[1] + diff[2] * diff[2]  # (P, b, F, L)
    del diff
    sq = sq.masked_fill(pad[None, :, None], math.inf)  # a pad is never the nearest and gets no vote
    # Only the nearest colour's distance is needed: the rounded root of the least squared distance. numpy's owner
    # is the first landmark at that rounded distance. Exact ties are common (the palette's saturated colours are
    # equidistant from a grey); the first of them is argmin's. A landmark before it whose larger squared distance
    # rounds to the same root would be numpy's owner instead: that takes one within a relative 2^-50 of the least,
    # and only then is each landmark's rounding checked exactly.
    owner = sq.argmin(-1)  # the first of equal least squared distances
    least = sq.gather(-1, owner[..., None])
    nearest = _sqrt_nearest(least[..., 0])  # (P, b, F)
    ahead = torch.arange(L, device=device) < owner[..., None]
    if bool(((sq <= least * (1.0 + 2.0 ** -48)) & ahead).any()):
        rounds_above, _ = _beyond_midpoints(sq, nearest[..., None])
        owner = (~rounds_above).to(torch.int32).argmax(-1)  # argmax: the first of the maxima
        del rounds_above
    del sq, ahead
    radius = torch.tensor(COLOUR_RADIUS, dtype=torch.float64, device=device)  # a tensor: no reciprocal shortcut
    closeness = (1.0 - nearest / radius).clamp_min(0.0)
    weight = (closeness * closeness)[..., None] * (owner[..., None] == torch.arange(L, device=device))
    grid = np.arange(H * W).reshape(H, W)
    index = torch.from_numpy(grid).to(device)
    u = (index % W).to(torch.float64).reshape(-1, 1, 1, 1)  # (P, 1, 1, 1): each pixel's column
    v = (index // W).to(torch.float64).reshape(-1, 1, 1, 1)
    mass, u_sum, v_sum = _pairwise_sum(torch.stack([weight, weight * u, weight * v], 1))
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))
    u_c, v_c = u_sum / safe, v_sum / safe
    du, dv = u - u_c, v - v_c
    spread = _sqrt_nearest(_in_order_sum(weight * (du * du + dv * dv)) / safe)
    del du, dv
    # the frame's outermost pixels as find_landmarks picks them: the first and last rows, and the first and last
    # columns of the rows between, each edge summed on its own
    edges = [grid[0], grid[-1], grid[1:-1, 0], grid[1:-1, -1]]
    top, bottom, left, right = (_pairwise_sum(weight[torch.from_numpy(np.ascontiguousarray(e)).to(device)])
                                for e in edges)
    border = (top + bottom) + (left + right)
    found = (mass >= MIN_MASS) & (spread <= MAX_SPREAD_FRACTION * max(H, W)) & (border <= MAX_BORDER_SHARE * mass)
    uv = torch.stack([u_c, v_c], -1).masked_fill(~found[..., None], math.nan)
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
    if len(landmarks) < MIN_LANDMARKS:  # real footage: no known 3D landmarks, so no frame is estimable
        return PoseEstimate.failed(len(frames), "scene_has_too_few_landmarks", "landmarks")
    uvs, founds = find_landmarks(np.asarray(frames, np.float64) / 255.0, colors)
    return poses_from_landmarks(uvs, founds, K, landmarks, time.perf_counter() - start)


def poses_from_landmarks(uvs: np.ndarray, founds: np.ndarray, K: np.ndarray, landmarks: np.ndarray,
                         search_seconds: float = 0.0) -> PoseEstimate:
    """One video's estimate from its landmarks' image positions: uvs (F, L, 2), founds (F, L) (find_landmarks'),
    PnP frame by frame. search_seconds: the search's share of the video's time, counted in seconds["pnp"] as
    estimate_video always has."""
    start = time.perf_counter()
    F = len(uvs)
    poses, ok, reasons = np.full((F, 3, 4), np.nan), np.zeros(F, bool), []
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
                        confidence={"landmarks_found_mean": float(np.mean(founds.sum(-1))),
                                    "frames_ok": float(ok.sum()), "parallax": parallax},
                        seconds={"pnp": search_seconds + time.perf_counter() - start}, parallax=parallax)


# Below this many videos PnP runs in the calling thread: a pool's hand-over costs more than it saves.
MIN_POOLED_VIDEOS = 64


def _solve(job: tuple) -> PoseEstimate:
    """One video's PnP in a pool process: (uvs, founds, K, landmarks, search_seconds) -> its estimate."""
    return poses_from_landmarks(*job)


def poses_from_landmarks_torch(uvs: torch.Tensor, founds: torch.Tensor, intrinsics: Sequence[np.ndarray],
                                landmarks: Sequence[np.ndarray], search_seconds: float = 0.0) -> list[PoseEstimate]:
    """poses_from_landmarks for a batch of videos at once, PnP batched in torch (rewards/pose/pnp_torch.py) on the
    device uvs are on: uvs (B, F, L, 2), founds (B, F, L) (find_landmarks_torch's, L >= every video's count, the
    padding never found); intrinsics and landmarks per video. Only the poses (B, F, 3, 4) cross to the host.
    search_seconds: the search's time for the whole batch, shared out as estimate_device_frames does."""
    start = time.perf_counter()
    if founds.shape[0] == 0:
        return []
    solved = solve_videos_torch(uvs, founds, intrinsics, landmarks)
    return estimates_from_poses(*solved, landmarks, search_seconds + time.perf_counter() - start)


def solve_videos_torch(uvs: torch.Tensor, founds: torch.Tensor, intrinsics: Sequence[np.ndarray],
                       landmarks: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device's part of poses_from_landmarks_torch: poses (B, F, 3, 4), codes (B, F) (pnp_torch's) and each
    video's mean count of found landmarks, on the host."""
    B, F, L = founds.shape
    device = uvs.device
    points = np.zeros((B, L, 3))
    for b, pts in enumerate(landmarks):
        points[b, :len(pts)] = pts
    points_t = torch.from_numpy(points).to(device)
    K_t = torch.from_numpy(np.stack([np.asarray(K, np.float64) for K in intrinsics])).to(device)
    # a frame with few landmarks may start from its video's previous or next frame's solution
    index = torch.arange(B * F, device=device).reshape(B, F)
    step = torch.full((B, 1), -1, dtype=torch.long, device=device)
    neighbours = torch.stack([torch.cat([step, index[:, :-1]], 1), torch.cat([index[:, 1:], step], 1)], -1)
    poses_t, codes_t = pnp_torch.solve_pnp(uvs.reshape(B * F, L, 2), founds.reshape(B * F, L),
                                           points_t[:, None].expand(B, F, L, 3).reshape(B * F, L, 3),
                                           K_t[:, None].expand(B, F, 3, 3).reshape(B * F, 3, 3),
                                           neighbours.reshape(B * F, 2))
    found_mean = founds.sum(-1).double().mean(-1)
    return (poses_t.reshape(B, F, 3, 4).cpu().numpy(), codes_t.reshape(B, F).cpu().numpy(),
            found_mean.cpu().numpy())


def estimates_from_poses(poses: np.ndarray, codes: np.ndarray, found_mean: np.ndarray,
                         landmarks: Sequence[np.ndarray], seconds: float = 0.0) -> list[PoseEstimate]:
    """The host's part of poses_from_landmarks_torch: each video's PoseEstimate (reasons, parallax, confidence)
    from solve_videos_torch's arrays; `seconds`, the batch's time, is shared out per video."""
    start = time.perf_counter()
    B = len(poses)
    out = []
    placed = codes == pnp_torch.PLACED
    parallaxes = landmark_parallax_batch(poses, placed, landmarks).tolist()
    for b in range(B):
        ok = placed[b]
        reasons = [PNP_REASONS[c] for c in codes[b].tolist()]
        parallax = parallaxes[b]
        out.append(PoseEstimate(poses=poses[b], ok=ok, reasons=reasons, method="landmarks",
                                video_reason=None if ok.any() else "no_frame_estimated",
                                confidence={"landmarks_found_mean": float(found_mean[b]),
                                            "frames_ok": float(ok.sum()), "parallax": parallax},
                                seconds={}, parallax=parallax))
    share = (seconds + time.perf_counter() - start) / max(B, 1)
    for estimate in out:
        estimate.seconds["pnp"] = share
    return out


PNP_REASONS = {pnp_torch.PLACED: None, pnp_torch.TOO_FEW: "too_few_landmarks", pnp_torch.FAILED: "pnp_failed"}
PNP_METHODS = ("torch", "opencv")


def _quiet_worker() -> None:
    # one pool process per core: the libraries' own thread pools would only contend
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def pnp_processes() -> int:
    """Pool processes per training process: the cores shared among the node's processes (LOCAL_WORLD_SIZE)."""
    return max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


class LandmarkEstimator:
    """PnP against each condition's landmarks (conditions need `landmarks` and `landmark_colors` tensors).

    pnp: how the poses are solved from the found landmarks. "torch" (the default): every frame of every video of
    a batch at once on the landmarks' device (poses_from_landmarks_torch), so with videos on an accelerator only
    the poses cross to the host. "opencv": OpenCV's SQPnP and LM refinement frame by frame on the host, the
    reference the torch solve is tested against (tests/test_pnp_torch.py), as described below.

    Two ways in, the same estimates: `estimate` takes each video's uint8 frames on the host and searches it with
    numpy; `estimate_device_frames` takes the batch as one uint8 tensor where it already is (an accelerator) and
    searches it there with find_landmarks_torch. With pnp "torch", both then solve the whole batch at once (on the
    CPU, or on the frames' device). With "opencv", only the landmarks' positions cross to the host, where PnP runs
    on a pool of processes (`processes`, default pnp_processes(); 0: in the calling thread), started at the first
    batch of MIN_POOLED_VIDEOS or more and kept until close(): per frame it is OpenCV calls between numpy and
    Python steps that hold the GIL, so threads gave no speedup (2.52 s per 2,048 videos on one thread, 2.58 on
    two), and two processes cut it to 1.3-2.1 s (scripts/bench/bench_update_cpu.py, docs/real_scale.md 0.1; the
    pool's hand-overs cost, hence the threshold). cam_score takes the second way for videos on a device
    `searches_on` accepts: not the CPU, where numpy's per-video search was the faster, unless torch_on_cpu.
    """

    name = "landmarks"

    def __init__(self, processes: int | None = None, chunk: int | None = None, torch_on_cpu: bool = False,
                 pnp: str = "torch"):
        if pnp not in PNP_METHODS:
            raise ValueError(f"reward.cam.pnp must be one of {PNP_METHODS}, got {pnp!r}")
        self.pnp = pnp
        self.processes = pnp_processes() if processes is None else processes
        self.chunk = chunk  # videos per find_landmarks_torch chunk; None: its default
        self.torch_on_cpu = torch_on_cpu
        self._pool: ProcessPoolExecutor | None = None

    def searches_on(self, device: torch.device) -> bool:
        """Whether videos on `device` go to estimate_device_frames."""
        return self.torch_on_cpu or torch.device(device).type != "cpu"

    def estimate(self, videos, intrinsics, conditions) -> list[PoseEstimate]:
        if self.pnp == "torch":
            return self._estimate_host_torch(videos, intrinsics, conditions)
        return [estimate_video(v, np.asarray(K, np.float64), c.landmarks.double().cpu().numpy(),
                               c.landmark_colors.double().cpu().numpy())
                for v, K, c in zip(videos, intrinsics, conditions, strict=True)]

    def _estimate_host_torch(self, videos, intrinsics, conditions) -> list[PoseEstimate]:
        """estimate's search (numpy, video by video), then one batched torch PnP on the CPU for all of them."""
        start = time.perf_counter()
        landmarks = [c.landmarks.double().cpu().numpy() for c in conditions]
        out = [PoseEstimate.failed(len(v), "scene_has_too_few_landmarks", "landmarks") for v in videos]
        searched = [b for b in range(len(videos)) if len(landmarks[b]) >= MIN_LANDMARKS]
        if not searched:
            return out
        L = max(len(landmarks[b]) for b in searched)
        F = len(videos[searched[0]])
        uvs, founds = np.full((len(searched), F, L, 2), np.nan), np.zeros((len(searched), F, L), bool)
        for row, b in enumerate(searched):
            colors = conditions[b].landmark_colors.double().cpu().numpy()
            uv, found = find_landmarks(np.asarray(videos[b], np.float64) / 255.0, colors)
            uvs[row, :, :len(colors)], founds[row, :, :len(colors)] = uv, found
        solved = poses_from_landmarks_torch(torch.from_numpy(uvs), torch.from_numpy(founds),
                                            [intrinsics[b] for b in searched], [landmarks[b] for b in searched],
                                            time.perf_counter() - start)
        for b, estimate in zip(searched, solved, strict=True):
            out[b] = estimate
        return out

    def pool(self) -> ProcessPoolExecutor:
        """The PnP processes, started on first use. Spawned, not forked: the training process holds threads and
        an accelerator context that a fork would copy mid-use."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_quiet_worker)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def estimate_device_frames(self, frames: torch.Tensor, intrinsics, conditions) -> list[PoseEstimate]:
        """frames (B, F, H, W, 3) uint8 on any device (rewards.pose.to_uint8_frames' quantisation); what
        `estimate` gives for the same frames, but for seconds."""
        start = time.perf_counter()
        B, F = frames.shape[:2]
        if not (B == len(intrinsics) == len(conditions)):
            raise ValueError(f"{B} videos, {len(intrinsics)} intrinsics, {len(conditions)} conditions")
        landmarks = [c.landmarks.double().cpu().numpy() for c in conditions]
        colors = [c.landmark_colors.double().cpu().numpy() for c in conditions]
        searched = [b for b in range(B) if len(landmarks[b]) >= MIN_LANDMARKS]
        picked = frames if len(searched) == B else frames[torch.as_tensor(searched, device=frames.device)]
        uvs, founds = find_landmarks_torch(picked, [colors[b] for b in searched], self.chunk)
        out = [PoseEstimate.failed(F, "scene_has_too_few_landmarks", "landmarks") for _ in range(B)]
        if self.pnp == "torch":
            solved = poses_from_landmarks_torch(uvs, founds, [np.asarray(intrinsics[b], np.float64) for b in searched],
                                                [landmarks[b] for b in searched], time.perf_counter() - start)
            for b, estimate in zip(searched, solved, strict=True):
                out[b] = estimate
            return out
        uvs, founds = uvs.cpu().numpy(), founds.cpu().numpy()
        share = (time.perf_counter() - start) / max(len(searched), 1)
        jobs = [(uvs[row, :, :len(landmarks[b])], founds[row, :, :len(landmarks[b])],
                 np.asarray(intrinsics[b], np.float64), landmarks[b], share) for row, b in enumerate(searched)]
        if self.processes > 0 and len(jobs) >= MIN_POOLED_VIDEOS:
            chunks = max(1, len(jobs) // (4 * self.processes))  # a few hand-overs per process, not one per video
            solved = list(self.pool().map(_solve, jobs, chunksize=chunks))
        else:
            solved = [_solve(job) for job in jobs]
        for b, estimate in zip(searched, solved, strict=True):
            out[b] = estimate
        return out

    def describe(self) -> str:
        return f"landmark PnP (synthetic world, {self.pnp})"


@register_estimator("landmarks")
def build_landmarks(cam_config=None) -> LandmarkEstimator:
    pnp = "torch" if cam_config is None else cam_config.get("pnp", "torch")
    return LandmarkEstimator(pnp=pnp)
