"""Run logging at the edge: metrics.jsonl (the record a verifier reads), wandb (offline by default), videos.

What the run writes into its folder is written whole or not at all: a record appended is cut back out when the
disk fills during it, a file replaced (config.json, summary.md) is written beside it and renamed over it. A full
disk raises DiskFull naming the file, and scripts/train_recam.py ends the run on it in one line (`stop_on_full_disk`).

metrics.jsonl holds one JSON object per line with a "type":
  "step"  - loss metrics of one optimizer step, keyed by the global step;
  "epoch" - everything an independent GRPO verification needs for one epoch, built by the engine
            (recam.engine.records) and written here as it is given;
  "eval"  - held-out evaluation (prefix eval/) and, with checkpoint selection on, validation (prefix val/) of one
            checkpoint, with the global step it was taken at.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import logging
import os
import re
import socket
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, NoReturn

from tqdm.auto import tqdm

from recam.infra import stop_signals
from recam.infra.checkpoint import (
    DISPLACED,
    LATEST,
    NO_CHECKPOINT_YET,
    SELECTED,
    DiskFull,
    is_disk_full,
    read_pointer,
)

_file_log = logging.getLogger("recam.run")

# Every entry a recam run writes at the top of its folder (a name, or a glob pattern for names that vary): the one
# list a folder is held against. `run_dir_problem` refuses, before anything is written, a folder holding an entry of
# the wrong kind (a file where the run keeps a folder, or the reverse) or any entry the list does not name (another
# tool's output, a checkout: the run would overwrite or, with resume=False, move what it did not write), and
# `archive_run` moves into ARCHIVE what the list marks archived. The domain's examples folder (Domain.examples_dir)
# is the caller's to add, since this layer knows no domain.


class RunEntry(NamedTuple):
    pattern: str  # a name, or a glob pattern (fnmatch)
    folder: bool
    archived: bool = True  # moved into ARCHIVE by a start with resume=False
    kept: str = ""  # what the run keeps there, in a refusal's words (default: "its <name> file/folder")


LOG_FILE = "run.log"  # everything logged at INFO and above: the run's own lines, per-batch reward timings, retries
ARCHIVE = "archive"  # <run_dir>/archive/<UTC time>/: earlier runs of this folder, moved there by resume=False
LOCK_FILE = ".recam.lock"  # the running run's lock on its folder (`hold_run_dir`), naming its process
PROBE = ".write-probe-"  # + pid: run_dir_problem's test that the folder can be written, removed at once
_RUN_FILES = ("config.json", "metrics.jsonl", LOG_FILE, "rolled_back.jsonl", "metrics.unreadable", "summary.md",
              "grpo_verification.md", "diagnosis.md")
_REPLACED = ("config.json", "metrics.jsonl", "summary.md", "grpo_verification.md", "diagnosis.md")  # write_whole's
RUN_ENTRIES = (
    *(RunEntry(name, False) for name in _RUN_FILES),
    RunEntry("run.rank*.log", False),
    RunEntry("grpo_verification_*.png", False),
    RunEntry("checkpoints", True),
    RunEntry("wandb", True),
    RunEntry(ARCHIVE, True, archived=False),
    # write_whole's temporary names (a file written beside its final name and renamed over it): a folder there
    # would stop the run at its first such write, after its work began; and an older version's temporary log
    *(RunEntry(f".{name}.tmp", False, kept=f"the temporary file it writes {name} through") for name in _REPLACED),
    RunEntry("metrics.tmp", False, kept="an older version's temporary metrics file"),
    # what the project's own tools keep in a run's folder: a device check's packed log (scripts/device_stages/
    # bundle.py), and the launchers' capture of the run's console beside it (scripts/placebo_runs.py,
    # scripts/measure/ablate.py and noise_sweep.py, scripts/bench/bench_time_to_reward.py), which the launcher holds
    # open across the run and so is never archived
    RunEntry("metrics.jsonl.gz", False),
    *(RunEntry(name, False, archived=False) for name in ("console.log", "stdout.log", "bench.log", "command.txt")),
    RunEntry(LOCK_FILE, False, archived=False, kept="its lock file"),
    RunEntry(f"{PROBE}*", False, archived=False, kept="the write test of a run starting"),
    # the file system's own (NFS keeps a removed, still open file as .nfs plus hex digits) and a file browser's
    RunEntry(".nfs*", False, archived=False, kept="a file NFS keeps for a removed one"),
    RunEntry(".DS_Store", False, archived=False, kept="a file browser's"),
)
# What the run writes in checkpoints/ (recam.infra.checkpoint): its epoch_NNNN folders, the two pointer files, a
# save's folder before its rename (.tmp-epoch_NNNN), one renamed aside to be replaced, and a pointer's temporary
CHECKPOINT_ENTRIES = ("epoch_*", LATEST, SELECTED, ".tmp-*", f"{DISPLACED}*", f".{LATEST}.tmp", f".{SELECTED}.tmp")
ARCHIVED_RUN = re.compile(r"\d{8}T\d{6}Z(-\d+)?")  # archive/<UTC time>[-n]/, as archive_run names them


def no_space(path: Path, error: BaseException) -> DiskFull:
    """The DiskFull for a write of `path` that found the disk full (`error`, what the writer raised)."""
    full = DiskFull(errno.ENOSPC, f"no space left on the device writing {path}")
    full.__cause__ = error
    return full


def _write(fd: int, data: memoryview) -> int:
    """os.write: every byte the run writes into its folder goes through here (the tests' full disk replaces it)."""
    return os.write(fd, data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a write may take only part of it, the next one then says why
        view = view[_write(fd, view):]


def _write_whole(fd: int, data: bytes, path: Path) -> None:
    """Append `data` to the file open at `fd` (O_APPEND), all of it or none: a write cut short by a full disk is cut
    back off, since a torn last line is what the next reader would have to explain."""
    start = os.fstat(fd).st_size
    try:
        _write_all(fd, data)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        if is_disk_full(e):
            raise no_space(path, e) from e
        raise


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created when missing) and sync it; on a full disk the file is left as it was and
    DiskFull names it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        if is_disk_full(e):
            raise no_space(path, e) from e
        raise
    try:
        _write_whole(fd, data, path)
        try:
            os.fsync(fd)
        except OSError as e:  # some file systems (NFS) report a full disk only here: the bytes are not kept
            with contextlib.suppress(OSError):
                os.ftruncate(fd, os.fstat(fd).st_size - len(data))
            if is_disk_full(e):
                raise no_space(path, e) from e
            raise
    finally:
        os.close(fd)


def write_whole(path: Path, data: str | bytes) -> None:
    """Replace `path` by `data`: written beside it and renamed over it, so a reader finds the old contents or the
    new ones, never a part. On a full disk nothing is left beside it and DiskFull names the file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        # a file or link left at the temporary name is removed, not written through: a link's target is not the run's
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data.encode("utf-8") if isinstance(data, str) else data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(e):
            raise no_space(path, e) from e
        raise


class _RunLogFile(logging.Handler):
    """run.log: each record a whole line or nothing. A full disk is kept in `full` for the run to stop on
    (RunLog.check_space) instead of logging's traceback per record; other failures are logging's as usual."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path
        self.full: DiskFull | None = None
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, record: logging.LogRecord) -> None:
        if self.full is not None or self._fd is None:
            return
        try:
            _write_whole(self._fd, (self.format(record) + "\n").encode("utf-8", "backslashreplace"), self.path)
        except DiskFull as e:
            self.full = e
        except Exception:  # noqa: BLE001 - as logging.FileHandler: a failed record is reported, the run goes on
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        finally:
            self.release()
            super().close()


# A full disk met by another handler (wandb's debug log lives in <run_dir>/wandb): noted here for the run to stop
# on, instead of the "--- Logging error ---" traceback logging prints for every record that handler gets from then.
_full_elsewhere: list[DiskFull] = []
_handle_error = logging.Handler.handleError


def _quiet_when_full(handler: logging.Handler, record: logging.LogRecord) -> None:
    error = sys.exc_info()[1]
    if error is not None and is_disk_full(error):
        if not _full_elsewhere:
            where = getattr(handler, "baseFilename", None)
            _full_elsewhere.append(no_space(Path(where), error) if where else
                                   DiskFull(errno.ENOSPC, f"no space left on the device ({error})"))
        return
    _handle_error(handler, record)


@contextlib.contextmanager
def _quiet_logging_errors():
    """`_quiet_when_full` for the span of the block, unless it is in place already (capture_logs keeps it there until
    close)."""
    if logging.Handler.handleError is _quiet_when_full:
        yield
        return
    logging.Handler.handleError = _quiet_when_full
    try:
        yield
    finally:
        logging.Handler.handleError = _handle_error


class RunLog:
    """The console shows progress bars, one line per epoch, what went wrong, and the summary (`info`); the run's
    log file gets those and every detail besides (`detail`, and the libraries' logging once `capture_logs` ran)."""

    def __init__(self, run_dir: Path, config, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        self._file_handler: _RunLogFile | None = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        write_whole(run_dir / "config.json", config.to_json(indent=1))
        if config.logging.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            _full_elsewhere.clear()
            with _quiet_logging_errors():  # wandb starts logging into <run_dir>/wandb before capture_logs
                self.wandb = wandb.init(project=config.logging.wandb_project, name=config.run_name,
                                        dir=str(run_dir), mode=config.logging.wandb_mode, config=config.to_dict(),
                                        resume="allow")
            if _full_elsewhere:
                raise _full_elsewhere[0]

    def config_history(self, history: list[dict]) -> None:
        """config.json with the run's resume history: each resume's changed fields, old and new value."""
        if self.enabled and history:
            data = json.loads((self.run_dir / "config.json").read_text())
            write_whole(self.run_dir / "config.json", json.dumps({**data, "resume_history": history}, indent=1))

    def info(self, msg: str) -> None:
        """A line for the console (and the log file)."""
        if self.enabled:
            tqdm.write(f"[recam] {msg}")  # above a progress bar, never glued onto it
            _file_log.info(msg)
            self.check_space()

    def detail(self, msg: str) -> None:
        """A line for the log file only: setup and per-batch details a person reads when something needs
        explaining."""
        if self.enabled:
            _file_log.info(msg)
            self.check_space()

    def check_space(self) -> None:
        """Raise the DiskFull a log handler met (run.log's, or wandb's debug log), on the run's own thread: logging
        swallows its handlers' errors, and a run whose disk is full must stop, not carry on unlogged."""
        handler = getattr(self, "_file_handler", None)  # None also for a RunLog made without __init__ (tests)
        if handler is None:  # logs not captured: nothing of logging's is this run's to stop on
            return
        full = handler.full or (_full_elsewhere[0] if _full_elsewhere else None)
        if full is not None:
            raise full

    def capture_logs(self, rank: int = 0) -> Path:
        """Route this process's Python logging (INFO and above) to <run_dir>/run.log (run.rank<N>.log on the other
        processes) and leave the console handlers only warnings and errors, so per-batch lines never interleave
        with the progress bars. close() undoes it. Returns the file's path."""
        path = self.run_dir / (LOG_FILE if rank == 0 else f"run.rank{rank}.log")
        path.parent.mkdir(parents=True, exist_ok=True)
        root = logging.getLogger()
        self._console_levels = [(handler, handler.level) for handler in root.handlers]
        for handler in root.handlers:
            handler.setLevel(max(handler.level, logging.WARNING))
        try:
            self._file_handler = _RunLogFile(path)
        except OSError as e:
            if is_disk_full(e):
                raise no_space(path, e) from e
            raise
        root.addHandler(self._file_handler)
        _full_elsewhere.clear()  # a disk still full is met again at the next record, and noted again
        logging.Handler.handleError = _quiet_when_full
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)
        return path

    def _append(self, obj: dict) -> None:
        self.check_space()
        with stop_signals.deferred():  # a record is in the log whole or not at all
            append_whole(self.path, (json.dumps(obj) + "\n").encode("utf-8"))

    def step_record(self, step: int, epoch: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._append({"type": "step", "step": step, "epoch": epoch, **metrics})
        if self.wandb:
            self.wandb.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def epoch_record(self, record: dict) -> None:
        if not self.enabled:
            return
        self._append({"type": "epoch", **record})
        if self.wandb:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.wandb.log(flat, step=record["step"])

    def eval_record(self, tag: str, step: int, summary: dict, epoch: int = -1, checkpoint: str = "",
                    progress: dict | None = None) -> None:
        """An evaluation of the weights in checkpoint folder `checkpoint`; epoch = its last trained epoch (-1 for the
        base), so that truncate_after keeps exactly the evaluations of the weights a resumed run continues from.
        progress: where in the run's budget it was taken (train_seconds, nfe_sampling_total, nfe_training_total),
        for reward-versus-time and reward-versus-NFE curves."""
        if not self.enabled:
            return
        self._append({"type": "eval", "tag": tag, "step": step, "epoch": epoch, "checkpoint": checkpoint, **summary,
                      **(progress or {})})
        if self.wandb:
            self.wandb.log({k: v for k, v in summary.items() if k.startswith(("eval/", "val/"))}, step=step)

    def reference_record(self, step: int, summary: dict) -> None:
        """The rewards of reference samples (recam.engine.evaluation.Evaluator.evaluate_references), once per run."""
        if not self.enabled or not summary:
            return
        self._append({"type": "reference", "step": step, **summary})

    def read_eval(self, tag: str) -> dict | None:
        """A previously logged evaluation (so a resumed run does not re-evaluate its start)."""
        for rec in read_records(self.path):
            if rec.get("type") == "eval" and rec.get("tag") == tag:
                return {k: v for k, v in rec.items() if k not in ("type", "tag", "step", "epoch")}
        return None

    def read_evals(self) -> list[dict]:
        """Every logged evaluation record, in the order taken (the base first)."""
        if not self.path.exists():
            return []
        return [r for r in read_records(self.path) if r.get("type") == "eval"]

    def health_record(self, step: int, epoch: int, findings: list[dict], console: list[str] = ()) -> None:
        """The guard's findings as the engine puts them (recam.engine.health.findings_record), and the lines of them
        the console shows."""
        if not self.enabled:
            return
        self._append({"type": "health", "step": step, "epoch": epoch, "findings": findings})
        for line in console:
            tqdm.write(f"[recam] {line}")

    def truncate_after(self, epoch: int, archive_reason: str | None = None, base_record: dict | None = None) -> None:
        """Drop records of epochs >= `epoch`: written by a run killed before checkpointing them, or rolled back.

        With `archive_reason` the dropped records are appended to rolled_back.jsonl instead of discarded, so a
        rollback stays auditable while metrics.jsonl describes exactly the training that produced the weights.
        Lines that are not UTF-8 JSON objects (a torn last line, stray bytes) are counted, moved verbatim to
        metrics.unreadable, and left out. `base_record`: the base's "start" evaluation record, put first when the
        log has lost it (readers take the first evaluation as the base).
        """
        if not self.enabled or not (self.path.exists() or base_record):
            return
        unreadable: list[bytes] = []
        records = read_records(self.path, unreadable)
        if unreadable:
            append_whole(self.run_dir / "metrics.unreadable", b"".join(line + b"\n" for line in unreadable))
            self.info(f"{self.path}: skipped {len(unreadable)} line(s) that are not UTF-8 JSON records (kept in "
                      f"{self.run_dir / 'metrics.unreadable'})")
        dropped = [r for r in records
                   if r.get("epoch", -1) >= epoch or (r.get("type") == "eval" and r.get("tag") == "final")]
        kept = [r for r in records if not any(r is d for d in dropped)]
        if base_record is not None and not any(r.get("type") == "eval" and r.get("tag") == "start" for r in kept):
            kept.insert(0, base_record)
            self.info(f"{self.path} had lost the base evaluation: restored from the base checkpoint's record")
        archive = self.run_dir / "rolled_back.jsonl"
        size = archive.stat().st_size if archive.exists() else 0
        if archive_reason and dropped:
            append_whole(archive,
                         "".join(json.dumps({**r, "rolled_back": archive_reason}) + "\n" for r in dropped).encode())
        try:
            write_whole(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        except BaseException:  # the records stay in metrics.jsonl: then they must not be in the archive as well
            if archive_reason and dropped:
                with contextlib.suppress(OSError):
                    os.truncate(archive, size)
            raise

    def archive_after(self, epoch: int, reason: str) -> None:
        self.truncate_after(epoch, archive_reason=reason)

    def archive_all(self, reason: str) -> None:
        """Move every record to rolled_back.jsonl (a start with no checkpoint: what it finds in metrics.jsonl
        describes weights that no longer exist), saying so in one line."""
        if self.enabled:
            self.info(f"{self.path} holds records but no checkpoint exists: moved to "
                      f"{self.run_dir / 'rolled_back.jsonl'} ({reason})")
        self.truncate_after(-(2**62), archive_reason=reason)

    def close(self) -> None:
        """Finish wandb and give the console back; a full disk met by the log on the way raises DiskFull."""
        if self.wandb:
            self.wandb.finish()
            self.wandb = None
        full = None
        if self._file_handler is not None:
            full = self._file_handler.full or (_full_elsewhere[0] if _full_elsewhere else None)
            logging.getLogger().removeHandler(self._file_handler)
            self._file_handler.close()
            self._file_handler = None
            logging.Handler.handleError = _handle_error
            _full_elsewhere.clear()
            for handler, level in self._console_levels:  # the console as it was before capture_logs
                handler.setLevel(level)
        if full is not None:
            raise full


def _examples(examples_dirs: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if not examples_dirs:
        return ()
    return (examples_dirs,) if isinstance(examples_dirs, str) else tuple(examples_dirs)


def _run_entries_of(examples_dirs: str | tuple[str, ...] | None) -> tuple[RunEntry, ...]:
    """RUN_ENTRIES with the examples folders of the domains whose runs the folder may hold."""
    return (*RUN_ENTRIES, *(RunEntry(name, True) for name in _examples(examples_dirs)))


def _listed(name: str, entries: tuple[RunEntry, ...]) -> RunEntry | None:
    return next((e for e in entries if fnmatch.fnmatchcase(name, e.pattern)), None)


def run_dir_problem(run_dir: str, examples_dirs: str | tuple[str, ...] | None = None) -> str | None:
    """Why `run_dir` cannot hold a run (one line naming the path and the problem), or None. Checked before the
    folder is created, so a name that cannot be used leaves nothing behind, and before anything is computed: an
    entry of the folder that is not what the run keeps there (a file named `checkpoints`, a folder named
    metrics.jsonl or .summary.md.tmp, a link to nothing, one this user cannot write) would otherwise fail the run
    after its work began, and one that no run writes (a checkout, another tool's output) is not the run's to
    overwrite or archive. examples_dirs: the examples folders (Domain.examples_dir) of this run's domain and of the
    one an earlier run in the folder had. A full disk is raised as itself (the run stops on it with exit status 3,
    not as a config error)."""
    try:
        str(run_dir).encode("utf-8")
    except UnicodeEncodeError:
        return (f"run_dir {str(run_dir).encode('utf-8', 'backslashreplace').decode()} is not valid UTF-8 (the logs "
                "and wandb write UTF-8 paths); choose a UTF-8 name")
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return f"run_dir {path} exists and is not a folder; choose another run_dir"
    problem = _entry_problem(path, examples_dirs) if path.is_dir() else None
    if problem:
        return f"run_dir {problem}: move it aside or choose another run_dir"
    foreign = _foreign_entries(path, examples_dirs) if path.is_dir() else []
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (f"run_dir {path} holds {foreign[0]}{more}, which no recam run writes: a run's folder holds only what "
                "the run writes (not a checkout or another tool's output, which a run would overwrite or archive); "
                "choose an empty folder or an earlier run's")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f"{PROBE}{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if is_disk_full(e):
            raise no_space(path, e) from e
        return f"run_dir {path} cannot be written: {e.strerror or e}"
    return None


def _foreign_entries(path: Path, examples_dirs: str | tuple[str, ...] | None) -> list[Path]:
    """The entries of the folder (and of its checkpoints and archive folders) that no recam run writes."""
    entries = _run_entries_of(examples_dirs)
    foreign = [e for e in sorted(path.iterdir()) if _listed(e.name, entries) is None]
    checkpoints, archive = path / "checkpoints", path / ARCHIVE
    if checkpoints.is_dir() and not foreign:
        foreign = [e for e in sorted(checkpoints.iterdir())
                   if not any(fnmatch.fnmatchcase(e.name, pattern) for pattern in CHECKPOINT_ENTRIES)]
    if archive.is_dir() and not foreign:
        foreign = [e for e in sorted(archive.iterdir()) if not (ARCHIVED_RUN.fullmatch(e.name) and e.is_dir())]
    return foreign


def _entry_problem(path: Path, examples_dirs: str | tuple[str, ...] | None) -> str | None:
    names = sorted(p.name for p in path.iterdir())
    for entry in _run_entries_of(examples_dirs):
        for name in fnmatch.filter(names, entry.pattern):
            kept = entry.kept or f"its {name} {'folder' if entry.folder else 'file'}"
            if problem := _kind_problem(path / name, entry.folder, kept):
                return problem
    if (path / LOCK_FILE).is_symlink():  # taking the lock writes the holder into the file, so through a link
        return f"entry {path / LOCK_FILE} is a link where the run keeps its lock file"
    # A pointer may be a link (the save replaces it, and what a dangling one leaves to resume from is resume's to
    # say), but one that is a folder can be neither read nor replaced: the run would stop on it after its log began.
    for pointer in (path / "checkpoints" / LATEST, path / "checkpoints" / SELECTED):
        if pointer.is_dir() and not pointer.is_symlink():
            return f"entry {pointer} is a folder where the run keeps its {pointer.name} pointer file"
    # the examples folder holds one folder per evaluation (its tag), each holding that evaluation's files: a
    # mismatch there stops the run at its first evaluation, after the base was evaluated and its checkpoint saved
    for examples in (path / name for name in _examples(examples_dirs)):
        for tag in sorted(examples.iterdir()) if examples.is_dir() else []:
            if problem := _kind_problem(tag, True, "one folder per evaluation"):
                return problem
            for entry in sorted(tag.iterdir()) if tag.is_dir() else []:
                if problem := _kind_problem(entry, False, "an evaluation's example files"):
                    return problem
    return None


def _kind_problem(entry: Path, folder: bool, kept: str) -> str | None:
    """Why `entry` cannot be what the run keeps there (a folder when `folder`, else a file), or None."""
    if entry.is_symlink() and not entry.exists():
        return f"entry {entry} is a link to nothing ({os.readlink(entry)}) where the run keeps {kept}"
    if not entry.exists():
        return None
    if entry.is_dir() != folder:
        return f"entry {entry} is a {'file' if folder else 'folder'} where the run keeps {kept}"
    if not os.access(entry, os.W_OK | (os.X_OK if folder else 0)):
        return f"entry {entry} cannot be written by this user (permissions {entry.stat().st_mode & 0o777:o})"
    return None


def run_entries(run_dir: Path, examples_dirs: str | tuple[str, ...] | None = None) -> list[Path]:
    """The entries of `run_dir` that a run wrote and resume=False archives: its checkpoints and records, its logs,
    reports and examples (not the archive itself, nor the lock the starting run holds)."""
    entries = _run_entries_of(examples_dirs)
    return [p for p in sorted(run_dir.iterdir()) if (e := _listed(p.name, entries)) is not None and e.archived]


def archive_run(run_dir: Path, examples_dirs: str | tuple[str, ...] | None = None) -> str | None:
    """A start with resume=False in a folder that holds a run: that run's entries (`run_entries`) are moved into
    <run_dir>/archive/<UTC time>/, so that this run's checkpoints never sit beside the earlier run's (a later resume
    would take theirs) and its log starts empty. Returns the one line that says so, or None when there was nothing
    to move. Renames only, so it needs no space for the data; a rename that fails puts back the ones made before
    it, and the folder is as it was. Called with the folder's lock held (`hold_run_dir`), after run_dir_problem
    found nothing there that a run did not write."""
    entries = run_entries(run_dir, examples_dirs)
    if not entries:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")  # a name for people: wall-clock time
    dest = run_dir / ARCHIVE / stamp
    n = 1
    while dest.exists():  # two starts within one second, or a clock set back
        n += 1
        dest = run_dir / ARCHIVE / f"{stamp}-{n}"
    moved: list[Path] = []
    try:
        dest.mkdir(parents=True)
        for entry in entries:
            os.rename(entry, dest / entry.name)
            moved.append(entry)
    except OSError as e:
        for entry in reversed(moved):
            os.rename(dest / entry.name, entry)
        with contextlib.suppress(OSError):
            dest.rmdir()
        if is_disk_full(e):
            raise no_space(dest, e) from e
        raise
    names = ", ".join(e.name for e in entries)
    return f"resume=False: moved the earlier run in {run_dir} ({names}) to {dest}; this run starts afresh"


class RunDirBusy(Exception):
    """Another process holds the run folder's lock: one line naming the folder and the holder."""


_held: dict[Path, int] = {}  # folder -> the open lock file whose flock this process holds until it exits


def hold_run_dir(run_dir: Path) -> str | None:
    """Take this run's exclusive lock on its folder, held until the process ends: an flock on <run_dir>/LOCK_FILE,
    which the kernel releases when the process dies however it dies (a kill, a crash, os._exit), so a stale lock
    never outlives its run and is never removed by hand. The holder writes its process id and host into the file
    for the refusal to name. Raises RunDirBusy when another process holds it; returns a line to log when the file
    system cannot lock (the run goes on unguarded rather than not at all), else None. Under a multi-process launch
    only the main process calls this: the launch's ranks are one holder."""
    key = run_dir.resolve()
    if key in _held:  # this process holds it already (a second start within one process, as the tests make)
        return None
    lock = run_dir / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if is_disk_full(e):
            raise no_space(lock, e) from e
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            try:
                holder = " ".join(lock.read_text(errors="replace").split()) or "a process that has not named itself yet"
            except OSError:
                holder = "a process that cannot be named"
            raise RunDirBusy(f"run_dir {run_dir} is in use by another run ({holder}, holding {lock}): one run per "
                             "folder; wait for it to end or choose another run_dir") from None
        return f"{lock} cannot be locked ({e.strerror or e}): this file system does not refuse a second run here"
    try:
        os.ftruncate(fd, 0)
        _write_all(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    except OSError as e:
        os.close(fd)
        if is_disk_full(e):
            raise no_space(lock, e) from e
        raise
    _held[key] = fd
    return None


def _chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _where(error: BaseException) -> str:
    """The innermost line of this repository's code in the traceback that ended in `error` (file:line, function):
    what the run was writing when the writer raised without naming its file."""
    root = Path(__file__).resolve().parents[2]
    frames = [f for e in _chain(error) for f in traceback.extract_tb(e.__traceback__)
              if Path(f.filename).resolve().is_relative_to(root)]
    if not frames:
        return type(error).__name__
    return f"{Path(frames[-1].filename).resolve().relative_to(root)}:{frames[-1].lineno}, {frames[-1].name}"


def full_disk_words(error: BaseException, run_dir: Path) -> str:
    """What a run stopped by a full disk says: what could not be written, and which checkpoint a resume takes."""
    full = next((e for e in _chain(error) if isinstance(e, DiskFull)), None)
    where = next((e.filename for e in _chain(error) if getattr(e, "filename", None)), None)
    if full is not None:
        words = full.strerror or str(full)
    elif where:
        words = f"no space left on the device writing {where}"
    else:  # a writer that names no file (torch.save's "unexpected pos 576 vs 534", an image library): where it was
        words = f"no space left on the device (met at {_where(error)})"
    if LATEST not in words and NO_CHECKPOINT_YET not in words:  # a checkpoint's own error says it already
        name = read_pointer(run_dir / "checkpoints")
        words += f"; {run_dir / 'checkpoints' / LATEST} names {name}" if name else f"; {NO_CHECKPOINT_YET}"
    return " ".join(words.split())


def stop_on_full_disk(error: BaseException, run_dir: Path) -> NoReturn:
    """End a run that found its disk full: one line on stderr, exit status 3, and nothing after it.

    The line is printed first; what would follow is only the same full disk again, from whatever still holds a file
    on it: wandb's service and its debug log, logging's handlers flushed at exit, an image writer's finaliser, and
    at worst a crash in a library's teardown (a run was seen to end in a segmentation fault). So standard output and
    error go to /dev/null and the process ends without the interpreter's exit hooks (os._exit). Nothing is lost by
    that: every record was written whole or cut back out, the checkpoint being written was removed, and `latest`
    names the last intact one, which the same command resumes from."""
    line = f"[recam] stopped: {full_disk_words(error, run_dir)}; free space and run the same command to resume"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
    os._exit(3)


def read_records(path: Path, unreadable: list[bytes] | None = None) -> list[dict]:
    """Records of a metrics.jsonl. A line that is not a UTF-8 JSON object (a torn last line of a run killed
    mid-write, stray bytes) is skipped, and appended to `unreadable` when given; it never stops the reading."""
    out = []
    if not path.exists():
        return out
    for line in path.read_bytes().split(b"\n"):  # JSON lines end in \n only; stray \r bytes stay in their line
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        elif unreadable is not None:
            unreadable.append(line)
    return out
