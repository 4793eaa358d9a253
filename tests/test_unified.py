import base64
import gzip
import io
import json
import math
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

import pytest
import torch
from PIL import Image

from rewards import build_reward
from rewards.unified import (
    UnifiedClient,
    UnifiedConfig,
    UnifiedParseError,
    UnifiedReward,
    UnifiedServerError,
    build_payload,
    build_unifiedscore,
    health_check,
    parse_answer,
    sample_frame_indices,
)
from tests.loopback import LoopbackServer

MODEL = "UnifiedReward-test"
FINAL_ANSWER = ("The frames follow the description closely; the camera pans smoothly and the spheres stay "
                "consistent.\n\n**Final Score:** 4")
APS_ANSWER = ("The content matches the caption.\nAlignment Score (1-5): 5\nPhysics Score (1-5): 3\n"
              "Style Score (1-5): 4.5\nOverall the video is good.")


class FakeJudge:
    """OpenAI-compatible server on 127.0.0.1 with a script per sample.

    The sample is identified by the "id-N" tag in the caption; script[N] is a list of actions, one per
    attempt (the last repeats): ("answer", text), ("status", code), ("sleep", seconds), ("drop",),
    ("bad_json",), ("huge", size, declare_length). It counts requests per sample and the peak number of requests
    in flight, and its serving loop ends by itself after max_seconds or max_requests.
    """

    def __init__(self, script=None, default=("answer", FINAL_ANSWER), hold_s=0.0, max_seconds=20.0,
                 max_requests=200):
        self.script = script or {}
        self.default = default
        self.hold_s = hold_s
        self.attempts: dict[int, int] = {}
        self.auth: list[str | None] = []
        self.encodings: list[str | None] = []  # the Accept-Encoding of each "gzip" request
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak = 0
        self.health_checks = 0
        self.sent: list[int] = []  # bytes of each "huge" answer written before it ended or the client hung up
        self.lock = threading.Lock()
        self.stop = threading.Event()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/v1/models":
                    with judge.lock:
                        judge.health_checks += 1
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.in_flight += 1
                    judge.peak = max(judge.peak, judge.in_flight)
                    judge.bodies.append(body)
                    judge.auth.append(self.headers.get("Authorization"))
                    text = body["messages"][0]["content"][-1]["text"]
                    sample = int(re.search(r"id-(\d+)", text).group(1))
                    n = judge.attempts.get(sample, 0)
                    judge.attempts[sample] = n + 1
                try:
                    if judge.hold_s:
                        judge.stop.wait(judge.hold_s)
                    actions = judge.script.get(sample, [judge.default])
                finally:
                    # Out of flight before the answer is written: once the client has it, it may send the next
                    # request at once, and a server thread descheduled between writing and counting (a loaded
                    # machine) would count both.
                    with judge.lock:
                        judge.in_flight -= 1
                self._act(actions[min(n, len(actions) - 1)])

            def _act(self, action):
                kind = action[0]
                if kind == "answer":
                    self._send(200, {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": action[1]},
                         "finish_reason": "stop"}]})
                elif kind == "status":
                    self._send(action[1], {"error": {"message": f"scripted {action[1]}"}})
                elif kind == "sleep":  # longer than the client's timeout; then answer into a closed socket
                    judge.stop.wait(action[1])
                    self._send(200, {"choices": [{"message": {"content": FINAL_ANSWER}}]})
                elif kind == "drop":
                    self.close_connection = True  # no status line, no body: the socket just closes
                elif kind == "bad_json":
                    self._raw(200, b"{not json")
                elif kind == "huge":  # a valid answer padded to `size` bytes, with or without its Content-Length
                    self._huge(action[1], action[2])
                elif kind == "gzip":  # a valid answer padded to `size` bytes, sent gzipped though not asked for
                    answer = json.dumps({"choices": [{"message": {"content": "Final Score: 4"}}]}).encode()
                    data = gzip.compress(answer[:-1] + b" " * (action[1] - len(answer)) + b"}")
                    judge.encodings.append(self.headers.get("Accept-Encoding"))
                    self.send_response(200)
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def _huge(self, size, declare_length):
                head = b'{"choices": [{"message": {"role": "assistant", "content": "'
                tail = b'Final Score: 4"}}]}'
                chunk = b"a" * 65536
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if declare_length:
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                sent = 0
                try:  # written lazily, chunk by chunk, until done or the client hangs up
                    for part in [head] + [chunk] * ((size - len(head) - len(tail)) // len(chunk)):
                        self.wfile.write(part)
                        sent += len(part)
                    pad = size - sent - len(tail)
                    self.wfile.write(b"a" * pad + tail)
                    sent += pad + len(tail)
                except OSError:
                    pass
                finally:
                    with judge.lock:
                        judge.sent.append(sent)
                self.close_connection = True

            def _send(self, code, obj):
                self._raw(code, json.dumps(obj).encode())

            def _raw(self, code, data):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.loopback = LoopbackServer(Handler, self.stop, max_seconds, max_requests)
        self.url = self.loopback.url

    def close(self):
        self.loopback.close()


@pytest.fixture
def judge_factory():
    judges = []

    def make(**kwargs):
        j = FakeJudge(**kwargs)
        judges.append(j)
        return j

    yield make
    for j in judges:
        j.close()


def videos(b, frames=6, size=16):
    return torch.rand(b, 3, frames, size, size, generator=torch.Generator().manual_seed(b)) * 2 - 1


def captions(b):
    return [f"id-{i} orbit around the red sphere" for i in range(b)]


def config(url, **kw):
    base = dict(base_url=url, model=MODEL, timeout_s=2.0, max_retries=2, backoff_s=0.01, frame_size=32)
    base.update(kw)
    return UnifiedConfig(**base)


# ----------------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("text, raw", [
    ("Final Score: 4", 4.0),
    ("final score:3", 3.0),
    ("FINAL SCORE :  5", 5.0),
    ("**Final Score:** 2", 2.0),
    ("**Final Score: 4.5**", 4.5),
    ("Final Score: **3**.", 3.0),
    ("Final Score: 4/5", 4.0),
    ("Final Score (1-5): 1", 1.0),
    ("Reasoning ... I'd say Final Score: 2 at first.\nFinal Score: 3 after checking.", 3.0),
    ("Final Score: 3,5 (good motion)", 3.5),
    ("Final_Score = 4 -- trailing text", 4.0),
])
def test_parse_final_score_variants(text, raw):
    score, components = parse_answer(text, "final_score")
    assert score == pytest.approx((raw - 1) / 4)
    assert components == {}


@pytest.mark.parametrize("text", [
    "", "   ", "The video is great.", "Final Score: X", "Final Score: 7", "Final Score: 0",
    "Final Score: 8/10", "Score: 4", "Final Score: -2",
])
def test_parse_final_score_failures(text):
    with pytest.raises(UnifiedParseError):
        parse_answer(text, "final_score")


@pytest.mark.parametrize("text, raw", [
    ("Final Score: 4 out of 5", 4.0),
    ("Final Score: 4.5 / 5.", 4.5),
    ("Final Score: 4 (1-5)", 4.0),
    ("Final Score: 3, because the camera drifts", 3.0),
    ("Final Score (overall): 2", 2.0),
    ("Final Score: 4 (on a scale of 1 to 5)", 4.0),
    ("Final Score: 4 on the whole", 4.0),
    ("Final Score: 2/5 and fine", 2.0),
])
def test_parse_in_range_scores_stated_on_the_1_5_scale(text, raw):
    assert parse_answer(text, "final_score")[0] == pytest.approx((raw - 1) / 4)


@pytest.mark.parametrize("text, why", [
    ("Final Score: 1e10", "not a plain number"),  # read as 1 -> 0.0 before
    ("Final Score: 1,000", "not a plain number"),  # read as 1,000 = 1.0 -> 0.0
    ("Final Score: 1.5e3", "not a plain number"),  # read as 1.5 -> 0.125
    ("Final Score: 1e+10", "not a plain number"),
    ("Final Score: 4th", "not a plain number"),
    ("Final Score: +4", "not a plain number"),
    ("Final Score: 4 out of 10", "scale out of 10"),  # read as 4 -> 0.75
    ("Final Score: 4 on a 10-point scale", "scale out of 10"),
    ("Final Score (1-10): 4", "scale 1-10"),
    ("Final Score: 4 (0-5)", "scale 0-5"),
    ("Final Score: 4-5", "range"),
    # another scale or number after the value, which the scale patterns do not name: each read as 4 -> 0.75 before
    ("Final Score: 4 out of ten", "followed by 'out of ten'"),
    ("Final Score: 4 points out of 10", "followed by"),
    ("Final Score: 4 out of a possible 10", "followed by"),
    ("Final Score: 4 (scale 1-10)", "followed by"),
    ("Final Score: 4 — on a 1-10 scale", "followed by"),
    ("Final Score: 4 on a ten-point scale", "followed by"),
    ("Final Score: 4／10", "followed by"),
    ("Final Score: 4 ⁄ 10", "followed by"),
    ("Final Score: 4**/**10", "followed by"),
    ("Final Score: 4/5/10", "followed by '/10'"),
    ("Final Score: 3 or 4", "followed by 'or 4'"),
    ("Final Score: 4 %", "followed by"),
    ("Final Score: 3_0", "another number"),
    ("Final Score: 3. The camera shakes in 2 places", "another number"),
    ("Final Score: 3\nOn reflection, Final Score: 1e10", "not a plain number"),  # the last label counts, not 3
    ("Final Score: 2 first.\nFinal Score: X", "'X'"),
    ("Final Score:", "no number"),
])
def test_parse_refuses_other_notations_and_scales(text, why):
    with pytest.raises(UnifiedParseError, match=why):
        parse_answer(text, "final_score")


def test_parse_aspects_are_held_to_the_same_notation():
    with pytest.raises(UnifiedParseError, match="Physics.*not a plain number"):
        parse_answer(APS_ANSWER.replace("Physics Score (1-5): 3", "Physics Score (1-5): 1e10"),
                     "alignment_physics_style")
    with pytest.raises(UnifiedParseError, match="Style.*scale 1-10"):
        parse_answer(APS_ANSWER.replace("Style Score (1-5): 4.5", "Style Score (1-10): 4.5"),
                     "alignment_physics_style")


def test_aspects_on_one_line_are_each_their_own_label_s():
    # the digit after Alignment's value belongs to the next label, not to Alignment
    score, comp = parse_answer("Alignment Score (1-5): 4 Physics Score (1-5): 3 Style Score (1-5): 5",
                               "alignment_physics_style")
    assert comp == pytest.approx({"alignment": 0.75, "physics": 0.5, "style": 1.0})


def test_parse_alignment_physics_style():
    score, comp = parse_answer(APS_ANSWER, "alignment_physics_style")
    assert comp == pytest.approx({"alignment": 1.0, "physics": 0.5, "style": 0.875})
    assert score == pytest.approx((1.0 + 0.5 + 0.875) / 3)
    md = "**Alignment Score (1-5):** 2\n**physics score (1–5)**: 2/5\n*Style Score*: 1"
    score, comp = parse_answer(md, "alignment_physics_style")
    assert comp == pytest.approx({"alignment": 0.25, "physics": 0.25, "style": 0.0})
    with pytest.raises(UnifiedParseError, match="Physics"):
        parse_answer("Alignment Score (1-5): 4\nStyle Score (1-5): 4", "alignment_physics_style")


# ----------------------------------------------------------------------------------------------------
# payload


def test_frame_indices_and_payload():
    assert sample_frame_indices(9, 3) == [0, 4, 8]
    assert sample_frame_indices(6, 4) == [0, 2, 3, 5]
    assert sample_frame_indices(2, 4) == [0, 1]
    assert sample_frame_indices(5, 1) == [0]
    v = torch.full((3, 5, 16, 32), -1.0)
    v[:, 4] = 1.0  # last frame white, the rest black
    cfg = config("http://127.0.0.1:1/v1", num_frames=3, frame_size=64)
    payload = build_payload(v, "a caption", cfg)
    assert payload["temperature"] == 0 and payload["model"] == MODEL
    parts = payload["messages"][0]["content"]
    images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert len(images) == 3 and parts[-1]["type"] == "text" and "a caption" in parts[-1]["text"]
    decoded = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in images]
    assert all(u.startswith("data:image/png;base64,") for u in images)
    assert [im.size for im in decoded] == [(64, 32)] * 3  # (width, height): longer side 64, aspect kept
    assert decoded[0].getpixel((5, 5)) == (0, 0, 0) and decoded[2].getpixel((5, 5)) == (255, 255, 255)
    assert cfg.chat_url == "http://127.0.0.1:1/v1/chat/completions"
    jpeg = build_payload(v, "c", config("http://h", image_format="jpeg"))
    assert jpeg["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/jpeg;base64,")


# ----------------------------------------------------------------------------------------------------
# against the local server


def test_realistic_answers_both_formats(judge_factory, monkeypatch):
    monkeypatch.setenv("UNIFIED_API_KEY", "secret")
    judge = judge_factory()
    with UnifiedClient(config(judge.url)) as client:
        scores, details = client.score_batch(videos(3), captions(3))
    assert scores.dtype == torch.float32 and torch.allclose(scores, torch.full((3,), 0.75))
    assert not details["failed"].any() and details["raw"] == [FINAL_ANSWER] * 3
    assert details["failure_reason"] == [None] * 3
    assert judge.auth == ["Bearer secret"] * 3
    assert all(len(b["messages"][0]["content"]) == 5 for b in judge.bodies)  # 4 frames + text

    monkeypatch.delenv("UNIFIED_API_KEY")
    judge2 = judge_factory(default=("answer", APS_ANSWER))
    with UnifiedClient(config(judge2.url, prompt_format="alignment_physics_style")) as client:
        scores, details = client.score_batch(videos(2), captions(2))
    assert torch.allclose(scores, torch.full((2,), (1.0 + 0.5 + 0.875) / 3))
    assert torch.allclose(details["physics"], torch.full((2,), 0.5))
    assert torch.allclose(details["style"], torch.full((2,), 0.875))
    assert judge2.auth == [None, None]
    assert "Alignment Score (1-5)" in judge2.bodies[0]["messages"][0]["content"][-1]["text"]


def test_malformed_answers_are_failures_not_zero(judge_factory):
    judge = judge_factory(script={1: [("answer", "I cannot rate this video.")], 2: [("bad_json",)],
                                  3: [("answer", "Final Score: 9")]})
    with UnifiedClient(config(judge.url)) as client:
        scores, details = client.score_batch(videos(4), captions(4))
    assert scores[0].item() == pytest.approx(0.75)
    assert torch.isnan(scores[1:]).all()  # never 0
    assert details["failed"].tolist() == [False, True, True, True]
    assert details["raw"][1] == "I cannot rate this video."  # raw text kept
    assert "unparseable" in details["failure_reason"][1]
    assert details["raw"][2] == "{not json" and "malformed" in details["failure_reason"][2]
    assert "outside the 1-5 scale" in details["failure_reason"][3]
    assert judge.attempts == {0: 1, 1: 1, 2: 1, 3: 1}  # deterministic answers are not re-asked


def test_an_answer_body_over_the_cap_is_a_failure_naming_its_size(judge_factory):
    # 3 MB declared by its Content-Length, and 48 MB streamed without one: valid answers ("Final Score: 4") that
    # the client must neither score nor read whole.
    from rewards.unified import MAX_BODY_BYTES

    streamed = 48 << 20
    judge = judge_factory(script={1: [("huge", 3_000_000, True)], 2: [("huge", streamed, False)]})
    with UnifiedClient(config(judge.url)) as client:
        scores, details = client.score_batch(videos(3), captions(3))
    assert scores[0].item() == pytest.approx(0.75)
    assert torch.isnan(scores[1:]).all() and details["failed"].tolist() == [False, True, True]
    assert "answer body of 3000000 bytes" in details["failure_reason"][1]
    assert f"over the {MAX_BODY_BYTES}-byte cap" in details["failure_reason"][2]
    assert "no Content-Length" in details["failure_reason"][2]
    assert details["raw"][1:] == [None, None]
    assert judge.attempts == {0: 1, 1: 1, 2: 1}  # the same oversized answer again would not help
    deadline = time.monotonic() + 5
    while len(judge.sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(judge.sent) == 2 and max(judge.sent) < streamed  # the client hung up instead of reading it all


def test_a_compressed_answer_body_is_refused_unread(judge_factory):
    # 60 MB of answer in about 60 KB of gzip: decoded, it was one 60 MB chunk in memory before the cap counted it
    judge = judge_factory(script={1: [("gzip", 60 << 20)]})
    with UnifiedClient(config(judge.url)) as client:
        scores, details = client.score_batch(videos(2), captions(2))
    assert scores[0].item() == pytest.approx(0.75) and math.isnan(scores[1].item())
    assert details["failure_reason"][1] == ("answer body sent with Content-Encoding 'gzip', which was not asked for; "
                                            "not read")
    assert judge.encodings == ["identity"] and judge.attempts == {0: 1, 1: 1}


def test_an_out_of_scale_answer_is_retried_by_the_runner_then_excluded(judge_factory):
    from recam.engine.reward_runner import AsyncRewardRunner

    judge = judge_factory(script={0: [("answer", "Final Score: 1e10"), ("answer", "Final Score: 4")],
                                  1: [("answer", "Final Score: 4 out of 10")]})
    reward = UnifiedReward(config(judge.url, max_retries=0), check_health=False)
    with AsyncRewardRunner(reward, failure_policy="wait", max_retries=1, sleep=lambda s: None) as runner:
        runner.submit(0, videos(3), captions(3))
        (r,) = runner.collect()
    reward.close()
    assert r.valid.tolist() == [True, False, True]
    assert r.scores[0].item() == pytest.approx(0.75) and math.isnan(r.scores[1].item())  # never 0.75 or 0.0
    assert "scale out of 10" in r.reasons[1]
    assert judge.attempts == {0: 2, 1: 2, 2: 1}


def test_slow_answer_times_out_then_retry_succeeds(judge_factory):
    judge = judge_factory(script={0: [("sleep", 1.0), ("answer", FINAL_ANSWER)], 1: [("sleep", 1.0)]})
    t0 = time.monotonic()
    with UnifiedClient(config(judge.url, timeout_s=0.25, max_retries=1)) as client:
        scores, details = client.score_batch(videos(2), captions(2))
    assert time.monotonic() - t0 < 3.0
    assert scores[0].item() == pytest.approx(0.75) and details["attempts"][0].item() == 2
    assert math.isnan(scores[1].item()) and "timeout" in details["failure_reason"][1]
    assert details["raw"][1] is None and details["attempts"][1].item() == 2


def test_http_500_retried_then_succeeds_or_gives_up(judge_factory):
    judge = judge_factory(script={0: [("status", 500), ("status", 503), ("answer", FINAL_ANSWER)],
                                  1: [("status", 500)]})
    with UnifiedClient(config(judge.url, max_retries=2)) as client:
        scores, details = client.score_batch(videos(2), captions(2))
    assert scores[0].item() == pytest.approx(0.75) and details["attempts"][0].item() == 3
    assert math.isnan(scores[1].item())
    assert judge.attempts[1] == 3  # first try + max_retries
    assert "gave up after 3 attempts" in details["failure_reason"][1] and "HTTP 500" in details["failure_reason"][1]


def test_dropped_connection_and_429_are_retried_other_4xx_not(judge_factory):
    judge = judge_factory(script={0: [("drop",), ("answer", FINAL_ANSWER)],
                                  1: [("status", 429), ("answer", "Final Score: 5")],
                                  2: [("status", 400)], 3: [("drop",)]})
    with UnifiedClient(config(judge.url, max_retries=2)) as client:
        scores, details = client.score_batch(videos(4), captions(4))
    assert scores[:2].tolist() == pytest.approx([0.75, 1.0])
    assert details["attempts"][:2].tolist() == [2, 2]
    assert math.isnan(scores[2].item()) and judge.attempts[2] == 1
    assert "HTTP 400 (not retried)" in details["failure_reason"][2]
    assert math.isnan(scores[3].item()) and judge.attempts[3] == 3
    assert "connection error" in details["failure_reason"][3]


def test_concurrency_limit_respected(judge_factory):
    judge = judge_factory(hold_s=0.15)
    # A long timeout: on a loaded machine a timed-out request would be retried while the server still holds the
    # abandoned one, and the server would count both.
    with UnifiedClient(config(judge.url, max_concurrency=3, timeout_s=60.0)) as client:
        scores, _ = client.score_batch(videos(9), captions(9))
    assert torch.isfinite(scores).all()
    assert 2 <= judge.peak <= 3  # parallel, but never above the limit


def test_health_check(judge_factory):
    judge = judge_factory()
    assert health_check(config(judge.url + "/v1")) == [MODEL]
    with pytest.raises(UnifiedServerError, match="not served"):
        health_check(config(judge.url, model="other"))
    assert health_check(config(judge.url, model="other"), check_model=False) == [MODEL]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(UnifiedServerError, match=re.escape(f"{url}/v1/models")) as err:
        health_check(config(url))
    assert "unreachable" in str(err.value)


def run_config(url, **kw):
    """A run config (config/base.py) whose reward.unified section points at `url`."""
    from config.base import get_config

    c = get_config()
    c.reward.unified.update({**dict(base_url=url, model=MODEL, timeout_s=2.0, max_retries=2, frame_size=32), **kw})
    return c


class Cond:
    def __init__(self, caption):
        self.caption = caption


def test_factory_builds_a_judge_object_from_the_run_config(judge_factory):
    judge = judge_factory(script={1: [("answer", "no score here")]})
    reward = build_reward("unifiedscore", run_config(judge.url, num_frames=3))
    try:
        assert isinstance(reward, UnifiedReward) and reward.served_models == [MODEL]
        assert (reward.config.base_url, reward.config.num_frames, reward.config.frame_size) == (judge.url, 3, 32)
        scores, details = reward(videos(2), [Cond(c) for c in captions(2)])
    finally:
        reward.close()
    assert scores[0].item() == pytest.approx(0.75) and math.isnan(scores[1].item())
    assert details["failed"].tolist() == [False, True]
    assert all(len(body["messages"][0]["content"]) == 3 + 1 for body in judge.bodies)  # 3 frames + the prompt
    with pytest.raises(RuntimeError, match="closed"):
        reward(videos(1), captions(1))


def test_two_judges_side_by_side_each_keep_their_own_server(judge_factory):
    # No module state: a second judge object (another run, a test) cannot redirect the first one's requests.
    first, second = judge_factory(), judge_factory(default=("answer", "Final Score: 2"))
    a = build_reward("unifiedscore", run_config(first.url))
    b = build_reward("unifiedscore", run_config(second.url))
    try:
        scores_a, _ = a(videos(2), captions(2))
        scores_b, _ = b(videos(3), captions(3))
        scores_a2, _ = a(videos(1), captions(1))
    finally:
        a.close()
        b.close()
    assert scores_a.tolist() + scores_a2.tolist() == pytest.approx([0.75] * 3)
    assert scores_b.tolist() == pytest.approx([0.25] * 3)
    assert len(first.bodies) == 3 and len(second.bodies) == 3


def test_factory_health_checks_before_anything_is_scored(judge_factory):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(UnifiedServerError, match=re.escape(f"127.0.0.1:{port}/v1/models")):
        build_reward("unifiedscore", run_config(f"http://127.0.0.1:{port}"))
    judge = judge_factory()
    with pytest.raises(UnifiedServerError, match="not served"):
        build_reward("unifiedscore", run_config(judge.url, model="other", check_model=True))
    build_reward("unifiedscore", run_config(judge.url, model="other", check_model=False)).close()
    assert judge.bodies == []  # health checks only: no video was sent
    with pytest.raises(ValueError, match="reward.unified"):
        build_reward("unifiedscore", None)


def test_concurrent_calls_share_the_connection_limit_and_queueing_is_not_a_timeout(judge_factory):
    # One connection, six callers (async reward workers and evaluation share one judge object), each request
    # held 0.3 s: the last caller waits ~1.5 s for the connection, longer than timeout_s. That wait must neither
    # fail nor count as an attempt; only the server's own slowness is a timeout.
    judge = judge_factory(hold_s=0.3)
    reward = UnifiedReward(config(judge.url, max_concurrency=1, timeout_s=1.0, max_retries=0))
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda i: reward(videos(1), [f"caption id-{i}"]), range(6)))
    finally:
        reward.close()
    # One at a time: the server's in-flight count can briefly read 2 (a finished handler thread decrements it
    # after the client already has the answer), so the cap is checked by the total time instead.
    assert time.monotonic() - t0 >= 6 * 0.3 * 0.95
    for scores, details in results:
        assert scores.tolist() == pytest.approx([0.75]) and details["attempts"].tolist() == [1]


def test_camera_domain_builds_one_judge_for_training_evaluation_and_hooks(judge_factory):
    from config import grpo
    from recam.domains.camera.domain import CameraDomain

    judge = judge_factory()
    c = grpo.get_config("tiny_cpu")
    c.reward.weights.unifiedscore = 1.0
    c.reward.unified.update(dict(base_url=judge.url, model=MODEL, frame_size=32))
    log = type("Log", (), {"info": lambda self, m: None, "detail": lambda self, m: None})()
    domain = CameraDomain(c, "cpu", log)
    assert judge.health_checks == 0  # building the domain contacts no judge
    weights = dict(c.reward.weights)
    evaluation = domain.reward_fn(weights, report=("fidelity",))
    assert judge.health_checks == 1  # the trainer's first reward_fn call: before any sampling
    train = domain.reward_fn(weights)
    assert domain.hooks() == []
    assert judge.health_checks == 1 and train.rewards["unifiedscore"] is evaluation.rewards["unifiedscore"]
    conds = [Cond(caption) for caption in captions(2)]
    assert train.rewards["unifiedscore"](videos(2), conds)[0].tolist() == pytest.approx([0.75, 0.75])
    domain._rewards().close()


def test_the_module_registers_its_factory():
    from rewards import REWARDS

    assert REWARDS["unifiedscore"].factory is build_unifiedscore and REWARDS["unifiedscore"].scores == "video"


# ----------------------------------------------------------------------------------------------------
# a judge that is down: at the start a one-line RewardServerDown, mid-run RewardServerDown from the runner


def _dead_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def test_judge_down_at_start_is_a_one_line_reward_server_down():
    from recam.engine.reward_runner import RewardServerDown

    url = _dead_url()
    with pytest.raises(RewardServerDown) as err:  # what an entry point catches for a clean exit
        build_reward("unifiedscore", run_config(url))
    assert isinstance(err.value, UnifiedServerError)
    message = str(err.value)
    assert "\n" not in message and f"{url}/v1/models" in message and "unreachable" in message
    assert "reward.unified.base_url" in message  # says what to fix


@pytest.mark.parametrize("failure", ["http_500", "connection_refused", "timeout", "dropped"])
def test_judge_failing_every_request_mid_run_is_server_down_not_nan(judge_factory, failure):
    """UnifiedReward answers NaN (+ reason) for each request that fails after its retries; the runner must turn a
    batch with no valid sample into RewardServerDown, so the trainer stops instead of training on nothing."""
    from recam.engine.reward_runner import AsyncRewardRunner, RewardServerDown

    if failure == "connection_refused":
        url = _dead_url()
    else:
        action = {"http_500": ("status", 500), "timeout": ("sleep", 1.0), "dropped": ("drop",)}[failure]
        url = judge_factory(default=action).url
    reward = UnifiedReward(config(url, max_retries=1, timeout_s=0.3), check_health=False)
    runner = AsyncRewardRunner(reward, failure_policy="wait", max_retries=1, sleep=lambda s: None)
    try:
        runner.submit(7, videos(3), [Cond(c) for c in captions(3)])
        with pytest.raises(RewardServerDown) as err:
            runner.collect()
    finally:
        runner.close()
        reward.close()
    message = str(err.value)
    assert "every one of the 3 samples of batch 7 failed after 2 reward call(s)" in message and "\n" not in message
    want = {"http_500": "HTTP 500", "connection_refused": "connection error", "timeout": "timeout",
            "dropped": "connection error"}[failure]
    assert want in message and "gave up after 2 attempts" in message


def test_a_flaky_judge_is_not_server_down(judge_factory):
    """Some requests fail for good: those samples are excluded (NaN + reason), the batch is not a server outage."""
    from recam.engine.reward_runner import AsyncRewardRunner

    judge = judge_factory(script={1: [("status", 500)]})
    reward = UnifiedReward(config(judge.url, max_retries=0), check_health=False)
    with AsyncRewardRunner(reward, failure_policy="wait", max_retries=1, sleep=lambda s: None) as runner:
        runner.submit(0, videos(3), captions(3))
        (r,) = runner.collect()
    reward.close()
    assert r.valid.tolist() == [True, False, True] and math.isnan(r.scores[1].item())
    assert "HTTP 500" in r.reasons[1] and judge.attempts[1] == 2  # first call + one runner retry


def test_the_judges_client_keeps_httpx_request_lines_out_of_the_run_log():
    """httpx logs every request at INFO (206 lines in a small run); a judge's client turns that off, and leaves a
    stricter level a user set alone."""
    import logging

    logger = logging.getLogger("httpx")
    old = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        UnifiedClient(config("http://127.0.0.1:1/v1")).close()
        assert logger.getEffectiveLevel() == logging.WARNING and not logger.isEnabledFor(logging.INFO)
        logger.setLevel(logging.ERROR)
        UnifiedClient(config("http://127.0.0.1:1/v1")).close()
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(old)
