"""Issue 63 item 5: asymmetric clipping's bounds and PTRW's sigma are multiples of the preset's train.clip_range
unless set, and the clip-saturation advice names the setting the active loss reads. The regression case is the
issue's toy (clip 0.05), where asymmetric clipping at fixed 1.4e-3 / 1e-3 bounds put 87% of the ratios outside them
and the advice said to widen train.clip_range, which the variant does not read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config.grpo import get_config
from config.validate import validate
from recam.engine import diagnosis, health
from recam.engine.extensions.variants import (
    CLIP_RATIO_NEG_SCALE,
    CLIP_RATIO_POS_SCALE,
    PTRW_SIGMA_SCALE,
    VariantSettings,
    grpo_variants_policy_loss,
)
from recam.engine.losses import loss_settings
from tests.test_diagnose import epoch_record

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = {"clip_ratio_pos": CLIP_RATIO_POS_SCALE, "clip_ratio_neg": CLIP_RATIO_NEG_SCALE,
          "ptrw_sigma": PTRW_SIGMA_SCALE}
# the toy case, as its first off-policy step logged it (this repository's toy preset, asymmetric clipping at
# the old fixed widths: python scripts/train_recam.py --config config/grpo.py:toy --config.train.policy_loss=
# grpo_variants --config.train.use_asymmetric_clipping=True --config.train.clip_ratio_pos=0.0014
# --config.train.clip_ratio_neg=0.001)
TOY_ASYMMETRIC_STEP = {"step": 2, "epoch": 0, "clipfrac": 0.8656, "clipfrac_high": 0.4406, "clipfrac_low": 0.425,
                       "asymmetric/clipfrac_pos": 0.400, "asymmetric/clipfrac_neg": 0.408,
                       "asymmetric/pos_advantage_ratio": 1.0006, "asymmetric/neg_advantage_ratio": 0.9993}


def test_the_widths_are_multiples_of_the_presets_clip_range():
    assert CLIP_RATIO_POS_SCALE > CLIP_RATIO_NEG_SCALE > 0 and PTRW_SIGMA_SCALE > 1
    for preset, clip in (("tiny_cpu", 1e-3), ("toy", 0.05), ("motion_tiny_cpu", 1e-3), ("asymmetric", 1e-3)):
        t = get_config(preset).train
        assert t.clip_range == clip
        for field, scale in WIDTHS.items():
            assert t[field] == pytest.approx(scale * clip, rel=1e-12), (preset, field)
    # the dataclass defaults are the same multiples of ClipSettings' clip range (1e-3): tiny_cpu's numbers as before
    d = VariantSettings()
    assert (d.clip_ratio_pos, d.clip_ratio_neg, d.ptrw_sigma) == pytest.approx((1.4e-3, 1e-3, 2e-3), rel=1e-12)


def test_the_widths_follow_a_changed_clip_range_and_an_explicit_value_stays():
    c = get_config("asymmetric")
    c.train.clip_range = 0.02  # as --config.train.clip_range=0.02 sets it
    assert (c.train.clip_ratio_pos, c.train.clip_ratio_neg, c.train.ptrw_sigma) == pytest.approx(
        (0.028, 0.02, 0.04), rel=1e-12)
    validate(c, 1)
    s = loss_settings("grpo_variants", c.train)  # what the loss is handed
    assert (s.clip_ratio_pos, s.clip_ratio_neg, s.ptrw_sigma) == pytest.approx((0.028, 0.02, 0.04), rel=1e-12)
    c.train.clip_ratio_pos = 0.005  # an explicit value overrides the multiple ...
    c.train.clip_range = 0.03  # ... and no later clip range moves it
    assert c.train.clip_ratio_pos == 0.005 and c.train.clip_ratio_neg == pytest.approx(0.03)
    # the run's recorded config holds the numbers, not the references
    recorded = json.loads(c.to_json())["train"]
    assert recorded["clip_ratio_pos"] == 0.005 and recorded["clip_ratio_neg"] == pytest.approx(0.03)


def test_the_loss_function_scales_unset_widths_with_its_clip_range():
    logp = torch.log(torch.tensor([1.06, 0.96, 1.2, 0.8], dtype=torch.float64))
    old, adv = torch.zeros(4, dtype=torch.float64), torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    _, m = grpo_variants_policy_loss(logp, old, adv, 0.05, 5.0, use_asymmetric_clipping=True)
    # bounds 1 + 0.07 and 1 - 0.05: 1.06 and 0.96 are inside, 1.2 and 0.8 outside
    assert m["asymmetric/clipfrac_pos"].item() == pytest.approx(0.5)
    assert m["asymmetric/clipfrac_neg"].item() == pytest.approx(0.5)
    _, m = grpo_variants_policy_loss(logp, old, adv, 0.05, 5.0, use_ptrw=True)
    r = torch.tensor([1.06, 0.96, 1.2, 0.8], dtype=torch.float64)
    expected = torch.exp(-((r - 1) ** 2) / (2 * 0.1**2)).mean()
    assert m["ptrw/trust_weights_mean"].item() == pytest.approx(expected.item(), rel=1e-9)


def actions_text(finding) -> str:
    return " | ".join(finding.actions)


def test_toy_asymmetric_saturation_advises_the_asymmetric_fields_not_clip_range():
    (f,) = [f for f in health.diagnose_step(TOY_ASYMMETRIC_STEP) if f.rule == "clip_saturation"]
    assert f.severity == "warn"
    widen = [a for a in f.actions if a.startswith("widen")]
    assert widen and "`train.clip_ratio_pos`" in widen[0] and "`train.clip_ratio_neg`" in widen[0]
    assert "widen `train.clip_range`" not in actions_text(f)
    assert "does not read `train.clip_range`" in f.explanation
    assert f.numbers["asymmetric/clipfrac_pos"] == 0.400 and f.numbers["asymmetric/clipfrac_neg"] == 0.408
    # one side mostly clipped: only its field is named
    one_side = {**TOY_ASYMMETRIC_STEP, "asymmetric/clipfrac_pos": 0.7, "asymmetric/clipfrac_neg": 0.1}
    (f,) = [f for f in health.diagnose_step(one_side) if f.rule == "clip_saturation"]
    widen = [a for a in f.actions if a.startswith("widen")][0]
    assert "`train.clip_ratio_pos`" in widen and "clip_ratio_neg" not in widen


def test_the_offline_diagnosis_gives_the_same_advice_from_the_run_records():
    records = [{"type": "step", **TOY_ASYMMETRIC_STEP, "loss": 0.01, "policy_loss": 0.01, "kl_penalty": 1e-4,
                "mean_ratio": 1.0, "ratio_min": 0.9, "ratio_max": 1.1, "mean_advantage": 0.0, "grad_norm": 0.3,
                "step_samples": 128, "learning_rate": 1e-3, "step": 1},
               epoch_record(0, 0, [0.1, 0.2, 0.3, 0.4, 0.1, 0.2, 0.3, 0.4], steps=1)]
    found = [f for f in diagnosis.diagnose_run(records) if f.rule == "clip_saturation"]
    assert found and "`train.clip_ratio_pos`" in actions_text(found[0])
    assert "widen `train.clip_range`" not in actions_text(found[0])
    assert "train.clip_ratio_pos" in diagnosis.format_findings(found)


def test_each_trust_region_is_advised_by_its_own_field():
    assert health.clip_settings_read({"clipfrac": 0.9}) == ("symmetric", ["train.clip_range"])
    (f,) = [f for f in health.diagnose_step({"clipfrac": 0.95}) if f.rule == "clip_saturation"]
    assert f.severity == "critical" and "widen `train.clip_range`" in actions_text(f)
    # AWM's ratio is of matching losses, clipped at train.awm_clip_range
    (f,) = [f for f in health.diagnose_step({"clipfrac": 0.7, "fm_loss": 0.3}) if f.rule == "clip_saturation"]
    assert "widen `train.awm_clip_range`" in actions_text(f) and "train.clip_range`" not in actions_text(f)
    # PTRW has no hard clip: its clipfrac against train.clip_range is a comparison only; the gate's mean is judged
    assert not [f for f in health.diagnose_step({"clipfrac": 0.9, "ptrw/trust_weights_mean": 0.8})
                if f.rule == "clip_saturation"]
    (f,) = [f for f in health.diagnose_step({"clipfrac": 0.0, "ptrw/trust_weights_mean": 0.27})
            if f.rule == "clip_saturation"]
    assert f.severity == "warn" and "widen `train.ptrw_sigma`" in actions_text(f)
    assert "widen `train.clip_range`" not in actions_text(f)
    (f,) = [f for f in health.diagnose_step({"ptrw/trust_weights_mean": 0.05}) if f.rule == "clip_saturation"]
    assert f.severity == "critical"


def toy_run(run_dir, *extra):
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy",
           f"--config.run_dir={run_dir}", "--config.num_epochs=3", "--config.eval.freq=100",
           "--config.logging.wandb_mode=disabled", "--config.train.policy_loss=grpo_variants",
           "--config.train.use_asymmetric_clipping=True", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    findings = [f for r in records if r["type"] == "health" for f in r["findings"]]
    return steps, findings, (Path(run_dir) / "diagnosis.md").read_text()


def test_toy_asymmetric_run_clips_on_its_clip_range_s_scale(tmp_path):
    """The issue's toy case end to end: at the old fixed widths asymmetric clipping puts most ratios outside its
    bounds on the epoch's second step and the diagnosis names the asymmetric fields; at the default (multiples of
    the toy's 0.05) it clips a few percent and raises no finding."""
    steps, findings, report = toy_run(tmp_path / "fixed", "--config.train.clip_ratio_pos=0.0014",
                                      "--config.train.clip_ratio_neg=0.001")
    assert max(s["clipfrac"] for s in steps) > 0.5
    saturated = [f for f in findings if f["rule"] == "clip_saturation"]
    assert saturated and "asymmetric/clipfrac_pos" in saturated[0]["numbers"]
    assert "train.clip_ratio_pos" in report and "widen `train.clip_range`" not in report
    steps, findings, _ = toy_run(tmp_path / "scaled")
    print("clip fractions at the scaled widths:", [round(s["clipfrac"], 3) for s in steps])
    assert max(s["clipfrac"] for s in steps) < 0.5
    assert not [f for f in findings if f["rule"] == "clip_saturation"]
