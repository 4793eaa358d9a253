"""The cosine between consecutive optimizer steps' gradients (train.log_gradient_cosine, logged grad_cosine_prev).

Two steps' samples are independent draws, so its mean over a run estimates |E g|^2 / E |g|^2: near 0, an update's
direction is its samples' noise (recam.engine.health.rule_update_noise).
"""

from __future__ import annotations

import math

import torch


class GradientCosine:
    def __init__(self):
        self.previous: list[torch.Tensor] | None = None

    def reset(self) -> None:
        """After a resume or a rollback: the last gradient belongs to weights that are no longer the policy's."""
        self.previous = None

    def __call__(self, parameters) -> float | None:
        """Cosine between this step's gradient of `parameters` (the trainable ones) and the previous step's; None on
        a run's or a resumed run's first step. The gradients are already averaged over processes, so every process
        computes the same number."""
        grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in parameters if p.requires_grad]
        previous, self.previous = self.previous, grads
        return None if previous is None else flat_cosine(grads, previous)


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
