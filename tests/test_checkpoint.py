import json

import pytest

from recam.engine.health import SAMPLE_RULES, diagnose_step
from recam.infra.checkpoint import (
    LATEST,
    SELECTED,
    CheckpointCorrupt,
    check_pointers,
    checkpoint_before,
    latest_checkpoint,
    point,
    point_latest,
    pointed_checkpoint,
    read_pointer,
)


def _ckpt(root, epoch, intact=True):
    d = root / f"epoch_{epoch:04d}"
    d.mkdir(parents=True)
    if intact:
        (d / "state.json").write_text(json.dumps({"epoch": epoch}))
    return d


def test_checkpoint_before_skips_the_weights_that_drew_a_collapsed_epoch(tmp_path):
    # epoch_NNNN holds the weights that sample epoch NNNN: a reward collapse seen in epoch 2 condemns epoch_0002
    for e in (0, 1, 2):
        _ckpt(tmp_path, e)
    point_latest(tmp_path, "epoch_0002")
    assert latest_checkpoint(tmp_path).name == "epoch_0002"
    assert checkpoint_before(tmp_path, 2).name == "epoch_0001"
    assert checkpoint_before(tmp_path, 1).name == "epoch_0000"
    assert checkpoint_before(tmp_path, 0) is None
    point_latest(tmp_path, "epoch_0001")
    assert latest_checkpoint(tmp_path).name == "epoch_0001"
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("content", [b"", b"\n", b"\xff\xfe\x00garbled", b"epoch_00", b"../epoch_0004", b"epoch_0004x"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_folder_and_is_named(tmp_path, content):
    for e in (0, 3, 4):
        _ckpt(tmp_path, e)
    (tmp_path / "epoch_best").mkdir()
    (tmp_path / LATEST).write_bytes(content)
    said = []
    assert read_pointer(tmp_path) == ("epoch_00" if content == b"epoch_00" else None)  # well-formed, not there
    assert pointed_checkpoint(tmp_path, said.append) == tmp_path / "epoch_0004"
    assert len(said) == 1 and str(tmp_path / LATEST) in said[0] and "epoch_0004" in said[0]
    assert latest_checkpoint(tmp_path) == tmp_path / "epoch_0004"  # not "holds no state.json" about the root


def test_a_sound_pointer_is_read_as_it_is_and_none_without_one(tmp_path):
    assert pointed_checkpoint(tmp_path) is None
    for e in (0, 1):
        _ckpt(tmp_path, e)
    (tmp_path / LATEST).write_text("epoch_0000\n")
    said = []
    assert read_pointer(tmp_path) == "epoch_0000"
    assert pointed_checkpoint(tmp_path, said.append) == tmp_path / "epoch_0000" and said == []


def test_a_damaged_pointer_with_no_folder_beside_it_is_an_error_naming_it(tmp_path):
    (tmp_path / LATEST).write_bytes(b"")
    with pytest.raises(CheckpointCorrupt, match="latest names no epoch_NNNN"):
        pointed_checkpoint(tmp_path)


def test_checkpoint_before_ignores_incomplete_folders_and_other_names(tmp_path):
    _ckpt(tmp_path, 0)
    _ckpt(tmp_path, 1, intact=False)  # a crash mid-write leaves no state.json
    (tmp_path / "epoch_best").mkdir()
    assert checkpoint_before(tmp_path, 2).name == "epoch_0000"


def test_reward_findings_and_only_they_send_a_rollback_past_latest():
    base = {"step": 5, "epoch": 1, "loss": 0.01, "mean_ratio": 1.0, "zero_std_ratio": 0.0, "std_reward": 0.1}
    history = [{**base, "step": 4, "epoch": 0, "mean_reward": 0.6, "reward_cam_score": 0.2}]
    collapsed = diagnose_step({**base, "mean_reward": 0.1, "reward_cam_score": 0.01}, history)
    assert {f.rule for f in collapsed} and {f.rule for f in collapsed} <= SAMPLE_RULES
    blown = diagnose_step({**base, "mean_ratio": 50.0, "mean_reward": 0.6, "reward_cam_score": 0.2}, history)
    assert blown and not ({f.rule for f in blown} & SAMPLE_RULES)  # a bad step is caught before it is applied


def test_a_latest_kept_as_a_link_to_a_folder_beside_it_is_followed_and_replaced_by_a_file(tmp_path):
    for e in (0, 1):
        _ckpt(tmp_path, e)
    (tmp_path / LATEST).symlink_to("epoch_0000", target_is_directory=True)
    said = []
    assert read_pointer(tmp_path) == "epoch_0000"
    assert pointed_checkpoint(tmp_path, said.append) == tmp_path / "epoch_0000" and said == []
    point_latest(tmp_path, "epoch_0001")  # the rename replaces the link, not the folder it names
    assert not (tmp_path / LATEST).is_symlink() and (tmp_path / LATEST).read_text() == "epoch_0001"
    assert (tmp_path / "epoch_0000" / "state.json").exists()


def test_a_latest_linking_outside_its_folder_is_a_damaged_pointer(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _ckpt(elsewhere, 7)
    root = tmp_path / "checkpoints"
    for e in (0, 1):
        _ckpt(root, e)
    (root / LATEST).symlink_to(elsewhere / "epoch_0007", target_is_directory=True)
    said = []
    assert read_pointer(root) is None
    assert pointed_checkpoint(root, said.append) == root / "epoch_0001"
    assert len(said) == 1 and f"it links to {elsewhere / 'epoch_0007'}" in said[0]


@pytest.mark.parametrize("pointer", [LATEST, SELECTED])
def test_a_pointer_that_is_a_folder_is_refused_in_one_line_naming_it(tmp_path, pointer):
    _ckpt(tmp_path, 0)
    (tmp_path / pointer).mkdir()
    with pytest.raises(CheckpointCorrupt) as e:
        check_pointers(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / pointer} is a folder") and "move it out" in message and "\n" not in message
    with pytest.raises(CheckpointCorrupt, match="is a folder"):
        point(tmp_path, pointer, "epoch_0000")
    if pointer == LATEST:
        with pytest.raises(CheckpointCorrupt, match="is a folder"):
            pointed_checkpoint(tmp_path)
    assert (tmp_path / pointer).is_dir() and not list(tmp_path.glob(".*tmp"))  # nothing of it touched
