"""The toy domain's generator: a small conditional MLP denoiser and the DDPM pretraining that makes its base.

The base is trained in process from a fixed seed (no checkpoint file, nothing downloaded), so every run of
the `toy` preset starts from the same weights, and GRPO has a known distribution to improve on.
"""

from __future__ import annotations

import math

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from recam.domains.toy.data import sample_base_data


class ToyDenoiser(ModelMixin, ConfigMixin):
    """eps(x_t, t, c) or x0(x_t, t, c) for points x in R^dim conditioned on a target c in R^dim.

    A diffusers ModelMixin so that checkpoints are written and read like every other policy's
    (save_pretrained -> diffusion_pytorch_model.safetensors)."""

    @register_to_config
    def __init__(self, dim: int = 2, hidden: int = 128, depth: int = 3, time_features: int = 16,
                 num_train_timesteps: int = 100):
        super().__init__()
        # Log-spaced frequencies: the low ones separate coarse noise levels, the high ones neighbouring steps.
        freqs = torch.exp(torch.linspace(0.0, math.log(100.0), time_features // 2))
        self.register_buffer("freqs", freqs, persistent=False)
        layers: list[nn.Module] = [nn.Linear(2 * dim + time_features, hidden), nn.SiLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.SiLU()]
        layers.append(nn.Linear(hidden, dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, t: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """x, target: (b, dim); t: (b,) DDPM timesteps in [0, num_train_timesteps)."""
        phase = (t.float() / self.config.num_train_timesteps)[:, None] * self.freqs
        h = torch.cat([x.float(), target.float(), torch.sin(phase), torch.cos(phase)], dim=1)
        return self.net(h)


def pretrain(model: ToyDenoiser, alphas_cumprod: torch.Tensor, prediction_type: str, data_config, steps: int,
             batch_size: int, lr: float, seed: int) -> list[float]:
    """DDPM denoising regression on freshly drawn (target, point) pairs; returns the loss every 50 steps.

    Runs under its own RNG (forked), so building the base does not shift the run's global random stream."""
    a = alphas_cumprod.float()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # Cosine decay to zero: the last steps average out the minibatch noise of a short schedule.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, steps))
    losses = []
    model.train()
    for step in range(steps):
        target, x0 = sample_base_data(batch_size, data_config, gen)
        t = torch.randint(0, a.shape[0], (batch_size,), generator=gen)
        eps = torch.randn(x0.shape, generator=gen)
        at = a[t][:, None]
        xt = at.sqrt() * x0 + (1 - at).sqrt() * eps
        pred = model(xt, t, target)
        loss = ((pred - (eps if prediction_type == "epsilon" else x0)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
    # the last step's gradients would otherwise ride along into the first GRPO step (and into the reference copy)
    opt.zero_grad(set_to_none=True)
    model.eval()
    return losses
