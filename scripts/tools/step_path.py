"""The project files a run executes on its way to one optimizer step, with their line counts: what a reader has to
read to follow the algorithm, measured rather than claimed.

    python scripts/tools/step_path.py --config config/grpo.py:toy              # the core path: sampling -> first step
    python scripts/tools/step_path.py --config config/grpo.py:toy --from-start  # from the entry point on

It runs scripts/train_recam.py in this process with a profiler that notes every project function called, on the
main thread and on the threads that score rewards (module and class bodies, i.e. imports, do not count), and stops
the run at the policy's first optimizer step. The core
path starts at the first call of GRPOTrainer.sample (setup, validation, the base's evaluation and checkpoint are
left out) and leaves out the chosen domain's own files (recam/domains/<domain>/: what a sample is, behind the
Domain interface); --from-start counts everything from the entry point. Config overrides pass through.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_NOT_FUNCTIONS = {"<module>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}


class _Reached(Exception):
    """Raised by the optimizer hook to end the run at its first policy step."""


def trace_to_first_step(train_args: list[str], from_start: bool) -> dict[str, int]:
    """{project file (relative): functions called in it} up to the first optimizer step of the trainer's policy."""
    import torch  # noqa: F401  (the hook below needs torch.optim loaded)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls: dict[str, int] = {}
    sampled = [False]  # the trainer has started sampling: the next optimizer step is the policy's (a domain may
    root = str(ROOT) + os.sep  # pretrain its base with an optimizer of its own before that)

    reached = [False]  # calls made while _Reached unwinds the run (its error handlers) are not on the path

    def profile(frame, event, arg):
        if event != "call" or reached[0]:
            return
        code, path = frame.f_code, frame.f_code.co_filename
        if not path.startswith(root) or path == __file__:
            return
        if code.co_name == "sample" and path.endswith(os.path.join("engine", "trainer.py")):
            sampled[0] = True
        is_class_body = "__module__" in frame.f_locals and "__qualname__" in frame.f_locals
        if (from_start or sampled[0]) and code.co_name not in _NOT_FUNCTIONS and not is_class_body:
            rel = os.path.relpath(path, ROOT)
            calls[rel] = calls.get(rel, 0) + 1

    def stop(optimizer, args, kwargs):
        if sampled[0]:
            reached[0] = True
            raise _Reached()

    handle = register_optimizer_step_pre_hook(stop)
    argv, sys.argv = sys.argv, [str(ROOT / "scripts" / "train_recam.py"), *train_args]
    sys.setprofile(profile)
    threading.setprofile(profile)  # rewards are scored on worker threads: they are on the path too
    try:
        runpy.run_path(str(ROOT / "scripts" / "train_recam.py"), run_name="__main__")
    except _Reached:
        pass
    except SystemExit as e:
        raise SystemExit(f"the run ended (exit {e.code}) before its first optimizer step") from e
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        sys.argv = argv
        handle.remove()
    return calls


def path_table(calls: dict[str, int], domain: str | None) -> list[tuple[str, int]]:
    """(file, lines) of the files called, less the chosen domain's own files when `domain` is given."""
    skip = f"recam{os.sep}domains{os.sep}{domain}{os.sep}" if domain else None
    rows = []
    for rel in sorted(calls):
        if skip and rel.startswith(skip):
            continue
        rows.append((rel, sum(1 for _ in open(ROOT / rel, encoding="utf-8"))))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from-start", action="store_true", help="count from the entry point, the domain's files too")
    args, train_args = p.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    calls = trace_to_first_step(train_args, args.from_start)
    domain = None
    if not args.from_start:
        parts = [Path(r).parts for r in calls]
        domains = {p[2] for p in parts if p[:2] == ("recam", "domains") and len(p) > 3}
        domain = domains.pop() if len(domains) == 1 else None
    rows = path_table(calls, domain)
    what = "from the entry point" if args.from_start else "from the first sampling call, less the domain's files"
    print(f"to the first optimizer step, {what}:")
    for rel, lines in rows:
        print(f"  {lines:5d}  {rel}")
    print(f"{len(rows)} files, {sum(n for _, n in rows)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
