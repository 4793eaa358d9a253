"""The run folder and what a resume may change (issue 52, items 7-9): entries of the folder that are not what the run
keeps there end the start in one line before anything is written; resume=False archives the earlier run, and a
later resume sees only the new one; a resume refuses what changes the run's numbers (a newly weighted reward
among them) and says so of a mutable field that still moves them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.resume import MUTABLE, differences, refusal, statement, why_mutable
from recam.infra import runlog
from recam.infra.runlog import read_records, run_dir_problem
from tests.smoke_runs import ROOT

NOT_RECORDED = "(not recorded)"  # config.resume.NOT_RECORDED: what a config without the field shows
TOY = [str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy", "--config.num_epochs=1",
       "--config.eval.freq=100"]


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *TOY, f"--config.run_dir={run_dir}", *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _listing(folder: Path) -> dict[str, bytes | None]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


# ---------------------------------------------------------------------------------------------------------------
# item 9: entries that are not what they should be


@pytest.mark.parametrize("entry, make, problem", [
    ("checkpoints", lambda p: p.write_text(""), "is a file where the run keeps its checkpoints folder"),
    ("metrics.jsonl", lambda p: p.mkdir(), "is a folder where the run keeps its metrics.jsonl file"),
    ("run.log", lambda p: p.mkdir(), "is a folder where the run keeps its run.log file"),
    ("config.json", lambda p: p.mkdir(), "is a folder where the run keeps its config.json file"),
    ("videos", lambda p: p.write_text(""), "is a file where the run keeps its videos folder"),
    ("wandb", lambda p: p.symlink_to(p.parent / "gone"), "is a link to nothing ("),
    ("archive", lambda p: p.write_text(""), "is a file where the run keeps its archive folder"),
    ("grpo_verification_rewards.png", lambda p: p.mkdir(), "is a folder where the run keeps its "
                                                           "grpo_verification_rewards.png file"),
    ("checkpoints/latest", lambda p: p.mkdir(), "is a folder where the run keeps its latest pointer file"),
    ("checkpoints/selected", lambda p: p.mkdir(), "is a folder where the run keeps its selected pointer file"),
    ("videos/start", lambda p: p.write_text(""), "is a file where the run keeps one folder per evaluation"),
    ("videos/final", lambda p: p.symlink_to(p.parent / "gone"), "is a link to nothing ("),
    ("videos/start/scene_0_cam_1.gif", lambda p: p.mkdir(), "is a folder where the run keeps an evaluation's "
                                                            "example files"),
])
def test_an_entry_that_is_not_what_the_run_keeps_there_is_named_before_anything_is_written(tmp_path, entry, make,
                                                                                          problem):
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    make(tmp_path / entry)
    before = _listing(tmp_path)
    said = run_dir_problem(str(tmp_path), "videos")
    assert said is not None and said.startswith(f"run_dir entry {tmp_path / entry} ") and problem in said, said
    assert said.endswith("move it aside or choose another run_dir") and "\n" not in said
    assert _listing(tmp_path) == before  # no probe, no folder made


def test_a_pointer_kept_as_a_link_and_examples_as_the_run_writes_them_are_not_refused(tmp_path):
    (tmp_path / "checkpoints" / "epoch_0001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").symlink_to(tmp_path / "checkpoints" / "epoch_0001")
    (tmp_path / "checkpoints" / "selected").symlink_to(tmp_path / "checkpoints" / "epoch_0000")  # resume's to judge
    (tmp_path / "videos" / "start").mkdir(parents=True)
    (tmp_path / "videos" / "start" / "scene_0_cam_1.gif").write_bytes(b"GIF89a;")
    assert run_dir_problem(str(tmp_path), "videos") is None


def test_an_entry_this_user_cannot_write_is_named(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("")
    real = os.access
    monkeypatch.setattr(runlog.os, "access", lambda p, mode: Path(p).name != "metrics.jsonl" and real(p, mode))
    said = run_dir_problem(str(tmp_path))
    assert said == (f"run_dir entry {tmp_path / 'metrics.jsonl'} cannot be written by this user (permissions 644): "
                    "move it aside or choose another run_dir")


@pytest.mark.parametrize("entry, make, kind", [("checkpoints", lambda p: p.write_text("x"), "file"),
                                               ("metrics.jsonl", lambda p: p.mkdir(), "folder"),
                                               ("checkpoints/latest", lambda p: p.mkdir(), "folder"),
                                               ("plots/start/points.png", lambda p: p.mkdir(), "folder")])
def test_a_start_in_such_a_folder_ends_in_one_line_with_exit_2_and_writes_nothing(tmp_path, entry, make, kind):
    (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
    make(tmp_path / entry)
    before = _listing(tmp_path)
    p = _train(tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"config error: run_dir entry {tmp_path / entry} is a {kind}")
    assert _listing(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------------
# item 7: what a resume may change


def test_a_reward_the_run_did_not_weight_is_refused_like_any_change_of_the_rewards():
    old = {"reward": {"weights": {"target": 1.0}}}
    allowed, refused = differences(old, {"reward": {"weights": {"target": 1.0, "near": 0.5}}})
    assert allowed == [] and refused == [("reward.weights.near", 0.0, 0.5)]  # unlisted = weight 0: not computed
    assert "reward.weights.near is 0.5 here but 0.0 in the run" in refusal(refused, Path("run_config.json"))
    # weight 0 is what the run had: no change at all; a weight the run had, dropped, is a change
    assert differences(old, {"reward": {"weights": {"target": 1.0, "near": 0.0}}}) == ([], [])
    assert differences({"reward": {"weights": {"target": 1.0, "near": 0.5}}}, old)[1] == [
        ("reward.weights.near", 0.5, 0.0)]


def test_a_field_the_run_does_not_record_is_taken_only_at_the_preset_s_default():
    old, defaults = {"train": {"beta": 0.01}}, {"train": {"beta": 0.01, "new_knob": 3}}
    at_default = differences(old, {"train": {"beta": 0.01, "new_knob": 3}}, defaults)
    assert at_default == ([("train.new_knob", NOT_RECORDED, 3)], [])
    assert statement("train.new_knob", NOT_RECORDED, 3).endswith("a field the run does not record (added to the "
                                                                 "code since), at its default")
    changed = differences(old, {"train": {"beta": 0.01, "new_knob": 4}}, defaults)
    assert changed == ([], [("train.new_knob", NOT_RECORDED, 4)])
    assert "train.new_knob is 4 here but the run does not record it" in refusal(changed[1], Path("x"))
    removed = differences({"train": {"beta": 0.01, "old_knob": 1}}, {"train": {"beta": 0.01}}, defaults)
    assert removed == ([("train.old_knob", 1, NOT_RECORDED)], [])


def test_mutable_fields_are_the_ones_that_leave_the_run_s_numbers_alone_or_say_so():
    # harmless: allowed (they were refused)
    for field in ("data.cache_size", "model.gradient_checkpointing", "reward.cam.sfm.timeout_s",
                  "eval.report_rewards"):
        assert why_mutable(field), field
    # they change what is trained: refused (they were allowed under "debug.")
    for field in ("debug.fail_reward_slots", "debug.inject_blowup_at_step", "reward.weights.cam_score"):
        assert why_mutable(field) is None, field
    assert why_mutable("debug.sigkill_at_step")  # the kill itself: the run up to it is the unchanged run
    # allowed, and the one-line notice says the numbers move
    assert "not bit-identical" in statement("num_threads", 1, 2)
    assert "training is unchanged" in statement("eval.batch_size", 16, 8)
    assert "not bit-identical" in statement("reward.cam.sfm.threads_per_worker", 1, 4)
    # one section stays whole: where the logs go moves nothing the run computes
    assert [m for m in MUTABLE if m.endswith(".")] == ["logging."]


def test_model_gradient_checkpointing_gives_the_same_gradients_bit_for_bit():
    """Why model.gradient_checkpointing may change on resume: the camera model's gradients are identical."""
    import torch

    from recam.domains.camera.model import ReCamTransformer3DModel

    base = ROOT / "checkpoints" / "recam_tiny_base"
    if not (base / "config.json").exists():
        pytest.skip("base checkpoint checkpoints/recam_tiny_base not present")

    def gradients(checkpointing: bool):
        model = ReCamTransformer3DModel.from_pretrained(base).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, 8, 32, 32, generator=g)
        cams = torch.eye(3, 4).expand(1, 8, 3, 4).contiguous()
        model(x, torch.tensor([0.7]), x, cams, cams).pow(2).mean().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    plain, recomputed = gradients(False), gradients(True)
    assert len(plain) == len(recomputed) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


# ---------------------------------------------------------------------------------------------------------------
# items 8 and 7 end to end: resume=False archives the earlier run; a later resume continues the new one


def test_resume_false_archives_the_earlier_run_and_a_later_resume_sees_only_the_new_one(tmp_path):
    run = tmp_path / "run"
    p = _train(run, "--config.num_epochs=2")
    assert p.returncode == 0, p.stderr[-3000:]
    earlier = {name: data for name, data in _listing(run).items() if name != runlog.LOCK_FILE}  # the lock stays

    p = _train(run, "--config.resume=False")
    assert p.returncode == 0, p.stderr[-3000:]
    (archive,) = (run / "archive").iterdir()
    said = [line for line in p.stdout.splitlines() if "resume=False" in line]
    assert said == [f"[recam] resume=False: moved the earlier run in {run} ({', '.join(sorted(n for n in earlier if '/' not in n))}) to {archive}; this run starts afresh"]  # noqa: E501
    assert "holds records but no checkpoint exists" not in p.stdout
    assert _listing(archive) == earlier  # the earlier run whole, byte for byte
    assert [r["epoch"] for r in read_records(run / "metrics.jsonl") if r["type"] == "epoch"] == [0]
    assert (run / "checkpoints" / "latest").read_text() == "epoch_0001"
    assert not (run / "checkpoints" / "epoch_0002").exists()

    # the new run, resumed: from its own checkpoint, with a thread count that says the numbers move
    p = _train(run, "--config.num_epochs=2", "--config.num_threads=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'epoch_0001'} at epoch 1" in p.stdout
    assert "resuming with num_threads 1 -> 2: CPU threads per process (float sums" in p.stdout
    assert [r["epoch"] for r in read_records(run / "metrics.jsonl") if r["type"] == "epoch"] == [0, 1]

    # a reward the run never weighted: refused in one line, nothing written
    before = _listing(run)
    p = _train(run, "--config.num_epochs=3", "--config.reward.weights.near=0.5")
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "reward.weights.near is 0.5 here but 0.0 in the run" in err, err
    # the lock file names the last process that held the folder: this one, refused once it held it
    assert {**_listing(run), runlog.LOCK_FILE: None} == {**before, runlog.LOCK_FILE: None}
    assert json.loads((run / "config.json").read_text())["resume_history"][0]["changes"]["num_threads"] == [1, 2]
