import math
from dataclasses import fields

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


def test_health_reads_accuracy_with_the_margin_and_the_ranking_loss():
    # The plan's saturated critic: d_acc 0.88 is under the old 0.9 line, but score_diff 9.81 at T 2 is a mean margin
    # of 4.9 temperatures, where the average pair's gradient is 2 sigmoid(-4.905) = 1.5% of its value at margin 0.
    [(severity, message)] = discriminator_health({"d_acc": 0.88, "score_diff": 9.81, "temperature": 2.0})
    assert severity == "warn" and message.startswith("critic_saturated:")
    assert "4.91 temperatures" in message and "1.5%" in message
    assert "reward.discriminator.temperature` to about 9.81" in message  # T at which the mean margin is 1 T
    assert "reward.discriminator.normalize_scores=True" in message
    # d_acc 1.0 by a hair (ranking_loss 0.691 against log 2 = 0.693): not saturation, with or without the temperature
    for hair in ({"d_acc": 1.0, "score_diff": 0.0025, "ranking_loss": 0.691},
                 {"d_acc": 1.0, "score_diff": 0.0025, "ranking_loss": 0.691, "temperature": 1.0}):
        found = discriminator_health(hair, step=100, warmup_steps=50)
        assert [s for s, _ in found] == ["info"], found
        assert found[0][1].startswith("critic_separates:") and "not saturation" in found[0][1]
    assert discriminator_health({"d_acc": 0.75, "loss": 0.5, "score_diff": 0.8, "temperature": 1.0}, step=100,
                                warmup_steps=50) == []
    low = discriminator_health({"d_acc": torch.tensor(0.5)}, step=100, warmup_steps=50)
    assert len(low) == 1 and "critic_learns_nothing" in low[0][1]
    assert discriminator_health({"d_acc": 0.5}, step=10, warmup_steps=50) == []  # still warming up
    assert discriminator_health({"d_acc": 0.5, "step": torch.tensor(10.0)}, warmup_steps=50) == []
    bad = discriminator_health({"d_acc": 0.7, "loss": float("nan")}, step=100)
    assert bad[0][0] == "critical"
    # d_acc alone cannot be judged: said so, not called saturation
    [(severity, message)] = discriminator_health({"d_acc": 0.97}, step=100, warmup_steps=50)
    assert severity == "warn" and message.startswith("critic_overconfident:") and "no margin" in message


def test_health_advice_follows_the_temperature_the_critic_has():
    plan = {"d_acc": 0.88, "score_diff": 9.81, "temperature": 2.0, "adaptive_temperature": 1.0}
    [(_, held)] = discriminator_health({**plan, "temperature_at_bound": 1.0})
    assert "reward.discriminator.max_temperature` to about 9.81" in held  # the bound stops the adaptive T
    [(_, trailing)] = discriminator_health({**plan, "temperature_at_bound": 0.0, "normalize_scores": 1.0})
    assert "temperature_momentum" in trailing and "normalize_scores=True" not in trailing  # already on


def test_saturation_is_proven_from_the_ranking_loss_when_no_margin_is_logged():
    # mean softplus(-z_i) >= softplus(-mean z): a loss of 0.02 proves a mean margin of at least -log(e^0.02 - 1)
    [(_, message)] = discriminator_health({"d_acc": 0.95, "ranking_loss": 0.02})
    assert message.startswith("critic_saturated:") and f"{-math.log(math.expm1(0.02)):.3g} temperatures" in message
    assert "at most" in message  # the gradient share of a margin that is only a lower bound


def test_the_logged_margin_is_what_the_sigmoid_sees_with_normalised_scores():
    s_t = torch.tensor([2.0, 0.5, 1.0])
    s_s = torch.tensor([0.0, 1.0, -1.0])
    raw_loss, raw = discriminator_loss(s_t, s_s, temperature=2.0)
    assert raw["margin"].item() == pytest.approx((2.0 - 0.5 + 2.0) / 3 / 2.0, rel=1e-6)
    scores = torch.cat([s_t, s_s])
    z = (scores - scores.mean()) / scores.std(unbiased=False)
    d = (z[:3] - z[3:]).tolist()
    loss, m = discriminator_loss(s_t * 10, s_s * 10, temperature=2.0, reg_threshold=100.0, normalize_scores=True)
    assert m["margin"].item() == pytest.approx(sum(d) / 3 / 2.0, rel=1e-5)  # blind to the scores' scale
    assert m["ranking_loss"].item() == pytest.approx(sum(math.log1p(math.exp(-x / 2.0)) for x in d) / 3, rel=1e-5)
    assert m["score_diff"].item() == pytest.approx(10 * raw["score_diff"].item(), rel=1e-6)  # raw, as rewarded
    assert m["d_acc"].item() == raw["d_acc"].item()


def test_every_remedy_is_a_run_config_field_with_the_critic_s_default():
    from config.base import get_config

    section = get_config().reward.discriminator
    defaults = DiscriminatorConfig()
    # betas and grad_clip are Adam's, not remedies; seed comes from the run's seed
    for f in fields(DiscriminatorConfig):
        if f.name not in ("betas", "grad_clip", "seed"):
            assert section[f.name] == getattr(defaults, f.name), f.name


def test_a_run_config_s_remedies_reach_the_critic():
    from config.base import get_config

    c = get_config()
    c.reward.discriminator.update(dict(normalize_scores=True, adaptive_temperature=True, temperature_momentum=0.5,
                                       min_temperature=0.2, max_temperature=0.3, warmup_steps=7, width=4))
    d = build_reward("discriminator", c).discriminator
    assert (d.config.normalize_scores, d.config.temperature_momentum, d.config.warmup_steps, d.num_parameters()) == (
        True, 0.5, 7, Discriminator(DiscriminatorConfig(width=4)).num_parameters())
    m = d.train_step(*_toy_batch(4, torch.Generator().manual_seed(2)))
    # T 1.0 moves toward the standardised differences' spread (about 1-2) and is held at the 0.3 bound
    assert m["temperature"].item() == pytest.approx(0.3)
    assert (m["temperature_at_bound"].item(), m["adaptive_temperature"].item(), m["normalize_scores"].item(),
            m["warmup_steps"].item()) == (1.0, 1.0, 1.0, 7.0)


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


def test_the_remedies_are_taken_from_the_command_line_and_checked(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # normalize_scores is taken (it was refused as "not a config field"); the bounds that cannot hold are then
    # refused in one line naming the field, before any model is built
    cmd = [sys.executable, "scripts/train_recam.py", "--config=config/grpo.py:smoke",
           "--config.reward.discriminator.normalize_scores=True", "--config.reward.discriminator.min_temperature=20.0",
           f"--config.run_dir={tmp_path / 'run'}", "--config.model.pretrained=/nonexistent"]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    [line] = p.stderr.strip().splitlines()
    assert "reward.discriminator.min_temperature=20.0 must be <= reward.discriminator.max_temperature" in line
    assert "not a config field" not in p.stderr + p.stdout and "nonexistent" not in p.stderr + p.stdout
