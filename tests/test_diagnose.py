"""scripts/diagnose.py and recam.engine.diagnosis against the run's own guard: no record is never "healthy", a
record the schema rejects is skipped and said so, and the diagnosis judges rewards as the guard does."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from recam.engine import diagnosis, health

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("diagnose_cli", ROOT / "scripts" / "diagnose.py")
diagnose_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(diagnose_script)


def step_metrics(step):
    """One optimizer step's metrics as the trainer's guard sees them (recam.engine.records.step_metrics: no step, no
    epoch, no reward; the epoch's reward signal is merged in by the trainer)."""
    return {"loss": 0.01 * (-1) ** step, "policy_loss": 0.0096 * (-1) ** step, "kl_penalty": 1e-4,
            "mean_ratio": 1.0003, "ratio_min": 0.998, "ratio_max": 1.004, "clipfrac": 0.04, "approx_kl": 2e-6,
            "mean_log_prob_current": 1.31, "mean_log_prob_old": 1.31, "mean_log_prob_ref": 1.30,
            "mean_advantage": 3e-9, "grad_norm": 0.4, "step_samples": 8, "learning_rate": 1e-4}


FIDELITY = [0.30, 0.35, 0.40, 0.45, 0.32, 0.37, 0.42, 0.47]


def epoch_record(e, step, cam, *, steps=2, constraint_weight=None, fidelity=FIDELITY):
    """An epoch record as recam.engine.records.epoch_record builds it, rewards per sample: cam_score `cam`, fidelity,
    and their average; `steps` optimizer steps taken."""
    avg = [(c + f) / 2 for c, f in zip(cam, fidelity, strict=True)]
    rec = {"type": "epoch", "epoch": e, "step": step, "rewards/avg": [[a, a] for a in avg],
           "rewards/cam_score": list(cam), "rewards/fidelity": list(fidelity),
           "reward_avg": sum(avg) / len(avg), "reward_cam_score": sum(cam) / len(cam),
           "reward_fidelity": sum(fidelity) / len(fidelity), "zero_std_ratio": 0.0, "reward_std_mean": 0.05,
           "first_step_ratio_deviation": 1e-5, "excluded": [False] * len(cam), "advantages": [[0.0, 0.0]] * len(cam),
           "optimizer_steps": [{} for _ in range(steps)]}
    if constraint_weight is not None:
        rec["constraint_weight"] = constraint_weight
    return rec


def run_records(epochs):
    """metrics.jsonl's records of a run with these epoch records: each epoch's steps, then its record."""
    records, step = [], 0
    for rec in epochs:
        assert rec["step"] == step
        for _ in rec["optimizer_steps"]:
            step += 1
            records.append({"type": "step", "step": step, "epoch": rec["epoch"], **step_metrics(step)})
        records.append(rec)
    return records


def guard(epochs):
    """What the trainer's guard finds over these epochs, fed as Trainer.optimizer_step feeds it: each step's metrics
    with its epoch's health.reward_signal merged in, against the history of the steps before. {(rule, severity)}."""
    history, fired, step = [], set(), 0
    for rec in epochs:
        signal = health.reward_signal(rec)
        for _ in rec["optimizer_steps"]:
            step += 1
            m = {**step_metrics(step), **signal}
            fired |= {(f.rule, f.severity) for f in health.diagnose_step(m, history)}
            history.append(m)
    return fired


def offline(epochs):
    return {(f.rule, f.severity) for f in diagnosis.diagnose_run(run_records(epochs))}


def write(run, records, tail=""):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


# ----------------------------------------------------------------------------------------------------------
# no record is never healthy


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_log_is_incomplete_never_healthy(tmp_path, capsys, text):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    assert diagnose_script.main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "verdict: INCOMPLETE (no step or epoch record to diagnose)" in out
    assert "HEALTHY" not in out and "look healthy" not in out
    assert diagnose_script.main([str(run), "--json"]) == 1
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["verdict"] == "INCOMPLETE" and parsed["healthy"] is False


def test_a_log_of_only_other_records_is_incomplete(tmp_path, capsys):
    run = tmp_path / "run"
    write(run, [{"type": "eval", "tag": "start", "step": 0, "epoch": -1, "eval/reward_avg": 0.3}])
    assert diagnose_script.main([str(run)]) == 1
    assert "verdict: INCOMPLETE" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# records the schema rejects are skipped, counted and said


def test_a_noise_step_record_is_not_a_step(tmp_path, capsys):
    run = tmp_path / "run"
    write(run, [{"type": "step"}])
    assert diagnose_script.main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "0 step records, 0 epoch records" in out
    assert "skipped 1 step record(s) without an integer step or an integer epoch" in out
    assert "verdict: INCOMPLETE" in out and "HEALTHY" not in out

    # amid a healthy run: it is not counted, the report says so, and the run is not called healthy
    records = run_records([epoch_record(0, 0, FIDELITY), epoch_record(1, 2, FIDELITY)])
    write(run, records[:3] + [{"type": "step"}] * 3 + records[3:])
    assert diagnose_script.main([str(run)]) == 1
    out = capsys.readouterr().out
    assert "4 step records, 2 epoch records" in out
    assert "skipped 3 step record(s) without an integer step or an integer epoch" in out
    assert "verdict: INCOMPLETE" in out and "3 record(s) failed the schema" in out
    write(run, records)
    assert diagnose_script.main([str(run)]) == 0
    assert "verdict: HEALTHY" in capsys.readouterr().out


def test_records_failing_the_schema_are_left_out_of_the_rules_one_line_per_kind(tmp_path, capsys):
    epochs = [epoch_record(0, 0, FIDELITY), epoch_record(1, 2, FIDELITY)]
    # each of these, counted, would be critical: a loss blow-up, a NaN, a collapsed reward
    bad = [{"type": "step", "loss": 1e9}, {"type": "step", "step": "7", "epoch": 1, "loss": math.nan},
           {"type": "step", "step": 8, "epoch": 1},
           {**epoch_record(2, 4, [0.0] * 8), "epoch": True},
           {k: v for k, v in epoch_record(3, 4, [0.0] * 8).items() if k != "reward_avg"},
           {"note": "no number here"}]
    kept, skipped = diagnosis.screen_records(run_records(epochs) + bad)
    assert len(kept) == 6 and skipped == {
        "step record(s) without an integer step or an integer epoch": 1,
        "step record(s) without an integer step": 1,
        "step record(s) without a single metric": 1,
        "epoch record(s) without an integer epoch": 1,
        "epoch record(s) without a number reward_avg": 1,
        "metric dict(s) without a single number": 1}
    assert diagnosis.is_healthy(diagnosis.diagnose_run(run_records(epochs) + bad))

    run = tmp_path / "run"
    write(run, run_records(epochs) + bad + [{"type": "stpe", "step": 9, "epoch": 1, "loss": 0.1}])
    assert diagnose_script.main([str(run)]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    for kind, n in skipped.items():
        assert sum(line.startswith(f"skipped {n} {kind} (") for line in lines) == 1
    assert "look healthy" not in out and "No findings in the records diagnosed" in out
    assert "ignored 1 record(s) of unknown type 'stpe'" in out
    assert "verdict: INCOMPLETE" in out and "6 record(s) failed the schema" in out
    assert diagnose_script.main([str(run), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["skipped_records"] == skipped


# ----------------------------------------------------------------------------------------------------------
# the diagnosis and the guard judge the same records alike


# The smoke run's cam_score near its floor: 0.0269 then 0.0003 over 8 samples, a 99% drop inside the two means'
# standard errors (3 x 0.025).
NEAR_FLOOR = [0.2, 0.0, 0.0, 0.015, 0.0, 0.0, 0.0, 0.0], [0.0024, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
# 0.12 -> 0.02 with a spread of 0.005: an 83% drop, about 40 standard errors
FAR = [0.12 + 0.005 * (i % 3 - 1) for i in range(8)], [0.02 + 0.005 * (i % 3 - 1) for i in range(8)]


def test_a_large_relative_drop_within_the_noise_is_no_collapse_for_either(tmp_path, capsys):
    before, after = NEAR_FLOOR
    epochs = [epoch_record(0, 0, before), epoch_record(1, 2, after)]
    assert (epochs[1]["reward_cam_score"] - epochs[0]["reward_cam_score"]) / epochs[0]["reward_cam_score"] < -0.75
    sem = [health.term_standard_errors(r)["reward_cam_score"] for r in epochs]
    assert 0.0269 - 0.0003 < 3 * math.hypot(*sem)
    assert "reward_term_collapse" not in {rule for rule, _ in guard(epochs)}
    assert "reward_term_collapse" not in {rule for rule, _ in offline(epochs)}
    assert guard(epochs) == set() and offline(epochs) == set()
    run = tmp_path / "run"
    write(run, run_records(epochs))
    assert diagnose_script.main([str(run)]) == 0
    assert "verdict: HEALTHY" in capsys.readouterr().out


def test_a_drop_beyond_the_noise_is_a_collapse_for_both():
    before, after = FAR
    epochs = [epoch_record(0, 0, before), epoch_record(1, 2, after)]
    assert ("reward_term_collapse", "critical") in guard(epochs)
    found = {f.rule: f for f in diagnosis.diagnose_run(run_records(epochs))}
    f = found["reward_term_collapse"]
    assert f.severity == "critical" and f.numbers["term"] == "reward_cam_score" and f.numbers["epochs"] == [1]
    assert "does not judge" not in f.explanation
    assert {r for r, s in guard(epochs) if s == "critical"} == {r for r, s in offline(epochs) if s == "critical"}


def weighted(rec, weight):
    """The record with reward_avg = (cam_score + weight x fidelity) / (1 + weight), as reward.constraint weighs it."""
    avg = [(c + weight * f) / (1 + weight) for c, f in zip(rec["rewards/cam_score"], rec["rewards/fidelity"],
                                                             strict=True)]
    return {**rec, "rewards/avg": [[a, a] for a in avg], "reward_avg": sum(avg) / len(avg),
            "constraint_weight": weight}


def test_a_mean_reward_under_a_moving_constraint_weight_is_judged_as_the_guard_does():
    """reward_avg's weights moved (a Lagrange multiplier) while every term held: the guard does not compare the two
    means, and neither does the diagnosis; under the same weights the same drop is a collapse for both."""
    high, low = weighted(epoch_record(0, 0, FAR[1]), 1.5), weighted(epoch_record(1, 2, FAR[1]), 0.09)
    assert low["reward_avg"] < 0.5 * high["reward_avg"]
    assert guard([high, low]) == set() and offline([high, low]) == set()
    same = {**low, "constraint_weight": 1.5}
    assert ("reward_collapse", "critical") in guard([high, same])
    assert ("reward_collapse", "critical") in offline([high, same])


def test_an_epoch_without_an_optimizer_step_is_no_best_the_guard_never_saw():
    """Every sample of epoch 1 was excluded (drop_group), so no step judged it and its rewards never entered the
    guard's history: epoch 2 is compared with epoch 0 only."""
    scaled = [[2.5 * x for x in FIDELITY], FIDELITY, [0.8 * x for x in FIDELITY]]
    epochs = [epoch_record(0, 0, FAR[0], fidelity=scaled[1]), epoch_record(1, 2, FAR[0], steps=0, fidelity=scaled[0]),
              epoch_record(2, 2, FAR[0], fidelity=scaled[2])]
    assert (epochs[1]["reward_fidelity"] - epochs[2]["reward_fidelity"]) / epochs[1]["reward_fidelity"] > 0.6
    assert guard(epochs) == set() and offline(epochs) == set()


def test_what_the_guard_cannot_judge_says_why():
    epochs = [epoch_record(0, 0, FAR[0]), epoch_record(1, 2, FAR[0])]
    epochs[1]["first_step_ratio_deviation"] = 0.7
    found = {f.rule: f for f in diagnosis.diagnose_run(run_records(epochs))}
    f = found["off_policy_first_step"]
    assert f.severity == "critical" and "The run's guard does not judge this: the first step's ratio" in f.explanation
    assert ("off_policy_first_step", "critical") not in guard(epochs)
    # every sample scoring the same: the guard stops on the dead advantages instead
    flat = {**epoch_record(1, 2, [0.1] * 8, fidelity=[0.3] * 8), "zero_std_ratio": 1.0}
    found = {f.rule: f for f in diagnosis.diagnose_run(run_records([epochs[0], flat]))}
    assert "the guard is not given the rewards' spread" in found["reward_collapse"].explanation
    assert "does not judge" not in found["no_advantage_signal"].explanation
    assert ("no_advantage_signal", "critical") in guard([epochs[0], flat])


def test_the_guard_s_rollbacks_are_named_where_its_history_restarted(tmp_path, capsys):
    run = tmp_path / "run"
    write(run, run_records([epoch_record(0, 0, FAR[0]), epoch_record(1, 2, FAR[0])]))
    assert diagnose_script.main([str(run)]) == 0
    assert "rolled back" not in capsys.readouterr().out
    archived = [{"epoch": 1, "rolled_back": "rollback 1: kl_growth"},  # an earlier run's, archived by a fresh start
                {"epoch": 1, "rolled_back": "a fresh start: no checkpoint to resume from"},
                {"epoch": 2, "rolled_back": "rollback 1: reward_term_collapse"},
                {"epoch": 3, "rolled_back": "rollback 1: reward_term_collapse"},
                {"epoch": 2, "rolled_back": "rollback 2: reward_collapse"}]
    (run / "rolled_back.jsonl").write_text("".join(json.dumps(r) + "\n" for r in archived))
    assert diagnose_script.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "the run's guard rolled back 2 time(s)" in out and "verdict: HEALTHY" in out


# ----------------------------------------------------------------------------------------------------------
# damaged logs: what the diagnosis reads is checked first, and damage is never HEALTHY


def full_run():
    """Two epochs of run_records with the per-sample fields the trainer writes beside the rewards."""
    records = run_records([epoch_record(0, 0, FIDELITY), epoch_record(1, 2, FIDELITY)])
    for r in records:
        if r["type"] == "epoch":
            r["dataset_indices"] = [i // 2 for i in range(8)]
            r["advantages"] = [[(-1) ** (i + 1)] * 2 for i in range(8)]  # each pair's second reward is higher
    return records


def _epochs(records, change):
    for r in records:
        if r["type"] == "epoch":
            change(r)
    return records


def _all_rewards_inf(r):
    for k in list(r):
        if k.startswith("rewards/"):
            r[k] = [[math.inf] * len(v) if isinstance(v, list) else math.inf for v in r[k]]
        elif k.startswith("reward_") and k != "reward_std_mean":
            r[k] = math.inf


DAMAGE = {
    "every reward +inf": (lambda rs: _epochs(rs, _all_rewards_inf), 2, "non_finite_samples"),
    "per-sample +inf under finite means": (
        lambda rs: _epochs(rs, lambda r: r.update({"rewards/cam_score": [math.inf] * 8})), 2, "non_finite_samples"),
    "NaN advantages": (lambda rs: _epochs(rs, lambda r: r.update({"advantages": [[math.nan] * 2] * 8})), 2,
                       "non_finite_samples"),
    "every record twice": (lambda rs: [x for r in rs for x in (r, dict(r))], 1,
                           "skipped 4 step record(s) repeating an earlier record's step number"),
    "advantages a string, dataset_indices null": (
        lambda rs: _epochs(rs, lambda r: r.update({"advantages": str(r["advantages"]), "dataset_indices": None})),
        1, "skipped 2 epoch record(s) with advantages not a list of numbers (or of lists of numbers) and "
           "dataset_indices not a list of integers"),
    "a step metric as a string": (lambda rs: [{**r, "loss": "0.01"} if r["type"] == "step" else r for r in rs], 1,
                                  "skipped 4 step record(s) with loss not a number"),
    "no step records": (lambda rs: [r for r in rs if r["type"] != "step"], 1,
                        "no step record at all for 2 epoch(s), while their records store 4 optimizer step(s)"),
    "one epoch's step records lost": (lambda rs: [r for r in rs if r["type"] != "step" or r["epoch"] != 1], 1,
                                      "epoch 1 stores 2 optimizer step(s) but 0 step record(s) carry its number"),
    # each of these was HEALTHY
    "a negative step number": (lambda rs: [{**r, "step": -1} if r["type"] == "step" and r["step"] == 1 else r
                                           for r in rs], 1, "skipped 1 step record(s) with a negative step"),
    "advantages cut short": (lambda rs: _epochs(rs, lambda r: r.update({"advantages": r["advantages"][:5]})), 1,
                             "with per-sample fields of different lengths (rewards/avg 8, rewards/cam_score 8, "
                             "rewards/fidelity 8, excluded 8, advantages 5, dataset_indices 8)"),
    "every epoch record removed": (lambda rs: [r for r in rs if r["type"] != "epoch"], 1,
                                   "step records of 2 epochs (0..1) but no epoch record at all"),
    "a step numbered 10**18": (lambda rs: [{**r, "step": 10**18} if r["type"] == "step" and r["step"] == 4 else r
                                           for r in rs], 1,
                               "epoch 1's step records are numbered 3, 1000000000000000000 where its record (step 2, "
                               "2 optimizer step(s)) says 3..4"),
    "an epoch record without advantages": (lambda rs: _epochs(rs, lambda r: r.pop("advantages")), 1,
                                           "epoch record(s) 0, 1 without advantages"),
    "advantages with their sign flipped": (
        lambda rs: _epochs(rs, lambda r: r.update({"advantages": [[-a for a in row] for row in r["advantages"]]})),
        2, "`advantage_sign`: 8 of 8 samples have an advantage whose sign is the opposite"),
    "an epoch record of another type": (lambda rs: [{**r, "type": "epoc"} if r["type"] == "epoch" and r["epoch"] == 0
                                                    else r for r in rs], 1,
                                        "step records of epoch(s) 0 but no epoch record of theirs"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_log_is_never_healthy(tmp_path, capsys, damage):
    change, code, said = DAMAGE[damage]
    run = tmp_path / "run"
    write(run, full_run())
    assert diagnose_script.main([str(run)]) == 0  # the same run undamaged
    assert "verdict: HEALTHY" in capsys.readouterr().out
    write(run, change(full_run()))
    assert diagnose_script.main([str(run)]) == code
    out = capsys.readouterr().out
    assert said in out and "HEALTHY" not in out and "look healthy" not in out
    assert f"verdict: {'CRITICAL' if code == 2 else 'INCOMPLETE'}" in out
    assert diagnose_script.main([str(run), "--json"]) == code
    assert json.loads(capsys.readouterr().out)["healthy"] is False


def test_the_steps_of_the_epoch_in_progress_need_no_epoch_record_yet(tmp_path, capsys):
    # the trainer writes an epoch's step records before its epoch record: a running run is not damaged
    records = full_run()
    write(tmp_path / "run", records[:-1])  # epoch 1's steps, its record not yet written
    assert diagnose_script.main([str(tmp_path / "run")]) == 0
    assert "verdict: HEALTHY" in capsys.readouterr().out


def test_a_reward_that_failed_everywhere_is_still_missing_not_infinite():
    # NaN on every sample (excluded) is a failed reward, judged by rule_exclusions; only an infinity is a blow-up
    records = full_run()
    rec = records[-1]
    rec.update({"rewards/cam_score": [math.nan] * 8, "reward_cam_score": math.nan})
    assert "non_finite" not in {f.rule for f in diagnosis.diagnose_run(records)}
    rec.update({"rewards/cam_score": [math.inf] * 8, "reward_cam_score": math.inf})
    assert {"non_finite", "non_finite_samples"} <= {f.rule for f in diagnosis.diagnose_run(records)}
