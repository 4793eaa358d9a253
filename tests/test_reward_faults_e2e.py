"""The trainer against a local OpenAI-compatible judge that fails, and against one that is down."""

import importlib.util
import json
import math
import random
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "checkpoints" / "recam_tiny_base"
pytestmark = pytest.mark.skipif(not (BASE / "config.json").exists(), reason="base checkpoint not present")


class FlakyJudge:
    """Answers "Final Score: 2..5" (never the score that maps to 0); every `fail_every`-th POST gets HTTP 500.

    Failing a fixed share of requests (rather than at random) makes the count in every phase of the run exact.
    From the first POST at which `dies()` is true (or past max_requests) it answers every request with HTTP 500:
    a judge that died mid-run.
    """

    def __init__(self, fail_every: int, seed: int = 0, max_requests: int = 2000, dies=lambda: False):
        rng = random.Random(seed)
        self.posts = self.failures = 0
        self.dead = False
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
                    judge.dead = judge.dead or judge.posts > max_requests or bool(dies())
                    fail = judge.posts % fail_every == 0 or judge.dead
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


def train(run_dir, url, *extra, epochs=1):
    cmd = [sys.executable, "scripts/train_recam.py", "--config=config/grpo.py:smoke", f"--config.run_dir={run_dir}",
           "--config.logging.wandb_mode=disabled", f"--config.num_epochs={epochs}", "--config.eval.freq=100",
           "--config.data.num_heldout_conditions=2", "--config.eval.select_by=", "--config.eval.select_guard=",
           "--config.eval.num_videos=0",
           "--config.reward.weights.unifiedscore=1.0", f"--config.reward.unified.base_url={url}",
           "--config.reward.unified.max_retries=0", "--config.reward.unified.timeout_s=5",
           # one request at a time: the judge fails every 5th POST, so which samples fail is the same in every run
           # (with requests in flight together it depends on the machine's load, and so would the run's numbers)
           "--config.reward.unified.max_concurrency=1",
           "--config.reward.retry_backoff_s=0.05", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)


def epoch_records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def verify_and_diagnose(run_dir, tmp_path, capsys):
    """scripts/verify_grpo_log.py and scripts/diagnose.py on the run directory, as a user runs them (in this process,
    to spare two interpreter starts): (verifier exit code, its report, diagnosis exit code, diagnosis text)."""
    verify_script, diagnose_script = _script("verify_grpo_log"), _script("diagnose")
    capsys.readouterr()
    v = verify_script.main([str(run_dir), "--out", str(tmp_path / "check" / "verification.md"), "--no-plots"])
    report, _ = verify_script.build_report(run_dir, 1e-3)
    d = diagnose_script.main([str(run_dir)])
    return v, report, d, capsys.readouterr().out


def test_smoke_run_with_a_judge_failing_20_percent_excludes_failures_and_verifies(tmp_path, capsys):
    """A flaky judge end to end: failures are excluded (never scored 0), the run ends normally, the verifier finds
    no failing check (it warns, per epoch, that samples were excluded) and the diagnosis is healthy."""
    judge = FlakyJudge(fail_every=5)  # 20% of requests
    try:
        p = train(tmp_path, judge.url, "--config.reward.max_retries=0", epochs=2)
    finally:
        judge.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert judge.failures == judge.posts // 5 > 0
    epochs = epoch_records(tmp_path)
    assert len(epochs) == 2
    for epoch in epochs:
        scores = epoch["rewards/unifiedscore"]
        failed = [s for s in scores if s != s]  # NaN marks a sample the judge never scored
        assert 0.0 not in scores  # every answer was >= 2/5, so a 0 could only be a failure passed off as a score
        assert len(failed) > 0 and epoch["failed_samples"] == len(failed) == sum(epoch["excluded"])
        for s, a in zip(scores, epoch["advantages"], strict=True):
            if s != s:
                assert set(a) == {0.0}  # excluded from the groups, not trained on
        assert epoch["group_size"] < 4  # over the kept samples
    assert f"kept {8 - sum(epochs[0]['excluded'])}/8 samples" in p.stdout

    v, report, d, out = verify_and_diagnose(tmp_path, tmp_path, capsys)
    assert v == 0, out
    assert report.failing() == []
    # WARN, not PASS: the only warnings say how many samples each epoch excluded
    assert report.status == "warn"
    warned = [(c.name, c.epoch) for c in report.checks if c.status == "warn"]
    assert [w for w in warned if w[0] == "excluded_samples"] == [("excluded_samples", 0), ("excluded_samples", 1)]
    # the only other warning allowed: a group whose rewards barely differ, which eps 1e-4 leaves at std < 1
    assert {name for name, _ in warned} <= {"excluded_samples", "advantage_per_condition"}
    for c in report.checks:
        if c.name == "excluded_samples":
            assert c.numbers["excluded_samples"] == sum(epochs[c.epoch]["excluded"])
    assert d == 0, out
    assert "verdict: HEALTHY" in out and "diagnosis_error" not in out
    assert f"excluded samples: {sum(sum(e['excluded']) for e in epochs)} of 16" in out
    # the trainer's own summary says the same
    assert "grpo_verification.md (WARN)" in p.stdout and "diagnosis.md (healthy)" in p.stdout


def test_a_judge_that_dies_mid_run_stops_cleanly_with_the_last_checkpoint_intact(tmp_path, capsys):
    from safetensors.torch import load_file

    from recam.infra.checkpoint import read_trainer_state

    first = tmp_path / "checkpoints" / "epoch_0001" / "state.json"
    judge = FlakyJudge(fail_every=10**9, dies=first.exists)  # every request fails once epoch 0 is checkpointed
    try:
        p = train(tmp_path, judge.url, epochs=3)
    finally:
        judge.close()
    assert p.returncode == 3, p.stderr[-3000:]  # documented: stopped early (reward server down)
    assert "Traceback" not in p.stderr
    stops = [line for line in p.stdout.splitlines() if "reward server down" in line and line.startswith("[recam]")]
    assert len(stops) == 1, p.stdout  # one clear message
    assert stops[0].startswith("[recam] reward server down at epoch 1: every one of the 8 samples")
    assert "HTTP 500" in stops[0] and "checkpoints/epoch_0001 is intact" in stops[0]
    assert "stopped early: reward server down at epoch 1" in p.stdout  # the summary repeats why
    # the final evaluation calls the dead judge no more (tests/test_rewards.py counts the calls)
    assert "the final evaluation skips unifiedscore" in p.stdout
    final = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["type"] == "eval" and r["tag"] == "final"]
    assert len(final) == 1 and math.isnan(final[0]["eval/unifiedscore"])
    assert math.isnan(final[0]["eval/reward_avg"]) and math.isfinite(final[0]["eval/cam_score"])

    # the last good checkpoint is the one `latest` names, whole and loadable
    ckpt_root = tmp_path / "checkpoints"
    assert (ckpt_root / "latest").read_text().strip() == "epoch_0001"
    assert not (ckpt_root / "epoch_0002").exists()
    state = json.loads(first.read_text())
    assert state["epoch"] == 1 and state["healthy"] is True
    trainer_state = read_trainer_state(ckpt_root / "epoch_0001")
    assert trainer_state["optimizer"]["state"]
    weights = load_file(str(next((ckpt_root / "epoch_0001" / "model").glob("*.safetensors"))))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    epochs = epoch_records(tmp_path)
    assert [e["epoch"] for e in epochs] == [0] and state["global_step"] == len(epochs[0]["optimizer_steps"])
    v, report, d, out = verify_and_diagnose(tmp_path, tmp_path, capsys)
    assert v == 0 and report.failing() == [] and d == 0, out


def test_a_judge_that_is_down_fails_before_any_sampling(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    p = train(tmp_path, f"http://127.0.0.1:{port}")
    assert p.returncode != 0
    assert f"127.0.0.1:{port}" in p.stderr + p.stdout
    assert not (tmp_path / "metrics.jsonl").exists() or '"epoch"' not in (tmp_path / "metrics.jsonl").read_text()
