"""What a GRPO run records, built here and handed to recam.infra.runlog, which writes each record as it is given.

An epoch record holds what an independent verification (recam.verify) needs to check the epoch: the gathered
condition ids and dataset indices, every sample's rewards and advantages, each group's advantage statistics, the
trajectory ids, the excluded samples and why; the trainer adds the update's steps and the budget's timings. A step
record holds one optimizer step's metrics, averaged over processes. The console's line per epoch is read off the
epoch record here too. The key names are what recam.verify, recam.engine.diagnosis and the committed fingerprints
(tests/fingerprints) read: change one only with them.
"""

from __future__ import annotations

import math

import torch

from recam.engine.advantages import trajectory_ids
from recam.engine.containers import Groups
from recam.infra.reports import fmt_or_na
from recam.infra.schema import REWARD_BOOKKEEPING


def reward_terms(record: dict, include_avg: bool = False) -> dict[str, float]:
    """reward_<name> -> mean of that reward over the epoch's scored samples, for every reward that was computed
    (reward_avg, the weighted one that drives training, only with include_avg)."""
    return {k: v for k, v in record.items()
            if k.startswith("reward_") and k not in REWARD_BOOKKEEPING and isinstance(v, float)
            and (include_avg or k != "reward_avg")}


def per_group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> dict[int, tuple[int, float, float]]:
    """{group id: (count, mean, population std)} of (N,) values; for logs and verification, not hot paths."""
    out = {}
    for g in torch.unique(group_ids).tolist():
        v = values[group_ids == g].double()
        out[int(g)] = (v.numel(), float(v.mean()), float(v.std(unbiased=False)))
    return out


def verification_record(epoch, step, derived, condition_ids, g_index, g_rewards, g_adv_t, adv_stats,
                        reward_seconds, details=None) -> dict:
    """The per-epoch record a GRPO verification needs, with plain key names, plus the rewards' details: per sample
    under "details/<reward>/<key>", their means over the samples that have them as "detail_<reward>/<key>", and
    summed counts (failure reasons) under "detail_counts/<reward>/<key>"."""
    T = g_adv_t.shape[1]
    avg_nt = g_rewards["avg"][:, None].expand(-1, T)
    adv_groups = per_group_stats(g_adv_t[:, 0], g_index)
    rec = {
        "epoch": epoch, "step": step, **derived,
        "dataset_indices": g_index.tolist(),
        "condition_ids": condition_ids,
        "rewards/avg": avg_nt.tolist(),
        **{f"rewards/{k}": v.tolist() for k, v in g_rewards.items() if k != "avg"},
        "reward_shapes": {"avg": list(avg_nt.shape), **{k: list(v.shape) for k, v in g_rewards.items() if k != "avg"}},
        # mean over the samples that were scored: a failed (NaN) reward is excluded, never averaged as 0
        **{f"reward_{k}": float(v.nanmean()) for k, v in g_rewards.items()},
        "advantages": g_adv_t.tolist(),
        "advantage_per_condition": {str(g): {"count": c, "mean": m, "std": sd} for g, (c, m, sd) in adv_groups.items()},
        **{k: float(v) for k, v in adv_stats.items()},
        "reward_seconds": reward_seconds,
    }
    if details is not None:
        for k, v in details.numbers.items():
            rec[f"details/{k}"] = [None if not math.isfinite(x) else x for x in v.tolist()]
            rec[f"detail_{k}"] = float(v.nanmean()) if torch.isfinite(v).any() else None
        rec.update({f"details/{k}": v for k, v in details.lists.items()})
        rec.update({f"detail_counts/{k}": v for k, v in details.counts.items()})
    return rec


def epoch_record(epoch: int, step: int, derived: dict, condition_ids: list[str], groups: Groups,
                 reward_seconds: float, placebo: bool = False, hook_fields: tuple[dict, ...] = ()) -> dict:
    """The epoch's record as far as the advantages: `verification_record` of the gathered groups, each sample's
    trajectory id ("<condition>#<copy>"), the placebo flag (the verifier then checks a permutation), what the hooks
    add (hook_fields, in hook order), and the excluded samples with their counts by reason."""
    record = verification_record(epoch, step, derived, condition_ids, groups.index, groups.rewards,
                                 groups.advantages, groups.stats, reward_seconds, groups.details)
    record["trajectory_ids"] = [f"{c}#{k}" for c, k in trajectory_ids(groups.index).tolist()]
    record |= {"placebo": True} if placebo else {}
    for fields in hook_fields:
        record.update(fields)
    record["excluded"] = (~groups.keep).tolist()
    record.update(groups.exclusion)
    return record


def epoch_line(rec: dict) -> str:
    """One line per epoch for the console; a missing value (None, NaN) prints as "n/a", never as a crash."""
    steps = rec.get("optimizer_steps") or [{}]
    # every reward that was computed this run, in the order the weights name them
    per_reward = "".join(f"{k} {fmt_or_na(v, '.4f')} " for k, v in reward_terms(rec).items())
    excluded = rec.get("excluded")
    n = len(excluded) if isinstance(excluded, list) else 0
    kept = f"kept {n - sum(bool(x) for x in excluded)}/{n} samples " if n else ""
    return (f"epoch {rec['epoch']} step {rec['step']}: reward_avg {fmt_or_na(rec.get('reward_avg'), '.4f')} "
            f"{per_reward}{kept}zero_std_ratio {fmt_or_na(rec.get('zero_std_ratio'), '.2f')} "
            f"first-step |ratio-1| {fmt_or_na(rec.get('first_step_ratio_deviation'), '.2e')} "
            f"loss {fmt_or_na(steps[-1].get('loss'), '.4g')} kl {fmt_or_na(steps[-1].get('kl_penalty'), '.3g')} "
            f"({fmt_or_na(rec.get('epoch_seconds'), '.1f')}s)")


def step_metrics(pass_metrics: list[dict], grad_norm: float, step_samples: int, grad_cosine_prev: float | None,
                 learning_rate: float) -> dict:
    """One optimizer step's metrics on this process from its backward passes': the mean of each metric every pass
    reported (an objective without ratios, DiffusionNFT, reports none, and the guard's ratio rules then have nothing
    to judge), the max of ratio_max and the min of ratio_min; then the step's own numbers."""
    common = [k for k in pass_metrics[0] if all(k in a for a in pass_metrics)]
    m = {k: float(torch.stack([torch.as_tensor(a[k]) for a in pass_metrics]).mean()) for k in common}
    if "ratio_max" in m:
        m["ratio_max"] = max(float(a["ratio_max"]) for a in pass_metrics)
    if "ratio_min" in m:
        m["ratio_min"] = min(float(a["ratio_min"]) for a in pass_metrics)
    m["grad_norm"], m["step_samples"] = grad_norm, step_samples
    if grad_cosine_prev is not None:
        m["grad_cosine_prev"] = grad_cosine_prev
    m["learning_rate"] = learning_rate
    return m


def mean_over_processes(metrics: dict, accelerator) -> dict:
    """Average scalar metrics over processes (min/max for ratio_min/ratio_max, when the objective has ratios)."""
    if accelerator.num_processes == 1:
        return metrics
    keys = sorted(metrics)
    vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    g = accelerator.gather(vals[None]).cpu()
    out = dict(zip(keys, g.mean(0).tolist(), strict=True))
    if "ratio_max" in out:
        out["ratio_max"] = float(g[:, keys.index("ratio_max")].max())
    if "ratio_min" in out:
        out["ratio_min"] = float(g[:, keys.index("ratio_min")].min())
    return out
