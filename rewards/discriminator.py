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
log 2 (at T = 1). `discriminator_health` flags a critic that is too strong (d_acc > 0.9: its reward
saturates and the policy chases artefacts) or learns nothing (d_acc < 0.6 after warm-up).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from rewards import register_reward


def discriminator_loss(s_teacher: torch.Tensor, s_student: torch.Tensor, temperature: float | torch.Tensor,
                       reg_threshold: float = 3.0, reg_weight: float = 0.1
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise ranking loss with a score regulariser.

    s_teacher (B,), s_student (B,): scores of the pair i (same condition). temperature > 0.
    Returns loss (0-dim, differentiable) = ranking + reg_weight * score_reg, and detached 0-dim metrics:
    d_acc (fraction with s_teacher > s_student), score_diff (mean s_teacher - s_student), teacher_mean,
    student_mean, teacher_min, teacher_max, student_min, student_max, ranking_loss, score_reg, loss.
    """
    if s_teacher.ndim != 1 or s_teacher.shape != s_student.shape:
        raise ValueError(f"s_teacher {tuple(s_teacher.shape)} and s_student {tuple(s_student.shape)} must be (B,)")
    if float(temperature) <= 0:
        raise ValueError(f"temperature must be > 0, got {float(temperature)}")
    diff = s_teacher - s_student
    ranking = F.softplus(-diff / temperature).mean()  # softplus(-x) = -log sigmoid(x), stable for large |x|
    scores = torch.cat([s_teacher, s_student])
    score_reg = F.relu(scores.abs() - reg_threshold).pow(2).mean()
    loss = ranking + reg_weight * score_reg
    t, s = s_teacher.detach(), s_student.detach()
    metrics = {
        "d_acc": (t > s).float().mean(),
        "score_diff": (t - s).mean(),
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
    batch's scores before the ranking loss. warmup_steps: steps before the "learns nothing" rule applies."""

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
            if c.normalize_scores:
                # Only the ranking term (and the adaptive temperature, which must match its scale) sees
                # standardised scores; d_acc is unchanged by it, and the regulariser and the logged score
                # levels stay on the raw scores the reward hands out.
                normed = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)
                self._update_temperature(normed[:b] - normed[b:])
                loss, metrics = discriminator_loss(s_teacher, s_student, self.temperature, c.reg_threshold,
                                                   c.reg_weight)
                ranking = F.softplus(-(normed[:b] - normed[b:]) / self.temperature).mean()
                loss = ranking + c.reg_weight * F.relu(raw.abs() - c.reg_threshold).pow(2).mean()
                metrics["ranking_loss"] = ranking.detach()
                metrics["loss"] = loss.detach()
            else:
                self._update_temperature(s_teacher - s_student)
                loss, metrics = discriminator_loss(s_teacher, s_student, self.temperature, c.reg_threshold,
                                                   c.reg_weight)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), c.grad_clip)
            self.optimizer.step()
            self.critic.eval()
            self.step += 1
        metrics["temperature"] = torch.tensor(self.temperature)
        metrics["grad_norm"] = grad_norm.detach().float()
        metrics["step"] = torch.tensor(float(self.step))
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


def _value(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    if v is None:
        return None
    return float(v.item() if torch.is_tensor(v) else v)


def discriminator_health(metrics: dict, step: int | None = None, warmup_steps: int = 0,
                         overconfident: float = 0.9, learns_nothing: float = 0.6) -> list[tuple[str, str]]:
    """Rules over one step's (or a window-averaged) metrics -> [(severity, message)], severities as in
    recam.engine.health ("info" | "warn" | "critical"). Empty when healthy.

    d_acc > overconfident: the critic separates teacher from student almost always; its reward saturates
    and the policy is pushed toward whatever artefact the critic keys on. d_acc < learns_nothing after
    warm-up (step taken from metrics["step"] when not given): the critic cannot tell the two apart, its
    reward is noise. A non-finite loss is critical.
    """
    findings: list[tuple[str, str]] = []
    loss = _value(metrics, "loss")
    if loss is not None and not math.isfinite(loss):
        findings.append(("critical", f"discriminator loss is {loss}: critic diverged, restore its last checkpoint"))
    acc = _value(metrics, "d_acc")
    if step is None:
        s = _value(metrics, "step")
        step = int(s) if s is not None else None
    warmed_up = step is None or step >= warmup_steps
    if acc is not None:
        if acc > overconfident:
            findings.append(("warn", f"d_acc {acc:.3f} > {overconfident}: critic overconfident, its reward "
                                     "saturates; lower its lr, raise the temperature or train it less often"))
        elif acc < learns_nothing and warmed_up:
            findings.append(("warn", f"d_acc {acc:.3f} < {learns_nothing} after warm-up: critic learns nothing, "
                                     "its reward is noise; raise its lr or capacity, check the teacher videos"))
    reg = _value(metrics, "score_reg")
    if reg is not None and reg > 1.0:
        findings.append(("info", f"score_reg {reg:.3f}: scores drift past the threshold; raise reg_weight"))
    return findings


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
    """The ranges of reward.discriminator (recam/infra/config_checks.py's FieldChecks)."""
    checks.boolean("reward.discriminator.adaptive_temperature")
    for field in ("lr", "temperature", "reg_threshold"):
        checks.number(f"reward.discriminator.{field}", 0, None, low_open=True)
    checks.number("reward.discriminator.reg_weight", 0)
    checks.integer("reward.discriminator.steps_per_epoch", 0, why="critic updates per epoch")


@register_reward("discriminator", scores="video", check=check_settings)
def build_discriminator_reward(config, device=None) -> DiscriminatorReward:
    """Factory of `discriminator`: a fresh critic configured by config.reward.discriminator (None: defaults)."""
    return DiscriminatorReward(Discriminator(discriminator_config(config) if config is not None else None))

