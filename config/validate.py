"""Config validation that runs before any model is built, and the derived numbers of a run.

Every error names the config field(s) at fault and says what would fix them.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


DATA_SOURCES = ("synthetic", "recammaster")
MODEL_FORMATS = ("recam", "wan_diffusers", "recammaster_diffsynth")
MODEL_DTYPES = ("float32", "bfloat16")
# Rewards that read the synthetic world's landmarks: real data has none (recam/domains/camera/data.py).
LANDMARK_REWARDS = ("cam_score",)


def eval_report_rewards(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """Rewards scored at evaluation besides the weighted ones (eval.report_rewards, comma-separated)."""
    return tuple(n.strip() for n in config.eval.report_rewards.split(",") if n.strip())


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
    from recam.engine.advantages import STD_MODES
    from recam.engine.domain import DOMAINS, known_domains
    from recam.engine.losses import KL_ESTIMATORS, POLICY_LOSSES
    from recam.engine.objective import OBJECTIVES
    from recam.engine.variants import VARIANT_SWITCHES  # (importing it registers the "grpo_variants" policy loss)
    from recam.infra.reward_runner import FailurePolicy

    s, t, a = config.sample, config.train, config.advantage
    _require(num_processes >= 1, f"num_processes must be >= 1, got {num_processes}")
    _require(config.domain in known_domains(), f"domain={config.domain!r} unknown; use one of {sorted(DOMAINS)}")
    if config.expected_num_processes:
        _require(
            config.expected_num_processes == num_processes,
            f"expected_num_processes={config.expected_num_processes} but {num_processes} processes were "
            "launched; launch that many or set --config.expected_num_processes=0",
        )
    for field in ("sample.batch_size", "sample.k", "sample.num_batches_per_epoch", "sample.num_steps",
                  "train.batch_size", "num_epochs", "train.num_inner_epochs"):
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
    _require(0 < t.timestep_fraction <= 1, f"train.timestep_fraction must be in (0, 1], got {t.timestep_fraction}")
    _require(t.clip_range > 0, f"train.clip_range must be > 0, got {t.clip_range}")
    _require(t.log_ratio_clamp > 0, f"train.log_ratio_clamp must be > 0, got {t.log_ratio_clamp}")
    _require(t.beta >= 0, f"train.beta must be >= 0, got {t.beta}")
    _require(t.learning_rate > 0, f"train.learning_rate must be > 0, got {t.learning_rate}")
    _require(0 < t.ema_decay < 1, f"train.ema_decay must be in (0, 1), got {t.ema_decay}")
    _require(t.policy_loss in POLICY_LOSSES,
             f"train.policy_loss={t.policy_loss!r} is not registered; known: {sorted(POLICY_LOSSES)}")
    _require(t.kl_type in KL_ESTIMATORS, f"train.kl_type={t.kl_type!r} unknown; use one of {sorted(KL_ESTIMATORS)}")
    _require(t.objective in OBJECTIVES, f"train.objective={t.objective!r} unknown; use one of {sorted(OBJECTIVES)}")
    switched_on = [f for f in VARIANT_SWITCHES if t[f]]
    readers = sorted(n for n, fn in POLICY_LOSSES.items() if getattr(fn, "reads_variants", False))
    _require(not switched_on or t.policy_loss in readers,
             f"train.{switched_on[0] if switched_on else ''} needs train.policy_loss in {readers}, "
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
    _require(a.std_mode in STD_MODES, f"advantage.std_mode must be one of {list(STD_MODES)}, got {a.std_mode!r}")
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
    _require(all(w >= 0 for w in weights.values()) and sum(weights.values()) > 0,
             f"reward.weights must be non-negative with a positive sum, got {weights}")
    _require(config.eval.select_max_drop >= 0, f"eval.select_max_drop must be >= 0, got {config.eval.select_max_drop}")
    policies = [p.value for p in FailurePolicy]
    _require(config.reward.failure_policy in policies,
             f"reward.failure_policy must be one of {policies}, got {config.reward.failure_policy!r}")
    _require(config.reward.async_workers >= 1, f"reward.async_workers must be >= 1, got {config.reward.async_workers}")
    conds_per_batch = per_batch // s.k
    # a domain names its own rewards, data and model, and checks them (its `check_config`)
    check = getattr(DOMAINS[config.domain], "check_config", None)
    if check is not None:
        check(config, conds_per_batch, _require)
    r = config.reward
    if r.constraint:
        _require(weights.get(r.constraint, 0) > 0,
                 f"reward.constraint={r.constraint!r} must name a reward of positive weight in reward.weights "
                 f"{weights}: its weight is where the multiplier starts")
        _require(any(w > 0 for k, w in weights.items() if k != r.constraint),
                 f"reward.constraint={r.constraint!r} needs another reward of positive weight to maximise; "
                 f"reward.weights is {weights} (--config.reward.constraint='' switches the constraint off)")
        for field in ("constraint_slack", "constraint_lr", "constraint_max_weight"):
            _require(r[field] >= 0, f"reward.{field} must be >= 0, got {r[field]}")
    return derived_numbers(config, num_processes)


def validate_camera(config: ml_collections.ConfigDict, conds_per_batch: int) -> None:
    """The camera domain's checks: the flow-matching sampler, its registered rewards (rewards.REWARDS), the video
    data and the transformer checkpoint's format."""
    from recam.engine.scheduler import FLOW_STEPS
    from rewards import known_rewards

    weights = dict(config.reward.weights)

    s = config.sample
    for field in ("data.num_frames", "data.size"):
        section, name = field.split(".")
        _require(isinstance(config[section][name], int) and config[section][name] >= 1,
                 f"{field} must be a positive integer, got {config[section][name]!r}")
    _require(s.sde_type in FLOW_STEPS, f"sample.sde_type must be one of {sorted(FLOW_STEPS)}, got {s.sde_type!r}")
    _require(s.noise_level > 0, f"sample.noise_level must be > 0 for a stochastic policy, got {s.noise_level}")
    unknown = sorted(set(weights) - set(known_rewards()))
    _require(not unknown, f"reward.weights names unknown rewards {unknown}; known: {sorted(known_rewards())}")
    unknown = sorted(set(eval_report_rewards(config)) - set(known_rewards()))
    _require(not unknown, f"eval.report_rewards names unknown rewards {unknown}; known: {sorted(known_rewards())}")
    e = config.eval
    scored_at_eval = {k for k, w in weights.items() if w > 0} | set(eval_report_rewards(config))
    for field in ("select_by", "select_guard"):  # real data has no validation split: there the last epoch reports
        _require(e[field] == "" or e[field] in scored_at_eval or config.data.source != "synthetic",
                 f"eval.{field}={e[field]!r} must be '' or a reward scored at evaluation (a positive reward.weights "
                 f"entry or one in eval.report_rewards): {sorted(scored_at_eval)}")
    _require(not e.select_by or config.data.source != "synthetic" or config.data.num_val_conditions >= 1,
             f"eval.select_by={e.select_by!r} needs validation conditions: data.num_val_conditions must be >= 1, "
             f"got {config.data.num_val_conditions}")
    d, m = config.data, config.model
    _require(d.source in DATA_SOURCES, f"data.source={d.source!r} unknown; use one of {list(DATA_SOURCES)}")
    _require(m.format in MODEL_FORMATS, f"model.format={m.format!r} unknown; use one of {list(MODEL_FORMATS)}")
    _require(m.dtype in MODEL_DTYPES, f"model.dtype={m.dtype!r} unknown; use one of {list(MODEL_DTYPES)}")
    _require(m.dtype == "float32" or m.lora_rank > 0,
             f"model.dtype={m.dtype!r} keeps the loaded weights in half precision, which only a LoRA adapter (fp32) "
             "may train: set model.lora_rank > 0 or model.dtype='float32'")
    _require(m.dtype == "float32" or config.mixed_precision == "bf16",
             f"model.dtype={m.dtype!r} needs mixed_precision='bf16' (the model does not cast its inputs), got "
             f"{config.mixed_precision!r}")
    if d.source == "synthetic":
        _require(
            d.num_train_conditions >= conds_per_batch,
            f"data.num_train_conditions={d.num_train_conditions} is smaller than the "
            f"{conds_per_batch} unique conditions one sampling batch needs",
        )
    else:
        _require(isinstance(d.root, str) and d.root != "",
                 "data.source='recammaster' needs data.root, the folder holding the scene folders")
        for field in ("height", "width", "frame_interval", "num_heldout_scenes"):
            _require(isinstance(d[field], int) and d[field] >= 1,
                     f"data.{field} must be a positive integer, got {d[field]!r}")
        for field in ("num_train_conditions", "num_heldout_conditions", "cache_size"):
            _require(isinstance(d[field], int) and d[field] >= 0,
                     f"data.{field} must be an integer >= 0, got {d[field]!r}")
        _require(d.num_train_conditions == 0 or d.num_train_conditions >= conds_per_batch,
                 f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conds_per_batch} unique "
                 "conditions one sampling batch needs (0 = every condition)")
        for name in LANDMARK_REWARDS:
            _require(weights.get(name, 0) == 0,
                     f"reward.weights.{name}={weights.get(name)} needs the synthetic world's landmarks, which real "
                     f"data (data.source='recammaster') does not have: set --config.reward.weights.{name}=0 and "
                     "score with fidelity / unifiedscore / discriminator")
            _require(name not in eval_report_rewards(config),
                     f"eval.report_rewards names {name!r}, which needs the synthetic world's landmarks that real data "
                     "(data.source='recammaster') does not have; drop it from eval.report_rewards")


def _transformer_config_file(config: ml_collections.ConfigDict) -> Path | None:
    folder = Path(config.model.pretrained)
    if config.model.format == "wan_diffusers" and not (folder / "config.json").is_file():
        folder = folder / "transformer"  # a whole -Diffusers pipeline folder
    return folder / "config.json" if folder.is_dir() else None


def _diffsynth_in_channels(path: Path) -> int | None:
    """Input channels of a DiffSynth-layout checkpoint file, read from patch_embedding's shape without loading the
    weights (safetensors header, or a memory-mapped torch file); None when that is not possible (folders, legacy
    torch files): the trainer then checks right after loading."""
    import torch

    key = "patch_embedding.weight"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                return int(f.get_slice(key).get_shape()[1]) if key in f.keys() else None
        if path.suffix in (".ckpt", ".pt", ".pth", ".bin"):
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            for wrapper in ("state_dict", "module"):
                if isinstance(state, dict) and set(state) == {wrapper}:
                    state = state[wrapper]
            return int(state[key].shape[1]) if key in state else None
    except Exception:  # unreadable here (legacy torch format, pickled objects): the loader will say what is wrong
        return None
    return None


def _vae_config(path: str) -> dict:
    folder = Path(path)
    if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    _require((folder / "config.json").is_file(), f"model.vae={path!r}: no config.json in {folder} (nor in a vae/ "
             "subfolder); point it at the Wan VAE folder or the -Diffusers pipeline folder")
    return json.loads((folder / "config.json").read_text())


def latent_channels(config: ml_collections.ConfigDict) -> int:
    """Channels of the space the policy samples in: 3 for pixels, the VAE's z_dim for latents."""
    return 3 if not config.model.vae else int(_vae_config(config.model.vae)["z_dim"])


def check_in_channels(in_channels: int, config: ml_collections.ConfigDict) -> None:
    """The transformer must take the codec's channels; the message carries both numbers."""
    channels = latent_channels(config)
    space = f"the latents of model.vae={config.model.vae!r}" if config.model.vae else "pixel space (model.vae='')"
    _require(in_channels == channels,
             f"model.pretrained={config.model.pretrained!r} has in_channels={in_channels} but {space} has "
             f"{channels} channels; use a model and a model.vae that belong together")


def validate_files(config: ml_collections.ConfigDict) -> None:
    """The checks that read the filesystem (paths, config.json headers; never weights), run by the trainer right
    after `validate` and before any model is built. Kept apart so presets for other machines validate anywhere.
    A domain whose model or data live in files checks them (its `check_files`)."""
    from recam.engine.domain import DOMAINS, known_domains

    if config.domain in known_domains() and hasattr(DOMAINS[config.domain], "check_files"):
        DOMAINS[config.domain].check_files(config)


def validate_camera_files(config: ml_collections.ConfigDict) -> None:
    """The camera domain's files: data.root, model.pretrained, the VAE's config and the channels they imply."""
    d, m = config.data, config.model
    if d.source == "recammaster":
        _require(Path(d.root).is_dir(), f"data.root={d.root!r} is not a folder (data.source='recammaster')")
    _require(Path(m.pretrained).exists(), f"model.pretrained={m.pretrained!r} does not exist "
             f"(model.format={m.format!r})")
    if m.vae:
        vae = _vae_config(m.vae)
        t, sp = vae.get("scale_factor_temporal") or 4, vae.get("scale_factor_spatial") or 8
        h, w = (d.height, d.width) if d.source == "recammaster" else (d.size, d.size)
        _require((d.num_frames - 1) % t == 0,
                 f"data.num_frames={d.num_frames} must be 1 + {t}k for the Wan VAE (model.vae={m.vae!r})")
        _require(h % sp == 0 and w % sp == 0,
                 f"frame size {h}x{w} (data.{'height/width' if d.source == 'recammaster' else 'size'}) must be "
                 f"divisible by the Wan VAE's spatial factor {sp}")
    if m.format == "recammaster_diffsynth":
        in_channels = _diffsynth_in_channels(Path(m.pretrained))
    else:
        config_file = _transformer_config_file(config)
        _require(config_file is not None and config_file.is_file(),
                 f"model.pretrained={m.pretrained!r}: no config.json there (model.format={m.format!r})")
        in_channels = json.loads(config_file.read_text()).get("in_channels")
    if in_channels is not None:
        check_in_channels(int(in_channels), config)
