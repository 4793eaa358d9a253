import math

import pytest
import torch
import torch.nn.functional as F

from rewards import build_reward
from rewards.discriminator import (
    Discriminator,
    DiscriminatorConfig,
    DiscriminatorReward,
    build_discriminator_reward,
    discriminator_health,
    discriminator_loss,
)


def test_loss_and_metrics_on_hand_computed_scores():
    s_t = torch.tensor([2.0, 0.0, 1.0])
    s_s = torch.tensor([0.0, 1.0, 1.0])
    loss, m = discriminator_loss(s_t, s_s, temperature=2.0, reg_threshold=1.5, reg_weight=0.5)
    # margins / T = [1, -0.5, 0]; -log sigmoid(x) = log(1 + e^-x)
    ranking = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5)) + math.log(2.0)) / 3
    reg = (2.0 - 1.5) ** 2 / 6  # only the score 2 exceeds tau; mean over all 6 scores
    assert m["ranking_loss"].item() == pytest.approx(ranking, rel=1e-6)
    assert m["score_reg"].item() == pytest.approx(reg, rel=1e-6)
    assert loss.item() == pytest.approx(ranking + 0.5 * reg, rel=1e-6)
    assert m["d_acc"].item() == pytest.approx(1 / 3)  # the tie (1 vs 1) is not a win
    assert m["score_diff"].item() == pytest.approx(1 / 3)
    assert m["teacher_mean"].item() == pytest.approx(1.0)
    assert m["student_mean"].item() == pytest.approx(2 / 3)
    assert (m["teacher_min"].item(), m["teacher_max"].item()) == (0.0, 2.0)
    assert (m["student_min"].item(), m["student_max"].item()) == (0.0, 1.0)
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())


def test_loss_gradient_pushes_teacher_up_and_student_down_and_is_stable():
    s_t = torch.tensor([0.0, -50.0], requires_grad=True)
    s_s = torch.tensor([0.0, 50.0], requires_grad=True)
    loss, _ = discriminator_loss(s_t, s_s, temperature=1.0, reg_threshold=100.0, reg_weight=1.0)
    loss.backward()
    assert torch.isfinite(loss)  # margin -100 must not overflow
    assert (s_t.grad < 0).all() and (s_s.grad > 0).all()  # descending raises teacher, lowers student
    with pytest.raises(ValueError):
        discriminator_loss(s_t, s_s, temperature=0.0)


def test_equal_scores_give_log2_and_zero_accuracy():
    s = torch.zeros(4)
    loss, m = discriminator_loss(s, s, 1.0)
    assert loss.item() == pytest.approx(math.log(2.0))
    assert m["d_acc"].item() == 0.0


def _toy_batch(b, gen, frames=4, size=16):
    """Teacher: smooth videos (coarse random fields upsampled); student: white noise."""
    coarse = torch.rand(b, 3, frames, 2, 2, generator=gen) * 1.6 - 0.8
    teacher = F.interpolate(coarse, size=(frames, size, size), mode="trilinear", align_corners=True)
    student = torch.rand(b, 3, frames, size, size, generator=gen) * 2 - 1
    return teacher, student


@pytest.mark.parametrize("cfg", [
    DiscriminatorConfig(lr=3e-3),
    DiscriminatorConfig(lr=3e-3, adaptive_temperature=True, normalize_scores=True),
])
def test_training_on_toy_data_raises_accuracy(cfg):
    d = Discriminator(cfg)
    assert d.num_parameters() < 100_000
    gen = torch.Generator().manual_seed(0)
    eval_t, eval_s = _toy_batch(32, gen)

    def accuracy():
        return (d.score(eval_t) > d.score(eval_s)).float().mean().item()

    before = accuracy()
    first = None
    for _ in range(40):
        m = d.train_step(*_toy_batch(8, gen))
        first = first if first is not None else m["ranking_loss"].item()
    after = accuracy()
    assert after >= 0.95 and after > before
    assert m["ranking_loss"].item() < first
    assert d.step == 40
    if cfg.adaptive_temperature:
        assert d.temperature != cfg.temperature
        assert cfg.min_temperature <= d.temperature <= cfg.max_temperature
    else:
        assert m["temperature"].item() == cfg.temperature


def test_state_dict_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(1)
    d = Discriminator(DiscriminatorConfig(adaptive_temperature=True))
    for _ in range(3):
        d.train_step(*_toy_batch(4, gen))
    path = tmp_path / "critic.pt"
    d.save(path)
    e = Discriminator.load(path)
    videos, _ = _toy_batch(3, gen)
    assert torch.equal(d.score(videos), e.score(videos))
    assert (e.step, e.temperature) == (d.step, d.temperature)
    # the optimiser state came along: one more identical step keeps them identical
    t, s = _toy_batch(4, gen)
    d.train_step(t, s)
    e.train_step(t, s)
    assert torch.allclose(d.score(videos), e.score(videos), atol=1e-6)
    with pytest.raises(ValueError):
        Discriminator(DiscriminatorConfig(width=4)).load_state_dict(d.state_dict())


def test_reward_object_scores_with_the_discriminator_it_holds():
    videos = torch.rand(2, 3, 4, 16, 16) * 2 - 1
    d = Discriminator()
    reward = DiscriminatorReward(d)
    scores, details = reward(videos, ["a", "b"])
    assert scores.shape == (2,) and scores.dtype == torch.float32
    assert torch.equal(scores, d.score(videos))
    assert details["temperature"].item() == 1.0 and details["critic_step"].item() == 0.0
    # Training the held instance (what the camera domain's hook does) changes what the reward hands out.
    gen = torch.Generator().manual_seed(5)
    t, s = _toy_batch(4, gen)
    d.train_step(t, s)
    after, details = reward(videos, ["a", "b"])
    assert torch.equal(after, d.score(videos)) and not torch.equal(after, scores)
    assert details["critic_step"].item() == 1.0
    with pytest.raises(ValueError, match="conditions"):
        reward(videos, ["a"])


def test_factory_builds_a_fresh_critic_from_the_run_config():
    from config.base import get_config

    c = get_config()
    c.seed = 7
    c.reward.discriminator.update(dict(lr=3e-4, temperature=0.5, adaptive_temperature=True, reg_threshold=2.0,
                                       reg_weight=0.2))
    a, b = build_reward("discriminator", c), build_reward("discriminator", c)
    assert isinstance(a, DiscriminatorReward) and a.discriminator is not b.discriminator  # no shared critic
    cfg = a.discriminator.config
    assert (cfg.lr, cfg.temperature, cfg.adaptive_temperature, cfg.reg_threshold, cfg.reg_weight, cfg.seed) == (
        3e-4, 0.5, True, 2.0, 0.2, 7)
    assert a.discriminator.optimizer.param_groups[0]["lr"] == 3e-4
    videos = torch.rand(3, 3, 4, 16, 16) * 2 - 1
    torch.testing.assert_close(a(videos, [0, 1, 2])[0], b(videos, [0, 1, 2])[0])  # same seed, same critic
    c.seed = 8
    assert not torch.equal(build_reward("discriminator", c)(videos, [0, 1, 2])[0], a(videos, [0, 1, 2])[0])
    assert build_reward("discriminator", None).discriminator.config == DiscriminatorConfig()


def test_health_rules():
    assert discriminator_health({"d_acc": 0.75, "loss": 0.5}, step=100, warmup_steps=50) == []
    high = discriminator_health({"d_acc": 0.97}, step=100, warmup_steps=50)
    assert len(high) == 1 and high[0][0] == "warn" and "overconfident" in high[0][1]
    low = discriminator_health({"d_acc": torch.tensor(0.5)}, step=100, warmup_steps=50)
    assert len(low) == 1 and "learns nothing" in low[0][1]
    assert discriminator_health({"d_acc": 0.5}, step=10, warmup_steps=50) == []  # still warming up
    assert discriminator_health({"d_acc": 0.5, "step": torch.tensor(10.0)}, warmup_steps=50) == []
    bad = discriminator_health({"d_acc": 0.7, "loss": float("nan")}, step=100)
    assert bad[0][0] == "critical"


def test_adaptive_temperature_tracks_std_of_score_differences():
    cfg = DiscriminatorConfig(adaptive_temperature=True, temperature=1.0, temperature_momentum=0.9,
                              min_temperature=1e-6)
    d = Discriminator(cfg)
    gen = torch.Generator().manual_seed(3)
    t, s = _toy_batch(6, gen)
    spread = (d.score(t) - d.score(s)).std(unbiased=False).item()
    m = d.train_step(t, s)
    assert m["temperature"].item() == pytest.approx(0.9 * 1.0 + 0.1 * spread, rel=1e-5)
    fixed = Discriminator(DiscriminatorConfig(temperature=0.7))
    assert fixed.train_step(t, s)["temperature"].item() == pytest.approx(0.7)


def test_the_module_registers_its_factory():
    from rewards import REWARDS

    assert REWARDS["discriminator"].factory is build_discriminator_reward
    assert REWARDS["discriminator"].scores == "video"
