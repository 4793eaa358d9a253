"""Where the camera reward's spread and gains come from: frames placed, or placed frames more accurate.

cam_score is the mean over a video's non-reference frames of a per-frame score that is about 0 on a frame the
estimator could not place, so per video it factors as

    cam_score = q * a,   q = the share of non-reference frames placed, a = cam_score / q (the mean placed score)

(a is defined by this; q = 0 leaves a undefined and the video is counted apart). Two readings:

    # within each training group of k samples (the advantages' unit), how much of the reward's spread is q (the
    # landmarks being findable) and how much a (the camera itself), and how alike a group's cameras are
    python scripts/measure/camera_spread.py groups runs/tiny_cpu

    # a run's held-out change from its base (or GRPO minus its placebo), split into "more frames placed" and
    # "placed frames more accurate"
    python scripts/measure/camera_spread.py gain runs/tiny_cpu [--placebo runs/tiny_cpu_placebo]

Within a group, cam_score's deviation from the group mean splits exactly as
dy = a_bar dq + q_bar da + (dq da - mean(dq da)), so its variance is the variance of the q term, of the a term, and
of the cross terms; the shares are reported with 95% intervals from a bootstrap over groups. The gain splits the
same way between two evaluations of the same conditions: dy = a_0 dq + q_0 da + dq da, each term's mean paired
over the conditions (recam.infra.stats.paired_change on the terms).

The camera's own spread within a group, beside it: the intraclass correlation of the placed frames' RotErr
(rot_err_placed_mean) over the epoch's groups, from the one-way ANOVA: near 1, a group's k samples follow the same
camera path and the trained steps' noise does not move it; near 0, the noise moves the camera as much as the
condition does.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recam.infra.runlog import read_records  # noqa: E402
from recam.infra.stats import mean_interval, paired_change  # noqa: E402

REWARD = "cam_score"


def detail(record: dict, name: str, prefix: str = "details/") -> list | None:
    """A per-sample detail of the camera reward by its last name (its key carries the reward's path before it)."""
    found = [k for k in record if k.startswith(prefix) and k.split("/")[-1] == name]
    return record[found[0]] if found else None


def factors(y: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, a, ok): a = y / q where q > 0; ok marks the samples with both finite."""
    ok = np.isfinite(y) & np.isfinite(q) & (q > 0)
    a = np.full_like(y, np.nan)
    a[ok] = y[ok] / q[ok]
    return q, a, ok


def group_split(y: np.ndarray, q: np.ndarray, groups: np.ndarray) -> dict:
    """Per group (whole groups only: every member with q > 0), the variance of cam_score's deviations and of its
    placed-share, accuracy and cross terms, summed over groups."""
    q, a, ok = factors(y, q)
    out = {"var_y": [], "var_q": [], "var_a": [], "var_x": []}
    for g in np.unique(groups):
        m = groups == g
        if m.sum() < 2 or not ok[m].all():
            continue
        yq, aq, yy = q[m], a[m], y[m]
        dq, da = yq - yq.mean(), aq - aq.mean()
        tq, ta = aq.mean() * dq, yq.mean() * da
        tx = dq * da - (dq * da).mean()
        out["var_y"].append(((yy - yy.mean()) ** 2).mean())
        out["var_q"].append((tq ** 2).mean())
        out["var_a"].append((ta ** 2).mean())
        out["var_x"].append(((tq + ta + tx) ** 2).mean() - (tq ** 2).mean() - (ta ** 2).mean())
    return {k: np.array(v) for k, v in out.items()}


def shares(split: dict) -> dict:
    total = split["var_y"].sum()
    return {k: split[f"var_{k}"].sum() / total if total > 0 else math.nan for k in ("q", "a", "x")}


def bootstrap_shares(split: dict, reps: int = 2000, seed: int = 0) -> dict:
    """95% percentile intervals of the shares, groups resampled with replacement."""
    n = len(split["var_y"])
    rng = np.random.default_rng(seed)
    draws = {k: [] for k in ("q", "a", "x")}
    for _ in range(reps):
        idx = rng.integers(0, n, n)
        s = shares({k: v[idx] for k, v in split.items()})
        for k in draws:
            draws[k].append(s[k])
    return {k: tuple(np.nanpercentile(v, [2.5, 97.5])) for k, v in draws.items()}


def icc(values: np.ndarray, groups: np.ndarray) -> float:
    """The one-way ANOVA intraclass correlation of values over groups (equal sizes assumed; finite values only)."""
    keep = np.isfinite(values)
    values, groups = values[keep], groups[keep]
    labels = np.unique(groups)
    sizes = np.array([(groups == g).sum() for g in labels])
    labels, sizes = labels[sizes >= 2], sizes[sizes >= 2]
    if len(labels) < 2:
        return math.nan
    means = np.array([values[groups == g].mean() for g in labels])
    k = sizes.mean()
    grand = np.concatenate([values[groups == g] for g in labels]).mean()
    msb = (sizes * (means - grand) ** 2).sum() / (len(labels) - 1)
    msw = sum(((values[groups == g] - m) ** 2).sum() for g, m in zip(labels, means, strict=True)) / (
        sizes.sum() - len(labels))
    return float((msb - msw) / (msb + (k - 1) * msw)) if msb + (k - 1) * msw > 0 else math.nan


def groups_report(run: Path, epochs: int | None) -> str:
    records = [r for r in read_records(run / "metrics.jsonl") if r.get("type") == "epoch"]
    if epochs:
        records = records[:epochs]
    if not records:
        raise SystemExit(f"{run}: metrics.jsonl has no epoch records")
    ys, qs, rots, gs = [], [], [], []
    for r in records:
        y, q, rot = r.get(f"rewards/{REWARD}"), detail(r, "placed_fraction"), detail(r, "rot_err_placed_mean")
        idx = r.get("dataset_indices")
        if not (isinstance(y, list) and isinstance(q, list) and isinstance(idx, list)):
            raise SystemExit(f"{run}: epoch {r.get('epoch')} lacks rewards/{REWARD}, its placed_fraction detail or "
                             "dataset_indices")
        ys += y
        qs += q
        rots += rot if isinstance(rot, list) else [None] * len(y)
        gs += [int(r["epoch"]) * 10**9 + int(i) for i in idx]  # a group is a condition within its epoch
    arr = lambda v: np.array([np.nan if x is None else float(x) for x in v])  # noqa: E731
    y, q, rot, g = arr(ys), arr(qs), arr(rots), np.array(gs)
    split = group_split(y, q, g)
    s, ci = shares(split), bootstrap_shares(split)
    _, _, ok = factors(y, q)
    lines = [f"**Within-group spread of {REWARD}** ({run}, {len(records)} epoch(s), {len(split['var_y'])} whole "
             f"groups of {len(y)} samples; {int((~ok).sum())} samples with nothing placed left out with their "
             "groups)", "",
             "| term | share of the within-group variance (95%, bootstrap over groups) |", "|---|---|"]
    names = {"q": "frames placed (a_bar dq)", "a": "placed frames' accuracy (q_bar da)", "x": "cross terms"}
    for k in ("q", "a", "x"):
        lines.append(f"| {names[k]} | {s[k]:.2f} [{ci[k][0]:.2f}, {ci[k][1]:.2f}] |")
    sd_y = math.sqrt(split["var_y"].mean()) if len(split["var_y"]) else math.nan
    lines += ["", f"within-group sd of {REWARD}: {sd_y:.4f}; intraclass correlation of the placed frames' RotErr "
                  f"over groups: {icc(rot, g):.2f}; of the placed share: {icc(q, g):.2f}"]
    return "\n".join(lines)


def gain_report(run: Path, placebo: Path | None) -> str:
    def evals(r: Path):
        records = [x for x in read_records(r / "metrics.jsonl") if x.get("type") == "eval"]
        base = next((x for x in records if x.get("tag") == "start"), None)
        last = next((x for x in reversed(records) if x.get("tag") == "final"), None)
        if base is None or last is None:
            raise SystemExit(f"{r}: no start or final evaluation")
        return base, last

    def terms(before: dict, after: dict) -> dict:
        get = lambda rec, name: np.array([np.nan if v is None else v for v in (detail(rec, name, "rows/eval/")  # noqa: E731
                                                                             or [])], dtype=float)
        y0, y1 = get(before, REWARD), get(after, REWARD)
        q0, q1 = get(before, "placed_fraction"), get(after, "placed_fraction")
        if not (len(y0) == len(y1) == len(q0) == len(q1)) or not len(y0):
            raise SystemExit(f"per-condition rows of eval/{REWARD} and eval/placed_fraction are needed in both "
                             "evaluations")
        _, a0, ok0 = factors(y0, q0)
        _, a1, ok1 = factors(y1, q1)
        ok = ok0 & ok1
        dq, da = q1 - q0, a1 - a0
        return {"total": y1 - y0, "placed": np.where(ok, a0 * dq, np.nan), "accuracy": np.where(ok, q0 * da, np.nan),
                "cross": np.where(ok, dq * da, np.nan), "both placed": int(ok.sum()), "n": len(y0)}

    g = terms(*evals(run))
    lines = [f"**{REWARD}'s held-out change split** ({run}; conditions with frames placed at both ends: "
             f"{g['both placed']} of {g['n']})", "", "| term | GRPO (paired over conditions) |"
             + (" placebo | GRPO minus placebo |" if placebo else ""), "|---|---|" + ("---|---|" if placebo else "")]
    p = terms(*evals(placebo)) if placebo else None
    for k in ("total", "placed", "accuracy", "cross"):
        m, h = mean_interval([x for x in g[k] if math.isfinite(x)])
        row = f"| {k} | {m:+.4f} ± {h:.4f} |"
        if p is not None:
            pm, ph = mean_interval([x for x in p[k] if math.isfinite(x)])
            d, dh, _ = paired_change([None if not math.isfinite(x) else x for x in p[k]],
                                     [None if not math.isfinite(x) else x for x in g[k]])
            row += f" {pm:+.4f} ± {ph:.4f} | {d:+.4f} ± {dh:.4f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("groups")
    g.add_argument("run", type=Path)
    g.add_argument("--epochs", type=int, default=None, help="only the first N epochs (the base's groups: 1)")
    h = sub.add_parser("gain")
    h.add_argument("run", type=Path)
    h.add_argument("--placebo", type=Path, default=None)
    args = ap.parse_args(argv)
    text = groups_report(args.run, args.epochs) if args.what == "groups" else gain_report(args.run, args.placebo)
    print(text)
    return text


if __name__ == "__main__":
    main()
