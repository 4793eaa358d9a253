"""Launching scripts/train_recam.py on the smoke preset, shared by the end-to-end test files (split in two so
the two test workers each take one: together they are the suite's longest file)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:smoke",
         "--config.logging.wandb_mode=disabled", "--config.num_threads=1"]


def cpu_2proc() -> list[str]:
    """accelerate's launcher for two CPU processes, on a port free now: the config's fixed port would clash when the
    two test workers each launch two processes at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "config" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(port)]


needs_base = pytest.mark.skipif(not (ROOT / "checkpoints" / "recam_tiny_base" / "config.json").exists(),
                                reason="base checkpoint checkpoints/recam_tiny_base not present")


# Three denoising steps instead of the smoke preset's six, for tests about bookkeeping across processes and
# restarts rather than about what training learns: half the sampling and training time.
SHORT = ("--config.sample.num_steps=3", "--config.sample.eval_num_steps=3")

SMOKE_SIZE = ("--config.num_epochs=1", "--config.data.num_train_conditions=16",
              "--config.data.num_heldout_conditions=4", "--config.sample.num_batches_per_epoch=1",
              *SHORT, "--config.eval.freq=100",
              "--config.eval.num_videos=0", "--config.train.batch_size=4", "--config.data.num_val_conditions=4")


def run(run_dir, *overrides, check=True, launcher=None):
    cmd = (launcher + TRAIN[1:] if launcher else TRAIN) + [f"--config.run_dir={run_dir}", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def records(run_dir, kind):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]
