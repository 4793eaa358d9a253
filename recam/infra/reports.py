"""A run's reports, written once at its end: summary.md's before/after table, the verification and diagnosis
reports (by their own scripts), and the evaluation summaries and comparison videos they read; and how a report
prints a missing value (`fmt_or_na`, which the console's line per epoch uses too). Nothing here runs on the way to
an optimizer step (recam.infra.runlog writes the records while training).
"""

from __future__ import annotations

import errno
import json
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from recam.infra.checkpoint import DiskFull, is_disk_full
from recam.infra.runlog import LOG_FILE, no_space, read_records, write_whole
from recam.infra.stats import paired_change


def fmt_or_na(value, spec: str) -> str:
    """`value` formatted with `spec`, or "n/a" when it is missing: None (e.g. first_step_ratio_deviation of an epoch
    that took no optimizer step because every sample was excluded), NaN (a mean over no sample), or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        return "n/a"
    return format(value, spec)



def write_summary(log, before: dict, after: dict, extra_paths: dict | None = None, note: str | None = None,
                  rollbacks: int = 0, selected: dict | None = None, selection: str | None = None,
                  rows: tuple[tuple[str, str], ...] = (), examples: Path | None = None, budget: str | None = None,
                  rewards: tuple[str, ...] = (), banner: str | None = None) -> str:
    """The before/after table of `log`'s run (a RunLog), written to summary.md and printed. With `selected` (the
    evaluation record of the checkpoint chosen on validation conditions) the run reports that checkpoint, and the
    last epoch stays beside it for comparison.
    rows: the domain's (label, metric key) pairs, e.g. ("cam_score", "eval/cam_score"). rewards: the rewards
    scored at evaluation; one whose eval/<name> no row shows gets a row of its own, so a new reward is reported
    without a domain listing it. budget: how the run's wall-clock budget (max_train_seconds) ended it, when it
    did. banner: a line that heads the summary and ends it (the last line printed), for what a reader must not
    miss about the run (a placebo run says so)."""
    shown = {key for _, key in rows}
    rows = (*rows, *((name, f"eval/{name}") for name in rewards if f"eval/{name}" not in shown))

    def f4(x):  # a missing value (absent, None, NaN) prints as "n/a"
        return fmt_or_na(x, ".4f")

    def diff(key, late, x, y):
        """late - base: paired over the conditions with its 95% interval where the metric is per condition."""
        if "n/a" in (f4(x), f4(y)):
            return "n/a"
        mean, half, _ = eval_change(before, late, key)
        return f"{mean:+.4f} ± {half:.4f}" if math.isfinite(half) else fmt_or_na(mean, "+.4f")

    if selected is None:
        lines = ["| held-out metric | base | after GRPO | change |", "|---|---|---|---|"]
        for name, key in rows:
            if key in before or key in after:
                b, a = before.get(key), after.get(key)
                lines.append(f"| {name} | {f4(b)} | {f4(a)} | {diff(key, after, a, b)} |")
    else:
        sel = selected["checkpoint"]
        lines = [f"| held-out metric | base | last epoch | selected ({sel}) | change (selected) | change (last) |",
                 "|---|---|---|---|---|---|"]
        for name, key in rows:
            if key in before or key in after or key in selected:
                b, a, s = before.get(key), after.get(key), selected.get(key)
                lines.append(f"| {name} | {f4(b)} | {f4(a)} | {f4(s)} | {diff(key, selected, s, b)} | "
                             f"{diff(key, after, a, b)} |")
    lines.append("")
    lines.append(f"conditions evaluated: {after.get('eval/num_conditions')} (held-out, ODE sampling, fixed noise)")
    lines.append("change: a ± b is the mean change over the held-out conditions with its paired 95% t-interval (a "
                 "change whose interval contains 0 is inside the noise); a change without ± is of a metric over "
                 "the whole split, which has no per-condition values")
    if selected is not None:
        lines.append(f"selected checkpoint: {log.run_dir / 'checkpoints' / selected['checkpoint']} ({selection}; "
                     "the held-out conditions play no part in the choice)")
    lines.append(f"health guard: {note or 'ran to the end'}; rollbacks: {rollbacks}")
    if budget:
        lines.append(f"budget: {budget}")
    paths = {"metrics": log.path, "examples": examples or log.run_dir / "videos",
             "checkpoints": log.run_dir / "checkpoints"}
    paths.update(extra_paths or {})
    lines += [f"{k}: {v}" for k, v in paths.items()]
    if banner:
        lines = [banner, "", *lines, banner]
    text = "\n".join(lines)
    write_whole(log.run_dir / "summary.md", text + "\n")
    print("\n" + text, flush=True)
    return text


def run_script(name: str, argv: list[str]) -> tuple[int, str]:
    """scripts/<name>.py's main(argv) in this process, with what it prints captured: the run's interpreter already
    holds what the tools import, so no second one starts. A tool that crashes gives exit 1 and its traceback."""
    import contextlib
    import importlib.util
    import io
    import traceback

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recam_tool_{name}", path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            code = module.main(argv)
        except SystemExit as e:  # argparse and friends
            code = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # noqa: BLE001 - the report says the tool failed; the run's results stand
            if is_disk_full(e):  # but a full disk stops the run, like any other write that finds none
                raise
            code = 1
            printed.write(traceback.format_exc())
    return int(code or 0), printed.getvalue()


def write_reports(run_dir: Path) -> dict:
    """Run the project's GRPO verification and diagnosis tools on this run; returns their report paths. A full disk
    raises DiskFull, with no report or plot of this call left half-written."""
    verification, diagnosis = run_dir / "grpo_verification.md", run_dir / "diagnosis.md"
    try:
        v_code, v_out = run_script("verify_grpo_log", [str(run_dir), "--out", str(verification)])
        # The verifier keeps going when it cannot write: a plot it could not save becomes a note in its report, a
        # report it could not save is printed instead. Here that means the disk is full.
        written = verification.read_text(errors="replace") if verification.is_file() else ""
        if any(words in text for words in ("No space left on device", "Disk quota exceeded")
               for text in (v_out, written)):
            raise DiskFull(errno.ENOSPC, f"no space left on the device writing {verification} (or its plots)")
        d_code, d_out = run_script("diagnose", [str(run_dir)])
        write_whole(diagnosis, d_out)
    except Exception as e:
        if not is_disk_full(e):
            raise
        for path in (verification, *run_dir.glob(f"{verification.stem}_*.png")):
            path.unlink(missing_ok=True)
        raise
    headline = v_out.strip().splitlines()[0] if v_out.strip() else ""
    print(headline or v_out[-2000:], flush=True)
    # The verifier exits 0 on PASS and on WARN alike: the word in its headline is what the summary must repeat.
    status = re.search(r": (PASS|WARN|FAIL) \(", headline)
    status = status.group(1) if status else ("FAIL" if v_code else "unknown")
    word = {0: "healthy", 1: "INCOMPLETE: not everything could be diagnosed", 2: "NOT healthy"}.get(d_code, "failed")
    return {"verification": f"{verification} ({status})", "diagnosis": f"{diagnosis} ({word})"}


def condition_rows(before: dict, after: dict, key: str) -> tuple[list, list] | None:
    """The two evaluation records' per-condition values of one metric (rows/<key>), or None where either lacks them
    (a metric over the whole split). Rows of different lengths are two different held-out sets, which no difference
    of means may stand in for: a ValueError that says both counts."""
    b, a = before.get(f"rows/{key}"), after.get(f"rows/{key}")
    if not (b and a):
        return None
    if len(a) != len(b):
        raise ValueError(f"{key}: the two evaluations scored different held-out sets ({len(b)} and {len(a)} "
                         "conditions), so they cannot be compared condition by condition")
    return b, a


def eval_change(before: dict, after: dict, key: str) -> tuple[float, float, int]:
    """after - before for one metric of two evaluation records: paired over the conditions both scored, with its 95%
    t half-width and their count, when both carry the metric's per-condition values (rows/<key>); otherwise the
    difference of the means, with a NaN half-width and 0 conditions (a metric over the whole split). A ValueError
    where the two scored different held-out sets (condition_rows)."""
    rows = condition_rows(before, after, key)
    if rows is not None:
        return paired_change(*rows)
    x, y = after.get(key), before.get(key)
    return (x - y if x is not None and y is not None else math.nan), math.nan, 0


def per_condition_change(before: dict, after: dict, key: str) -> list[float | None]:
    """after - before per held-out condition (rows/<key>; None where either has no value), or the one difference of
    the means for a metric over the whole split (no per-condition values): a row of a seeds x conditions table. A
    ValueError where the two scored different held-out sets (condition_rows)."""
    rows = condition_rows(before, after, key)
    if rows is not None:
        return [None if x is None or y is None else float(y) - float(x) for x, y in zip(*rows, strict=True)]
    x, y = after.get(key), before.get(key)
    return [x - y if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None]


def summarise_eval(rows: list[dict], prefix: str = "eval") -> dict:
    """Mean metrics (<prefix>/<name>, eval/ for held-out, val/ for validation) from per-condition rows, and each
    metric's per-condition values as rows/<prefix>/<name> (paired intervals between two evaluations).

    A missing value (None or NaN: a reward that failed on that condition) is left out of its mean, never averaged
    as a number; a metric with no value at all is NaN."""
    out = {f"{prefix}/num_conditions": len(rows)}
    for key in dict.fromkeys(k for r in rows for k in r):
        if key == "index":
            continue
        vals = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=np.float64)
        # reward_<name> -> <name> (reward_avg keeps its prefix); details keep their last path part
        short = key.removeprefix("reward_") if key.startswith("reward_") and key != "reward_avg" else key
        name = f"{prefix}/{short.split('/')[-1]}"
        finite = vals[np.isfinite(vals)]
        out[name] = float(finite.mean()) if finite.size else float("nan")
        # per condition, in index order (None: no value), so that two evaluations compare condition by condition
        out[f"rows/{name}"] = [float(v) if math.isfinite(v) else None for v in vals]
    return out


def write_comparison_videos(out_dir: Path, batch: dict, videos: torch.Tensor, n: int, scale: int = 4) -> list[Path]:
    """GIFs of source | ground truth | generated, side by side, for the first n conditions of a batch. Each GIF is
    encoded in memory and written whole (`write_whole`): a full disk leaves no half-written GIF, and no image writer
    holding a file that its finaliser would try, and fail, to flush at exit."""
    import imageio.v3 as iio

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if is_disk_full(e):
            raise no_space(out_dir, e) from e
        raise
    paths = []
    for i in range(min(n, videos.shape[0])):
        panels = [batch["source_video"][i], batch["target_video"][i], videos[i]]
        # panels may live on different devices (the samples on the accelerator, the dataset's clips on the CPU)
        strip = torch.cat([p.detach().float().cpu().clamp(-1, 1) for p in panels], dim=-1)  # (3, F, H, 3W)
        frames = ((strip + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
        path = out_dir / f"{batch['condition_ids'][i].replace('/', '_')}.gif"
        write_whole(path, iio.imwrite("<bytes>", frames, extension=".gif", duration=0.25, loop=0))
        paths.append(path)
    return paths


# ---------------------------------------------------------------- the guard's events of a finished run

# A health record's severities (recam.engine.health.SEVERITIES; infra does not import the engine) and the names a
# report gives them.
_SEVERITY_NAMES = {"critical": "critical", "warn": "warning", "info": "info"}
# what the trainer writes on a rollback (the archived records' "rolled_back") and at the end of a run (summary.md)
_ROLLBACK = re.compile(r"rollback (\d+): (\S+)")
_SUMMARY_GUARD = re.compile(r"^health guard: (.*); rollbacks: (\d+)\s*$", re.MULTILINE)
_GUARD_STOP_PREFIX = "stopped early: health guard, "


def _guard_stop_in_run_log(path: Path) -> str | None:
    """The guard's stop as run.log says it, for a run that wrote no summary.md (killed before its end): the rules of
    the last guard decision before a "stopped; weights restored" line, unless a later resume went on training."""
    if not path.is_file():
        return None
    rules, stop = None, None
    for line in path.read_text(errors="replace").splitlines():
        _, _, message = line.partition(" recam.run: ")
        if message.startswith("health guard: "):
            rules = message.removeprefix("health guard: ").split(" (")[0]
        elif message.startswith("stopped; weights restored from the last healthy checkpoint"):
            stop = f"health guard, {rules or 'rule not logged'} (from {LOG_FILE}: the run wrote no summary.md)"
        elif message.startswith("resumed from "):
            stop = None
    return stop


def run_events(run_dir: Path) -> dict:
    """What the health guard did in a run folder, for reading beside its results: the guard acts on the rewards, so
    two arms of a comparison (GRPO and its placebo) can be rolled back or stopped differently.

    Returns {"rollbacks": int, "guard_stop": the stop's reason or None, "critical", "warning", "info": findings
    counted by severity, "critical_steps": optimizer steps with a critical finding (each one a guard decision:
    rollback, stop, or carry on under health.action=warn), "rules": {rule: findings of it that were critical or
    warnings}, most frequent first (the engine lists a step's findings most severe first; ties keep that order)}.

    Read from metrics.jsonl's health records and those a rollback moved to rolled_back.jsonl (the step that
    triggered a rollback is among them), the rollbacks' reasons there, and summary.md's "health guard" line; run.log
    stands in for summary.md in a run killed before its end. rollbacks is the larger of the archived rollbacks and
    summary.md's count, since summary.md is written at an end only and a window killed later has more. A folder
    from before a file existed counts nothing from it; a folder without metrics.jsonl is not a run: FileNotFoundError
    names the file."""
    log = run_dir / "metrics.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{log} is missing: {run_dir} is not a run folder (or its log was packed or moved)")
    archived = read_records(run_dir / "rolled_back.jsonl")
    health = [r for r in (*read_records(log), *archived) if r.get("type") == "health"]
    counts = Counter({name: 0 for name in _SEVERITY_NAMES.values()})
    rules: Counter = Counter()
    critical_steps = 0
    for record in health:
        findings = [f for f in record.get("findings") or [] if isinstance(f, dict)]
        critical_steps += any(f.get("severity") == "critical" for f in findings)
        for f in findings:
            severity = _SEVERITY_NAMES.get(f.get("severity"), str(f.get("severity")))
            counts[severity] += 1
            if severity in ("critical", "warning"):
                rules[str(f.get("rule"))] += 1
    archived_rollbacks = {m.group(1) for r in archived
                          if (m := _ROLLBACK.match(str(r.get("rolled_back", ""))))}
    summary = run_dir / "summary.md"
    said = _SUMMARY_GUARD.findall(summary.read_text(errors="replace")) if summary.is_file() else []
    if said:
        note, count = said[-1]
        stop = note.removeprefix("stopped early: ") if note.startswith(_GUARD_STOP_PREFIX) else None
        rollbacks = max(len(archived_rollbacks), int(count))
    else:
        stop, rollbacks = _guard_stop_in_run_log(run_dir / LOG_FILE), len(archived_rollbacks)
    return {"rollbacks": rollbacks, "guard_stop": stop, **counts, "critical_steps": critical_steps,
            "rules": dict(sorted(rules.items(), key=lambda kv: -kv[1]))}  # ties: first seen first


def _run_seed(run_dir: Path):
    """The seed config.json records, or None (no config.json, or one without a seed)."""
    try:
        seed = json.loads((run_dir / "config.json").read_text()).get("seed")
    except (OSError, ValueError, AttributeError):
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def events_table(grpo_runs: list[Path], placebo_runs: list[Path], top: int = 3) -> str:
    """A markdown table of each run's guard events (`run_events`), one row per run, GRPO's first, and a line that
    says whether the two arms differ in them: rollbacks, guard stops, critical findings and warnings, added up per
    arm. top: how many of a run's most frequent rules its row names."""
    lines = ["| arm | run | seed | rollbacks | guard stop | critical findings | warnings | top rules |",
             "|---|---|---|---|---|---|---|---|"]
    totals = {}
    for arm, runs in (("GRPO", grpo_runs), ("placebo", placebo_runs)):
        total = Counter(runs=0, rollbacks=0, stops=0, critical=0, warning=0)
        for run in runs:
            e = run_events(Path(run))
            seed = _run_seed(Path(run))
            named = ", ".join(f"{rule} ×{n}" for rule, n in list(e["rules"].items())[:top]) or "none"
            stop = (e["guard_stop"] or "none").replace("|", "\\|")
            lines.append(f"| {arm} | {run} | {'n/a' if seed is None else seed} | {e['rollbacks']} | {stop} | "
                         f"{e['critical']} | {e['warning']} | {named} |")
            total.update(runs=1, rollbacks=e["rollbacks"], stops=e["guard_stop"] is not None,
                         critical=e["critical"], warning=e["warning"])
        totals[arm] = total

    def said(t):
        return (f"{t['rollbacks']} rollback(s), {t['stops']} guard stop(s), {t['critical']} critical finding(s), "
                f"{t['warning']} warning(s) over {t['runs']} run(s)")
    g, p = totals["GRPO"], totals["placebo"]
    keys = ("rollbacks", "stops", "critical", "warning")
    if all(g[k] == p[k] == 0 for k in keys):
        verdict = (f"The arms do not differ in the guard's events: neither had a rollback, a guard stop, a critical "
                   f"finding or a warning ({g['runs']} GRPO run(s), {p['runs']} placebo run(s)).")
    elif all(g[k] == p[k] for k in keys):
        verdict = f"The arms do not differ in the guard's events in total: each arm had {said(g)}."
    else:
        verdict = (f"The arms differ in the guard's events: GRPO {said(g)}; placebo {said(p)}. The guard acts on "
                   "the rewards, so its rollbacks and stops are part of what each arm's result measures.")
    return "\n".join([*lines, "", verdict])
