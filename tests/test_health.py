import importlib.util
import json
import math
from pathlib import Path

import pytest

from recam.engine import diagnosis, health

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("diagnose", ROOT / "scripts" / "diagnose.py")
diagnose_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diagnose_script)

# The metrics of a real blown-up run.
BLOWN_UP = {"loss": 1.7155e8, "policy_loss": 1.7153e8, "kl_penalty": 1.9756e5, "mean_ratio": 4.8517e8,
            "mean_advantage": 0.0, "mean_log_prob_current": -8.336e5, "mean_log_prob_ref": -1.0312e6,
            "mean_reward": 0.4971, "std_reward": 0.1766, "zero_std_ratio": 1.0}


def healthy(step=1, **over):
    m = {"step": step, "epoch": (step - 1) // 4, "loss": 0.01 * (-1) ** step, "policy_loss": 0.0096 * (-1) ** step,
         "kl_penalty": 1e-4, "mean_ratio": 1.0003, "ratio_min": 0.998, "ratio_max": 1.004, "clipfrac": 0.04,
         "clipfrac_high": 0.02, "clipfrac_low": 0.02, "approx_kl": 2e-6, "mean_log_prob_current": 1.31,
         "mean_log_prob_old": 1.31, "mean_log_prob_ref": 1.30, "mean_advantage": 3e-9, "grad_norm": 0.4,
         "learning_rate": 1e-4, "zero_std_ratio": 0.0625, "mean_reward": 0.5, "std_reward": 0.17}
    m.update(over)
    return m


def rules(findings, severity=None):
    return {f.rule for f in findings if severity is None or f.severity == severity}


def test_blown_up_run_is_critical_naming_ratio_drift_and_missing_signal():
    findings = health.diagnose_step(BLOWN_UP, [])
    assert diagnosis.worst_severity(findings) == "critical" and not diagnosis.is_healthy(findings)
    critical = rules(findings, "critical")
    assert {"ratio_explosion", "reference_drift", "no_advantage_signal", "loss_blowup", "kl_growth"} <= critical
    by_rule = {f.rule: f for f in findings}
    assert by_rule["ratio_explosion"].numbers["mean_ratio"] == 4.8517e8
    assert by_rule["reference_drift"].numbers["drift_per_element"] == pytest.approx(1.976e5, rel=1e-3)
    assert "policy_loss" in by_rule["no_advantage_signal"].explanation  # a loss with all-zero advantages
    text = diagnosis.format_findings(findings)
    assert text.startswith("- **CRITICAL**")
    for field in ("train.learning_rate", "train.beta", "motion.log_prob_reduction", "model.lora_rank",
                  "sample.noise_level", "reward.weights", "checkpoints/latest"):
        assert field in text
    assert "reward_collapse" not in rules(findings)  # mean 0.50, std 0.18: the reward itself is fine


def test_ratio_explosion_names_its_causes_in_order_and_what_a_clamp_hides():
    f = next(f for f in health.diagnose_step(BLOWN_UP, []) if f.rule == "ratio_explosion")
    why = f.explanation
    causes = ["(1) log-probs summed over elements", "(2) a reference that trains", "(3) LoRA bound to nothing",
              "(4) the learning rate"]
    assert all(c in why for c in causes) and [why.index(c) for c in causes] == sorted(why.index(c) for c in causes)
    # measured, not guessed: a mean log-prob of -8.3e5 is no per-element log-density
    assert "mean_log_prob_ref -1.031e+06 is no per-element log-density" in why
    assert "`train.log_ratio_clamp`) caps exp(log-ratio) and so the loss: it hides the cause" in why
    assert not any("log_ratio_clamp" in a for a in f.actions)  # the clamp is no remedy
    assert "so exp(log-ratio) cannot explode" not in diagnosis.format_findings([f])  # the old advice is gone
    assert f.actions[0].startswith("check that log-probs are per-element means")
    assert f.actions[1].startswith("check the reference is frozen and only LoRA trains")
    # every advantage is 0, so this ratio cannot have made this loss: said so rather than blamed on the ratio
    assert "is not this ratio's: every advantage is 0" in why


# the plan's blown-up numbers: ratio 4.8e8, a log-prob gap of 1e5 to the reference, loss 1.7e8
PLAN_RATIO = {"mean_ratio": 4.8e8, "mean_log_prob_current": -8.336e5, "mean_log_prob_ref": -8.336e5 - 1e5,
              "loss": 1.7e8, "learning_rate": 1e-4}


def test_the_tiered_remedies_on_the_plan_s_numbers():
    why, actions, nums = health.ratio_explosion_advice(PLAN_RATIO, health.DEFAULT)
    assert nums["worst_log_ratio"] == pytest.approx(math.log(4.8e8), rel=1e-12)  # 19.99 nats
    # learning rate: past log(100) nats the top tier, 100x, and only once the causes before it are ruled out
    assert (nums["learning_rate_tier"], nums["learning_rate_divisor"]) == (3, 100.0)
    lr = next(a for a in actions if a.startswith("learning-rate tier 3 of 3"))
    assert "lower `train.learning_rate` 100x (0.0001 -> 1e-06)" in lr and "only after (1)-(3)" in lr
    # KL: 1e5 nats per element is past ref_drift_critical; no beta pulls that back within a run
    assert nums["log_prob_gap"] == pytest.approx(1e5, rel=1e-9) and nums["kl_tier"] == 2
    kl = next(a for a in actions if a.startswith("KL tier 2 of 2"))
    assert "no KL weight pulls that back" in kl and "`train.beta` 10x" in kl
    # loss: 1.7e8 / 4.8e8 = 0.354, an advantage-sized factor: the loss is the ratio's, and bounding it hides it
    assert nums["loss_over_ratio"] == pytest.approx(1.7e8 / 4.8e8, rel=1e-12)
    assert "|loss| / mean_ratio = 0.354" in why and "would hide the ratio as the clamp does" in why
    assert actions[1] == next(a for a in actions if "check the reference is frozen and only LoRA trains" in a)


@pytest.mark.parametrize("ratio,tier,divisor", [(1.5, 1, 2.0), (2.0, 1, 2.0), (0.4, 2, 10.0), (50.0, 2, 10.0),
                                                (100.0, 2, 10.0), (101.0, 3, 100.0), (4.8e8, 3, 100.0)])
def test_learning_rate_tiers(ratio, tier, divisor):
    assert health.learning_rate_tier(math.log(ratio), health.DEFAULT) == (tier, divisor)


@pytest.mark.parametrize("gap,tier", [(0.5, 0), (1.0, 0), (5.0, 1), (10.0, 1), (10.5, 2), (1e5, 2)])
def test_kl_tiers(gap, tier):
    assert health.kl_tier(gap, health.DEFAULT) == tier
    m = healthy(2, mean_ratio=3.0, mean_log_prob_current=1.0, mean_log_prob_ref=1.0 - gap)
    f = next(f for f in health.diagnose_step(m, []) if f.rule == "ratio_explosion")
    assert f.numbers["kl_tier"] == tier
    assert any(a.startswith(f"KL tier {tier} of 2") for a in f.actions) == (tier > 0)


def test_healthy_metrics_give_no_findings():
    history = [healthy(s) for s in range(1, 40)]
    assert health.diagnose_step(healthy(40), history) == []
    assert health.diagnose_step(healthy(1), []) == []
    assert diagnosis.is_healthy([]) and diagnosis.worst_severity([]) is None
    assert "healthy" in diagnosis.format_findings([])


@pytest.mark.parametrize("key,value", [("loss", math.nan), ("grad_norm", math.inf), ("mean_ratio", math.nan)])
def test_nan_or_inf_is_critical(key, value):
    findings = health.diagnose_step(healthy(5, **{key: value}), [healthy(s) for s in range(1, 5)])
    f = next(f for f in findings if f.rule == "non_finite")
    assert f.severity == "critical" and f.numbers["keys"] == [key]


def test_loss_far_above_running_median_warns():
    history = [healthy(s) for s in range(1, 30)]
    f = health.diagnose_step(healthy(30, loss=5.0, policy_loss=5.0), history)
    assert [(x.rule, x.severity) for x in f] == [("loss_blowup", "warn")]
    assert health.diagnose_step(healthy(30, loss=5.0), history[:2]) == []  # too little history for a median
    assert rules(health.diagnose_step(healthy(30, loss=-250.0), []), "critical") == {"loss_blowup"}


def test_kl_growing_fast_and_clip_saturation():
    history = [healthy(s, kl_penalty=2e-3) for s in range(1, 12)]
    f = health.diagnose_step(healthy(12, kl_penalty=0.05), history)
    assert [(x.rule, x.severity) for x in f] == [("kl_growth", "warn")]
    assert health.diagnose_step(healthy(12, kl_penalty=5e-3), history) == []  # below the floor
    assert health.diagnose_step(healthy(2, clipfrac=0.6), [])[0].severity == "warn"
    assert health.diagnose_step(healthy(2, clipfrac=0.95), [])[0].severity == "critical"


def test_ratio_bounds():
    assert rules(health.diagnose_step(healthy(2, mean_ratio=0.4), []), "critical") == {"ratio_explosion"}
    assert rules(health.diagnose_step(healthy(2, ratio_max=1e4), []), "critical") == {"ratio_explosion"}
    assert rules(health.diagnose_step(healthy(2, mean_ratio=1.5), []), "warn") == {"ratio_explosion"}
    assert health.diagnose_step(healthy(2, mean_ratio=1.5), [], thresholds=health.Thresholds(ratio_warn_high=1.6)) \
        == []


def test_reward_collapse_in_step_metrics():
    history = [healthy(s, mean_reward=0.6) for s in range(1, 5)]
    f = health.diagnose_step(healthy(5, mean_reward=0.25), history)
    assert [(x.rule, x.severity) for x in f] == [("reward_collapse", "critical")]
    f = health.diagnose_step(healthy(5, std_reward=0.0), history)
    assert "every sample scores the same" in f[0].explanation


def test_one_reward_term_traded_away_is_critical():
    # The per-epoch train rewards of a real run at learning_rate 1e-3: cam_score went to 0 while fidelity rose.
    cam = [0.1092, 0.0273, 0.1169, 0.0264, 0.0026]
    fid = [0.1922, 0.0239, 0.1247, 0.1017, 0.0828]
    steps = [healthy(e + 1, reward_cam_score=c, reward_fidelity=f)
             for e, (c, f) in enumerate(zip(cam, fid, strict=True))]
    f = health.diagnose_step(steps[4], steps[:2] + steps[3:4])
    term = next(x for x in f if x.rule == "reward_term_collapse")
    assert term.severity == "critical" and term.numbers["term"] == "reward_cam_score"
    assert term.numbers["best_reward_cam_score"] == 0.1092 and "reward.weights.cam_score" in " ".join(term.actions)
    # a term that merely fluctuates (the default run's cam_score: 0.175 best, 0.1095 worst) is fine
    ok = [healthy(e + 1, reward_cam_score=c) for e, c in enumerate([0.109, 0.175, 0.1443, 0.1095])]
    assert "reward_term_collapse" not in rules(health.diagnose_step(ok[-1], ok[:-1]))
    # a zero-centred term (ever negative) has no relative drop
    z = [healthy(e + 1, reward_discriminator=v) for e, v in enumerate([0.3, -0.1, 0.01])]
    assert "reward_term_collapse" not in rules(health.diagnose_step(z[-1], z[:-1]))
    # bookkeeping keys are not reward terms
    b = [healthy(e + 1, reward_seconds=v, reward_std_mean=v) for e, v in enumerate([1.0, 0.1])]
    assert health.diagnose_step(b[-1], b[:-1]) == []


def test_a_mean_reward_reweighted_by_a_constraint_is_not_compared_across_weights():
    """tiny_cpu+flow_grpo_fast seed 2 in the bench: fidelity's Lagrange multiplier fell from 1.5 to about 0.09, so
    reward_avg went 0.142 -> 0.059 while cam_score (0.056 -> 0.039) and fidelity (0.236 -> 0.256) held; the guard
    called it a collapse and rolled back. Recomputed by hand: (0.0393 + 0.091 x 0.2557) / 1.091 = 0.0573."""
    assert (0.0393 + 0.091 * 0.2557) / 1.091 == pytest.approx(0.0573, abs=1e-4)
    before = healthy(3, mean_reward=None, reward_avg=0.1419, reward_cam_score=0.0564, reward_fidelity=0.2360,
                     constraint_weight=1.5)
    after = healthy(4, mean_reward=None, reward_avg=0.0589, reward_cam_score=0.0393, reward_fidelity=0.2557,
                    constraint_weight=0.091)
    assert "reward_collapse" not in rules(health.diagnose_step(after, [before]))
    # the same drop under the same weights is a collapse
    same = {**after, "constraint_weight": 1.5}
    assert "reward_collapse" in rules(health.diagnose_step(same, [before]))


def test_a_term_near_its_floor_losing_most_of_itself_by_chance_is_not_a_collapse():
    """The smoke run's first two epochs after cam_score judged still targets by parallax: cam_score 0.0269 then
    0.0003 over 8 samples each, a 99% drop well inside the two means' noise; the guard rolled it back."""
    import numpy as np

    first = [0.2, 0.0, 0.0, 0.015, 0.0, 0.0, 0.0, 0.0]
    second = [0.0024, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    records = [{"rewards/cam_score": v, "rewards/avg": v, "excluded": [False] * 8} for v in (first, second)]
    sems = [health.term_standard_errors(r) for r in records]
    for sem, values in zip(sems, (first, second), strict=True):  # against numpy's sample std / sqrt(n)
        assert sem["reward_cam_score"] == pytest.approx(np.std(values, ddof=1) / math.sqrt(8))
        assert set(sem) == {"reward_cam_score"}
    steps = [healthy(e + 1, reward_cam_score=float(np.mean(v)), term_sem=sem)
             for e, (v, sem) in enumerate(zip((first, second), sems, strict=True))]
    assert "reward_term_collapse" not in rules(health.diagnose_step(steps[1], steps[:1]))
    # without the standard errors (a log that predates them) the relative rule alone judges, as before
    bare = [{k: v for k, v in st.items() if k != "term_sem"} for st in steps]
    assert "reward_term_collapse" in rules(health.diagnose_step(bare[1], bare[:1]))
    # a drop far beyond its noise is still a collapse
    tight = [healthy(e + 1, reward_cam_score=c, term_sem={"reward_cam_score": 0.002}) for e, c in
             enumerate([0.12, 0.02])]
    assert "reward_term_collapse" in rules(health.diagnose_step(tight[1], tight[:1]))
    # excluded samples and failed (NaN) rewards are left out of the standard error
    r = {"rewards/cam_score": [0.1, 0.3, float("nan"), 5.0], "excluded": [False, False, False, True]}
    expected = np.std([0.1, 0.3], ddof=1) / math.sqrt(2)
    assert health.term_standard_errors(r)["reward_cam_score"] == pytest.approx(expected)


def _epoch(e, step, reward, zero_std=0.0625, rewards=None):
    return {"type": "epoch", "epoch": e, "step": step, "reward_avg": reward, "zero_std_ratio": zero_std,
            "first_step_ratio_deviation": 1e-5,
            "rewards/avg": rewards if rewards is not None else [[reward + 0.1 * (i % 3)] * 2 for i in range(8)]}


def test_diagnose_run_merges_epoch_signal_and_reports_each_rule_once():
    records = []
    for e in range(3):
        for s in range(2):
            step = e * 2 + s + 1
            m = healthy(step, mean_advantage=0.0, epoch=e)
            del m["zero_std_ratio"]  # as the trainer logs steps: the ratio lives in the epoch record
            records.append({"type": "step", **m})
        records.append(_epoch(e, e * 2, 0.5, zero_std=1.0 if e == 2 else 0.0625))
    findings = diagnosis.diagnose_run(records, run_dir="runs/x")
    signal = [f for f in findings if f.rule == "no_advantage_signal"]
    assert len(signal) == 1 and signal[0].severity == "critical"
    assert signal[0].numbers["first_step"] == 5 and signal[0].numbers["epochs"] == [2]
    assert "runs/x/checkpoints" not in diagnosis.format_findings(signal)  # no rollback advice for a dead signal


def test_diagnose_run_reward_drop_over_epochs():
    records = [_epoch(0, 0, 0.5), _epoch(1, 2, 0.6), _epoch(2, 4, 0.2)]
    findings = diagnosis.diagnose_run(records, run_dir="runs/x")
    f = next(f for f in findings if f.rule == "reward_collapse")
    assert f.severity == "critical" and f.numbers["best_mean_reward"] == 0.6 and f.numbers["epochs"] == [2]
    assert "runs/x/checkpoints/latest" in " ".join(f.actions)
    flat = [_epoch(0, 0, 0.5), _epoch(1, 2, 0.5, rewards=[[0.5, 0.5]] * 8)]
    assert rules(diagnosis.diagnose_run(flat), "critical") == {"reward_collapse"}


def test_diagnose_script_exit_codes_and_torn_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    # one epoch in progress: step records of several epochs and no epoch record at all are a gutted log
    lines = [json.dumps({"type": "step", "step": s, **healthy(s, epoch=0)}) for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert diagnose_script.main([str(run)]) == 0
    assert "HEALTHY" in capsys.readouterr().out

    lines.append(json.dumps({"type": "step", "step": 6, "epoch": 1, **BLOWN_UP}))
    lines.append('{"type": "step", "step": 7, "loss": 1.2e')
    (run / "metrics.jsonl").write_text("\n".join(lines))
    assert diagnose_script.main([str(run)]) == 2
    out = capsys.readouterr().out
    assert "could not read line 7" in out and "ratio_explosion" in out and f"{run}/checkpoints" in out

    single = tmp_path / "m.json"
    single.write_text(json.dumps([BLOWN_UP]))
    assert diagnose_script.main([str(single), "--json"]) == 2
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["healthy"] is False and parsed["worst"] == "critical"

    assert diagnose_script.main([str(tmp_path / "missing.jsonl")]) == 1


def _collapsing_run(run):
    """A run whose epoch records show a reward collapse at epoch 2 (its steps look healthy): the bytes of its
    metrics.jsonl."""
    lines = []
    for e, reward in enumerate((0.5, 0.6, 0.2)):
        lines += [json.dumps({"type": "step", **healthy(2 * e + s + 1, epoch=e)}) for s in range(2)]
        lines.append(json.dumps(_epoch(e, 2 * e, reward)))
    return ("\n".join(lines) + "\n").encode()


def test_binary_noise_in_the_log_never_hides_what_its_records_show(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    clean = _collapsing_run(run)
    (run / "metrics.jsonl").write_bytes(clean)
    assert diagnose_script.main([str(run)]) == 2
    assert "reward_collapse" in capsys.readouterr().out
    # noise written just before records (no newline of its own): every epoch record is glued onto binary noise,
    # with bytes that str.splitlines() also breaks at (\r, \x0b, \x1c, \x85)
    noise = [b"\x00\xff\xfe\x1c\xc2\x85garbage\x0b\r", b"\x9c\x01\x1e{\"type\": \"ep", b"\xc3(\xa0\xa1]"]
    lines, glued = clean.split(b"\n"), iter(noise)
    noisy = b"\n".join(next(glued) + line if b'"type": "epoch"' in line else line for line in lines)
    (run / "metrics.jsonl").write_bytes(noisy + b"\xf0\x9f\n\x00\x00\n")  # and two lines of noise at the end
    assert diagnose_script.main([str(run)]) == 2
    out = capsys.readouterr().out
    assert "verdict: CRITICAL" in out and "reward_collapse" in out
    assert "6 step records, 3 epoch records" in out
    assert out.count("recovered the record after") == 3 and "could not read line 10" in out

    # a record lost beyond recovery: nothing critical in what is left, but the verdict is not HEALTHY either
    lines = clean.split(b"\n")
    lines[8] = lines[8][:40] + b"\xff\xfe" + lines[8][60:]  # the collapsed epoch's record, its middle garbled
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert diagnose_script.main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "verdict: INCOMPLETE" in out and "HEALTHY" not in out and "an epoch record (epoch 2)" in out


def test_the_run_s_reports_are_written_in_process_and_say_what_the_tools_said(tmp_path):
    from recam.infra import reports

    code, out = reports.run_script("diagnose", [str(tmp_path / "missing")])
    assert code == 1 and "cannot read" in out
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(_collapsing_run(run))
    paths = reports.write_reports(run)
    assert paths["diagnosis"] == f"{run / 'diagnosis.md'} (NOT healthy)"
    assert "reward_collapse" in (run / "diagnosis.md").read_text()
    assert (run / "grpo_verification.md").exists() and paths["verification"].startswith(str(run))


def test_capture_logs_sends_info_to_run_log_and_close_gives_the_console_back(tmp_path):
    import logging

    from config import grpo
    from recam.infra.runlog import RunLog

    console = logging.StreamHandler()
    logging.getLogger().addHandler(console)
    try:
        config = grpo.get_config("smoke")
        config.logging.wandb_mode = "disabled"
        log = RunLog(tmp_path, config)
        assert log.capture_logs() == tmp_path / "run.log" and console.level == logging.WARNING
        logging.getLogger("recam.test").info("a per-batch detail")
        log.detail("a setup line")
        log.close()
        assert console.level == logging.NOTSET
        text = (tmp_path / "run.log").read_text()
        assert "recam.test: a per-batch detail" in text and "recam.run: a setup line" in text
    finally:
        logging.getLogger().removeHandler(console)


# ----------------------------------------------------------------------------------------------------------
# excluded samples (failed rewards): statistics ignore them, the count is reported, nothing false alarms


def _flaky_epoch(e, step, failed=(), all_excluded=False):
    """An epoch record as the trainer writes it when the judge failed on the samples at `failed` (NaN rewards,
    excluded); with all_excluded, drop_group excluded every group and no optimizer step was taken."""
    avg = [0.3 + 0.05 * (i % 4) for i in range(8)]
    judge = [0.5 + 0.1 * (i % 3) for i in range(8)]
    for i in failed:
        avg[i] = judge[i] = math.nan
    excluded = [all_excluded or i in failed for i in range(8)]
    finite = [x for x in avg if x == x]
    rec = {"type": "epoch", "epoch": e, "step": step, "dataset_indices": [i // 4 for i in range(8)],
           "rewards/avg": [[x] * 2 for x in avg], "rewards/unifiedscore": judge,
           "reward_avg": sum(finite) / len(finite) if finite else math.nan,
           "reward_unifiedscore": (sum(x for x in judge if x == x) / len(finite)) if finite else math.nan,
           "zero_std_ratio": math.nan if all_excluded else 0.0, "reward_std_mean": math.nan if all_excluded else 0.05,
           "group_size": 0.0 if all_excluded else (8 - len(failed)) / 2,
           "trained_prompt_num": 0.0 if all_excluded else 2.0,
           "first_step_ratio_deviation": None if all_excluded else 1e-5, "excluded": excluded,
           "excluded_samples": sum(excluded), "failed_samples": len(failed),
           "excluded_groups": 2 if all_excluded else 0, "affected_groups": len({i // 4 for i in failed})}
    advantages = [0.0] * 8  # group-normalised over the kept samples; an excluded one's is 0
    for g in range(2):
        kept = [i for i in range(4 * g, 4 * g + 4) if not excluded[i]]
        if kept:
            mean = sum(avg[i] for i in kept) / len(kept)
            std = (sum((avg[i] - mean) ** 2 for i in kept) / len(kept)) ** 0.5
            advantages[kept[0]:kept[-1] + 1] = [(avg[i] - mean) / (std + 1e-4) if i in kept else 0.0
                                                for i in range(kept[0], kept[-1] + 1)]
    rec["advantages"] = [[a, a] for a in advantages]
    return rec


def test_reward_std_ignores_failed_rewards_and_reports_the_excluded_count():
    rec = _flaky_epoch(0, 0, failed=(1, 6))
    m = diagnosis.epoch_metrics(rec)  # statistics.pstdev over a NaN used to raise AttributeError ('numerator')
    finite = [0.3 + 0.05 * (i % 4) for i in range(8) if i not in (1, 6)]
    mean = sum(finite) / len(finite)
    assert m["std_reward"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite)))
    assert (m["excluded_samples"], m["samples"], m["failed_samples"]) == (2, 8, 2)
    findings = diagnosis.diagnose_epoch(rec)
    assert diagnosis.is_healthy(findings) and rules(findings) == {"excluded_samples"}
    f = findings[0]
    assert f.severity == "info" and f.numbers["excluded_samples"] == 2 and "2 of 8 samples" in f.explanation


def test_epoch_that_kept_nothing_is_a_warning_not_a_nan_blowup():
    rec = _flaky_epoch(1, 2, failed=(0, 5), all_excluded=True)
    findings = diagnosis.diagnose_epoch(rec, [_flaky_epoch(0, 0)])
    assert diagnosis.is_healthy(findings)
    assert [(f.rule, f.severity) for f in findings] == [("excluded_samples", "warn")]
    # every sample's reward failed: the means are over nothing, missing rather than a numerical blow-up
    dead = _flaky_epoch(1, 2, failed=tuple(range(8)), all_excluded=True)
    assert [(f.rule, f.severity) for f in diagnosis.diagnose_epoch(dead)] == [("excluded_samples", "warn")]


def test_nan_that_exclusions_do_not_explain_is_still_critical():
    rec = _flaky_epoch(0, 0, failed=(1,))
    rec["zero_std_ratio"] = math.nan  # groups were kept, so this NaN is a bug, not a missing value
    assert rules(diagnosis.diagnose_epoch(rec), "critical") == {"non_finite"}
    rec = _flaky_epoch(0, 0)
    rec["reward_unifiedscore"] = math.nan  # every sample has a finite score, yet the mean is NaN
    assert rules(diagnosis.diagnose_epoch(rec), "critical") == {"non_finite"}


def test_diagnose_script_on_a_run_with_excluded_samples_is_healthy(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = []
    for e in range(3):
        n_steps = 0 if e == 1 else 2
        for _ in range(n_steps):
            step = len([r for r in records if r["type"] == "step"]) + 1
            m = healthy(step, epoch=e)
            del m["zero_std_ratio"], m["mean_reward"], m["std_reward"]
            records.append({"type": "step", **m})
        step0 = len([r for r in records if r["type"] == "step"]) - n_steps
        records.append(_flaky_epoch(e, step0, failed=(2,) if e != 1 else (0, 4), all_excluded=e == 1))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert diagnose_script.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "HEALTHY" in out and "excluded samples: 10 of 24 in 3 epoch(s)" in out
    assert "diagnosis_error" not in out and "excluded_samples" in out
    assert diagnose_script.main([str(run), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["healthy"] is True and parsed["excluded_samples"] == 10 and parsed["samples"] == 24


# ----------------------------------------------------------------------------------------------------------
# the learned critic: its discriminator/* fields in the epoch records, judged in diagnosis.md


def _critic_run(run, critic_by_epoch):
    """A healthy run whose epoch records carry the critic's metrics (discriminator/*, as its hook writes them)."""
    lines = []
    for e, critic in enumerate(critic_by_epoch):
        lines += [json.dumps({"type": "step", **healthy(2 * e + s + 1, epoch=e)}) for s in range(2)]
        lines.append(json.dumps({**_epoch(e, 2 * e, 0.5), **{f"discriminator/{k}": v for k, v in critic.items()}}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


HAIR = {"d_acc": 1.0, "score_diff": 0.0025, "ranking_loss": 0.691, "temperature": 1.0, "step": 60.0,
        "warmup_steps": 50.0}
PLAN_SATURATED = {"d_acc": 0.88, "score_diff": 9.81, "temperature": 2.0, "step": 64.0, "warmup_steps": 50.0,
                  "adaptive_temperature": 0.0, "temperature_at_bound": 0.0, "normalize_scores": 0.0}


def test_the_critic_s_findings_come_from_accuracy_margin_and_ranking_loss():
    saturated = health.critic_findings(PLAN_SATURATED)
    assert [(f.rule, f.severity) for f in saturated] == [("critic_saturated", "warn")]
    f = saturated[0]
    assert f.numbers["margin"] == pytest.approx(9.81 / 2.0)
    assert f.numbers["pair_gradient_share"] == pytest.approx(2 / (1 + math.exp(9.81 / 2.0)), rel=1e-9)
    assert "reward.discriminator.temperature` to about 9.81" in f.actions[0]
    # every pair won by a hair: the chord bound puts the mean pair gradient at >= 0.691 / log 2 of its largest
    hair = health.critic_findings(HAIR)
    assert [(h.rule, h.severity) for h in hair] == [("critic_separates", "info")]
    assert hair[0].numbers["margin"] == pytest.approx(0.0025)
    no_t = health.critic_findings({k: v for k, v in HAIR.items() if k != "temperature"})
    assert [(h.rule, h.severity) for h in no_t] == [("critic_separates", "info")]
    assert no_t[0].numbers["pair_gradient_share"] == pytest.approx(0.691 / math.log(2), rel=1e-9)
    assert health.gradient_share_at_least(0.691, 0.99) is None  # a lost pair breaks the chord bound


def test_diagnosis_md_names_the_saturated_critic_and_not_the_narrow_one(tmp_path):
    from recam.infra import reports

    run = tmp_path / "run"
    run.mkdir()
    _critic_run(run, [HAIR, PLAN_SATURATED])
    findings = {f.rule: f for f in diagnosis.diagnose_run([json.loads(x) for x in
                                                          (run / "metrics.jsonl").read_text().splitlines()])}
    assert findings["critic_saturated"].numbers["epochs"] == [1]
    assert findings["critic_separates"].numbers["epochs"] == [0] and findings["critic_separates"].severity == "info"
    assert "The run's guard does not judge this" in findings["critic_saturated"].explanation
    reports.write_reports(run)
    text = (run / "diagnosis.md").read_text()
    assert "`critic_saturated`" in text and "4.91 temperatures" in text and "`critic_separates`" in text
    assert "reward.discriminator.temperature" in text


def test_ratio_advice_reads_whatever_the_step_logged():
    # only the reference's log-prob, no loss, no learning rate: the advice still names the sum it measures
    why, actions, nums = health.ratio_explosion_advice({"ratio_max": 1e5, "mean_log_prob_ref": -5e4}, health.DEFAULT)
    assert "mean_log_prob_ref -5e+04 is no per-element log-density" in why
    assert nums["log_prob_gap"] is None and "kl_tier" not in nums and "loss_over_ratio" not in nums
    assert any(a.startswith("learning-rate tier 3 of 3") and "->" not in a for a in actions)
    why, actions, nums = health.ratio_explosion_advice({}, health.DEFAULT)
    assert nums == {"worst_log_ratio": None, "log_prob_gap": None} and "(4) the learning rate" in why
