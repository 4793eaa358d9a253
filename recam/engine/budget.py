"""The time-to-reward budget of a run: training seconds (sampling, rewards, update; never evaluation or
checkpoints), denoiser evaluations per phase, the max_train_seconds stop, and the eval.every_seconds grid.

Every process must agree on all of it (a process that stops or evaluates alone hangs the others), so epoch times
are the slowest process's and evaluation counts are summed over processes.
"""

from __future__ import annotations

import math
import time

import torch


class RunBudget:
    def __init__(self, max_train_seconds: float, every_seconds: float, accelerator):
        self.max_train_seconds, self.every_seconds, self.accelerator = max_train_seconds, every_seconds, accelerator
        self.nfe = {"sampling": 0, "training": 0}  # denoiser rows of this epoch on this process
        self.train_seconds, self.nfe_sampling_total, self.nfe_training_total = 0.0, 0, 0
        self.next_time_eval, self.time_eval_due = every_seconds, None
        self.clock = DeviceClock(accelerator.device)

    def spent(self) -> bool:
        return self.max_train_seconds > 0 and self.train_seconds >= self.max_train_seconds

    def new_epoch(self) -> None:
        self.nfe = {"sampling": 0, "training": 0}
        self.clock.take()

    def counted(self, denoise, phase: str):
        """denoise, counting each call as as many evaluations as it has rows. A domain that runs classifier-free
        guidance inside its closure (two passes per row) counts once: the count is of closure rows, which is what
        every run of one domain shares."""
        timed = self.clock.timed(denoise)

        def call(x, t):
            self.nfe[phase] += int(x.shape[0])
            return timed(x, t)
        return call

    def timed(self, fn):
        """fn, its calls counted as device-busy time (a backward pass)."""
        return self.clock.timed(fn)

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
        grid); returns the record's epoch_seconds and train_seconds, and this process's split of its own wall time
        into seconds_device (the model's passes, as DeviceClock measures them) and seconds_host (the rest: noise
        keys, decoding, waiting on rewards, gathers, bookkeeping), which says what bounds an update."""
        device, own = self.clock.take(), seconds
        seconds = max_over_processes(seconds, self.accelerator)
        self.train_seconds += seconds
        return {"epoch_seconds": seconds, "train_seconds": self.train_seconds, "seconds_device": device,
                "seconds_host": max(0.0, own - device)}

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


class DeviceClock:
    """Seconds a device spends in the calls it times (the model's forward and backward passes).

    On an accelerator each call is bracketed by two timing events on the current stream and read once, at take(),
    with one synchronisation: nothing waits inside the loop. The span runs from the call's first kernel to its
    last, so launch gaps inside a pass count as busy (for models this small and batches this large the kernels are
    long). On the CPU the device is the host, and a call's wall time is its device time.
    """

    def __init__(self, device: torch.device):
        module = None if device.type == "cpu" else torch.get_device_module(device)
        self.events = module.Event if module is not None and hasattr(module, "Event") else None
        self.spans: list[tuple] = []
        self.seconds = 0.0

    def timed(self, fn):
        def call(*args, **kwargs):
            if self.events is None:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
            start, end = self.events(enable_timing=True), self.events(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self.spans.append((start, end))
        return call

    def take(self) -> float:
        """The seconds timed since the last take(); starts again from zero."""
        if self.spans:
            self.spans[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.spans) / 1000.0
        seconds, self.spans, self.seconds = self.seconds, [], 0.0
        return seconds


def max_over_processes(value: float, accelerator) -> float:
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.gather(torch.tensor([value], dtype=torch.float64, device=accelerator.device)).max())


def time_eval_tag(seconds: float) -> str:
    """time_NNNNNs for a whole number of seconds, time_NNNNN.NNNs otherwise (a grid finer than a second)."""
    return f"time_{int(seconds):05d}s" if float(seconds).is_integer() else f"time_{seconds:09.3f}s"
