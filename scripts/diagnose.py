"""Diagnose a finished or running GRPO run from its metrics: blown-up ratios, drift, dead advantages, collapse.

    python scripts/diagnose.py runs/tiny_cpu                  # <run_dir>/metrics.jsonl
    python scripts/diagnose.py metrics.jsonl                  # JSONL of step/epoch records or metric dicts
    python scripts/diagnose.py step_metrics.json              # one metric dict or a list of them

Exit status: 0 when nothing is critical (warnings allowed), 2 when something is critical, 1 when the input
could not be read at all, or when the verdict is INCOMPLETE: no step or epoch record the schema accepts (an empty
metrics.jsonl, a file of noise), or nothing readable is critical but some lines could not be read, some records
failed the schema (recam.infra.schema: a step record without an integer step, a field of the wrong type such as
a string of advantages, a negative or repeated step or epoch number, per-sample fields of different lengths), or
the step records do not cover the optimizer steps the epoch records store (none at all, or some epochs' missing),
or some carry an epoch that has no epoch record (other than the one still in progress; a log of step records of
several epochs and no epoch record at all included), or are numbered other than their epoch record says (step+1 ..
step+n), or an epoch record lacks its advantages. What those held was not
diagnosed, so the run is not called healthy; the report says how many were skipped and why, one line per kind. A
record glued onto noise (bytes written before it with no newline of their own) is recovered and said so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recam import verify  # noqa: E402
from recam.engine import diagnosis  # noqa: E402


def load_records(path: Path) -> tuple[verify.ParsedLog, Path]:
    """Metric records of a run dir / JSONL / JSON file (with the lines that could not be read, what they still show
    of themselves, and the lines whose record was recovered from after noise), and the file read."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    text = path.read_bytes().decode("utf-8", errors="replace")  # no newline translation: a \r is not a line end
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, list):
            records = [r for r in data if isinstance(r, dict)]
            bad = [verify.Unreadable(0, f"list item {i} is not a metrics dict", str(r)[:80])
                   for i, r in enumerate(data) if not isinstance(r, dict)]
            return verify.ParsedLog(records, [], bad), path
    return verify.parse_jsonl(text), path


def _run_dir(path: Path) -> str:
    return str(path.parent) if path.name == "metrics.jsonl" else "<run_dir>"


def _last_step_line(records: list[dict]) -> str:
    steps = [r for r in records if r.get("type", "step") == "step"]
    if not steps:
        return "no optimizer step recorded yet"
    last = steps[-1]
    keys = ("loss", "policy_loss", "kl_penalty", "mean_ratio", "ratio_max", "clipfrac", "mean_advantage")
    shown = ", ".join(f"{k} {last[k]:.4g}" for k in keys if isinstance(last.get(k), (int, float)))
    return f"last step {last.get('step', '?')} (epoch {last.get('epoch', '?')}): {shown}"


def _exclusions(records: list[dict]) -> tuple[int, int, int]:
    """(excluded samples, samples, epochs with an exclusion) over the epoch records that say."""
    counts = [c for r in records if r.get("type") == "epoch" and (c := diagnosis.excluded_count(r)) is not None]
    return sum(e for e, _ in counts), sum(n for _, n in counts), sum(1 for e, _ in counts if e)


def _lost(kind: str | None, epoch: int | None) -> str:
    """What an unreadable line still shows it was (parse_jsonl's `lost`), e.g. "an epoch record (epoch 2)"."""
    if kind is None:
        return "unknown content"
    return f"a{'n' if kind[0] in 'aeiou' else ''} {kind} record" + (f" (epoch {epoch})" if epoch is not None else "")


def verdict(findings: list, unreadable: list, skipped: int = 0, counted: int = 1, gaps: list | None = None
            ) -> tuple[str, int]:
    """(verdict, exit status): CRITICAL / 2 when a readable record shows something critical; INCOMPLETE / 1 when
    no step or epoch record was counted, or nothing counted is critical but some lines could not be read,
    `skipped` records failed the schema, or the step records do not cover the optimizer steps the epoch records
    store (`gaps`, diagnosis.step_record_gaps); HEALTHY / 0 otherwise. counted: the step and epoch records
    diagnosed."""
    if not diagnosis.is_healthy(findings):
        return "CRITICAL", 2
    if not counted or unreadable or skipped or gaps:
        return "INCOMPLETE", 1
    return "HEALTHY", 0


def _why_incomplete(counted: int, unreadable: list, skipped: int, gaps: list | None = None,
                    unread: list | None = None) -> str:
    if not counted:
        return "no step or epoch record to diagnose"
    lost = [f"{len(unreadable)} line(s) could not be read"] if unreadable else []
    lost += [f"{skipped} record(s) failed the schema"] if skipped else []
    why = [f"{' and '.join(lost)}: what they held was not diagnosed"] if lost else []
    why += ["the step records do not match the optimizer steps the epoch records store: steps without a record "
            "were never judged by the step rules"] if gaps else []
    why += ["some epoch records lack what the rules read (above)"] if unread else []
    return f"nothing critical in the records diagnosed, but {'; and '.join(why)}"


def _rollbacks(source: Path) -> int:
    """How many times this run's guard rolled back, from rolled_back.jsonl beside the metrics records (0 when there
    is none). The trainer archives a rollback's records as "rollback <n>: <rule>"; any other reason (a fresh start
    archiving an earlier run's records) ends what came before, which was another run's."""
    archive = source.parent / "rolled_back.jsonl"
    if source.name != "metrics.jsonl" or not archive.exists():
        return 0
    reasons: set[str] = set()
    for line in archive.read_text(errors="replace").splitlines():
        try:
            reason = json.loads(line).get("rolled_back")
        except (ValueError, AttributeError):
            continue
        if isinstance(reason, str) and reason.startswith("rollback "):
            reasons.add(reason)
        elif reason is not None:
            reasons = set()
    return len(reasons)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="run directory, metrics.jsonl, or a JSON/JSONL file of metric dicts")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON instead of Markdown")
    args = parser.parse_args(argv)
    try:
        parsed, source = load_records(Path(args.path))
    except OSError as e:
        print(f"cannot read {args.path}: {e}")
        return 1
    unreadable, recovered = parsed.unreadable, parsed.recovered
    records, skipped = diagnosis.screen_records(parsed.records)
    n_skipped = sum(skipped.values())
    lost = {line: (kind, epoch) for line, kind, epoch in parsed.lost}
    try:
        findings = diagnosis.diagnose_run(records, run_dir=_run_dir(source))
    except Exception as e:
        # The rules are written against well-formed metrics; a record they trip on is itself the finding.
        findings = [diagnosis.Finding("diagnosis_error", "critical", {"error": f"{type(e).__name__}: {e}"},
                                   "The metrics could not be diagnosed; some record is malformed.",
                                   ["inspect the records named in the error"])]
    excluded, samples, epochs_hit = _exclusions(records)
    n_steps = sum(1 for r in records if r.get("type", "step") == "step")
    n_epochs = sum(1 for r in records if r.get("type") == "epoch")
    gaps = diagnosis.step_record_gaps(records)
    unread = diagnosis.epochs_without(records)
    word, status = verdict(findings, unreadable, n_skipped, n_steps + n_epochs, gaps + unread)
    others = diagnosis.unknown_types(records)
    rollbacks = _rollbacks(source)
    noise_line = diagnosis.noise_scale_line(records)
    if args.json:
        print(json.dumps({"source": str(source), "verdict": word, "unreadable_lines": [u.line for u in unreadable],
                          "recovered_lines": [u.line for u in recovered], "skipped_records": skipped,
                          "step_records": n_steps, "epoch_records": n_epochs, "step_record_gaps": gaps,
                          "not_judged": unread,
                          "unknown_types": others,
                          "rollbacks": rollbacks, "excluded_samples": excluded, "samples": samples,
                          "noise_scale": noise_line,
                          "healthy": status == 0, "worst": diagnosis.worst_severity(findings),
                          "findings": [f.__dict__ for f in findings]}, indent=1, default=str))
        return status
    print(f"# Diagnosis of {source}\n")
    print(f"{n_steps} step records, {n_epochs} epoch records; {_last_step_line(records)}")
    if noise_line:
        print(noise_line)
    if excluded:
        print(f"excluded samples: {excluded} of {samples} in {epochs_hit} epoch(s) (failed rewards, kept out of "
              "the advantages; the reward statistics below ignore them)")
    for u in recovered:
        print(f"line {u.line}: {u.reason}")
    for u in unreadable:
        print(f"could not read line {u.line}: {u.reason}; it held {_lost(*lost.get(u.line, (None, None)))}")
    for kind, n in skipped.items():
        print(f"skipped {n} {kind} (recam.infra.schema); not diagnosed")
    for gap in gaps:
        print(f"step records: {gap}")
    for line in unread:
        print(line)
    for kind, n in others.items():
        print(f"ignored {n} record(s) of unknown type {kind!r}")
    if rollbacks:
        # the guard's history restarts at each rollback; these records are compared with every epoch kept
        print(f"the run's guard rolled back {rollbacks} time(s) (rolled_back.jsonl) and compared each epoch only with "
              "those since its last rollback; this diagnosis compares it with every epoch metrics.jsonl keeps")
    why = (_why_incomplete(n_steps + n_epochs, unreadable, n_skipped, gaps, unread) if word == "INCOMPLETE"
           else f"worst: {diagnosis.worst_severity(findings) or 'none'}")
    print(f"\nverdict: {word} ({why})\n")
    if not n_steps + n_epochs:
        print("No step or epoch record was diagnosed: nothing is known about this run's health.")
    elif not findings and word == "INCOMPLETE":  # not "the metrics look healthy": some were never looked at
        print("No findings in the records diagnosed; what was not diagnosed (above) is unknown.")
    else:
        print(diagnosis.format_findings(findings), end="")
    return status


if __name__ == "__main__":
    sys.exit(main())
