import base64
import io
import json
import math
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import ml_collections
import numpy as np
import pytest
from PIL import Image

from recam.engine.reward_runner import RewardServerDown
from rewards.pose import STILL_TOLERANCE, build_estimator, known_estimators
from rewards.pose.served import (
    NOT_REGISTERED,
    NOT_SENT,
    PoseServerError,
    ServedPoseConfig,
    ServedPoseEstimator,
    sent_frame_indices,
    served_config,
)
from tests.loopback import LoopbackServer

K = np.array([[30.0, 0.0, 9.5], [0.0, 28.0, 5.5], [0.0, 0.0, 1.0]])


def rot(axis: int, degrees: float) -> np.ndarray:
    a = math.radians(degrees)
    c, s = math.cos(a), math.sin(a)
    i, j = [k for k in range(3) if k != axis]
    R = np.eye(3)
    R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def true_pose(frame_index: int) -> np.ndarray:
    """What the fake estimator answers for a frame: a camera turning and moving sideways, in a world frame whose
    origin is not the first camera (the client must not assume it is)."""
    R = rot(1, 3.0 * frame_index) @ rot(0, 1.0 * frame_index)
    t = np.array([0.1 * frame_index, -0.05 * frame_index, 2.0])
    return np.concatenate([R, t[:, None]], 1)


def make_video(sample: int, num_frames: int = 10, h: int = 12, w: int = 20) -> np.ndarray:
    """(F, H, W, 3) uint8 whose red channel is 20 * sample everywhere (the fake server reads the sample from it)."""
    rng = np.random.default_rng(sample)
    video = rng.integers(0, 256, (num_frames, h, w, 3), dtype=np.uint8)
    video[..., 0] = 20 * sample
    return video


def decode(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


class FakePoseServer:
    """A pose estimator on 127.0.0.1 speaking the rewards/pose/served.py protocol, with a script per sample.

    script[sample] is a list of actions, one per attempt (the last repeats): ("poses", {position: reason}) answers
    true_pose for each sent frame, null at the given positions; ("json", obj) and ("raw", bytes) answer 200 with
    that body; ("status", code, headers); ("sleep", seconds) answers too late; ("drop",) closes the socket. It
    records every request (sample, time, body, Authorization) and the peak number in flight.
    """

    def __init__(self, script=None, default=("poses", {}), health_status=200, hold_s=0.0, max_seconds=20.0):
        self.script = script or {}
        self.default = default
        self.health_status = health_status
        self.hold_s = hold_s
        self.requests: list[dict] = []
        self.health_checks = 0
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    with server.lock:
                        server.health_checks += 1
                    self._send(server.health_status, {"status": "ok" if server.health_status == 200 else "down"})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/camera_poses":
                    self._send(404, {"error": "not found"})
                    return
                sample = round(int(decode(body["frames"][0])[0, 0, 0]) / 20)
                with server.lock:
                    n = sum(r["sample"] == sample for r in server.requests)
                    server.requests.append({"sample": sample, "time": time.monotonic(), "body": body,
                                            "auth": self.headers.get("Authorization")})
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                self._in_flight = True
                try:
                    if server.hold_s:
                        server.stop.wait(server.hold_s)
                    actions = server.script.get(sample, [server.default])
                    self._act(actions[min(n, len(actions) - 1)], body)
                finally:
                    self._done()

            def _done(self):
                # A request stops counting before its answer is written: once the client has the answer it may
                # send the next one, which a handler still on its way out would otherwise count as a 4th of 3.
                if getattr(self, "_in_flight", False):
                    self._in_flight = False
                    with server.lock:
                        server.in_flight -= 1

            def _act(self, action, body):
                kind = action[0]
                if kind == "poses":
                    nulls = action[1]
                    poses = [None if k in nulls else true_pose(i).tolist()
                             for k, i in enumerate(body["frame_indices"])]
                    reasons = [nulls.get(k) for k in range(len(poses))]
                    self._send(200, {"poses": poses, "reasons": reasons,
                                     "confidence": {"inlier_ratio": 0.9, "model": "fake-vggt"}})
                elif kind == "json":
                    self._send(200, action[1])
                elif kind == "raw":
                    self._raw(200, action[1])
                elif kind == "status":
                    self._send(action[1], {"error": f"scripted {action[1]}"}, action[2] if len(action) > 2 else {})
                elif kind == "sleep":  # past the client's timeout; the answer then goes into a closed socket
                    server.stop.wait(action[1])
                    self._send(200, {"poses": []})
                elif kind == "drop":
                    self.close_connection = True  # no status line, no body

            def _send(self, code, obj, headers=None):
                self._raw(code, json.dumps(obj).encode(), headers)

            def _raw(self, code, data, headers=None):
                self._done()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.loopback = LoopbackServer(Handler, self.stop, max_seconds)
        self.url = self.loopback.url

    def attempts(self, sample: int) -> int:
        return sum(r["sample"] == sample for r in self.requests)

    def close(self):
        self.loopback.close()


@pytest.fixture
def server_factory():
    servers = []

    def make(**kwargs):
        s = FakePoseServer(**kwargs)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def cam_config(url, **kw):
    """config.reward.cam as the run config holds it, with its served section pointing at `url`."""
    served = dict(base_url=url, timeout_s=2.0, max_retries=2, backoff_s=0.01, max_frames=4)
    served.update(kw)
    return ml_collections.ConfigDict({"estimator": "served", "served": served})


def estimator(url, **kw) -> ServedPoseEstimator:
    return build_estimator("served", cam_config(url, **kw))


def dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def assert_not_judged(est, num_frames: int, reason: str):
    """A video the estimator did not judge: no number anywhere a pose would be, and the reason on every frame."""
    assert est.unavailable and est.method == "served"
    assert est.poses.shape == (num_frames, 3, 4) and np.isnan(est.poses).all()
    assert not est.ok.any() and est.num_frames == num_frames
    assert reason in est.video_reason and all(r == est.video_reason for r in est.reasons)
    assert "\n" not in est.video_reason


# ----------------------------------------------------------------------------------------------------
# the round trip


def test_frames_sent_are_evenly_spaced_with_first_and_last():
    assert sent_frame_indices(10, 4) == [0, 3, 6, 9]
    assert sent_frame_indices(81, 16)[0] == 0 and sent_frame_indices(81, 16)[-1] == 80
    assert len(set(sent_frame_indices(17, 16))) == 16
    assert sent_frame_indices(3, 4) == [0, 1, 2]


def test_answer_round_trips_with_null_frames_and_unsent_frames(server_factory, monkeypatch):
    monkeypatch.setenv("POSE_API_KEY", "secret")
    server = server_factory(script={0: [("poses", {1: "low_confidence", 2: None})],
                                    2: [("poses", {0: "no_features", 1: "no_features", 2: None, 3: None})]})
    est_ = estimator(server.url, max_concurrency=2)
    videos = [make_video(0, 10), make_video(1, 3), make_video(2, 7, h=8, w=6)]
    Ks = [K, K * [[2], [2], [1]], K]
    try:
        results = est_.estimate(videos, Ks, [None] * 3)
    finally:
        est_.close()
    assert server.health_checks == 1 and len(server.requests) == 3
    assert [r["auth"] for r in server.requests] == ["Bearer secret"] * 3

    # what the server received
    bodies = {r["sample"]: r["body"] for r in server.requests}
    assert bodies[0]["frame_indices"] == [0, 3, 6, 9] and bodies[1]["frame_indices"] == [0, 1, 2]
    assert bodies[2]["frame_indices"] == [0, 2, 4, 6]
    assert (bodies[0]["height"], bodies[0]["width"]) == (12, 20) and (bodies[2]["height"], bodies[2]["width"]) == (8, 6)
    assert bodies[0]["intrinsics"] == K.tolist() and bodies[1]["intrinsics"] == Ks[1].tolist()
    for sample, body in bodies.items():
        assert len(body["frames"]) == len(body["frame_indices"])
        assert all(url.startswith("data:image/png;base64,") for url in body["frames"])
        sent = np.stack([decode(url) for url in body["frames"]])
        assert np.array_equal(sent, videos[sample][body["frame_indices"]])  # PNG: the frames themselves

    # what came back
    a, b, c = results
    assert not a.unavailable and a.video_reason is None and a.method == "served" and a.has_translation
    assert a.ok.tolist() == [True, False, False, False, False, False, False, False, False, True]
    for i in (0, 9):
        np.testing.assert_allclose(a.poses[i], true_pose(i), atol=1e-12)
    assert a.reasons[0] is None and a.reasons[9] is None
    assert a.reasons[3] == "low_confidence" and a.reasons[6] == NOT_REGISTERED  # null reason -> not_registered
    assert a.reasons[1] == NOT_SENT and a.reasons[5] == NOT_SENT
    assert np.isnan(a.poses[~a.ok]).all()
    assert a.confidence == {"inlier_ratio": 0.9, "frames_sent": 4.0}  # the non-number dropped
    assert a.seconds["request"] > 0 and "encode" in a.seconds

    assert b.ok.all() and b.confidence["frames_sent"] == 3.0
    np.testing.assert_allclose(b.poses, np.stack([true_pose(i) for i in range(3)]), atol=1e-12)

    # the estimator looked and placed nothing: judged (unavailable False), every frame NaN with a reason
    assert not c.unavailable and not c.ok.any() and np.isnan(c.poses).all()
    assert [c.reasons[i] for i in (0, 2, 4, 6)] == ["no_features", "no_features", NOT_REGISTERED, NOT_REGISTERED]
    assert c.reasons[1] == NOT_SENT and NOT_REGISTERED == "not_registered"
    assert c.video_reason == "no frame placed: no_features"


def test_scene_depth_gives_a_scale_free_parallax_that_cam_score_holds_against_a_still_target(server_factory):
    from rewards.cam_score import CamScore, CamScoreSettings

    still = [np.concatenate([np.eye(3), [[0.0], [0.0], [2.0]]], 1).tolist()] * 4
    # sideways by 0.1 per frame at a scene depth of 4: pairs 1, 2, 3 frames apart, three, two and one of them
    truck = [np.concatenate([np.eye(3), [[-0.1 * f], [0.0], [2.0]]], 1).tolist() for f in range(4)]
    server = server_factory(script={0: [("json", {"poses": still, "scene_depth": 4.0})],
                                    1: [("json", {"poses": truck, "scene_depth": 4.0})],
                                    2: [("json", {"poses": truck})]})
    est_ = estimator(server.url)
    try:
        results = est_.estimate([make_video(i, 4) for i in range(3)], [K] * 3, [None] * 3)
    finally:
        est_.close()
    tol = STILL_TOLERANCE  # what two frames may differ by relative to the depth without counting as a move
    by_hand = (3 * (0.1 / 4 - tol) + 2 * (0.2 / 4 - tol) + (0.3 / 4 - tol)) / 6
    assert results[0].parallax == 0.0 and results[1].parallax == pytest.approx(by_hand, rel=1e-12)
    assert math.isnan(results[2].parallax) and results[1].confidence["scene_depth"] == 4.0
    target = np.stack([np.concatenate([np.eye(3), np.zeros((3, 1))], 1)] * 4)  # a camera asked to stand still
    own = np.array(truck)
    scores, d = CamScore(CamScoreSettings()).score(results, [target, target, target])
    own_score, _ = CamScore(CamScoreSettings()).score(results[1:2], [own])
    assert float(scores[0]) >= 0.9 and float(own_score[0]) - float(scores[1]) >= 0.1
    # no scene depth: the still target's translation is unmeasured and scores its worst value
    assert d["translation"] == ["parallax", "parallax", "parallax_unknown"] and float(scores[2]) < float(scores[1])


def test_jpeg_frames_and_no_key_means_no_authorization(server_factory, monkeypatch):
    monkeypatch.delenv("POSE_API_KEY", raising=False)
    server = server_factory()
    est_ = estimator(server.url, image_format="jpeg", check_health=False)
    try:
        (res,) = est_.estimate([make_video(0, 5)], [K], [None])
    finally:
        est_.close()
    body = server.requests[0]["body"]
    assert server.health_checks == 0 and server.requests[0]["auth"] is None
    assert all(url.startswith("data:image/jpeg;base64,") for url in body["frames"])
    assert [decode(url).shape for url in body["frames"]] == [(12, 20, 3)] * 4
    assert res.ok.sum() == 4 and not res.unavailable


def test_nearly_orthonormal_rotation_is_projected_onto_a_rotation(server_factory):
    noisy = [(true_pose(i) + np.eye(3, 4) * 2e-4).tolist() for i in range(4)]
    server = server_factory(default=("json", {"poses": noisy}))
    est_ = estimator(server.url)
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert res.ok.all() and not res.unavailable
    R = res.poses[:, :, :3]
    np.testing.assert_allclose(R.transpose(0, 2, 1) @ R, np.broadcast_to(np.eye(3), (4, 3, 3)), atol=1e-12)
    np.testing.assert_allclose(res.poses, np.stack([true_pose(i) for i in range(4)]), atol=1e-3)
    np.testing.assert_array_equal(res.poses[:, :, 3], np.array(noisy)[:, :, 3])  # t kept as sent


def test_requests_run_concurrently_within_the_limit(server_factory):
    server = server_factory(hold_s=0.2)
    est_ = estimator(server.url, max_concurrency=3, timeout_s=30.0)
    try:
        results = est_.estimate([make_video(i, 4) for i in range(6)], [K] * 6, [None] * 6)
    finally:
        est_.close()
    assert all(r.ok.all() for r in results)
    assert 2 <= server.peak <= 3
    with pytest.raises(RuntimeError, match="closed"):
        est_.estimate([make_video(0, 4)], [K], [None])


def test_bad_input_is_reported_per_video_and_not_sent(server_factory):
    server = server_factory()
    est_ = estimator(server.url)
    videos = [make_video(0, 4), make_video(1, 4).astype(np.float32) / 255, make_video(2, 4)[..., :2],
              make_video(3, 4), make_video(4, 4)]
    Ks = [K, K, K, np.full((3, 3), np.nan), K[:2]]
    try:
        results = est_.estimate(videos, Ks, [None] * 5)
    finally:
        est_.close()
    assert results[0].ok.all() and [r["sample"] for r in server.requests] == [0]
    assert "uint8" in results[1].video_reason and "(F, H, W, 3)" in results[2].video_reason
    for r in results[1:]:
        assert_not_judged(r, 4, "bad_input: ")
    assert "intrinsics" in results[3].video_reason and "intrinsics" in results[4].video_reason
    with pytest.raises(ValueError, match="2 videos but 1 intrinsics"):
        estimator(server.url).estimate(videos[:2], [K], [None, None])


# ----------------------------------------------------------------------------------------------------
# retries and failures


def test_503_then_success_is_retried(server_factory):
    server = server_factory(script={0: [("status", 503), ("status", 502), ("poses", {})]})
    est_ = estimator(server.url, max_retries=2)
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert server.attempts(0) == 3 and res.ok.all() and not res.unavailable


@pytest.mark.parametrize("action, reason", [
    (("status", 503), "server_error: HTTP 503 (3 attempts)"),
    (("status", 429, {"Retry-After": "0"}), "rate_limited: HTTP 429 (3 attempts)"),
    (("drop",), "connection_error: "),
])
def test_failing_forever_is_unavailable_after_max_retries(server_factory, action, reason):
    server = server_factory(default=action)
    est_ = estimator(server.url, max_retries=2)
    try:
        results = est_.estimate([make_video(0, 6), make_video(1, 5)], [K, K], [None, None])
    finally:
        est_.close()
    assert server.attempts(0) == 3 and server.attempts(1) == 3  # the first try + max_retries
    assert_not_judged(results[0], 6, reason)
    assert_not_judged(results[1], 5, reason)
    assert results[0].confidence == {"frames_sent": 4.0} and results[0].seconds["request"] > 0


def test_429_honours_retry_after(server_factory):
    server = server_factory(script={0: [("status", 429, {"Retry-After": "0.4"}), ("poses", {})]})
    est_ = estimator(server.url, max_retries=1, backoff_s=0.001)
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert res.ok.all() and server.attempts(0) == 2
    assert server.requests[1]["time"] - server.requests[0]["time"] >= 0.38


def test_other_4xx_is_reported_at_once(server_factory):
    server = server_factory(script={1: [("status", 400)]})
    est_ = estimator(server.url, max_retries=3)
    try:
        results = est_.estimate([make_video(0, 4), make_video(1, 4)], [K, K], [None, None])
    finally:
        est_.close()
    assert server.attempts(1) == 1 and results[0].ok.all()
    assert_not_judged(results[1], 4, "http_error: HTTP 400 (not retried)")
    assert "scripted 400" in results[1].video_reason  # the server's own words, for the user


def test_timeout_is_unavailable(server_factory):
    server = server_factory(default=("sleep", 1.0))
    est_ = estimator(server.url, timeout_s=0.2, max_retries=1)
    t0 = time.monotonic()
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert time.monotonic() - t0 < 1.5
    assert server.attempts(0) == 2
    assert_not_judged(res, 4, "timeout: no answer within 0.2s (2 attempts)")


def test_server_gone_mid_run_is_unavailable_with_connection_error():
    est_ = estimator(dead_url(), check_health=False, max_retries=1)
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert_not_judged(res, 4, "connection_error: ConnectError")


GOOD = [true_pose(i).tolist() for i in range(4)]


def _with(index, pose):
    poses = [p for p in GOOD]
    poses[index] = pose
    return {"poses": poses}


@pytest.mark.parametrize("action, what", [
    (("raw", b"{not json"), "not JSON"),
    (("json", [GOOD]), "not a JSON object"),
    (("json", {"pose": GOOD}), "no 'poses' field"),
    (("json", {"poses": "none"}), "'poses' is not a list"),
    (("json", {"poses": GOOD[:3]}), "wrong number of poses: 3 for 4 frames sent"),
    (("json", _with(1, np.eye(4).tolist())), "poses[1] (frame 1) is not a 3x4 nested list (got 4x4)"),
    (("json", _with(2, GOOD[2][:2])), "poses[2] (frame 2) is not a 3x4 nested list (got 2x4)"),
    (("json", _with(0, [[str(x) for x in row] for row in GOOD[0]])), "values that are not numbers"),
    (("raw", json.dumps({"poses": GOOD}).replace("2.0", "NaN", 1).encode()), "non-finite values"),
    (("raw", json.dumps({"poses": GOOD}).replace("2.0", "Infinity", 1).encode()), "non-finite values"),
    (("json", _with(3, np.zeros((3, 4)).tolist())), "poses[3] (frame 3) rotation block is not orthonormal"),
    (("json", _with(1, (true_pose(1) * 2).tolist())), "rotation block is not orthonormal"),
    (("json", _with(2, np.diag([1.0, 1.0, -1.0, 0.0])[:3].tolist())), "rotation block is a reflection"),
    (("json", {"poses": GOOD, "reasons": [None]}), "'reasons' is not a list of 4"),
    (("json", {"poses": GOOD, "confidence": [0.9]}), "'confidence' is not an object"),
    (("json", {"poses": GOOD, "scene_depth": 0.0}), "'scene_depth' is not a finite number > 0"),
    (("json", {"poses": GOOD, "scene_depth": "4 m"}), "'scene_depth' is not a finite number > 0"),
])
def test_malformed_answers_are_unavailable_and_not_retried(server_factory, action, what):
    server = server_factory(default=action)
    est_ = estimator(server.url, max_retries=3)
    try:
        (res,) = est_.estimate([make_video(0, 4)], [K], [None])
    finally:
        est_.close()
    assert server.attempts(0) == 1  # the estimator would answer the same again
    assert_not_judged(res, 4, "malformed_answer: ")
    assert what in res.video_reason


# ----------------------------------------------------------------------------------------------------
# health check, registry, configuration


def test_health_check_when_nothing_listens_is_a_one_line_server_down():
    url = dead_url()
    with pytest.raises(PoseServerError) as err:
        build_estimator("served", cam_config(url))
    assert isinstance(err.value, RewardServerDown)
    message = str(err.value)
    assert "\n" not in message and f"{url}/health" in message and "unreachable" in message
    assert "reward.cam.served.base_url" in message  # says what to fix


def test_health_check_not_ready_and_ready(server_factory):
    down = server_factory(health_status=503)
    with pytest.raises(PoseServerError, match=re.escape(f"{down.url}/health") + ".*HTTP 503"):
        estimator(down.url)
    assert down.requests == []
    up = server_factory()
    est_ = estimator(up.url + "/v1/")
    try:
        assert up.health_checks == 1 and up.requests == []  # no video sent to check health
        line = est_.describe()
        assert "\n" not in line and f"{up.url}/v1/camera_poses" in line and "4 frames" in line
    finally:
        est_.close()


def test_registered_under_served():
    assert "served" in known_estimators()
    assert isinstance(build_estimator("served", cam_config(dead_url(), check_health=False)), ServedPoseEstimator)


def test_config_defaults_and_sections():
    assert served_config(None) == ServedPoseConfig()
    assert served_config(ml_collections.ConfigDict({"estimator": "served"})) == ServedPoseConfig()
    c = served_config({"served": {"base_url": "http://h:1", "max_frames": 8}})
    assert (c.base_url, c.max_frames, c.timeout_s, c.max_retries, c.max_concurrency) == ("http://h:1", 8, 60.0, 3, 4)
    assert (c.backoff_s, c.image_format, c.api_key_env, c.check_health) == (1.0, "png", "POSE_API_KEY", True)
    with pytest.raises(ValueError, match=r"reward\.cam\.served has unknown field\(s\) \['max_frame'\]"):
        served_config({"served": {"max_frame": 8}})


@pytest.mark.parametrize("field, value", [
    ("base_url", "127.0.0.1:30100"), ("timeout_s", 0), ("timeout_s", math.inf), ("max_retries", -1),
    ("max_retries", 1.5), ("backoff_s", -0.1), ("max_concurrency", 0), ("max_frames", 1),
    ("image_format", "webp"), ("api_key_env", None), ("check_health", "yes"),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError) as err:
        ServedPoseConfig(**{field: value})
    message = str(err.value)
    assert message.startswith(f"reward.cam.served.{field} must be ") and "\n" not in message
