"""The time-to-reward bookkeeping on the toy domain: the wall-clock budget stops a run, the evaluation grid fires
where the cumulative training time crosses it, denoiser evaluations are counted as by hand, a resumed run carries
the totals on; and an objective without log-probs or ratios (sampling fully deterministic, an old policy kept and
restored exactly) runs through the same trainer."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import grpo
from recam.engine import records
from recam.engine.budget import time_eval_tag
from recam.engine.containers import EpochResult, StepStats
from recam.engine.diagnosis import diagnose_epoch
from recam.engine.extensions.old_policy import KeepsOldPolicy, decode_tensors, encode_tensors
from recam.engine.health import diagnose_step
from recam.engine.objective import OBJECTIVES, register_objective

ROOT = Path(__file__).resolve().parents[1]
TOY = grpo.get_config("toy")
SAMPLES = TOY.sample.batch_size * TOY.sample.num_batches_per_epoch  # 128 per epoch, one process
STEPS = TOY.sample.num_steps  # 10, of which round(0.5 x 10) = 5 are trained


def _run(run_dir: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy",
           f"--config.run_dir={run_dir}", "--config.eval.freq=100", "--config.logging.wandb_mode=disabled",
           *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _of(records, kind):
    return [r for r in records if r["type"] == kind]


def test_the_budget_stops_the_run_after_the_epoch_that_reaches_it(tmp_path):
    budget = 0.15  # a toy epoch takes about 0.05 s on one CPU thread
    p, records = _run(tmp_path, "--config.num_epochs=200", f"--config.max_train_seconds={budget}",
                      "--config.train.beta=0")
    epochs = _of(records, "epoch")
    assert 1 <= len(epochs) < 200
    assert epochs[-1]["train_seconds"] >= budget
    assert all(e["train_seconds"] < budget for e in epochs[:-1])
    running = 0.0
    for e in epochs:  # the budget is the epochs' own time: evaluations and checkpoints never count
        running += e["epoch_seconds"]
        assert e["train_seconds"] == pytest.approx(running, rel=1e-9)
        assert e["seconds_sampling"] + e["seconds_rewards"] + e["seconds_training"] <= e["epoch_seconds"]
        # one process: its own wall time is the epoch's, split into the passes' time and the rest
        assert 0 < e["seconds_device"] < e["epoch_seconds"]
        assert e["seconds_device"] + e["seconds_host"] == pytest.approx(e["epoch_seconds"], rel=1e-9)
        # hand counts: every step of every sample; training rescores the 5 trained steps, no reference (beta 0)
        assert e["nfe_sampling"] == STEPS * SAMPLES and e["nfe_training"] == 5 * SAMPLES
    assert epochs[-1]["nfe_sampling_total"] == len(epochs) * STEPS * SAMPLES
    final = next(r for r in _of(records, "eval") if r["tag"] == "final")
    assert final["train_seconds"] == epochs[-1]["train_seconds"] and final["epoch"] == epochs[-1]["epoch"]
    assert final["nfe_training_total"] == len(epochs) * 5 * SAMPLES
    assert "max_train_seconds" in (tmp_path / "summary.md").read_text()
    state = json.loads((tmp_path / "checkpoints" / f"epoch_{len(epochs):04d}" / "state.json").read_text())
    assert state["budget"]["train_seconds"] == epochs[-1]["train_seconds"]


def test_the_device_clock_sums_its_calls_and_nothing_else(monkeypatch):
    """On the CPU a call's wall time; on an accelerator its events' span, read once at take()."""
    import time

    from recam.engine.budget import DeviceClock

    clock = DeviceClock(torch.device("cpu"))
    nap = clock.timed(lambda s: time.sleep(s) or s)
    assert nap(0.02) == 0.02
    time.sleep(0.05)  # outside any timed call: not device time
    nap(0.01)
    taken = clock.take()
    assert 0.03 <= taken < 0.05 and clock.take() == 0.0

    class Event:  # a stand-in for torch.cuda.Event: records host time, elapsed in milliseconds
        synchronized = 0

        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            Event.synchronized += 1

        def elapsed_time(self, end):
            return (end.t - self.t) * 1000.0

    clock.events = Event
    with pytest.raises(ZeroDivisionError):  # a call that raises is still timed, and the error goes through
        clock.timed(lambda: time.sleep(0.01) or 1 / 0)()
    nap(0.02)
    assert len(clock.spans) == 2 and Event.synchronized == 0  # nothing waits inside the loop
    assert 0.03 <= clock.take() < 0.05 and Event.synchronized == 1 and clock.spans == []


def test_the_evaluation_grid_fires_where_training_time_crosses_it(tmp_path):
    every = 0.1
    _, records = _run(tmp_path, "--config.num_epochs=6", f"--config.eval.every_seconds={every}",
                      "--config.sample.window_size=2")
    epochs, evals = _of(records, "epoch"), _of(records, "eval")
    # by hand: after each epoch, the latest grid point reached since the last one evaluated
    expected, next_point = {}, every
    for e in epochs:
        if e["train_seconds"] >= next_point:
            point = math.floor(e["train_seconds"] / every) * every
            expected[time_eval_tag(point)] = e
            next_point = point + every
        # a window of 2 trained steps: 2 x 128 rescored by the policy and by the frozen reference (beta > 0)
        assert e["nfe_sampling"] == STEPS * SAMPLES and e["nfe_training"] == 2 * SAMPLES * 2
    timed = {r["tag"]: r for r in evals if r["tag"].startswith("time_")}
    assert expected and set(timed) == set(expected)
    for tag, r in timed.items():
        e = expected[tag]
        assert r["epoch"] == e["epoch"] and r["checkpoint"] == f"epoch_{e['epoch'] + 1:04d}"
        assert r["train_seconds"] == e["train_seconds"] and r["nfe_sampling_total"] == e["nfe_sampling_total"]
        assert r["nfe_training_total"] == e["nfe_training_total"] and "eval/target" in r
    start = next(r for r in evals if r["tag"] == "start")
    assert start["train_seconds"] == 0.0 and start["nfe_sampling_total"] == 0 and start["epoch"] == -1


def test_a_resumed_run_carries_the_totals_on(tmp_path):
    _, first = _run(tmp_path, "--config.num_epochs=2")
    _, records = _run(tmp_path, "--config.num_epochs=4")
    epochs = _of(records, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    before = _of(first, "epoch")
    assert epochs[1]["train_seconds"] == before[1]["train_seconds"]  # the first invocation's records are kept
    for prev, e in zip(epochs, epochs[1:], strict=False):
        assert e["train_seconds"] == pytest.approx(prev["train_seconds"] + e["epoch_seconds"], rel=1e-9)
        assert e["nfe_sampling_total"] == prev["nfe_sampling_total"] + STEPS * SAMPLES
        assert e["nfe_training_total"] == prev["nfe_training_total"] + 5 * SAMPLES * 2
    final = next(r for r in _of(records, "eval") if r["tag"] == "final")
    assert final["nfe_sampling_total"] == 4 * STEPS * SAMPLES


def test_time_eval_tags():
    assert time_eval_tag(30.0) == "time_00030s" and time_eval_tag(1200) == "time_01200s"
    assert time_eval_tag(0.5) == "time_00000.500s"


def test_a_wall_clock_stepped_back_mid_run_leaves_epoch_times_and_the_budget_alone(tmp_path, monkeypatch, one_thread):
    """Issue 64, item 6: NTP or a VM restore steps the wall clock back an hour in the middle of the first epoch's
    sampling; durations come from a monotonic clock, so every epoch's time stays positive and the budget stops the
    run as it would have."""
    import time

    from tests.toy_trainer import toy_trainer

    wall, wall_ns, offset = time.time, time.time_ns, [0.0]
    monkeypatch.setattr(time, "time", lambda: wall() + offset[0])
    monkeypatch.setattr(time, "time_ns", lambda: wall_ns() + int(offset[0] * 1e9))
    budget = 0.15
    trainer = toy_trainer(tmp_path, "toy", {"num_epochs": 200, "max_train_seconds": budget, "eval.freq": 100,
                                            "train.beta": 0.0})
    score = trainer.score

    def score_after_the_step():
        offset[0] = -3600.0
        return score()

    monkeypatch.setattr(trainer, "score", score_after_the_step)
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115 - the report prints its table
        trainer.train()
    assert offset[0] == -3600.0  # the step happened
    epochs = _of([json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()], "epoch")
    assert 1 <= len(epochs) < 200
    for e in epochs:
        assert 0 < e["epoch_seconds"] < 60
        assert min(e["seconds_sampling"], e["seconds_rewards"], e["seconds_training"]) >= 0
    assert epochs[-1]["train_seconds"] >= budget and all(e["train_seconds"] < budget for e in epochs[:-1])


# ---------------------------------------------------------------- an objective without log-probs or ratios


@pytest.fixture
def matching_objective():
    """A forward-process objective standing in for DiffusionNFT / AWM: re-noises each final sample once and fits
    the flow / DDPM target there, weighted by the advantage; keeps an old policy; reports no ratio."""
    calls = []

    @register_objective("test_matching")
    class Matching(KeepsOldPolicy):
        needs_log_probs = False

        def __init__(self, train_config, scheduler):
            self.t, self.scheduler = train_config, scheduler

        def accumulate(self, mb, backward):
            b = mb.final.shape[0]
            calls.append((tuple(mb.states.shape), tuple(mb.advantages.shape), mb.old_means))
            g = torch.Generator().manual_seed(int(mb.traj_ids[:, 0].sum()))
            noise = torch.randn(mb.final.shape, generator=g)
            u = torch.full((b,), 0.5)
            x_t, t = self.scheduler.noise_to(mb.final, noise, u)
            with torch.no_grad():
                old = mb.old_policy(x_t, t)
            out = mb.policy(x_t, t)
            per_sample = ((out - self.scheduler.output_target(mb.final, noise, u)) ** 2).mean(1)
            loss = (mb.sample_weight * mb.advantages[:, 0] * per_sample).mean()
            backward(loss, True)
            return [{"loss": loss.detach(), "old_gap": ((out - old) ** 2).mean().detach()}]

        def end_epoch(self):
            pass

    yield calls
    OBJECTIVES.pop("test_matching")


def _train_in_process(run_dir: Path, epochs: int):
    from tests.toy_trainer import toy_trainer

    trainer = toy_trainer(run_dir, "toy", {"num_epochs": epochs, "train.objective": "test_matching",
                                           "train.old_policy_decay": 0.5, "eval.freq": 100,
                                           "train.old_policy_decay_ramp": 0.0})  # half way per epoch from the first
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115 - the report prints its table
        trainer.train()
    return trainer, trainer.numbers, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_objective_without_ratios_samples_deterministically_and_keeps_an_exact_old_policy(tmp_path,
                                                                                            matching_objective):
    trainer, derived, records = _train_in_process(tmp_path / "a", 3)
    assert trainer.scheduler.num_train_steps == 0 and derived.num_train_timesteps == 1
    # nothing stored per step (states (b, 0, 2)), one advantage column, no sampling means asked for
    assert {(states[1], adv[1], means) for states, adv, means in matching_objective} == {(0, 1, None)}
    for e in _of(records, "epoch"):
        assert e["first_step_ratio_deviation"] is None  # no ratio: nothing to judge, never reported as 1
        assert e["nfe_sampling"] == STEPS * SAMPLES  # the whole trajectory deterministic, nothing trained in it
        assert e["nfe_training"] == 2 * SAMPLES  # the policy and the old policy, once per re-noised sample
        assert all("ratio_max" not in s and "loss" in s for s in e["optimizer_steps"])
    # the old policy moved toward the policy, half way per epoch
    live = dict(trainer.model.named_parameters())
    old = trainer.objective.old.tensors()
    assert all(not torch.equal(old[n], live[n]) for n in old)
    side = json.loads((tmp_path / "a" / "checkpoints" / "epoch_0003" / "old_policy.json").read_text())
    assert side["decay"] == 0.5
    assert all(torch.equal(v, old[n]) for n, v in decode_tensors(side["tensors"]).items())
    # interrupted after 2 epochs and resumed: the same old policy as the uninterrupted run, bit for bit
    _train_in_process(tmp_path / "b", 2)
    resumed, _, _ = _train_in_process(tmp_path / "b", 3)
    for n, v in resumed.objective.old.tensors().items():
        assert torch.equal(v, old[n]), n


def test_absent_ratios_are_skipped_by_the_guard_and_the_logs():
    steps = [StepStats(1, {"loss": 0.3, "grad_norm": 1.0})]
    assert EpochResult(steps).first_step_ratio_deviation is None
    assert EpochResult([StepStats(1, {"mean_ratio": 1.25})]).first_step_ratio_deviation == pytest.approx(0.25)
    findings = diagnose_step({"loss": 0.3, "step": 1, "epoch": 0}, [])
    assert not any("ratio" in f.rule for f in findings)
    findings = diagnose_epoch({"epoch": 0, "step": 1, "first_step_ratio_deviation": None}, [])
    assert not any("ratio" in f.rule or "first_step" in f.rule for f in findings)
    assert "n/a" in records.epoch_line({"epoch": 0, "step": 1, "first_step_ratio_deviation": None})


def test_tensors_survive_the_side_file_encoding_exactly():
    tensors = {"w": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16), "s": torch.tensor(2.5)}
    back = decode_tensors(json.loads(json.dumps(encode_tensors(tensors))))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
