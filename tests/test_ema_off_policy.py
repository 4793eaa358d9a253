"""Issue 63 item 1: the EMA of importance weights smooths off-policy weights only, its variance-reduction ratio is
Var(raw) / Var(smoothed) over the weights it smoothed in an optimizer step, and an EMA with nothing to smooth is
refused by validation in one line naming the fields."""

import json
import statistics

import pytest
import torch

from config.grpo import ema_passes, get_config
from config.validate import ConfigError, validate
from recam.engine import records
from recam.engine.extensions.variants import (
    EMA_STATE_FILE,
    VariantInputs,
    off_policy_visits,
    optimizer_steps_per_pass,
)
from recam.engine.objective import GRPOObjective, MicroBatch
from recam.engine.rollout import rescore, rollout
from tests.test_methods_parity import SHAPE, Velocity, scheduler_of

N, T, MICRO, PASSES, BETA = 8, 3, 4, 3, 0.6


def ema_train_config(**overrides):
    c = get_config("tiny_cpu")
    t = c.train
    t.policy_loss, t.use_ema_smoothing, t.ema_beta, t.beta = "grpo_variants", True, BETA, 0.0
    for k, v in overrides.items():
        t[k] = v
    return c


def independent_ema_ratios(weights_by_step, ids_by_step, updates_by_step, beta):
    """The variance ratio of each step written out as a plain loop over python floats: weights of a visit with no
    update since sampling are skipped; a (sample id, timestep)'s first off-policy weight starts its average; every
    later one is smoothed and counted. None for a step that smoothed nothing."""
    history, out = {}, []
    for weights, ids, updates in zip(weights_by_step, ids_by_step, updates_by_step, strict=True):
        raw, smooth = [], []
        if updates > 0:
            for row, sample in enumerate(ids):
                for j, w in enumerate(weights[row]):
                    key = (sample, j)
                    if key in history:
                        s = beta * w + (1 - beta) * history[key]
                        raw.append(w)
                        smooth.append(s)
                        history[key] = s
                    else:
                        history[key] = w
        out.append(statistics.pvariance(raw) / statistics.pvariance(smooth) if raw else None)
    return out


def test_variance_reduction_ratio_matches_a_plain_loop_on_a_run_where_the_weights_vary():
    """Three passes over 8 samples in micro-batches of 4, one optimizer step per micro-batch (two per pass): the
    first step is on-policy, the next two are each sample's first off-policy visit, and the last three smooth. The
    logged ratio of each step is the loop's, it varies from step to step, and it is neither 1 nor 1 / beta^2 (what
    blending with the on-policy weights used to report whatever the data)."""
    c = ema_train_config()
    sched = scheduler_of(c, T)
    torch.manual_seed(0)
    policy = Velocity(1)
    g = torch.Generator().manual_seed(5)
    noise = torch.randn(N, c.sample.num_steps + 1, *SHAPE, generator=g)
    with torch.no_grad():
        out = rollout(policy, noise, sched)
    assert out.log_probs.shape == (N, T)
    advantages = torch.randn(N, generator=g)
    traj = torch.stack([torch.arange(N) + 100, torch.arange(N) % 2], 1)
    objective = GRPOObjective(c.train, sched)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)

    logged, weights_by_step, ids_by_step, updates_by_step = [], [], [], []
    steps = 0
    for inner in range(PASSES):
        for first in range(0, N, MICRO):
            rows = slice(first, first + MICRO)
            with torch.no_grad():  # the weights this visit sees, computed apart from the objective
                logp = torch.stack([rescore(policy, out.states[rows], sched, j).log_prob for j in range(T)], 1)
            weights_by_step.append((logp - out.log_probs[rows]).exp().double().tolist())
            ids_by_step.append([tuple(r) for r in traj[rows].tolist()])
            updates_by_step.append(steps)
            mb = MicroBatch(states=out.states[rows], old_log_probs=out.log_probs[rows],
                            advantages=advantages[rows, None].expand(MICRO, T), sample_weight=torch.full(
                                (MICRO,), 1.0 / MICRO), traj_ids=traj[rows], policy=policy, reference=None,
                            inner_epoch=inner, policy_updates=steps)
            passes = objective.accumulate(mb, lambda loss, last: loss.backward())
            logged.append(objective.finish_step_metrics(records.step_metrics(passes, 0.0, MICRO, None, 0.5)))
            opt.step()
            opt.zero_grad()
            steps += 1
    objective.end_epoch()

    expected = independent_ema_ratios(weights_by_step, ids_by_step, updates_by_step, BETA)
    assert [e is None for e in expected] == [True, True, True, False, False, False]
    for m, e in zip(logged, expected, strict=True):
        assert not any(k.startswith("ema/sums/") for k in m)
        if e is None:
            assert m["ema/smoothed_fraction"] == 0.0 and "ema/variance_reduction_ratio" not in m
        else:
            assert m["ema/smoothed_fraction"] == 1.0
            assert m["ema/variance_reduction_ratio"] == pytest.approx(e, rel=1e-6)
            assert m["ema/missing_state"] == 0.0
    ratios = [m["ema/variance_reduction_ratio"] for m in logged[3:]]
    print("variance reduction ratios of the smoothing steps:", [f"{r:.4f}" for r in ratios])
    for r in ratios:
        assert abs(r - 1.0) > 1e-3 and abs(r - 1 / BETA**2) > 1e-3
    assert max(ratios) - min(ratios) > 1e-3  # not a constant
    # the raw weights it smoothed did move: the run is off-policy by more than rounding
    assert logged[-1]["ema/raw_weights_variance"] > 1e-8
    assert objective.step_inputs.ema.active_sequences == 0  # retired with the epoch


def test_the_cross_epoch_state_travels_with_the_checkpoint(tmp_path):
    c = ema_train_config(ema_across_epochs=True)
    inputs = VariantInputs(c.train, scheduler_of(c, T))
    inputs.ema.update([(3, 0), (4, 1)], torch.tensor([[1.001, 0.999, 1.0], [0.998, 1.0, 1.003]]))
    inputs.retire_epoch()  # kept: the next epoch's draw of the same id continues it
    assert inputs.ema.active_sequences == 2
    files = inputs.side_files()
    assert set(files) == {EMA_STATE_FILE}
    (tmp_path / EMA_STATE_FILE).write_text(json.dumps(files[EMA_STATE_FILE]))
    restored = VariantInputs(c.train, scheduler_of(c, T))
    restored.load_side_files(tmp_path, lambda line: None)
    assert restored.ema.has_history([(3, 0), (4, 1), (5, 0)]).tolist() == [True, True, False]
    new = torch.tensor([[1.002, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float32)
    torch.testing.assert_close(restored.ema.update([(3, 0), (4, 1)], new), inputs.ema.update([(3, 0), (4, 1)], new),
                               rtol=0, atol=0)
    told = []
    empty = VariantInputs(c.train, scheduler_of(c, T))
    empty.load_side_files(tmp_path / "none", told.append)
    assert empty.ema.active_sequences == 0 and EMA_STATE_FILE in told[0]
    # within-epoch state is not checkpointed: the epoch's samples end with it
    assert VariantInputs(ema_train_config(num_inner_epochs=3).train, scheduler_of(c, T)).side_files() == {}


# ------------------------------------------------------------------------------------------- validation


def refused(c, processes=1) -> str:
    with pytest.raises(ConfigError) as e:
        validate(c, processes)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_the_schedule_arithmetic():
    assert optimizer_steps_per_pass(128, 8, 16) == 1  # tiny_cpu: 16 micro-batches, one step
    assert optimizer_steps_per_pass(64, 8, 4) == 2  # motion_tiny_cpu
    assert optimizer_steps_per_pass(10, 4, 2) == 2  # 3 micro-batches, the last one short
    assert off_policy_visits(1, 1) == (0, 0)
    assert off_policy_visits(2, 1) == (1, 1)
    assert off_policy_visits(2, 2) == (1, 2)
    assert off_policy_visits(3, 1) == (2, 2)


def test_ema_with_nothing_to_smooth_is_refused_in_one_line_naming_the_fields():
    # one pass, one optimizer step: every weight is on-policy
    msg = refused(ema_train_config(num_inner_epochs=1))
    assert "train.use_ema_smoothing" in msg and "train.num_inner_epochs=3" in msg
    assert "ema_across_epochs" not in msg  # it would not help: no weight is ever off-policy
    # two passes of one step: each sample's only off-policy visit starts its average, none is smoothed
    msg = refused(ema_train_config(num_inner_epochs=2))
    assert "train.num_inner_epochs=3" in msg and "train.ema_across_epochs=True" in msg
    # what the messages offer is accepted
    validate(ema_train_config(num_inner_epochs=3), 1)
    validate(ema_train_config(num_inner_epochs=2, gradient_accumulation_steps=8), 1)  # two steps per pass
    validate(ema_train_config(num_inner_epochs=2, ema_across_epochs=True), 1)
    validate(ema_train_config(num_inner_epochs=1, gradient_accumulation_steps=8, ema_across_epochs=True), 1)
    # one pass of two steps, no cross-epoch state: refused, naming the pass count that a two-step pass needs
    msg = refused(ema_train_config(num_inner_epochs=1, gradient_accumulation_steps=8))
    assert "train.num_inner_epochs=2" in msg


def test_cross_epoch_state_needs_the_ema_and_one_process():
    c = ema_train_config(num_inner_epochs=3, ema_across_epochs=True)
    c.train.use_ema_smoothing = False
    msg = refused(c)
    assert "train.ema_across_epochs" in msg and "train.use_ema_smoothing" in msg
    msg = refused(ema_train_config(num_inner_epochs=3, ema_across_epochs=True), processes=2)
    assert "train.ema_across_epochs" in msg and "2 processes" in msg
    validate(ema_train_config(num_inner_epochs=3), 2)  # within-epoch state is per process and fine


def test_ema_presets_smooth_and_have_a_control_that_differs_only_in_the_ema():
    for name in ("ema", "conservative", "balanced"):
        c = get_config(name)
        assert c.train.num_inner_epochs == ema_passes(c) == 3, name
        validate(c, 1)
    ema, control, base = get_config("ema"), get_config("ema_control"), get_config("tiny_cpu")
    validate(control, 1)
    differs = {k for k in ema.train if ema.train[k] != control.train[k]}
    assert differs == {"use_ema_smoothing"}
    assert not any(control.train[k] for k in control.train if k.startswith("use_"))
    # the control's difference to tiny_cpu is its passes (its loss with every variant off is grpo_clip's)
    differs = {k for k in control.train if control.train[k] != base.train[k]}
    assert differs == {"num_inner_epochs", "policy_loss"}
    # a preset whose pass takes two optimizer steps needs two passes only
    motion = get_config("motion_tiny_cpu")
    assert ema_passes(motion) == 2
