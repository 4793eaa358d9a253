"""A run's checkpoints as the trainer uses them: start (resume from the newest intact checkpoint, or evaluate the
base and save it), save at an epoch boundary (only healthy states get there), restore (a damaged checkpoint is
skipped for the one below it), check a resume against the run's log, find the checkpoint a guard rolls back to,
and evaluate the weights a run ends with. The files' format and integrity checks are recam.infra.checkpoint's.

The loop's own numbers travel through a small interface, `Loop` below: the trainer says what its state is
(state / restore), this module decides when and where it is saved and restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from recam.engine.health import SAMPLE_RULES
from recam.infra import runlog, stop_signals
from recam.infra.checkpoint import (
    BASE_EVAL,
    RUN_CONFIG,
    Checkpoint,
    CheckpointCorrupt,
    ResumeMismatch,
    apply_model_weights,
    check_pointers,
    checkpoint_before,
    convert_legacy,
    convert_legacy_folders,
    epoch_of,
    latest_checkpoint,
    older_checkpoint,
    point_latest,
    pointed_checkpoint,
    read_intact,
    read_pointer,
    remove_leftovers,
    save_checkpoint,
    set_rng_state,
)
from recam.infra.distributed import load_optimizer_state, whole_optimizer_state, whole_weights


class Loop(Protocol):
    """What RunCheckpoints needs of the training loop."""

    epoch: int
    global_step: int
    selected: dict | None  # the evaluation record the run reports (its checkpoint is never pruned)
    rollbacks: int  # the guard's rollbacks over the run's life

    def state(self, epoch: int) -> dict: ...  # the loop's part of state.json

    def restore(self, state: dict) -> None: ...

    def load(self, newest: Path, lr: float | None = None) -> Checkpoint: ...

    def evaluate(self, tag: str, checkpoint: str) -> dict: ...


class RunCheckpoints:
    """root: the run's checkpoints folder; hooks' and the objective's states travel with every checkpoint.
    run: config's resume, num_epochs, save_freq and eval.freq; evaluator: recam.engine.evaluation.Evaluator.
    trust_legacy: config.trust_legacy_checkpoint (a checkpoint holding a pickle is read, and converted)."""

    def __init__(self, root: Path, accelerator, log, model, optimizer, ema, hooks: list, objective, keep: int,
                 batches_per_epoch: int, evaluator, budget, net=None, cosine=None, trust_legacy: bool = False):
        self.root, self.accelerator, self.log = root, accelerator, log
        self.model, self.optimizer, self.ema, self.hooks, self.objective = model, optimizer, ema, hooks, objective
        self.net = model if net is None else net  # the FSDP root, when sharded (recam.infra.distributed)
        self.keep, self.batches_per_epoch, self.evaluator, self.budget = keep, batches_per_epoch, evaluator, budget
        self.base_record: dict | None = None  # the base's "start" evaluation record, sealed in every checkpoint
        self.resumed_from: Path | None = None
        self.run_config: dict | None = None  # the config as asked for and its resume history (seal_config)
        self.lr_scale = 1.0
        self.cosine = cosine  # the gradient cosine's last gradient, so a resumed run logs what an unbroken one does
        self.trust_legacy = trust_legacy
        self.legacy_swept = False  # the other checkpoints of a trusted run folder are converted once

    def seal_config(self, run_config: dict, lr_scale: float = 1.0) -> None:
        """Seal `run_config` in every checkpoint from now on (what a later resume compares with); lr_scale: a
        learning rate changed on resume, applied to the resumed optimizer (whose rate a rollback may have cut)."""
        self.run_config, self.lr_scale = run_config, lr_scale

    # ---- a run's start and end

    def start(self, loop: Loop, resume: bool) -> dict:
        """Resume from `latest` (or, when it is corrupt, the newest intact checkpoint below it), or evaluate the base
        and save it as the first healthy checkpoint with that evaluation sealed in; returns the base's evaluation,
        which a resumed run reads from its checkpoint and never recomputes from weights that are not the base."""
        check_pointers(self.root)  # a pointer that is a folder could not be rewritten at the first save
        if self.accelerator.is_main_process and (gone := remove_leftovers(self.root)):
            self.log.info(f"removed what an interrupted save left in {self.root}: {', '.join(gone)}")
        newest = self.newest() if resume else None
        if newest is None:
            if self.log.path.exists() and self.log.path.stat().st_size:  # a start killed before its checkpoint, or
                self.log.archive_all("a fresh start: no checkpoint to resume from")  # an earlier run's records
            self.evaluator.evaluate_references(loop.global_step)
            summary, self.base_record = self.base_eval_record(loop, "epoch_0000")
            self.save(loop.state(0), self.base_record)
            self.accelerator.wait_for_everyone()
            return summary
        ckpt = loop.load(newest)
        self.check_resume(ckpt)
        loop.restore(ckpt.state)
        for group in self.optimizer.param_groups:
            group["lr"] *= self.lr_scale
        if self.cosine is not None and ckpt.trainer.get("gradient") is not None:
            self.cosine.previous = [g.to(self.accelerator.device) for g in ckpt.trainer["gradient"]]
        self.resumed_from = ckpt.path
        self.base_record = self.base_evaluation(ckpt, lambda: self.base_eval_record(loop, ckpt.path.name)[1])
        self.log.truncate_after(loop.epoch, base_record=self.base_record)
        self.log.info(f"resumed from {ckpt.path} at epoch {loop.epoch}, global step {loop.global_step}")
        self.accelerator.wait_for_everyone()
        return {k: v for k, v in self.base_record.items() if k not in ("type", "tag", "step", "epoch", "checkpoint")}

    def base_eval_record(self, loop: Loop, checkpoint: str) -> tuple[dict, dict]:
        """The evaluation of the weights in memory, the base's, and its "start" record."""
        summary = self.evaluator.evaluate("start", checkpoint, loop.global_step, self.budget.progress())
        return summary, {"type": "eval", "tag": "start", "step": loop.global_step, "epoch": -1,
                         "checkpoint": checkpoint, **summary, **self.budget.progress()}

    def eval_missed_at_resume(self, loop: Loop, num_epochs: int, eval_freq: int) -> None:
        """The run died between a checkpoint and its evaluation (an epoch's, or a time grid point's): evaluate it
        now."""
        ckpt, e, due = self.resumed_from, loop.epoch, self.budget.time_eval_due
        if ckpt is not None and 0 < e < num_epochs and e % eval_freq == 0 \
                and self.log.read_eval(f"epoch_{e:04d}") is None:
            loop.evaluate(f"epoch_{e:04d}", ckpt.name)
        if ckpt is not None and due and self.log.read_eval(due) is None:
            loop.evaluate(due, ckpt.name)

    def epoch_end(self, loop: Loop, save_freq: int, last: bool) -> None:
        """Save the state at an epoch boundary (every save_freq epochs and the run's last, whose weights are the
        final ones): only healthy states get here."""
        acc = self.accelerator
        acc.wait_for_everyone()
        if loop.epoch % save_freq == 0 or last:
            self.save(loop.state(loop.epoch), self.base_record,
                      protect=(loop.selected["checkpoint"],) if loop.selected else ())
        acc.wait_for_everyone()

    def final_evaluation(self, loop: Loop, finished: dict | None) -> dict:
        """The evaluation of the weights the run ends with (a stopped run holds those of `latest`). A run directory
        that had already finished (`finished`: its final record, None when this invocation trained) is not
        evaluated again: its final record is reported as it was, and said so."""
        if finished is not None and self.resumed_from is not None:
            self.log.info(f"this run had already finished at epoch {loop.epoch}: its final evaluation is reported as "
                          "logged, not redone (raise num_epochs or use a new run_dir to train further)")
            summary = {k: v for k, v in finished.items() if k != "checkpoint"}
            self.log.eval_record("final", loop.global_step, summary, epoch=loop.epoch - 1,
                                 checkpoint=finished.get("checkpoint", ""))
            return summary
        return self.evaluator.evaluate("final", latest_checkpoint(self.root).name, loop.global_step,
                                       self.budget.progress())

    # ---- checkpoints

    def save(self, state: dict, base_record: dict, protect: tuple[str, ...] = ()) -> None:
        """Checkpoint epoch_<state["epoch"]>, called by every process (under FSDP they gather the weights and the
        optimizer state together), written by the main one; `protect`: never pruned. Every checkpoint carries the
        base's evaluation, so that pruning epoch_0000 does not lose it."""
        optimizer_state = whole_optimizer_state(self.net, self.optimizer)  # None: not sharded
        with whole_weights(self.net):
            if not self.accelerator.is_main_process:
                return
            state = dict(state)
            for h in self.hooks:
                if h.state_key:
                    state[h.state_key] = h.state_dict()
            side_files = {BASE_EVAL: base_record, **self.objective.side_files()}
            if self.run_config is not None:
                side_files[RUN_CONFIG] = self.run_config
            # a sharded gradient is one shard per process, and only this one writes: such a run starts it afresh
            cos = self.cosine
            gradient = cos.previous if cos is not None and cos.reduce is None else None
            with stop_signals.deferred():  # a SIGTERM mid-write would cost the epoch's checkpoint
                save_checkpoint(self.root, f"epoch_{state['epoch']:04d}", self.model, self.optimizer, self.ema,
                                state, keep=self.keep, protect=protect, side_files=side_files,
                                optimizer_state=optimizer_state, extra={"gradient": gradient})

    def load(self, newest: Path, lr: float | None = None) -> Checkpoint:
        """Restore weights, optimizer, EMA, RNG, hook and objective state from checkpoint `newest`, or, when it fails
        its checks, from the newest intact one below it (`latest` then points there); returns the checkpoint read.
        lr: the learning rate from here on (a rollback's: the rate before it times the factor, whichever checkpoint
        is restored, so that each rollback lowers it once), else the checkpoint's."""
        while True:
            ckpt = read_intact(self.root, newest, self.model, self.log.info, self.trust_legacy)
            try:
                with whole_weights(self.net, write=True):
                    apply_model_weights(self.model, ckpt.weights, ckpt.weights_path)
                break
            except ValueError as e:
                # sealed, intact, but its tensors do not fit this model (a shape, a tensor missing or extra): as
                # unusable as a corrupt one, and the one below it is tried the same way. What the failed load
                # copied in is overwritten whole by the next.
                self.log.info(f"skipping corrupt checkpoint {ckpt.path.name}: {' '.join(str(e).split())}")
                newest = older_checkpoint(self.root, ckpt.path)
                if newest is None:
                    raise CheckpointCorrupt(f"no intact checkpoint under {self.root}: {ckpt.path.name}: "
                                            f"{' '.join(str(e).split())}") from e
        if read_pointer(self.root) != ckpt.path.name and self.accelerator.is_main_process:
            point_latest(self.root, ckpt.path.name)  # a crash from here on resumes from the intact one
        state, trainer = ckpt.state, ckpt.trainer
        for h in self.hooks:
            if h.state_key and h.state_key in state:
                h.load_state_dict(state[h.state_key])
        load_optimizer_state(self.net, self.optimizer, trainer["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"] = state["learning_rate"] if lr is None else lr
        if self.ema is not None and trainer["ema"] is not None:
            self.ema.load_state_dict(trainer["ema"])
        self.objective.load_side_files(ckpt.path, self.log.info)
        set_rng_state(trainer["rng"])
        sweep = self.trust_legacy and not self.legacy_swept
        if ckpt.legacy or sweep:  # once every process has read it: a folder is swapped while being rewritten
            self.legacy_swept = True
            self.accelerator.wait_for_everyone()
            if self.accelerator.is_main_process:
                if ckpt.legacy:
                    convert_legacy(ckpt.path, trainer)
                    self.log.info(f"converted {ckpt.path} to the pickle-free layout ({ckpt.path / 'trainer.pt'} -> "
                                  "trainer.safetensors + trainer.json): trust_legacy_checkpoint is no longer needed "
                                  "for it")
                if sweep:  # else a fallback to one of them, later, would stop to ask for the setting again
                    convert_legacy_folders(self.root, self.log.info)
            self.accelerator.wait_for_everyone()
        return ckpt

    def record_rollback(self, loop: Loop, restored: Path) -> None:
        """Save the checkpoint a rollback restored (`restored`, now the loop's state) again, with the loop's rollback
        count and lowered learning rate, and say so: the count then holds for the run's life (health.max_rollbacks
        counts every invocation's rollbacks, not this one's), and a resume goes on at the rate the rollback set, as
        the unbroken run does."""
        self.save(loop.state(loop.epoch), self.base_record,
                  protect=(loop.selected["checkpoint"],) if loop.selected else ())
        self.log.info(f"rolled back to {restored} (epoch {loop.epoch}, step {loop.global_step}), learning rate now "
                      f"{self.optimizer.param_groups[0]['lr']:.3g}; rollbacks so far: {loop.rollbacks}")

    def newest(self) -> Path | None:
        return pointed_checkpoint(self.root, self.log.info)

    def rollback_target(self, critical: list, epoch: int) -> Path:
        """The checkpoint a guard restores: `latest`, or, when the samples collapsed (they were drawn by the weights
        in `latest`), the one before it (`latest` then points there). load() skips a damaged one."""
        healthy = self.newest()
        if any(f.rule in SAMPLE_RULES for f in critical):
            older = checkpoint_before(self.root, epoch)
            if older is None:
                self.log.info(f"no checkpoint older than epoch {epoch} is kept (config.keep_checkpoints); "
                              f"restoring {healthy}, whose weights drew the collapsed samples")
            else:
                healthy = older
                if self.accelerator.is_main_process:
                    point_latest(self.root, older.name)  # a crash from here on resumes from the good one
                self.accelerator.wait_for_everyone()
        return healthy

    def check_resume(self, ckpt: Checkpoint) -> None:
        """Refuse a resume whose state.json disagrees with the checkpoint's own name and sampler position, or with the
        training that metrics.jsonl records before it."""
        state, source, log_path = ckpt.state, ckpt.path / "state.json", self.log.path
        epoch, step = state["epoch"], state["global_step"]
        problems = []
        named = epoch_of(ckpt.path)
        if named is not None and named != epoch:
            problems.append(f"it says epoch {epoch} in folder {ckpt.path.name}")
        per_epoch = self.batches_per_epoch
        if state.get("sampler_position", epoch * per_epoch) != epoch * per_epoch:
            problems.append(f"its sampler_position {state['sampler_position']} is not epoch {epoch} x {per_epoch} "
                            "batches per epoch")
        trained = [r for r in runlog.read_records(log_path) if r.get("type") in ("epoch", "step")
                   and isinstance(r.get("epoch"), int) and r["epoch"] < epoch]
        if trained:
            last_epoch = max(r["epoch"] for r in trained)
            last_step = max((r["step"] for r in trained if r["type"] == "step" and isinstance(r.get("step"), int)),
                            default=0)
            if last_epoch != epoch - 1:
                problems.append(f"it says {epoch} epochs are done, {log_path} records training up to epoch "
                                f"{last_epoch}")
            if last_step != step:
                problems.append(f"it says global step {step}, {log_path} records step {last_step} before epoch "
                                f"{epoch}")
        elif epoch > 0:
            self.log.info(f"{log_path} records no training before epoch {epoch}: the resume is checked against "
                          f"{ckpt.path.name} alone")
        if problems:
            raise ResumeMismatch(f"refusing to resume from {source}: " + "; ".join(problems))

    def base_evaluation(self, ckpt: Checkpoint, evaluate_base) -> dict:
        """The base's "start" evaluation record: sealed in the checkpoint, or (a checkpoint from before that) the
        log's; evaluating now would measure the resumed weights and call them the base, so without either the
        resume is refused. evaluate_base(): the record of evaluating the weights in memory, when they are the
        base's (a checkpoint of epoch 0)."""
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
            return evaluate_base()
        raise ResumeMismatch(f"refusing to resume from {ckpt.path}: neither it (no {BASE_EVAL}) nor {self.log.path} "
                             "holds the base's evaluation, and the resumed weights are not the base's")
