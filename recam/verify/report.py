"""The Markdown report of a verification (`render_markdown`) and the table of the text-log forms read
(`debug_log_forms_markdown`, in docs/guide.md). Both return text; nothing here writes files."""

from __future__ import annotations

from typing import Any

from recam.verify.core import FAIL, PASS, WARN, Check, Report, _short, worst
from recam.verify.parse_text import DEBUG_LOG_FORMS


def debug_log_forms_markdown() -> str:
    """DEBUG_LOG_FORMS as the Markdown table docs/guide.md carries (a test keeps the two the same)."""
    rows = ["| form read | example |", "|---|---|"]
    for what, example in DEBUG_LOG_FORMS:
        shown = "<br>".join(f"`{line}`" for line in example.split("\n")) if example else "-"
        rows.append(f"| {what.replace('|', chr(92) + '|')} | {shown.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def _fmt(x: Any, depth: int = 0) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, (list, tuple)):
        return "[" + _short([_fmt(i, depth + 1) for i in x], 8) + "]"
    if isinstance(x, dict):
        items = [f"{k}: {_fmt(v, depth + 1)}" for k, v in x.items()]
        return "{" + _short(items, 6) + "}"
    return str(x)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _numbers(nums: dict) -> str:
    return _cell(", ".join(f"{k}={_fmt(v)}" for k, v in nums.items()))


def _check_table(checks: list[Check]) -> list[str]:
    lines = ["| check | status | numbers | detail |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.status.upper()} | {_numbers(c.numbers)} | {_cell(c.detail)} |")
    return lines


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


def _condition_table(rows: list[dict]) -> list[str]:
    lines = ["| condition | id | samples | mean | std | reward std | status | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        samples = "-" if r.get("samples") is None else r["samples"]
        lines.append(f"| {r['condition']} | {_cell(r.get('id', ''))} | {samples} | {_num(r['mean'])} | "
                     f"{_num(r['std'])} | {_num(r.get('reward_std'))} | {r['status'].upper()} | "
                     f"{_cell(r.get('note', ''))} |")
    return lines


def render_markdown(report: Report, plots: list[tuple[str, str]] | None = None) -> str:
    """The report as Markdown; `plots` are (title, relative path) pairs to link."""
    summary = report.summary()
    n_fail = sum(1 for c in report.checks if c.status == FAIL)
    n_warn = sum(1 for c in report.checks if c.status == WARN)
    epochs = report.epochs
    span = f"{min(epochs)}..{max(epochs)} ({len(epochs)})" if epochs else "none"
    placebo = report.settings.get("placebo") is True
    out = ["# GRPO verification report" + (" — PLACEBO run" if placebo else ""), "",
           *(["PLACEBO: each group's advantages were permuted among its own samples (advantage.placebo=True); the "
              "advantage checks verify that permutation.", ""] if placebo else []),
           f"- source: `{report.source}` ({report.kind})",
           f"- epochs: {span}",
           f"- settings: {_numbers(report.settings)}", "",
           f"**Result: {report.status.upper()}** — {n_fail} failing and {n_warn} warning check results "
           f"over {len(report.checks)}.", ""]
    out += ["## Summary", "", "| check | overall | failing in | warning in |", "|---|---|---|---|"]
    for name, row in summary.items():
        out.append(f"| {name} | {row['status'].upper()} | {_cell(_short(row['fail'])) or '-'} | "
                   f"{_cell(_short(row['warn'])) or '-'} |")
    out.append("")
    out += ["## Could not read", ""]
    if report.unreadable:
        out += [f"- line {u.line}: {u.reason} — `{u.text.replace('`', chr(39))}`" for u in report.unreadable]
    else:
        out.append("Every line was read.")
    out.append("")
    for note in report.notes:
        out.append(f"> {note}")
    if report.notes:
        out.append("")
    run_checks = [c for c in report.checks if c.epoch is None]
    out += ["## Whole run", ""] + _check_table(run_checks) + [""]
    for e in sorted({c.epoch for c in report.checks if c.epoch is not None}):
        these = [c for c in report.checks if c.epoch == e]
        status = worst(c.status for c in these)
        out += [f"## Epoch {e} — {status.upper()}", ""] + _check_table(these) + [""]
        for c in these:
            if not c.table:
                continue
            title = f"Advantages per condition ({len(c.table)} conditions, {c.status.upper()})"
            if c.status == PASS:
                out += ["<details><summary>" + title + "</summary>", ""] + _condition_table(c.table)
                out += ["", "</details>", ""]
            else:
                out += [f"### {title}", ""] + _condition_table(c.table) + [""]
    if plots:
        out += ["## Plots", ""]
        for title, path in plots:
            out += [f"### {title}", "", f"![{title}]({path})", ""]
    return "\n".join(out).rstrip() + "\n"
