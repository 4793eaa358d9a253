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
    assert d.samples_per_epoch % d.k == 0
    assert d.unique_conditions_per_epoch * d.k == d.samples_per_epoch


def test_recam_8npu_arithmetic():
    d = validate(grpo.get_config("recam_8npu"), 8)
    assert (d.samples_per_epoch, d.unique_conditions_per_epoch, d.conditions_per_batch) == (64, 16, 4)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: setattr(c.sample, "k", 3), "sample.k"),
    (lambda c: setattr(c.sample, "batch_size", 0), "sample.batch_size"),
    (lambda c: c.reward.weights.__setitem__("camscore", 1.0), "reward.weights"),
    (lambda c: setattr(c.train, "kl_type", "k4"), "train.kl_type"),
    (lambda c: setattr(c.advantage, "std_mode", "batch"), "advantage.std_mode"),
    (lambda c: setattr(c, "expected_num_processes", 8), "expected_num_processes"),
    (lambda c: setattr(c.train, "batch_size", 3), "train.batch_size"),
    (lambda c: setattr(c.advantage, "eps", -1.0), "advantage.eps"),  # would invert every advantage's sign
    (lambda c: setattr(c.eval, "freq", 0), "eval.freq"),  # was a ZeroDivisionError after the first epoch
    (lambda c: setattr(c, "save_freq", 0), "save_freq"),
    (lambda c: setattr(c.sample, "eval_num_steps", 0), "sample.eval_num_steps"),
])
def test_broken_config_names_the_field(mutate, field):
    c = grpo.get_config("tiny_cpu")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(c, 1)


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="nope"):
        grpo.get_config("nope")


def test_the_trainer_names_an_unknown_preset_in_one_short_line_without_its_traceback():
    cmd = [sys.executable, "scripts/train_recam.py", "--config", "config/grpo.py:nope"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    [line] = p.stderr.strip().splitlines()
    assert line.startswith("config error: flag --config=config/grpo.py:nope: unknown preset 'nope' in config/grpo.py; "
                           "known presets: [") and "'tiny_cpu'" in line
    assert "Traceback" not in line and "File " not in line and "line " not in line


def test_command_line_overrides_reach_validation_before_any_model_is_built(tmp_path):
    # --config.sample.k=3 cannot hold whole groups in 8 samples: the trainer must stop at validation, naming it.
    cmd = [sys.executable, "scripts/train_recam.py", "--config=config/grpo.py:smoke", "--config.sample.k=3",
           "--config.train.beta=0.01", f"--config.run_dir={tmp_path}", "--config.model.pretrained=/nonexistent"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "sample.k=3 must divide" in p.stderr + p.stdout
    assert "nonexistent" not in p.stderr + p.stdout  # failed before the model was loaded


@pytest.mark.parametrize("name,procs,per_device", [("recam_wan_1_3b_8npu", 8, 2), ("recam_wan_14b_multinode", 16, 1)])
def test_real_scale_presets_arithmetic_and_settings(name, procs, per_device):
    c = grpo.get_config(name)
    assert c.expected_num_processes == procs
    d = validate(c, procs)
    assert (d.samples_per_epoch, d.unique_conditions_per_epoch, d.k, d.num_batches_per_epoch,
            d.per_device_batch) == (64, 16, 4, 4, per_device)
    assert c.data.source == "recammaster" and c.model.vae and c.model.lora_rank > 0
    assert (c.data.num_frames, c.data.height, c.data.width) == (81, 480, 832)
    assert c.mixed_precision == "bf16" and c.model.dtype == "bfloat16" and c.model.gradient_checkpointing
    # camera accuracy from structure-from-motion (no landmarks in real data) plus the quality reward
    assert c.reward.weights.cam_score > 0 and c.reward.cam.estimator == "sfm" and c.reward.weights.fidelity > 0
    with pytest.raises(ConfigError, match="expected_num_processes"):
        validate(c, 1)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: setattr(c.data, "source", "webvid"), "data.source"),
    (lambda c: setattr(c.model, "format", "ckpt"), "model.format"),
    (lambda c: setattr(c.model, "dtype", "float16"), "model.dtype"),
    (lambda c: setattr(c.model, "dtype", "bfloat16"), "model.dtype"),  # a bf16 base needs LoRA
    (lambda c: (setattr(c.data, "source", "recammaster"), c.reward.weights.__setitem__("cam_score", 0.0)),
     "data.root"),
    # landmark PnP on real data (no landmarks there), whether cam_score is trained on or only reported
    (lambda c: (setattr(c.data, "source", "recammaster"), setattr(c.data, "root", "x")), "reward.cam.estimator"),
    (lambda c: (setattr(c.data, "source", "recammaster"), setattr(c.data, "root", "x"),
                c.reward.weights.__setitem__("cam_score", 0.0)), "reward.cam.estimator"),
    (lambda c: setattr(c.reward.cam, "estimator", "colmap"), "reward.cam.estimator"),
    (lambda c: setattr(c.reward.cam, "max_frames", 1), "reward.cam.max_frames"),
    (lambda c: setattr(c.reward.cam, "pnp", "sqpnp"), "reward.cam.pnp"),
    (lambda c: setattr(c.reward.cam, "static_parallax", 0.0), "reward.cam.static_parallax"),
    (lambda c: setattr(c.reward.cam.sfm, "timeout_s", 0.0), "reward.cam.sfm.timeout_s"),
    (lambda c: setattr(c.reward.cam.sfm, "min_registered_fraction", 1.5), "reward.cam.sfm.min_registered_fraction"),
    (lambda c: setattr(c.reward.cam.served, "base_url", "localhost:30100"), "reward.cam.served.base_url"),
    (lambda c: setattr(c.reward.cam.served, "image_format", "webp"), "reward.cam.served.image_format"),
    (lambda c: setattr(c.eval, "report_rewards", "cam_score,fidlity"), "eval.report_rewards"),
    (lambda c: setattr(c.eval, "select_by", "camscore"), "eval.select_by"),
    (lambda c: setattr(c.eval, "select_guard", "unifiedscore"), "eval.select_guard"),  # weight 0, not reported
    (lambda c: setattr(c.eval, "select_max_drop", -0.01), "eval.select_max_drop"),
    (lambda c: setattr(c.eval, "primary_endpoint", ""), "eval.primary_endpoint"),
    (lambda c: setattr(c.eval, "primary_endpoint", "cam_score"), "eval.primary_endpoint"),
    (lambda c: setattr(c.eval, "primary_time", "end"), "eval.primary_time"),
    (lambda c: setattr(c.eval, "secondary_endpoints", "eval/fidelity,eval/cam_score"), "eval.secondary_endpoints"),
    (lambda c: setattr(c.eval, "secondary_endpoints", "fidelity"), "eval.secondary_endpoints"),
    (lambda c: setattr(c.data, "num_val_conditions", 0), "data.num_val_conditions"),
])
def test_broken_data_and_model_fields_are_named(mutate, field):
    c = grpo.get_config("tiny_cpu")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(c, 1)


def test_synthetic_frames_of_another_size_than_the_base_learned_are_refused(monkeypatch):
    """checkpoints/recam_tiny_base was pretrained on 8 x 32 x 32 frames (its provenance.json): 48 px would run, on
    frames it never saw."""
    from config.validate import validate_files

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    c = grpo.get_config("smoke")
    validate_files(c)  # the default size passes
    c.data.size = 48
    with pytest.raises(ConfigError, match=r"data.size=48 .* size 32"):
        validate_files(c)
    c.data.size, c.data.num_frames = 32, 12
    with pytest.raises(ConfigError, match=r"data.num_frames=12 .* num_frames 8"):
        validate_files(c)
