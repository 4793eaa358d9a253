"""Config validation that runs before any model is built, and the derived numbers of a run.

Every error names the config field(s) at fault and says what would fix them. The checks themselves (ConfigError,
check_int, FieldChecks, ...) are in recam/infra/config_checks.py, below the domains and rewards that use them; a
domain checks its own fields and files in its `check_config` / `check_files` (recam/domains/camera/checks.py).
"""

from __future__ import annotations

import math
import netrc
import os
from urllib.parse import urlparse

import ml_collections

from recam.engine.plan import RunNumbers, StepPlan, latest_window_start, trained_steps
from recam.infra.config_checks import (  # noqa: F401  (ConfigError, eval_report_rewards: re-exported for callers)
    ConfigError,
    FieldChecks,
    _get,
    _is_int,
    _is_number,
    _require,
    check_bool,
    check_choice,
    check_int,
    check_nonempty_str,
    check_number,
    eval_report_rewards,
)

MAX_THREADS = 1024


def wandb_account_problem() -> str | None:
    """Why wandb's online mode cannot log in from here, or None. Looked up where wandb looks (WANDB_API_KEY, then
    the netrc entry of its host), without the network: online without an account stalls at wandb.init, asking for a
    key no one is there to type."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"logging.wandb_mode='online' needs a wandb account, and none is set up here (no WANDB_API_KEY, no "
            f"netrc entry for {host}): run `wandb login` or set WANDB_API_KEY, or use 'offline' (needs none, "
            "`wandb sync` uploads it later) or 'disabled'")


# (field, low, high, why): integers every domain reads (config/base.py states each range).
INT_FIELDS = (
    ("seed", 0, 2**32 - 1, "numpy seeds are 0 .. 2**32 - 1"),
    ("expected_num_processes", 0, None, "0 = accept whatever is launched"),
    ("save_freq", 1, None, "a checkpoint every N epochs"),
    ("keep_checkpoints", 0, None, "0 = keep every epoch checkpoint"),
    # 100000 threads crashed the process (libgomp's allocation per thread); no CPU gains past a few per core
    ("num_threads", 0, MAX_THREADS, f"0 = torch's default; this machine has {os.cpu_count()} cores"),
    ("data.num_train_conditions", 0, None, ""),
    ("data.num_heldout_conditions", 0, None, ""),
    ("data.num_val_conditions", 0, None, ""),
    ("eval.num_train_conditions", 0, None, "0 = no evaluation on training conditions"),
    ("data.seed", 0, 2**32 - 1, ""),
    ("model.lora_rank", 0, None, "0 = full fine-tuning"),
    ("train.old_policy_decay_flat", 0, None, "optimizer steps before the old policy's ramp starts"),
    ("sample.eval_num_steps", 1, None, "ODE steps of held-out evaluation"),
    ("sample.window_size", 0, None, "0 = the first round(train.timestep_fraction x num_steps) steps"),
    ("sample.window_start", 0, None, "a scheduler step"),
    ("sample.window_max_start", -1, None, "a scheduler step, or -1 = the latest that fits"),
    ("sample.window_shift_every", 1, None, "epochs per one-step shift of a progressive window"),
    ("sample.noise_frequencies", 0, None, "0 = noise in every element"),
    ("sample.noise_channels", 0, None, "0 = noise in every channel"),
    ("train.fp_num_timesteps", 0, None, "re-noised timesteps per final sample per pass; 0 only with 'grid'"),
    ("reward.max_retries", 0, None, ""),
    ("eval.freq", 1, None, "evaluate every N epochs"),
    ("eval.seed", 0, 2**32 - 1, ""),
    ("eval.batch_size", 1, None, "conditions per evaluation forward"),
    ("eval.num_videos", 0, None, "0 = write no examples"),
    ("health.max_rollbacks", 0, None, ""),
    ("debug.inject_blowup_at_step", None, None, "negative = off"),
    ("debug.sigkill_at_step", None, None, "negative = off"),
)
# (field, low, high, low_open, high_open, allow_inf): numbers every domain reads. A policy loss's own settings are
# checked by the loss (check_policy_loss).
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
    ("train.sampling_kl_coeff", 0, None, False, False, False),
    ("train.ema_decay", 0, 1, True, True, False),
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
    ("train.awm_ghuber_power", 0, None, True, False, False),
    ("train.fp_grid_fraction", 0, 1, True, False, False),
    ("sample.sa_eta", 0, None, False, False, False),
    ("sample.sa_min_sigma", 0, 1, False, False, False),
    ("sample.sa_max_sigma", 0, 1, False, False, False),
    ("eval.every_seconds", 0, None, False, False, False),
    ("max_train_seconds", 0, None, False, False, False),
)
BOOL_FIELDS = ("resume", "trust_legacy_checkpoint", "model.gradient_checkpointing", "train.ema",
               "advantage.filter_zero_std", "advantage.placebo",
               "advantage.unbiased_std", "train.guard_dt_weighting",
               "sample.same_initial_noise", "train.log_gradient_cosine", "train.noise_scale")

# Free-form strings ('' allowed); their contents are checked where they are read (domains, validate_files).
STR_FIELDS = ("data.root", "model.vae", "model.lora_targets", "eval.report_rewards", "eval.select_by",
              "eval.select_guard", "eval.secondary_endpoints", "reward.constraint", "debug.fail_reward_slots",
              "plugins")


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


def check_rewards(config: ml_collections.ConfigDict, domain_cls) -> None:
    """Every reward in reward.weights and eval.report_rewards is registered as scoring the samples the domain
    (`domain_cls`, the class registered as config.domain) produces, its sample_kind; and the settings of every reward
    of that kind are in range (each reward's `check`). The registry is the one source: a reward of another domain,
    or a name nothing registers, is refused here rather than when the run first scores. A weight of 0 switches a
    reward off (it is never built), so a preset's reward of another kind may stay listed at 0 when a run changes
    the domain; its name must still be a registered reward."""
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
    switched_off = {name for name, w in config.reward.weights.items() if w == 0} - set(eval_report_rewards(config))
    for subject, name in named:
        other = reward_kind(name)
        if name in scorable or (name in switched_off and other is not None):
            continue
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
    """The run's trained steps and window (recam.engine.plan.StepPlan), from sample.* and train.*."""
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

    from recam.domains import domain_class

    try:
        hint = typing.get_type_hints(domain_class(domain).scheduler).get("return")
    except Exception:  # noqa: BLE001 - a factory or an unresolvable annotation: the trainer checks at build time
        return None
    flow = getattr(hint, "is_flow", None)
    return flow if isinstance(flow, bool) else None


FLOW_ONLY_OBJECTIVES = ("grpo_guard",)  # GRPO-Guard's RatioNorm is derived for the flow SDE's transition


def check_window_and_objective(config: ml_collections.ConfigDict) -> None:
    """The stochastic window, the deterministic solver, and the objectives' own fields (ranges are in the tables
    above)."""
    from recam.engine.extensions.fast_objectives import AWM_WEIGHTINGS, FP_TIMESTEP_SAMPLING, fp_level_count
    from recam.engine.objective import objective_needs
    from recam.engine.plan import WINDOW_MODES
    from recam.engine.rollout import ODE_SOLVERS, SOLVER_SCOPES

    s, t = config.sample, config.train
    check_choice(config, "sample.window_mode", WINDOW_MODES)
    check_choice(config, "sample.ode_solver", ODE_SOLVERS)
    check_choice(config, "sample.ode_solver_scope", SOLVER_SCOPES)
    check_number(config, "sample.post_window_compress", 0, 1, low_open=True)
    check_choice(config, "train.fp_timestep_sampling", FP_TIMESTEP_SAMPLING)
    check_choice(config, "train.awm_weighting", AWM_WEIGHTINGS)
    _require(t.fp_min_noise < t.fp_max_noise,
             f"train.fp_min_noise={t.fp_min_noise} must be below train.fp_max_noise={t.fp_max_noise}")
    try:
        fp_level_count(t.fp_timestep_sampling, t.fp_num_timesteps, s.num_steps, t.fp_grid_fraction)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _require(s.sa_min_sigma <= s.sa_max_sigma,
             f"sample.sa_min_sigma={s.sa_min_sigma} must be <= sample.sa_max_sigma={s.sa_max_sigma}")
    flow = scheduler_is_flow(config.domain)
    _require(s.ode_solver not in ("sa_solver", "sa_solver_pc") or (
        flow is not False and not objective_needs(t.objective, "needs_log_probs")),
             f"sample.ode_solver={s.ode_solver!r} draws noise that no log-prob scores: it needs a flow domain and an "
             f"objective without log-probs ('nft', 'awm'); here domain {config.domain!r}, train.objective="
             f"{t.objective!r}")
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


def check_policy_loss(config: ml_collections.ConfigDict, num_processes: int | None = None) -> None:
    """The settings of the chosen train.policy_loss, as its registration states them (recam.engine.losses.
    register_policy_loss): each is in config.train with its default's type, in the range its `check` states; and
    no switch (a bool setting named use_*) of another loss is on, since the chosen one would not read it."""
    from recam.engine.losses import policy_loss_switches, registered_policy_loss

    t = config.train
    entry = registered_policy_loss(t.policy_loss)
    for name, default in entry.fields().items():
        _require(name in t, f"train.{name} is not in the config, and train.policy_loss={t.policy_loss!r} reads it: "
                 "config.plugins.add_loss_settings adds a loss's settings once its plugin is imported")
        value, kind = t[name], type(default)
        ok = isinstance(value, kind) if kind in (bool, str) else _is_int(value) if kind is int else _is_number(value)
        _require(ok, f"train.{name} must be a {kind.__name__} like its default {default!r}, got {value!r}")
    if entry.check is not None:
        entry.check(FieldChecks(config, num_processes))
    for switch, readers in policy_loss_switches().items():
        _require(switch not in t or not t[switch] or switch in entry.fields(),
                 f"train.{switch} needs train.policy_loss in {sorted(readers)}, got {t.policy_loss!r}")


def endpoints(config: ml_collections.ConfigDict) -> tuple[str, str, list[str]]:
    """(primary endpoint, its time point, secondary endpoints) as the config names them."""
    secondary = [m.strip() for m in str(config.eval.secondary_endpoints).split(",") if m.strip()]
    return config.eval.primary_endpoint, config.eval.primary_time, secondary


def check_endpoints(config: ml_collections.ConfigDict) -> None:
    """The pre-registered endpoints are held-out metric names (eval/...), the primary is not also secondary, and its
    time point is one seed_gains knows. Whether a run's evaluations carry them is checked where they are read."""
    check_nonempty_str(config, "eval.primary_endpoint", "the held-out metric a claim rests on, e.g. eval/cam_score")
    primary, time, secondary = endpoints(config)
    _require(primary.startswith("eval/"),
             f"eval.primary_endpoint={primary!r} must name a held-out metric (eval/<name>, e.g. eval/cam_score)")
    _require(time in ("last", "reported"),
             f"eval.primary_time must be 'last' (the last epoch) or 'reported' (the selected checkpoint), got {time!r}")
    for name in secondary:
        _require(name.startswith("eval/"), f"eval.secondary_endpoints names {name!r}: use held-out metric names "
                 "(eval/<name>), comma-separated")
    _require(primary not in secondary, f"eval.secondary_endpoints names the primary endpoint {primary!r} again")
    _require(len(set(secondary)) == len(secondary), f"eval.secondary_endpoints names a metric twice: {secondary}")


def validate(config: ml_collections.ConfigDict, num_processes: int) -> RunNumbers:
    """Check `config` for a launch with `num_processes` processes; return `derived_numbers`.

    Every numeric field's range and every choice field's membership is checked here (fields every domain reads)
    or in the domain's `check_config` (its own fields); each error is one line naming the field and what it
    may be."""
    from recam.domains import domain_class, known_domains
    from recam.engine.advantages import STD_MODES
    from recam.engine.losses import KL_ESTIMATORS, known_policy_losses
    from recam.engine.objective import OBJECTIVES, STEP_WEIGHTINGS, known_objectives
    from recam.engine.reward_runner import FailurePolicy

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
    _require(t.policy_loss in known_policy_losses(),
             f"train.policy_loss={t.policy_loss!r} is not registered; known: {known_policy_losses()}")
    check_policy_loss(config, num_processes)
    _require(t.kl_type in KL_ESTIMATORS, f"train.kl_type={t.kl_type!r} unknown; use one of {sorted(KL_ESTIMATORS)}")
    _require(t.step_weighting in STEP_WEIGHTINGS,
             f"train.step_weighting={t.step_weighting!r} unknown; use one of {list(STEP_WEIGHTINGS)}")
    _require(t.step_weighting == "uniform" or t.objective == "grpo",
             f"train.step_weighting={t.step_weighting!r} weights GRPO's log-prob steps; train.objective="
             f"{t.objective!r} has its own weighting: set train.step_weighting='uniform' or train.objective='grpo'")
    _require(t.objective in known_objectives(),
             f"train.objective={t.objective!r} unknown; use one of {sorted(OBJECTIVES)}")
    _require(t.sampling_kl_coeff == 0 or (t.objective == "grpo" and t.policy_loss == "grpo_clip"),
             f"train.sampling_kl_coeff={t.sampling_kl_coeff!r} (MixGRPO's KL form) is read by train.objective 'grpo' "
             f"with policy loss 'grpo_clip' only; here {t.objective!r} / {t.policy_loss!r}: set it to 0")
    check_window_and_objective(config)
    _require(a.std_mode in STD_MODES, f"advantage.std_mode must be one of {list(STD_MODES)}, got {a.std_mode!r}")
    _require(config.mixed_precision in ("no", "fp16", "bf16"),
             f"mixed_precision must be 'no', 'fp16' or 'bf16', got {config.mixed_precision!r}")
    _require(config.logging.wandb_mode in ("offline", "online", "disabled"),
             f"logging.wandb_mode must be offline/online/disabled, got {config.logging.wandb_mode!r}")
    if config.logging.wandb_mode == "online":
        problem = wandb_account_problem()
        _require(problem is None, problem or "")
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
    check_endpoints(config)
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


def validate_files(config: ml_collections.ConfigDict) -> None:
    """The checks that read the filesystem (paths, config.json headers; never weights), run by the trainer right
    after `validate` and before any model is built. Kept apart so presets for other machines validate anywhere.
    A domain whose model or data live in files checks them (its `check_files`)."""
    from recam.domains import domain_class, known_domains

    if config.domain in known_domains() and hasattr(domain_class(config.domain), "check_files"):
        domain_class(config.domain).check_files(config)
