"""Typed containers passed between the phases of an epoch. Shapes: n samples on this process, N over all
processes (gathered in rank order), T trained steps, sample_shape the domain's (e.g. (C, F, H, W) latents)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Rollout:
    """One sampling batch, only what training needs.

    final: (n, *sample_shape) the final samples.
    states: (n, T + 1, *sample_shape) x before each trained step, plus the state after the last trained one;
        (n, 0, *sample_shape) when nothing is trained (T = 0: forward-process objectives train on `final`).
    log_probs: (n, T) float32 log-prob of each trained transition under the sampling policy.
    start: the scheduler step of trained step 0 (the window's start; 0 without a window), so stored step j is
        scheduler step start + j.
    means: (n, T, *sample_shape) float32 the sampling transitions' means, or None when not kept.
    """

    final: torch.Tensor
    states: torch.Tensor
    log_probs: torch.Tensor
    start: int = 0
    means: torch.Tensor | None = None


@dataclass
class Rollouts:
    """This process's samples of one epoch, in sampling order.

    index: (n,) dataset index of each sample's condition.
    states, log_probs, means: as in Rollout, batches concatenated (means None unless the objective asks for them).
    decoded: per batch, what the rewards saw (videos, motions); kept only when a hook asks for it.
    start: the window's start, one per epoch (every sample of the epoch shares it).
    final: (n, *sample_shape) the final samples, on the CPU.
    """

    index: torch.Tensor
    states: torch.Tensor
    log_probs: torch.Tensor
    decoded: list = field(default_factory=list)
    start: int = 0
    final: torch.Tensor | None = None
    means: torch.Tensor | None = None


@dataclass
class Scores:
    """This process's rewards. rewards: name -> (n,) float32 ("avg" drives training; NaN = failed);
    valid: (n,) bool, False where a reward failed; seconds: time spent in reward calls; details: what the rewards
    report per sample besides their scores (recam.engine.reward_runner.RewardDetails: errors, estimator seconds,
    per-frame lists, failure-reason counts), logged with the epoch."""

    rewards: dict[str, torch.Tensor]
    valid: torch.Tensor
    seconds: float
    details: Any = None


@dataclass
class Groups:
    """Every process's samples after the gather, and what the advantages were computed from.

    index: (N,) dataset indices; rewards: name -> (N,); keep: (N,) bool, samples that are trained
    (False: reward failed, or excluded with a zero-std group); advantages: (N, T) per trained step, (N, 1) when
    nothing is stored per step (T = 0, forward-process objectives);
    stats: advantage statistics (group_size, zero_std_ratio, ...); exclusion: counts of excluded samples;
    details: every process's reward details in the same sample order (RewardDetails)."""

    index: torch.Tensor
    rewards: dict[str, torch.Tensor]
    keep: torch.Tensor
    advantages: torch.Tensor
    stats: dict[str, float]
    exclusion: dict[str, int]
    details: Any = None


@dataclass
class StepStats:
    """One optimizer step: global step number, metrics averaged over processes, the guard's findings, and
    whether the update was applied (a critical finding withholds it)."""

    step: int
    metrics: dict[str, float]
    findings: list = field(default_factory=list)
    applied: bool = True


@dataclass
class EpochResult:
    """What the update phase hands to the guard: its steps and the first critical finding set (if any)."""

    steps: list[StepStats]
    critical: list = field(default_factory=list)

    @property
    def first_step_ratio_deviation(self) -> float | None:
        """|mean ratio - 1| of the first step; None without a step or when the objective has no ratio."""
        ratio = self.steps[0].metrics.get("mean_ratio") if self.steps else None
        return None if ratio is None else abs(ratio - 1.0)


@dataclass
class Batch:
    """What a domain's collate gives the engine for a list of dataset indices.

    index: (b,) dataset indices; conditions: what the rewards receive per sample; inputs: the conditioning
    the domain's denoiser closes over (opaque to the engine)."""

    index: torch.Tensor
    conditions: list
    inputs: Any
