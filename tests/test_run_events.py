"""recam.infra.reports.run_events and events_table: what the health guard did in a run folder (rollbacks, a guard
stop, findings by severity and rule), read from real smoke runs with an injected blow-up and without one, and from
folders that lack what older or killed runs lack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recam.infra.reports import events_table, run_events
from tests.smoke_runs import SMOKE_SIZE, needs_base, run

# the blow-up is injected once per process, before step 1: epoch 0's second step finds it
BLOWUP = ("--config.debug.inject_blowup_at_step=1",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three one-epoch smoke runs: the blow-up rolled back, the blow-up stopping the run, and no fault."""
    root = tmp_path_factory.mktemp("events")
    run(root / "rollback", *SMOKE_SIZE, *BLOWUP, "--config.health.action=rollback")
    stopped = run(root / "stop", *SMOKE_SIZE, *BLOWUP, "--config.health.action=stop", check=False)
    assert stopped.returncode == 3, stopped.stderr[-2000:]  # the guard's stop
    run(root / "clean", *SMOKE_SIZE, "--config.seed=7")
    return root


@needs_base
def test_a_rollback_a_guard_stop_and_a_clean_run_are_told_apart(runs):
    rolled = run_events(runs / "rollback")
    assert rolled["rollbacks"] == 1 and rolled["guard_stop"] is None
    # the rolled-back step's findings live in rolled_back.jsonl now, and are counted from there
    kept = [json.loads(line) for line in (runs / "rollback" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in kept if r["type"] == "health" and any(f["severity"] == "critical" for f in r["findings"])]
    assert rolled["critical"] >= 1 and rolled["critical_steps"] == 1
    assert next(iter(rolled["rules"])) == "ratio_explosion"  # the step's most severe finding, the guard's reason

    stopped = run_events(runs / "stop")
    assert stopped["rollbacks"] == 0 and stopped["critical_steps"] == 1
    assert stopped["guard_stop"].startswith("health guard, ratio_explosion at step ")
    assert stopped["critical"] == rolled["critical"] and stopped["rules"] == rolled["rules"]

    clean = run_events(runs / "clean")
    assert (clean["rollbacks"], clean["guard_stop"], clean["critical"], clean["critical_steps"]) == (0, None, 0, 0)
    assert clean["warning"] == sum(clean["rules"].values())  # a smoke run may warn; each warning is a rule's


@needs_base
def test_the_events_table_has_a_row_per_run_and_says_the_arms_differ(runs):
    table = events_table([runs / "rollback", runs / "clean"], [runs / "stop"])
    rows = [line for line in table.splitlines() if line.startswith("| GRPO") or line.startswith("| placebo")]
    assert len(rows) == 3
    assert rows[0].split(" | ")[2:5] == ["0", "1", "none"]  # seed 0 (the preset's), one rollback, no stop
    assert rows[1].split(" | ")[2] == "7"  # the seed config.json records
    assert "health guard, ratio_explosion at step" in rows[2] and "ratio_explosion ×1" in rows[2]
    assert "The arms differ" in table and "GRPO 1 rollback(s), 0 guard stop(s)" in table
    assert "placebo 0 rollback(s), 1 guard stop(s)" in table
    same = events_table([runs / "clean"], [runs / "clean"])
    assert "do not differ" in same


def _run_folder(path: Path, records: list[dict] = ()) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_an_old_folder_counts_zeros_and_a_folder_without_its_log_is_named(tmp_path):
    old = _run_folder(tmp_path / "old", [{"type": "step", "step": 1, "epoch": 0, "loss": 0.1}])
    assert run_events(old) == {"rollbacks": 0, "guard_stop": None, "critical": 0, "warning": 0, "info": 0,
                               "critical_steps": 0, "rules": {}}
    assert "| n/a |" in events_table([old], [old])  # no config.json: no seed
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty" / "metrics.jsonl")):
        run_events(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        events_table([old], [tmp_path / "empty"])


def test_severities_rules_and_a_stop_from_run_log_when_there_is_no_summary(tmp_path):
    findings = [{"rule": "clip_saturation", "severity": "warn", "numbers": {}},
                {"rule": "no_advantage_signal", "severity": "info", "numbers": {}}]
    run_dir = _run_folder(tmp_path / "killed", [{"type": "health", "step": 3, "epoch": 1, "findings": findings}])
    log = run_dir / "run.log"
    log.write_text("2026-01-01 00:00:00,000 INFO recam.run: health guard: kl_growth (critical); loss_blowup "
                   "(critical)\n2026-01-01 00:00:00,001 INFO recam.run: stopped; weights restored from the last "
                   "healthy checkpoint x/checkpoints/epoch_0001\n")
    e = run_events(run_dir)
    assert (e["critical"], e["warning"], e["info"], e["critical_steps"]) == (0, 1, 1, 0)
    assert e["rules"] == {"clip_saturation": 1}  # info findings are no rule firing
    assert e["guard_stop"].startswith("health guard, kl_growth (from run.log")
    with log.open("a") as f:  # the same command resumed it and trained on: the stop is no longer the run's end
        f.write("2026-01-01 00:01:00,000 INFO recam.run: resumed from x/checkpoints/epoch_0001 at epoch 1, global "
                "step 2\n")
    assert run_events(run_dir)["guard_stop"] is None
    # summary.md, when there is one, says how the run ended: a stop for a reward server down is not the guard's
    (run_dir / "summary.md").write_text("health guard: stopped early: reward server down at epoch 2: refused; "
                                        "rollbacks: 2\n")
    assert run_events(run_dir)["guard_stop"] is None and run_events(run_dir)["rollbacks"] == 2


def test_the_severities_read_are_the_engine_s():
    from recam.engine.health import SEVERITIES
    from recam.infra.reports import _SEVERITY_NAMES

    assert set(_SEVERITY_NAMES) == set(SEVERITIES)
