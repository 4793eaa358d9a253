"""A run's plan, resolved once from its config (config.validate) and passed down: how many samples and conditions an
epoch holds (RunNumbers) and which denoising steps it trains (StepPlan: the window and where it starts each epoch).
The trainer, the domains' schedulers and the reports read these numbers; none recomputes them from a config.

Apart from the containers that travel between phases (recam.engine.containers) and from the rollout that uses the
plan (recam.engine.rollout), so that neither of those two needs the other's module for its types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

WINDOW_MODES = ("fixed", "random", "progressive")
_WINDOW_STREAM = 0x57494E  # keeps the window's draws apart from the noise streams keyed by (seed, ...)


def window_start(mode: str, epoch: int, seed: int, start: int, max_start: int, shift_every: int) -> int:
    """The scheduler step where epoch `epoch`'s stochastic window starts.

    fixed: `start`; random: uniform in [0, max_start] from a generator seeded by (seed, epoch) alone, so every
    process, and a run resumed at this epoch, draws the same start; progressive: one step later every shift_every
    epochs from `start`, back to `start` after max_start (MixGRPO's sliding window with its --roll_back, which the
    public MixGRPO scripts set). One start per epoch, shared by every sample: the k copies of
    a condition must be drawn with the same window for their rewards to be a fair group comparison, and an
    epoch's stored steps then share one scheduler offset.
    """
    if mode == "fixed":
        return int(start)
    if mode == "random":
        rng = np.random.default_rng([int(seed), int(epoch), _WINDOW_STREAM])
        return int(rng.integers(0, int(max_start) + 1))
    if mode == "progressive":
        if shift_every < 1:
            raise ValueError(f"shift_every must be >= 1, got {shift_every!r}")
        if max_start < start:
            raise ValueError(f"a progressive window needs start <= max_start, got {start!r} > {max_start!r}")
        return int(start) + (int(epoch) // int(shift_every)) % (int(max_start) - int(start) + 1)
    raise ValueError(f"window mode must be one of {WINDOW_MODES}, got {mode!r}")


def num_train_timesteps(num_steps: int, timestep_fraction: float) -> int:
    """Trained denoising steps by the timestep_fraction rule: that fraction of the rollout's first steps, never the
    final (too peaked) step."""
    return max(1, min(num_steps - 1, int(num_steps * timestep_fraction)))


def trained_steps(needs_log_probs: bool, num_steps: int, window_size: int, timestep_fraction: float) -> int:
    """T, the steps a rollout samples stochastically, stores and trains: the window's size when a window is set,
    else the timestep_fraction rule; 0 for an objective that needs no log-probs (it samples deterministically and
    trains on the final samples)."""
    if not needs_log_probs:
        return 0
    return window_size if window_size > 0 else num_train_timesteps(num_steps, timestep_fraction)


def latest_window_start(num_steps: int, window_size: int, window_max_start: int) -> int:
    """window_max_start, with -1 read as the latest start whose window ends before the last step (so a preset that
    changes num_steps keeps a window that slides to the end)."""
    return window_max_start if window_max_start >= 0 else num_steps - 1 - window_size


@dataclass(frozen=True)
class StepPlan:
    """Which denoising steps a run trains, resolved once from its config (config.validate.step_plan) and passed
    down: the trainer, the domains' schedulers and the reports read these numbers, none recomputes them."""

    trained_steps: int  # T: stochastic, stored and trained steps per rollout (0: an objective without log-probs)
    window_size: int  # 0: no window (the T noisiest steps are trained)
    window_mode: str  # WINDOW_MODES
    window_start: int
    latest_window_start: int
    window_shift_every: int

    def start(self, epoch: int, seed: int) -> int:
        """The scheduler step where epoch `epoch`'s stochastic window starts (0 without a window)."""
        if self.window_size == 0 or self.trained_steps == 0:
            return 0
        return window_start(self.window_mode, epoch, seed, self.window_start, self.latest_window_start,
                            self.window_shift_every)


@dataclass(frozen=True)
class RunNumbers:
    """A run's numbers derived from its config, as typed values resolved once at the edge (config.validate) and
    passed down, so that the engine never recomputes them from a config: samples and unique conditions per batch
    and epoch (logged with every epoch record), and the trained steps."""

    num_processes: int
    per_device_batch: int
    k: int
    num_batches_per_epoch: int
    samples_per_batch: int  # all processes
    conditions_per_batch: int
    samples_per_epoch: int
    unique_conditions_per_epoch: int
    num_train_timesteps: int  # the advantages' columns: T, or 1 for an objective that stores no step (T = 0)
    plan: StepPlan

    def record(self) -> dict:
        """The numbers an epoch record carries (the plan aside)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
