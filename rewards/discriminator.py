"""`discriminator`: a learned critic reward trained alongside the policy.

A tiny 3D-conv critic scores videos (3, F, H, W) in [-1, 1]. It is trained to rank reference videos
("teacher", e.g. the ground-truth target render of a condition) above policy samples ("student") of the same
condition, with the pairwise loss

    ranking = mean_i -log sigmoid((s_teacher_i - s_student_i) / T)

plus a score regulariser reg = mean over all scores of relu(|s| - tau)^2, which leaves scores inside
[-tau, tau] untouched and stops the critic from winning by inflating their magnitude. The policy's reward
is the critic's score of its sample (the GAD / Adv-GRPO recipe); GRPO's group normalisation makes the
reward's offset and scale irrelevant, so the raw score is used.

Temperature T:
  - fixed: T = config.temperature;
  - adaptive: T follows an exponential moving average of the batch std of the score differences that
    enter the ranking term (T <- m T + (1 - m) std(s_teacher - s_student), clamped to
    [min_temperature, max_temperature]; updated before the step's loss, from the step's batch). The
    margins divided by T then stay of order 1, so the sigmoid neither saturates once the critic separates
    the two sets (vanishing gradients) nor stays in its linear part; and because scaling every score by c
    scales T by c too, the critic cannot lower the loss by inflating scores, only by ordering pairs better.
Optional score normalisation standardises the 2B scores of a training batch (mean 0, std 1) before the
ranking loss, another way to make the loss scale-free; the regulariser always sees the raw scores.

At equilibrium (student indistinguishable from teacher) accuracy tends to 0.5 and the ranking loss to
log 2. `discriminator_health` (recam.engine.health.critic_findings, which diagnosis.md applies to the epoch records
too) reads d_acc with the mean margin in temperatures, margin = mean(s_teacher - s_student) / T over the
differences the ranking term sees: a critic has saturated when it wins most pairs by a margin of 3 T or more (the
average pair's gradient is then under a tenth of its value at margin 0; its reward ranks the policy's samples by
whatever separated the sets), not whenever d_acc is high (d_acc 1.0 by a margin of 0.0025 T is a critic in the
sigmoid's linear part); it learns nothing at d_acc < 0.6 after warmup_steps critic steps.

Every remedy is a field of reward.discriminator (config/base.py), checked by `check_settings`: temperature,
adaptive_temperature with temperature_momentum and [min_temperature, max_temperature], normalize_scores,
reg_threshold and reg_weight, warmup_steps, lr, width and steps_per_epoch.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from recam.engine.health import DEFAULT, critic_findings
from rewards import register_reward


def ranking_differences(s_teacher: torch.Tensor, s_student: torch.Tensor, normalize_scores: bool = False
                        ) -> torch.Tensor:
    """(B,) the differences the ranking term divides by T: s_teacher - s_student, or with normalize_scores the same
    difference of the 2B scores standardised together (mean 0, std 1), which makes the term blind to the scores'
    scale. Standardising keeps each pair's order, so d_acc is the same either way."""
    if not normalize_scores:
        return s_teacher - s_student
    scores = torch.cat([s_teacher, s_student])
    normed = (scores - scores.mean()) / (scores.std(unbiased=False) + 1e-6)
    b = s_teacher.shape[0]
    return normed[:b] - normed[b:]


def discriminator_loss(s_teacher: torch.Tensor, s_student: torch.Tensor, temperature: float | torch.Tensor,
                       reg_threshold: float = 3.0, reg_weight: float = 0.1, normalize_scores: bool = False
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise ranking loss with a score regulariser.

    s_teacher (B,), s_student (B,): scores of the pair i (same condition). temperature > 0. normalize_scores: the
    ranking term sees ranking_differences(..., True); the regulariser and the logged score levels stay on the raw
    scores the reward hands out.
    Returns loss (0-dim, differentiable) = ranking + reg_weight * score_reg, and detached 0-dim metrics:
    d_acc (fraction with s_teacher > s_student), score_diff (mean raw s_teacher - s_student), margin (mean of the
    ranking term's differences / T: what the sigmoid sees, the saturation measure), teacher_mean, student_mean,
    teacher_min, teacher_max, student_min, student_max, ranking_loss, score_reg, loss.
    """
    if s_teacher.ndim != 1 or s_teacher.shape != s_student.shape:
        raise ValueError(f"s_teacher {tuple(s_teacher.shape)} and s_student {tuple(s_student.shape)} must be (B,)")
    if float(temperature) <= 0:
        raise ValueError(f"temperature must be > 0, got {float(temperature)}")
    diff = ranking_differences(s_teacher, s_student, normalize_scores)
    ranking = F.softplus(-diff / temperature).mean()  # softplus(-x) = -log sigmoid(x), stable for large |x|
    scores = torch.cat([s_teacher, s_student])
    score_reg = F.relu(scores.abs() - reg_threshold).pow(2).mean()
    loss = ranking + reg_weight * score_reg
    t, s = s_teacher.detach(), s_student.detach()
    metrics = {
        "d_acc": (t > s).float().mean(),
        "score_diff": (t - s).mean(),
        "margin": (diff.detach() / temperature).mean(),
        "teacher_mean": t.mean(),
        "student_mean": s.mean(),
        "teacher_min": t.min(),
        "teacher_max": t.max(),
        "student_min": s.min(),
        "student_max": s.max(),
        "ranking_loss": ranking.detach(),
        "score_reg": score_reg.detach(),
        "loss": loss.detach(),
    }
    return loss, metrics


class VideoCritic(nn.Module):
    """(B, 3, F, H, W) -> (B,) scores. Three strided 3D convs, then mean and std pooling over
    (F, H, W): the std channel lets the critic see texture statistics (noise vs smooth content) that a
    mean alone would average away. About 18k parameters at width 8."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(3, width, 3, stride=(1, 2, 2), padding=1), nn.SiLU(),
            nn.Conv3d(width, 2 * width, 3, stride=2, padding=1), nn.SiLU(),
            nn.Conv3d(2 * width, 4 * width, 3, stride=2, padding=1), nn.SiLU(),
        )
        self.head = nn.Linear(8 * width, 1)

    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        if videos.ndim != 5 or videos.shape[1] != 3:
            raise ValueError(f"videos must be (B, 3, F, H, W), got {tuple(videos.shape)}")
        h = self.features(videos).flatten(2)  # (B, C, positions)
        pooled = torch.cat([h.mean(-1), h.std(-1, unbiased=False)], dim=1)
        return self.head(pooled).squeeze(-1)


@dataclass
class DiscriminatorConfig:
    """lr / betas / grad_clip: Adam on the critic. temperature: fixed T, or the start of the adaptive one.
    adaptive_temperature with temperature_momentum m and [min_temperature, max_temperature] bounds.
    reg_threshold tau and reg_weight: the score regulariser. normalize_scores: standardise each training
    batch's scores before the ranking loss. warmup_steps: steps before the "learns nothing" rule applies.
    The run config's reward.discriminator holds the same defaults (a test keeps them equal)."""

    width: int = 8
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    temperature: float = 1.0
    adaptive_temperature: bool = False
    temperature_momentum: float = 0.9
    min_temperature: float = 0.05
    max_temperature: float = 10.0
    reg_threshold: float = 3.0
    reg_weight: float = 0.1
    normalize_scores: bool = False
    warmup_steps: int = 50
    seed: int = 0


class Discriminator:
    """Critic + optimiser + temperature state. score() and train_step() share a lock, so a reward job
    scoring on another thread never sees half-updated weights."""

    def __init__(self, config: DiscriminatorConfig | None = None, device: str | torch.device = "cpu"):
        self.config = config or DiscriminatorConfig()
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            self.critic = VideoCritic(self.config.width).to(self.device)
        self.optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.config.lr, betas=self.config.betas)
        self.temperature = float(self.config.temperature)
        self.step = 0
        self._lock = threading.Lock()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.critic.parameters())

    @torch.no_grad()
    def score(self, videos: torch.Tensor) -> torch.Tensor:
        """(B, 3, F, H, W) in [-1, 1] -> (B,) float32 scores on the CPU."""
        with self._lock:
            return self.critic(videos.to(self.device, torch.float32)).float().cpu()

    def _update_temperature(self, diff: torch.Tensor) -> None:
        if not self.config.adaptive_temperature or diff.numel() < 2:
            return
        m = self.config.temperature_momentum
        spread = float(diff.detach().std(unbiased=False))
        if math.isfinite(spread):
            t = m * self.temperature + (1 - m) * spread
            self.temperature = min(max(t, self.config.min_temperature), self.config.max_temperature)

    def train_step(self, teacher_videos: torch.Tensor, student_videos: torch.Tensor) -> dict[str, torch.Tensor]:
        """One critic update on B pairs (teacher i and student i share a condition; repeat a reference k
        times to pair it with k policy samples). Returns discriminator_loss's metrics plus temperature,
        grad_norm and step."""
        if teacher_videos.shape != student_videos.shape:
            raise ValueError(f"teacher {tuple(teacher_videos.shape)} and student {tuple(student_videos.shape)} "
                             "batches must pair up")
        c = self.config
        with self._lock:
            self.critic.train()
            b = teacher_videos.shape[0]
            both = torch.cat([teacher_videos, student_videos]).to(self.device, torch.float32)
            raw = self.critic(both)
            s_teacher, s_student = raw[:b], raw[b:]
            # the adaptive temperature follows the differences the ranking term divides by it (standardised ones
            # under normalize_scores), so that the margins it sees stay of order 1
            self._update_temperature(ranking_differences(s_teacher, s_student, c.normalize_scores))
            loss, metrics = discriminator_loss(s_teacher, s_student, self.temperature, c.reg_threshold,
                                               c.reg_weight, c.normalize_scores)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), c.grad_clip)
            self.optimizer.step()
            self.critic.eval()
            self.step += 1
        metrics["temperature"] = torch.tensor(self.temperature)
        metrics["grad_norm"] = grad_norm.detach().float()
        metrics["step"] = torch.tensor(float(self.step))
        # the settings the health rules' advice depends on, so that an epoch record (read offline, without the
        # config) says which remedy is left: a fixed T to raise, or an adaptive one held at its bound
        metrics["adaptive_temperature"] = torch.tensor(float(c.adaptive_temperature))
        metrics["temperature_at_bound"] = torch.tensor(temperature_bound(self.temperature, c))
        metrics["normalize_scores"] = torch.tensor(float(c.normalize_scores))
        metrics["warmup_steps"] = torch.tensor(float(c.warmup_steps))
        return metrics

    def state_dict(self) -> dict:
        return {
            "critic": self.critic.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "temperature": self.temperature,
            "step": self.step,
            "config": asdict(self.config),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state.get("config", {}))
        if saved and saved.get("width") != self.config.width:
            raise ValueError(f"checkpoint critic width {saved.get('width')} != configured {self.config.width}")
        with self._lock:
            self.critic.load_state_dict(state["critic"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.temperature = float(state["temperature"])
            self.step = int(state["step"])

    def save(self, path) -> None:
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path, device: str | torch.device = "cpu") -> Discriminator:
        state = torch.load(path, map_location=device, weights_only=True)
        saved = dict(state["config"])
        saved["betas"] = tuple(saved["betas"])
        d = cls(DiscriminatorConfig(**saved), device)
        d.load_state_dict(state)
        return d

    def health(self, metrics: dict) -> list[tuple[str, str]]:
        return discriminator_health(metrics, step=self.step, warmup_steps=self.config.warmup_steps)


def temperature_bound(temperature: float, config: DiscriminatorConfig) -> float:
    """+1 when the adaptive temperature sits at max_temperature, -1 at min_temperature, else 0 (and 0 for a fixed
    one, which has no bounds)."""
    if not config.adaptive_temperature:
        return 0.0
    if temperature >= config.max_temperature:
        return 1.0
    return -1.0 if temperature <= config.min_temperature else 0.0


def discriminator_health(metrics: dict, step: int | None = None, warmup_steps: int = 0,
                         overconfident: float = 0.9, learns_nothing: float = 0.6) -> list[tuple[str, str]]:
    """recam.engine.health.critic_findings over one step's metrics as [(severity, "rule: explanation Try: ...")],
    severities "info" | "warn" | "critical"; empty when healthy. d_acc is read with the margin and the ranking loss
    (saturation is a margin of 3 temperatures or more, not a high d_acc); "learns nothing" (d_acc < learns_nothing)
    waits for warm-up (step from metrics["step"] when not given)."""
    th = replace(DEFAULT.critic, overconfident=overconfident, learns_nothing=learns_nothing)
    out = []
    for f in critic_findings(metrics, th, step=step, warmup_steps=warmup_steps):
        tries = f" Try: {'; '.join(f.actions)}." if f.actions else ""
        out.append((f.severity, f"{f.rule}: {f.explanation}{tries}"))
    return out


# ----------------------------------------------------------------------------------------------------
# the registered reward


class DiscriminatorReward:
    """The `discriminator` reward object: the critic's score of each sample, from the Discriminator it holds.

    The same instance must be the one trained (the camera domain's DiscriminatorHook gets `.discriminator`) and
    the one scoring, in training and in evaluation; its lock keeps a score from seeing half-updated weights."""

    def __init__(self, discriminator: Discriminator):
        self.discriminator = discriminator

    def describe(self) -> str:
        return f"a critic of {self.discriminator.num_parameters()} parameters"

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
        """(B, 3, F, H, W) in [-1, 1] -> (critic scores (B,) float32, details with the temperature and the critic's
        step)."""
        if videos.shape[0] != len(conditions):
            raise ValueError(f"{videos.shape[0]} videos but {len(conditions)} conditions")
        d = self.discriminator
        return d.score(videos), {"temperature": torch.tensor(d.temperature),
                                 "critic_step": torch.tensor(float(d.step))}


def discriminator_config(config) -> DiscriminatorConfig:
    """DiscriminatorConfig from a run config: the reward.discriminator fields DiscriminatorConfig has (the others,
    such as steps_per_epoch, belong to whoever trains it) and the run's seed for the critic's initialisation."""
    section = config.reward.discriminator
    names = {f.name for f in fields(DiscriminatorConfig)}
    values = {k: section[k] for k in section.keys() if k in names}
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    values.setdefault("seed", config.seed)
    return DiscriminatorConfig(**values)


def check_settings(checks) -> None:
    """The ranges of reward.discriminator (recam/infra/config_checks.py's FieldChecks), each refusal one line naming
    the field and what it may be."""
    section = "reward.discriminator"
    checks.boolean(f"{section}.adaptive_temperature", f"{section}.normalize_scores")
    for field in ("lr", "temperature", "reg_threshold"):
        checks.number(f"{section}.{field}", 0, None, low_open=True)
    checks.number(f"{section}.reg_weight", 0)
    checks.number(f"{section}.temperature_momentum", 0, 1, high_open=True,
                  why="the adaptive temperature keeps this share of itself per step; 1 would never move")
    checks.number(f"{section}.min_temperature", 0, None, low_open=True, why="the adaptive temperature's lower bound")
    checks.number(f"{section}.max_temperature", 0, None, low_open=True, why="the adaptive temperature's upper bound")
    low, high = checks.config.reward.discriminator.min_temperature, checks.config.reward.discriminator.max_temperature
    checks.require(low <= high, f"{section}.min_temperature={low!r} must be <= {section}.max_temperature={high!r} "
                                "(the adaptive temperature's bounds): lower the one or raise the other")
    checks.integer(f"{section}.warmup_steps", 0, why="critic updates before 'learns nothing' is judged")
    checks.integer(f"{section}.width", 1, why="the critic's channels")
    checks.integer(f"{section}.steps_per_epoch", 0, why="critic updates per epoch")


@register_reward("discriminator", scores="video", check=check_settings)
def build_discriminator_reward(config, device=None) -> DiscriminatorReward:
    """Factory of `discriminator`: a fresh critic configured by config.reward.discriminator (None: defaults)."""
    return DiscriminatorReward(Discriminator(discriminator_config(config) if config is not None else None))

