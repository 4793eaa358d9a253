"""scripts/device_check.py: every stage at tiny sizes on the CPU writes every key a GPU run reports, a stage that
runs out of time is recorded without losing the others, and the learning stage's interval is a paired t-interval."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)

KEYS = {
    "recam": ("sampling_step_s", "trained_step_s", "peak_memory_gib", "mfu", "first_step_ratio_dev_bf16",
              "first_step_ratio_dev_fp16", "adapter_save_s", "adapter_load_s", "epoch_s_implied",
              "forward_alone_s", "train_passes_alone_s"),
    "vae": ("encode_s", "decode_s", "peak_memory_gib"),
    "motion": ("sampling_step_s", "trained_step_s", "peak_memory_gib"),
}
LEARNING = ("samples_per_update", "epochs", "seconds", "base", "final", "gain", "ci95")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    p = subprocess.run([sys.executable, "scripts/device_check.py", "--tiny", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread per worker (conftest.py)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return out, json.loads((out / "device_check.json").read_text())


def test_tiny_run_writes_every_key(tiny):
    out, r = tiny
    assert r["mode"] == "tiny" and r["device"].startswith("cpu") and r["torch"]
    assert set(r["stages"]) == set(device_check.STAGES)
    assert {n for n, s in r["stages"].items() if s["status"] != "ok"} == {"fsdp"}  # needs an accelerator
    assert r["stages"]["fsdp"]["status"] == "skipped" and "no available devices" in r["fsdp"]["skipped"]
    assert r["peak_tflops"] > 0 and r["peak"]["dtype"] == "float32"
    for stage, keys in KEYS.items():
        missing = [k for k in keys if k not in r[stage]]
        assert not missing, (stage, missing)
    rc, mo = r["recam"], r["motion"]
    assert rc["sampling_step_s"] > 0 and rc["trained_step_s"] > 0 and 0 < rc["mfu"] < 1
    assert rc["peak_memory_gib"] is None  # the CPU keeps no peak count: not reported as a number
    # on one CPU the sampling forward and the training rescoring run the same kernels: the ratio is exactly 1
    assert rc["first_step_ratio_dev_bf16"] == 0.0
    assert rc["first_step_ratio_dev_fp16"] is not None or "first_step_ratio_dev_fp16_error" in rc
    assert rc["trainable_parameters"] < rc["parameters"] and rc["lora_rank"] == 32 and rc["gradient_checkpointing"]
    assert r["vae"]["latent_shape"] == [16, 2, 4, 4]  # 5 frames -> 1 + 4/4 latent frames, 32 px / 8
    assert mo["guidance_passes"] == 2 and mo["preset_steps"] == 50
    for name in ("camera", "motion"):
        learning = r["learning"][name]
        missing = [k for k in LEARNING if k not in learning]
        assert not missing, (name, missing)
        assert learning["exit"] in (0, 3) and learning["epochs"] >= 1 and learning["conditions"] >= 2
        assert math.isfinite(learning["gain"]) and math.isfinite(learning["ci95"])
        assert math.isfinite(learning["beside"]["gain"]), learning["beside"]  # fidelity / motion_alignment
    assert r["learning"]["motion"]["score"] == "eval/r_precision_top3"  # its gain paired per caption
    assert set(r["overhead"]) == {"recam_sampling", "recam_training", "motion_sampling", "motion_training"}
    summary = (out / "device_check.md").read_text()
    assert "# Device check: cpu" in summary and "sampling_step_s" in summary and "learning" in summary


def test_a_stage_past_its_cap_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    monkeypatch.setitem(device_check.SIZES["tiny"]["caps"], "vae", 0.05)  # not even an interpreter starts in time
    status = device_check.main(["--tiny", "--out", str(tmp_path), "--stages", "vae,peak"])
    r = json.loads((tmp_path / "device_check.json").read_text())
    assert status == 1
    assert r["stages"]["vae"]["status"] == "timeout" and "cap of 0.05 s" in r["vae"]["error"]
    assert r["stages"]["peak"]["status"] == "ok" and r["peak_tflops"] > 0


def test_paired_gain_is_the_t_interval_of_the_differences():
    before, after = [0.1, 0.2, None, 0.4, 0.3], [0.2, 0.2, 0.5, 0.7, float("nan")]
    diffs = [0.1, 0.0, 0.3]  # conditions scored in both evaluations only
    mean, half, n = device_check.paired_change(before, after)
    assert n == 3 and mean == pytest.approx(statistics.fmean(diffs))
    assert half == pytest.approx(4.303 * statistics.stdev(diffs) / math.sqrt(3), rel=2e-4)  # t_{0.975, 2}


def test_a_longer_learning_run_gets_a_cap_that_holds_it_and_unknown_presets_are_named(monkeypatch):
    monkeypatch.setitem(device_check.SIZES, "full", copy.deepcopy(device_check.SIZES["full"]))
    device_check.set_learning("full", 240.0, "motion_tiny_gpu")
    size = device_check.SIZES["full"]
    assert size["learning"]["presets"] == ("motion_tiny_gpu",) and size["learning"]["seconds"] == 240.0
    assert size["caps"]["learning"] == 240 + device_check.LEARNING_MARGIN_S + 10  # one run, its margin
    device_check.set_learning("full", 100.0, "tiny_gpu,motion_tiny_gpu")  # two runs, one after the other
    assert size["caps"]["learning"] == 2 * (100 + device_check.LEARNING_MARGIN_S) + 10
    with pytest.raises(SystemExit, match="unknown \\['camera'\\]"):
        device_check.set_learning("full", None, "camera")
