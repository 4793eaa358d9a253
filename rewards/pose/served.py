"""`served`: camera poses from a learned estimator (VGGT, MASt3R, MapAnything, ...) running behind an HTTP endpoint.

Learned estimators need GPU weights, so they run elsewhere (another process, another machine) and recam only talks
to them. Configuration: config.reward.cam.served (see ServedPoseConfig).

Protocol (version 1)
--------------------
One request per video:

    POST {base_url}/v1/camera_poses
    Content-Type: application/json
    Authorization: Bearer <key>          (only when the environment variable named by api_key_env is set)

    {
      "frames": ["data:image/png;base64,...", ...],   # n frames, RGB, PNG or JPEG (image_format), full resolution
      "frame_indices": [0, 5, 10, ...],               # each sent frame's index in the video, increasing
      "intrinsics": [[fx, 0, cx], [0, fy, cy], [0, 0, 1]],  # pixels of the frames as sent; OpenCV convention:
                                                      # pixel (row i, col j) has its centre at u = j, v = i
      "height": H, "width": W                         # size of every sent frame
    }

Which frames are sent: at most max_frames, evenly spaced and always including the first and the last frame
(every frame when the video has no more than max_frames). Frames are sent at their own resolution, so the
intrinsics are the video's own.

Answer, HTTP 200 (any 2xx) with a JSON object:

    {
      "poses": [ [[r00, r01, r02, t0], [r10, r11, r12, t1], [r20, r21, r22, t2]] or null, ... ],
      "reasons": [ null or "why", ... ],   # optional; why a frame has a null pose
      "confidence": {"name": number, ...}, # optional; logged with the video
      "scene_depth": number                # optional; median depth of the scene in front of the first sent
                                           # camera, in the poses' units (a learned estimator has a depth map)
    }

  - "poses" has exactly one entry per sent frame, in the order sent. Each is a 3x4 world-to-camera matrix [R|t]
    in OpenCV camera axes (x right, y down, z forward): a world point X maps to camera coordinates R X + t.
    The world frame and the scale are free (the first camera need not be the identity, the unit need not be
    metres): cam_score makes the trajectory relative to the first frame and normalises its scale.
  - null means the estimator could not place that frame; the frame then has no pose, with the reason given at
    the same position in "reasons", or "not_registered".
  - R must be a rotation: max |R^T R - I| <= 1e-3 and det R > 0. Within that tolerance it is replaced by the
    nearest rotation (so small float32 round-off does not reach cam_score's angles); t is kept as sent.
  - "confidence" values that are not numbers are dropped; "frames_sent" is set by the client.
  - "scene_depth", when present, must be a finite number > 0. It is the only scale the poses can be read against:
    the estimate's `parallax` is rewards.pose.centre_parallax, the mean over pairs of placed frames of
    |c_i - c_j| / scene_depth (c the camera centres) beyond rewards.pose.STILL_TOLERANCE. cam_score needs it only
    for a target that does not translate; without it the video's translation there is unmeasured and scores its
    worst value (cam_score's rule for every term it cannot measure), so a server should send it.

    GET {base_url}/health  ->  any 2xx when the estimator is ready to answer.

A trailing "/v1" on base_url is accepted and ignored.

What the client makes of it
---------------------------
Each video becomes one PoseEstimate (method "served"). Frames that were not sent have NaN poses, ok False and the
reason "not_sent" (rewards.pose.NOT_SENT): the client never invents poses between sent frames; cam_score leaves such
frames out of its per-frame mean rather than count them as failed ones.

Failures are explicit and never become poses (no zeros, no identity):
  - each attempt is bounded as a whole by timeout_s (connect, send, the whole answer; not per read) and by
    MAX_ANSWER_BYTES of answer: a server that trickles its answer fails the attempt at timeout_s, and a larger
    answer is cut off there, unread ("malformed_answer: answer body over the ...-byte cap").
  - timeouts, connection errors (refused, reset, closed without an answer), HTTP 5xx and 429 are retried up to
    max_retries times with exponential backoff backoff_s * 2**(attempt - 1); a numeric Retry-After header on 429
    is honoured, capped at timeout_s. Once the retries are spent, the video is `PoseEstimate.failed(...,
    unavailable=True)` with a reason such as "server_error: HTTP 503 (4 attempts): ...", "rate_limited: HTTP 429
    (4 attempts)", "timeout: no answer within 60.0s (4 attempts)" or "connection_error: ConnectError: ... (4
    attempts)".
  - other non-2xx statuses (a request the server rejects, e.g. 400 or 413) are not retried: "http_error: HTTP 400
    (not retried): ...", unavailable.
  - a malformed answer (not JSON, not an object, no "poses", a wrong number of poses, a pose that is not 3x4
    numbers, non-finite numbers, a translation beyond MAX_TRANSLATION, JSON nested too deep to read, a
    scene_depth that makes the parallax non-finite, a rotation block that is not a rotation, "reasons" or
    "confidence" of the wrong form) is not retried, since the estimator would answer the same again:
    "malformed_answer: <what>", unavailable, because the video was not judged and must not be scored as a wrong
    camera.
  - a video the client cannot send (not (F, H, W, 3) uint8, intrinsics not a finite 3x3 matrix) is
    "bad_input: <what>", unavailable, and no request is made for it.
Unavailable videos get NaN from cam_score and are retried by the reward runner; a batch where every video is
unavailable becomes RewardServerDown there, so a server that dies mid-run stops the run cleanly.

Building the estimator runs GET /health (unless check_health is False) and raises PoseServerError, a
RewardServerDown with a one-line message naming the URL and the cause, when the server cannot be used.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import httpx
import numpy as np
from PIL import Image

from recam.engine.reward_runner import RewardServerDown
from rewards import bounded_http
from rewards.pose.estimator import NOT_SENT, PoseEstimate, centre_parallax, register_estimator

METHOD = "served"
NOT_REGISTERED = "not_registered"
POSES_PATH = "/v1/camera_poses"
HEALTH_PATH = "/health"
ROTATION_TOL = 1e-3
CONFIG_PATH = "reward.cam.served"
# An answer is a few kilobytes (12 numbers a frame, max_frames frames, a few confidences); a body past this is a
# server gone wrong, and reading it whole could exhaust memory.
MAX_ANSWER_BYTES = 4 << 20
# Poses are scale-free (cam_score normalises the trajectory), so any unit up to this is as good as another; a
# translation beyond it is a broken server, and beyond ~1e154 squared distances overflow to inf.
MAX_TRANSLATION = 1e12
JPEG_QUALITY = 95  # the estimator matches features; heavier compression would cost it accuracy, not us bandwidth


class PoseServerError(RewardServerDown):
    """The pose estimator server cannot be used (unreachable, or not healthy). One-line message naming the URL and
    the cause, so an entry point reports it like a reward server that died mid-run (exit status 3)."""


@dataclass
class ServedPoseConfig:
    """Where the estimator lives and how to talk to it (config.reward.cam.served).

    base_url: server root, e.g. "http://127.0.0.1:30100". timeout_s: the overall deadline of one attempt:
    connecting, sending the request and receiving the whole answer, not each read (waiting for a free pooled
    connection does not count). max_retries: retries after the
    first try; backoff_s: first retry delay, doubled each retry. max_concurrency: requests in flight at once.
    max_frames: frames sent per video, at least 2 (see the module docstring). image_format: "png" (lossless) or "jpeg"
    (smaller requests). api_key_env: environment variable holding a bearer token; "" or unset means none.
    check_health: GET /health when the estimator is built.
    """

    base_url: str = "http://127.0.0.1:30100"
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 1.0
    max_concurrency: int = 4
    max_frames: int = 16
    image_format: str = "png"
    api_key_env: str = "POSE_API_KEY"
    check_health: bool = True

    def __post_init__(self):
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"{CONFIG_PATH}.{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def is_real(v) -> bool:
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)

        if not isinstance(self.base_url, str) or not self.base_url.startswith(("http://", "https://")):
            raise bad("base_url", "an http:// or https:// URL")
        if not is_real(self.timeout_s) or self.timeout_s <= 0:
            raise bad("timeout_s", "a number > 0")
        if not is_int(self.max_retries) or self.max_retries < 0:
            raise bad("max_retries", "an integer >= 0")
        if not is_real(self.backoff_s) or self.backoff_s < 0:
            raise bad("backoff_s", "a number >= 0")
        if not is_int(self.max_concurrency) or self.max_concurrency < 1:
            raise bad("max_concurrency", "an integer >= 1")
        # Two frames at least: one frame has nothing to be relative to.
        if not is_int(self.max_frames) or self.max_frames < 2:
            raise bad("max_frames", "an integer >= 2")
        if self.image_format not in ("png", "jpeg"):
            raise bad("image_format", "'png' or 'jpeg'")
        if not isinstance(self.api_key_env, str):
            raise bad("api_key_env", "a string (an environment variable name, or '' for none)")
        if not isinstance(self.check_health, bool):
            raise bad("check_health", "True or False")

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def poses_url(self) -> str:
        return self.api_root + POSES_PATH

    @property
    def health_url(self) -> str:
        return self.api_root + HEALTH_PATH

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}


def served_config(cam_config) -> ServedPoseConfig:
    """ServedPoseConfig from config.reward.cam (a ConfigDict or a dict; None, or no "served" section, gives the
    defaults). A key the dataclass does not know is an error: a misspelt max_frame would otherwise be ignored."""
    section = None
    if cam_config is not None:
        section = cam_config.get("served") if hasattr(cam_config, "get") else getattr(cam_config, "served", None)
    if section is None:
        return ServedPoseConfig()
    values = dict(section.items())
    known = [f.name for f in fields(ServedPoseConfig)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{CONFIG_PATH} has unknown field(s) {unknown}; known: {known}")
    return ServedPoseConfig(**values)


# ----------------------------------------------------------------------------------------------------
# request


def sent_frame_indices(num_frames: int, max_frames: int) -> list[int]:
    """Evenly spaced indices including the first and the last frame; every frame when there are few enough."""
    if num_frames <= max_frames:
        return list(range(num_frames))
    # A spacing of at least one frame keeps the rounded indices distinct.
    return [int(i) for i in np.linspace(0, num_frames - 1, max_frames).round()]


def encode_frame(frame: np.ndarray, image_format: str) -> str:
    """(H, W, 3) uint8 -> data URL."""
    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(frame))
    if image_format == "jpeg":
        image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buf, format="PNG")
    return f"data:image/{image_format};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def check_input(video: Any, K: Any) -> str | None:
    """Why (video, K) cannot be sent, or None."""
    if not isinstance(video, np.ndarray) or video.ndim != 4 or video.shape[-1] != 3 or video.shape[0] < 1:
        shape = getattr(video, "shape", type(video).__name__)
        return f"video must be a (F, H, W, 3) array with F >= 1, got {shape}"
    if video.dtype != np.uint8:
        return f"video must be uint8 (rewards.pose.to_uint8_frames), got {video.dtype}"
    if min(video.shape[1:3]) < 1:
        return f"video frames are empty: {video.shape}"
    try:
        K = np.asarray(K, dtype=np.float64)
    except (TypeError, ValueError):
        return f"intrinsics must be a finite 3x3 matrix, got {_short(repr(K), 80)}"
    if K.shape != (3, 3) or not np.isfinite(K).all():
        return f"intrinsics must be a finite 3x3 matrix, got {_short(repr(K.tolist()), 80)}"
    return None


def build_request(video: np.ndarray, K: np.ndarray, config: ServedPoseConfig) -> tuple[dict, list[int]]:
    """Request body for one checked video, and the indices of the frames it sends."""
    indices = sent_frame_indices(video.shape[0], config.max_frames)
    body = {
        "frames": [encode_frame(video[i], config.image_format) for i in indices],
        "frame_indices": indices,
        "intrinsics": np.asarray(K, dtype=np.float64).tolist(),
        "height": int(video.shape[1]),
        "width": int(video.shape[2]),
    }
    return body, indices


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n] + "..."


def _retry_after(headers: httpx.Headers, cap: float) -> float:
    # Only the seconds form; an HTTP-date falls back to the client's own backoff.
    try:
        value = float(headers.get("retry-after", "0"))
    except ValueError:
        return 0.0
    return min(max(value, 0.0), cap) if math.isfinite(value) else 0.0


def post_with_retries(client: httpx.Client, body: dict, config: ServedPoseConfig) -> bounded_http.Answer | str:
    """The server's 2xx answer, or the failure reason once retrying cannot help. Each attempt is bounded by
    timeout_s as a whole and MAX_ANSWER_BYTES of answer (rewards/bounded_http.py)."""
    last, detail = "no attempt made", ""
    extra_wait = 0.0
    attempts = 0
    for attempt in range(config.max_retries + 1):
        if attempt:
            time.sleep(max(config.backoff_s * 2 ** (attempt - 1), extra_wait))
        extra_wait = 0.0
        attempts = attempt + 1
        try:
            resp = bounded_http.request(client, "POST", config.poses_url, json=body, headers=config.headers(),
                                        timeout_s=config.timeout_s, max_bytes=MAX_ANSWER_BYTES)
        except httpx.TimeoutException:
            last, detail = f"timeout: no answer within {config.timeout_s}s", ""
            continue
        except httpx.RequestError as e:  # refused, reset, closed without a response
            last, detail = f"connection_error: {type(e).__name__}", _short(e, 100)
            continue
        shown = resp.not_read or _short(resp.text)
        if resp.status == 429:
            last, detail = "rate_limited: HTTP 429", shown
            extra_wait = _retry_after(resp.headers, config.timeout_s)
            continue
        if resp.status >= 500:
            last, detail = f"server_error: HTTP {resp.status}", shown
            continue
        if not 200 <= resp.status < 300:
            return f"http_error: HTTP {resp.status} (not retried)" + (f": {shown}" if shown else "")
        return resp
    return f"{last} ({attempts} attempts)" + (f": {detail}" if detail else "")


# ----------------------------------------------------------------------------------------------------
# answer


class MalformedAnswer(ValueError):
    """The server's 2xx answer does not follow the protocol."""


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shape_of(x: Any) -> str:
    if not isinstance(x, list):
        return type(x).__name__
    lengths = {len(r) if isinstance(r, list) else None for r in x}
    if len(lengths) == 1 and None not in lengths:
        return f"{len(x)}x{lengths.pop()}"
    return f"a list of {len(x)}"


def parse_pose(pose: Any, where: str) -> np.ndarray:
    """One non-null "poses" entry -> (3, 4) float64 with R projected onto SO(3); MalformedAnswer if unusable."""
    if not (isinstance(pose, list) and len(pose) == 3 and all(isinstance(r, list) and len(r) == 4 for r in pose)):
        raise MalformedAnswer(f"{where} is not a 3x4 nested list (got {_shape_of(pose)})")
    if not all(_is_number(x) for row in pose for x in row):
        raise MalformedAnswer(f"{where} holds values that are not numbers")
    P = np.array(pose, dtype=np.float64)
    if not np.isfinite(P).all():
        raise MalformedAnswer(f"{where} has non-finite values")
    if np.abs(P[:, 3]).max() > MAX_TRANSLATION:
        raise MalformedAnswer(f"{where} translation {np.abs(P[:, 3]).max():.3g} is beyond {MAX_TRANSLATION:g}")
    R = P[:, :3]
    err = float(np.abs(R.T @ R - np.eye(3)).max())
    if err > ROTATION_TOL:
        raise MalformedAnswer(f"{where} rotation block is not orthonormal (max |R^T R - I| = {err:.3g})")
    if np.linalg.det(R) < 0:
        raise MalformedAnswer(f"{where} rotation block is a reflection (det < 0)")
    U, _, Vt = np.linalg.svd(R)
    P[:, :3] = U @ Vt
    return P


def parse_answer(resp: bounded_http.Answer, indices: list[int], num_frames: int,
                 seconds: dict[str, float]) -> PoseEstimate:
    """A 2xx response for the frames `indices` of a num_frames video -> PoseEstimate; MalformedAnswer if unusable."""
    if resp.not_read:
        raise MalformedAnswer(resp.not_read)
    try:
        answer = json.loads(resp.body)
    except ValueError as e:  # not JSON, or not UTF-8
        raise MalformedAnswer(f"not JSON ({_short(resp.text, 80)!r})") from e
    except RecursionError as e:  # nested deeper than the decoder goes: no protocol answer is more than 4 deep
        raise MalformedAnswer("JSON nested too deeply to read") from e
    if not isinstance(answer, dict):
        raise MalformedAnswer(f"not a JSON object (a {type(answer).__name__})")
    if "poses" not in answer:
        raise MalformedAnswer(f"no 'poses' field (fields: {sorted(answer)[:10]})")
    poses, n = answer["poses"], len(indices)
    if not isinstance(poses, list):
        raise MalformedAnswer(f"'poses' is not a list (a {type(poses).__name__})")
    if len(poses) != n:
        raise MalformedAnswer(f"wrong number of poses: {len(poses)} for {n} frames sent")
    server_reasons = answer.get("reasons")
    if server_reasons is None:
        server_reasons = [None] * n
    elif not (isinstance(server_reasons, list) and len(server_reasons) == n
              and all(r is None or isinstance(r, str) for r in server_reasons)):
        raise MalformedAnswer(f"'reasons' is not a list of {n} strings or nulls")
    scene_depth = answer.get("scene_depth")
    if scene_depth is not None and not (_is_number(scene_depth) and math.isfinite(scene_depth) and scene_depth > 0):
        raise MalformedAnswer(f"'scene_depth' is not a finite number > 0 (got {_short(repr(scene_depth), 40)})")
    server_confidence = answer.get("confidence")
    if server_confidence is None:
        server_confidence = {}
    elif not isinstance(server_confidence, dict):
        raise MalformedAnswer(f"'confidence' is not an object (a {type(server_confidence).__name__})")

    out = np.full((num_frames, 3, 4), np.nan)
    ok = np.zeros(num_frames, bool)
    reasons: list[str | None] = [NOT_SENT] * num_frames
    for k, (i, pose) in enumerate(zip(indices, poses, strict=True)):
        if pose is None:
            reasons[i] = server_reasons[k] or NOT_REGISTERED
            continue
        out[i] = parse_pose(pose, f"poses[{k}] (frame {i})")
        ok[i], reasons[i] = True, None

    confidence = {str(k): float(v) for k, v in server_confidence.items() if _is_number(v) and math.isfinite(v)}
    confidence["frames_sent"] = float(n)
    video_reason = None
    if not ok.any():
        # The estimator looked and placed nothing: a judged video, scored at cam_score's floor.
        common = Counter(reasons[i] for i in indices).most_common(1)[0][0]
        video_reason = f"no frame placed: {common}"
    with np.errstate(over="ignore"):  # an overflow is refused just below
        parallax = math.nan if scene_depth is None else centre_parallax(out, ok, float(scene_depth))
    if scene_depth is not None and not math.isfinite(parallax) and ok.sum() > 1:
        # e.g. scene_depth 1e-300 against bounded poses
        raise MalformedAnswer(f"'scene_depth' {scene_depth:.3g} gives a non-finite parallax")
    if scene_depth is not None:
        confidence["scene_depth"], confidence["parallax"] = float(scene_depth), parallax
    return PoseEstimate(poses=out, ok=ok, reasons=reasons, method=METHOD, has_translation=True,
                        video_reason=video_reason, unavailable=False, confidence=confidence, seconds=seconds,
                        parallax=parallax)


# ----------------------------------------------------------------------------------------------------
# health and the estimator


def health_check(config: ServedPoseConfig) -> None:
    """Raise PoseServerError (one line naming the URL and the cause) unless GET /health answers 2xx."""
    url = config.health_url
    hint = f"; start the pose server or fix {CONFIG_PATH}.base_url"
    try:
        resp = bounded_http.get(url, headers=config.headers(), timeout_s=min(config.timeout_s, 10.0),
                                max_bytes=MAX_ANSWER_BYTES)
    except httpx.TimeoutException as e:
        raise PoseServerError(f"pose estimator server at {url} did not answer in time ({type(e).__name__})"
                              f"{hint}") from e
    except httpx.RequestError as e:
        raise PoseServerError(f"pose estimator server at {url} is unreachable ({type(e).__name__}: "
                              f"{_short(e, 100)}){hint}") from e
    if not 200 <= resp.status < 300:
        detail = resp.not_read or _short(resp.text, 100)
        raise PoseServerError(f"pose estimator server at {url} answered HTTP {resp.status}"
                              + (f": {detail}" if detail else "") + " (not ready)")


class ServedPoseEstimator:
    """PoseEstimator backed by an HTTP server (protocol in the module docstring).

    One pooled httpx.Client, thread-safe: concurrent estimate() calls share its max_concurrency connections.
    """

    name = METHOD

    def __init__(self, config: ServedPoseConfig):
        if config.check_health:
            health_check(config)
        self.config = config
        # httpx logs every request at INFO; failures reach the run log through the PoseEstimate reasons anyway
        logger = logging.getLogger("httpx")
        logger.setLevel(max(logger.level, logging.WARNING))
        self._http = bounded_http.make_client(config.max_concurrency)
        # Nothing at the end of a run closes estimators for sure; collection or interpreter exit then does.
        self._finalizer = weakref.finalize(self, self._http.close)

    def describe(self) -> str:
        c = self.config
        return (f"served pose estimator at {c.poses_url} (up to {c.max_frames} frames per video as "
                f"{c.image_format}, {c.max_concurrency} requests in flight)")

    def close(self) -> None:
        self._finalizer()

    def estimate(self, videos: Sequence[np.ndarray], intrinsics: Sequence[np.ndarray],
                 conditions: Sequence[Any]) -> list[PoseEstimate]:
        """One PoseEstimate per video, in order; `conditions` is not used. Failures are PoseEstimates (see the
        module docstring); only a closed estimator or lists of different lengths raise."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the served pose estimator for {self.config.api_root} was closed")
        if len(videos) != len(intrinsics):
            raise ValueError(f"{len(videos)} videos but {len(intrinsics)} intrinsics")
        if not len(videos):
            return []
        workers = min(self.config.max_concurrency, len(videos))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pose-served") as pool:
            return list(pool.map(self._estimate_one, videos, intrinsics))

    def _estimate_one(self, video: np.ndarray, K: np.ndarray) -> PoseEstimate:
        try:
            num_frames = len(video)  # the caller's frame count, so that even a rejected video keeps its length
        except TypeError:
            num_frames = 0
        problem = check_input(video, K)
        if problem:
            return PoseEstimate.failed(num_frames, f"bad_input: {problem}", METHOD, unavailable=True)
        # Encoding here rather than up front keeps at most max_concurrency videos' frames in memory at once.
        t0 = time.monotonic()
        body, indices = build_request(video, K, self.config)
        seconds = {"encode": time.monotonic() - t0}
        t1 = time.monotonic()
        resp = post_with_retries(self._http, body, self.config)
        seconds["request"] = time.monotonic() - t1
        confidence = {"frames_sent": float(len(indices))}
        if isinstance(resp, str):
            return PoseEstimate.failed(num_frames, resp, METHOD, unavailable=True, seconds=seconds,
                                       confidence=confidence)
        try:
            return parse_answer(resp, indices, num_frames, seconds)
        except MalformedAnswer as e:
            return PoseEstimate.failed(num_frames, f"malformed_answer: {e}", METHOD, unavailable=True,
                                       seconds=seconds, confidence=confidence)


@register_estimator(METHOD)
def build_served(cam_config=None) -> ServedPoseEstimator:
    """Factory of the "served" estimator from config.reward.cam (its "served" section), health-checked now."""
    return ServedPoseEstimator(served_config(cam_config))
