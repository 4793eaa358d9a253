"""A full disk (issue 52, item 6): recognised in every form a writer reports it, met by any write of the run (a
checkpoint, metrics.jsonl, run.log, wandb's log, example GIFs, the reports) it ends the run in one line with exit
status 3 and nothing after it, leaves nothing half-written, and the same command resumes once there is space.

Each path is tested twice: with the write made to fail in process (runs everywhere), and on a real small file
system (a tmpfs, which needs root: skipped, saying why, where it cannot be mounted)."""

import contextlib
import errno
import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recam.infra import reports, runlog
from recam.infra.checkpoint import DiskFull, is_disk_full
from recam.infra.runlog import RunLog, read_records
from tests.smoke_runs import ROOT

# a toy run (recam/domains/toy): the whole GRPO loop, checkpoints included, in seconds
TOY = [str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy", "--config.num_threads=1",
       "--config.num_epochs=3", "--config.eval.freq=100"]


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs mounted at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small file system needs root and mount(8) here; the injected version of this test runs")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}); the injected version runs")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk: Path, free: int) -> None:
    """Leave `free` bytes of `disk` (a tmpfs) unused."""
    st = os.statvfs(disk)
    with open(disk / "filler", "ab") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - free)))


@pytest.fixture
def injected(monkeypatch):
    """Every write of the run's folder finds the disk full after `injected.budget` more bytes (the write that
    crosses it writes up to the budget, like a real short write, and the next one fails)."""
    class Full:
        budget = 0

        def __call__(self, fd, data):
            if self.budget <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = os.write(fd, data[: self.budget])
            self.budget -= n
            return n

    full = Full()
    monkeypatch.setattr(runlog, "_write", full)
    return full


def _torch_stream_error() -> RuntimeError:
    """What torch.save raises when its zip writer runs out of space (seen on a full disk: no errno anywhere)."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    error.__context__ = RuntimeError("basic_ios::clear: iostream error")
    return error


def test_a_full_disk_is_recognised_in_every_form_a_writer_reports_it():
    def wrapped(inner):  # a library that catches the OS error and raises its own
        try:
            raise inner
        except Exception as e:  # noqa: BLE001
            try:
                raise ValueError("could not write the file") from e
            except ValueError as outer:
                return outer

    full = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
            _torch_stream_error(), RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
            RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
            RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
            wrapped(OSError(errno.ENOSPC, "No space left on device")), wrapped(_torch_stream_error()),
            DiskFull(errno.ENOSPC, "no space left on the device writing x")]
    for error in full:
        assert is_disk_full(error), repr(error)
    for error in (ValueError("not a disk"), OSError(errno.EACCES, "Permission denied"), RuntimeError("CUDA OOM"),
                  wrapped(KeyError("x")), None):
        assert not is_disk_full(error), repr(error)


def test_each_writer_on_a_real_full_disk_is_recognised(small_disk):
    from safetensors.torch import save_file

    fill(small_disk, 64 * 1024)
    big = torch.zeros(256 * 1024)  # 1 MiB
    for name, write in (("torch.save", lambda: torch.save({"a": big}, small_disk / "t.pt")),
                        ("safetensors", lambda: save_file({"a": big}, small_disk / "t.safetensors")),
                        ("a plain write", lambda: (small_disk / "t.bin").write_bytes(bytes(1 << 20)))):
        with pytest.raises(Exception) as e:  # noqa: B017 - each writer raises its own type
            write()
        assert is_disk_full(e.value), f"{name}: {e.value!r}"


def _log(run_dir: Path) -> RunLog:
    from config import grpo

    config = grpo.get_config("toy")
    config.logging.wandb_mode = "disabled"
    return RunLog(run_dir, config)


def _check_records_are_cut_back(run_dir: Path, make_full):
    log = _log(run_dir)
    log.step_record(1, 0, {"loss": 0.5})
    config_before = (run_dir / "config.json").read_bytes()
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    make_full()
    with pytest.raises(DiskFull, match=f"no space left on the device writing {re.escape(str(log.path))}$"):
        log.epoch_record({"epoch": 0, "step": 1, "advantages": [[0.25] * 64] * 512})  # 200 kB, cut short
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # no torn last line
    make_full()
    with pytest.raises(DiskFull, match="config.json"):
        log.config_history([{"checkpoint": "epoch_0001", "changes": {"run_name": ["toy", "t" * 20000]}}])
    assert (run_dir / "config.json").read_bytes() == config_before
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "metrics.jsonl"]  # no temporary left


def test_a_record_cut_short_by_a_full_disk_is_cut_back_out_injected(tmp_path, injected):
    injected.budget = 10**9
    _check_records_are_cut_back(tmp_path, lambda: setattr(injected, "budget", 4096))


def test_a_record_cut_short_by_a_full_disk_is_cut_back_out(small_disk):
    _check_records_are_cut_back(small_disk / "run", lambda: fill(small_disk, 8192))


def _check_logs_stop_the_run_quietly(run_dir: Path, make_full, capfd):
    import logging

    log = _log(run_dir)
    log.capture_logs()
    # wandb keeps its own log file in the run folder (wandb/.../debug.log), with a handler of its own
    (run_dir / "wandb").mkdir()
    other = logging.FileHandler(run_dir / "wandb" / "debug.log")
    library = logging.getLogger("recam.test.library")
    library.addHandler(other)
    try:
        log.detail("a line before the disk fills")
        make_full()
        for _ in range(3):  # a library logs on: its handler fails each time, and says nothing
            library.warning("a library's line " + "x" * 20000)
        with pytest.raises(DiskFull, match="no space left on the device writing .*(run.log|debug.log)"):
            log.detail("a line after it filled " + "y" * 20000)
        with pytest.raises(DiskFull):
            log.info("the run's own line")
    finally:
        library.removeHandler(other)
        with pytest.raises(DiskFull):
            log.close()
        stream, other.stream = other.stream, None  # what it buffered can never be written: closed, not retried
        with contextlib.suppress(OSError):
            stream.close()
    lines = (run_dir / "run.log").read_text().splitlines()
    assert lines and all(re.match(r"^\d{4}-\d\d-\d\d .* INFO ", line) for line in lines)  # whole lines only
    assert logging.Handler.handleError is runlog._handle_error  # close() gave logging back as it was
    err = capfd.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err


def test_the_logs_on_a_full_disk_stop_the_run_without_a_traceback_injected(tmp_path, injected, capfd, monkeypatch):
    import logging

    injected.budget = 10**9

    def full():
        injected.budget = 0
        # the other handler writes through its own stream: make that one fail too
        monkeypatch.setattr(logging.FileHandler, "flush", _raise_enospc)

    _check_logs_stop_the_run_quietly(tmp_path, full, capfd)


def _raise_enospc(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_the_logs_on_a_full_disk_stop_the_run_without_a_traceback(small_disk, capfd):
    _check_logs_stop_the_run_quietly(small_disk / "run", lambda: fill(small_disk, 0), capfd)


def _check_gifs(out_dir: Path, make_full, capfd):
    n, frames = 2, 4
    video = lambda: torch.rand(n, 3, frames, 32, 32) * 2 - 1  # noqa: E731
    batch = {"source_video": video(), "target_video": video(), "condition_ids": ["scene_0/cam_1", "scene_0/cam_2"]}
    make_full()
    with pytest.raises(DiskFull, match=f"writing {re.escape(str(out_dir))}/scene_0_cam_1.gif"):
        reports.write_comparison_videos(out_dir, batch, video(), n)
    gc.collect()  # an image writer left holding the file would try (and fail) to flush it now
    assert not out_dir.exists() or list(out_dir.iterdir()) == []  # no half-written GIF, no temporary
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


def test_example_gifs_on_a_full_disk_leave_nothing_half_written_injected(tmp_path, injected, capfd):
    _check_gifs(tmp_path / "videos", lambda: setattr(injected, "budget", 100), capfd)


def test_example_gifs_on_a_full_disk_leave_nothing_half_written(small_disk, capfd):
    (small_disk / "videos").mkdir()
    _check_gifs(small_disk / "videos", lambda: fill(small_disk, 0), capfd)


def test_reports_that_meet_a_full_disk_are_removed_not_left_half_written(tmp_path, monkeypatch):
    report, plot = tmp_path / "grpo_verification.md", tmp_path / "grpo_verification_rewards.png"

    def verifier(name, argv):  # the verifier keeps going when a write fails: it prints the report instead
        report.write_text("# GRPO verifica")
        plot.write_bytes(b"\x89PNG")
        return 0, "GRPO verification of x: PASS (0 failing)\nreport not written ([Errno 28] No space left on device)"

    monkeypatch.setattr(reports, "run_script", verifier)
    with pytest.raises(DiskFull, match="grpo_verification.md"):
        reports.write_reports(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# end to end: scripts/train_recam.py

# Fills the small disk at a chosen point of the run (sys.argv: disk, bytes left, when, marker file, then the run's
# command): "line:<prefix>" after the console line starting with it, "record:<type> <epoch>" before that record is
# appended. The error the run stopped on goes to the marker file, its cause chain one line each.
FILL_AND_RUN = """
import os, runpy, sys
from pathlib import Path
disk, free, when, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.argv = sys.argv[5:]
from recam.infra import runlog
def fill():
    st = os.statvfs(disk)
    with open(os.path.join(disk, "filler"), "ab") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - free)))
info, append = runlog.RunLog.info, runlog.RunLog._append
stop = getattr(runlog, "stop_on_full_disk", None)  # absent before issue 52: the run then stops as it did
def info_then_fill(self, msg):
    info(self, msg)
    if when == "line:" + msg[:len(when) - 5]:
        fill()
def fill_then_append(self, obj):
    if when == f"record:{obj.get('type')} {obj.get('epoch')}":
        fill()
    append(self, obj)
def recorded_stop(error, run_dir):
    chain, e = [], error
    while e is not None:
        chain.append(f"{type(e).__name__}: {' '.join(str(e).split())}")
        e = e.__cause__ or e.__context__
    Path(marker).write_text("\\n".join(chain))
    stop(error, run_dir)
runlog.RunLog.info, runlog.RunLog._append = info_then_fill, fill_then_append
if stop is not None:
    runlog.stop_on_full_disk = recorded_stop
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _train(run_dir: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *prefix, *TOY, f"--config.run_dir={run_dir}", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _stderr_after_progress_bars(stderr: str) -> list[str]:
    """stderr's lines less tqdm's progress bars (drawn with carriage returns) and their blank clean-ups."""
    return [x for x in re.split(r"[\r\n]", stderr) if x.strip() and not re.search(r"\d+%\|", x)]


def _check_one_line_stop(p: subprocess.CompletedProcess, run_dir: Path, words: str, latest: str):
    assert p.returncode == 3, p.stderr[-3000:]
    lines = _stderr_after_progress_bars(p.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"[recam] stopped: no space left on the device writing {words}") \
        and lines[0].endswith("free space and run the same command to resume"), p.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == latest and not list(ckpts.glob(".tmp-*")), lines[0]
    assert "latest" in lines[0] and latest in lines[0]
    unreadable: list[bytes] = []  # every record whole: the next start reads them all, with nothing to move aside
    assert read_records(run_dir / "metrics.jsonl", unreadable) and unreadable == []
    assert not list(run_dir.rglob(".*.tmp"))
    return lines[0]


def test_a_full_disk_mid_run_ends_in_one_line_and_the_same_command_resumes(small_disk, tmp_path):
    """With wandb logging offline into the run folder. First the checkpoint's trainer state does not fit (300 kB
    left: the weights, 145 kB, do), where torch.save says only that its stream failed; then, resumed with space
    freed, the disk fills completely before an epoch record: metrics.jsonl, run.log and wandb all fail at once."""
    run_dir = small_disk / "run"
    marker = tmp_path / "stopped_on"
    wandb = "--config.logging.wandb_mode=offline"
    p = _train(run_dir, wandb, prefix=("-c", FILL_AND_RUN, str(small_disk), "300000", "line:epoch 1 step",
                                       str(marker)))
    line = _check_one_line_stop(p, run_dir, f"checkpoint {run_dir / 'checkpoints' / 'epoch_0002'}", "epoch_0001")
    assert "still names epoch_0001" in line
    writer_said = marker.read_text()
    # the writer's own error, whatever writes the trainer state: torch's stream error or safetensors' message
    assert re.search(r"unexpected pos|basic_ios|file write failed|os error 28|No space left", writer_said), writer_said
    (small_disk / "filler").unlink()

    p = _train(run_dir, wandb, prefix=("-c", FILL_AND_RUN, str(small_disk), "0", "record:epoch 2", str(marker)))
    assert f"resumed from {run_dir / 'checkpoints' / 'epoch_0001'}" in p.stdout, p.stdout[-3000:]
    _check_one_line_stop(p, run_dir, str(run_dir / "metrics.jsonl"), "epoch_0002")
    assert [r["epoch"] for r in read_records(run_dir / "metrics.jsonl") if r["type"] == "epoch"] == [0, 1]


# the trainer state's write fails as torch.save does on a full disk: part of it written, then a stream error
STREAM_ERROR_AT_SECOND_SAVE = """
import runpy, sys
import recam.infra.checkpoint as c
write, calls = c.write_model, []
def full(model, directory):
    calls.append(directory)
    if len(calls) == 2:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "diffusion_pytorch_model.safetensors").write_bytes(b"0" * 64)
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    return write(model, directory)
c.write_model = full
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_torch_save_s_stream_error_ends_in_one_line_with_exit_3_injected(tmp_path):
    run_dir = tmp_path / "run"
    p = _train(run_dir, "--config.logging.wandb_mode=disabled", prefix=("-c", STREAM_ERROR_AT_SECOND_SAVE))
    line = _check_one_line_stop(p, run_dir, f"checkpoint {run_dir / 'checkpoints' / 'epoch_0001'}", "epoch_0000")
    assert "Traceback" not in p.stderr and "unexpected pos" not in line


def _check_stick_figures(out_dir: Path, make_full):
    from recam.domains.motion.domain import stick_figure_gif

    motion = torch.randn(12, 22, 3) * 0.3
    make_full()
    with pytest.raises(DiskFull, match=f"writing {re.escape(str(out_dir / 'walk.gif'))}$"):
        stick_figure_gif(out_dir / "walk.gif", [motion, motion], ["reference", "generated"], "a person walks")
    assert list(out_dir.iterdir()) == []


def test_the_motion_domain_s_gifs_on_a_full_disk_leave_nothing_half_written_injected(tmp_path, monkeypatch):
    from matplotlib.animation import PillowWriter

    from recam.domains.motion.domain import stick_figure_gif

    (tmp_path / "ok").mkdir()  # with space: the GIF, and nothing beside it
    written = stick_figure_gif(tmp_path / "ok" / "walk.gif", [torch.zeros(4, 22, 3)], ["reference"], "stands")
    assert written.read_bytes().startswith(b"GIF8") and [p.name for p in written.parent.iterdir()] == ["walk.gif"]

    def full(self):  # part of the GIF written, then the device is full
        Path(self.outfile).write_bytes(b"GIF89a")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(PillowWriter, "finish", full)
    (tmp_path / "full").mkdir()
    _check_stick_figures(tmp_path / "full", lambda: None)


def test_the_motion_domain_s_gifs_on_a_full_disk_leave_nothing_half_written(small_disk):
    (small_disk / "motions").mkdir()
    _check_stick_figures(small_disk / "motions", lambda: fill(small_disk, 0))


# write permission taken away mid-run (a quota's read-only switch, a remount, a chmod by a cleanup job): the second
# checkpoint's weights are refused. As root a real chmod does not stop a write, so the refusal is injected.
DENIED_AT_SECOND_SAVE = """
import errno, runpy, sys
import recam.infra.checkpoint as c
write, calls = c.write_model, []
def denied(model, directory):
    calls.append(directory)
    if len(calls) == 2:
        raise PermissionError(errno.EACCES, "Permission denied", str(directory))
    return write(model, directory)
c.write_model = denied
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_write_permission_lost_mid_run_ends_in_one_line_naming_what_resumes_injected(tmp_path):
    run_dir = tmp_path / "run"
    p = _train(run_dir, "--config.logging.wandb_mode=disabled", prefix=("-c", DENIED_AT_SECOND_SAVE))
    assert p.returncode == 3, p.stderr[-3000:]
    lines = _stderr_after_progress_bars(p.stderr)
    ckpts = run_dir / "checkpoints"
    assert lines == [f"[recam] stopped: cannot write {ckpts / '.tmp-epoch_0001' / 'model'} (Permission denied): the "
                     f"last intact checkpoint is {ckpts / 'epoch_0000'}; restore write permission and run the same "
                     "command to resume"], p.stderr[-3000:]
    # what the same command resumes from is whole: `latest` names it, nothing half-written beside it, every record
    # whole (a resume from an intact `latest` is the full disk's test above)
    assert (ckpts / "latest").read_text() == "epoch_0000" and not list(ckpts.glob(".tmp-*"))
    unreadable: list[bytes] = []
    assert read_records(run_dir / "metrics.jsonl", unreadable) and unreadable == []
