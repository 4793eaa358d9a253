"""The GRPO loop: one epoch is sample -> score -> advantages -> update -> guard -> checkpoint -> evaluate, each
phase a method over the typed containers of recam.engine.containers. The trainer knows a domain only through
recam.engine.domain.Domain, an algorithm only through its objective (recam.engine.objective), and side concerns
through hooks and its components: budget, evaluation (and selection), run_checkpoints (and resume), health (the
guard's rules and the gradient cosine) and noise_scale (each update's gradient noise scale).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from recam.engine import records
from recam.engine.advantages import (
    broadcast_over_timesteps,
    local_slice,
    nonzero_group_mask,
    placebo_advantages,
    step_sample_weights,
    trajectory_ids,
)
from recam.engine.budget import RunBudget
from recam.engine.containers import EpochResult, Groups, Rollouts, Scores, StepStats
from recam.engine.domain import decode, element_mask, exploration_scheduler
from recam.engine.evaluation import Evaluator
from recam.engine.health import GradientCosine, diagnose_step, findings_record, nonfinite_findings, reward_signal
from recam.engine.hooks import run_hooks
from recam.engine.noise_scale import NoiseScale
from recam.engine.objective import MicroBatch, accumulating_backward, build_objective
from recam.engine.plan import RunNumbers
from recam.engine.policy import build_policy, refuse_sharded_copies
from recam.engine.reward_runner import (
    AsyncRewardRunner,
    RewardServerDown,
    exclusion_mask,
    gather_details,
    masked_group_advantages,
)
from recam.engine.rollout import INITIAL_NOISE_STREAM, noise_source, rollout, solver_options
from recam.engine.run_checkpoints import RunCheckpoints
from recam.engine.sampler import KRepeatBatchSampler
from recam.infra.checkpoint import latest_checkpoint, nonfinite_tensors
from recam.infra.distributed import clip_gradients, forward_module, sum_over_shards, union_over_processes


class GRPOTrainer:
    def __init__(self, config, domain, accelerator, log, numbers: RunNumbers, report_rewards: tuple[str, ...] = ()):
        self.config, self.domain, self.accelerator, self.log, self.numbers = config, domain, accelerator, log, numbers
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.run_dir = Path(config.run_dir)
        t, s = config.train, config.sample

        # ---- data, policy (+ LoRA or a frozen reference copy), optimizer, rewards ----
        splits = domain.datasets()
        self.train_set, self.heldout, self.val_set = splits.train, splits.heldout, splits.val
        log.detail(f"data ({config.domain} domain): {len(self.train_set)} training / {len(self.heldout)} held-out"
                   + (f" / {len(self.val_set)} validation conditions" if self.val_set is not None else " conditions"))
        policy, self.reference, optimizer, self.ema = build_policy(domain, config.model, t, accelerator.device)
        self.use_lora = config.model.lora_rank > 0
        weights, r = dict(config.reward.weights), config.reward
        eval_reward_fn = domain.reward_fn(weights, report=report_rewards)
        eval_reward_names = tuple(dict.fromkeys([*(n for n, w in weights.items() if w > 0), *report_rewards]))
        self.runner = AsyncRewardRunner(domain.reward_fn(weights), r.async_workers, r.failure_policy, r.max_retries,
                                        r.retry_backoff_s)
        self.hooks = run_hooks(domain.hooks(), weights, r, config.debug)

        self.policy, self.optimizer = accelerator.prepare(policy, optimizer)
        self.model = accelerator.unwrap_model(self.policy)  # for its parameters, state and adapter switches
        self.net = forward_module(self.policy, self.model)  # for forward passes besides the trained one
        self.optimizer.zero_grad(set_to_none=True)  # whatever built the policy leaves no gradient in step 1
        self.autocast = accelerator.autocast if config.mixed_precision != "no" else contextlib.nullcontext
        scheduler = exploration_scheduler(domain, config.domain, s.noise_frequencies, s.noise_channels,
                                          accelerator.device)
        T = numbers.plan.trained_steps  # the window's size, the timestep_fraction rule, or 0 without log-probs
        self.scheduler = scheduler if scheduler.num_train_steps == T else scheduler.with_train_steps(T)
        self.objective = build_objective(t, self.scheduler, self.model)
        refuse_sharded_copies(self.policy, self.world_size, t, self.ema, self.objective.frozen_models())

        # ---- components ----
        self.sample_shape = domain.sample_shape()
        self.budget = RunBudget(config.max_train_seconds, config.eval.every_seconds, accelerator)
        self.evaluator = Evaluator(config.eval, domain, self.model, self.ema, self.scheduler.with_steps(
            s.eval_num_steps), eval_reward_fn, eval_reward_names, splits, accelerator, log, self.run_dir,
            self.autocast, self.sample_shape, net=self.net)
        self.gradient_cosine = GradientCosine(sum_over_shards(self.policy)) if t.log_gradient_cosine else None
        self.noise = NoiseScale.of(t.noise_scale, self.policy, accelerator)  # its running means: saved as a hook's
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", accelerator, log, self.model, self.optimizer,
                                          self.ema, [*self.hooks, self.noise], self.objective, config.keep_checkpoints,
                                          s.num_batches_per_epoch, self.evaluator, self.budget, self.net,
                                          self.gradient_cosine, trust_legacy=config.trust_legacy_checkpoint)
        self.sampler = KRepeatBatchSampler(len(self.train_set), s.batch_size, s.k, self.world_size, self.rank,
                                           config.seed, s.num_batches_per_epoch)
        self.epoch_cache: dict = {}  # work shared by sampling and training within one epoch, renewed by sample()
        self.epoch, self.global_step, self.rollbacks, self.stopped_by = 0, 0, 0, None
        self.history: list[dict] = []  # recent step metrics with their epoch's reward signal, for the guard
        self.selected, self.budget_stop = None, False

    # ------------------------------------------------------------------------------------------------------
    # the loop

    def train(self) -> str | None:
        """Run to config.num_epochs (or a stop); returns why the run stopped early, or None. Reaching
        max_train_seconds is the run's planned end: self.stopped_by says so, and None is returned."""
        cfg, budget = self.config, self.budget
        finished = self.log.read_eval("final")  # read before a resume drops it from the log
        eval_before = self.checkpoints.start(self, cfg.resume)  # the base's evaluation: made once, then read back
        if self.epoch < cfg.num_epochs and not budget.spent():
            finished = None  # this invocation trains: its end is evaluated anew
        self.checkpoints.eval_missed_at_resume(self, cfg.num_epochs, cfg.eval.freq)
        self.selected = self.evaluator.selected()  # its checkpoint is never pruned
        while self.epoch < cfg.num_epochs:
            if budget.spent():
                self.budget_stop = True
                self.stopped_by = (f"max_train_seconds={cfg.max_train_seconds:g} reached after epoch {self.epoch - 1} "
                                   f"({budget.train_seconds:.1f} s of training)")
                self.log.info(self.stopped_by)
                break
            # durations and the budget come from a monotonic clock: a wall clock stepped back (NTP, a VM
            # restore) would give negative epochs and a budget that never runs out
            epoch_t0 = time.perf_counter()
            budget.new_epoch()
            rollouts = self.sample(self.epoch)                       # 1. k copies per condition, with log-probs
            t_sampled = time.perf_counter()
            try:
                scores = self.score()                                # 2. rewards (scored while sampling went on)
            except RewardServerDown as e:
                self.stopped_by = f"reward server down at epoch {self.epoch}: {e}"
                self.log.info(f"{self.stopped_by}; checkpoint {latest_checkpoint(self.checkpoints.root)} is intact")
                self.evaluator.skip_served_rewards()
                break
            t_scored = time.perf_counter()
            groups = self.advantages(rollouts, scores)               # 3. gather, group-relative advantages
            record = self.epoch_record(rollouts, scores, groups)
            signal = reward_signal(record)                           # the guard's reward rules compare epochs
            t_update = time.perf_counter()
            result = self.update(rollouts, groups, signal)          # 4. clipped-ratio policy updates with KL
            record["old_policy_decay"] = self.objective.after_epoch(self.global_step)
            t_updated = time.perf_counter()
            record |= {"optimizer_steps": [st.metrics for st in result.steps], **self.noise.record()}
            # every objective's ratio is against the weights that sampled: its first step's ratio is 1
            record["first_step_ratio_deviation"] = result.first_step_ratio_deviation
            record.update(budget.epoch_record(rollouts.start, t_sampled - epoch_t0, t_scored - t_sampled,
                                              t_updated - t_update))
            record.update(budget.add_epoch(time.perf_counter() - epoch_t0))  # evaluations and checkpoints never count
            self.log.epoch_record(record)
            self.log.info(records.epoch_line(record))
            critical = result.critical or self.nonfinite_state()
            if critical:                                             # 5. guard: never checkpoint a broken epoch
                if self.guard(critical) == "stop":
                    break
                continue
            for h in self.hooks:
                h.epoch_done(groups)
            self.epoch += 1
            budget.time_eval_due = budget.crossed_time_grid()
            self.checkpoints.epoch_end(self, cfg.save_freq,          # 6. checkpoint, 7. evaluate
                                       last=self.epoch == cfg.num_epochs or budget.spent())
            if self.epoch % cfg.eval.freq == 0 and self.epoch != cfg.num_epochs:
                self.evaluate(f"epoch_{self.epoch:04d}", f"epoch_{self.epoch:04d}")
            if budget.time_eval_due:
                self.evaluate(budget.time_eval_due, f"epoch_{self.epoch:04d}")
        self.runner.close()
        eval_after = self.checkpoints.final_evaluation(self, finished)
        self.selected = self.evaluator.selected()
        if self.accelerator.is_main_process:
            self.evaluator.report(eval_before, eval_after, self.selected, self.checkpoints.root, self.rollbacks,
                                  self.stopped_by, self.budget_stop, placebo=cfg.advantage.placebo)
        return None if self.budget_stop else self.stopped_by

    # ------------------------------------------------------------------------------------------------------
    # phases

    def sample(self, epoch: int) -> Rollouts:
        """k copies of each condition of this process's batches; rewards are submitted as each batch finishes."""
        s, model = self.config.sample, self.objective.sampling_model(self.model).eval()
        model = self.net if model is self.model else model  # under FSDP the passes enter at the root
        self.epoch_cache = {}  # this epoch's shared work (e.g. encoded source videos), for sampling and training
        index, states, log_probs, decoded, finals, means = [], [], [], [], [], []
        keep_decoded = any(getattr(h, "needs_samples", False) for h in self.hooks)
        start = self.numbers.plan.start(epoch, self.config.seed)
        for b in tqdm(range(s.num_batches_per_epoch), desc=f"epoch {epoch} sampling", disable=not self.log.enabled,
                      leave=False):
            position = epoch * s.num_batches_per_epoch + b
            indices = self.sampler.batch_at(position)
            batch = self.domain.collate(self.train_set, indices, self.epoch_cache)
            keys = [(self.config.seed, position, self.rank * s.batch_size + n) for n in range(len(indices))]
            # one start per condition and epoch, shared by its k copies on every process
            starts = [(self.config.seed, epoch, int(i), INITIAL_NOISE_STREAM) for i in indices]
            dev, store = self.accelerator.device, getattr(self.objective, "needs_old_means", False)
            noise = noise_source(keys, self.scheduler.num_steps + 1, self.sample_shape, dev,
                                 starts if s.same_initial_noise else None)
            denoise = self.budget.counted(self.domain.denoiser(model, batch, self.autocast), "sampling")
            out = rollout(denoise, noise, self.scheduler, element_mask(self.domain, batch, dev), start=start,
                          store_means=store, **solver_options(s))
            samples = decode(self.domain, out.final, batch)  # rewards see what the domain decodes (pixels, motions)
            self.runner.submit(position, samples, batch.conditions)  # scored while the next batch samples
            index.append(torch.tensor(indices))
            states.append(out.states)  # kept where sampled: no round trip through the host
            log_probs.append(out.log_probs)
            finals.append(out.final)
            means += [] if out.means is None else [out.means]
            if keep_decoded:
                decoded.append(samples)
        return Rollouts(torch.cat(index), torch.cat(states), torch.cat(log_probs), decoded, start=start,
                        final=torch.cat(finals), means=torch.cat(means) if means else None)

    def score(self) -> Scores:
        """This process's rewards. A reward server found down on any process stops every process (the others
        would otherwise wait for it in the next gather)."""
        scores = self.runner.collect_scores(self.accelerator)
        for h in self.hooks:
            scores = h.adjust_scores(scores, self.rank, self.config.sample.batch_size)
        return scores

    def advantages(self, rollouts: Rollouts, scores: Scores) -> Groups:
        """Gather every process's samples (rank order), normalise rewards within each condition's group over the
        samples that are kept (a failed reward is excluded, never counted as a 0)."""
        acc, a = self.accelerator, self.config.advantage
        index = acc.gather(rollouts.index.to(acc.device)).cpu()
        rewards = {k: acc.gather(v.to(acc.device)).cpu() for k, v in scores.rewards.items()}
        valid = acc.gather(scores.valid.to(acc.device)).cpu().bool()
        keep, exclusion = exclusion_mask(valid, index, self.runner.exclusion_policy)
        for h in self.hooks:
            rewards = h.adjust_rewards(rewards)
        advantages, _, stats = masked_group_advantages(rewards["avg"], index, keep, a.std_mode, a.eps, a.unbiased_std)
        if a.placebo:  # the control: the same draws on every process, a new one each epoch
            advantages = placebo_advantages(advantages, index, keep, self.config.seed, self.epoch)
        if a.filter_zero_std:
            keep &= nonzero_group_mask(advantages, index)
        # one column per trained step; one for an objective that trains no stored step (T = 0)
        advantages = broadcast_over_timesteps(advantages, max(1, self.scheduler.num_train_steps))
        return Groups(index, rewards, keep, advantages, stats, exclusion, gather_details(scores.details, acc))

    def epoch_record(self, rollouts: Rollouts, scores: Scores, groups: Groups) -> dict:
        ids = [self.domain.condition_id(self.train_set, int(i)) for i in groups.index]
        return records.epoch_record(self.epoch, self.global_step, self.numbers.record(), ids, groups, scores.seconds,
                                    self.config.advantage.placebo,
                                    tuple(h.epoch_record(rollouts, groups, self.train_set) for h in self.hooks))

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
        order = self.noise.begin_epoch(groups.index.view(P, -1), keep_all, seed=cfg.seed * 7919 + self.epoch)
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
                for c, sel in self.noise.micro_batches(chunk, keep_all, self.rank):  # measures them as they go
                    # every step in `steps` was applied (a refused one ends the epoch): the policy's updates so far
                    mb = self.micro_batch(rollouts, sel, adv, traj, weight, inner, policy_updates=len(steps))
                    acc_metrics += self.objective.accumulate(mb, self.budget.timed(accumulating_backward(
                        self.accelerator, self.policy, last_micro_batch=c == len(chunk) - 1)))
                stats = self.optimizer_step(acc_metrics, signal, kept=int(keep_all[:, positions].sum()))
                steps.append(stats)
                bar.update(1)
                if not stats.applied:  # the guard refused it: the epoch ends here
                    bar.close()
                    self.objective.end_epoch()
                    return EpochResult(steps, [f for f in stats.findings if f.severity == "critical"])
        bar.close()
        self.objective.end_epoch()
        return EpochResult(steps)

    def micro_batch(self, rollouts: Rollouts, sel: torch.Tensor, adv, traj, weight, inner: int,
                    policy_updates: int = 0) -> MicroBatch:
        dev, t, dom, counted = self.accelerator.device, self.config.train, self.domain, self.budget.counted
        indices = [int(i) for i in rollouts.index[sel]]
        batch = dom.collate(self.train_set, indices, self.epoch_cache)
        reference = None
        if self.use_lora and t.beta > 0:
            reference = dom.denoiser(self.net, batch, self.autocast, adapter_off=True)
        elif self.reference is not None:
            reference = dom.denoiser(self.reference, batch, self.autocast)
        closures: dict[int, object] = {}  # one closure per frozen module (NFT's old policy is also its sampler)
        frozen = {name: closures.setdefault(id(module), counted(dom.denoiser(module, batch, self.autocast),
                                                                "training"))
                  for name, module in self.objective.frozen_models().items()}

        def policy_rows(rows: slice):
            rows_batch = dom.collate(self.train_set, indices[rows], self.epoch_cache)
            return counted(dom.denoiser(self.net, rows_batch, self.autocast), "training")
        return MicroBatch(rollouts.states[sel].to(dev), rollouts.log_probs[sel], adv[sel], weight[sel], traj[sel],
                          counted(dom.denoiser(self.policy, batch, self.autocast), "training"),
                          None if reference is None else counted(reference, "training"), inner, self.model,
                          policy_rows, element_mask(self.domain, batch, self.accelerator.device),
                          final=None if rollouts.final is None else rollouts.final[sel].to(dev),
                          old_means=None if rollouts.means is None else rollouts.means[sel].to(dev),
                          step_offset=rollouts.start, epoch=self.epoch, policy_updates=policy_updates, **frozen)

    def optimizer_step(self, acc_metrics: list[dict], signal: dict, kept: int = 0) -> StepStats:
        """Clip, average metrics over processes, ask the guard, and apply the update only if it found nothing
        critical (a broken step never reaches the weights). kept: the samples the step's gradient averages over
        (all processes)."""
        grad_norm = clip_gradients(self.accelerator, self.policy, self.config.train.max_grad_norm)
        cosine = self.gradient_cosine(self.policy.parameters()) if self.gradient_cosine is not None else None
        m = records.mean_over_processes(records.step_metrics(acc_metrics, float(grad_norm), kept, cosine,
                                                             self.optimizer.param_groups[0]["lr"]), self.accelerator)
        m = self.objective.finish_step_metrics(m)  # after the processes' mean: sums pool over all of them
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
            self.log.health_record(self.global_step, self.epoch, *findings_record(findings))
        for h in self.hooks:
            h.after_step(self.global_step)
        return StepStats(self.global_step, m, findings, applied)

    def guard(self, critical: list) -> str:
        """Stop, or roll back to the last healthy checkpoint at a lower learning rate, as health.action says;
        returns "stop" or "continue". A checkpoint that fails its checks is skipped for the intact one below it."""
        h = self.config.health
        self.log.info("health guard: " + "; ".join(f"{f.rule} ({f.severity})" for f in critical))
        healthy = self.checkpoints.rollback_target(critical, self.epoch)
        if h.action == "stop" or (h.action == "rollback" and self.rollbacks >= h.max_rollbacks):
            self.stopped_by = f"health guard, {critical[0].rule} at step {self.global_step}"
            healthy = self.load(healthy).path
            self.log.info(f"stopped; weights restored from the last healthy checkpoint {healthy}")
            return "stop"
        if h.action == "rollback":
            self.rollbacks += 1
            ckpt = self.load(healthy, lr=self.optimizer.param_groups[0]["lr"] * h.rollback_lr_factor)
            self.epoch, self.global_step = ckpt.state["epoch"], ckpt.state["global_step"]
            self.log.archive_after(self.epoch, reason=f"rollback {self.rollbacks}: {critical[0].rule}")
            self.selected = self.evaluator.selected()  # the rolled-back evaluations are no longer candidates
            self.history.clear()
            self.checkpoints.record_rollback(self, ckpt.path)  # the count then holds across invocations
            return "continue"
        self.epoch += 1  # action "warn": keep going, but this state is never saved as a checkpoint
        return "continue"

    def nonfinite_state(self) -> list:
        """A critical finding when the applied updates left NaN or inf in the weights, optimizer state or EMA. Every
        process checks its own copy (its shards, under FSDP) and all share the names, to take the path together."""
        bad = union_over_processes(nonfinite_tensors(self.model, self.optimizer, self.ema), self.world_size)
        findings = nonfinite_findings(bad)
        if findings:
            self.log.health_record(self.global_step, self.epoch, *findings_record(findings))
        return findings

    # ------------------------------------------------------------------------------------------------------
    # state: what a checkpoint records of the loop (the components save, restore and evaluate)

    def state(self, epoch: int) -> dict:
        """The loop's part of a checkpoint's state.json (hooks and the objective add their own)."""
        return {"epoch": epoch, "global_step": self.global_step,
                "sampler_position": epoch * self.config.sample.num_batches_per_epoch,
                "learning_rate": self.optimizer.param_groups[0]["lr"], "healthy": True,
                "guard": {"history": self.history, "rollbacks": self.rollbacks}, "budget": self.budget.state_dict()}

    def restore(self, state: dict) -> None:
        """The loop's part of a resumed checkpoint. The guard compares each step with the ones before it since the
        last rollback (a reward collapse is a drop from the best epoch so far): a resumed run that forgot them would
        let pass what the uninterrupted run rolls back. Checkpoints from before a field was saved resume without it."""
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        guard = state.get("guard", {})
        self.history, self.rollbacks = list(guard.get("history", [])), int(guard.get("rollbacks", 0))
        self.budget.load_state_dict(state.get("budget", {}))

    def load(self, newest: Path, lr: float | None = None):
        if self.gradient_cosine is not None:
            self.gradient_cosine.reset()  # a gradient of weights that are no longer the policy's
        return self.checkpoints.load(newest, lr)

    def evaluate(self, tag: str, checkpoint: str) -> dict:
        out = self.evaluator.evaluate(tag, checkpoint, self.global_step, self.budget.progress())
        self.selected = self.evaluator.selected()
        return out

