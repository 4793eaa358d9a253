"""Checkpoints that cannot run code, and nothing in one trusted before it is verified (issue 52, items 2-5).

A checkpoint folder is anyone's to write: its files are parsed (safetensors, JSON), never executed; its manifest
names only files inside it; links are followed only where that is safe; a folder saved again never fails halfway.
Tiny in-process model with AdamW and EMA, as in test_checkpoint_integrity.py."""

import builtins
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from recam.infra.checkpoint import (
    DISPLACED,
    LEGACY_TRAINER,
    MANIFEST,
    TRAINER_STATE,
    TRAINER_TENSORS,
    TRUST_LEGACY,
    CheckpointCorrupt,
    LegacyCheckpoint,
    convert_legacy,
    convert_legacy_folders,
    decode_tree,
    encode_tree,
    read_checkpoint,
    read_intact,
    read_trainer_state,
    remove_leftovers,
    resumable_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from tests.test_checkpoint_integrity import BASE, WEIGHTS, _legacy, _pickled, _reseal, _save, _sha, _trained


def _same(a, b) -> bool:
    """Equal values of equal types, all the way down (tensors: same dtype, shape and bits)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _is_pickle(data: bytes) -> bool:
    # torch.save writes a zip holding data.pkl; a bare pickle starts with the PROTO opcode
    return data[:2] == b"PK" or data[:1] == b"\x80"


# ---------------------------------------------------------------------------------------------------------------
# 2. nothing recam loads from a checkpoint is a pickle


def test_a_checkpoint_holds_no_pickle_and_its_trainer_state_comes_back_with_exact_types_and_bits(tmp_path):
    model, opt, ema = _trained()
    torch.manual_seed(5)
    np.random.seed(6)
    random.seed(7)
    saved_rng = rng_state()
    # what each generator draws next, computed before the save: the restored states must draw the same
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    set_rng_state(saved_rng)
    ckpt = _save(tmp_path, 1, model, opt, ema)
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert LEGACY_TRAINER not in files and not [f for f in files if _is_pickle((ckpt / f).read_bytes())]
    assert {TRAINER_TENSORS, TRAINER_STATE} <= set(files) and verify_checkpoint(ckpt)

    got = read_checkpoint(ckpt, model)
    assert _same(got.trainer["optimizer"], opt.state_dict())  # int keys, Adam's betas tuple, step tensors
    assert _same(got.trainer["ema"], ema.state_dict())
    assert _same(got.trainer["rng"]["python"], saved_rng["python"])
    assert _same(got.trainer["rng"]["numpy"], saved_rng["numpy"])
    assert torch.equal(got.trainer["rng"]["torch"], saved_rng["torch"])
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    set_rng_state(got.trainer["rng"])
    drawn = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]
    # an optimizer loaded from it steps to the same bits as the one that was saved
    fresh_model, _, _ = _trained(seed=3)
    fresh_model.load_state_dict(model.state_dict())
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(got.trainer["optimizer"])
    for m, o in ((model, opt), (fresh_model, fresh)):
        torch.manual_seed(11)
        m(torch.randn(3, 6)).pow(2).mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True))


def test_the_tree_encoding_keeps_keys_tags_and_shared_tensors_apart():
    base = torch.arange(6.0)
    value = {"$tensor": "not a tag", 3: (1, 2.5, None), "views": [base[:3], base[3:], base], "s": "x",
             "a": np.arange(4, dtype=np.uint32), "nested": {"k": [True, {"$items": 1}]}}
    skeleton, tensors = encode_tree(value)
    json.dumps(skeleton)  # plain JSON
    from safetensors.torch import load, save
    back = decode_tree(json.loads(json.dumps(skeleton)), load(save(tensors)))
    assert _same(back, value)
    for bad in ({"$tensor": "absent"}, {"$eval": "1"}, {"$tuple": [1], "x": 2},
                {"$ndarray": {"dtype": "object", "shape": [1], "data": [1]}}, {"$items": [[1.5, 2]]}):
        with pytest.raises(ValueError):
            decode_tree(bad, {})


class _Payload:
    """A pickle that, when loaded, writes a marker file: what a crafted trainer.pt would do with a shell."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.mark.parametrize("layout", ["resealed", "no_manifest"])
@pytest.mark.parametrize("trust", [False, True], ids=["refused", "trusted"])
def test_a_pickle_payload_in_trainer_pt_is_never_executed(tmp_path, layout, trust):
    model, opt, ema = _trained()
    _save(tmp_path, 1, model, opt, ema)
    ckpt = _save(tmp_path, 2, model, opt, ema)
    marker = tmp_path / "marker"
    (_pickled if layout == "resealed" else _legacy)(ckpt, payload=_Payload(marker))
    if layout == "resealed":
        assert verify_checkpoint(ckpt)  # its checksums agree: the manifest alone cannot tell
    lines = []
    if not trust:
        with pytest.raises(LegacyCheckpoint) as e:
            read_intact(tmp_path, ckpt, model, lines.append)
        message = str(e.value)
        assert str(ckpt / LEGACY_TRAINER) in message and TRUST_LEGACY in message and "\n" not in message
    else:  # even trusted, a pickle holding more than tensors and plain data is refused; the run falls back
        got = read_intact(tmp_path, ckpt, model, lines.append, trust_legacy=True)
        assert got.path.name == "epoch_0001" and not got.legacy
        assert len(lines) == 1 and str(ckpt / LEGACY_TRAINER) in lines[0] and "it names exec, which" in lines[0]
    assert not marker.exists()


def test_a_legacy_checkpoint_is_converted_once_with_the_flag_and_then_reads_without_it(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    trainer = _pickled(ckpt)
    kept = {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()
            and p.name not in (LEGACY_TRAINER, MANIFEST, "state.json")}
    got = read_intact(tmp_path, ckpt, model, print, trust_legacy=True)
    assert got.legacy and got.verified and _same(got.trainer, trainer)
    convert_legacy(ckpt, got.trainer)
    assert not (ckpt / LEGACY_TRAINER).exists() and verify_checkpoint(ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0001", "latest"]  # nothing left beside it
    assert {rel: (ckpt / rel).read_bytes() for rel in kept} == kept  # weights and side files byte for byte
    assert json.loads((ckpt / "state.json").read_text())["checkpoint_format"] == 2
    again = read_checkpoint(ckpt, model)  # no flag needed any more
    assert not again.legacy and _same(again.trainer, trainer)
    assert again.state == {**got.state, "checkpoint_format": 2}


def test_a_manifest_less_legacy_checkpoint_is_sealed_by_its_conversion(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    trainer = _legacy(ckpt)
    got = read_checkpoint(ckpt, model, trust_legacy=True)
    assert not got.verified and got.legacy
    convert_legacy(ckpt, got.trainer)
    assert verify_checkpoint(ckpt) and _same(read_trainer_state(ckpt), trainer)


def test_a_trusted_run_folder_has_every_legacy_checkpoint_converted_and_a_payload_left_unrun(tmp_path):
    """The checkpoint a trusted resume reads is not the only one it may fall back to: each legacy one is converted
    (the selected one, the one below a damaged newer one); one that holds more than data is named and left."""
    model, opt, ema = _trained()
    first, bad, new = (_save(tmp_path, epoch, model, opt, ema) for epoch in (1, 2, 3))
    trainer = _pickled(first)
    marker = tmp_path / "marker"
    _pickled(bad, payload=_Payload(marker))
    new_bytes = {p: p.read_bytes() for p in new.rglob("*") if p.is_file()}
    lines = []
    assert convert_legacy_folders(tmp_path, lines.append) == ["epoch_0001"]
    assert not (first / LEGACY_TRAINER).exists() and verify_checkpoint(first)
    assert _same(read_checkpoint(first, model).trainer, trainer)  # no flag needed for it any more
    assert (bad / LEGACY_TRAINER).exists() and not marker.exists()
    assert {p: p.read_bytes() for p in new.rglob("*") if p.is_file()} == new_bytes
    assert len(lines) == 2 and lines[0].startswith(f"converted {first} ")
    assert lines[1].startswith(f"not converting {bad}: {bad / LEGACY_TRAINER}") and "\n" not in lines[1]


def test_the_conversion_script_reads_no_pickle_without_its_flag_and_leaves_a_payload_unrun(tmp_path, capsys):
    from scripts.tools.convert_checkpoints import main

    model, opt, ema = _trained()
    run = tmp_path / "run"
    good, bad = (_save(run / "checkpoints", epoch, model, opt, ema) for epoch in (1, 2))
    trainer = _pickled(good)
    marker = tmp_path / "marker"
    _pickled(bad, payload=_Payload(marker))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as e:
        main([str(run)])
    assert e.value.code == 2 and "--trust-legacy-checkpoint" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert main(["--trust-legacy-checkpoint", str(run)]) == 1  # one folder could not be converted
    out, err = capsys.readouterr()
    assert out == f"{good}: converted\n" and err.startswith(f"{bad}: not converted: {bad / LEGACY_TRAINER}")
    assert _same(read_checkpoint(good, model).trainer, trainer) and not marker.exists()
    assert (bad / LEGACY_TRAINER).exists()


def test_a_folder_with_both_trainer_files_is_corrupt(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    torch.save({"optimizer": {}}, ckpt / LEGACY_TRAINER)
    _reseal(ckpt)
    with pytest.raises(CheckpointCorrupt, match="trainer.pt is beside .*trainer.json"):
        read_checkpoint(ckpt, model, trust_legacy=True)


# ---------------------------------------------------------------------------------------------------------------
# 3. a manifest names only files inside its folder


def _outside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's\n")
    return secret


def _list(ckpt, rel, target):
    """Add manifest entry `rel` with the size and SHA-256 of `target`: right, if it is read where it points."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"][rel] = {"bytes": target.stat().st_size, "sha256": _sha(target)}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "file_link", "folder_link", "linked_listed_file"])
def test_a_manifest_entry_outside_its_folder_is_refused_and_the_checkpoint_skipped(tmp_path, how):
    root = tmp_path / "checkpoints"
    model, opt, ema = _trained()
    _save(root, 1, model, opt, ema)
    ckpt = _save(root, 2, model, opt, ema)
    secret = _outside(tmp_path)
    if how == "absolute":
        rel, named = str(secret), str(secret)
        _list(ckpt, rel, secret)
    elif how == "dotdot":
        rel = "../../secret.txt"
        named = rel
        _list(ckpt, rel, secret)
    elif how == "file_link":  # a link inside the folder leading out of it
        (ckpt / "extra.json").symlink_to(secret)
        rel = named = "extra.json"
        _list(ckpt, rel, secret)
    elif how == "folder_link":
        (ckpt / "more").symlink_to(tmp_path, target_is_directory=True)
        rel, named = "more/secret.txt", "more/secret.txt"
        _list(ckpt, rel, secret)
    else:  # a file the checkpoint lists, swapped for a link to a file outside with the same bytes
        shutil.copy(ckpt / "base_eval.json", secret)
        (ckpt / "base_eval.json").unlink()
        (ckpt / "base_eval.json").symlink_to(secret)
        named = "base_eval.json"
    with pytest.raises(CheckpointCorrupt) as e:
        verify_checkpoint(ckpt)
    assert named in str(e.value) and "\n" not in str(e.value)
    assert "absolute path" in str(e.value) if how == "absolute" else "outside" in str(e.value) or "'..'" in str(e.value)
    lines = []
    assert read_intact(root, ckpt, model, lines.append).path.name == "epoch_0001"  # skipped like a corrupt one
    assert len(lines) == 1 and lines[0].startswith("skipping corrupt checkpoint epoch_0002") and named in lines[0]
    assert resumable_checkpoint(root, ckpt).name == "epoch_0001"


def test_a_link_inside_the_folder_to_a_file_inside_it_is_followed(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    (ckpt / "base_eval_copy.json").symlink_to("base_eval.json")
    write = json.loads((ckpt / MANIFEST).read_text())
    write["files"]["base_eval_copy.json"] = write["files"]["base_eval.json"]
    (ckpt / MANIFEST).write_text(json.dumps(write))
    assert verify_checkpoint(ckpt) and read_checkpoint(ckpt, model).base_eval == BASE


def test_an_unlisted_link_to_a_folder_outside_is_named_and_never_walked(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path / "checkpoints", 1, model, opt, ema)
    _outside(tmp_path)
    (ckpt / "model" / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(CheckpointCorrupt, match="model/elsewhere is not listed"):
        verify_checkpoint(ckpt)


# ---------------------------------------------------------------------------------------------------------------
# 4. a linked checkpoint folder, and saving a folder again


def test_a_linked_checkpoint_folder_is_read_through_the_link_and_saved_again_as_a_folder(tmp_path):
    model, opt, ema = _trained()
    root, elsewhere = tmp_path / "checkpoints", tmp_path / "elsewhere"
    target = _save(elsewhere, 1, model, opt, ema)
    before = {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    root.mkdir()
    (root / "epoch_0001").symlink_to(target, target_is_directory=True)
    (root / "latest").write_text("epoch_0001")
    got = read_intact(root, root / "epoch_0001", model, print)  # followed: its files are inside its target
    assert got.verified and got.state["epoch"] == 1
    _save(root, 1, model, opt, ema)  # a rollback saves the folder it restored again
    assert not (root / "epoch_0001").is_symlink() and verify_checkpoint(root / "epoch_0001")
    assert sorted(p.name for p in root.iterdir()) == ["epoch_0001", "latest"]  # no .tmp-*, no displaced copy
    assert {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


def test_pruning_a_linked_checkpoint_removes_the_link_not_what_it_points_to(tmp_path):
    model, opt, ema = _trained()
    root = tmp_path / "checkpoints"
    target = _save(tmp_path / "elsewhere", 1, model, opt, ema)
    root.mkdir()
    (root / "epoch_0001").symlink_to(target, target_is_directory=True)
    _save(root, 2, model, opt, ema, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["epoch_0002", "latest"]
    assert verify_checkpoint(target)


def test_a_save_again_interrupted_between_its_renames_is_put_back_by_the_next_start(tmp_path, monkeypatch):
    import recam.infra.checkpoint as checkpoint

    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    sealed = (ckpt / MANIFEST).read_bytes()
    replace = os.replace

    def dies_publishing(src, dst):  # the process dies as the new folder is renamed into place
        if str(src).endswith(".tmp-epoch_0001"):
            raise KeyboardInterrupt("killed")
        return replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", dies_publishing)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 1, model, opt, ema)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    assert not ckpt.exists() and (tmp_path / f"{DISPLACED}epoch_0001").is_dir()
    done = remove_leftovers(tmp_path)
    assert done == [f"{DISPLACED}epoch_0001 (put back as epoch_0001)", ".tmp-epoch_0001"]
    assert (ckpt / MANIFEST).read_bytes() == sealed and verify_checkpoint(ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0001", "latest"]


def test_a_failed_save_again_leaves_the_sealed_folder_as_it_was(tmp_path, monkeypatch):
    import recam.infra.checkpoint as checkpoint

    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    before = {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    monkeypatch.setattr(checkpoint, "write_manifest", lambda folder: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        save_checkpoint(tmp_path, "epoch_0001", model, opt, ema,
                        {"epoch": 1, "global_step": 2, "learning_rate": 1e-2}, keep=0)
    assert {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0001", "latest"]


# ---------------------------------------------------------------------------------------------------------------
# 5. what a resume reads before the model exists is read after its manifest verifies


@pytest.mark.parametrize("damage", ["truncated", "edited", "resealed_garbage"])
def test_the_run_config_of_a_damaged_checkpoint_is_never_used_for_the_resume(tmp_path, damage):
    model, opt, ema = _trained()
    config = {"config": {"seed": 0}, "history": []}
    for epoch in (1, 2):
        save_checkpoint(tmp_path, f"epoch_{epoch:04d}", model, opt, ema,
                        {"epoch": epoch, "global_step": 2 * epoch, "learning_rate": 1e-2}, keep=0,
                        side_files={"run_config.json": config})
    path = tmp_path / "epoch_0002" / "run_config.json"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:7])
    elif damage == "edited":  # valid JSON that no longer matches its checksum
        path.write_text(json.dumps({"config": {"seed": 7}, "history": []}))
    else:  # checksums agree, the contents do not parse
        path.write_bytes(b'{"config": ')
        _reseal(path.parent)
    assert resumable_checkpoint(tmp_path, tmp_path / "epoch_0002").name == "epoch_0001"
    lines = []
    got = read_intact(tmp_path, tmp_path / "epoch_0002", model, lines.append)
    assert got.path.name == "epoch_0001" and got.run_config == config
    assert len(lines) == 1 and str(path) in lines[0]
    path.parent.joinpath(WEIGHTS).unlink()  # nothing intact left: one line naming what is wrong with each
    shutil.rmtree(tmp_path / "epoch_0001")
    with pytest.raises(CheckpointCorrupt, match="no intact checkpoint"):
        resumable_checkpoint(tmp_path, tmp_path / "epoch_0002")
