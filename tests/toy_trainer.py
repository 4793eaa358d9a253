"""An in-process GRPOTrainer on the toy domain, for the tests that step through the engine's phases (sample, score,
update) or run a few epochs without a subprocess. Seconds on a CPU; nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator

from config import grpo
from config.validate import validate
from recam.domains.toy.domain import ToyDomain
from recam.engine.trainer import GRPOTrainer
from recam.infra import runlog


def toy_config(run_dir: Path, preset: str = "toy", settings: dict | None = None):
    """The preset's config writing to run_dir with logging off, then each "section.field": value of settings."""
    c = grpo.get_config(preset)
    c.run_dir, c.logging.wandb_mode = str(run_dir), "disabled"
    for dotted, value in (settings or {}).items():
        *sections, field = dotted.split(".")
        node = c
        for name in sections:
            node = node[name]
        node[field] = value
    return c


def toy_trainer(run_dir: Path, preset: str = "toy", settings: dict | None = None) -> GRPOTrainer:
    """A validated trainer as scripts/train_recam.py builds it, on one CPU process, seeded like a run."""
    c = toy_config(run_dir, preset, settings)
    derived = validate(c, 1)
    torch.manual_seed(c.seed)
    log = runlog.RunLog(Path(run_dir), c)
    return GRPOTrainer(c, ToyDomain(c, "cpu", log), Accelerator(cpu=True), log, derived)
