"""Rewards computed off the sampling thread, with failures kept out of the advantages.

Sampling is GPU-bound and reward servers (UnifiedReward, pose estimators) are network/CPU-bound, so the
trainer submits each sampling batch's videos and keeps sampling the next batch while they are scored:

    runner = AsyncRewardRunner(reward_fn, max_workers=2, failure_policy="wait")
    for b in batches:
        videos = rollout(...)
        runner.submit(b, videos.cpu(), conditions)      # returns at once
    results = runner.collect()                          # submission order; may raise RewardServerDown
    scores, valid = concat_results(results)
    keep, counts = exclusion_mask(valid, group_ids, runner.exclusion_policy)
    adv, excluded, stats = masked_group_advantages(scores["avg"], group_ids, keep)

A sample is valid when every reward score it has is finite and no reward flagged it in a `failed` mask.
Invalid samples are excluded from the advantage computation: group statistics are computed over the kept
samples only and the excluded ones get advantage 0 plus an `excluded` flag, so a failed reward can never
enter a group's mean/std as a 0 (which would make every other sample in the group look better).

Failure policies (what the runner does when some samples of a batch failed):
  - "wait": re-score only the failed samples, up to max_retries times with exponential backoff; those
    still failing are excluded one by one (exclusion policy "sample");
  - "drop_group": no retry; any group with a failed sample is excluded whole (exclusion policy "group"),
    so no group is trained on a biased subset of its k samples;
  - "stop": raise RewardServerDown, which the trainer catches to checkpoint and stop.

A whole outage is RewardServerDown under every policy, whatever form the failure takes:
  - the reward function raises on every attempt (connection refused, a bug): nothing was scored;
  - every sample of a batch is still invalid after the policy's retries (the "wait" rounds; none under
    "drop_group"), i.e. the reward answered only NaN / `failed`: a judge that answers nothing is down, whether
    its client raises or returns NaN (UnifiedReward returns NaN for HTTP 5xx, refused connections and timeouts
    once its own retries are spent). Excluding the whole batch instead would train on nothing and let the run
    carry on as if it were learning.
Since every batch of an epoch is collected before the trainer moves on, an epoch in which every sample failed
always raises. The trainer catches RewardServerDown from collect(), keeps the last checkpoint as it is and
stops (scripts/train_recam.py exits 3). Partial failures are excluded sample by sample (or group by group) as
above and the run goes on.

The reward function may return scores as one (B,) tensor or as a dict of (B,) tensors (MultiReward's
per-reward scores plus their weighted "avg"); both are kept in that form.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from recam.engine import containers
from recam.engine.advantages import group_advantages

logger = logging.getLogger(__name__)

Scores = torch.Tensor | dict[str, torch.Tensor]


class FailurePolicy(str, Enum):
    WAIT = "wait"
    DROP_GROUP = "drop_group"
    STOP = "stop"


class RewardServerDown(RuntimeError):
    """Rewards could not be computed; the trainer should checkpoint and stop. Carries the batch id and the
    per-sample failure reasons (None for samples that were fine)."""

    def __init__(self, message: str, batch_id: Any = None, reasons: list[str | None] | None = None):
        super().__init__(message)
        self.batch_id = batch_id
        self.reasons = reasons or []


@dataclass
class RewardResult:
    """Rewards of one submitted batch, in the batch's sample order.

    scores: (B,) tensor or dict of (B,) tensors, NaN where a reward failed; valid: (B,) bool;
    details: the reward's details with retried samples merged in; reasons: per-sample failure reason or None;
    call_seconds: wall time of each reward call (first call, then retries); attempts: number of calls.
    """

    batch_id: Any
    scores: Scores
    valid: torch.Tensor
    details: dict
    reasons: list[str | None]
    call_seconds: list[float] = field(default_factory=list)
    attempts: int = 1


# ----------------------------------------------------------------------------------------------------
# validity of a reward output


def _batch_size(scores: Scores) -> int:
    if torch.is_tensor(scores):
        return int(scores.shape[0])
    return int(next(iter(scores.values())).shape[0])


def _is_key(key: Any, name: str) -> bool:
    """`name` itself or a namespaced form of it: MultiReward flattens details to "<reward>/<key>"."""
    return isinstance(key, str) and (key == name or key.endswith("/" + name))


def _failed_masks(details: Any, size: int):
    """Every (B,) bool tensor stored under a key named "failed" (or "<reward>/failed"), at any nesting
    depth of details."""
    if isinstance(details, dict):
        for key, value in details.items():
            if _is_key(key, "failed") and torch.is_tensor(value) and value.dtype == torch.bool \
                    and value.shape == (size,):
                yield value
            else:
                yield from _failed_masks(value, size)


def _failure_reasons(details: Any, size: int):
    """Every per-sample list stored under a key named "failure_reason" (or "<reward>/failure_reason")."""
    if isinstance(details, dict):
        for key, value in details.items():
            if _is_key(key, "failure_reason") and isinstance(value, list) and len(value) == size:
                yield value
            else:
                yield from _failure_reasons(value, size)


def valid_mask(scores: Scores, details: dict | None = None) -> torch.Tensor:
    """(B,) bool: True where every score is finite and no `failed` mask in details is set."""
    tensors = [scores] if torch.is_tensor(scores) else [v for v in scores.values() if torch.is_tensor(v)]
    size = _batch_size(scores)
    valid = torch.ones(size, dtype=torch.bool)
    for t in tensors:
        if t.shape != (size,):
            raise ValueError(f"reward scores must be (B,) = ({size},), got {tuple(t.shape)}")
        valid &= torch.isfinite(t.detach().cpu())
    for failed in _failed_masks(details or {}, size):
        valid &= ~failed.cpu()
    return valid


def sample_reasons(valid: torch.Tensor, details: dict | None) -> list[str | None]:
    """Per-sample failure reason (joined over rewards), "non-finite reward" when none was given."""
    size = valid.shape[0]
    lists = list(_failure_reasons(details or {}, size))
    out: list[str | None] = []
    for i, ok in enumerate(valid.tolist()):
        if ok:
            out.append(None)
            continue
        found = [str(lst[i]) for lst in lists if lst[i]]
        out.append("; ".join(found) if found else "non-finite reward")
    return out


def _merge_into(target: Any, new: Any, index: torch.Tensor, size: int) -> Any:
    """Write the per-sample entries of `new` (length len(index)) into `target` (length size) at index;
    entries that are not per-sample (scalars, summaries) are taken from the newest call."""
    n = index.shape[0]
    if torch.is_tensor(target) and torch.is_tensor(new) and target.ndim >= 1 and target.shape[0] == size \
            and new.ndim >= 1 and new.shape[0] == n and target.shape[1:] == new.shape[1:]:
        out = target.clone()
        out[index] = new.to(out.dtype)
        return out
    if isinstance(target, list) and isinstance(new, list) and len(target) == size and len(new) == n:
        out = list(target)
        for j, i in enumerate(index.tolist()):
            out[i] = new[j]
        return out
    if isinstance(target, dict) and isinstance(new, dict):
        out = dict(target)
        for key, value in new.items():
            out[key] = _merge_into(target[key], value, index, size) if key in target else value
        return out
    return new


def _nan_like(scores: Scores, index: torch.Tensor) -> Scores:
    """Copy of scores with NaN at index: a failed retry leaves its samples failed, whatever an earlier
    (already failed) call wrote there."""
    def blank(t):
        out = t.detach().float().clone()
        out[index] = math.nan
        return out
    return blank(scores) if torch.is_tensor(scores) else {k: blank(v) for k, v in scores.items()}


# ----------------------------------------------------------------------------------------------------
# the runner


class AsyncRewardRunner:
    """Runs reward_fn(videos, conditions) -> (scores, details) on a thread pool, one job per batch.

    reward_fn: any fn(samples, conditions) -> (scores, details), e.g. a domain's reward_fn; it must be
        thread-safe when max_workers > 1.
    failure_policy: "wait" | "drop_group" | "stop" (see the module docstring).
    max_retries / retry_backoff_s: for "wait", re-scoring rounds of the failed samples and the first
    delay (doubled each round); also used when the reward function raises.
    The runner keeps references to submitted tensors: do not modify them in place before collect().
    """

    def __init__(self, reward_fn: Callable, max_workers: int = 1, failure_policy: str | FailurePolicy = "wait",
                 max_retries: int = 2, retry_backoff_s: float = 1.0, sleep: Callable[[float], None] = time.sleep):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.reward_fn = reward_fn
        self.failure_policy = FailurePolicy(failure_policy)
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._sleep = sleep
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")
        self._pending: list[tuple[Any, Future]] = []
        self.timings: list[tuple[Any, int, float]] = []  # (batch id, samples scored, seconds) per call

    @property
    def exclusion_policy(self) -> str:
        return "group" if self.failure_policy is FailurePolicy.DROP_GROUP else "sample"

    def submit(self, batch_id: Any, videos: torch.Tensor, conditions: list) -> Future:
        """Start scoring one sampling batch; videos (B, 3, F, H, W), B conditions. Returns a Future of
        RewardResult (its exception is RewardServerDown under the "stop" policy or when nothing scores)."""
        if videos.shape[0] != len(conditions):
            raise ValueError(f"{videos.shape[0]} videos but {len(conditions)} conditions")
        future = self._pool.submit(self._run, batch_id, videos.detach(), list(conditions))
        self._pending.append((batch_id, future))
        return future

    def collect(self) -> list[RewardResult]:
        """Wait for every submitted batch; results in submission order. Raises the first batch's
        RewardServerDown (in submission order) after all jobs have finished, so no job is left running."""
        pending, self._pending = self._pending, []
        wait([f for _, f in pending])
        return [f.result() for _, f in pending]

    def collect_scores(self, accelerator) -> containers.Scores:
        """Every submitted batch's rewards on this process, in submission order (collect_everywhere)."""
        results = self.collect_everywhere(accelerator)
        rewards, valid = concat_results(results)
        return containers.Scores({k: v.float() for k, v in rewards.items()}, valid,
                                 sum(sum(r.call_seconds) for r in results), concat_details(results))

    def collect_everywhere(self, accelerator) -> list[RewardResult]:
        """collect(), with a reward server found down on any process raised on every process (the others would
        otherwise wait for it in the next gather)."""
        down = None
        try:
            results = self.collect()
        except RewardServerDown as e:
            down = e
        if accelerator.num_processes > 1:
            flags = accelerator.gather(torch.tensor([down is not None], device=accelerator.device))
            if down is None and bool(flags.any()):
                down = RewardServerDown("another process found its reward server down")
        if down is not None:
            raise down
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncRewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one batch ------------------------------------------------------------------------------------

    def _call(self, batch_id: Any, videos: torch.Tensor, conditions: list) -> tuple[Scores, dict, float]:
        t0 = time.monotonic()
        scores, details = self.reward_fn(videos, conditions)
        seconds = time.monotonic() - t0
        self.timings.append((batch_id, len(conditions), seconds))
        logger.info("reward batch %s: %d samples in %.3f s (%.4f s/sample)", batch_id, len(conditions), seconds,
                    seconds / max(len(conditions), 1))
        return scores, details, seconds

    def _run(self, batch_id: Any, videos: torch.Tensor, conditions: list) -> RewardResult:
        size = len(conditions)
        call_seconds: list[float] = []
        attempts = 0
        scores = details = None
        last_error: BaseException | None = None
        # First call: the whole batch. An exception means nothing was scored, so it is retried as a whole.
        while scores is None:
            attempts += 1
            try:
                scores, details, sec = self._call(batch_id, videos, conditions)
                call_seconds.append(sec)
            except Exception as e:  # any reward failure is reported through the policy
                last_error = e
                logger.warning("reward batch %s: reward function raised %s: %s", batch_id, type(e).__name__, e)
                if self.failure_policy is FailurePolicy.STOP or attempts > self.max_retries:
                    reason = _first_reason([f"{type(e).__name__}: {e}"])
                    raise RewardServerDown(f"reward function failed on batch {batch_id} after {attempts} "
                                           f"call(s): {reason}", batch_id, [reason] * size) from e
                self._sleep(self.retry_backoff_s * 2 ** (attempts - 1))
        if _batch_size(scores) != size:
            raise ValueError(f"reward function returned {_batch_size(scores)} scores for {size} samples")
        valid = valid_mask(scores, details)
        reasons = sample_reasons(valid, details)

        if not bool(valid.all()) and self.failure_policy is FailurePolicy.STOP:
            raise RewardServerDown(f"{int((~valid).sum())} of {size} rewards failed on batch {batch_id}: "
                                   f"{_first_reason(reasons)}", batch_id, reasons)
        if self.failure_policy is FailurePolicy.WAIT:
            for round_ in range(self.max_retries):
                if bool(valid.all()):
                    break
                self._sleep(self.retry_backoff_s * 2 ** round_)
                index = (~valid).nonzero().flatten()
                attempts += 1
                try:
                    new_scores, new_details, sec = self._call(
                        batch_id, videos[index], [conditions[i] for i in index.tolist()])
                    call_seconds.append(sec)
                except Exception as e:
                    last_error = e
                    logger.warning("reward batch %s retry %d raised %s: %s", batch_id, round_ + 1,
                                   type(e).__name__, e)
                    continue
                scores = _merge_into(_nan_like(scores, index), new_scores, index, size)
                details = _merge_into(details, new_details, index, size)
                valid = valid_mask(scores, details)
                reasons = sample_reasons(valid, details)
        if last_error is not None and not bool(valid.all()):
            reasons = [r if r is None else f"{r} (last error: {type(last_error).__name__})" for r in reasons]
        if size and not bool(valid.any()):
            raise RewardServerDown(f"every one of the {size} samples of batch {batch_id} failed after {attempts} "
                                   f"reward call(s): {_first_reason(reasons)}", batch_id, reasons)
        if not bool(valid.all()):
            logger.warning("reward batch %s: %d of %d samples failed and will be excluded", batch_id,
                           int((~valid).sum()), size)
        return RewardResult(batch_id, scores, valid, details, reasons, call_seconds, attempts)


def _first_reason(reasons: list[str | None]) -> str:
    """The first failure reason, on one line and short enough for a log line."""
    text = " ".join(str(next((r for r in reasons if r), "no reason given")).split())
    return text if len(text) <= 300 else text[:300] + "..."


def concat_results(results: list[RewardResult]) -> tuple[Scores, torch.Tensor]:
    """Results of consecutive batches -> (scores concatenated along samples, valid (N,))."""
    if not results:
        raise ValueError("no results to concatenate")
    valid = torch.cat([r.valid for r in results])
    first = results[0].scores
    if torch.is_tensor(first):
        return torch.cat([r.scores.float() for r in results]), valid
    return {k: torch.cat([r.scores[k].float() for r in results]) for k in first}, valid


@dataclass
class RewardDetails:
    """What the rewards of consecutive batches reported besides their scores, in sample order.

    numbers: key -> (N,) float32, from every details entry that is a (B,) float tensor in each batch (e.g.
    "cam_score/rot_err_sum", "cam_score/seconds_extract"); lists: key -> N per-sample values (str, lists, dicts, None),
    from every (B,) list entry (e.g. "cam_score/method", "cam_score/rot_err_per_frame"); counts: key -> summed
    counts from dict entries of str -> int (e.g. "cam_score/fail_reason" -> {"not_registered": 12})."""

    numbers: dict[str, torch.Tensor] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)


def gather_details(details: RewardDetails | None, accelerator) -> RewardDetails:
    """Every process's reward details in rank order, like the rewards (numbers by tensor gather, the rest as
    objects)."""
    if details is None or accelerator.num_processes == 1:
        return details or RewardDetails()
    from accelerate.utils import gather_object

    acc = accelerator
    numbers = {k: acc.gather(v.to(acc.device)).cpu() for k, v in sorted(details.numbers.items())}
    lists = {k: gather_object(v) for k, v in sorted(details.lists.items())}
    counts: dict[str, dict[str, int]] = {}
    for k, v in sorted(details.counts.items()):
        counts[k] = {}
        for part in gather_object([v]):
            for name, c in part.items():
                counts[k][name] = counts[k].get(name, 0) + c
    return RewardDetails(numbers, lists, counts)


def concat_details(results: list[RewardResult]) -> RewardDetails:
    """Details of consecutive batches, keeping only what every batch reported in the same form."""
    out = RewardDetails()
    if not results:
        return out
    sizes = [int(r.valid.shape[0]) for r in results]
    for key in results[0].details or {}:
        values = [(r.details or {}).get(key) for r in results]
        pairs = list(zip(values, sizes, strict=True))
        if all(torch.is_tensor(v) and v.shape == (n,) and v.is_floating_point() for v, n in pairs):
            out.numbers[key] = torch.cat([v.detach().float().cpu() for v in values])
        elif all(isinstance(v, list) and len(v) == n for v, n in pairs):
            out.lists[key] = [x for v in values for x in v]
        elif all(isinstance(v, dict) and all(isinstance(c, int) for c in v.values()) for v in values):
            total: dict[str, int] = {}
            for v in values:
                for name, c in v.items():
                    total[str(name)] = total.get(str(name), 0) + int(c)
            out.counts[key] = total
    return out


# ----------------------------------------------------------------------------------------------------
# exclusion and advantages (pure)


def exclusion_mask(valid: torch.Tensor, group_ids: torch.Tensor, policy: str = "sample") -> tuple[torch.Tensor, dict]:
    """Which samples may enter the advantage computation.

    valid (N,) bool, group_ids (N,) int64. policy "sample" excludes only the failed samples; "group"
    excludes every sample of a group that has a failure.
    Returns keep (N,) bool and counts (ints): excluded_samples, excluded_groups (groups left with no kept
    sample), failed_samples, affected_groups (groups with at least one failure).
    """
    if valid.ndim != 1 or valid.shape != group_ids.shape:
        raise ValueError(f"valid {tuple(valid.shape)} and group_ids {tuple(group_ids.shape)} must both be (N,)")
    valid = valid.bool()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    group_failed = torch.zeros(num_groups, dtype=torch.bool).index_fill_(0, inverse[~valid], True)
    if policy == "sample":
        keep = valid.clone()
    elif policy == "group":
        keep = ~group_failed[inverse]
    else:
        raise ValueError(f"policy must be 'sample' or 'group', got {policy!r}")
    group_kept = torch.zeros(num_groups, dtype=torch.bool).index_fill_(0, inverse[keep], True)
    counts = {
        "excluded_samples": int((~keep).sum()),
        "excluded_groups": int((~group_kept).sum()),
        "failed_samples": int((~valid).sum()),
        "affected_groups": int(group_failed.sum()),
    }
    return keep, counts


def masked_group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor,
                            std_mode: str = "group", eps: float = 1e-4, unbiased: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Group advantages over the kept samples only (recam.engine.advantages.group_advantages on the subset).

    rewards (N,) (may hold NaN where not kept), group_ids (N,), keep (N,) bool.
    Returns advantages (N,) float32 (0 where excluded), excluded (N,) bool (= ~keep), and the subset's
    stats plus excluded_samples (0-dim tensors). A group with one kept sample gets advantage 0 (its std is 0).
    """
    if rewards.shape != keep.shape or rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError("rewards, group_ids and keep must all be (N,)")
    keep = keep.bool()
    if bool((keep & ~torch.isfinite(rewards)).any()):
        raise ValueError("a kept sample has a non-finite reward; build keep with exclusion_mask first")
    advantages = torch.zeros(rewards.shape, dtype=torch.float32)
    if bool(keep.any()):
        adv_kept, stats = group_advantages(rewards[keep], group_ids[keep], std_mode, eps, unbiased)
        advantages[keep] = adv_kept
    else:
        stats = {"group_size": torch.tensor(0.0), "trained_prompt_num": torch.tensor(0.0),
                 "zero_std_ratio": torch.tensor(float("nan")), "reward_std_mean": torch.tensor(float("nan"))}
    stats["excluded_samples"] = (~keep).sum().float()
    return advantages, ~keep, stats
