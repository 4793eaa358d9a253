"""A reward kept as a constraint instead of maximised: its weight in `avg` is a Lagrange multiplier.

The issue a ReCam run answers to is a constrained one (raise camera accuracy, let fidelity fall by at most a
little), and a fixed weight does not express it: on the synthetic world the fidelity reward first loses to the
camera reward and later overtakes it, ending well above where it started (docs/results.md, "Why the gain
fades"; how a run uses the constraint: docs/guide.md). Treating fidelity as a constraint E[fidelity] >= threshold
and maximising the Lagrangian E[others] + lambda * (E[fidelity] - threshold) gives the weight lambda a rule:
projected gradient descent on the dual, which raises lambda while the constraint is violated and lowers it (to 0
at the least) while it holds with room to spare, as in constrained policy optimisation with PPO-Lagrangian and
Safe RLHF.
"""

from __future__ import annotations

import math


def dual_step(weight: float, observed: float, threshold: float, lr: float, max_weight: float) -> float:
    """The multiplier for the next epoch: weight + lr * (threshold - observed), projected onto [0, max_weight].

    observed: this epoch's mean of the constrained reward over the gathered samples; threshold: the floor it
    should stay above. A NaN observation (every sample failed) leaves the weight unchanged.
    """
    if lr < 0 or max_weight < 0:
        raise ValueError(f"need lr >= 0 and max_weight >= 0, got {lr}, {max_weight}")
    if not math.isfinite(observed):
        return weight
    return min(max(weight + lr * (threshold - observed), 0.0), max_weight)
