"""Exploration in a subspace: stochastic steps whose noise lies in a few cosine components along the last axis, and
optionally in a few given directions over the other axes.

A GRPO update is a score-function estimate, sum_i A_i grad log p(x_i'), and each stochastic step contributes
grad log p = J^T noise / std with the noise drawn in every element of the sample. For a motion (263 x 196 = 51,548
elements) most of those directions are frame-to-frame wiggles or feature combinations no real frame has, which
the reward hardly sees; if each of them added variance to the estimate, exploring in fewer directions would make
an update more signal. On the embedded motion job it did not (docs/results.md, "Exploring in fewer directions"):
the options are here for models and rewards where it may.

With `sample.noise_frequencies = m` each stochastic step draws its noise only in the m lowest-frequency
orthonormal cosine (DCT-II) components along the sample's last axis (a motion's frames; over each sample's real
frames when a frame mask is given), independently for every other element (feature channel):

    x' = mean + std * B z,   z ~ N(0, I_m) per channel,   B: (frames, m) with orthonormal columns.

With `sample.noise_channels = c` the noise is further confined to c orthonormal directions P (C, c) over the
channels (the elements of every axis between the batch and the last, flattened; for a motion its 263 features),
which the domain gives (the motion domain: the leading principal directions of its training frames):

    x' = mean + std * P Z B^T,   Z ~ N(0, I) of shape (c, m).

The policy of such a step is a Gaussian on the coordinates z = B^T (x' - mean) / std (and P^T), and its log-prob
is that density, averaged over the d = channels x m (or c x m) coordinates ("mean") or summed ("sum"). The part of
x' outside span(B) is the mean's own, a deterministic function of the parameters, and goes untrained, as the
deterministic steps outside a window do. The KL toward the reference is left on every element: it keeps the whole
mean, explored directions or not, near the reference's. m = 0 is the neutral case: noise in every element (the
wrapped scheduler itself); m equal to the number of frames spans them all and gives the same samples and
log-probs as no subspace, up to float rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recam.engine.sde import StepOutput

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def cosine_basis(lengths: Tensor, num_frames: int, num_components: int) -> Tensor:
    """(N, m, F) float32 rows b_k(n) = c_k cos(pi (n + 1/2) k / L) for n < L (0 beyond), c_0 = sqrt(1/L),
    c_k = sqrt(2/L): the first m orthonormal DCT-II vectors over each sample's first L = lengths[i] frames."""
    lengths = lengths.to(torch.float64).reshape(-1, 1, 1)
    if bool((lengths < num_components).any()):
        raise ValueError(f"a sample has {int(lengths.min())} real frames, fewer than the {num_components} "
                         "noise components asked for")
    n = torch.arange(num_frames, dtype=torch.float64).reshape(1, 1, -1)
    k = torch.arange(num_components, dtype=torch.float64).reshape(1, -1, 1)
    scale = torch.where(k == 0, torch.sqrt(1.0 / lengths), torch.sqrt(2.0 / lengths))
    rows = scale * torch.cos(math.pi * (n + 0.5) * k / lengths)
    return torch.where(n < lengths, rows, torch.zeros((), dtype=torch.float64)).float()


def frame_lengths(mask: Tensor | None, sample: Tensor) -> Tensor:
    """(N,) the real frames of each sample: all of the last axis without a mask, else the count of a mask that
    marks frames only (every axis but the batch and the last of size 1) as a prefix of each sample's frames."""
    n, frames = sample.shape[0], sample.shape[-1]
    if mask is None:
        return torch.full((n,), frames, dtype=torch.long, device=sample.device)
    if mask.shape[-1] != frames or any(s != 1 for s in mask.shape[1:-1]):
        raise ValueError(f"low-frequency noise needs a mask over the frames only, shape (N, 1, ..., {frames}); got "
                         f"{tuple(mask.shape)}")
    real = torch.broadcast_to(mask.reshape(mask.shape[0], frames), (n, frames)).bool()
    lengths = real.sum(-1)
    prefix = torch.arange(frames, device=real.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not bool((prefix == real).all()):
        raise ValueError("low-frequency noise needs each sample's real frames to come first (padding at the end)")
    return lengths


def to_components(values: Tensor, basis: Tensor, channels: Tensor | None = None) -> Tensor:
    """(N, ..., F) -> coordinates (N, C, m) in the frame basis rows (N, m, F), all C = prod(...) channels, or
    (N, c, m) in the channel basis columns (C, c) as well."""
    coords = torch.einsum("ncf,nmf->ncm", values.reshape(values.shape[0], -1, values.shape[-1]), basis)
    return coords if channels is None else torch.einsum("ncm,cp->npm", coords, channels)


def from_components(coords: Tensor, basis: Tensor, shape: tuple[int, ...], channels: Tensor | None = None) -> Tensor:
    """Coordinates (N, C or c, m) -> the combination (N, *shape) of the frame basis rows (and channel columns)."""
    if channels is not None:
        coords = torch.einsum("npm,cp->ncm", coords, channels)
    return torch.einsum("ncm,nmf->ncf", coords, basis).reshape(coords.shape[0], *shape)


def subspace_log_prob(sample: Tensor, mean: Tensor, std: Tensor, basis: Tensor, channels: Tensor | None = None,
                      reduction: str = "mean") -> Tensor:
    """(N,) float32: log N(z; 0, I) - log std per coordinate of z = (sample - mean) / std in the subspace's
    coordinates (to_components), averaged ("mean") or summed ("sum") over them; 0 where std is 0 (no density, as
    for a deterministic step)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    std = std.reshape(-1, 1, 1) if std.dim() else std
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    z = to_components(sample.float() - mean, basis, channels) / safe_std
    density = -0.5 * z**2 - torch.log(safe_std) - _LOG_SQRT_2PI
    density = torch.where(positive, density, torch.zeros_like(density))
    dims = tuple(range(1, density.dim()))
    return density.mean(dim=dims) if reduction == "mean" else density.sum(dim=dims)


class SubspaceNoise:
    """A scheduler whose stochastic steps draw their noise in `num_components` cosine components along the last
    axis, and in the columns of `channels` (C, c) when given (see the module docstring); everything else is the
    wrapped scheduler's."""

    def __init__(self, inner, num_components: int, channels: Tensor | None = None):
        if isinstance(num_components, bool) or not isinstance(num_components, int) or num_components < 1:
            raise ValueError(f"num_components must be a positive int, got {num_components!r}")
        if channels is not None:
            eye = torch.eye(channels.shape[1], dtype=channels.dtype)
            if channels.dim() != 2 or not torch.allclose(channels.T @ channels, eye, atol=1e-4):
                raise ValueError(f"channels must be (C, c) with orthonormal columns, got shape {tuple(channels.shape)}")
            channels = channels.float()
        self.inner, self.num_components, self.channels = inner, num_components, channels
        self.reduction = getattr(inner, "reduction", "mean")

    def __getattr__(self, name):  # the time grid, deterministic steps, forward process: the wrapped scheduler's
        if name == "inner":  # not set yet (copy, unpickling): no delegation loop
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def num_train_steps(self) -> int:
        return self.inner.num_train_steps

    @property
    def num_steps(self) -> int:
        return self.inner.num_steps

    def transition(self, j, output, x, next_state=None, noise=None, mask=None) -> StepOutput:
        # the wrapped step scores x itself only to give its mean and std
        probe = self.inner.transition(j, output, x, next_state=x, mask=mask)
        basis = cosine_basis(frame_lengths(mask, x), x.shape[-1], self.num_components).to(x.device)
        channels = None if self.channels is None else self.channels.to(x.device)
        if next_state is None:
            # the step's own noise projected onto the subspace: standard normal coordinates there, and a rollout's
            # noise stays keyed by sample and step as without a subspace
            explore = from_components(to_components(noise.float(), basis, channels), basis, tuple(x.shape[1:]),
                                      channels)
            next_state = (probe.mean + probe.std * explore).to(x.dtype)
        log_prob = subspace_log_prob(next_state, probe.mean, probe.std, basis, channels, self.reduction)
        return StepOutput(prev_sample=next_state, log_prob=log_prob, mean=probe.mean, std=probe.std)

    def transition_kl(self, mean_a: Tensor, mean_b: Tensor, std, mask: Tensor | None = None) -> Tensor:
        """(N,) KL between this step's subspace Gaussians centred on mean_a and on mean_b: half the squared mean gap
        over std^2 in the subspace's coordinates, reduced as the log-probs are. The gap outside the subspace is no
        part of it: no draw can tell the two apart there."""
        basis = cosine_basis(frame_lengths(mask, mean_a), mean_a.shape[-1], self.num_components).to(mean_a.device)
        channels = None if self.channels is None else self.channels.to(mean_a.device)
        std = std.reshape(-1, 1, 1) if torch.is_tensor(std) and std.dim() else std
        gap = to_components(mean_a.float() - mean_b.float(), basis, channels) / std
        half_sq = 0.5 * gap**2
        dims = tuple(range(1, half_sq.dim()))
        return half_sq.mean(dim=dims) if self.reduction == "mean" else half_sq.sum(dim=dims)

    def with_steps(self, num_steps: int) -> SubspaceNoise:
        return SubspaceNoise(self.inner.with_steps(num_steps), self.num_components, self.channels)

    def with_train_steps(self, num_train_steps: int) -> SubspaceNoise:
        return SubspaceNoise(self.inner.with_train_steps(num_train_steps), self.num_components, self.channels)


def subspace_scheduler(scheduler, domain, domain_name: str, noise_frequencies: int, noise_channels: int):
    """`scheduler` (the domain's) with its stochastic steps' noise confined to the subspace sample.noise_frequencies
    (and sample.noise_channels) ask for; recam.engine.domain.exploration_scheduler calls it when they ask for one."""
    frames = domain.sample_shape()[-1]
    if noise_frequencies > frames:
        raise ValueError(f"sample.noise_frequencies={noise_frequencies} exceeds the {frames} positions on the last "
                         f"axis of the {domain_name} domain's samples")
    channels = None
    if noise_channels:
        if not hasattr(domain, "principal_channels"):
            raise ValueError(f"sample.noise_channels={noise_channels} needs the principal directions of the "
                             f"domain's data; the {domain_name} domain gives none: set it to 0")
        channels = domain.principal_channels(noise_channels)
    return SubspaceNoise(scheduler, noise_frequencies, channels)
