"""The toy domain: 2-D points generated around a target by a small DDPM-trained MLP, sampled with DDIM, scored
by an analytic reward. It exists to show that the engine knows nothing camera-specific: the same trainer,
objective, guard, checkpoints and evaluation post-train it in seconds on a CPU.

Config: the `toy` section of the `toy` preset (config/grpo.py); data.num_*_conditions size the splits.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

import recam.domains.toy.rewards  # noqa: F401  (importing it registers the toy's rewards)
from recam.domains.toy.data import ToyConditions
from recam.domains.toy.model import ToyDenoiser, pretrain
from recam.engine.containers import Batch
from recam.engine.domain import Splits, register_domain
from recam.engine.scheduler import DDIMScheduler
from recam.infra.lora import adapter_disabled
from recam.infra.runlog import write_whole
from rewards import MultiReward

PREDICTION_TYPES = ("epsilon", "sample")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid", "laplace")  # diffusers DDPMScheduler


def training_alphas_cumprod(toy_config) -> torch.Tensor:
    """The DDPM noise schedule the base is trained on (and DDIM samples over), from diffusers' scheduler config."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=toy_config.num_train_timesteps,
                         beta_schedule=toy_config.beta_schedule).alphas_cumprod.clone()


def build_base(toy_config, log=None) -> ToyDenoiser:
    """The pretrained base: initialised and trained under toy.model_seed only, so it is the same in every run."""
    t = toy_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.model_seed)
        model = ToyDenoiser(dim=2, hidden=t.hidden, depth=t.depth, time_features=t.time_features,
                            num_train_timesteps=t.num_train_timesteps)
    losses = pretrain(model, training_alphas_cumprod(t), t.prediction_type, t, t.pretrain_steps, t.pretrain_batch_size,
                      t.pretrain_lr, t.model_seed)
    if log is not None:
        log.detail(f"toy base: {t.pretrain_steps} DDPM steps ({t.prediction_type} prediction), "
                 f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return model


def check_config(config, conditions_per_batch: int, require) -> None:
    """The toy domain's own config checks (config/validate.py runs them for domain 'toy'); `require(cond, msg)`
    raises the config error."""
    require("toy" in config, "domain='toy' needs the `toy` config section: start from the toy preset "
            "(--config config/grpo.py:toy)")
    t, d, m, e = config.toy, config.data, config.model, config.eval
    weights = dict(config.reward.weights)
    report = [n.strip() for n in e.report_rewards.split(",") if n.strip()]
    scored = {k for k, w in weights.items() if w > 0} | set(report)
    for field in ("select_by", "select_guard"):
        require(e[field] == "" or e[field] in scored,
                f"eval.{field}={e[field]!r} must be '' or a toy reward scored at evaluation: {sorted(scored)}")
    require(not e.select_by or d.num_val_conditions >= 1,
            f"eval.select_by={e.select_by!r} needs data.num_val_conditions >= 1, got {d.num_val_conditions}")
    require(d.num_train_conditions >= conditions_per_batch,
            f"data.num_train_conditions={d.num_train_conditions} is smaller than the {conditions_per_batch} unique "
            "conditions one sampling batch needs")
    require(d.num_heldout_conditions >= 1, f"data.num_heldout_conditions must be >= 1, got {d.num_heldout_conditions}")
    require(t.prediction_type in PREDICTION_TYPES,
            f"toy.prediction_type={t.prediction_type!r} unknown; use one of {list(PREDICTION_TYPES)}")
    require(0 < t.eta <= 1, f"toy.eta must be in (0, 1] for stochastic DDIM rollouts, got {t.eta}")
    require(t.beta_schedule in BETA_SCHEDULES,
            f"toy.beta_schedule={t.beta_schedule!r} unknown; use one of {list(BETA_SCHEDULES)}")
    for field in ("model_seed", "num_side_modes"):
        require(isinstance(t[field], int) and not isinstance(t[field], bool) and t[field] >= 0,
                f"toy.{field} must be an integer >= 0, got {t[field]!r}")
    require(t.mode_offset >= 0, f"toy.mode_offset must be >= 0 (ring radius of the side modes), got {t.mode_offset}")
    require(isinstance(t.num_train_timesteps, int) and t.num_train_timesteps >= config.sample.num_steps
            and t.num_train_timesteps >= config.sample.eval_num_steps,
            f"toy.num_train_timesteps={t.num_train_timesteps} must be an integer >= sample.num_steps "
            f"({config.sample.num_steps}) and sample.eval_num_steps ({config.sample.eval_num_steps})")
    for field in ("hidden", "depth", "time_features", "pretrain_steps", "pretrain_batch_size"):
        require(isinstance(t[field], int) and t[field] >= 1,
                f"toy.{field} must be a positive integer, got {t[field]!r}")
    require(t.time_features % 2 == 0, f"toy.time_features must be even (sin and cos pairs), got {t.time_features}")
    for field in ("reward_width", "mode_std", "target_radius", "pretrain_lr"):
        require(t[field] > 0, f"toy.{field} must be > 0, got {t[field]}")
    require(m.lora_rank == 0 or m.lora_targets.strip() != "",
            "model.lora_rank > 0 needs model.lora_targets naming the toy MLP's Linear layers (e.g. 'net.2,net.4'): "
            "the default targets are the video transformer's attention projections")
    require(config.mixed_precision == "no", f"the toy domain runs in float32: mixed_precision must be 'no', got "
            f"{config.mixed_precision!r}")
    require(not m.gradient_checkpointing, "model.gradient_checkpointing is not supported by the toy MLP (it has no "
            "blocks to recompute); set it False")


@register_domain("toy")
class ToyDomain:
    sample_kind = "points"  # what decode returns, and so which registered rewards can score it
    examples_dir = "plots"
    summary_rows = (("target", "eval/target"), ("near (share within one width)", "eval/near"),
                    ("distance to target", "eval/distance"))
    check_config = staticmethod(check_config)  # run by config/validate.py before anything is built

    def __init__(self, config, device, log):
        self.config, self.device, self.log = config, device, log
        self._splits = None

    # ---- data ----
    def datasets(self) -> Splits:
        if self._splits is None:
            d, r = self.config.data, self.config.toy.target_radius
            self._splits = Splits(ToyConditions("train", d.num_train_conditions, d.seed, r),
                                  ToyConditions("heldout", d.num_heldout_conditions, d.seed, r),
                                  ToyConditions("val", d.num_val_conditions, d.seed, r)
                                  if self.config.eval.select_by else None)
        return self._splits

    def condition_id(self, dataset, i: int) -> str:
        return dataset.condition_id(i)

    def collate(self, dataset, indices, cache=None) -> Batch:
        conditions = [dataset[int(i)] for i in indices]
        targets = torch.stack([c.target for c in conditions]).to(self.device)
        return Batch(torch.as_tensor([int(i) for i in indices]), conditions, targets)

    # ---- model ----
    def build_policy(self) -> torch.nn.Module:
        return build_base(self.config.toy, self.log)

    def sample_shape(self) -> tuple[int, ...]:
        return (2,)

    def scheduler(self, device) -> DDIMScheduler:
        from recam.engine.plan import num_train_timesteps

        s, t = self.config.sample, self.config.toy
        return DDIMScheduler(training_alphas_cumprod(t), s.num_steps, t.eta, t.prediction_type,
                             num_train_timesteps(s.num_steps, self.config.train.timestep_fraction), device)

    def denoiser(self, model, batch: Batch, autocast, adapter_off: bool = False):
        targets = batch.inputs

        def predict(x, t):
            with autocast(), (adapter_disabled(model) if adapter_off else contextlib.nullcontext()):
                return model(x, t, targets).float()
        return predict

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        return samples.float().cpu()  # the points are the output

    # ---- rewards, hooks, examples ----
    def reward_fn(self, weights, report=()):
        return MultiReward(weights, report=report, config=self.config, device=self.device)

    def hooks(self) -> list:
        return []

    def write_examples(self, out_dir: Path, batch: Batch, decoded: torch.Tensor, n: int) -> None:
        """One PNG: each of the first n conditions' target (cross), its sample (dot) and a circle of the reward's
        width; a trained policy's dots move into the circles."""
        import matplotlib

        matplotlib.use("Agg")  # no display on training machines
        import matplotlib.pyplot as plt

        out_dir.mkdir(parents=True, exist_ok=True)
        n = min(n, decoded.shape[0])
        fig, ax = plt.subplots(figsize=(5, 5))
        colours = plt.get_cmap("tab10")
        for i in range(n):
            c, x = batch.conditions[i].target.tolist(), decoded[i].tolist()
            ax.add_patch(plt.Circle(c, self.config.toy.reward_width, fill=False, color=colours(i % 10), alpha=0.4))
            ax.plot([c[0], x[0]], [c[1], x[1]], color=colours(i % 10), lw=0.8, alpha=0.6)
            ax.scatter([c[0]], [c[1]], marker="x", color=colours(i % 10))
            ax.scatter([x[0]], [x[1]], marker="o", s=18, color=colours(i % 10))
        lim = self.config.toy.target_radius + self.config.toy.mode_offset + 3 * self.config.toy.mode_std
        ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal",
               title=f"{out_dir.name}: target (x), sample (o), reward width (circle)")
        image = io.BytesIO()  # drawn in memory and written whole: a full disk leaves no half-written PNG
        fig.savefig(image, format="png", dpi=80)
        plt.close(fig)
        write_whole(out_dir / "points.png", image.getvalue())
