"""PNG plots of a metrics.jsonl beside its report; `write_plots` is the only function of the verifier that writes
files (matplotlib is imported only when it is called)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recam.infra.schema import REWARD_BOOKKEEPING, consistent_share_of
from recam.verify.core import _array, _float, _int


def _finite(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return np.where(np.isfinite(a), a, np.nan)


def write_plots(records: list[dict], out_dir: Path, stem: str) -> list[tuple[str, str]]:
    """PNG plots of a metrics.jsonl next to the report; returns (title, file name) of those written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    epochs = sorted((r for r in records if r.get("type") == "epoch" and _int(r.get("epoch")) is not None),
                    key=lambda r: _int(r["epoch"]))
    steps = [r for r in records if r.get("type") == "step" and _int(r.get("step")) is not None]
    if not steps:
        steps = [s for r in epochs for s in (r.get("optimizer_steps") or []) if isinstance(s, dict)]

    keys = sorted({k[len("reward_"):] for r in epochs for k, v in r.items()
                   if k.startswith("reward_") and k not in REWARD_BOOKKEEPING and _float(v) is not None})
    if keys:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            xs = [_int(r["epoch"]) for r in epochs if _float(r.get(f"reward_{key}")) is not None]
            ys = [_float(r.get(f"reward_{key}")) for r in epochs if _float(r.get(f"reward_{key}")) is not None]
            ax.plot(xs, _finite(ys), marker="o", label=key)
        ax.set_xlabel("epoch")
        ax.set_ylabel("mean reward (gathered)")
        ax.set_title("Reward per key over epochs")
        ax.legend()
        ax.grid(alpha=0.3)
        name = f"{stem}_rewards.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Reward per key over epochs", name))

    per_epoch = []
    for r in epochs:
        a = _array(r.get("advantages"))
        if a is not None and a.ndim >= 1 and a.size:
            per_epoch.append((_int(r["epoch"]), (a[:, 0] if a.ndim == 2 else a.ravel())))
    if per_epoch:
        fig, ax = plt.subplots(figsize=(7, 4))
        everything = _finite(np.concatenate([a for _, a in per_epoch]))
        everything = everything[np.isfinite(everything)]
        if everything.size:
            ax.hist(everything, bins=50, alpha=0.6, label=f"all {len(per_epoch)} epochs", density=True)
            last_e, last = per_epoch[-1]
            last = _finite(last)
            ax.hist(last[np.isfinite(last)], bins=50, histtype="step", linewidth=1.5,
                    label=f"epoch {last_e}", density=True)
        ax.set_xlabel("advantage (one per sample)")
        ax.set_ylabel("density")
        ax.set_title("Advantage distribution")
        ax.legend()
        name = f"{stem}_advantages.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Advantage distribution", name))

    if steps:
        xs = [_int(s.get("step")) if _int(s.get("step")) is not None else i for i, s in enumerate(steps, 1)]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        ratio = _finite([_float(s.get("mean_ratio")) if _float(s.get("mean_ratio")) is not None else np.nan
                         for s in steps])
        ax1.plot(xs, ratio, label="mean_ratio")
        for key, style in (("ratio_min", ":"), ("ratio_max", ":")):
            vals = [_float(s.get(key)) for s in steps]
            if any(x is not None for x in vals):
                ax1.plot(xs, _finite([np.nan if x is None else x for x in vals]), style, label=key)
        spread = _finite([_float(s.get(k)) for s in steps for k in ("mean_ratio", "ratio_max", "ratio_min")
                          if _float(s.get(k)) is not None])
        spread = spread[np.isfinite(spread) & (spread > 0)]
        if spread.size and spread.max() / spread.min() > 100:
            ax1.set_yscale("log")
        ax1.set_ylabel("ratio")
        ax1.set_title("Importance ratio and KL over optimizer steps")
        ax1.legend()
        ax1.grid(alpha=0.3)
        positive = []
        for key in ("kl_penalty", "approx_kl"):
            vals = [_float(s.get(key)) for s in steps]
            if any(x is not None for x in vals):
                series = _finite([np.nan if x is None else x for x in vals])
                ax2.plot(xs, series, label=key)
                positive += [x for x in series.tolist() if x > 0]
        # symlog, because KL is exactly 0 at the first step; linear only below the smallest value logged
        ax2.set_yscale("symlog", linthresh=max(min(positive, default=1e-6), 1e-12))
        ax2.set_xlabel("global step")
        ax2.set_ylabel("KL")
        ax2.legend()
        ax2.grid(alpha=0.3)
        name = f"{stem}_ratio_kl.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(("Importance ratio and KL over optimizer steps", name))
    noise = _noise_scale_plot(plt, epochs, out_dir, f"{stem}_noise_scale.png")
    if noise:
        written.append(noise)
    return written


def _noise_scale_plot(plt, epochs: list[dict], out_dir: Path, name: str) -> tuple[str, str] | None:
    """The gradient noise scale over epochs (running means, and each epoch's own estimate) against the update's size,
    and the consistent share of an update (KL pull included); None when no epoch has a number to draw."""
    def series(key):
        return [_float(r.get(key)) for r in epochs]

    def shares(epoch):
        return [_float(consistent_share_of(r, epoch)) for r in epochs]
    scale, scale_epoch = series("gradient_noise_scale"), series("gradient_noise_scale_epoch")
    if not any(x is not None for x in scale + scale_epoch):
        return None
    xs = [_int(r["epoch"]) for r in epochs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    nan = np.nan
    ax1.plot(xs, _finite([nan if x is None else x for x in scale]), marker="o", label="noise scale (running means)")
    ax1.plot(xs, _finite([nan if x is None else x for x in scale_epoch]), "x", label="this epoch's steps alone")
    ax1.plot(xs, _finite([nan if x is None else x for x in series("noise/update_samples")]), "--",
             label="samples per update")
    ax1.set_yscale("log")
    ax1.set_ylabel("samples")
    ax1.set_title("Gradient noise scale B_simple = tr(Sigma) / |G|^2 over epochs")
    ax1.legend()
    ax1.grid(alpha=0.3, which="both")
    for epoch, style, label in ((False, "o-", "running means"), (True, "x", "this epoch's steps alone")):
        ax2.plot(xs, _finite([nan if x is None else x for x in shares(epoch)]), style, label=label)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("1 / (1 + B_simple / B)")
    ax2.set_title("Consistent share of an update (expected cosine between two updates; KL pull included)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=90)
    plt.close(fig)
    return "Gradient noise scale and the update's consistent share over epochs", name
