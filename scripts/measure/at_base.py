"""A trainer on a preset's base weights, for the tools that measure the base without training it
(scripts/measure/step_gradients.py, scripts/measure/gradient_agreement.py). Not a script itself."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from accelerate import Accelerator

from config.plugins import add_loss_settings, import_plugins
from config.validate import ConfigError, eval_report_rewards, validate
from recam.domains import build_domain
from recam.engine.trainer import GRPOTrainer
from recam.infra import runlog
from recam.infra.distributed import use_cpu_if_no_accelerator


@contextlib.contextmanager
def trainer_at_base(config) -> Iterator[GRPOTrainer]:
    """Import config.plugins (and add the settings of a policy loss they register) and validate `config` (exit with
    the field's one-line error), build its domain and trainer in a temporary run folder that is removed afterwards,
    and close the reward runner and log on the way out."""
    with tempfile.TemporaryDirectory() as tmp:
        config.run_dir, config.logging.wandb_mode = tmp, "disabled"
        try:
            import_plugins(config)
            add_loss_settings(config)
            derived = validate(config, 1)
        except ConfigError as e:
            sys.exit(f"[recam] {e}")
        use_cpu_if_no_accelerator()
        accelerator = Accelerator()
        log = runlog.RunLog(Path(tmp), config, enabled=False)
        trainer = GRPOTrainer(config, build_domain(config, accelerator.device, log), accelerator, log, derived,
                              eval_report_rewards(config))
        try:
            yield trainer
        finally:
            trainer.runner.close()
            log.close()
