"""The GRPO engine: one epoch is sample -> score -> gather -> advantages -> update -> guard -> checkpoint ->
evaluate, each phase a method over the typed containers of recam.engine.containers.

The trainer knows a domain only through recam.engine.domain.Domain, an algorithm only through the registries
(objectives, policy losses, KL estimators), and side concerns only through hooks (recam.engine.hooks).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from recam.engine.advantages import broadcast_over_timesteps, nonzero_group_mask
from recam.engine.containers import EpochResult, Groups, Rollouts, Scores, StepStats
from recam.engine.health import SAMPLE_RULES, Finding, diagnose_step, term_standard_errors
from recam.engine.hooks import ConstraintHook, FaultInjectionHook
from recam.engine.noise_subspace import SubspaceNoise
from recam.engine.objective import OBJECTIVES, MicroBatch, known_objectives, objective_needs
from recam.engine.plan import RunNumbers
from recam.engine.reward_runner import (
    AsyncRewardRunner,
    RewardDetails,
    RewardServerDown,
    concat_details,
    concat_results,
    exclusion_mask,
    masked_group_advantages,
)
from recam.engine.rollout import deterministic_sample, per_sample_noise, rollout
from recam.engine.sampler import KRepeatBatchSampler
from recam.engine.selection import select_checkpoint
from recam.infra import runlog
from recam.infra.checkpoint import (
    BASE_EVAL,
    SELECTED,
    Checkpoint,
    CheckpointCorrupt,
    ResumeMismatch,
    apply_model_weights,
    checkpoint_before,
    epoch_of,
    latest_checkpoint,
    nonfinite_tensors,
    point,
    point_latest,
    pointed_checkpoint,
    read_intact,
    read_pointer,
    save_checkpoint,
    set_rng_state,
)
from recam.infra.distributed import local_slice
from recam.infra.lora import add_lora
from recam.infra.schema import reward_terms

OLD_POLICY = "old_policy.json"  # checkpoint side file: the old policy's trainable parameters, exact


INITIAL_NOISE_STREAM = 0x494E4954  # keeps sample.same_initial_noise's draws apart from the per-sample streams
TRAIN_PROBE_PREFIX = "train_eval"  # metrics of eval.num_train_conditions training conditions (not "train/": wandb's)


class FirstConditions(Sequence):
    """The first n conditions of a split, read through to the split itself (its own attributes included), so a
    domain collates them exactly as it collates the split."""

    def __init__(self, dataset, n: int):
        self.dataset, self.n = dataset, int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not -self.n <= int(i) < self.n:
            raise IndexError(f"condition {i} of {self.n}")
        return self.dataset[int(i) % self.n]

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (copy, unpickling): without this the lookup below would recurse
            raise AttributeError(name)
        return getattr(self.dataset, name)


def exploration_scheduler(domain, config, device):
    """The domain's scheduler, its stochastic steps' noise confined to a subspace when sample.noise_frequencies
    (and sample.noise_channels) ask for one (recam.engine.noise_subspace)."""
    s, scheduler = config.sample, domain.scheduler(device)
    if not s.noise_frequencies:
        return scheduler
    frames = domain.sample_shape()[-1]
    if s.noise_frequencies > frames:
        raise ValueError(f"sample.noise_frequencies={s.noise_frequencies} exceeds the {frames} positions on the last "
                         f"axis of the {config.domain} domain's samples")
    channels = None
    if s.noise_channels:
        if not hasattr(domain, "principal_channels"):
            raise ValueError(f"sample.noise_channels={s.noise_channels} needs the principal directions of the "
                             f"domain's data; the {config.domain} domain gives none: set it to 0")
        channels = domain.principal_channels(s.noise_channels)
    return SubspaceNoise(scheduler, s.noise_frequencies, channels)


class GRPOTrainer:
    def __init__(self, config, domain, accelerator, log, numbers: RunNumbers, report_rewards: tuple[str, ...] = ()):
        self.config, self.domain, self.accelerator, self.log, self.numbers = config, domain, accelerator, log, numbers
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.run_dir = Path(config.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        t, s = config.train, config.sample

        # ---- data, policy (+ LoRA or a frozen reference copy), optimizer, rewards ----
        splits = domain.datasets()
        self.train_set, self.heldout, self.val_set = splits.train, splits.heldout, splits.val
        log.detail(f"data ({config.domain} domain): {len(self.train_set)} training / {len(self.heldout)} held-out"
                   + (f" / {len(self.val_set)} validation conditions" if self.val_set is not None else " conditions"))
        # the first N training conditions, evaluated like the held-out ones: whether the policy improves on the
        # conditions it trains on at all, which tells an optimisation problem from a generalisation one
        n_probe = min(config.eval.num_train_conditions, len(self.train_set))
        self.train_probe = FirstConditions(self.train_set, n_probe) if n_probe else None
        if config.eval.select_by and self.val_set is None:
            log.info(f"eval.select_by={config.eval.select_by!r} is ignored: this data has no validation split, so "
                     "the run reports its last epoch")
        policy = domain.build_policy()
        self.use_lora = config.model.lora_rank > 0
        self.reference = None
        if self.use_lora:  # the reference is the same network with the adapter disabled: no second copy
            add_lora(policy, config.model.lora_rank, config.model.lora_alpha,
                     [m.strip() for m in config.model.lora_targets.split(",") if m.strip()] or None)
        elif t.beta > 0:
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval().to(accelerator.device)
        if config.model.gradient_checkpointing:  # recompute block activations in the backward: memory for time
            policy.enable_gradient_checkpointing()
        optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=t.learning_rate,
                                      betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                                      eps=t.adam_epsilon)
        self.ema = None
        if t.ema:
            from diffusers.training_utils import EMAModel
            self.ema = EMAModel(policy.parameters(), decay=t.ema_decay)
        weights = dict(config.reward.weights)
        self.eval_reward_fn = domain.reward_fn(weights, report=report_rewards)
        self.eval_reward_names = tuple(dict.fromkeys([*(n for n, w in weights.items() if w > 0), *report_rewards]))
        self.runner = AsyncRewardRunner(domain.reward_fn(weights), config.reward.async_workers,
                                        config.reward.failure_policy, config.reward.max_retries,
                                        config.reward.retry_backoff_s)
        self.hooks = list(domain.hooks())
        r = config.reward
        if r.constraint:
            self.hooks.append(ConstraintHook(r.constraint, weights, r.constraint_slack, r.constraint_lr,
                                             r.constraint_max_weight))
        d = config.debug
        self.hooks.append(FaultInjectionHook(d.inject_blowup_at_step, d.sigkill_at_step,
                                             tuple(int(x) for x in d.fail_reward_slots.split(",") if x.strip())))

        self.policy, self.optimizer = accelerator.prepare(policy, optimizer)
        self.model = accelerator.unwrap_model(self.policy)
        self.optimizer.zero_grad(set_to_none=True)  # whatever built the policy leaves no gradient in step 1
        self.autocast = accelerator.autocast if config.mixed_precision != "no" else contextlib.nullcontext
        known_objectives()
        self.needs_old_means = objective_needs(t.objective, "needs_old_means")
        scheduler = exploration_scheduler(domain, config, accelerator.device)
        T = numbers.plan.trained_steps  # the window's size, the timestep_fraction rule, or 0 without log-probs
        self.scheduler = scheduler if scheduler.num_train_steps == T else scheduler.with_train_steps(T)
        if s.ode_solver == "dpm2" and not getattr(self.scheduler, "is_flow", False):
            raise ValueError(f"sample.ode_solver='dpm2' needs a flow-matching scheduler; the {config.domain} domain "
                             f"samples with {type(self.scheduler).__name__}")
        self.eval_scheduler = self.scheduler.with_steps(s.eval_num_steps)
        self.objective = OBJECTIVES[t.objective](t, self.scheduler)
        # the old policy of forward-process objectives: a frozen copy averaged toward the policy after each epoch
        self.old_policy = None
        if objective_needs(t.objective, "needs_old_policy"):
            self.old_policy = copy.deepcopy(self.model).requires_grad_(False).eval()
        # DiffusionNFT samples with its old policy; everything else with the policy
        self.samples_with_old_policy = objective_needs(t.objective, "samples_with_old_policy")
        # the weights that drew this epoch's samples, frozen while the update moves the policy (AWM's old losses)
        self.sampling_snapshot = None
        if objective_needs(t.objective, "needs_sampling_policy") and not self.samples_with_old_policy:
            self.sampling_snapshot = copy.deepcopy(self.model).requires_grad_(False).eval()
        # denoiser evaluations (rows) of this epoch on this process, and the run's budget so far (all processes)
        self.nfe = {"sampling": 0, "training": 0}
        self.train_seconds, self.nfe_sampling_total, self.nfe_training_total = 0.0, 0, 0
        self.budget_stop = False
        self.next_time_eval, self.time_eval_due = config.eval.every_seconds, None
        self.sampler = KRepeatBatchSampler(len(self.train_set), s.batch_size, s.k, self.world_size, self.rank,
                                           config.seed, s.num_batches_per_epoch)
        self.sample_shape = domain.sample_shape()
        self.epoch_cache: dict = {}  # work shared by sampling and training within one epoch, renewed by sample()
        self.epoch, self.global_step, self.rollbacks, self.stopped_by = 0, 0, 0, None
        self.history: list[dict] = []  # recent step metrics with their epoch's reward signal, for the guard
        self.previous_grads: list[torch.Tensor] | None = None  # the last optimizer step's gradient (grad_cosine_prev)
        self.selected = None

    # ------------------------------------------------------------------------------------------------------
    # the loop

    def train(self) -> str | None:
        """Run to config.num_epochs (or a stop); returns why the run stopped early, or None. Reaching
        max_train_seconds is the run's planned end: self.stopped_by says so, and None is returned."""
        cfg = self.config
        finished = self.log.read_eval("final")  # read before a resume drops it from the log
        eval_before = self.resume_or_start()  # the base's evaluation: made once, then read from the checkpoint
        if self.epoch < cfg.num_epochs and not self.budget_spent():
            finished = None  # this invocation trains: its end is evaluated anew
        self.eval_missed_at_resume()
        self.selected = self.selected_eval()  # its checkpoint is never pruned
        while self.epoch < cfg.num_epochs:
            if self.budget_spent():
                self.budget_stop = True
                self.stopped_by = (f"max_train_seconds={cfg.max_train_seconds:g} reached after epoch {self.epoch - 1} "
                                   f"({self.train_seconds:.1f} s of training)")
                self.log.info(self.stopped_by)
                break
            epoch_t0 = time.time()
            self.nfe = {"sampling": 0, "training": 0}
            rollouts = self.sample(self.epoch)                       # 1. k copies per condition, with log-probs
            t_sampled = time.time()
            try:
                scores = self.score()                                # 2. rewards (scored while sampling went on)
            except RewardServerDown as e:
                self.stopped_by = f"reward server down at epoch {self.epoch}: {e}"
                self.log.info(f"{self.stopped_by}; the last checkpoint {latest_checkpoint(self.ckpt_root)} is intact")
                self.skip_served_rewards()
                break
            t_scored = time.time()
            groups = self.advantages(rollouts, scores)               # 3. gather, group-relative advantages
            record = self.epoch_record(rollouts, scores, groups)
            signal = {"zero_std_ratio": record["zero_std_ratio"],    # the guard's reward rules compare epochs
                      **reward_terms(record, include_avg=True), "term_sem": term_standard_errors(record),
                      "constraint_weight": record.get("constraint_weight")}
            t_update = time.time()
            result = self.update(rollouts, groups, signal)          # 4. clipped-ratio policy updates with KL
            record["old_policy_decay"] = self.update_old_policy()
            t_updated = time.time()
            record["optimizer_steps"] = [st.metrics for st in result.steps]
            # every objective's ratio is against the weights that sampled: its first step's ratio is 1
            record["first_step_ratio_deviation"] = result.first_step_ratio_deviation
            record.update(self.budget_record(rollouts, t_sampled - epoch_t0, t_scored - t_sampled,
                                             t_updated - t_update))
            # the slowest process's time, so that every process agrees on the budget and the time grid
            record["epoch_seconds"] = self.max_over_processes(time.time() - epoch_t0)
            self.train_seconds += record["epoch_seconds"]  # evaluations and checkpoints never count
            record["train_seconds"] = self.train_seconds
            self.log.epoch_record(record)
            self.log.info(runlog.epoch_line(record))
            critical = result.critical or self.nonfinite_state()
            if critical:                                             # 5. guard: never checkpoint a broken epoch
                if self.guard(critical) == "stop":
                    break
                continue
            for h in self.hooks:
                h.epoch_done(groups)
            self.epoch += 1
            self.time_eval_due = self.crossed_time_grid()
            self.checkpoint()                                        # 6. checkpoint, 7. evaluate
            if self.epoch % cfg.eval.freq == 0 and self.epoch != cfg.num_epochs:
                self.evaluate(f"epoch_{self.epoch:04d}", f"epoch_{self.epoch:04d}")
                self.selected = self.selected_eval()
            if self.time_eval_due:
                self.evaluate(self.time_eval_due, f"epoch_{self.epoch:04d}")
                self.selected = self.selected_eval()
        self.runner.close()
        eval_after = self.final_evaluation(finished)
        self.selected = self.selected_eval()
        self.report(eval_before, eval_after)
        return None if self.budget_stop else self.stopped_by

    # ------------------------------------------------------------------------------------------------------
    # the time-to-reward budget: wall-clock and denoiser evaluations

    def budget_spent(self) -> bool:
        budget = self.config.max_train_seconds
        return budget > 0 and self.train_seconds >= budget

    def budget_record(self, rollouts: Rollouts, sampling: float, rewards: float, training: float) -> dict:
        """The epoch's phase times (this process's) and denoiser evaluations (summed over processes), and the run's
        totals after it. seconds_rewards is the wait in score(): rewards are computed while sampling goes on."""
        counts = torch.tensor([self.nfe["sampling"], self.nfe["training"]], dtype=torch.long,
                              device=self.accelerator.device)
        if self.world_size > 1:
            counts = self.accelerator.gather(counts[None]).sum(0)
        nfe_sampling, nfe_training = (int(c) for c in counts.cpu())
        self.nfe_sampling_total += nfe_sampling
        self.nfe_training_total += nfe_training
        return {"window_start": rollouts.start, "seconds_sampling": sampling, "seconds_rewards": rewards,
                "seconds_training": training, "nfe_sampling": nfe_sampling, "nfe_training": nfe_training,
                "nfe_sampling_total": self.nfe_sampling_total, "nfe_training_total": self.nfe_training_total}

    def max_over_processes(self, value: float) -> float:
        if self.world_size == 1:
            return value
        return float(self.accelerator.gather(torch.tensor([value], dtype=torch.float64,
                                                          device=self.accelerator.device)).max())

    def counted(self, denoise, phase: str):
        """denoise, counting each call as as many evaluations as it has rows. A domain that runs classifier-free
        guidance inside its closure (two passes per row) counts once: the count is of closure rows, which is what
        every run of one domain shares."""
        def call(x, t):
            self.nfe[phase] += int(x.shape[0])
            return denoise(x, t)
        return call

    def crossed_time_grid(self) -> str | None:
        """The tag of the eval.every_seconds grid point the cumulative training time has reached since the last one
        evaluated (the latest when it reached several in one epoch), or None; moves the grid past it. An epoch
        that was rolled back reaches nothing: its point waits for the next healthy epoch."""
        every = self.config.eval.every_seconds
        if every <= 0 or self.train_seconds < self.next_time_eval:
            return None
        point = math.floor(self.train_seconds / every) * every
        self.next_time_eval = point + every
        return time_eval_tag(point)

    def skip_served_rewards(self) -> None:
        """After a reward server stopped the run, the final evaluation calls no server again (a dead one would cost
        its retries and timeouts on every batch): the served rewards are NaN there, and the log says so."""
        without = getattr(self.eval_reward_fn, "without_served", None)
        served = self.eval_reward_fn.served() if without is not None else []
        if served:
            self.eval_reward_fn = without("not evaluated: a reward server stopped the run")
            self.log.info(f"the final evaluation skips {', '.join(served)} (served; a reward server stopped the "
                          "run): n/a in the summary")

    def progress(self) -> dict:
        """What every evaluation record carries: where in the run's budget it was taken."""
        return {"train_seconds": self.train_seconds, "nfe_sampling_total": self.nfe_sampling_total,
                "nfe_training_total": self.nfe_training_total}

    def final_evaluation(self, finished: dict | None) -> dict:
        """The evaluation of the weights the run ends with (a stopped run holds those of `latest`). A run directory
        that had already finished (`finished`: its final record, None when this invocation trained) is not
        evaluated again: its final record is reported as it was, and said so."""
        if finished is not None and self.resumed_from is not None:
            self.log.info(f"this run had already finished at epoch {self.epoch}: its final evaluation is reported as "
                          "logged, not redone (raise num_epochs or use a new run_dir to train further)")
            summary = {k: v for k, v in finished.items() if k != "checkpoint"}
            self.log.eval_record("final", self.global_step, summary, epoch=self.epoch - 1,
                                 checkpoint=finished.get("checkpoint", ""))
            return summary
        return self.evaluate("final", latest_checkpoint(self.ckpt_root).name)

    # ------------------------------------------------------------------------------------------------------
    # phases

    def window_start(self, epoch: int) -> int:
        """The scheduler step where this epoch's stochastic window starts (0 without a window)."""
        return self.numbers.plan.start(epoch, self.config.seed)

    def sampling_model(self) -> torch.nn.Module:
        """The weights this epoch samples with: the old policy for objectives that sample with it (DiffusionNFT),
        else the policy, whose weights are copied into the sampling snapshot when an objective needs them later."""
        if self.samples_with_old_policy:
            return self.old_policy
        if self.sampling_snapshot is not None:
            blend_into(list(self.trainable(self.sampling_snapshot).values()),
                       list(self.trainable(self.model).values()), 0.0)
        return self.model

    def sample(self, epoch: int) -> Rollouts:
        """k copies of each condition of this process's batches; rewards are submitted as each batch finishes."""
        s, model = self.config.sample, self.sampling_model()
        model.eval()
        self.epoch_cache = {}  # this epoch's shared work (e.g. encoded source videos), for sampling and training
        index, states, log_probs, decoded, finals, means = [], [], [], [], [], []
        keep_decoded = any(getattr(h, "needs_samples", False) for h in self.hooks)
        start = self.window_start(epoch)
        for b in tqdm(range(s.num_batches_per_epoch), desc=f"epoch {epoch} sampling", disable=not self.log.enabled,
                      leave=False):
            position = epoch * s.num_batches_per_epoch + b
            indices = self.sampler.batch_at(position)
            batch = self.domain.collate(self.train_set, indices, self.epoch_cache)
            keys = [(self.config.seed, position, self.rank * s.batch_size + n) for n in range(len(indices))]
            noise = per_sample_noise(keys, self.scheduler.num_steps + 1, self.sample_shape)
            if s.same_initial_noise:  # one start per condition and epoch, shared by its k copies on every process
                starts = [(self.config.seed, epoch, int(i), INITIAL_NOISE_STREAM) for i in indices]
                noise[:, 0] = per_sample_noise(starts, 1, self.sample_shape)[:, 0]
            denoise = self.counted(self.domain.denoiser(model, batch, self.autocast), "sampling")
            out = rollout(denoise, noise.to(self.accelerator.device), self.scheduler, self.element_mask(batch),
                          start=start, store_means=self.needs_old_means, ode_solver=s.ode_solver,
                          solver_scope=s.ode_solver_scope, post_window_compress=s.post_window_compress)
            samples = self.decode(out.final, batch)  # rewards see what the domain decodes (pixels, motions)
            self.runner.submit(position, samples, batch.conditions)  # scored while the next batch samples
            index.append(torch.tensor(indices))
            states.append(out.states.cpu())
            log_probs.append(out.log_probs.cpu())
            finals.append(out.final.cpu())
            if out.means is not None:
                means.append(out.means.cpu())
            if keep_decoded:
                decoded.append(samples)
        return Rollouts(torch.cat(index), torch.cat(states), torch.cat(log_probs), decoded, start=start,
                        final=torch.cat(finals), means=torch.cat(means) if means else None)

    def decode(self, final: torch.Tensor, batch):
        """What the rewards see: the domain's optional decode_batch when decoding needs the batch (a padded motion is
        cut at its condition's length), else its decode."""
        fn = getattr(self.domain, "decode_batch", None)
        return fn(final, batch) if fn is not None else self.domain.decode(final)

    def score(self) -> Scores:
        """This process's rewards. A reward server found down on any process stops every process (the others
        would otherwise wait for it in the next gather)."""
        down = None
        try:
            results = self.runner.collect()
        except RewardServerDown as e:
            down = e
        if self.world_size > 1:
            flags = self.accelerator.gather(torch.tensor([down is not None], device=self.accelerator.device))
            if down is None and bool(flags.any()):
                down = RewardServerDown("another process found its reward server down")
        if down is not None:
            raise down
        rewards, valid = concat_results(results)
        scores = Scores({k: v.float() for k, v in rewards.items()}, valid, sum(sum(r.call_seconds) for r in results),
                        concat_details(results))
        for h in self.hooks:
            scores = h.adjust_scores(scores, self.rank, self.config.sample.batch_size)
        return scores

    def advantages(self, rollouts: Rollouts, scores: Scores) -> Groups:
        """Gather every process's samples (rank order), normalise rewards within each condition's group over the
        samples that are kept (a failed reward is excluded, never counted as a 0)."""
        acc, adv_cfg = self.accelerator, self.config.advantage
        index = acc.gather(rollouts.index.to(acc.device)).cpu()
        rewards = {k: acc.gather(v.to(acc.device)).cpu() for k, v in scores.rewards.items()}
        valid = acc.gather(scores.valid.to(acc.device)).cpu().bool()
        keep, exclusion = exclusion_mask(valid, index, self.runner.exclusion_policy)
        for h in self.hooks:
            rewards = h.adjust_rewards(rewards)
        advantages, _, stats = masked_group_advantages(rewards["avg"], index, keep, adv_cfg.std_mode, adv_cfg.eps)
        if adv_cfg.filter_zero_std:
            keep &= nonzero_group_mask(advantages, index)
        # one column per trained step; one for an objective that trains no stored step (T = 0)
        columns = max(1, self.scheduler.num_train_steps)
        return Groups(index, rewards, keep, broadcast_over_timesteps(advantages, columns),
                      stats, exclusion, self.gather_details(scores.details))

    def gather_details(self, details: RewardDetails | None) -> RewardDetails:
        """Every process's reward details in rank order, like the rewards (numbers by tensor gather, the rest as
        objects)."""
        if details is None or self.world_size == 1:
            return details or RewardDetails()
        acc = self.accelerator
        numbers = {k: acc.gather(v.to(acc.device)).cpu() for k, v in sorted(details.numbers.items())}
        lists = {k: gather_object(v) for k, v in sorted(details.lists.items())}
        counts: dict[str, dict[str, int]] = {}
        for k, v in sorted(details.counts.items()):
            counts[k] = {}
            for part in gather_object([v]):
                for name, c in part.items():
                    counts[k][name] = counts[k].get(name, 0) + c
        return RewardDetails(numbers, lists, counts)

    def epoch_record(self, rollouts: Rollouts, scores: Scores, groups: Groups) -> dict:
        ids = [self.domain.condition_id(self.train_set, int(i)) for i in groups.index]
        record = runlog.epoch_record(self.epoch, self.global_step, self.numbers.record(), ids, groups.index,
                                     groups.rewards, groups.advantages, groups.stats, scores.seconds, groups.details)
        record["trajectory_ids"] = [f"{c}#{k}" for c, k in trajectory_ids(groups.index).tolist()]
        for h in self.hooks:
            record.update(h.epoch_record(rollouts, groups, self.train_set))
        record["excluded"] = (~groups.keep).tolist()
        record.update(groups.exclusion)
        return record

    def update(self, rollouts: Rollouts, groups: Groups, signal: dict) -> EpochResult:
        """Optimizer steps over this process's samples; the guard sees each step before it is applied.

        Excluded samples are masked, not dropped: every process walks the same number of micro-batches and
        steps (dropping them per process would let processes disagree on the number of steps and hang on the
        next collective), and each kept sample weighs the same in its step, which is the mean over the step's
        kept samples on every process."""
        cfg, t, P = self.config, self.config.train, self.world_size
        self.model.train()
        adv = local_slice(groups.advantages, self.rank, P)
        traj = local_slice(trajectory_ids(groups.index), self.rank, P)
        keep_all = groups.keep.view(P, -1)  # (processes, n): what every process keeps, known to each of them
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.epoch)
        order = torch.randperm(len(rollouts.states), generator=gen)  # the same permutation on every process
        steps: list[StepStats] = []
        per_pass = math.ceil(math.ceil(len(order) / t.batch_size) / t.gradient_accumulation_steps)
        bar = tqdm(total=t.num_inner_epochs * per_pass, desc=f"epoch {self.epoch} training",
                   disable=not self.log.enabled, leave=False)
        for inner in range(t.num_inner_epochs):
            micro = [order[i:i + t.batch_size] for i in range(0, len(order), t.batch_size)]
            for first in range(0, len(micro), t.gradient_accumulation_steps):
                chunk = micro[first:first + t.gradient_accumulation_steps]
                positions = torch.cat(chunk)
                weight = step_sample_weights(keep_all, positions, self.rank)
                if weight is None:
                    continue  # nothing to learn from on any process
                for h in self.hooks:
                    h.before_step(self.global_step, self.model)
                acc_metrics = []
                for c, sel in enumerate(chunk):
                    mb = self.micro_batch(rollouts, sel, adv, traj, weight, inner)
                    acc_metrics += self.objective.accumulate(mb, self.backward_fn(c == len(chunk) - 1))
                stats = self.optimizer_step(acc_metrics, signal, kept=int(keep_all[:, positions].sum()))
                steps.append(stats)
                bar.update(1)
                if not stats.applied:
                    bar.close()
                    self.objective.end_epoch()
                    return EpochResult(steps, [f for f in stats.findings if f.severity == "critical"])
        bar.close()
        self.objective.end_epoch()
        return EpochResult(steps)

    def backward_fn(self, last_micro_batch: bool):
        """backward(loss, last_piece): gradients accumulate over timesteps and micro-batches; processes sync once
        per optimizer step, on the last piece of its last micro-batch."""
        def backward(loss, last_piece):
            sync = last_micro_batch and last_piece
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.policy):
                self.accelerator.backward(loss)
        return backward

    def micro_batch(self, rollouts: Rollouts, sel: torch.Tensor, adv, traj, weight, inner: int) -> MicroBatch:
        dev, t = self.accelerator.device, self.config.train
        indices = [int(i) for i in rollouts.index[sel]]
        batch = self.domain.collate(self.train_set, indices, self.epoch_cache)
        reference = None
        if self.use_lora and t.beta > 0:
            reference = self.domain.denoiser(self.model, batch, self.autocast, adapter_off=True)
        elif self.reference is not None:
            reference = self.domain.denoiser(self.reference, batch, self.autocast)
        old_policy = sampling_policy = None
        if self.old_policy is not None:
            old_policy = self.counted(self.domain.denoiser(self.old_policy, batch, self.autocast), "training")
        if self.samples_with_old_policy:
            sampling_policy = old_policy
        elif self.sampling_snapshot is not None:
            sampling_policy = self.counted(self.domain.denoiser(self.sampling_snapshot, batch, self.autocast),
                                           "training")

        def policy_rows(rows: slice):
            rows_batch = self.domain.collate(self.train_set, indices[rows], self.epoch_cache)
            return self.counted(self.domain.denoiser(self.model, rows_batch, self.autocast), "training")
        return MicroBatch(rollouts.states[sel].to(dev), rollouts.log_probs[sel], adv[sel], weight[sel], traj[sel],
                          self.counted(self.domain.denoiser(self.policy, batch, self.autocast), "training"),
                          None if reference is None else self.counted(reference, "training"), inner, self.model,
                          policy_rows, self.element_mask(batch),
                          final=None if rollouts.final is None else rollouts.final[sel].to(dev),
                          old_policy=old_policy, sampling_policy=sampling_policy,
                          old_means=None if rollouts.means is None else rollouts.means[sel].to(dev),
                          step_offset=rollouts.start, epoch=self.epoch)

    def element_mask(self, batch):
        """The elements of the batch's samples that log-probs and KLs average over (the domain's optional
        element_mask: padded motion frames are not real), on the device; None = all."""
        fn = getattr(self.domain, "element_mask", None)
        mask = fn(batch) if fn is not None else None
        return None if mask is None else mask.to(self.accelerator.device)

    def optimizer_step(self, acc_metrics: list[dict], signal: dict, kept: int = 0) -> StepStats:
        """Clip, average metrics over processes, ask the guard, and apply the update only if it found nothing
        critical (a broken step never reaches the weights). kept: the samples the step's gradient averages over
        (all processes)."""
        t = self.config.train
        grad_norm = self.accelerator.clip_grad_norm_(self.policy.parameters(), t.max_grad_norm)
        cosine = self.gradient_cosine() if t.log_gradient_cosine else None
        # metrics every backward pass reported, one sync; an objective without ratios (DiffusionNFT) reports none,
        # and the guard's ratio rules then have nothing to judge
        common = [k for k in acc_metrics[0] if all(k in a for a in acc_metrics)]
        m = {k: float(torch.stack([torch.as_tensor(a[k]) for a in acc_metrics]).mean()) for k in common}
        if "ratio_max" in m:
            m["ratio_max"] = max(float(a["ratio_max"]) for a in acc_metrics)
        if "ratio_min" in m:
            m["ratio_min"] = min(float(a["ratio_min"]) for a in acc_metrics)
        m["grad_norm"] = float(grad_norm)
        m["step_samples"] = kept
        if cosine is not None:
            m["grad_cosine_prev"] = cosine
        m["learning_rate"] = self.optimizer.param_groups[0]["lr"]
        m = runlog.mean_over_processes(m, self.accelerator)
        findings = diagnose_step({**m, **signal}, self.history, run_dir=str(self.run_dir))
        applied = not any(f.severity == "critical" for f in findings)
        if applied:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.step(self.model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.log.step_record(self.global_step, self.epoch, m)
        self.history.append({**m, **signal})
        if findings:
            self.log.health_record(self.global_step, self.epoch, findings)
        for h in self.hooks:
            h.after_step(self.global_step)
        return StepStats(self.global_step, m, findings, applied)

    def gradient_cosine(self) -> float | None:
        """Cosine between this optimizer step's gradient and the previous step's (None on a run's or a resumed
        run's first step, and after a rollback). The gradients are already averaged over processes, so every
        process computes the same number. Two steps' samples are independent draws, so its mean over a run
        estimates |E g|^2 / E |g|^2: near 0, an update's direction is its samples' noise (health.rule_update_noise)."""
        grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in self.policy.parameters() if p.requires_grad]
        previous, self.previous_grads = self.previous_grads, grads
        return None if previous is None else flat_cosine(grads, previous)

    def guard(self, critical: list) -> str:
        """Stop, or roll back to the last healthy checkpoint at a lower learning rate, as health.action says;
        returns "stop" or "continue". A checkpoint that fails its checks is skipped for the intact one below it."""
        cfg, acc = self.config, self.accelerator
        self.log.info("health guard: " + "; ".join(f"{f.rule} ({f.severity})" for f in critical))
        healthy = pointed_checkpoint(self.ckpt_root, self.log.info)  # load() skips it for the one below if damaged
        if any(f.rule in SAMPLE_RULES for f in critical):
            # the collapsed samples were drawn by the weights in `latest`: restore the checkpoint before them
            older = checkpoint_before(self.ckpt_root, self.epoch)
            if older is None:
                self.log.info(f"no checkpoint older than epoch {self.epoch} is kept (config.keep_checkpoints); "
                              f"restoring {healthy}, whose weights drew the collapsed samples")
            else:
                healthy = older
                if acc.is_main_process:
                    point_latest(self.ckpt_root, older.name)  # a crash from here on resumes from the good one
                acc.wait_for_everyone()
        h = cfg.health
        if h.action == "stop" or (h.action == "rollback" and self.rollbacks >= h.max_rollbacks):
            self.stopped_by = f"health guard, {critical[0].rule} at step {self.global_step}"
            healthy = self.load(healthy).path
            self.log.info(f"stopped; weights restored from the last healthy checkpoint {healthy}")
            return "stop"
        if h.action == "rollback":
            self.rollbacks += 1
            ckpt = self.load(healthy, lr_factor=h.rollback_lr_factor ** self.rollbacks)
            self.epoch, self.global_step = ckpt.state["epoch"], ckpt.state["global_step"]
            self.log.archive_after(self.epoch, reason=f"rollback {self.rollbacks}: {critical[0].rule}")
            self.selected = self.selected_eval()  # the rolled-back evaluations are no longer candidates
            self.history.clear()
            self.log.info(f"rolled back to {ckpt.path} (epoch {self.epoch}, step {self.global_step}), "
                          f"learning rate now {self.optimizer.param_groups[0]['lr']:.3g}")
            return "continue"
        self.epoch += 1  # action "warn": keep going, but this state is never saved as a checkpoint
        return "continue"

    def nonfinite_state(self) -> list:
        """A critical finding when the applied updates left NaN or inf in the weights, optimizer state or EMA. Every
        process checks its own copy, so that all of them take the guard's path together."""
        bad = nonfinite_tensors(self.model, self.optimizer, self.ema)
        if not bad:
            return []
        finding = Finding("nonfinite_state", "critical", {"tensors": bad[:5], "count": len(bad)},
                          "the optimizer step left NaN or inf in the weights or optimizer state")
        self.log.health_record(self.global_step, self.epoch, [finding])
        return [finding]

    def checkpoint(self) -> None:
        """Save the state at an epoch boundary (every save_freq epochs and the last): only healthy states get here."""
        acc, cfg = self.accelerator, self.config
        acc.wait_for_everyone()
        last = self.epoch == cfg.num_epochs or self.budget_spent()  # the run ends here: its weights are the final
        if acc.is_main_process and (self.epoch % cfg.save_freq == 0 or last):
            self.save(self.epoch, protect=(self.selected["checkpoint"],) if self.selected else ())
        acc.wait_for_everyone()

    @torch.no_grad()
    def evaluate_split(self, dataset, tag: str, prefix: str, examples_dir: Path | None) -> dict:
        """Deterministic sampling from fixed per-condition noise, rank-sharded; metrics as <prefix>/<name>."""
        cfg, acc = self.config, self.accelerator
        idx = list(range(acc.process_index, len(dataset), acc.num_processes))
        rows, items = [], []
        for start in tqdm(range(0, len(idx), cfg.eval.batch_size), desc=f"{tag} {prefix}", leave=False,
                          disable=not self.log.enabled):
            chunk = idx[start:start + cfg.eval.batch_size]
            batch = self.domain.collate(dataset, chunk)
            noise = per_sample_noise([(cfg.eval.seed, i) for i in chunk], 1, self.sample_shape)[:, 0]
            final = deterministic_sample(self.domain.denoiser(self.model, batch, self.autocast), noise.to(acc.device),
                                         self.eval_scheduler)
            decoded = self.decode(final, batch)
            rows += self.score_rows(decoded, batch, chunk)
            items += self.split_items(decoded, batch, chunk)
            if acc.is_main_process and start == 0 and cfg.eval.num_videos > 0 and examples_dir is not None:
                self.domain.write_examples(examples_dir / tag, batch, decoded, cfg.eval.num_videos)
        return self.summarise_split(rows, items, prefix)

    def split_items(self, decoded, batch, chunk: list[int]) -> list[tuple[int, object]]:
        """(dataset index, item) per condition for the domain's optional split metrics (evaluation_items)."""
        fn = getattr(self.domain, "evaluation_items", None)
        return [] if fn is None else list(zip(chunk, fn(decoded, batch), strict=True))

    def summarise_split(self, rows: list[dict], items: list, prefix: str) -> dict:
        """Per-condition means of the rows, plus the domain's optional evaluation_metrics(items) over the whole split
        (every process's items in index order): metrics a mean over conditions cannot express, e.g. retrieval
        precision within pools of conditions, or a distance between the distributions of generated and real samples."""
        out = runlog.summarise_eval(sorted(gather_object(rows), key=lambda r: r["index"]), prefix)
        fn = getattr(self.domain, "evaluation_metrics", None)
        if fn is not None:
            every = [item for _, item in sorted(gather_object(items), key=lambda r: r[0])]
            out.update({f"{prefix}/{k}": float(v) for k, v in fn(every).items()})
        return out

    def score_rows(self, decoded: torch.Tensor, batch, chunk: list[int]) -> list[dict]:
        """One row per condition: its evaluation rewards and their per-sample numeric details, less wall times (an
        evaluation describes weights, and two evaluations of the same weights must be equal; the epoch records
        carry the rewards' costs)."""
        scores, details = self.eval_reward_fn(decoded, batch.conditions)
        rows = []
        for n, i in enumerate(chunk):
            row = {"index": i, **{f"reward_{k}": float(v[n]) for k, v in scores.items()}}
            row.update({k: float(v[n]) for k, v in details.items() if torch.is_tensor(v) and v.ndim == 1
                        and not k.split("/")[-1].startswith("seconds")})
            rows.append(row)
        return rows

    def evaluate_references(self) -> dict:
        """The evaluation rewards of the held-out conditions' reference samples (the domain's optional
        `references(batch)`: for the camera domain the ground-truth clip, the reward's ceiling on this data, and the
        source clip, a camera that never moved to the target), as ref_<name>/... in one "reference" record per
        run: the yardsticks the policy's numbers are read against, and a check that each reward works on this
        data at all."""
        references = getattr(self.domain, "references", None)
        if references is None:
            return {}
        cfg, acc = self.config, self.accelerator
        idx = list(range(acc.process_index, len(self.heldout), acc.num_processes))
        rows: dict[str, list[dict]] = {}
        items: dict[str, list] = {}
        for start in range(0, len(idx), cfg.eval.batch_size):
            chunk = idx[start:start + cfg.eval.batch_size]
            batch = self.domain.collate(self.heldout, chunk)
            for name, samples in references(batch).items():
                rows.setdefault(name, []).extend(self.score_rows(samples, batch, chunk))
                items.setdefault(name, []).extend(self.split_items(samples, batch, chunk))
        summary = {}
        for name in sorted(rows):
            summary.update(self.summarise_split(rows[name], items[name], f"ref_{name}"))
        self.log.reference_record(self.global_step, summary)
        return summary

    def evaluate(self, tag: str, checkpoint: str) -> dict:
        """Held-out metrics (eval/...) and, when a checkpoint is to be selected, validation metrics (val/...) of
        the weights in memory, which are those of checkpoint folder `checkpoint` (epoch_NNNN)."""
        with ema_weights(self.ema, self.model):
            self.model.eval()
            out = self.evaluate_split(self.heldout, tag, "eval", self.run_dir / self.domain.examples_dir)
            if self.val_set is not None:
                out.update(self.evaluate_split(self.val_set, tag, "val", None))
            if self.train_probe is not None:
                out.update(self.evaluate_split(self.train_probe, tag, TRAIN_PROBE_PREFIX, None))
        # epoch = the last trained epoch, so resuming or rolling back keeps exactly that checkpoint's evaluations
        self.log.eval_record(tag, self.global_step, out, epoch=int(checkpoint.removeprefix("epoch_")) - 1,
                             checkpoint=checkpoint, progress=self.progress())
        return out

    # ------------------------------------------------------------------------------------------------------
    # state: resume, checkpoints, selection, report

    def resume_or_start(self) -> dict:
        """Resume from `latest` (or, when it is corrupt, the newest intact checkpoint below it), or evaluate the base
        and save it as the first healthy checkpoint with that evaluation sealed in; returns the base's evaluation,
        which a resumed run reads from its checkpoint and never recomputes from weights that are not the base."""
        newest = pointed_checkpoint(self.ckpt_root, self.log.info) if self.config.resume else None
        self.resumed_from = None
        if newest is None:
            self.evaluate_references()
            summary = self.evaluate("start", "epoch_0000")
            self.base_record = {"type": "eval", "tag": "start", "step": self.global_step, "epoch": -1,
                                "checkpoint": "epoch_0000", **summary, **self.progress()}
            if self.accelerator.is_main_process:
                self.save(0)
            self.accelerator.wait_for_everyone()
            return summary
        ckpt = self.load(newest)
        self.check_resume(ckpt)
        self.epoch, self.global_step = ckpt.state["epoch"], ckpt.state["global_step"]
        # The guard compares each step with the ones before it since the last rollback (a reward collapse is a drop
        # from the best epoch so far): a resumed run that forgot them would let pass what the uninterrupted run
        # rolls back. Checkpoints written before the guard's state was saved resume with an empty history.
        guard = ckpt.state.get("guard", {})
        self.history, self.rollbacks = list(guard.get("history", [])), int(guard.get("rollbacks", 0))
        # the budget so far; checkpoints written before it was saved resume from zero
        budget = ckpt.state.get("budget", {})
        self.train_seconds = float(budget.get("train_seconds", 0.0))
        self.nfe_sampling_total = int(budget.get("nfe_sampling_total", 0))
        self.nfe_training_total = int(budget.get("nfe_training_total", 0))
        every = self.config.eval.every_seconds
        self.next_time_eval = float(budget.get("next_time_eval", (math.floor(self.train_seconds / every) + 1) * every
                                               if every > 0 else 0.0))
        self.time_eval_due = budget.get("time_eval_due")
        self.resumed_from = ckpt.path
        self.base_record = self.base_evaluation(ckpt)
        self.log.truncate_after(self.epoch, base_record=self.base_record)
        self.log.info(f"resumed from {ckpt.path} at epoch {self.epoch}, global step {self.global_step}")
        self.accelerator.wait_for_everyone()
        return {k: v for k, v in self.base_record.items() if k not in ("type", "tag", "step", "epoch", "checkpoint")}

    def base_evaluation(self, ckpt: Checkpoint) -> dict:
        """The base's "start" evaluation record: sealed in the checkpoint, or (a checkpoint from before that) the
        log's; evaluating now would measure the resumed weights and call them the base, so without either the
        resume is refused."""
        logged = next((r for r in runlog.read_records(self.log.path)
                       if r.get("type") == "eval" and r.get("tag") == "start"), None)
        if ckpt.base_eval is not None:
            if logged is not None and logged != ckpt.base_eval:
                self.log.info(f"{self.log.path}'s start evaluation differs from {ckpt.path / BASE_EVAL}; the summary "
                              "uses the checkpoint's")
            return ckpt.base_eval
        if logged is not None:
            return logged
        if ckpt.state["epoch"] == 0:  # the weights in memory are the base's
            summary = self.evaluate("start", ckpt.path.name)
            return {"type": "eval", "tag": "start", "step": self.global_step, "epoch": -1,
                    "checkpoint": ckpt.path.name, **summary, **self.progress()}
        raise ResumeMismatch(f"refusing to resume from {ckpt.path}: neither it (no {BASE_EVAL}) nor {self.log.path} "
                             "holds the base's evaluation, and the resumed weights are not the base's")

    def check_resume(self, ckpt: Checkpoint) -> None:
        """Refuse a resume whose state.json disagrees with the checkpoint's own name and sampler position, or with the
        training that metrics.jsonl records before it."""
        state, source = ckpt.state, ckpt.path / "state.json"
        epoch, step = state["epoch"], state["global_step"]
        problems = []
        named = epoch_of(ckpt.path)
        if named is not None and named != epoch:
            problems.append(f"it says epoch {epoch} in folder {ckpt.path.name}")
        per_epoch = self.config.sample.num_batches_per_epoch
        if state.get("sampler_position", epoch * per_epoch) != epoch * per_epoch:
            problems.append(f"its sampler_position {state['sampler_position']} is not epoch {epoch} x {per_epoch} "
                            "batches per epoch")
        trained = [r for r in runlog.read_records(self.log.path) if r.get("type") in ("epoch", "step")
                   and isinstance(r.get("epoch"), int) and r["epoch"] < epoch]
        if trained:
            last_epoch = max(r["epoch"] for r in trained)
            last_step = max((r["step"] for r in trained if r["type"] == "step" and isinstance(r.get("step"), int)),
                            default=0)
            if last_epoch != epoch - 1:
                problems.append(f"it says {epoch} epochs are done, {self.log.path} records training up to epoch "
                                f"{last_epoch}")
            if last_step != step:
                problems.append(f"it says global step {step}, {self.log.path} records step {last_step} before epoch "
                                f"{epoch}")
        elif epoch > 0:
            self.log.info(f"{self.log.path} records no training before epoch {epoch}: the resume is checked against "
                          f"{ckpt.path.name} alone")
        if problems:
            raise ResumeMismatch(f"refusing to resume from {source}: " + "; ".join(problems))

    def eval_missed_at_resume(self) -> None:
        """The run died between a checkpoint and its evaluation (an epoch's, or a time grid point's): evaluate it
        now."""
        ckpt, cfg, e = self.resumed_from, self.config, self.epoch
        if ckpt is not None and 0 < e < cfg.num_epochs and e % cfg.eval.freq == 0 \
                and self.log.read_eval(f"epoch_{e:04d}") is None:
            self.evaluate(f"epoch_{e:04d}", ckpt.name)
        if ckpt is not None and self.time_eval_due and self.log.read_eval(self.time_eval_due) is None:
            self.evaluate(self.time_eval_due, ckpt.name)

    def save(self, epoch: int, protect: tuple[str, ...] = ()) -> None:
        """Checkpoint at an epoch boundary: only healthy states get here; `protect`: never pruned. Every checkpoint
        carries the base's evaluation, so that pruning epoch_0000 does not lose it."""
        state = {"epoch": epoch, "global_step": self.global_step,
                 "sampler_position": epoch * self.config.sample.num_batches_per_epoch,
                 "learning_rate": self.optimizer.param_groups[0]["lr"], "healthy": True,
                 "guard": {"history": self.history, "rollbacks": self.rollbacks},
                 "budget": {**self.progress(), "next_time_eval": self.next_time_eval,
                            "time_eval_due": self.time_eval_due}}
        for h in self.hooks:
            if h.state_key:
                state[h.state_key] = h.state_dict()
        side_files = {BASE_EVAL: self.base_record}
        if self.old_policy is not None:
            side_files[OLD_POLICY] = {"decay": self.config.train.old_policy_decay,
                                      "tensors": encode_tensors(self.old_policy_tensors())}
        save_checkpoint(self.ckpt_root, f"epoch_{epoch:04d}", self.model, self.optimizer, self.ema, state,
                        keep=self.config.keep_checkpoints, protect=protect, side_files=side_files)

    def load(self, newest: Path, lr_factor: float = 1.0) -> Checkpoint:
        """Restore weights, optimizer, EMA, RNG and hook state from checkpoint `newest`, or, when it fails its
        checks, from the newest intact one below it (`latest` then points there); returns the checkpoint read."""
        ckpt = read_intact(self.ckpt_root, newest, self.model, self.log.info)
        self.previous_grads = None  # a gradient of weights that are no longer the policy's
        if read_pointer(self.ckpt_root) != ckpt.path.name and self.accelerator.is_main_process:
            point_latest(self.ckpt_root, ckpt.path.name)  # a crash from here on resumes from the intact one
        state, trainer = ckpt.state, ckpt.trainer
        for h in self.hooks:
            if h.state_key and h.state_key in state:
                h.load_state_dict(state[h.state_key])
        apply_model_weights(self.model, ckpt.weights, ckpt.weights_path)
        self.optimizer.load_state_dict(trainer["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"] = state["learning_rate"] * lr_factor
        if self.ema is not None and trainer["ema"] is not None:
            self.ema.load_state_dict(trainer["ema"])
        self.load_old_policy(ckpt)
        set_rng_state(trainer["rng"])
        return ckpt

    # ------------------------------------------------------------------------------------------------------
    # the old policy of forward-process objectives

    def trainable(self, copy_of_policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A copy's parameters at the policy's trainable names (the frozen rest equals the policy's), detached."""
        params = dict(copy_of_policy.named_parameters())
        return {n: params[n].detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def old_policy_tensors(self) -> dict[str, torch.Tensor]:
        """The old policy's copies of the trainable parameters."""
        return self.trainable(self.old_policy)

    def update_old_policy(self) -> float | None:
        """old = d x old + (1 - d) x policy, d = old_policy_decay_at(optimizer steps so far); returns d (None
        without an old policy)."""
        if self.old_policy is None:
            return None
        t = self.config.train
        decay = old_policy_decay_at(self.global_step, t.old_policy_decay, t.old_policy_decay_ramp)
        blend_into(list(self.old_policy_tensors().values()), list(self.trainable(self.model).values()), decay)
        return decay

    def load_old_policy(self, ckpt: Checkpoint) -> None:
        """The old policy as saved with the checkpoint (its side file is sealed in the manifest); a checkpoint
        without one (written by a run without an old policy) starts it from the restored policy."""
        if self.old_policy is None:
            return
        path = ckpt.path / OLD_POLICY
        old = self.old_policy_tensors()
        if not path.exists():
            self.log.info(f"{ckpt.path} holds no {OLD_POLICY}: the old policy starts from the restored policy")
            live = dict(self.model.named_parameters())
            blend_into(list(old.values()), [live[n].detach() for n in old], 0.0)
            return
        try:
            saved = decode_tensors(json.loads(path.read_bytes())["tensors"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e
        if sorted(saved) != sorted(old) or any(saved[n].shape != old[n].shape for n in old):
            raise CheckpointCorrupt(f"{path} does not hold this run's trainable parameters")
        if not all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point()):
            raise CheckpointCorrupt(f"{path} holds non-finite values")
        blend_into(list(old.values()), [saved[n] for n in old], 0.0)

    def selected_eval(self) -> dict | None:
        """The evaluation record the run reports (eval.select_by on val/...), or None when it reports its end."""
        if self.val_set is None or not self.accelerator.is_main_process:  # only the main process reports
            return None
        e = self.config.eval
        evals = self.log.read_evals()
        return evals[select_checkpoint(evals, f"val/{e.select_by}", f"val/{e.select_guard}" if e.select_guard else "",
                                       e.select_max_drop)]

    def report(self, eval_before: dict, eval_after: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        if self.selected is not None:
            point(self.ckpt_root, SELECTED, self.selected["checkpoint"])
        reports = runlog.write_reports(self.run_dir)
        e = self.config.eval
        rule = None
        if self.selected is not None:
            guard = f", {e.select_guard} at most {e.select_max_drop:g} below the base's" if e.select_guard else ""
            rule = f"best validation {e.select_by} over {len(self.val_set)} validation conditions{guard}"
        self.log.summary(eval_before, eval_after, extra_paths=reports,
                         note=None if self.budget_stop else self.stopped_by and f"stopped early: {self.stopped_by}",
                         budget=self.stopped_by if self.budget_stop else None, rollbacks=self.rollbacks,
                         selected=self.selected, selection=rule, rows=self.domain.summary_rows,
                         rewards=self.eval_reward_names,
                         examples=self.run_dir / self.domain.examples_dir)


def time_eval_tag(seconds: float) -> str:
    """time_NNNNNs for a whole number of seconds, time_NNNNN.NNNs otherwise (a grid finer than a second)."""
    return f"time_{int(seconds):05d}s" if float(seconds).is_integer() else f"time_{seconds:09.3f}s"


def old_policy_decay_at(step: int, decay: float, ramp: float) -> float:
    """The old policy's averaging weight after `step` optimizer steps: min(ramp x step, decay), DiffusionNFT's and
    AWM's schedule (their scripts: 0.001 per step, capped at 0.5 and 0.3), so that early on the old policy is the
    policy and it lags more as training settles; ramp 0 holds it at `decay` from the start."""
    return float(decay) if ramp <= 0 else min(float(ramp) * int(step), float(decay))


def blend_into(old: list[torch.Tensor], new: list[torch.Tensor], decay: float) -> None:
    """old = decay * old + (1 - decay) * new, in place; decay 0 copies new exactly."""
    with torch.no_grad():
        for o, n in zip(old, new, strict=True):
            if decay == 0:
                o.copy_(n)
            else:
                o.mul_(decay).add_(n.to(o.dtype), alpha=1.0 - decay)


def encode_tensors(tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors as JSON (dtype, shape, base64 of the raw bytes): exact, for a checkpoint's side files."""
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                "base64": base64.b64encode(v.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                .decode("ascii")}
            for k, v in tensors.items()}


def decode_tensors(encoded: dict) -> dict[str, torch.Tensor]:
    out = {}
    for k, e in encoded.items():
        raw, dtype = bytearray(base64.b64decode(e["base64"])), getattr(torch, e["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
        out[k] = flat.reshape(e["shape"])
    return out


def flat_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine between two parameter lists taken as one flat vector each; NaN when either is zero. Summed in fp32 on
    the tensors' device (NPUs lack fp64) and read back once."""
    pairs = list(zip(a, b, strict=True))
    if not pairs:
        return float("nan")
    dot, na, nb = torch.stack([sum((x.float() * y.float()).sum() for x, y in pairs),
                               sum((x.float() ** 2).sum() for x, _ in pairs),
                               sum((y.float() ** 2).sum() for _, y in pairs)]).tolist()
    return dot / math.sqrt(na * nb) if na > 0 and nb > 0 else float("nan")


def step_sample_weights(keep: torch.Tensor, positions: torch.Tensor, rank: int) -> torch.Tensor | None:
    """Per-sample loss weights (n,) of process `rank` for one optimizer step, or None when the step keeps nothing.

    keep: (P, n) bool, which samples each process keeps (every process knows all of it after the gather);
    positions: the local sample positions the step covers, the same on every process. Processes' gradients are
    averaged, so weight P / kept on each kept sample makes the step's gradient the mean over its kept samples on
    all processes, and every process computes the same `kept`, so all take the same steps.
    """
    kept = int(keep[:, positions].sum())
    if kept == 0:
        return None
    return keep[rank].float() * (keep.shape[0] / kept)


def trajectory_ids(g_index: torch.Tensor) -> torch.Tensor:
    """(N, 2) int64 [dataset index, copy number]: a key per trajectory that survives shuffles and splits."""
    seen: dict[int, int] = {}
    copies = []
    for i in g_index.tolist():
        copies.append(seen.get(i, 0))
        seen[i] = copies[-1] + 1
    return torch.stack([g_index.long(), torch.tensor(copies, dtype=torch.long)], 1)


@contextlib.contextmanager
def ema_weights(ema, model):
    """Evaluate with the EMA weights when EMA is on, restoring the live weights afterwards."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())
