"""Config validation that runs before any model is built, and the derived numbers of a run.

Every error names the config field(s) at fault and says what would fix them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_collections

from recam.engine.plan import RunNumbers, StepPlan, latest_window_start, trained_steps


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _get(config: ml_collections.ConfigDict, field: str):
    node = config
    for part in field.split("."):
        node = node[part]
    return node


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"{'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_int(config, field: str, low: int | None = None, high: int | None = None, why: str = "") -> None:
    """`field` must be an integer in [low, high] (None: unbounded); the message names the field and the range."""
    value = _get(config, field)
    ok = _is_int(value) and (low is None or value >= low) and (high is None or value <= high)
    rng = "" if low is None and high is None else " " + _interval(low, high, False, False)
    _require(ok, f"{field} must be an integer{rng}, got {value!r}" + (f" ({why})" if why else ""))


def check_number(config, field: str, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False, allow_inf: bool = False, why: str = "") -> None:
    """`field` must be a number in the interval (open or closed ends), finite unless `allow_inf`."""
    value = _get(config, field)
    ok = _is_number(value) and (allow_inf or math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    rng = _interval(low, high, low_open, high_open)
    _require(ok, f"{field} must be a {'' if allow_inf else 'finite '}number {rng}, got {value!r}"
             + (f" ({why})" if why else ""))


def check_choice(config, field: str, choices) -> None:
    value = _get(config, field)
    _require(value in tuple(choices), f"{field}={value!r} unknown; use one of {list(choices)}")


def check_bool(config, fields) -> None:
    for field in fields:
        value = _get(config, field)
        _require(isinstance(value, bool), f"{field} must be True or False, got {value!r}")


def check_nonempty_str(config, field: str, why: str = "") -> None:
    value = _get(config, field)
    _require(isinstance(value, str) and value.strip() != "",
             f"{field} must be a non-empty string, got {value!r}" + (f" ({why})" if why else ""))


class FieldChecks:
    """The checks above bound to one config, handed to a reward's `check` (rewards.register_reward): a reward states
    the ranges of its own config section in its module, and that module needs no import of config/."""

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config

    def require(self, cond: bool, msg: str) -> None:
        _require(cond, msg)

    def integer(self, field: str, low: int | None = None, high: int | None = None, why: str = "") -> None:
        check_int(self.config, field, low, high, why)

    def number(self, field: str, low: float | None = None, high: float | None = None, low_open: bool = False,
               high_open: bool = False, allow_inf: bool = False, why: str = "") -> None:
        check_number(self.config, field, low, high, low_open, high_open, allow_inf, why)

    def choice(self, field: str, choices) -> None:
        check_choice(self.config, field, choices)

    def boolean(self, *fields: str) -> None:
        check_bool(self.config, fields)

    def nonempty_str(self, field: str, why: str = "") -> None:
        check_nonempty_str(self.config, field, why)

    def url(self, field: str) -> None:
        value = _get(self.config, field)
        _require(isinstance(value, str) and value.startswith(("http://", "https://")),
                 f"{field} must start with http:// or https://, got {value!r}")


# (field, low, high, why): integers every domain reads (config/base.py states each range).
INT_FIELDS = (
    ("seed", 0, 2**32 - 1, "numpy seeds are 0 .. 2**32 - 1"),
    ("expected_num_processes", 0, None, "0 = accept whatever is launched"),
    ("save_freq", 1, None, "a checkpoint every N epochs"),
    ("keep_checkpoints", 0, None, "0 = keep every epoch checkpoint"),
    ("num_threads", 0, None, "0 = torch's default"),
    ("data.num_train_conditions", 0, None, ""),
    ("data.num_heldout_conditions", 0, None, ""),
    ("data.num_val_conditions", 0, None, ""),
    ("eval.num_train_conditions", 0, None, "0 = no evaluation on training conditions"),
    ("data.seed", 0, 2**32 - 1, ""),
    ("model.lora_rank", 0, None, "0 = full fine-tuning"),
    ("sample.eval_num_steps", 1, None, "ODE steps of held-out evaluation"),
    ("train.gradient_weighting_num_probes", 0, None, "0 = exact per-sample gradients, P > 0 = P probes"),
    ("sample.window_size", 0, None, "0 = the first round(train.timestep_fraction x num_steps) steps"),
    ("sample.window_start", 0, None, "a scheduler step"),
    ("sample.window_max_start", -1, None, "a scheduler step, or -1 = the latest that fits"),
    ("sample.window_shift_every", 1, None, "epochs per one-step shift of a progressive window"),
    ("sample.noise_frequencies", 0, None, "0 = noise in every element"),
    ("sample.noise_channels", 0, None, "0 = noise in every channel"),
    ("train.fp_num_timesteps", 1, None, "re-noised timesteps per final sample per pass"),
    ("reward.max_retries", 0, None, ""),
    ("eval.freq", 1, None, "evaluate every N epochs"),
    ("eval.seed", 0, 2**32 - 1, ""),
    ("eval.batch_size", 1, None, "conditions per evaluation forward"),
    ("eval.num_videos", 0, None, "0 = write no examples"),
    ("health.max_rollbacks", 0, None, ""),
    ("debug.inject_blowup_at_step", None, None, "negative = off"),
    ("debug.sigkill_at_step", None, None, "negative = off"),
)
# (field, low, high, low_open, high_open, allow_inf): numbers every domain reads.
NUMBER_FIELDS = (
    ("model.lora_alpha", 0, None, True, False, False),
    ("train.learning_rate", 0, None, True, False, False),
    ("train.adam_beta1", 0, 1, False, True, False),
    ("train.adam_beta2", 0, 1, False, True, False),
    ("train.adam_weight_decay", 0, None, False, False, False),
    ("train.adam_epsilon", 0, None, True, False, False),
    ("train.max_grad_norm", 0, None, True, False, True),
    ("train.timestep_fraction", 0, 1, True, False, False),
    ("train.clip_range", 0, None, True, False, False),
    ("train.adv_clip_max", 0, None, True, False, True),
    ("train.log_ratio_clamp", 0, None, True, False, True),
    ("train.beta", 0, None, False, False, False),
    ("train.ema_decay", 0, 1, True, True, False),
    ("train.ema_beta", 0, 1, True, False, False),
    ("train.gradient_weighting_temperature", 0, None, True, False, True),
    ("train.ptrw_sigma", 0, None, True, False, False),
    ("train.temporal_decay_gamma", 0, 1, True, False, False),
    ("train.clip_ratio_pos", 0, None, True, False, False),
    ("train.clip_ratio_neg", 0, None, True, False, False),
    ("reward.constraint_slack", 0, None, False, False, False),
    ("reward.constraint_lr", 0, None, False, False, False),
    ("reward.constraint_max_weight", 0, None, False, False, False),
    ("reward.retry_backoff_s", 0, None, False, False, False),
    ("eval.select_max_drop", 0, None, False, False, False),
    ("health.rollback_lr_factor", 0, 1, True, False, False),
    ("train.old_policy_decay", 0, 1, False, True, False),
    ("train.old_policy_decay_ramp", 0, None, False, False, False),
    ("train.fp_min_noise", 0, 1, True, True, False),
    ("train.fp_max_noise", 0, 1, True, True, False),
    ("train.nft_beta", 0, None, True, False, False),
    ("train.awm_adv_scale", 0, None, True, False, False),
    ("train.awm_clip_range", 0, None, True, False, False),
    ("train.awm_old_kl_weight", 0, None, False, False, False),
    ("eval.every_seconds", 0, None, False, False, False),
    ("max_train_seconds", 0, None, False, False, False),
)
BOOL_FIELDS = ("resume", "model.gradient_checkpointing", "train.ema", "train.use_ema_smoothing",
               "train.use_gradient_adaptive_weighting", "train.use_amic", "train.use_gspo", "train.use_ptrw",
               "train.use_temporal_decay", "train.temporal_decay_normalize", "train.use_asymmetric_clipping",
               "advantage.filter_zero_std", "train.guard_dt_weighting",
               "sample.same_initial_noise", "train.log_gradient_cosine")

# Free-form strings ('' allowed); their contents are checked where they are read (domains, validate_files).
STR_FIELDS = ("data.root", "model.vae", "model.lora_targets", "eval.report_rewards", "eval.select_by",
              "eval.select_guard", "reward.constraint", "debug.fail_reward_slots", "plugins")


def fail_reward_slots(config: ml_collections.ConfigDict, num_processes: int) -> tuple[int, ...]:
    """debug.fail_reward_slots parsed: each slot an integer in [0, num_processes x sample.batch_size)."""
    raw, n = config.debug.fail_reward_slots, num_processes * config.sample.batch_size
    _require(isinstance(raw, str), f"debug.fail_reward_slots must be a string like '5,6', got {raw!r}")
    parts = [x.strip() for x in raw.split(",") if x.strip()]
    slots = tuple(int(x) for x in parts if x.lstrip("-").isdigit())
    _require(len(slots) == len(parts) and all(0 <= x < n for x in slots),
             f"debug.fail_reward_slots={raw!r} must be comma-separated integers in [0, {n}) (num_processes x "
             f"sample.batch_size = {num_processes} x {config.sample.batch_size}), or '' for none")
    return slots


DATA_SOURCES = ("synthetic", "recammaster")
MODEL_FORMATS = ("recam", "wan_diffusers", "recammaster_diffsynth")
MODEL_DTYPES = ("float32", "bfloat16")
# cam_score's estimator that reads the synthetic world's landmarks: real data has none (recam/domains/camera/data.py).
LANDMARK_ESTIMATOR = "landmarks"


def eval_report_rewards(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """Rewards scored at evaluation besides the weighted ones (eval.report_rewards, comma-separated)."""
    return tuple(n.strip() for n in config.eval.report_rewards.split(",") if n.strip())


def check_rewards(config: ml_collections.ConfigDict, domain_cls) -> None:
    """Every reward in reward.weights and eval.report_rewards is registered as scoring the samples the domain
    (`domain_cls`, the class registered as config.domain) produces, its sample_kind; and the settings of every reward
    of that kind are in range (each reward's `check`). The registry is the one source: a reward of another domain,
    or a name nothing registers, is refused here rather than when the run first scores."""
    from rewards import known_rewards, reward_checks, reward_kind

    domain = config.domain
    kind = getattr(domain_cls, "sample_kind", None)
    _require(isinstance(kind, str) and kind != "",
             f"domain={domain!r} declares no sample_kind: its class must name the kind of sample its decode returns "
             "(e.g. sample_kind = 'video'), which decides the rewards that can score it")
    scorable = known_rewards(kind)
    instead = (f"use one of the rewards that score {kind} instead, {scorable}" if scorable else
               f"no registered reward scores {kind} samples (rewards.register_reward(..., scores={kind!r}))")
    named = [(f"reward.weights.{name}", name) for name in config.reward.weights]
    named += [(f"eval.report_rewards names {name!r}, which", name) for name in eval_report_rewards(config)]
    for subject, name in named:
        if name in scorable:
            continue
        other = reward_kind(name)
        what = (f"scores {other} samples, but domain {domain!r} produces {kind}" if other is not None else
                "is not a registered reward (your own rewards register in a module named by --config.plugins), and "
                f"domain {domain!r} produces {kind}")
        _require(False, f"{subject} {what}: {instead}")
    for check in reward_checks(kind):
        check(FieldChecks(config))


def derived_numbers(config: ml_collections.ConfigDict, num_processes: int) -> RunNumbers:
    """Numbers every reader of a run needs, computed once: samples and unique conditions per batch/epoch, the
    trained steps and window."""
    s, plan = config.sample, step_plan(config)
    per_batch = num_processes * s.batch_size
    return RunNumbers(num_processes=num_processes, per_device_batch=s.batch_size, k=s.k,
                      num_batches_per_epoch=s.num_batches_per_epoch, samples_per_batch=per_batch,
                      conditions_per_batch=per_batch // s.k, samples_per_epoch=per_batch * s.num_batches_per_epoch,
                      unique_conditions_per_epoch=per_batch * s.num_batches_per_epoch // s.k,
                      num_train_timesteps=max(1, plan.trained_steps), plan=plan)


def step_plan(config: ml_collections.ConfigDict) -> StepPlan:
    """The run's trained steps and window (recam.engine.rollout.StepPlan), from sample.* and train.*."""
    from recam.engine.objective import objective_needs

    s = config.sample
    return StepPlan(trained_steps(objective_needs(config.train.objective, "needs_log_probs"), s.num_steps,
                                  s.window_size, config.train.timestep_fraction),
                    s.window_size, s.window_mode, s.window_start,
                    latest_window_start(s.num_steps, s.window_size, s.window_max_start), s.window_shift_every)


def scheduler_is_flow(domain: str) -> bool | None:
    """Whether a registered domain samples with a flow-matching scheduler, read from the return annotation of its
    `scheduler` method (the scheduler class's is_flow); None when the annotation does not say."""
    import typing

    from recam.engine.domain import domain_class

    try:
        hint = typing.get_type_hints(domain_class(domain).scheduler).get("return")
    except Exception:  # noqa: BLE001 - a factory or an unresolvable annotation: the trainer checks at build time
        return None
    flow = getattr(hint, "is_flow", None)
    return flow if isinstance(flow, bool) else None


FP_TIMESTEP_SAMPLING = ("stratified", "uniform")
FLOW_ONLY_OBJECTIVES = ("grpo_guard",)  # GRPO-Guard's RatioNorm is derived for the flow SDE's transition


def check_window_and_objective(config: ml_collections.ConfigDict) -> None:
    """The stochastic window, the deterministic solver, and the objectives' own fields (ranges are in the tables
    above)."""
    from recam.engine.objective import objective_needs
    from recam.engine.rollout import ODE_SOLVERS, SOLVER_SCOPES, WINDOW_MODES

    s, t = config.sample, config.train
    check_choice(config, "sample.window_mode", WINDOW_MODES)
    check_choice(config, "sample.ode_solver", ODE_SOLVERS)
    check_choice(config, "sample.ode_solver_scope", SOLVER_SCOPES)
    check_number(config, "sample.post_window_compress", 0, 1, low_open=True)
    check_choice(config, "train.fp_timestep_sampling", FP_TIMESTEP_SAMPLING)
    _require(t.fp_min_noise < t.fp_max_noise,
             f"train.fp_min_noise={t.fp_min_noise} must be below train.fp_max_noise={t.fp_max_noise}")
    flow = scheduler_is_flow(config.domain)
    _require(s.ode_solver != "dpm2" or flow is not False,
             f"sample.ode_solver='dpm2' is a flow-matching solver; domain {config.domain!r} samples with DDIM: use "
             "'euler' (its deterministic DDIM step)")
    _require(s.post_window_compress == 1.0 or (flow is not False and objective_needs(t.objective, "needs_log_probs")
                                               and s.window_size > 0),
             f"sample.post_window_compress={s.post_window_compress} compresses the flow-matching grid after a "
             "stochastic window: it needs a flow domain, an objective with log-probs and sample.window_size > 0, or "
             "set it to 1")
    _require(t.objective not in FLOW_ONLY_OBJECTIVES or flow is not False,
             f"train.objective={t.objective!r} needs a flow-matching scheduler; domain {config.domain!r} samples "
             "with DDIM")
    _require(s.noise_frequencies == 0 or objective_needs(t.objective, "needs_log_probs"),
             f"sample.noise_frequencies={s.noise_frequencies} shapes the noise of the trained stochastic steps; "
             f"train.objective={t.objective!r} samples without them: set it to 0")
    _require(s.noise_channels == 0 or s.noise_frequencies > 0,
             f"sample.noise_channels={s.noise_channels} restricts the noise of a cosine subspace along the frames: set "
             "sample.noise_frequencies > 0 as well")
    _require(s.noise_frequencies == 0 or not t.use_gradient_adaptive_weighting,
             f"sample.noise_frequencies={s.noise_frequencies} gives a log-prob over cosine components, and "
             "train.use_gradient_adaptive_weighting's gradient norms assume noise in every element: switch one off")
    # a sampled KL estimate is log p - log p_ref at the stored draw, written for noise in every element; a draw
    # confined to a subspace tells nothing about the means' gap outside it (measured k3 0.0074 against the
    # closed form's 0.045), while the closed form keeps the whole mean near the reference's
    _require(s.noise_frequencies == 0 or t.beta == 0 or t.kl_type == "gaussian_mean",
             f"train.kl_type={t.kl_type!r} estimates the KL from a draw with noise in every element, and "
             f"sample.noise_frequencies={s.noise_frequencies} draws it in a subspace: use "
             "train.kl_type='gaussian_mean'")
    if s.window_size == 0:
        return
    # the last step is never trained (num_train_timesteps): its transition to clean data is too peaked
    last = s.num_steps - 1
    if s.window_mode == "fixed":
        _require(s.window_start + s.window_size <= last,
                 f"sample.window_start={s.window_start} + sample.window_size={s.window_size} must be <= "
                 f"sample.num_steps - 1 = {last}: the window may not reach the last step")
    elif s.window_max_start == -1:
        _require(s.window_size <= last,
                 f"sample.window_size={s.window_size} must be <= sample.num_steps - 1 = {last}: the window may not "
                 "reach the last step")
    else:
        _require(s.window_max_start + s.window_size <= last,
                 f"sample.window_max_start={s.window_max_start} + sample.window_size={s.window_size} must be <= "
                 f"sample.num_steps - 1 = {last}: the latest window may not reach the last step")
    if s.window_mode == "progressive":
        latest = latest_window_start(s.num_steps, s.window_size, s.window_max_start)
        _require(s.window_start <= latest,
                 f"sample.window_start={s.window_start} must be <= sample.window_max_start={s.window_max_start} "
                 f"(here {latest}; a progressive window slides from the one to the other)")


def validate(config: ml_collections.ConfigDict, num_processes: int) -> RunNumbers:
    """Check `config` for a launch with `num_processes` processes; return `derived_numbers`.

    Every numeric field's range and every choice field's membership is checked here (fields every domain reads)
    or in the domain's `check_config` (its own fields); each error is one line naming the field and what it
    may be."""
    from recam.engine.advantages import STD_MODES
    from recam.engine.domain import domain_class, known_domains
    from recam.engine.losses import KL_ESTIMATORS, POLICY_LOSSES
    from recam.engine.objective import OBJECTIVES, STEP_WEIGHTINGS, known_objectives
    from recam.engine.reward_runner import FailurePolicy
    from recam.engine.variants import VARIANT_SWITCHES  # (importing it registers the "grpo_variants" policy loss)

    s, t, a = config.sample, config.train, config.advantage
    _require(_is_int(num_processes) and num_processes >= 1, f"num_processes must be >= 1, got {num_processes}")
    _require(config.domain in known_domains(), f"domain={config.domain!r} unknown; use one of {known_domains()}")
    check_nonempty_str(config, "run_name")
    check_nonempty_str(config, "run_dir", "where checkpoints and logs go")
    check_nonempty_str(config, "logging.wandb_project")
    for field in ("sample.batch_size", "sample.k", "sample.num_batches_per_epoch", "sample.num_steps",
                  "train.batch_size", "num_epochs", "train.num_inner_epochs", "train.gradient_accumulation_steps"):
        value = _get(config, field)
        _require(_is_int(value) and value >= 1, f"{field} must be a positive integer, got {value!r}")
    for field, low, high, why in INT_FIELDS:
        check_int(config, field, low, high, why)
    for field, low, high, low_open, high_open, allow_inf in NUMBER_FIELDS:
        check_number(config, field, low, high, low_open, high_open, allow_inf)
    check_bool(config, BOOL_FIELDS)
    for field in STR_FIELDS:
        _require(isinstance(_get(config, field), str), f"{field} must be a string, got {_get(config, field)!r}")
    check_number(config, "advantage.eps", 0, None, low_open=True,
                 why="it is added to the std that divides the centred rewards: 0 divides equal-reward groups by "
                 "zero, a negative eps inverts the sign of every advantage whose group std is below -eps; "
                 "Flow-GRPO uses 1e-4")
    if config.expected_num_processes:
        _require(
            config.expected_num_processes == num_processes,
            f"expected_num_processes={config.expected_num_processes} but {num_processes} processes were "
            "launched; launch that many or set --config.expected_num_processes=0",
        )
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
    _require(t.policy_loss in POLICY_LOSSES,
             f"train.policy_loss={t.policy_loss!r} is not registered; known: {sorted(POLICY_LOSSES)}")
    _require(t.kl_type in KL_ESTIMATORS, f"train.kl_type={t.kl_type!r} unknown; use one of {sorted(KL_ESTIMATORS)}")
    _require(t.step_weighting in STEP_WEIGHTINGS,
             f"train.step_weighting={t.step_weighting!r} unknown; use one of {list(STEP_WEIGHTINGS)}")
    _require(t.step_weighting == "uniform" or t.objective == "grpo",
             f"train.step_weighting={t.step_weighting!r} weights GRPO's log-prob steps; train.objective="
             f"{t.objective!r} has its own weighting: set train.step_weighting='uniform' or train.objective='grpo'")
    _require(t.objective in known_objectives(),
             f"train.objective={t.objective!r} unknown; use one of {sorted(OBJECTIVES)}")
    check_window_and_objective(config)
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
    _require(a.std_mode in STD_MODES, f"advantage.std_mode must be one of {list(STD_MODES)}, got {a.std_mode!r}")
    _require(config.mixed_precision in ("no", "fp16", "bf16"),
             f"mixed_precision must be 'no', 'fp16' or 'bf16', got {config.mixed_precision!r}")
    _require(config.logging.wandb_mode in ("offline", "online", "disabled"),
             f"logging.wandb_mode must be offline/online/disabled, got {config.logging.wandb_mode!r}")
    _require(config.health.action in ("warn", "stop", "rollback"),
             f"health.action must be 'warn', 'stop' or 'rollback', got {config.health.action!r}")
    weights = dict(config.reward.weights)
    _require(len(weights) > 0, "reward.weights is empty: name at least one reward")
    for name, w in weights.items():
        _require(_is_number(w) and math.isfinite(w) and w >= 0,
                 f"reward.weights.{name} must be a finite number >= 0 (0 = not computed), got {w!r}")
    _require(sum(weights.values()) > 0,
             f"reward.weights must have a positive sum: set at least one weight > 0, got {weights}")
    policies = [p.value for p in FailurePolicy]
    _require(config.reward.failure_policy in policies,
             f"reward.failure_policy must be one of {policies}, got {config.reward.failure_policy!r}")
    check_int(config, "reward.async_workers", 1)
    fail_reward_slots(config, num_processes)
    conds_per_batch = per_batch // s.k
    # a domain names its own rewards, data and model, and checks them (its `check_config`)
    check = getattr(domain_class(config.domain), "check_config", None)
    if check is not None:
        check(config, conds_per_batch, _require)
    check_rewards(config, domain_class(config.domain))
    r = config.reward
    _require(isinstance(r.constraint, str), f"reward.constraint must be '' or a reward name, got {r.constraint!r}")
    if r.constraint:
        _require(weights.get(r.constraint, 0) > 0,
                 f"reward.constraint={r.constraint!r} must name a reward of positive weight in reward.weights "
                 f"{weights}: its weight is where the multiplier starts")
        _require(any(w > 0 for k, w in weights.items() if k != r.constraint),
                 f"reward.constraint={r.constraint!r} needs another reward of positive weight to maximise; "
                 f"reward.weights is {weights} (--config.reward.constraint='' switches the constraint off)")
    return derived_numbers(config, num_processes)


def validate_camera(config: ml_collections.ConfigDict, conds_per_batch: int) -> None:
    """The camera domain's checks: the flow-matching sampler, the video data and the transformer checkpoint's
    format (its rewards' names and settings: check_rewards)."""
    from recam.engine.scheduler import FLOW_NOISE_RANGE, FLOW_STEPS

    weights = dict(config.reward.weights)

    s = config.sample
    for field in ("data.num_frames", "data.size", "data.conditions_per_scene", "data.height", "data.width",
                  "data.frame_interval", "data.num_heldout_scenes"):
        value = _get(config, field)
        _require(_is_int(value) and value >= 1, f"{field} must be a positive integer, got {value!r}")
    check_int(config, "data.cache_size", 0, why="decoded conditions kept per process")
    _require(isinstance(config.data.source_cams, str),
             f"data.source_cams must be a comma-separated string like 'cam01,cam02', got {config.data.source_cams!r}")
    check_nonempty_str(config, "model.pretrained")
    _require(s.sde_type in FLOW_STEPS, f"sample.sde_type must be one of {sorted(FLOW_STEPS)}, got {s.sde_type!r}")
    check_number(config, "sample.shift", 0, None, low_open=True, why="sigma schedule time shift; 1 = linear sigmas")
    low, high, why = FLOW_NOISE_RANGE[s.sde_type]
    check_number(config, "sample.noise_level", low, high, low_open=True, why=f"sample.sde_type={s.sde_type!r}: {why}")
    check_number(config, "data.hfov_deg", 0, 180, high_open=True, why="0 = fx = W")
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
        _require(d.num_heldout_conditions >= 1,
                 f"data.num_heldout_conditions must be >= 1 (the held-out evaluation), got {d.num_heldout_conditions}")
    else:
        _require(isinstance(d.root, str) and d.root != "",
                 "data.source='recammaster' needs data.root, the folder holding the scene folders")
        _require(d.num_train_conditions == 0 or d.num_train_conditions >= conds_per_batch,
                 f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conds_per_batch} unique "
                 "conditions one sampling batch needs (0 = every condition)")
        uses_cam = weights.get("cam_score", 0) > 0 or "cam_score" in eval_report_rewards(config)
        _require(not uses_cam or config.reward.cam.estimator != LANDMARK_ESTIMATOR,
                 f"reward.cam.estimator={LANDMARK_ESTIMATOR!r} needs the synthetic world's landmarks, which real data "
                 "(data.source='recammaster') does not have: set --config.reward.cam.estimator=sfm (or served)")


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
    from recam.engine.domain import domain_class, known_domains

    if config.domain in known_domains() and hasattr(domain_class(config.domain), "check_files"):
        domain_class(config.domain).check_files(config)


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
        model_config = json.loads(config_file.read_text())
        in_channels = model_config.get("in_channels")
        check_sample_shape(model_config, config)
        check_trained_sample(config_file.parent / "provenance.json", config)
    if in_channels is not None:
        check_in_channels(int(in_channels), config)


def check_trained_sample(provenance: Path, config: ml_collections.ConfigDict) -> None:
    """Synthetic frames of the size the base was pretrained at (provenance.json's trained_sample, written by
    scripts/pretrain_base.py): a ReCam-Tiny base asked for other sizes runs, but on frames it never learned."""
    d = config.data
    if d.source != "synthetic" or config.model.vae or not provenance.is_file():
        return
    try:
        trained = json.loads(provenance.read_text()).get("trained_sample") or {}
    except (OSError, json.JSONDecodeError):
        return
    for field, value in (("size", d.size), ("num_frames", d.num_frames)):
        if field in trained:
            _require(value == trained[field], f"data.{field}={value} but model.pretrained={config.model.pretrained!r} "
                     f"was pretrained on synthetic samples with {field} {trained[field]} ({provenance}); set "
                     f"--config.data.{field}={trained[field]} or pretrain a base at that size")


def check_sample_shape(model_config: dict, config: ml_collections.ConfigDict) -> None:
    """The frames the data gives, in the space the policy samples in, against the checkpoint's own config.json:
    each of (F, H, W) divisible by its patch_size, and the (2F, H, W) patches (source and target are joined along
    frames) within its rope_max_seq_len; the transformer would otherwise fail at its first forward.

    The checkpoint's config.json does not record the frame size it was trained at (checkpoints/recam_tiny_base
    has patch_size and rope_max_seq_len only), so a size the base never saw that fits these limits passes."""
    d, m = config.data, config.model
    patch, rope = model_config.get("patch_size"), model_config.get("rope_max_seq_len")
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3):
        return
    size_field = "data.height/data.width" if d.source == "recammaster" else "data.size"
    f, h, w = (d.num_frames, d.height, d.width) if d.source == "recammaster" else (d.num_frames, d.size, d.size)
    space = "pixels"
    if m.vae:
        vae = _vae_config(m.vae)
        t, sp = vae.get("scale_factor_temporal") or 4, vae.get("scale_factor_spatial") or 8
        f, h, w, space = 1 + (f - 1) // t, h // sp, w // sp, "VAE latents"
    p_t, p_h, p_w = (int(x) for x in patch)
    ckpt = f"the config.json of model.pretrained={m.pretrained!r}"
    _require(f % p_t == 0, f"data.num_frames={d.num_frames} must give a frame count ({f} in {space}) divisible by "
             f"the temporal patch size {p_t} (patch_size {list(patch)} in {ckpt})")
    size = f"{d.height}x{d.width}" if d.source == "recammaster" else str(d.size)
    _require(h % p_h == 0 and w % p_w == 0,
             f"{size_field}={size} must give frames ({h}x{w} in {space}) divisible by the patch size {p_h}x{p_w} "
             f"(patch_size {list(patch)} in {ckpt})")
    if isinstance(rope, int):
        patches = (2 * f // p_t, h // p_h, w // p_w)
        _require(patches[0] <= rope, f"data.num_frames={d.num_frames} must give at most {rope} frame patches for "
                 f"source + target (rope_max_seq_len in {ckpt}), got 2F = {patches[0]}")
        _require(max(patches[1:]) <= rope, f"{size_field}={size} must give at most {rope} patches per side "
                 f"(rope_max_seq_len in {ckpt}), got {patches[1]}x{patches[2]}")
