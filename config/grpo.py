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
    c.train.gradient_accumulation_steps = 1
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


def _variants(c, name, **flags):
    """tiny_cpu with policy-optimization variants switched on (see config/base.py, recam/variants.py)."""
    c.run_name = name
    c.run_dir = f"runs/{name}"
    c.train.policy_loss = "grpo_variants"
    # Smoothing across inner updates needs more than one inner update per trajectory.
    c.train.num_inner_epochs = 2 if flags.get("use_ema_smoothing") else c.train.num_inner_epochs
    for k, v in flags.items():
        c.train[k] = v
    return c


def ema():
    """2.1 temporally smoothed (EMA) importance weights."""
    return _variants(tiny_cpu(), "ema", use_ema_smoothing=True)


def gradient_adaptive():
    """2.2 gradient-adaptive importance weighting over timesteps."""
    return _variants(tiny_cpu(), "gradient_adaptive", use_gradient_adaptive_weighting=True)


def amic():
    """2.3 arithmetic-mean importance correction, clipped at sequence level."""
    return _variants(tiny_cpu(), "amic", use_amic=True)


def ptrw():
    """2.4 probabilistic trust-region weighting (Gaussian gate instead of hard clipping)."""
    return _variants(tiny_cpu(), "ptrw", use_ptrw=True)


def temporal_decay():
    """2.5 temporal-decay advantage shaping (noisiest steps weigh most)."""
    return _variants(tiny_cpu(), "temporal_decay", use_temporal_decay=True)


def asymmetric():
    """2.6 asymmetric clipping for positive and negative advantages."""
    return _variants(tiny_cpu(), "asymmetric", use_asymmetric_clipping=True)


def conservative():
    """Plan combination: EMA + temporal decay."""
    return _variants(tiny_cpu(), "conservative", use_ema_smoothing=True, use_temporal_decay=True)


def aggressive():
    """Plan combination: AMIC + gradient-adaptive + PTRW."""
    return _variants(tiny_cpu(), "aggressive", use_amic=True, use_gradient_adaptive_weighting=True, use_ptrw=True)


def balanced():
    """Plan combination: EMA + gradient-adaptive + asymmetric clipping."""
    return _variants(tiny_cpu(), "balanced", use_ema_smoothing=True, use_gradient_adaptive_weighting=True,
                     use_asymmetric_clipping=True)


VARIANT_PRESETS = (ema, gradient_adaptive, amic, ptrw, temporal_decay, asymmetric, conservative, aggressive,
                   balanced)
PRESETS = {f.__name__: f for f in (tiny_cpu, smoke, recam_8npu, *VARIANT_PRESETS)}


def get_config(name: str = "tiny_cpu"):
    name = name or "tiny_cpu"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} in config/grpo.py; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()
