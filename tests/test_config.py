import subprocess
import sys
from pathlib import Path

import pytest

from config import grpo
from config.validate import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]
PROCS = {"tiny_cpu": 1, "smoke": 1, "recam_8npu": 8}


@pytest.mark.parametrize("name", sorted(grpo.PRESETS))
def test_every_preset_loads_and_validates(name):
    c = grpo.get_config(name)
    d = validate(c, PROCS.get(name, c.expected_num_processes or 1))
    assert d["samples_per_epoch"] % d["k"] == 0
    assert d["unique_conditions_per_epoch"] * d["k"] == d["samples_per_epoch"]


def test_recam_8npu_arithmetic():
    d = validate(grpo.get_config("recam_8npu"), 8)
    assert (d["samples_per_epoch"], d["unique_conditions_per_epoch"], d["conditions_per_batch"]) == (64, 16, 4)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: setattr(c.sample, "k", 3), "sample.k"),
    (lambda c: setattr(c.sample, "batch_size", 0), "sample.batch_size"),
    (lambda c: c.reward.weights.__setitem__("camscore", 1.0), "reward.weights"),
    (lambda c: setattr(c.train, "kl_type", "k4"), "train.kl_type"),
    (lambda c: setattr(c.advantage, "std_mode", "batch"), "advantage.std_mode"),
    (lambda c: setattr(c, "expected_num_processes", 8), "expected_num_processes"),
    (lambda c: setattr(c.train, "batch_size", 3), "train.batch_size"),
])
def test_broken_config_names_the_field(mutate, field):
    c = grpo.get_config("tiny_cpu")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(c, 1)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="nope"):
        grpo.get_config("nope")


def test_command_line_overrides_reach_validation_before_any_model_is_built(tmp_path):
    # --config.sample.k=3 cannot hold whole groups in 8 samples: the trainer must stop at validation, naming it.
    cmd = [sys.executable, "scripts/train_recam.py", "--config=config/grpo.py:smoke", "--config.sample.k=3",
           "--config.train.beta=0.01", f"--config.run_dir={tmp_path}", "--config.model.pretrained=/nonexistent"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "sample.k=3 must divide" in p.stderr + p.stdout
    assert "nonexistent" not in p.stderr + p.stdout  # failed before the model was loaded
