"""GRPO post-training of a generator, top to bottom; the preset chooses the domain (config.domain).

    accelerate launch scripts/train_recam.py --config config/grpo.py:tiny_cpu [--config.train.beta=0.01]

Per epoch: sample k copies of each condition with log-probs -> score with the rewards -> gather across
processes -> group-relative advantages -> clipped-ratio policy updates with a KL pull toward the frozen
reference -> health guard -> checkpoint -> evaluate held-out conditions with deterministic sampling
(recam/engine/trainer.py). Exit status: 0 when the run ends, 3 when it stopped early (reward server down, or the
health guard), 2 for an invalid config.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from config.validate import eval_report_rewards, validate, validate_files  # noqa: E402
from recam.engine.domain import build_domain  # noqa: E402
from recam.engine.trainer import GRPOTrainer  # noqa: E402
from recam.infra import runlog  # noqa: E402
from recam.infra.distributed import use_cpu_if_no_accelerator  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "config/grpo.py:tiny_cpu", "Preset file:name plus overrides.")


def main(_):
    config = FLAGS.config
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    use_cpu_if_no_accelerator()
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    derived = validate(config, accelerator.num_processes)  # before any model is built
    validate_files(config)  # paths, and in_channels against the codec's channels, from config.json headers
    log = runlog.RunLog(Path(config.run_dir), config, enabled=accelerator.is_main_process)
    log.info(f"derived numbers: {json.dumps(derived)}")
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)

    domain = build_domain(config, accelerator.device, log)
    trainer = GRPOTrainer(config, domain, accelerator, log, derived, eval_report_rewards(config))
    stopped_by = trainer.train()

    log.close()
    # The DDP reducer must die before its process group, or gloo's teardown deadlocks on the GIL at exit.
    accelerator.free_memory()
    trainer = None
    gc.collect()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if stopped_by:
        sys.exit(3)


if __name__ == "__main__":
    app.run(main)
