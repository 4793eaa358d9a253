"""The constrained reward's Lagrange multiplier (recam.engine.constraint) and the weighted mean it feeds."""

import math

import pytest
import torch

from config import grpo
from config.validate import ConfigError, validate
from recam.engine.constraint import dual_step
from rewards import MultiReward, cam_score, fidelity, weighted_mean  # noqa: F401  (cam_score, fidelity register)


def test_dual_step_by_hand():
    # 0.02 below the floor at lr 10: the weight rises by 0.2; 0.03 above it: falls by 0.3
    assert dual_step(1.5, 0.13, 0.15, 10.0, 6.0) == pytest.approx(1.7)
    assert dual_step(1.5, 0.18, 0.15, 10.0, 6.0) == pytest.approx(1.2)
    assert dual_step(0.1, 0.30, 0.15, 10.0, 6.0) == 0.0  # projected onto [0, max]
    assert dual_step(5.9, 0.00, 0.15, 10.0, 6.0) == 6.0
    assert dual_step(1.5, math.nan, 0.15, 10.0, 6.0) == 1.5  # every sample failed: no evidence, no change
    with pytest.raises(ValueError, match="lr"):
        dual_step(1.5, 0.1, 0.1, -1.0, 6.0)


def test_weighted_mean_is_multireward_avg_and_keeps_failures_visible():
    scores = {"cam_score": torch.tensor([0.2, 0.4, math.nan]), "fidelity": torch.tensor([0.1, 0.3, 0.5])}
    avg = weighted_mean(scores, {"cam_score": 1.0, "fidelity": 3.0, "unifiedscore": 0.0})
    assert torch.allclose(avg[:2], torch.tensor([(0.2 + 0.3) / 4, (0.4 + 0.9) / 4]))
    assert torch.isnan(avg[2])  # a failed score is excluded downstream, never averaged as 0
    torch.testing.assert_close(weighted_mean(scores, {"cam_score": 1.0, "fidelity": 0.0}), scores["cam_score"],
                               equal_nan=True)  # weight 0 (a multiplier driven to 0): the reward drops out
    with pytest.raises(ValueError, match="positive"):
        weighted_mean(scores, {"cam_score": 0.0})
    m = MultiReward({"cam_score": 2.0, "fidelity": 1.0})
    video = torch.rand(2, 3, 8, 32, 32)
    from recam.domains.camera.world import SyntheticWorld

    conds = [SyntheticWorld("heldout", 2)[i] for i in range(2)]
    out, _ = m(video, conds)
    assert torch.allclose(out["avg"], (2 * out["cam_score"] + out["fidelity"]) / 3)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: setattr(c.reward, "constraint", "unifiedscore"), "reward.constraint"),  # weight 0
    (lambda c: (setattr(c.reward, "constraint", "fidelity"), c.reward.weights.__setitem__("cam_score", 0.0)),
     "reward.constraint"),  # nothing left to maximise
    (lambda c: (setattr(c.reward, "constraint", "fidelity"), setattr(c.reward, "constraint_lr", -1.0)),
     "reward.constraint_lr"),
])
def test_bad_constraint_config_names_the_field(mutate, field):
    c = grpo.get_config("tiny_cpu")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(c, 1)
