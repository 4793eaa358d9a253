"""Both reward-server clients (the UnifiedReward judge, the served pose estimator) against servers that misbehave
at the HTTP level: answers that trickle, answers that never end, JSON nested too deep, numbers out of range. Each is
a failed answer within the request's overall deadline, never a hang or an exception."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler

import ml_collections
import numpy as np
import pytest
import torch

from recam.engine.reward_runner import AsyncRewardRunner, RewardServerDown
from rewards.pose import build_estimator
from rewards.pose.served import MAX_ANSWER_BYTES, PoseServerError
from rewards.unified import MAX_BODY_BYTES, UnifiedConfig, UnifiedReward, UnifiedServerError, health_check
from tests.loopback import LoopbackServer

TIMEOUT = 1.0
SLACK = 1.0  # thread start-up and the retry bookkeeping on a loaded two-core machine
HUGE = 200 << 20
POSE = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


class MisbehavingServer:
    """An HTTP server on 127.0.0.1 that answers every request (any path, GET or POST) with `action`:
    ("trickle", gap_s): a 200 header, then the body one byte every gap_s; ("trickle_headers", gap_s): the status
    line, then the headers one byte every gap_s; ("huge", declare): a 200 MB body streamed as fast as the client
    takes it, its Content-Length sent when `declare`; ("body", bytes): that body. `sent` holds the body bytes each
    answer wrote before it ended or the client hung up."""

    def __init__(self, action, max_seconds=30.0):
        self.action = action
        self.sent: list[int] = []
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer()

            def _answer(self):
                kind, arg = server.action
                sent = 0
                try:
                    if kind == "trickle_headers":
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                        for byte in b"X-Slow: " + b"a" * 1000:
                            if server.stop.wait(arg):
                                return
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if kind == "body":
                        self.send_header("Content-Length", str(len(arg)))
                        self.end_headers()
                        self.wfile.write(arg)
                        sent = len(arg)
                    elif kind == "trickle":
                        self.send_header("Content-Length", "1000")
                        self.end_headers()
                        self.wfile.flush()
                        for _ in range(1000):
                            if server.stop.wait(arg):
                                return
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            sent += 1
                    elif kind == "huge":
                        if arg:
                            self.send_header("Content-Length", str(HUGE))
                        self.end_headers()
                        chunk = b" " * 65536
                        while sent < HUGE and not server.stop.is_set():
                            self.wfile.write(chunk)
                            sent += len(chunk)
                except OSError:
                    pass  # the client hung up: what these tests want
                finally:
                    server.sent.append(sent)
                    self.close_connection = True

        self.loopback = LoopbackServer(Handler, self.stop, max_seconds)
        self.url = self.loopback.url

    def close(self):
        self.loopback.close()


@pytest.fixture
def serve():
    servers = []

    def make(action):
        servers.append(MisbehavingServer(action))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def judge(url, **kw) -> UnifiedReward:
    settings = dict(base_url=url, model="m", num_frames=2, frame_size=16, timeout_s=TIMEOUT, max_retries=0,
                    backoff_s=0.0)
    settings.update(kw)
    return UnifiedReward(UnifiedConfig(**settings), check_health=False)


def judge_once(url, **kw):
    reward = judge(url, **kw)
    try:
        scores, details = reward(torch.zeros(1, 3, 2, 8, 8), ["a caption"])
    finally:
        reward.close()
    return scores[0].item(), details["failure_reason"][0]


def pose_estimator(url, **kw):
    served = dict(base_url=url, timeout_s=TIMEOUT, max_retries=0, backoff_s=0.0, max_frames=4, check_health=False)
    served.update(kw)
    return build_estimator("served", ml_collections.ConfigDict({"estimator": "served", "served": served}))


def pose_once(url, frames=2, **kw):
    est = pose_estimator(url, **kw)
    try:
        (res,) = est.estimate([np.zeros((frames, 8, 8, 3), np.uint8)], [np.eye(3)], [None])
    finally:
        est.close()
    return res


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


# ----------------------------------------------------------------------------------------------------
# the overall deadline


@pytest.mark.parametrize("kind", ["trickle", "trickle_headers"])
def test_a_trickling_judge_fails_the_request_at_its_deadline(serve, kind):
    server = serve((kind, 0.2))  # every read is answered within 0.2 s: a per-read timeout of 1 s never fires
    (score, reason), seconds = timed(judge_once, server.url)
    assert math.isnan(score) and "timeout" in reason and f"{TIMEOUT}s" in reason and server.url in reason
    assert TIMEOUT * 0.9 <= seconds < TIMEOUT + SLACK


@pytest.mark.parametrize("kind", ["trickle", "trickle_headers"])
def test_a_trickling_pose_server_fails_the_request_at_its_deadline(serve, kind):
    server = serve((kind, 0.2))
    res, seconds = timed(pose_once, server.url, max_retries=1)
    assert res.unavailable and res.video_reason.startswith(f"timeout: no answer within {TIMEOUT}s (2 attempts)")
    assert 2 * TIMEOUT * 0.9 <= seconds < 2 * TIMEOUT + SLACK  # each of the two attempts had its own deadline


def test_a_trickling_judge_mid_run_becomes_server_down_after_the_runners_retries(serve):
    """The reward's retry rules apply to a trickling judge as to a dead one: the runner's rounds, then
    RewardServerDown naming the judge (the trainer stops on it, exit 3)."""
    server = serve(("trickle", 0.2))
    reward = judge(server.url, max_retries=0)
    runner = AsyncRewardRunner(reward, failure_policy="wait", max_retries=1, sleep=lambda s: None)
    t0 = time.monotonic()
    try:
        runner.submit(0, torch.zeros(2, 3, 2, 8, 8), ["a", "b"])
        with pytest.raises(RewardServerDown) as err:
            runner.collect()
    finally:
        runner.close()
        reward.close()
    assert time.monotonic() - t0 < 2 * TIMEOUT + 2 * SLACK  # two rounds, the two samples of each in parallel
    assert "timeout" in str(err.value) and server.url in str(err.value) and "\n" not in str(err.value)


def test_health_checks_of_a_trickling_server_end_at_the_deadline_in_one_line(serve):
    server = serve(("trickle_headers", 0.2))
    t0 = time.monotonic()
    with pytest.raises(UnifiedServerError, match="did not answer in time"):
        health_check(UnifiedConfig(base_url=server.url, model="m", timeout_s=TIMEOUT))
    with pytest.raises(PoseServerError, match="did not answer in time"):
        pose_estimator(server.url, check_health=True)
    assert time.monotonic() - t0 < 2 * (TIMEOUT + SLACK)


# ----------------------------------------------------------------------------------------------------
# the byte cap


@pytest.mark.parametrize("declare", [True, False])
def test_a_200_mb_answer_is_cut_at_the_cap_without_reading_it(serve, declare):
    judge_server = serve(("huge", declare))
    score, reason = judge_once(judge_server.url, timeout_s=20.0)
    assert math.isnan(score) and f"{MAX_BODY_BYTES}-byte cap" in reason
    pose_server = serve(("huge", declare))
    res = pose_once(pose_server.url, timeout_s=20.0)
    assert res.unavailable and "malformed_answer: answer body" in res.video_reason
    assert f"{MAX_ANSWER_BYTES}-byte cap" in res.video_reason
    for server in (judge_server, pose_server):
        server.close()  # the handler's last write fails once the client is gone; its count is then final
        # socket buffers hold a few MB at most: nowhere near the 200 MB the server would have sent
        assert max(server.sent) < 4 * MAX_ANSWER_BYTES


# ----------------------------------------------------------------------------------------------------
# what the answer holds


DEEP = b"[" * 200_000 + b"]" * 200_000


def test_deeply_nested_json_is_a_failed_answer_for_both_clients(serve):
    server = serve(("body", DEEP))
    score, reason = judge_once(server.url)
    assert math.isnan(score) and "malformed response body" in reason
    res = pose_once(server.url)
    assert res.unavailable and res.video_reason.startswith("malformed_answer: ")


@pytest.mark.parametrize("answer, what", [
    ({"poses": [POSE, [[*r[:3], 1e300] for r in POSE]], "scene_depth": 1.0}, "translation 1e+300 is beyond"),
    ({"poses": [POSE, [[*r[:3], 1.0] for r in POSE]], "scene_depth": 1e-310}, "non-finite parallax"),
])
def test_absurd_pose_numbers_are_a_failed_answer(serve, answer, what):
    res = pose_once(serve(("body", json.dumps(answer).encode())).url)
    assert res.unavailable and res.video_reason.startswith("malformed_answer: ") and what in res.video_reason
    assert math.isnan(res.parallax)


def test_a_plain_large_translation_is_still_a_pose(serve):
    answer = {"poses": [POSE, [[*r[:3], 1e6] for r in POSE]], "scene_depth": 1e6, "confidence": {"x": 1e400}}
    res = pose_once(serve(("body", json.dumps(answer).replace("1e+400", "Infinity").encode())).url)
    assert not res.unavailable and res.ok.all() and math.isfinite(res.parallax) and "x" not in res.confidence
