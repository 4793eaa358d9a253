"""Verify from its logs that a GRPO run did what it claims; write a Markdown report with plots.

    python scripts/verify_grpo_log.py runs/tiny_cpu                 # metrics.jsonl (+ config.json) of a run
    python scripts/verify_grpo_log.py old_run/train.log --tol 1e-3  # a text log with [GRPO Debug] lines

Exit status:
    0  every epoch's sampling facts (gathered dataset indices, or counts per condition) were read and every
       check passed; warnings allowed (a line that could not be read is listed in the report and is a warning)
    1  some check failed, or could not be evaluated where that matters: an epoch whose sampling facts were not
       read fails "could not verify", and so does a log with no readable epoch (e.g. a file of unrelated text)
    2  the path does not exist or holds no log (argparse usage errors also exit 2)
Never ends in a traceback: anything unexpected becomes a failing "parse" check in the report (exit 1).

Text logs are read by `recam.verify.parse_debug_log`; `recam.verify.DEBUG_LOG_FORMS` lists the forms it reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recam import verify  # noqa: E402

LOG_NAMES = ("train.log", "training.log", "log.txt", "stdout.log")


def find_source(path: Path) -> tuple[Path, Path | None]:
    """(log file to verify, config.json or None) for a run directory or a log file."""
    if path.is_dir():
        if (path / "metrics.jsonl").exists():
            log = path / "metrics.jsonl"
        else:
            candidates = [path / n for n in LOG_NAMES if (path / n).exists()]
            candidates += sorted(p for p in path.glob("*.log") if p not in candidates)
            with_tag = [p for p in candidates if verify.has_debug_tag(p.read_text(errors="replace"))]
            if not with_tag:
                raise FileNotFoundError(f"{path} holds neither metrics.jsonl nor a log with {verify.TAG} lines")
            log = with_tag[0]
        config = path / "config.json"
    else:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        log, config = path, path.parent / "config.json"
    return log, config if config.exists() else None


def build_report(path: Path, tol: float, eps: float = 1e-4) -> tuple[verify.Report, list[dict]]:
    """The report and, for metrics.jsonl, its records (for the plots). eps: the advantage eps of a text log's run
    (a run directory's config.json says its own)."""
    log, config_path = find_source(path)
    text = log.read_bytes().decode("utf-8", errors="replace")  # no newline translation: a \r is not a line end
    if not verify.looks_like_jsonl(text) and (log.suffix != ".jsonl" or verify.has_debug_tag(text)):
        # anything that is not JSON lines is read as a text log: with no [GRPO Debug] epoch in it, it fails
        return verify.verify_debug_log(verify.parse_debug_log(text), tol, source=str(log), eps=eps), []
    config, config_check = None, None
    if config_path is not None:
        try:
            config = json.loads(config_path.read_text())
            config_check = verify.Check("config_file", verify.PASS, {"path": str(config_path)}, "config.json read")
        except (OSError, json.JSONDecodeError) as e:
            config_check = verify.Check("config_file", verify.WARN, {"path": str(config_path)},
                                        f"config.json unreadable ({e}); verified without it")
    parsed = verify.parse_jsonl(text)
    report = verify.verify_metrics(parsed, config, tol, source=str(log))
    if config_check is not None:
        report.checks.insert(1, config_check)
    return report, parsed.records


def default_out(path: Path) -> Path:
    if path.is_dir():
        return path / "grpo_verification.md"
    return path.parent / f"{path.stem}_verification.md"


def render(report: verify.Report, plots: list[tuple[str, str]]) -> str:
    try:
        return verify.render_markdown(report, plots)
    except Exception as e:
        # A check carrying something unprintable must not cost the whole report: fall back to plain lines.
        lines = [f"# GRPO verification report ({report.status.upper()})", "",
                 f"(full rendering failed: {type(e).__name__}: {e})", ""]
        lines += [f"- {c.status.upper()} {c.name} [{c.epoch}]: {c.detail}" for c in report.checks]
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="run directory (metrics.jsonl, config.json) or a log file")
    parser.add_argument("--out", help="Markdown report (default: next to the log); plots go beside it")
    parser.add_argument("--tol", type=float, default=1e-3, help="tolerance of mean 0 / std 1 / equalities")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--eps", type=float, default=1e-4,
                        help="a text log's advantage eps (r - mean) / (std + eps): what an advantage std below 1 "
                             "is read against (metrics.jsonl runs take theirs from config.json)")
    args = parser.parse_args(argv)
    path = Path(args.path)
    out = Path(args.out) if args.out else default_out(path)
    records: list[dict] = []
    code = None
    try:
        report, records = build_report(path, args.tol, args.eps)
    except Exception as e:
        if isinstance(e, FileNotFoundError):
            code = 2
        detail = f"{type(e).__name__}: {e}"
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            detail += f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})"
        report = verify.Report(str(path), "unknown", [verify.Check("parse", verify.FAIL, {}, detail)], [], [],
                               {"tol": args.tol})
    plots: list[tuple[str, str]] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if records and not args.no_plots:
            try:
                plots = verify.write_plots(records, out.parent, out.stem)
            except Exception as e:
                report.notes.append(f"plots could not be drawn: {type(e).__name__}: {e}")
        out.write_text(render(report, plots))
        where = f"report: {out}"
    except OSError as e:
        where = f"report not written ({e}); printing it instead\n\n" + render(report, plots)
    failing = report.failing()
    warns = sum(c.status == verify.WARN for c in report.checks)
    placebo = " (PLACEBO run: advantages permuted within groups)" if report.settings.get("placebo") is True else ""
    print(f"GRPO verification of {report.source}{placebo}: {report.status.upper()} "
          f"({len(failing)} failing, {warns} warning of {len(report.checks)} check results)")
    for c in failing[:20]:
        scope = "run" if c.epoch is None else f"epoch {c.epoch}"
        print(f"  FAIL {c.name} [{scope}]: {c.detail}")
    if len(failing) > 20:
        print(f"  … and {len(failing) - 20} more failing results in the report")
    if report.unreadable:
        print(f"  could not read line(s): {', '.join(str(u.line) for u in report.unreadable[:20])}"
              + (f" and {len(report.unreadable) - 20} more" if len(report.unreadable) > 20 else ""))
        for u in report.unreadable[:5]:
            print(f"    line {u.line}: {u.reason}")
    print(where)
    if code is not None:
        return code
    return 1 if report.status == verify.FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
