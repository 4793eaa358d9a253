"""Which weights sample, and which weights a ratio divides by: DiffusionNFT draws its rollouts with its old policy,
AWM's ratio is against the weights that sampled (its average is only a KL anchor), and both ramp the old policy's
averaging weight as their public scripts do. Checked on in-process toy runs against computations made apart from
the trainer."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import pytest
import torch

from recam.engine.extensions.old_policy import old_policy_decay_at
from recam.engine.rollout import deterministic_sample, per_sample_noise
from recam.engine.trainer import GRPOTrainer
from tests.toy_trainer import toy_trainer


def _trainer(run_dir: Path, preset: str, **train) -> GRPOTrainer:
    settings = {"eval.freq": 100, "sample.num_batches_per_epoch": 1, "sample.batch_size": 8,  # seconds, not minutes
                "train.batch_size": 8,
                "toy.pretrain_steps": 200}  # which weights sample is the question here, not how good the base is
    return toy_trainer(run_dir, preset, {**settings, **{f"train.{k}": v for k, v in train.items()}})


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "epoch"]


def test_old_policy_decay_ramps_like_the_reference_scripts():
    # DiffusionNFT decay_type 1: min(0.001 * step, 0.5); AWM: min(0.3, 0.001 * step)
    assert [old_policy_decay_at(s, 0.5, 0.001) for s in (0, 1, 250, 500, 10_000)] == [0.0, 0.001, 0.25, 0.5, 0.5]
    assert old_policy_decay_at(400, 0.3, 0.001) == 0.3
    assert old_policy_decay_at(0, 0.5, 0.0) == 0.5  # no ramp: the cap from the start
    # DiffusionNFT decay_type 2 (its ocr preset): 0 for 75 steps, then 0.0075 per step up to 0.999
    assert [old_policy_decay_at(s, 0.999, 0.0075, 75) for s in (0, 74, 75, 76, 175, 300)] == \
        pytest.approx([0.0, 0.0, 0.0, 0.0075, 0.75, 0.999])


def test_nft_samples_with_its_old_policy(tmp_path):
    trainer = _trainer(tmp_path / "nft", "toy+nft")
    assert trainer.objective.sampling_model(trainer.model) is trainer.objective.old.copy
    with torch.no_grad():  # an old policy apart from the policy: which one drew the samples is then visible
        for p in trainer.objective.old.copy.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    rollouts = trainer.sample(0)
    trainer.runner.collect()
    s, c = trainer.config.sample, trainer.config
    indices = trainer.sampler.batch_at(0)
    batch = trainer.domain.collate(trainer.train_set, indices, {})
    keys = [(c.seed, 0, n) for n in range(len(indices))]
    noise = per_sample_noise(keys, trainer.scheduler.num_steps + 1, trainer.sample_shape)[:, 0]
    by = {name: deterministic_sample(trainer.domain.denoiser(m, batch, contextlib.nullcontext), noise,
                                     trainer.scheduler, s.ode_solver)
          for name, m in (("old", trainer.objective.old.copy), ("policy", trainer.model))}
    assert not torch.allclose(by["old"], by["policy"], atol=1e-3)
    torch.testing.assert_close(rollouts.final, by["old"], atol=1e-6, rtol=1e-6)


def test_nft_run_ramps_its_old_policy_from_the_policy(tmp_path):
    trainer = _trainer(tmp_path / "nft", "toy+nft")
    trainer.config.num_epochs = 2
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
        trainer.train()
    records = _records(tmp_path / "nft")
    steps = [len(r["optimizer_steps"]) for r in records]
    assert [r["old_policy_decay"] for r in records] == [pytest.approx(0.001 * steps[0]),
                                                         pytest.approx(0.001 * sum(steps))]


def test_awm_first_step_ratio_is_one_in_every_epoch(tmp_path):
    """Before the fix the ratio divided by the old (averaged) policy: its first step's ratio left 1 from the
    second epoch on, and the check was switched off for AWM."""
    run_dir = tmp_path / "awm"
    trainer = _trainer(run_dir, "toy+awm", old_policy_decay_ramp=0.0, old_policy_decay=0.5)
    trainer.config.num_epochs = 3
    with contextlib.redirect_stdout(open(os.devnull, "w")):  # noqa: SIM115
        trainer.train()
    records = _records(run_dir)
    assert len(records) == 3
    for r in records:
        assert r["first_step_ratio_deviation"] is not None and r["first_step_ratio_deviation"] < 1e-4, r["epoch"]
        assert r["old_policy_decay"] == 0.5
    # the average lags the policy (it is the KL anchor): the policy moved away from it
    live = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, live[n]) for n, v in trainer.objective.old.tensors().items())
    # later steps of an epoch are off the sampler: the snapshot kept the sampling weights, not the policy's
    snap = trainer.objective.old.trainable(trainer.objective.old.snapshot)
    assert any(not torch.equal(v, live[n].detach()) for n, v in snap.items())
    fresh = copy.deepcopy(trainer.model)
    assert trainer.objective.sampling_model(trainer.model) is trainer.model
    assert all(torch.equal(v, dict(fresh.named_parameters())[n]) for n, v in trainer.objective.old.trainable(
        trainer.objective.old.snapshot).items())
