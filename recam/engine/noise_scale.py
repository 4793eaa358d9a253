"""The gradient noise scale of every update: how many samples an update needs before its direction mostly repeats from
one update to the next.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162), define the
simple noise scale B_simple = tr(Sigma) / |G|^2, G the true gradient and Sigma the covariance of one draw's gradient.
The mean gradient of b independent draws satisfies E|G_b|^2 = |G|^2 + tr(Sigma) / b, so two batch sizes b < B give
(their appendix A)

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

both unbiased, being linear in the squared norms. With many small batches of sizes b_i, the mean of |G_{b_i}|^2 has
expectation |G|^2 + tr(Sigma) mean(1/b_i), so the same formulas hold with |G_b|^2 -> mean |G_{b_i}|^2 and 1/b ->
mean(1/b_i) (two_batch_estimates). The ratio of the two is biased, so, as the paper does, the two estimates are
averaged over optimizer steps separately (RunningNoise) and only their running means are divided.

Here a draw is a sample, but the samples are not independent: GRPO centres the k copies of a condition within their
group, so a group is one draw of k samples. A small batch that holds part of a group misses the cancellation the
centring gives the whole update, and its |G_b|^2 is too large on average. Every small batch is therefore a set of
whole groups (recam.engine.trainer orders the samples group by group, whole_group_cuts finds where micro-batches may
be split), and tr(Sigma) is k times the covariance of a group's mean gradient, in units of samples. Where a group's
copies sit on several processes no process holds a whole group, and no unbiased estimate exists: the record says so.

update_consistent_share = 1 / (1 + B_simple / B) is the expected cosine between two independent updates of B samples,
E[G_B . G'_B] / E|G_B|^2 = |G|^2 / (|G|^2 + tr(Sigma) / B): the share of an update's squared norm that repeats from
one update to the next. G is the whole loss's gradient, so that share counts every consistent pull, the KL term's
toward the reference included, not the reward's signal alone: a placebo run (advantages carrying no reward
information) can have as small a noise scale as GRPO. Records written before the field's rename carry it as
update_signal_share (recam.infra.schema.consistent_share_of reads both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

from recam.infra.distributed import sum_over_shards
from recam.infra.schema import CONSISTENT_SHARE

# Per optimizer step. The noise scale drifts as the policy learns (the paper's B_noise grows as the loss falls), so a
# plain mean over the whole run would let the first epochs decide it for ever; one step's estimate is far too noisy
# on its own (its |G|^2 is a small difference of two large squared norms). An exponential mean over about 20 steps,
# bias-corrected as Adam's moments are, weighs the steps of a short run alike (at n steps with n << 20 it is nearly
# their plain mean) and forgets the start of a long one.
RUNNING_DECAY = 0.95


# ---------------------------------------------------------------------------------------------------------------
# the formulas


def two_batch_estimates(small_sq: torch.Tensor, small_sizes: torch.Tensor, big_sq: float,
                        big_size: float) -> tuple[float, float] | None:
    """(|G|^2, tr(Sigma)) from small batches' squared gradient norms small_sq (m,) at sizes small_sizes (m,) and the
    whole update's big_sq at big_size (module docstring); None when no small batch is smaller than the update (the
    two equations are then the same one). Sizes in draws (samples)."""
    if small_sq.numel() == 0 or small_sq.shape != small_sizes.shape:
        return None
    sizes = small_sizes.double()
    if not bool((sizes > 0).all()) or not bool((sizes < big_size).any()):
        return None
    inv_small, inv_big = float((1 / sizes).mean()), 1.0 / big_size
    mean_small = float(small_sq.double().mean())
    trace = (mean_small - big_sq) / (inv_small - inv_big)
    return big_sq - trace * inv_big, trace


def noise_scale(g2: float | None, trace: float | None) -> float | None:
    """B_simple = tr(Sigma) / |G|^2 in samples; None when either estimate is missing or not above 0 (a noise scale
    of a signal that is not measurable, or of noise that is not, would be a number that only looks like one)."""
    if g2 is None or trace is None or not (g2 > 0 and trace > 0) or not math.isfinite(g2 + trace):
        return None
    return trace / g2


def consistent_share(g2: float | None, trace: float | None, samples: float | None) -> float | None:
    """1 / (1 + B_simple / B): the expected cosine between two independent updates of `samples` samples, the share of
    an update's squared norm that repeats between them (KL pull included: module docstring)."""
    b = noise_scale(g2, trace)
    if b is None or not samples or samples <= 0:
        return None
    return 1.0 / (1.0 + b / samples)


def why_not_ratio(g2: float | None, trace: float | None) -> str | None:
    """Why noise_scale(g2, trace) is None, in words; None when it is a number."""
    if g2 is None or trace is None:
        return "no estimate"
    if not math.isfinite(g2 + trace):
        return "non-finite estimates"
    if g2 <= 0:
        return (f"estimated |G|^2 = {g2:.3g} is not above 0: the signal is below what these sizes can measure "
                "(the noise scale is larger than the estimate can show)")
    if trace <= 0:
        return f"estimated tr(Sigma) = {trace:.3g} is not above 0: the noise is below what these sizes can measure"
    return None


# Enough resamples that the percentiles' own Monte Carlo error is small against the interval; a fixed seed so that the
# same records always give the same interval.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def bootstrap_ratio_interval(g2: list[float], trace: list[float], weights: list[float] | None = None, *,
                             resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                             level: float = 0.95) -> tuple[float, float]:
    """Percentile-bootstrap interval of the pooled noise scale sum(w trace) / sum(w g2) over epochs (one estimate
    pair per epoch, w its optimizer steps): the epochs resampled with replacement, the ratio of each resample's
    weighted means, and the quantiles of those ratios at expanded_tail and 1 - expanded_tail (the empirical quantile,
    no interpolation; with many epochs the tails approach (1 -+ level) / 2, the plain percentile interval's).
    The epochs are the independent draws, and an epoch's two estimates come from the same steps, so they are
    resampled together; a ratio of noisy means is skewed, which a t-interval on it would hide. A resample whose
    |G|^2 mean is not above 0 has a noise scale larger than any number, +inf: the upper end is then open where
    enough of them do. A negative tr(Sigma) mean counts as 0 noise."""
    g, t = np.asarray(g2, dtype=np.float64), np.asarray(trace, dtype=np.float64)
    w = np.ones_like(g) if weights is None else np.asarray(weights, dtype=np.float64)
    if not (g.shape == t.shape == w.shape and g.ndim == 1 and g.size >= 2):
        raise ValueError("bootstrap_ratio_interval needs matching lists of at least two epochs")
    if not (np.isfinite(g).all() and np.isfinite(t).all() and np.isfinite(w).all() and (w > 0).all()):
        raise ValueError("bootstrap_ratio_interval needs finite estimates and positive weights")
    rows = np.random.default_rng(seed).integers(0, g.size, size=(resamples, g.size))
    weight = w[rows].sum(axis=1)
    g_mean = (w[rows] * g[rows]).sum(axis=1) / weight
    t_mean = np.maximum((w[rows] * t[rows]).sum(axis=1) / weight, 0.0)
    ratio = np.where(g_mean > 0, t_mean / np.where(g_mean > 0, g_mean, 1.0), np.inf)
    tail = expanded_tail(g.size, level)
    low, high = np.quantile(ratio, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def expanded_tail(n: int, level: float = 0.95) -> float:
    """The quantile an expanded percentile interval takes at each end for n resampled units (Hesterberg 2015, "What
    Teachers Should Know About the Bootstrap"): Phi(sqrt(n / (n - 1)) t_{n-1}((1 - level) / 2)). The plain
    percentile interval is too narrow with few units, as a z-interval with the plug-in standard deviation is (the
    bootstrap's spread divides by n, not n - 1, and it knows no t): on 8 simulated epochs of a noisy |G|^2
    (tests/test_noise_scale.py) the plain one covered the true ratio in 88% of 300 runs at a nominal 95%, this one
    in 93%."""
    q = stats.t.ppf((1 - level) / 2, n - 1) * math.sqrt(n / (n - 1))
    return float(stats.norm.cdf(q))


# ---------------------------------------------------------------------------------------------------------------
# groups: which samples must stay together


def group_units(index: torch.Tensor) -> torch.Tensor:
    """(n,) a unit id (0, 1, ... in order of first position) per local sample position, from index (P, n): every
    process's dataset index per local position. Positions that hold the same condition on some process are one unit,
    and so are, transitively, positions linked on different processes, so that one training order (the same
    positions on every process) keeps every process's groups together. A condition drawn twice in an epoch (a small
    dataset wraps) is one group of the advantages, and one unit here."""
    P, n = index.shape
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for row in index.tolist():
        first: dict[int, int] = {}
        for t, c in enumerate(row):
            if c in first:
                ra, rb = find(first[c]), find(t)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
            else:
                first[c] = t
    labels: dict[int, int] = {}
    return torch.tensor([labels.setdefault(find(t), len(labels)) for t in range(n)], dtype=torch.long)


def group_order(units: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(n,) local positions: the units in a random order drawn from `generator`, each unit's positions together (in
    sampling order), so that micro-batches of a multiple of k samples hold whole groups."""
    count = int(units.max()) + 1 if units.numel() else 0
    members = [[] for _ in range(count)]
    for t, u in enumerate(units.tolist()):
        members[u].append(t)
    perm = torch.randperm(count, generator=generator).tolist()
    return torch.tensor([t for u in perm for t in members[u]], dtype=torch.long)


def groups_across_processes(index: torch.Tensor, keep: torch.Tensor) -> int:
    """How many conditions have kept samples on more than one process (index, keep: (P, n)). Such a group is whole on
    no process, so no process's small batch holds it whole."""
    seen: dict[int, int] = {}
    spanning = set()
    for p, (row, kept) in enumerate(zip(index.tolist(), keep.tolist(), strict=True)):
        for c, k in zip(row, kept, strict=True):
            if not k:
                continue
            if seen.setdefault(c, p) != p:
                spanning.add(c)
    return len(spanning)


def whole_group_cuts(micro_units: list[torch.Tensor], units: torch.Tensor) -> list[int] | None:
    """The boundaries c (1 .. M) of a step's M micro-batches such that micro-batches [0, c) hold whole units: those
    that close every unit they opened, so that consecutive cuts bound small batches of whole groups. micro_units:
    the unit id of each position of each micro-batch; units: every position's unit (n,), to see whether the step
    holds its units whole. None when it does not (a unit continues in another step): the step's own gradient is then
    not a set of whole groups."""
    step = torch.cat(micro_units) if micro_units else torch.zeros(0, dtype=torch.long)
    if step.numel() == 0:
        return None
    ids, in_step = torch.unique(step, return_counts=True)
    if not torch.equal(in_step, torch.bincount(units, minlength=int(ids.max()) + 1)[ids]):
        return None
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for m, u in enumerate(micro_units):
        for x in u.tolist():
            first.setdefault(x, m)
            last[x] = m
    open_until = [0] * (len(micro_units) + 1)  # open_until[c] > 0: some unit started before c and goes on after it
    for x, f in first.items():
        for c in range(f + 1, last[x] + 1):
            open_until[c] += 1
    return [c for c in range(1, len(micro_units) + 1) if open_until[c] == 0]


# ---------------------------------------------------------------------------------------------------------------
# measuring it during an update


def squared_norm(tensors: list[torch.Tensor | None], reduce=None, device=None) -> float:
    """sum |t|^2 over the tensors (None counts as 0), summed in fp32 on their device and read once; `reduce` sums it
    over processes when each holds a shard (FSDP), and is called on every process, shards or none."""
    sums = [t.detach().float().pow(2).sum() for t in tensors if t is not None]
    total = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
    return float(total if reduce is None else reduce(total))


class StepProbe:
    """One optimizer step's small batches: the squared norm of the accumulated gradient's increment between
    consecutive cuts (after micro-batch c - 1, for each c in `cuts`), each the local gradient of a run of micro-batches
    of whole groups. It keeps one fp32 copy of the trainable gradients, the accumulated gradient at the latest cut (none
    after the last), and no other: each parameter's increment is squared and summed before the next one's is formed.

    scales[i]: what turns small batch i's increment (a weighted sum, weights P / kept) into its mean gradient,
    kept / (P b_i) (recam.engine.advantages.step_sample_weights); sizes[i]: b_i, its kept samples on this process."""

    def __init__(self, parameters: list[torch.nn.Parameter], cuts: list[int], sizes: list[int],
                 scales: list[float]):
        self.parameters, self.cuts, self.sizes, self.scales = parameters, set(cuts), sizes, scales
        self.last: list[torch.Tensor | None] = [None] * len(parameters)
        self.squares: list[float] = []

    def after_micro_batch(self, c: int) -> None:
        """Call after micro-batch c's backward passes (0 first)."""
        if c + 1 not in self.cuts:
            return
        again = c + 1 < max(self.cuts)  # the last cut's gradient is never subtracted from: no copy of it
        sums = []
        for i, p in enumerate(self.parameters):
            g, before = p.grad, self.last[i]
            if g is None:  # not reached by any backward yet (gradients only accumulate: nothing to take back)
                continue
            if before is None:
                sums.append(g.detach().float().pow(2).sum())
                if again:
                    self.last[i] = g.detach().float().clone()
            else:
                sums.append((g.detach().float() - before).pow(2).sum())
                if again:
                    before.copy_(g.detach())
        sq = float(torch.stack(sums).sum()) if sums else 0.0
        i = len(self.squares)
        self.squares.append(sq * self.scales[i] ** 2)

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(squared norms, sizes) of this process's small batches, float64 (m,) each."""
        self.last = [None] * len(self.parameters)  # its memory goes back before the optimizer step
        return (torch.tensor(self.squares, dtype=torch.float64),
                torch.tensor(self.sizes[:len(self.squares)], dtype=torch.float64))


@dataclass
class RunningNoise:
    """Bias-corrected exponential means of the per-step |G|^2 and tr(Sigma) estimates (RUNNING_DECAY), kept apart so
    that the noise scale is their ratio, not a mean of noisy ratios. JSON-able through state_dict."""

    decay: float = RUNNING_DECAY
    steps: int = 0
    g2_sum: float = 0.0  # decay-weighted sums; divided by 1 - decay^steps they are the means
    trace_sum: float = 0.0

    def add(self, g2: float, trace: float) -> None:
        self.g2_sum = self.decay * self.g2_sum + (1 - self.decay) * g2
        self.trace_sum = self.decay * self.trace_sum + (1 - self.decay) * trace
        self.steps += 1

    def means(self) -> tuple[float | None, float | None]:
        """(|G|^2, tr(Sigma)) running means; (None, None) before the first estimate."""
        if self.steps == 0:
            return None, None
        norm = 1 - self.decay ** self.steps
        return self.g2_sum / norm, self.trace_sum / norm

    def state_dict(self) -> dict:
        return {"decay": self.decay, "steps": self.steps, "g2_sum": self.g2_sum, "trace_sum": self.trace_sum}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint from before the noise scale was measured resumes from no estimate."""
        state = state or {}
        self.decay = float(state.get("decay", RUNNING_DECAY))
        self.steps = int(state.get("steps", 0))
        self.g2_sum, self.trace_sum = float(state.get("g2_sum", 0.0)), float(state.get("trace_sum", 0.0))


@dataclass
class EpochNoise:
    """One epoch's per-step estimates, the update sizes, and why steps gave none."""

    g2: list[float] = field(default_factory=list)
    trace: list[float] = field(default_factory=list)
    small_batches: int = 0
    update_samples: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)


class NoiseScale:
    """The trainer's side of the measurement: per epoch, the training order of whole groups and whether the epoch can
    be measured at all (begin_epoch); per step, its micro-batches measured as they are trained (micro_batches: probe
    before the first, StepProbe.after_micro_batch after each, finish_step once the gradient is synced, before it is
    clipped); per epoch, the record (record). Its running means are checkpointed as a hook's state is (state_key,
    state_dict, load_state_dict: recam.engine.run_checkpoints saves and restores them, at a resume and a rollback
    alike)."""

    state_key = "noise_scale"

    def __init__(self, enabled: bool, parameters: list[torch.nn.Parameter], rank: int, world_size: int,
                 gather=None, reduce=None, grad_scale=None):
        """gather: (m, ...) on each process -> (P m, ...) in rank order (None with one process); reduce: sums a
        tensor over processes when each holds a shard of the synced gradient (FSDP), else None; grad_scale: () -> the
        loss scale the gradients carry (fp16's GradScaler), None for none."""
        self.enabled, self.parameters = enabled, [p for p in parameters if p.requires_grad]
        self.rank, self.world_size, self.gather, self.reduce = rank, world_size, gather, reduce
        self.grad_scale = grad_scale
        self.device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self.running = RunningNoise()
        self.epoch = EpochNoise()
        self.units: torch.Tensor | None = None
        self.blocked: str | None = None

    @classmethod
    def of(cls, enabled: bool, policy: torch.nn.Module, accelerator) -> NoiseScale:
        """The trainer's: over the prepared policy's trainable parameters, gathering with the accelerator, summing
        over shards under FSDP, dividing out fp16's loss scale."""
        scaler = getattr(accelerator, "scaler", None)
        P = accelerator.num_processes
        return cls(enabled, list(policy.parameters()), accelerator.process_index, P,
                   gather=accelerator.gather if P > 1 else None, reduce=sum_over_shards(policy),
                   grad_scale=(lambda: float(scaler.get_scale())) if scaler is not None else None)

    def state_dict(self) -> dict:
        return self.running.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.running.load_state_dict(state)

    def begin_epoch(self, index: torch.Tensor, keep: torch.Tensor, seed: int) -> torch.Tensor:
        """index, keep: (P, n) every process's dataset index and kept flag per local position. Returns the epoch's
        training order (group_order, drawn from `seed`): the units of group_units in a random order, each in a row,
        the same positions on every process, so that micro-batches of a multiple of k samples are whole groups (and a
        step of whole groups gets the cancellation of the centred advantages the whole epoch gets). Decides whether
        the epoch can be measured at all."""
        self.epoch = EpochNoise()
        self.units = group_units(index)
        self.blocked = None
        if not self.enabled:
            self.blocked = "train.noise_scale is off"
        elif (spanning := groups_across_processes(index, keep)) > 0:
            self.blocked = (f"{spanning} group(s) have copies on more than one process (sample.batch_size is not a "
                            f"multiple of sample.k, or a condition was drawn twice): no process holds them whole, "
                            "and small batches of parts of groups would bias the estimate")
        if self.blocked:
            self.epoch.skip(self.blocked)
        return group_order(self.units, torch.Generator().manual_seed(seed))

    def micro_batches(self, chunk: list[torch.Tensor], keep: torch.Tensor, rank: int):
        """Yields (c, positions) for each micro-batch of the optimizer step over `chunk`, for the caller to train (its
        backward passes) before asking for the next; then, the step's gradient synced and not yet clipped, estimates
        the step (finish_step). keep: (P, n) every process's kept flags."""
        kept = int(keep[:, torch.cat(chunk)].sum())
        probe = self.probe(chunk, keep[rank], kept)
        for c, sel in enumerate(chunk):
            yield c, sel
            if probe is not None:
                probe.after_micro_batch(c)
        self.finish_step(probe, kept)

    def probe(self, chunk: list[torch.Tensor], keep_local: torch.Tensor, kept: int) -> StepProbe | None:
        """A StepProbe for the optimizer step over micro-batches `chunk` (local positions), or None (the reason is
        kept for the record). keep_local: (n,) this process's kept flags; kept: the step's kept samples, all
        processes."""
        if self.blocked:
            return None
        cuts = whole_group_cuts([self.units[sel] for sel in chunk], self.units)
        if cuts is None:
            self.epoch.skip("a step splits a group with another step (the optimizer step does not hold whole groups)")
            return None
        if self.world_size > 1:
            # the last micro-batch's backward syncs the gradients: its local increment is never seen
            cuts = [c for c in cuts if c < len(chunk)]
        bounds = [0, *cuts]
        sizes = [int(keep_local[torch.cat(chunk[a:b])].sum()) for a, b in zip(bounds, bounds[1:], strict=False)]
        # decided from what every process knows alike, so that all of them gather in finish_step or none does: with
        # several processes a small batch is one process's share, smaller than the update; alone, one is the update
        if not cuts or (self.world_size == 1 and sizes == [kept]):
            self.epoch.skip("no small batch of whole groups smaller than the update: one micro-batch per step"
                            + (" before the last (whose gradient is synced)" if self.world_size > 1 else "")
                            + ", or groups spanning every micro-batch boundary")
            return None
        scales = [kept / (self.world_size * b) if b > 0 else 0.0 for b in sizes]
        return StepProbe(self.parameters, cuts, sizes, scales)

    def finish_step(self, probe: StepProbe | None, kept: int) -> None:
        """After the step's last backward (the gradient synced), before clipping: one estimate of |G|^2 and
        tr(Sigma) from every process's small batches, added to the running means. Called on every process alike."""
        self.epoch.update_samples.append(kept)
        if probe is None:
            return
        squares, sizes = probe.local()
        if self.gather is not None:  # fp32 on the wire: NPUs have no fp64 collectives
            both = self.gather(torch.stack([squares, sizes], 1).float().to(self.device)).cpu().double()
            squares, sizes = both[:, 0], both[:, 1]
        big = squared_norm([p.grad for p in self.parameters], self.reduce, self.device)
        scale = self.grad_scale() if self.grad_scale is not None else 1.0
        used = sizes > 0  # a small batch whose every sample was excluded has no gradient to measure
        squares, sizes = squares[used] / scale ** 2, sizes[used]
        estimate = two_batch_estimates(squares, sizes, big / scale ** 2, float(kept))
        if estimate is None or not all(math.isfinite(x) for x in estimate):
            self.epoch.skip("no usable small batch" if estimate is None else "non-finite gradient norms")
            return
        g2, trace = estimate
        self.epoch.g2.append(g2)
        self.epoch.trace.append(trace)
        self.epoch.small_batches += int(used.sum())
        self.running.add(g2, trace)

    def record(self) -> dict:
        """The epoch record's noise fields: the noise scale and consistent share from the running means (what to read)
        and from this epoch's steps alone (`_epoch`), the raw estimates, and why a value is None."""
        e = self.epoch
        samples = sum(e.update_samples) / len(e.update_samples) if e.update_samples else None
        g2 = sum(e.g2) / len(e.g2) if e.g2 else None
        trace = sum(e.trace) / len(e.trace) if e.trace else None
        g2_run, trace_run = self.running.means()
        reasons = list(e.reasons)
        for label, (a, b) in (("running means", (g2_run, trace_run)), ("this epoch", (g2, trace))):
            if a is not None and (why := why_not_ratio(a, b)):
                reasons.append(f"{label}: {why}")
        return {
            "gradient_noise_scale": noise_scale(g2_run, trace_run),
            CONSISTENT_SHARE: consistent_share(g2_run, trace_run, samples),
            "gradient_noise_scale_epoch": noise_scale(g2, trace),
            CONSISTENT_SHARE + "_epoch": consistent_share(g2, trace, samples),
            "noise/g2": g2, "noise/trace": trace, "noise/g2_running": g2_run, "noise/trace_running": trace_run,
            "noise/steps": len(e.g2), "noise/steps_running": self.running.steps,
            "noise/small_batches": e.small_batches, "noise/update_samples": samples,
            "noise/reason": "; ".join(reasons) if reasons else None,
        }
