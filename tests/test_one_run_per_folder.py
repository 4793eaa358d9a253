"""One run per folder, and the folder is the run's (issue 64, items 1, 5 and 8): a run holds an flock on its folder
while it runs, and a second start on it is refused in one line (exit 5) before it writes or moves anything; a folder
that holds what no recam run writes (a checkout, another tool's output), or a folder at one of the run's temporary
names, is refused at start (exit 2); resume=False archives only what a run wrote."""

from __future__ import annotations

import fcntl
import fnmatch
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recam.infra import runlog
from recam.infra.runlog import LOCK_FILE, run_dir_problem, run_entries, write_whole
from tests.smoke_runs import ROOT

TOY = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy",
       "--config.eval.freq=100", "--config.logging.wandb_mode=disabled", "--config.num_threads=1"]


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOY, f"--config.run_dir={run_dir}", "--config.num_epochs=1", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _listing(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def _earlier_run(run: Path) -> Path:
    """A folder as an earlier toy run leaves it (its entries' names and kinds; their contents do not matter here)."""
    (run / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (run / "checkpoints" / "epoch_0001" / "state.json").write_text("{}")
    (run / "checkpoints" / "latest").write_text("epoch_0001")
    (run / "plots" / "start").mkdir(parents=True)
    (run / "plots" / "start" / "points.png").write_bytes(b"png")
    (run / "archive" / "20260101T000000Z").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "run.log", "run.rank1.log", "summary.md", "grpo_verification.md",
                 "grpo_verification_rewards.png", "diagnosis.md", "rolled_back.jsonl", ".metrics.jsonl.tmp"):
        (run / name).write_text("{}\n")
    return run


class _Holder:
    """Another run's hold on a folder, as the test process takes it: an flock on the lock file, naming this process."""

    def __init__(self):
        self.fds: list[int] = []

    def hold(self, run: Path) -> str:
        fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        os.write(fd, f"{holder}\n".encode())
        self.fds.append(fd)
        return holder

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(runlog, "_held", {})  # what this test's hold_run_dir calls take is theirs to give back
    holder = _Holder()
    yield holder
    holder.release()
    for fd in runlog._held.values():
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# one run per folder


def test_the_lock_is_refused_while_held_naming_the_holder_and_taken_once_released(tmp_path, held):
    holder = held.hold(tmp_path)
    with pytest.raises(runlog.RunDirBusy) as e:
        runlog.hold_run_dir(tmp_path)
    assert str(e.value) == (f"run_dir {tmp_path} is in use by another run ({holder}, holding {tmp_path / LOCK_FILE}): "
                            "one run per folder; wait for it to end or choose another run_dir")
    # the refused call opened and closed the lock file: unlike a POSIX record lock, an flock survives that
    with pytest.raises(runlog.RunDirBusy):
        runlog.hold_run_dir(tmp_path)
    held.release()
    assert runlog.hold_run_dir(tmp_path) is None
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"


def test_a_crashed_holder_leaves_nothing_to_clean_up(tmp_path, held):
    # the holder is a child process killed outright: the kernel drops its flock with it
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                              f"fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
                              "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, b'pid %d on x' % os.getpid())\n"
                              "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(runlog.RunDirBusy, match=f"pid {child.pid} on x"):
        runlog.hold_run_dir(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert runlog.hold_run_dir(tmp_path) is None
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert runlog.hold_run_dir(tmp_path) is None  # this process holds it already: taken once, not twice


def test_a_second_start_with_resume_false_on_a_held_folder_is_refused_in_one_line_and_moves_nothing(tmp_path, held):
    run = _earlier_run(tmp_path / "run")
    holder = held.hold(run)
    before = _listing(run)
    p = _train(run, "--config.resume=False")
    assert p.returncode == 5, p.stderr[-3000:]
    assert p.stderr.strip() == (f"[recam] run_dir {run} is in use by another run ({holder}, holding "
                                f"{run / LOCK_FILE}): one run per folder; wait for it to end or choose another run_dir")
    assert _listing(run) == before  # resume=False archived nothing of the live run: nothing moved, nothing written


def test_a_real_run_holds_its_folder_until_it_dies(tmp_path, held):
    """A run started as a user starts it holds the lock under its own pid while it runs (what refuses the second
    start above), and a kill releases it with nothing to clean up."""
    run = tmp_path / "run"
    first = subprocess.Popen([*TOY, f"--config.run_dir={run}", "--config.num_epochs=100000"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (run / LOCK_FILE).exists() or f"pid {first.pid} " not in (run / LOCK_FILE).read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            held.hold(run)
        with pytest.raises(runlog.RunDirBusy, match=f"pid {first.pid} on "):
            runlog.hold_run_dir(run)
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()
        first.wait(timeout=60)
    held.hold(run)  # the killed run's lock went with it


# ---------------------------------------------------------------------------------------------------------------
# the run folder is the run's


def test_an_empty_folder_and_an_earlier_run_s_folder_are_accepted(tmp_path):
    assert run_dir_problem(str(tmp_path / "new"), "plots") is None
    assert run_dir_problem(str(tmp_path / "new"), "plots") is None  # now empty
    assert run_dir_problem(str(_earlier_run(tmp_path / "run")), "plots") is None
    # another domain's earlier run: its examples folder is the caller's to name (scripts/train_recam.py reads it)
    (tmp_path / "run" / "videos").mkdir()
    assert run_dir_problem(str(tmp_path / "run"), ("plots", "videos")) is None


@pytest.mark.parametrize("entries, named", [
    (["notes.txt"], "notes.txt"),
    (["results/table.csv"], "results"),
    (["checkpoints/recam_tiny_base/config.json", "checkpoints/motion_grader/config.json"],
     "checkpoints/motion_grader and 1 more"),
    (["archive/old_notes.md"], "archive/old_notes.md"),
    (["videos/start/a.gif"], "videos"),  # the examples folder of a domain neither this run nor the last one had
])
def test_a_folder_holding_what_no_run_writes_is_refused_naming_one(tmp_path, entries, named):
    run = _earlier_run(tmp_path / "run")
    for entry in entries:
        (run / entry).parent.mkdir(parents=True, exist_ok=True)
        (run / entry).write_text("not a run's")
    before = _listing(run)
    said = run_dir_problem(str(run), "plots")
    assert said == (f"run_dir {run} holds {run / named}, which no recam run writes: a run's folder holds only what "
                    "the run writes (not a checkout or another tool's output, which a run would overwrite or "
                    "archive); choose an empty folder or an earlier run's")
    assert _listing(run) == before


@pytest.mark.parametrize("name", [".summary.md.tmp", ".config.json.tmp", ".metrics.jsonl.tmp", ".diagnosis.md.tmp"])
def test_a_folder_at_a_temporary_name_is_refused_at_start(tmp_path, name):
    (tmp_path / name).mkdir()
    said = run_dir_problem(str(tmp_path), "plots")
    written = name.removeprefix(".").removesuffix(".tmp")
    assert said == (f"run_dir entry {tmp_path / name} is a folder where the run keeps the temporary file it writes "
                    f"{written} through: move it aside or choose another run_dir")


def test_every_name_the_project_puts_in_a_run_folder_is_in_the_one_list():
    """The list a folder is held against must grow with the code: a name written under a run_dir (the trainer's,
    the reports', the launchers' console captures) that the list lacks would refuse the next start in that folder."""
    written = {m for path in [*ROOT.glob("recam/**/*.py"), *ROOT.glob("scripts/**/*.py")]
               for m in re.findall(r"\brun_dir\)? / \"([^\"/]+)\"", path.read_text())}
    assert {"metrics.jsonl", "summary.md", "console.log", "bench.log"} <= written  # the search finds them
    entries = [*runlog.RUN_ENTRIES, runlog.RunEntry("videos", True)]  # the camera domain's examples (the caller's)
    assert [name for name in sorted(written) if not any(fnmatch.fnmatchcase(name, e.pattern) for e in entries)] == []


def test_a_lock_file_that_is_a_folder_or_a_link_is_refused_at_start(tmp_path):
    (tmp_path / "a" / LOCK_FILE).mkdir(parents=True)
    assert run_dir_problem(str(tmp_path / "a")) == (f"run_dir entry {tmp_path / 'a' / LOCK_FILE} is a folder where the "
                                                    "run keeps its lock file: move it aside or choose another run_dir")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / LOCK_FILE).symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("not the run's")
    assert run_dir_problem(str(tmp_path / "b")) == (f"run_dir entry {tmp_path / 'b' / LOCK_FILE} is a link where the "
                                                    "run keeps its lock file: move it aside or choose another run_dir")


def test_a_link_at_a_temporary_name_is_replaced_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere.md"
    elsewhere.write_text("not the run's")
    (tmp_path / ".summary.md.tmp").symlink_to(elsewhere)
    write_whole(tmp_path / "summary.md", "the run's")
    assert elsewhere.read_text() == "not the run's" and (tmp_path / "summary.md").read_text() == "the run's"
    assert not (tmp_path / ".summary.md.tmp").is_symlink()


def test_resume_false_archives_what_a_run_wrote_and_leaves_the_lock_and_a_launcher_s_log(tmp_path):
    run = _earlier_run(tmp_path / "run")
    (run / LOCK_FILE).write_text("pid 1 on x\n")
    (run / f"{runlog.PROBE}123").write_text("")
    (run / "console.log").write_text("a launcher's capture, open while the run runs\n")
    assert [p.name for p in run_entries(run, "plots")] == [
        ".metrics.jsonl.tmp", "checkpoints", "config.json", "diagnosis.md", "grpo_verification.md",
        "grpo_verification_rewards.png", "metrics.jsonl", "plots", "rolled_back.jsonl", "run.log", "run.rank1.log",
        "summary.md"]


def test_a_checkout_as_run_dir_with_resume_false_is_refused_in_one_line_and_nothing_moves(tmp_path):
    """The issue's case: --config.run_dir=. in a checkout, then --config.resume=False, moved the repository's own
    checkpoints/ into archive/."""
    checkout = tmp_path / "checkout"
    for entry in ("README.md", "pyproject.toml", "recam/__init__.py", "checkpoints/recam_tiny_base/config.json",
                  "checkpoints/motion_grader/config.json"):
        (checkout / entry).parent.mkdir(parents=True, exist_ok=True)
        (checkout / entry).write_text("the repository's")
    before = _listing(checkout)
    p = _train(checkout, "--config.resume=False")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip() == (f"config error: run_dir {checkout} holds {checkout / 'README.md'} and 2 more, which "
                                "no recam run writes: a run's folder holds only what the run writes (not a checkout "
                                "or another tool's output, which a run would overwrite or archive); choose an empty "
                                "folder or an earlier run's")
    assert _listing(checkout) == before
