"""What the device check writes besides its stages' entries: where the time went outside the model's passes
(`overhead`), the device and its attention kernels, and DIR/device_check.md, a summary of device_check.json."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch


def overhead(results: dict) -> dict:
    """Per stage: the share of a step's wall time outside the model passes timed alone at the same shapes."""
    out = {}
    for stage in ("recam", "motion"):
        r = results.get(stage, {})
        if "sampling_step_s" in r and "forward_alone_s" in r:
            out[f"{stage}_sampling"] = 1 - r["forward_alone_s"] / r["sampling_step_s"]
        if "trained_step_s" in r and "train_passes_alone_s" in r:
            out[f"{stage}_training"] = 1 - r["train_passes_alone_s"] / r["trained_step_s"]
    return out


def attention_backends(device: torch.device) -> dict:
    """Which scaled-dot-product attention kernels torch may pick here (diffusers' Wan attention calls SDPA)."""
    if device.type != "cuda":
        return {"sdpa": "math / CPU kernels"}
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "n/a" if v is None else str(v)


def curve_tables(learning: dict) -> list[str]:
    lines = []
    for name, r in learning.items():
        if not isinstance(r, dict) or not r.get("curve"):
            continue
        lines += [f"### {name}: held-out curve ({r['score']}, beside it {r['beside']['score']})", "",
                  "| tag | epoch | train_seconds | score | beside |", "|---|---|---|---|---|"]
        lines += [f"| {p['tag']} | {fmt(p['epoch'])} | {fmt(p['train_seconds'])} | {fmt(p['score'])} | "
                  f"{fmt(p['beside'])} |" for p in r["curve"]] + [""]
    return lines


def pm(pair) -> str:
    """(mean, 95% half-width) as mean ± half."""
    mean, half = (pair or (None, None))[:2]
    return "n/a" if not isinstance(mean, (int, float)) else f"{mean:+.4f}" + (
        f" ± {half:.4f}" if isinstance(half, (int, float)) and math.isfinite(half) else "")


def guard_events(events: dict | None) -> str:
    """One arm's health-guard events (learning.<domain>.vs_placebo.events.<arm>) in a few words."""
    if not events:
        return "n/a"
    stop = events.get("guard_stop")
    return (f"{fmt(events.get('rollbacks'))} rollbacks, {fmt(events.get('critical'))} critical"
            + (f", stopped: {stop}" if stop else ""))


def placebo_table(learning: dict) -> list[str]:
    """GRPO against its placebo, one row per domain whose placebo ran (learning.<domain>.vs_placebo), with each
    arm's health-guard events: the guard acts on the rewards, so the arms' rollbacks and stops can differ. The bases'
    difference is shown beside it: 0 where both evaluated the base on one machine, perhaps not where the GRPO run's
    base was evaluated in an earlier window on another GPU, and then part of the difference."""
    rows = [(name, r["vs_placebo"]) for name, r in learning.items() if isinstance(r, dict) and "vs_placebo" in r]
    if not rows:
        return []
    lines = ["### GRPO minus placebo (paired over the held-out conditions; ± a 95% interval)", "",
             "| domain | score | at update (GRPO / placebo seconds) | GRPO gain | placebo gain | GRPO minus placebo | "
             "at the ends (updates, GRPO / placebo) | placebo's base minus GRPO's | guard events, GRPO / placebo |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, v in rows:
        ev = v.get("events") or {}
        events = f"{guard_events(ev.get('grpo'))} / {guard_events(ev.get('placebo'))}".replace("|", "\\|")
        if ev.get("differ"):
            events += " (the arms differ)"
        if "error" in v:
            lines.append(f"| {name} | n/a | {v['error']} | | | | | | {events} |")
            continue
        ends = v["at_ends"]
        lines.append(f"| {name} | {v['score']} | {v['step']} ({fmt(v['grpo_train_seconds'])} / "
                     f"{fmt(v['placebo_train_seconds'])} s) | {pm(v.get('grpo_gain'))} | {pm(v.get('placebo_gain'))} | "
                     f"{pm((v['difference'], v['ci95']))} | {pm((ends['difference'], ends['ci95']))} "
                     f"({ends['grpo_step']} / {ends['placebo_step']}) | {fmt(v.get('base_difference'))} | {events} |")
    return [*lines, ""]


def write(out_dir: Path, results: dict) -> None:
    (out_dir / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [f"# Device check: {results['device']}", "",
             f"torch {results['torch']}, mode {results['mode']}, {results.get('wall_s', 0):.0f} s in all", ""]
    for stage in ("peak", "recam", "vae", "motion", "learning", "overhead"):
        r = results.get(stage)
        if r is None:
            continue
        lines += [f"## {stage}", ""]
        flat = {f"{k}.{kk}": vv for k, v in r.items() if isinstance(v, dict) for kk, vv in v.items()}
        flat.update({k: v for k, v in r.items() if not isinstance(v, dict)})
        lines += [f"- {k}: {fmt(v)}" for k, v in flat.items()
                  if k != "traceback" and not k.endswith((".curve", ".vs_placebo"))] + [""]
        if stage == "learning":
            lines += placebo_table(r) + curve_tables(r)
    (out_dir / "device_check.md").write_text("\n".join(lines))
