"""Rollouts with log-probs, deterministic sampling, and re-scoring stored transitions under the current policy.

A rollout is deterministic before a window of T = scheduler.num_train_steps consecutive steps, stochastic (with
log-probs, stored and trained) inside it, and deterministic after it (Flow-GRPO-Fast, MixGRPO). The window
starts at step `start`; start 0 is the classic setting where the T noisiest steps are trained.

The policy is any `denoise(x (N, *sample_shape), t (N,)) -> model output (N, *sample_shape)` closure: the
domain closes the conditioning over its model, the scheduler says what the output means. These functions know
nothing about models, domains or configs.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from recam.engine.containers import Rollout
from recam.engine.sde import StepOutput, flow_sa_solver_pc, sa_solver_grid

ODE_SOLVERS = ("euler", "dpm2", "sa_solver", "sa_solver_pc")
# where sample.ode_solver runs: on every deterministic step, or only after the window (MixGRPO-Flash's "post":
# Euler before it)
SOLVER_SCOPES = ("all", "after_window")
INITIAL_NOISE_STREAM = 0x494E4954  # keeps sample.same_initial_noise's draws apart from the per-sample streams


def per_sample_noise(keys: list[tuple[int, ...]], num_draws: int, shape: tuple[int, ...],
                     workers: int | None = None) -> torch.Tensor:
    """Standard normal noise (N, num_draws, *shape), sample i drawn from its own stream seeded by keys[i].

    Keying noise by a sample's global position (not by process) makes a run's samples independent of how
    many processes share the batch: 1 process x 8 samples and 2 x 4 draw identical noise. Drawn on the CPU
    whatever the default device, up front; the noise of every run on the CPU device (noise_source), whose
    documented results rest on these exact numbers. An accelerator draws KeyedNoise instead.

    Each stream is sequential, but the streams are independent, so they are drawn on `workers` threads (default
    torch's intra-op thread count; torch lets go of the GIL while it draws). On a GPU this was the sampler's main
    CPU cost: 2,048 motion samples of 21 draws each took 13-24 s on one thread of a 2-core machine
    (docs/real_scale.md), which is why accelerators draw KeyedNoise.
    """
    out = torch.empty(len(keys), num_draws, *shape, device="cpu")

    def draw(i: int) -> None:
        out[i].normal_(generator=torch.Generator(device="cpu").manual_seed(_stream_seed(keys[i]) % (2**63)))

    workers = min(len(keys), torch.get_num_threads() if workers is None else workers)
    if workers <= 1:
        for i in range(len(keys)):
            draw(i)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(draw, range(len(keys))))
    return out


def _stream_seed(key: tuple[int, ...], words: int = 1) -> int | np.ndarray:
    # SeedSequence mixes the key so that nearby keys ((seed, batch, 0), (seed, batch, 1)) give unrelated streams
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(words, dtype=np.uint64 if words == 1
                                                                         else np.uint32)
    return int(state[0]) if words == 1 else state


class TensorNoise:
    """Draws made up front: noise (N, num_draws, *shape); draw(j) is noise[:, j]."""

    def __init__(self, noise: torch.Tensor):
        self.noise = noise

    def draw(self, j: int) -> torch.Tensor:
        return self.noise[:, j]


# lowbias32's multipliers (a 32-bit integer hash whose output bits each depend on every input bit), as int32
_MIX = (0x7FEB352D, 0x846CA68B - 2**32)
# pairs of elements per launch: bounds the int32 temporaries (a few alive at once) to a few hundred MB
_CHUNK = 1 << 25


def _xor_shift_(x: torch.Tensor, s: int) -> None:
    # x ^= x >>> s on int32 words: torch's >> is arithmetic, so the sign's copies are masked off
    x ^= (x >> s) & ((1 << (32 - s)) - 1)


def _mix32_(x: torch.Tensor) -> None:
    # in place, one pass per operation: on an accelerator this hash is memory-bound, so every pass counts.
    # int32 products wrap modulo 2^32, which is the hash's arithmetic.
    _xor_shift_(x, 16)
    x *= _MIX[0]
    _xor_shift_(x, 15)
    x *= _MIX[1]
    _xor_shift_(x, 16)


def keyed_uniform_bits(counters: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """32 random bits per counter, as int32 words: counters (...) int32, key (..., 3) int32 words broadcast against
    them. Each round is a bijection of the counter for a fixed key word, so one key's counters never collide, and
    each key word enters before a full mix, so keys that differ in one bit give unrelated streams (a counter-based
    generator: any draw is computed on its own, on any device)."""
    x = (counters ^ key[..., 0]).contiguous()
    _mix32_(x)
    for w in (1, 2):
        x ^= key[..., w]
        _mix32_(x)
    return x


class KeyedNoise:
    """Standard normal draws computed on `device` from (the sample's key, the draw's index, the element), read
    step by step as the rollout needs them: nothing is drawn for a step that reads no noise, and nothing crosses
    from the host but three key words per sample.

    A sample's numbers depend on its key alone, never on its batch, so 1 process x 8 samples and 2 x 4 draw
    identical noise on one device type (the bits are integer hashing; Box-Muller's float32 log and cos may differ
    in the last place between device types). They differ from
    per_sample_noise's torch.Generator streams, which stay the CPU device's noise. draw(0) is the initial x, drawn
    from initial_keys[i] when given (one start per condition, shared by its k copies); draw(j + 1) is step j's.
    """

    def __init__(self, keys: list[tuple[int, ...]], num_draws: int, shape: tuple[int, ...], device,
                 initial_keys: list[tuple[int, ...]] | None = None):
        self.num_draws, self.shape, self.device = num_draws, tuple(shape), torch.device(device)
        self.numel = int(np.prod(self.shape))
        self.pairs = (self.numel + 1) // 2  # Box-Muller makes two normals of two uniforms
        if 2 * num_draws * self.pairs >= 2**31:
            raise ValueError(f"{num_draws} draws of {self.numel} elements exceed a 31-bit counter per sample")
        self.keys = self._words(keys)
        self.initial = self._words(initial_keys) if initial_keys is not None else self.keys

    def _words(self, keys) -> torch.Tensor:
        words = np.stack([_stream_seed(k, 3) for k in keys]).view(np.int32)
        return torch.from_numpy(words).to(self.device)

    def draw(self, j: int) -> torch.Tensor:
        if not 0 <= j < self.num_draws:
            raise IndexError(f"draw {j} of {self.num_draws}")
        keys = self.initial if j == 0 else self.keys
        n = keys.shape[0]
        out = torch.empty(n, self.pairs, 2, device=self.device)
        rows = max(1, _CHUNK // self.pairs)
        # pair p of draw j takes counters 2 (j P + p) and 2 (j P + p) + 1: one uniform for the radius, one for the
        # angle, and the pair's two normals are the cosine's and the sine's
        c = 2 * (j * self.pairs + torch.arange(self.pairs, dtype=torch.int32, device=self.device))[None]
        for r in range(0, n, rows):
            key = keys[r:r + rows, None, :]
            a, b = keyed_uniform_bits(c, key), keyed_uniform_bits(c + 1, key)
            # the top 24 bits as floats: u1 in (0, 1] (log never sees 0), u2 in [0, 1); float32 holds both exactly
            radius = torch.sqrt(-2.0 * torch.log((((a >> 8) & 0xFFFFFF) + 1).float() * 2.0**-24))
            angle = ((b >> 8) & 0xFFFFFF).float() * (2 * math.pi * 2.0**-24)
            out[r:r + rows, :, 0] = radius * torch.cos(angle)
            out[r:r + rows, :, 1] = radius * torch.sin(angle)
        return out.view(n, 2 * self.pairs)[:, :self.numel].reshape(n, *self.shape)


def noise_source(keys: list[tuple[int, ...]], num_draws: int, shape: tuple[int, ...], device,
                 initial_keys: list[tuple[int, ...]] | None = None) -> TensorNoise | KeyedNoise:
    """A rollout's noise for samples keyed by keys[i]: on the CPU device, per_sample_noise's streams drawn up front
    (documented results rest on them bit for bit); on an accelerator, KeyedNoise, drawn on the device as read."""
    if torch.device(device).type != "cpu":
        return KeyedNoise(keys, num_draws, shape, device, initial_keys)
    noise = per_sample_noise(keys, num_draws, shape)
    if initial_keys is not None:
        noise[:, 0] = per_sample_noise(initial_keys, 1, shape)[:, 0]
    return TensorNoise(noise)


@torch.no_grad()
def rollout(denoise, noise: torch.Tensor, scheduler, mask: torch.Tensor | None = None, start: int = 0,
            store_means: bool = False, ode_solver: str = "euler", solver_scope: str = "all",
            post_window_compress: float = 1.0, sa_eta: float = 0.0,
            sa_sigma_range: tuple[float, float] = (0.3, 0.9)) -> Rollout:
    """Sample N outputs: steps start .. start + T - 1 stochastic with log-probs, every other step deterministic.

    Steps after the window stay deterministic because noise there would stay visible in the output while no
    trained step is responsible for it; steps before it are deterministic so that only the trained steps draw
    noise (Flow-GRPO-Fast). With T = 0 the whole trajectory is deterministic and nothing is stored.

    noise: a noise source (noise_source) or a tensor (N, S + 1, *sample_shape) of standard normal draws: draw 0
        the initial x, draw j + 1 step j's noise (read only inside the window, and by SA-Solver's steps).
    mask: the elements the log-probs average over (broadcastable to a sample batch), all when None.
    store_means: keep each stored transition's mean (objectives that compare with the sampling policy's means).
    ode_solver: "euler" (the scheduler's deterministic step), "dpm2" (DPM-Solver++(2M), flow schedulers only;
        first order on the first step; a stochastic step leaves its x0 prediction as the history, so the first step
        after the window is second order, as MixGRPO-Flash keeps its solver state through the window) or
        "sa_solver" (flow only, T = 0: SA-Solver's first-order stochastic step with tau = sa_eta on the steps that
        end at a sigma inside sa_sigma_range, tau 0 (Euler) elsewhere; it reads step j's noise noise[:, j + 1] and
        stores nothing) or "sa_solver_pc" (flow only, T = 0: AWM's sampler as its pipeline runs it, SA-Solver's
        order-2 predictor-corrector on sa_solver_grid's grid, recam.engine.sde.flow_sa_solver_pc; step j's noise
        noise[:, j + 1]).
    solver_scope: "all" (ode_solver on every deterministic step) or "after_window" (Euler before the window).
    post_window_compress: below 1, the steps after the window run on the scheduler's grid from the window's end
        compressed to this fraction of its points (scheduler.compressed_after, MixGRPO-Flash): fewer evaluations
        where nothing is trained.
    """
    T, S = scheduler.num_train_steps, scheduler.num_steps
    if not 0 <= start <= S - T:
        raise ValueError(f"a window of {T} steps starting at {start} does not fit in {S} steps")
    _check_solver(ode_solver, scheduler)
    if ode_solver in ("sa_solver", "sa_solver_pc") and T:
        raise ValueError(f"ode_solver {ode_solver!r} draws noise that no log-prob scores: it needs a rollout with no "
                         f"trained steps, got {T}")
    if solver_scope not in SOLVER_SCOPES:
        raise ValueError(f"solver_scope must be one of {SOLVER_SCOPES}, got {solver_scope!r}")
    noise = TensorNoise(noise) if isinstance(noise, torch.Tensor) else noise
    x = noise.draw(0)
    if ode_solver == "sa_solver_pc":
        final = flow_sa_solver_pc(denoise, x, sa_solver_grid(scheduler.sigmas),
                                  lambda t: sa_eta if sa_sigma_range[0] <= t <= sa_sigma_range[1] else 0.0, noise.draw)
        n, shape = final.shape[0], tuple(final.shape[1:])
        return Rollout(final=final, states=final.new_empty((n, 0, *shape)),
                       log_probs=torch.empty(n, 0, device=final.device), start=start,
                       means=final.new_empty((n, 0, *shape)) if store_means else None)
    states, log_probs, means = [], [], []
    previous = None  # the 2M solver's last x0 prediction; None restarts it at first order
    grid, j = scheduler, 0  # the grid becomes the compressed one after the window
    while j < grid.num_steps:
        out = denoise(x, grid.model_time(j, x.shape[0]))
        if start <= j < start + T:
            states.append(x)
            step = scheduler.transition(j, out, x, noise=noise.draw(j + 1), mask=mask)
            x = step.prev_sample
            log_probs.append(step.log_prob)
            if store_means:
                means.append(step.mean)
            if ode_solver == "dpm2":
                previous = scheduler.dpm2_history(j, out, states[-1])
        elif ode_solver == "dpm2" and (solver_scope == "all" or j >= start + T):
            x, previous = grid.deterministic_2m(j, out, x, previous)
        elif ode_solver == "sa_solver":
            x = grid.stochastic_adams(j, out, x, sa_eta, sa_sigma_range, noise.draw(j + 1))
        else:
            x = grid.deterministic(j, out, x)
        if T and j == start + T - 1:
            states.append(x)
            if post_window_compress < 1.0:
                grid = scheduler.compressed_after(start + T, post_window_compress)
        j += 1
    n, shape = x.shape[0], tuple(x.shape[1:])
    return Rollout(final=x,
                   states=torch.stack(states, 1) if states else x.new_empty((n, 0, *shape)),
                   log_probs=torch.stack(log_probs, 1) if log_probs else torch.empty(n, 0, device=x.device),
                   start=start,
                   means=(torch.stack(means, 1) if means else torch.empty(n, 0, *shape, device=x.device))
                   if store_means else None)


def solver_options(sample_config) -> dict:
    """rollout's solver keywords from config.sample (ode_solver, its scope, the post-window grid, SA-Solver's tau)."""
    s = sample_config
    return dict(ode_solver=s.ode_solver, solver_scope=s.ode_solver_scope, post_window_compress=s.post_window_compress,
                sa_eta=s.sa_eta, sa_sigma_range=(s.sa_min_sigma, s.sa_max_sigma))


def _check_solver(ode_solver: str, scheduler) -> None:
    if ode_solver not in ODE_SOLVERS:
        raise ValueError(f"ode_solver must be one of {ODE_SOLVERS}, got {ode_solver!r}")
    if ode_solver in ("dpm2", "sa_solver", "sa_solver_pc") and not getattr(scheduler, "is_flow", False):
        raise ValueError(f"ode_solver {ode_solver!r} is written for flow matching; {type(scheduler).__name__} is not")


@torch.no_grad()
def deterministic_sample(denoise, noise: torch.Tensor, scheduler, ode_solver: str = "euler") -> torch.Tensor:
    """Noise-free sampling from noise (N, *sample_shape); used for evaluation."""
    _check_solver(ode_solver, scheduler)
    if ode_solver in ("sa_solver", "sa_solver_pc"):
        raise ValueError(f"ode_solver {ode_solver!r} is stochastic; noise-free sampling takes 'euler' or 'dpm2'")
    x, previous = noise, None
    for j in range(scheduler.num_steps):
        out = denoise(x, scheduler.model_time(j, x.shape[0]))
        if ode_solver == "dpm2":
            x, previous = scheduler.deterministic_2m(j, out, x, previous)
        else:
            x = scheduler.deterministic(j, out, x)
    return x


def rescore(denoise, states: torch.Tensor, scheduler, j: int, mask: torch.Tensor | None = None,
            start: int = 0) -> StepOutput:
    """The stored transition states[:, j] -> states[:, j + 1], which is scheduler step start + j, under
    `denoise`: log-prob (N,), mean and std.

    Gradients flow through the model output into the log-prob and the mean.
    """
    x, step = states[:, j], start + j
    return scheduler.transition(step, denoise(x, scheduler.model_time(step, x.shape[0])), x,
                                next_state=states[:, j + 1], mask=mask)
