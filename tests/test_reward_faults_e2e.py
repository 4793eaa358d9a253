"""The trainer against a local OpenAI-compatible judge that fails, and against one that is down."""

import json
import random
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "checkpoints" / "recam_tiny_base"
pytestmark = pytest.mark.skipif(not (BASE / "config.json").exists(), reason="base checkpoint not present")


class FlakyJudge:
    """Answers "Final Score: 2..5" (never the score that maps to 0); every `fail_every`-th POST gets HTTP 500.

    Failing a fixed share of requests (rather than at random) makes the count in every phase of the run exact.
    """

    def __init__(self, fail_every: int, seed: int = 0, max_requests: int = 2000):
        rng = random.Random(seed)
        self.posts = self.failures = 0
        lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "UnifiedReward", "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    judge.posts += 1
                    fail = judge.posts % fail_every == 0 or judge.posts > max_requests
                    judge.failures += fail
                    score = rng.choice([2, 3, 4, 5])
                if fail:
                    self._send(500, {"error": {"message": "injected failure"}})
                else:
                    self._send(200, {"choices": [{"index": 0, "message": {
                        "role": "assistant", "content": f"Smooth camera, consistent spheres.\nFinal Score: {score}"}}]})

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def train(run_dir, url, *extra):
    cmd = [sys.executable, "scripts/train_recam.py", "--config=config/grpo.py:smoke", f"--config.run_dir={run_dir}",
           "--config.logging.wandb_mode=disabled", "--config.num_epochs=1", "--config.eval.freq=100",
           "--config.reward.weights.unifiedscore=1.0", f"--config.reward.unified.base_url={url}",
           "--config.reward.unified.max_retries=0", "--config.reward.unified.timeout_s=5",
           "--config.reward.retry_backoff_s=0.05", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)


def test_smoke_run_with_a_judge_failing_20_percent_counts_failures_and_never_scores_zero(tmp_path):
    judge = FlakyJudge(fail_every=5)  # 20% of requests
    try:
        p = train(tmp_path, judge.url, "--config.reward.max_retries=0")
    finally:
        judge.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert judge.failures == judge.posts // 5 > 0
    epoch = next(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["type"] == "epoch")
    scores = epoch["rewards/unifiedscore"]
    failed = [s for s in scores if s != s]  # NaN marks a sample the judge never scored
    assert 0.0 not in scores  # every answer was >= 2/5, so a 0 could only be a failure passed off as a score
    assert len(failed) > 0 and epoch["failed_samples"] == len(failed)
    assert sum(epoch["excluded"]) >= len(failed)
    for s, a in zip(scores, epoch["advantages"], strict=True):
        if s != s:
            assert set(a) == {0.0}  # excluded from the groups, not trained on


def test_a_judge_that_is_down_fails_before_any_sampling(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    p = train(tmp_path, f"http://127.0.0.1:{port}")
    assert p.returncode != 0
    assert f"127.0.0.1:{port}" in p.stderr + p.stdout
    assert not (tmp_path / "metrics.jsonl").exists() or '"epoch"' not in (tmp_path / "metrics.jsonl").read_text()
