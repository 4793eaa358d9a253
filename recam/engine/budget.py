"""The time-to-reward budget of a run: training seconds (sampling, rewards, update; never evaluation or
checkpoints), denoiser evaluations per phase, the max_train_seconds stop, and the eval.every_seconds grid.

Every process must agree on all of it (a process that stops or evaluates alone hangs the others), so epoch times
are the slowest process's and evaluation counts are summed over processes.
"""

from __future__ import annotations

import math

import torch


class RunBudget:
    def __init__(self, max_train_seconds: float, every_seconds: float, accelerator):
        self.max_train_seconds, self.every_seconds, self.accelerator = max_train_seconds, every_seconds, accelerator
        self.nfe = {"sampling": 0, "training": 0}  # denoiser rows of this epoch on this process
        self.train_seconds, self.nfe_sampling_total, self.nfe_training_total = 0.0, 0, 0
        self.next_time_eval, self.time_eval_due = every_seconds, None

    def spent(self) -> bool:
        return self.max_train_seconds > 0 and self.train_seconds >= self.max_train_seconds

    def new_epoch(self) -> None:
        self.nfe = {"sampling": 0, "training": 0}

    def counted(self, denoise, phase: str):
        """denoise, counting each call as as many evaluations as it has rows. A domain that runs classifier-free
        guidance inside its closure (two passes per row) counts once: the count is of closure rows, which is what
        every run of one domain shares."""
        def call(x, t):
            self.nfe[phase] += int(x.shape[0])
            return denoise(x, t)
        return call

    def epoch_record(self, window_start: int, sampling: float, rewards: float, training: float) -> dict:
        """The epoch's phase times (this process's) and denoiser evaluations (summed over processes), and the run's
        totals after it. seconds_rewards is the wait in score(): rewards are computed while sampling goes on."""
        acc = self.accelerator
        counts = torch.tensor([self.nfe["sampling"], self.nfe["training"]], dtype=torch.long, device=acc.device)
        if acc.num_processes > 1:
            counts = acc.gather(counts[None]).sum(0)
        nfe_sampling, nfe_training = (int(c) for c in counts.cpu())
        self.nfe_sampling_total += nfe_sampling
        self.nfe_training_total += nfe_training
        return {"window_start": window_start, "seconds_sampling": sampling, "seconds_rewards": rewards,
                "seconds_training": training, "nfe_sampling": nfe_sampling, "nfe_training": nfe_training,
                "nfe_sampling_total": self.nfe_sampling_total, "nfe_training_total": self.nfe_training_total}

    def add_epoch(self, seconds: float) -> dict:
        """Count an epoch's wall time (the slowest process's, so every process agrees on the budget and the time
        grid); returns the record's epoch_seconds and train_seconds."""
        seconds = max_over_processes(seconds, self.accelerator)
        self.train_seconds += seconds
        return {"epoch_seconds": seconds, "train_seconds": self.train_seconds}

    def crossed_time_grid(self) -> str | None:
        """The tag of the eval.every_seconds grid point the cumulative training time has reached since the last one
        evaluated (the latest when it reached several in one epoch), or None; moves the grid past it. An epoch
        that was rolled back reaches nothing: its point waits for the next healthy epoch."""
        every = self.every_seconds
        if every <= 0 or self.train_seconds < self.next_time_eval:
            return None
        point = math.floor(self.train_seconds / every) * every
        self.next_time_eval = point + every
        return time_eval_tag(point)

    def progress(self) -> dict:
        """What every evaluation record carries: where in the run's budget it was taken."""
        return {"train_seconds": self.train_seconds, "nfe_sampling_total": self.nfe_sampling_total,
                "nfe_training_total": self.nfe_training_total}

    def state_dict(self) -> dict:
        return {**self.progress(), "next_time_eval": self.next_time_eval, "time_eval_due": self.time_eval_due}

    def load_state_dict(self, budget: dict) -> None:
        """The budget so far; checkpoints written before it was saved resume from zero."""
        self.train_seconds = float(budget.get("train_seconds", 0.0))
        self.nfe_sampling_total = int(budget.get("nfe_sampling_total", 0))
        self.nfe_training_total = int(budget.get("nfe_training_total", 0))
        every = self.every_seconds
        self.next_time_eval = float(budget.get("next_time_eval", (math.floor(self.train_seconds / every) + 1) * every
                                               if every > 0 else 0.0))
        self.time_eval_due = budget.get("time_eval_due")


def max_over_processes(value: float, accelerator) -> float:
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.gather(torch.tensor([value], dtype=torch.float64, device=accelerator.device)).max())


def time_eval_tag(seconds: float) -> str:
    """time_NNNNNs for a whole number of seconds, time_NNNNN.NNNs otherwise (a grid finer than a second)."""
    return f"time_{int(seconds):05d}s" if float(seconds).is_integer() else f"time_{seconds:09.3f}s"
