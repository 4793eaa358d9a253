"""GRPO presets, selected as `--config config/grpo.py:NAME` (default: tiny_cpu).

Each preset is a function over the commented base config in config/base.py.
"""

from config.base import get_config as base_config


def tiny_cpu():
    """The embedded default: ReCam-Tiny on the synthetic world, one CPU process."""
    return base_config()


def smoke():
    """tiny_cpu cut down to finish in about two minutes; used by tests and CI."""
    c = tiny_cpu()
    c.run_name = "smoke"
    c.run_dir = "runs/smoke"
    c.num_epochs = 2
    c.data.num_train_conditions = 16
    c.data.num_heldout_conditions = 8
    c.sample.num_batches_per_epoch = 1
    c.sample.num_steps = 6
    c.sample.eval_num_steps = 6
    c.eval.freq = 2
    c.eval.batch_size = 8
    c.eval.num_videos = 2
    return c


def recam_8npu():
    """8 NPUs x 2 samples per device, k = 4, 4 batches per epoch: 64 samples, 16 conditions per epoch."""
    c = tiny_cpu()
    c.run_name = "recam_8npu"
    c.run_dir = "runs/recam_8npu"
    c.expected_num_processes = 8
    c.mixed_precision = "bf16"
    c.sample.batch_size = 2
    c.train.batch_size = 2
    c.sample.k = 4
    c.sample.num_batches_per_epoch = 4
    c.num_epochs = 100
    return c


PRESETS = {f.__name__: f for f in (tiny_cpu, smoke, recam_8npu)}


def get_config(name: str = "tiny_cpu"):
    name = name or "tiny_cpu"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in config/grpo.py; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()
