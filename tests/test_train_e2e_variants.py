"""End-to-end runs of scripts/train_recam.py at smoke size: the variant presets, the reward constraint, and a
reward failing on one of two processes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.smoke_runs import ROOT, SHORT, SMOKE_SIZE, cpu_2proc, needs_base, records, run

pytestmark = needs_base


VARIANT_FLAGS = {"use_ema_smoothing": "ema/", "use_gradient_adaptive_weighting": "gradient_adaptive/",
                 "use_amic": "amic/", "use_ptrw": "ptrw/", "use_temporal_decay": "temporal_decay/",
                 "use_asymmetric_clipping": "asymmetric/"}
SINGLE_VARIANTS = ("ema", "gradient_adaptive", "amic", "ptrw", "temporal_decay", "asymmetric")
COMBINED_VARIANTS = ("conservative", "aggressive", "balanced")


def test_the_combined_variant_presets_cover_every_variant_and_every_variant_preset_validates():
    """The combined presets run end to end below; together they switch on every variant a single preset does, so
    each variant's code runs in some run, and each single preset is checked for what it switches on."""
    from config import grpo
    from config.validate import validate

    on = {f for p in COMBINED_VARIANTS for f in VARIANT_FLAGS if grpo.get_config(p).train[f]}
    assert on == set(VARIANT_FLAGS)
    for preset in SINGLE_VARIANTS + COMBINED_VARIANTS:
        c = grpo.get_config(preset)
        validate(c, 1)
    for preset, flag in zip(SINGLE_VARIANTS, VARIANT_FLAGS, strict=True):
        t = grpo.get_config(preset).train
        assert [f for f in VARIANT_FLAGS if t[f]] == [flag], preset


@pytest.mark.parametrize("preset", COMBINED_VARIANTS)
def test_every_variant_preset_runs_at_smoke_size_and_logs_its_metrics(tmp_path, preset):
    from config import grpo

    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), f"--config=config/grpo.py:{preset}",
           "--config.logging.wandb_mode=disabled", "--config.num_threads=1", f"--config.run_dir={tmp_path}",
           *SMOKE_SIZE]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = records(tmp_path, "step")
    assert steps and all(np.isfinite(s["loss"]) for s in steps)
    t = grpo.get_config(preset).train
    for flag, prefix in VARIANT_FLAGS.items():
        logged = any(k.startswith(prefix) for k in steps[0])
        assert logged == bool(t[flag]), (flag, sorted(steps[0]))
    if t.use_ema_smoothing:
        assert all(s["ema/missing_state"] == 0 for s in steps)
        # one epoch of three passes, one optimizer step each: on-policy, then each sample's first off-policy visit
        # (starts its average), then every weight smoothed, with a measured ratio (tests/test_ema_off_policy.py)
        assert [s["ema/smoothed_fraction"] for s in steps] == [0.0, 0.0, 1.0]
        assert "ema/variance_reduction_ratio" not in steps[0] and "ema/variance_reduction_ratio" not in steps[1]
        ratio = steps[2]["ema/variance_reduction_ratio"]
        assert np.isfinite(ratio) and abs(ratio - 1 / t.ema_beta**2) > 1e-3, ratio


def test_constrained_reward_weight_follows_the_dual_step_and_is_checkpointed(tmp_path):
    import torch

    from recam.engine.constraint import dual_step
    from rewards import weighted_mean

    run(tmp_path, "--config.num_epochs=2", "--config.eval.freq=100", "--config.reward.constraint=fidelity",
        "--config.reward.constraint_lr=20", "--config.eval.num_videos=0", *SHORT)
    e0, e1 = records(tmp_path, "epoch")
    first_fid = float(np.nanmean(e0["rewards/fidelity"]))
    assert e0["constraint_threshold"] == pytest.approx(first_fid - 0.01)  # the base's samples set the floor
    assert e0["constraint_weight"] == 1.5  # starts at reward.weights.fidelity
    assert e1["constraint_weight"] == pytest.approx(dual_step(1.5, first_fid, first_fid - 0.01, 20, 6.0))
    for e in (e0, e1):  # avg, which the advantages are computed from, uses the epoch's multiplier
        scores = {k: torch.tensor(e[f"rewards/{k}"]) for k in ("cam_score", "fidelity")}
        avg = weighted_mean(scores, {"cam_score": 1.0, "fidelity": e["constraint_weight"]})
        np.testing.assert_allclose(np.array(e["rewards/avg"])[:, 0], avg.numpy(), rtol=1e-6)
    state = json.loads((tmp_path / "checkpoints" / "epoch_0002" / "state.json").read_text())
    second_fid = float(np.nanmean(e1["rewards/fidelity"]))
    assert state["reward_constraint"]["weight"] == pytest.approx(
        dual_step(e1["constraint_weight"], second_fid, first_fid - 0.01, 20, 6.0))


def _update(run_dir):
    """Weights after epoch 1 minus the base's, flattened (the checkpoint of each)."""
    from safetensors.torch import load_file

    def flat(name):
        files = sorted((Path(run_dir) / "checkpoints" / name / "model").glob("*.safetensors"))
        tensors = {}
        for f in files:
            tensors.update(load_file(f))
        return np.concatenate([tensors[k].float().numpy().ravel() for k in sorted(tensors)])
    return flat("epoch_0001") - flat("epoch_0000")


def test_reward_failing_on_one_process_is_masked_and_the_update_equals_one_process(tmp_path):
    """Slots 5 and 6 of every batch fail scoring: with 2 processes x 4 samples both are rank 1's. Rank 1 keeps 2
    samples, rank 0 keeps 4. Dropping them per process would give rank 1 one micro-batch of 2 weighted like rank
    0's two (and, with one micro-batch per step, one optimizer step against rank 0's two: a hang)."""
    common = ("--config.num_epochs=1", "--config.eval.freq=100", "--config.debug.fail_reward_slots=5,6",
              "--config.train.batch_size=2", "--config.eval.select_by=", "--config.eval.select_guard=",
              "--config.data.num_heldout_conditions=2", "--config.eval.num_videos=0", *SHORT)
    launcher = cpu_2proc()
    run(tmp_path / "one", *common, "--config.train.gradient_accumulation_steps=4")
    run(tmp_path / "two", *common, "--config.sample.batch_size=4", "--config.train.gradient_accumulation_steps=2",
        launcher=launcher)
    e1, e2 = records(tmp_path / "one", "epoch")[0], records(tmp_path / "two", "epoch")[0]
    assert e1["excluded_samples"] == e2["excluded_samples"] == 2
    assert len(e1["optimizer_steps"]) == len(e2["optimizer_steps"]) == 1
    u1, u2 = _update(tmp_path / "one"), _update(tmp_path / "two")
    assert np.linalg.norm(u1) > 0
    # same samples up to batch-4 vs batch-8 kernel rounding, so the same update up to that rounding
    rel = np.linalg.norm(u2 - u1) / np.linalg.norm(u1)
    print(f"relative difference of the updates: {rel:.2e}")
    assert rel < 1e-3
    # one micro-batch per step: rank 0 has two steps' worth of kept samples, rank 1 one; every rank takes two
    run(tmp_path / "steps", *common, "--config.sample.batch_size=4", "--config.train.gradient_accumulation_steps=1",
        launcher=launcher)
    steps = records(tmp_path / "steps", "epoch")[0]["optimizer_steps"]
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
