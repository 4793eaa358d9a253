"""Config validation that runs before any model is built, and the derived numbers of a run.

Every error names the config field(s) at fault and says what would fix them.
"""

from __future__ import annotations

import ml_collections


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


VARIANT_FLAGS = ("use_ema_smoothing", "use_gradient_adaptive_weighting", "use_amic", "use_gspo", "use_ptrw",
                 "use_temporal_decay", "use_asymmetric_clipping")


def derived_numbers(config: ml_collections.ConfigDict, num_processes: int) -> dict:
    """Numbers every reader of a run needs, computed once: samples and unique conditions per batch/epoch."""
    s = config.sample
    per_batch = num_processes * s.batch_size
    return {
        "num_processes": num_processes,
        "per_device_batch": s.batch_size,
        "k": s.k,
        "num_batches_per_epoch": s.num_batches_per_epoch,
        "samples_per_batch": per_batch,
        "conditions_per_batch": per_batch // s.k,
        "samples_per_epoch": per_batch * s.num_batches_per_epoch,
        "unique_conditions_per_epoch": per_batch * s.num_batches_per_epoch // s.k,
        "num_train_timesteps": num_train_timesteps(s.num_steps, config.train.timestep_fraction),
    }


def num_train_timesteps(num_steps: int, timestep_fraction: float) -> int:
    """Trained denoising steps: the first ceil-free fraction of the rollout, never the final (too peaked) step."""
    return max(1, min(num_steps - 1, int(num_steps * timestep_fraction)))


def validate(config: ml_collections.ConfigDict, num_processes: int) -> dict:
    """Check `config` for a launch with `num_processes` processes; return `derived_numbers`."""
    import recam.variants  # noqa: F401  (registers the "grpo_variants" policy loss)
    from recam.losses import KL_ESTIMATORS, POLICY_LOSSES
    from rewards import known_rewards

    s, t, a = config.sample, config.train, config.advantage
    _require(num_processes >= 1, f"num_processes must be >= 1, got {num_processes}")
    if config.expected_num_processes:
        _require(
            config.expected_num_processes == num_processes,
            f"expected_num_processes={config.expected_num_processes} but {num_processes} processes were "
            "launched; launch that many or set --config.expected_num_processes=0",
        )
    for field in ("sample.batch_size", "sample.k", "sample.num_batches_per_epoch", "sample.num_steps",
                  "train.batch_size", "num_epochs", "train.num_inner_epochs", "data.num_frames", "data.size"):
        section, name = field.split(".") if "." in field else (None, field)
        value = config[section][name] if section else config[name]
        _require(isinstance(value, int) and value >= 1, f"{field} must be a positive integer, got {value!r}")
    _require(s.k >= 2, f"sample.k must be >= 2 for group-relative advantages, got {s.k}")
    per_batch = num_processes * s.batch_size
    _require(
        per_batch % s.k == 0,
        f"sample.k={s.k} must divide num_processes x sample.batch_size = {num_processes} x {s.batch_size} "
        f"= {per_batch}: every sampling batch must hold whole groups",
    )
    total = per_batch * s.num_batches_per_epoch
    _require(total % s.k == 0, f"samples per epoch {total} must be divisible by sample.k={s.k}")
    _require(
        s.batch_size % t.batch_size == 0,
        f"train.batch_size={t.batch_size} must divide sample.batch_size={s.batch_size}",
    )
    _require(isinstance(t.gradient_accumulation_steps, int) and t.gradient_accumulation_steps >= 1,
             f"train.gradient_accumulation_steps must be a positive integer, got {t.gradient_accumulation_steps!r}")
    _require(s.sde_type in ("sde", "cps"), f"sample.sde_type must be 'sde' or 'cps', got {s.sde_type!r}")
    _require(s.noise_level > 0, f"sample.noise_level must be > 0 for a stochastic policy, got {s.noise_level}")
    _require(0 < t.timestep_fraction <= 1, f"train.timestep_fraction must be in (0, 1], got {t.timestep_fraction}")
    _require(t.clip_range > 0, f"train.clip_range must be > 0, got {t.clip_range}")
    _require(t.log_ratio_clamp > 0, f"train.log_ratio_clamp must be > 0, got {t.log_ratio_clamp}")
    _require(t.beta >= 0, f"train.beta must be >= 0, got {t.beta}")
    _require(t.learning_rate > 0, f"train.learning_rate must be > 0, got {t.learning_rate}")
    _require(0 < t.ema_decay < 1, f"train.ema_decay must be in (0, 1), got {t.ema_decay}")
    _require(t.policy_loss in POLICY_LOSSES,
             f"train.policy_loss={t.policy_loss!r} is not registered; known: {sorted(POLICY_LOSSES)}")
    _require(t.kl_type == "gaussian_mean" or t.kl_type in KL_ESTIMATORS,
             f"train.kl_type={t.kl_type!r} unknown; use 'gaussian_mean' or one of {sorted(KL_ESTIMATORS)}")
    variant_flags = [f for f in VARIANT_FLAGS if t[f]]
    _require(not variant_flags or t.policy_loss == "grpo_variants",
             f"train.{variant_flags[0] if variant_flags else ''} needs train.policy_loss='grpo_variants', "
             f"got {t.policy_loss!r}")
    _require(not (t.use_amic and t.use_gspo),
             "train.use_amic and train.use_gspo are mutually exclusive: AMIC is the arithmetic-mean alternative "
             "to GSPO's geometric mean; enable one")
    _require(not (t.use_ptrw and t.use_asymmetric_clipping),
             "train.use_ptrw and train.use_asymmetric_clipping are mutually exclusive: PTRW replaces hard "
             "clipping, so there is no clip range to make asymmetric")
    _require(not (t.use_ema_smoothing and (t.use_amic or t.use_gspo)),
             "train.use_ema_smoothing cannot combine with train.use_amic/train.use_gspo: the EMA smooths one "
             "timestep's weight, the sequence forms are built from all raw weights")
    _require(0 < t.ema_beta <= 1, f"train.ema_beta must be in (0, 1], got {t.ema_beta}")
    _require(t.gradient_weighting_temperature > 0,
             f"train.gradient_weighting_temperature must be > 0, got {t.gradient_weighting_temperature}")
    _require(t.ptrw_sigma > 0, f"train.ptrw_sigma must be > 0, got {t.ptrw_sigma}")
    _require(0 < t.temporal_decay_gamma <= 1,
             f"train.temporal_decay_gamma must be in (0, 1], got {t.temporal_decay_gamma}")
    _require(t.clip_ratio_pos > 0 and t.clip_ratio_neg > 0,
             f"train.clip_ratio_pos/neg must be > 0, got {t.clip_ratio_pos}, {t.clip_ratio_neg}")
    _require(a.std_mode in ("group", "global", "none"),
             f"advantage.std_mode must be 'group', 'global' or 'none', got {a.std_mode!r}")
    _require(config.mixed_precision in ("no", "fp16", "bf16"),
             f"mixed_precision must be 'no', 'fp16' or 'bf16', got {config.mixed_precision!r}")
    _require(config.logging.wandb_mode in ("offline", "online", "disabled"),
             f"logging.wandb_mode must be offline/online/disabled, got {config.logging.wandb_mode!r}")
    _require(config.health.action in ("warn", "stop", "rollback"),
             f"health.action must be 'warn', 'stop' or 'rollback', got {config.health.action!r}")
    _require(0 < config.health.rollback_lr_factor <= 1,
             f"health.rollback_lr_factor must be in (0, 1], got {config.health.rollback_lr_factor}")
    weights = dict(config.reward.weights)
    _require(len(weights) > 0, "reward.weights is empty: name at least one reward")
    unknown = sorted(set(weights) - set(known_rewards()))
    _require(not unknown, f"reward.weights names unknown rewards {unknown}; known: {sorted(known_rewards())}")
    _require(all(w >= 0 for w in weights.values()) and sum(weights.values()) > 0,
             f"reward.weights must be non-negative with a positive sum, got {weights}")
    _require(config.reward.failure_policy in ("wait", "drop_group", "stop"),
             f"reward.failure_policy must be 'wait', 'drop_group' or 'stop', got {config.reward.failure_policy!r}")
    _require(config.reward.async_workers >= 1, f"reward.async_workers must be >= 1, got {config.reward.async_workers}")
    conds_per_batch = per_batch // s.k
    _require(
        config.data.num_train_conditions >= conds_per_batch,
        f"data.num_train_conditions={config.data.num_train_conditions} is smaller than the "
        f"{conds_per_batch} unique conditions one sampling batch needs",
    )
    return derived_numbers(config, num_processes)
