"""Conditions and the base's data distribution for the toy domain (2-D points around a target).

A condition is a target point c drawn uniformly from a disk. The base model learns p(x | c), a Gaussian
mixture of a mode at c and `num_side_modes` modes on a ring of radius `mode_offset` around it; the reward
(recam.domains.toy.rewards) only pays near c, so most of the base's mass sits where the reward is ~0 and GRPO
has to move it onto the centre mode and sharpen that mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SPLITS = ("train", "heldout", "val")


@dataclass(frozen=True)
class ToyCondition:
    condition_id: str
    target: torch.Tensor  # (2,) float32


def disk_points(n: int, radius: float, gen: torch.Generator) -> torch.Tensor:
    """(n, 2) points uniform in the disk of `radius` (sqrt of a uniform radius: uniform in area)."""
    r = radius * torch.rand(n, generator=gen).sqrt()
    phi = 2 * math.pi * torch.rand(n, generator=gen)
    return torch.stack([r * torch.cos(phi), r * torch.sin(phi)], 1)


class ToyConditions(Sequence):
    """One split's targets, fixed by (data seed, split): the splits never share a stream."""

    def __init__(self, split: str, n: int, seed: int, radius: float):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        key = int(np.random.SeedSequence([int(seed), SPLITS.index(split)]).generate_state(1, dtype=np.uint64)[0])
        self.split = split
        self.targets = disk_points(n, radius, torch.Generator().manual_seed(key % (2**63)))

    def __len__(self) -> int:
        return self.targets.shape[0]

    def __getitem__(self, i: int) -> ToyCondition:
        if not -len(self) <= i < len(self):
            raise IndexError(f"condition {i} out of range for {len(self)} {self.split} conditions")
        i = i % len(self)
        return ToyCondition(self.condition_id(i), self.targets[i])

    def condition_id(self, i: int) -> str:
        return f"toy/{self.split}/{i:06d}"


def mode_centres(target: torch.Tensor, data_config) -> torch.Tensor:
    """(b, 1 + M, 2) the mixture's mode centres for targets (b, 2): the target itself, then the ring."""
    m = data_config.num_side_modes
    angles = 2 * math.pi * torch.arange(m) / max(m, 1)
    ring = data_config.mode_offset * torch.stack([torch.cos(angles), torch.sin(angles)], 1)  # (M, 2)
    return target[:, None, :] + torch.cat([torch.zeros(1, 2), ring])[None]


def sample_base_data(n: int, data_config, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets (n, 2), points (n, 2)): targets from the whole disk, points from the mixture around each."""
    target = disk_points(n, data_config.target_radius, gen)
    centres = mode_centres(target, data_config)
    pick = torch.randint(0, centres.shape[1], (n,), generator=gen)
    x = centres[torch.arange(n), pick] + data_config.mode_std * torch.randn(n, 2, generator=gen)
    return target, x
