"""Standing numeric fingerprints: the toy run's records and final weights, within 1e-5 relative of the committed
ones (tests/fingerprints/; the smoke run's is checked in tests/test_checkpoint_integrity.py, on the run it
already makes). A change that moves a number fails here until its commit rewrites the file, saying why:

    python scripts/run_fingerprint.py RUN_DIR --write tests/fingerprints/toy.json --command "<the command>"
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from scripts.run_fingerprint import check, difference

ROOT = Path(__file__).resolve().parents[1]
TOY = ["scripts/train_recam.py", "--config", "config/grpo.py:toy", "--config.logging.wandb_mode=disabled",
       "--config.num_threads=1", "--config.num_epochs=4", "--config.eval.freq=2"]


def test_numbers_compare_within_the_tolerance_and_everything_else_exactly():
    base = {"type": "epoch", "loss": 0.25, "rewards": [1.0, 2.0], "zero": 0.0, "tag": "final", "n": 3}
    assert difference(base, {**base, "loss": 0.25 * (1 + 5e-6)}) is None
    assert difference(base, {**base, "loss": 0.25 * (1 + 5e-5)}).startswith("loss: 0.25 vs 0.250012")
    assert difference(base, {**base, "zero": 1e-12}) is None  # rounding around 0
    assert difference(base, {**base, "rewards": [1.0]}) == "rewards: 2 vs 1 items"
    assert difference(base, {**base, "rewards": [1.0, 2.1]}) == "rewards[1]: 2.0 vs 2.1"
    assert difference(base, {**base, "tag": "start"}) == "tag: 'final' vs 'start'"
    assert difference(base, {**base, "extra": 1}) == ": keys ['extra'] in one only"
    assert difference({"x": None}, {"x": 0.0}) == "x: None vs 0.0"
    assert difference({"x": True}, {"x": 1}) == "x: True vs 1"  # a flag is not a number


def test_the_toy_run_repeats_its_committed_numbers(tmp_path):
    committed = ROOT / "tests" / "fingerprints" / "toy.json"
    assert json.loads(committed.read_text())["command"] == TOY  # the file is this command's
    p = subprocess.run([sys.executable, *TOY, f"--config.run_dir={tmp_path}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert check(tmp_path, committed) is None
