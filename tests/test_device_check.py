"""scripts/device_check.py: every stage at tiny sizes on the CPU writes every key a GPU run reports (each stage's
module in scripts/device_stages/ names them), a stage that runs out of time is recorded without losing the others,
the learning stage's interval is a paired t-interval, and its runs draw a held-out curve, come back small and
continue in a later window (--resume), beside placebo runs trained to the same seconds (--learning-arms)."""

from __future__ import annotations

import copy
import gzip
import hashlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)  # puts the repository on sys.path, for the stage modules below

from recam.infra.stats import paired_change  # noqa: E402
from scripts.device_stages import bundle, learning, report  # noqa: E402

KEYS = {
    "recam": ("sampling_step_s", "trained_step_s", "peak_memory_gib", "mfu", "first_step_ratio_dev_bf16",
              "first_step_ratio_dev_fp16", "adapter_save_s", "adapter_load_s", "epoch_s_implied",
              "forward_alone_s", "train_passes_alone_s"),
    "vae": ("encode_s", "decode_s", "peak_memory_gib"),
    "motion": ("sampling_step_s", "trained_step_s", "peak_memory_gib"),
}
LEARNING = ("samples_per_update", "epochs", "seconds", "base", "final", "gain", "ci95", "curve", "plot",
            "seconds_per_update", "seconds_device", "seconds_host", "device_share", "bundle", "max_train_seconds")


def check_tiny(*args: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "scripts/device_check.py", "--tiny", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # as conftest.py's
    out = Path(args[args.index("--out") + 1])
    return p.returncode, json.loads((out / "device_check.json").read_text()) if p.returncode in (0, 1) else {
        "stderr": p.stderr[-3000:]}


def log_records(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / bundle.PACKED_LOG, "rt") as f:
        return [json.loads(line) for line in f]


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
        # a point per evaluation (freq 1: the base, epoch 1, the end), the end's interval the reported one
        curve = learning["curve"]
        assert len(curve) >= 2 and curve[0]["tag"] == "start" and curve[0]["epoch"] == 0, curve
        assert curve[-1]["score"] == learning["final"] and curve[-1]["epoch"] == learning["epochs"]
        assert [p["train_seconds"] for p in curve] == sorted(p["train_seconds"] for p in curve)
        assert (out / learning["plot"]).stat().st_size > 0
        assert learning["seconds_per_update"] > 0 and learning["samples_per_update"] == 8
        timed = learning["seconds_device"]  # measured by the trainer, or None where its records lack it
        assert (timed is None) == (learning["device_share"] is None) and (timed is None or 0 < learning[
            "device_share"] <= 1)
        # the bundle: the checkpoint `latest` names (and `selected`'s), the log packed
        run = out / "runs" / ("tiny_gpu" if name == "camera" else "motion_tiny_gpu")
        folders = sorted(p.name for p in (run / "checkpoints").glob("epoch_*"))
        assert folders == learning["bundle"]["checkpoints"] and "epoch_0001" in folders and len(folders) <= 2
        assert not (run / "metrics.jsonl").exists() and (run / bundle.PACKED_LOG).exists()
        assert learning["bundle"]["bytes"] == sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    assert r["learning"]["motion"]["score"] == "eval/r_precision_top3"  # its gain paired per caption
    assert set(r["overhead"]) == {"recam_sampling", "recam_training", "motion_sampling", "motion_training"}
    summary = (out / "device_check.md").read_text()
    assert "# Device check: cpu" in summary and "sampling_step_s" in summary and "learning" in summary
    assert "### camera: held-out curve" in summary and "| start | 0 |" in summary


def test_each_stage_reports_the_keys_its_module_names(tiny):
    _, r = tiny
    for name, module in device_check.STAGE_MODULES.items():
        entries = [r[name][run] for run in ("camera", "motion")] if name == "learning" else [r[name]]
        for entry in entries:
            if name == "fsdp" and "skipped" in entry:  # the CPU: accelerate's FSDP needs an accelerator
                continue
            missing = [k for k in module.KEYS if k not in entry]
            assert not missing, (name, missing)
        assert set(module.CAP) == set(module.SIZES) == {"full", "tiny"}
        assert device_check.SIZES["tiny"]["caps"][name] == module.CAP["tiny"]


ONE = ("--stages", "learning", "--learning-presets", "motion_tiny_gpu")


@pytest.fixture(scope="module")
def motion_window(tmp_path_factory):
    """A first window of the motion preset's GRPO run alone (the later windows below continue from it)."""
    first = tmp_path_factory.mktemp("first")
    rc, r1 = check_tiny("--out", str(first), *ONE)
    assert rc == 0, r1
    return first, r1


def test_a_learning_run_continues_in_a_later_window(tmp_path, motion_window):
    """--resume DIR: the run DIR brought back continues at its next epoch for the window's seconds more; its log
    and curve hold both windows, no epoch twice; a run folder already there is never continued silently."""
    (first, r1), second, one = motion_window, tmp_path / "second", ONE
    rc, r2 = check_tiny("--out", str(second), *one, "--resume", str(first))
    assert rc == 0, r2
    a, b = r1["learning"]["motion"], r2["learning"]["motion"]
    assert a["resumed_from"] is None and a["epochs"] == 1  # the tiny cap: one epoch per window
    carried = b["resumed_from"]
    assert carried["epochs"] == 1 and carried["checkpoint"] == "epoch_0001"
    assert carried["train_seconds"] == carried["log_train_seconds"] == a["train_seconds"]
    assert b["max_train_seconds"] == pytest.approx(a["train_seconds"] + device_check.SIZES["tiny"]["learning"][
        "seconds"])
    assert b["epochs"] == 2 and b["train_seconds"] > a["train_seconds"]

    def points(r):
        return [(p["tag"], p["epoch"], p["train_seconds"], p["score"]) for p in r["curve"]]
    assert points(b)[:len(points(a))] == points(a)  # the first window's end kept, though the log drops it
    assert {p[1] for p in points(b)[len(points(a)):]} == {2} and points(b)[-1][0] == "final"
    assert b["base"] == a["base"] and (second / b["plot"]).exists()

    records = log_records(second / "runs" / "motion_tiny_gpu")
    assert [r["epoch"] for r in records if r["type"] == "epoch"] == [0, 1]
    assert [r["step"] for r in records if r["type"] == "step"] == [1, 2]
    assert sorted(p.name for p in (second / "runs" / "motion_tiny_gpu" / "checkpoints").glob("epoch_*")) == [
        "epoch_0002"]
    assert (first / "runs" / "motion_tiny_gpu" / "checkpoints" / "epoch_0001").is_dir()  # copied, not moved

    rc, r3 = check_tiny("--out", str(second), *one)  # no --resume: refused, nothing trained
    assert rc == 1 and r3["stages"]["learning"]["status"] == "error"
    assert "--resume" in r3["learning"]["motion"]["error"]
    assert [r["epoch"] for r in log_records(second / "runs" / "motion_tiny_gpu") if r["type"] == "epoch"] == [0, 1]


def test_a_placebo_catches_up_with_its_grpo_run_and_both_continue_together(tmp_path, motion_window):
    """--learning-arms placebo: the placebo (advantage.placebo=True, in runs/<preset>_placebo) trains from the same
    base until it has the GRPO run's training seconds, the GRPO run is carried over untrained, and GRPO minus
    placebo is paired over the held-out conditions at the last update both evaluated; a later window with both
    arms continues both bundles, the placebo again to the GRPO run's new seconds."""
    (first, r1), second, third = motion_window, tmp_path / "second", tmp_path / "third"
    rc, r2 = check_tiny("--out", str(second), *ONE, "--learning-arms", "placebo", "--resume", str(first))
    assert rc == 0, r2
    grpo, placebo, vs = r2["learning"]["motion"], r2["learning"]["motion_placebo"], r2["learning"]["motion"][
        "vs_placebo"]
    assert not [k for k in learning.KEYS if k not in placebo]  # a placebo run reports what a GRPO run does
    assert not [k for k in learning.PLACEBO_KEYS if k not in grpo]
    assert grpo["trained"] is False and grpo["epochs"] == 1 and grpo["train_seconds"] == r1["learning"]["motion"][
        "train_seconds"]
    assert [r["epoch"] for r in log_records(second / "runs" / "motion_tiny_gpu") if r["type"] == "epoch"] == [0]
    run = second / "runs" / "motion_tiny_gpu_placebo"
    assert json.loads((run / "config.json").read_text())["advantage"]["placebo"] is True and placebo["placebo"]
    assert placebo["verification"] == "PASS" and "(PASS)" in (run / "summary.md").read_text()
    assert all(r.get("placebo") is True for r in log_records(run) if r["type"] == "epoch")
    assert placebo["resumed_from"] is None and placebo["max_train_seconds"] == grpo["train_seconds"]
    assert placebo["train_seconds"] >= grpo["train_seconds"] and placebo["epochs"] >= 1  # the same budget at least
    # the same base, the same conditions: GRPO minus placebo at update 1, paired condition by condition
    assert vs["base_difference"] == 0 and placebo["base"] == grpo["base"] and vs["step"] == 1
    evals = {arm: {r["step"]: r for r in log_records(second / "runs" / d) if r["type"] == "eval"}
             for arm, d in (("grpo", "motion_tiny_gpu"), ("placebo", "motion_tiny_gpu_placebo"))}
    mean, half, n = paired_change(evals["placebo"][1]["rows/eval/r_precision_top3"],
                                  evals["grpo"][1]["rows/eval/r_precision_top3"])
    assert (vs["difference"], vs["ci95"], vs["conditions"]) == pytest.approx((mean, half, n)) and n == 32
    assert math.isfinite(vs["beside"]["difference"]) and vs["at_ends"]["placebo_step"] == placebo["epochs"]
    # each arm's guard events, read from its run folder (motion's tiny size runs health.action=warn: never a stop)
    for arm, entry in (("grpo", grpo), ("placebo", placebo)):
        assert vs["events"][arm] == {k: entry["events"][k] for k in learning.EVENT_KEYS}
        assert entry["events"]["guard_stop"] is None and entry["events"]["rollbacks"] == 0
    assert vs["events"]["differ"] == (vs["events"]["grpo"] != vs["events"]["placebo"])
    assert placebo["plot"] == grpo["plot"] and (second / grpo["plot"]).stat().st_size > 0  # one plot, both curves
    assert "### GRPO minus placebo" in (second / "device_check.md").read_text()
    assert r2["learning"]["bundle_bytes"] == grpo["bundle"]["bytes"] + placebo["bundle"]["bytes"]

    rc, r3 = check_tiny("--out", str(third), *ONE, "--learning-arms", "grpo,placebo", "--resume", str(second))
    assert rc == 0, r3
    grpo3, placebo3 = r3["learning"]["motion"], r3["learning"]["motion_placebo"]
    assert grpo3["epochs"] == 2 and placebo3["resumed_from"]["train_seconds"] == placebo["train_seconds"]
    assert placebo3["max_train_seconds"] == grpo3["train_seconds"]  # the GRPO run's new cumulative seconds
    assert placebo3["train_seconds"] >= grpo3["train_seconds"] and placebo3["verification"] == "PASS"
    # both evaluate after every update here: the last one both made (the placebo's epochs can be slower on a busy
    # machine, and then fewer for the same seconds)
    assert grpo3["vs_placebo"]["step"] == min(2, placebo3["epochs"]) and 1 in grpo3["vs_placebo"]["steps_in_common"]


def test_grpo_minus_placebo_pairs_the_last_update_both_evaluated():
    def ev(step, rows, seconds):
        return {"type": "eval", "step": step, "train_seconds": seconds, "eval/s": statistics.fmean(rows),
                "rows/eval/s": rows, "eval/b": 0.0, "rows/eval/b": [0.0] * len(rows)}
    grpo = [ev(0, [0.1, 0.2, 0.3], 0), ev(5, [0.4, 0.2, 0.5], 50), ev(7, [0.5, 0.3, 0.6], 70)]
    placebo = [ev(0, [0.1, 0.2, 0.3], 0), *[ev(s, [0.1 * s, 0.2, 0.3], 10 * s) for s in range(1, 9)]]
    vs = learning.versus_placebo(grpo, placebo, "eval/s", "eval/b", 8)
    assert vs["steps_in_common"] == [0, 5, 7] and vs["step"] == 7 and vs["samples"] == 56
    assert (vs["difference"], vs["conditions"]) == (pytest.approx(statistics.fmean([0.5 - 0.7, 0.1, 0.3])), 3)
    assert vs["base_difference"] == 0 and vs["at_ends"]["grpo_step"] == 7 and vs["at_ends"]["placebo_step"] == 8
    assert vs["at_ends"]["difference"] == pytest.approx(statistics.fmean([0.5 - 0.8, 0.1, 0.3]))
    # one seed pair: paired over the conditions, its p from that t, and said to be conditional on the seed
    d = [0.5 - 0.7, 0.1, 0.3]
    se = statistics.stdev(d) / 3 ** 0.5
    assert vs["ci95"] == pytest.approx(4.302652729911275 * se)
    assert vs["p"] == pytest.approx(2 * stats.t.sf(abs(statistics.fmean(d)) / se, 2))
    assert "conditional on this seed" in vs["interval"]
    vs = learning.versus_placebo(grpo, placebo[:4], "eval/s", "eval/b", 8)  # the placebo only got to update 3
    assert vs["step"] == 0 and vs["difference"] is None and "nothing but the base" in vs["note"]
    assert "placebo run" in learning.versus_placebo(grpo, placebo[1:], "eval/s", "eval/b", 8)["error"]


def test_arms_scored_on_different_held_out_sets_are_an_error_not_a_difference():
    """A placebo that evaluated 2 conditions beside a GRPO run's 3 is no pair: vs_placebo says so (with each arm's
    events), where it used to report a difference of the means over one "condition" with no interval."""
    def ev(step, rows):
        return {"type": "eval", "step": step, "train_seconds": step, "eval/s": statistics.fmean(rows),
                "rows/eval/s": rows, "eval/b": 0.0, "rows/eval/b": [0.0] * len(rows)}
    vs = learning.versus_placebo([ev(0, [0.1, 0.2, 0.3]), ev(1, [0.3, 0.2, 0.3])], [ev(0, [0.1, 0.2]),
                                 ev(1, [0.1, 0.3])], "eval/s", "eval/b", 8)
    assert "not paired" in vs["error"] and "(3 and 2 conditions)" in vs["error"] and "difference" not in vs
    assert set(vs["events"]) == {"grpo", "placebo", "differ"}


def test_a_placebo_of_another_size_than_its_grpo_run_is_not_run(tmp_path):
    """--tiny beside a GPU-size run from --resume (the window's command rehearsed on the CPU): the placebo would
    draw other samples and score another held-out set, so it is refused before it runs, naming the settings. At
    one size, the committed GPU runs (full) and a run that --tiny made (tiny) pair."""
    for preset in ("tiny_gpu", "motion_tiny_gpu"):
        committed = ROOT / "docs" / "learning_gpu" / "runs" / preset
        assert learning.unpaired_sizes(preset, learning.kept_heldout(committed, ()), committed) == []
        tiny = learning.SIZES["tiny"]["overrides"][preset]
        unpaired = learning.unpaired_sizes(preset, tiny, committed)
        assert any(u.startswith("sample.batch_size '8' here") for u in unpaired), unpaired
        made = tmp_path / preset
        made.mkdir()
        config = json.loads((committed / "config.json").read_text())
        for o in tiny:
            key, value = o.removeprefix("--config.").split("=", 1)
            *path, last = key.split(".")
            node = config
            for part in path:
                node = node[part]
            node[last] = type(node[last])(value) if value else value
        (made / "config.json").write_text(json.dumps(config))
        assert learning.unpaired_sizes(preset, tiny, made) == []
        size = {**learning.SIZES["tiny"], "arms": ("placebo",)}
        grpo = tmp_path / "out" / "runs" / preset  # the GPU run carried over: its config.json is what is read
        grpo.mkdir(parents=True)
        (grpo / "config.json").write_bytes((committed / "config.json").read_bytes())
        out = learning.run_preset(preset, size, tmp_path / "out", 10, None, placebo=True)
        assert out["error"].startswith("not run: this placebo would not pair with") and "more. Run both" in out["error"]
        assert not (tmp_path / "out" / "runs" / (preset + learning.PLACEBO)).exists()


def test_grpo_minus_placebo_reports_each_arm_s_guard_events():
    """The guard's rollbacks and stops act on the rewards, so they can differ between the arms: vs_placebo repeats
    each run's, says whether they differ, and the report's table shows them, beside an error too."""
    def ev(step):
        return {"type": "eval", "step": step, "train_seconds": step, "eval/s": 0.1, "rows/eval/s": [0.1, 0.2],
                "eval/b": 0.0, "rows/eval/b": [0.0, 0.0]}
    quiet = {"rollbacks": 0, "guard_stop": None, "critical": 0, "warning": 2, "info": 0, "critical_steps": 0,
             "rules": {"clip_saturation": 2}}
    rolled = {**quiet, "rollbacks": 1, "critical": 5, "critical_steps": 1, "rules": {"ratio_explosion": 5}}
    vs = learning.versus_placebo([ev(0), ev(1)], [ev(0), ev(1)], "eval/s", "eval/b", 8, quiet, rolled)
    assert vs["events"] == {"grpo": {"rollbacks": 0, "guard_stop": None, "critical": 0, "warning": 2},
                            "placebo": {"rollbacks": 1, "guard_stop": None, "critical": 5, "warning": 2},
                            "differ": True}
    assert learning.versus_placebo([ev(0)], [ev(0)], "eval/s", "eval/b", 8, quiet, quiet)["events"]["differ"] is False
    unknown = learning.versus_placebo([ev(1)], [ev(0)], "eval/s", "eval/b", 8, quiet, None)
    assert "error" in unknown and unknown["events"]["placebo"] is None and unknown["events"]["differ"] is None
    stopped = {**rolled, "guard_stop": "health guard, ratio_explosion at step 2"}
    table = "\n".join(report.placebo_table({
        "camera": {"vs_placebo": vs}, "camera_placebo": {}, "motion": {"vs_placebo": {
            "error": "no evaluations to compare", "events": learning.arm_events(stopped, quiet)}}}))
    assert "guard events, GRPO / placebo" in table and "placebo's base minus GRPO's" in table
    camera = next(line for line in table.splitlines() if line.startswith("| camera |"))
    assert camera.count("|") == table.splitlines()[2].count("|")  # every column filled, the base's difference too
    assert camera.split(" | ")[-2] == "0"
    assert "| 0 rollbacks, 0 critical / 1 rollbacks, 5 critical (the arms differ) |" in table
    assert "1 rollbacks, 5 critical, stopped: health guard, ratio_explosion at step 2 / 0 rollbacks, 0 critical" in (
        table)


def test_a_continued_run_and_its_placebo_keep_the_held_out_count_the_run_began_with(tmp_path):
    """The committed camera run began at 32 held-out conditions, before the presets' 128: continuing it with the
    preset's count would be refused, and a placebo at 128 would not pair with it condition by condition."""
    committed = ROOT / "docs" / "learning_gpu" / "runs" / "tiny_gpu"
    began = json.loads((committed / "config.json").read_text())["data"]["num_heldout_conditions"]
    assert learning.kept_heldout(committed, ()) == (f"--config.data.num_heldout_conditions={began}",)
    assert learning.kept_heldout(committed, ("--config.data.num_heldout_conditions=4",)) == ()  # the size's own
    assert learning.kept_heldout(tmp_path, ()) == ()  # no config.json: the trainer's resume check says what lacks


def test_the_placebo_arm_gets_its_catch_up_in_the_stage_cap(monkeypatch):
    """A placebo trains what it lacks of its GRPO run's cumulative seconds (the --resume bundles say them), the
    GRPO run its window's seconds; each run gets LEARNING_MARGIN_S besides, a placebo PLACEBO_MARGIN_S more for its
    evaluation after every update."""
    monkeypatch.setitem(device_check.SIZES, "full", copy.deepcopy(device_check.SIZES["full"]))
    resume, margin = ROOT / "docs" / "learning_gpu", learning.LEARNING_MARGIN_S + learning.PLACEBO_MARGIN_S
    camera = bundle.trained_seconds(resume / "runs" / "tiny_gpu")
    assert camera == pytest.approx(157.1, abs=0.1)
    device_check.set_learning("full", None, "tiny_gpu", "placebo", resume)
    assert device_check.SIZES["full"]["caps"]["learning"] == pytest.approx(camera + margin + 10)
    device_check.set_learning("full", 60.0, "tiny_gpu", "placebo,grpo", resume)
    assert device_check.SIZES["full"]["learning"]["arms"] == ("grpo", "placebo")  # GRPO first: its seconds set the
    assert device_check.SIZES["full"]["caps"]["learning"] == pytest.approx(  # placebo's budget
        (60 + learning.LEARNING_MARGIN_S) + (camera + 60 + margin) + 10)
    with pytest.raises(SystemExit, match="unknown \\['ppo'\\]"):
        device_check.set_learning("full", None, None, "grpo,ppo")


def test_seconds_per_update_and_the_device_share_are_none_where_no_record_has_them():
    epochs = [{"epoch_seconds": 30.0, "optimizer_steps": [{}]}, {"epoch_seconds": 20.0, "optimizer_steps": [{}, {}]},
              {"epoch_seconds": 12.0, "optimizer_steps": [{}]}]
    t = learning.update_timing(epochs)
    assert t["seconds_per_update"] == 12.0 and t["epochs_device_timed"] == 0
    assert t["seconds_device"] is t["seconds_host"] is t["device_share"] is None
    epochs[0].update(seconds_device=20.0, seconds_host=10.0)
    epochs[1].update(seconds_device=16.0, seconds_host=None)  # not measured there: left out, not counted as 0
    epochs[2].update(seconds_device=8.0, seconds_host=4.0)
    t = learning.update_timing(epochs)
    assert t["epochs_device_timed"] == 2 and t["seconds_device"] == 14.0 and t["seconds_host"] == 7.0
    assert t["device_share"] == pytest.approx(28 / 42)


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
    mean, half, n = paired_change(before, after)
    assert n == 3 and mean == pytest.approx(statistics.fmean(diffs))
    assert half == pytest.approx(4.303 * statistics.stdev(diffs) / math.sqrt(3), rel=2e-4)  # t_{0.975, 2}


def test_a_longer_learning_run_gets_a_cap_that_holds_it_and_unknown_presets_are_named(monkeypatch):
    monkeypatch.setitem(device_check.SIZES, "full", copy.deepcopy(device_check.SIZES["full"]))
    device_check.set_learning("full", 240.0, "motion_tiny_gpu")
    size = device_check.SIZES["full"]
    assert size["learning"]["presets"] == ("motion_tiny_gpu",) and size["learning"]["seconds"] == 240.0
    assert size["caps"]["learning"] == 240 + learning.LEARNING_MARGIN_S + 10  # one run, its margin
    device_check.set_learning("full", 100.0, "tiny_gpu,motion_tiny_gpu")  # two runs, one after the other
    assert size["caps"]["learning"] == 2 * (100 + learning.LEARNING_MARGIN_S) + 10
    with pytest.raises(SystemExit, match="unknown \\['camera'\\]"):
        device_check.set_learning("full", None, "camera")
    with pytest.raises(SystemExit, match="must be positive"):  # num_epochs never ends these runs: the cap must
        device_check.set_learning("full", 0.0, None)


def test_a_bundle_keeps_the_checkpoints_its_pointers_name_and_prunes_nothing_when_latest_names_none(tmp_path):
    run = tmp_path / "run"
    for name in ("epoch_0000", "epoch_0001", "epoch_0002", ".tmp-epoch_0003"):  # the last: a save killed midway
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("epoch_0002")
    (run / "checkpoints" / "selected").write_text("epoch_0000")
    (run / "metrics.jsonl").write_text('{"type": "epoch", "epoch": 0}\n')
    out = bundle.pack(run)
    assert out["checkpoints"] == ["epoch_0000", "epoch_0002"] and "pruned" not in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["epoch_0000", "epoch_0002"]
    assert log_records(run) == [{"type": "epoch", "epoch": 0}] and not (run / "metrics.jsonl").exists()
    assert out["bytes"] == sum(p.stat().st_size for p in run.rglob("*") if p.is_file())

    (run / "checkpoints" / "latest").write_text("epoch_0009")  # names nothing there: no guess at what to keep
    out = bundle.pack(run)
    assert "nothing" in out["pruned"] and out["checkpoints"] == ["epoch_0000", "epoch_0002"]


def test_a_bundle_drops_a_linked_checkpoint_it_does_not_keep_and_leaves_its_target(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "epoch_0000"
    elsewhere.mkdir(parents=True)
    (elsewhere / "state.json").write_text("{}")
    (run / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0000").symlink_to(elsewhere, target_is_directory=True)
    (run / "checkpoints" / "latest").write_text("epoch_0001")
    out = bundle.pack(run)  # rmtree on the link raised OSError
    assert out["checkpoints"] == ["epoch_0001"] and not (run / "checkpoints" / "epoch_0000").is_symlink()
    assert (elsewhere / "state.json").exists()


def test_a_bundle_whose_checkpoint_fails_its_manifest_is_not_continued(tmp_path):
    prior = tmp_path / "prior" / "runs" / "motion_tiny_gpu"
    ckpt = prior / "checkpoints" / "epoch_0001"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"epoch": 1, "global_step": 1, "budget": {"train_seconds": 5.0}}')
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "algorithm": "sha256", "files": {
        "state.json": {"bytes": 3, "sha256": "0" * 64}}}))
    (prior / "checkpoints" / "latest").write_text("epoch_0001")
    size = device_check.SIZES["tiny"]["learning"]
    out = learning.run_preset("motion_tiny_gpu", size, tmp_path / "out", 60, prior)
    assert "CheckpointCorrupt" in out["error"] and "state.json" in out["error"]
    assert not (tmp_path / "out" / "runs" / "motion_tiny_gpu").exists()  # nothing half-copied stays behind


@pytest.mark.parametrize("preset", ["tiny_gpu", "motion_tiny_gpu"])
def test_the_committed_learning_runs_continue_from_pickle_free_checkpoints(tmp_path, preset):
    """--resume docs/learning_gpu: each committed bundle's checkpoints verify and hold no pickle, so the next window
    resumes them without trust_legacy_checkpoint; a bundle of the older layout is refused, naming the conversion."""
    from recam.infra.checkpoint import LEGACY_TRAINER, read_pointer, read_trainer_state, verify_checkpoint

    prior = ROOT / "docs" / "learning_gpu" / "runs" / preset
    carried = bundle.carry_over(prior, tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    assert carried["checkpoint"] == read_pointer(root) and carried["epochs"] > 0
    for ckpt in sorted(root.glob("epoch_*")):
        assert verify_checkpoint(ckpt) and not (ckpt / LEGACY_TRAINER).exists()
        assert read_trainer_state(ckpt)["optimizer"]["state"] or ckpt.name == "epoch_0000"
    legacy = root / carried["checkpoint"]
    (legacy / LEGACY_TRAINER).write_bytes(b"a pickle")
    manifest = json.loads((legacy / "manifest.json").read_text())
    manifest["files"][LEGACY_TRAINER] = {"bytes": 8, "sha256": hashlib.sha256(b"a pickle").hexdigest()}
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match=f"{LEGACY_TRAINER} is a pickle .*convert_checkpoints.py"):
        bundle.carry_over(tmp_path / "run", tmp_path / "again")
