"""scripts/measure/noise_sweep.py: every setting it runs is a valid config, and its table's noise scale, interval and
seconds to a cosine of 1/2 are the hand-computed ones from a run's epoch records."""

import json
import math

import pytest

from config import grpo
from config.validate import validate
from scripts.measure import noise_sweep


def _with_overrides(name: str, overrides: list[str]):
    """The preset with `--config.a.b=v` overrides applied, cast to the field's own type, as the command line does."""
    c = grpo.get_config(name)
    for o in overrides:
        path, value = o.removeprefix("--config.").split("=", 1)
        *parents, leaf = path.split(".")
        node = c
        for p in parents:
            node = node[p]
        old = node[leaf]
        node[leaf] = (value == "True") if isinstance(old, bool) else type(old)(value)
    return c


@pytest.mark.parametrize("preset,label,suffix,overrides", [
    (preset, label, suffix, overrides) for d, gpu in (("camera", "tiny_gpu"), ("motion", "motion_tiny_gpu"))
    for p in (None, gpu) for preset, settings in [noise_sweep.settings_for(d, p)]
    for label, suffix, overrides in settings])
def test_every_setting_is_a_valid_config_at_the_presets_update_size(preset, label, suffix, overrides):
    base = validate(grpo.get_config(preset), 1)
    numbers = validate(_with_overrides(preset + suffix, overrides), 1)
    assert numbers.samples_per_epoch == base.samples_per_epoch  # settings compare at one update size


def _epoch(g2: float, trace: float, steps: int = 1, samples: int = 128, seconds: float = 64.0) -> dict:
    return {"type": "epoch", "gradient_noise_scale": None, "noise/g2": g2, "noise/trace": trace,
            "noise/steps": steps, "noise/update_samples": float(samples), "samples_per_epoch": samples,
            "epoch_seconds": seconds, "nfe_sampling": 10 * samples, "nfe_training": 5 * samples}


def _write(run_dir, epochs):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in epochs))


def test_a_row_is_the_hand_computed_noise_scale_interval_and_seconds(tmp_path):
    from recam.engine.noise_scale import bootstrap_ratio_interval

    # |G|^2 over 3 epochs: 1e-6, 2e-6, 3e-6 (mean 2e-6, sd 1e-6); t(0.975, 2) = 4.303: the interval contains 0,
    # so no point value, only the lower end
    _write(tmp_path / "a", [_epoch(1e-6, 1e-3), _epoch(2e-6, 1e-3), _epoch(3e-6, 1e-3)])
    r = noise_sweep.row(tmp_path / "a")
    half = 4.302653 * 1e-6 / math.sqrt(3)
    assert r["noise_scale"] is None and r["seconds_to_half"] is None
    assert r["noise_scale_low"] == pytest.approx(1e-3 / (2e-6 + half), rel=1e-5)
    assert r["noise_scale_high"] == math.inf  # open above
    assert r["seconds_per_sample"] == pytest.approx(0.5)
    assert r["seconds_to_half_low"] == pytest.approx(r["noise_scale_low"] * 0.5)
    assert r["nfe_per_sample"] == pytest.approx(15)
    # 1.9e-6, 2e-6, 2.1e-6: sd 1e-7, half 2.5e-7, the interval excludes 0: the point value and the bootstrap's
    _write(tmp_path / "b", [_epoch(1.9e-6, 1e-3), _epoch(2e-6, 1e-3), _epoch(2.1e-6, 1e-3)])
    r = noise_sweep.row(tmp_path / "b")
    assert r["noise_scale"] == pytest.approx(500, rel=1e-9)
    low, high = bootstrap_ratio_interval([1.9e-6, 2e-6, 2.1e-6], [1e-3] * 3)
    assert (r["noise_scale_low"], r["noise_scale_high"]) == pytest.approx((low, high))
    assert r["seconds_to_half"] == pytest.approx(250, rel=1e-9)
    assert noise_sweep.row(tmp_path / "missing") is None
    _write(tmp_path / "one", [_epoch(1e-6, 1e-3)])
    assert noise_sweep.row(tmp_path / "one") is None  # one epoch has no interval


def test_the_table_ranks_by_the_lower_end_and_names_separated_intervals(tmp_path, monkeypatch):
    monkeypatch.setitem(noise_sweep.SETTINGS, "camera", ("tiny_cpu", [("wide", "", []), ("tight", "", []),
                                                                      ("never ran", "", [])]))
    # tight: |G|^2 1e-6 +- tiny -> ~1,000; wide: |G|^2 1e-8 +- tiny -> ~100,000
    _write(tmp_path / "tight", [_epoch(1.0e-6, 1e-3), _epoch(1.01e-6, 1e-3), _epoch(0.99e-6, 1e-3)])
    _write(tmp_path / "wide", [_epoch(1.0e-8, 1e-3), _epoch(1.01e-8, 1e-3), _epoch(0.99e-8, 1e-3)])
    (tmp_path / "tight" / "summary.md").write_text("done")  # "wide" has no summary yet: still running
    text = noise_sweep.table("camera", tmp_path)
    lines = text.splitlines()
    ranked = [x.split("|")[1].strip() for x in lines if x.startswith("| ") and "setting" not in x]
    assert ranked == ["tight", "wide (running)"]
    assert "not measured (yet): never ran" in text
    assert "intervals that separate: tight < wide" in text
    assert "1,000 [" in text and "100,000 [" in text
