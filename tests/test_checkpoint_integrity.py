"""Checkpoints are verified before they are trusted, and a resume checks what it resumes (issue 16, parts 1-2).

File-level tests use a tiny in-process model with AdamW; the end-to-end tests share one short smoke run and
resume copies of it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.training_utils import EMAModel
from safetensors.torch import load_file, save_file

from recam.infra.checkpoint import (
    BASE_EVAL,
    LEGACY_TRAINER,
    MANIFEST,
    TRAINER_STATE,
    TRAINER_TENSORS,
    CheckpointCorrupt,
    NonFiniteState,
    latest_checkpoint,
    read_checkpoint,
    read_intact,
    read_trainer_state,
    save_checkpoint,
)
from recam.infra.lora import add_lora
from recam.infra.runlog import RunLog, read_records

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "model/diffusion_pytorch_model.safetensors"
BASE = {"type": "eval", "tag": "start", "step": 0, "epoch": -1, "checkpoint": "epoch_0000", "eval/cam_score": 0.25}


class Tiny(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, width: int = 6):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)


def _trained(seed=0):
    """A model and AdamW (with EMA) after two steps, so the optimizer state holds real tensors."""
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = EMAModel(model.parameters(), decay=0.9)
    for _ in range(2):
        model(torch.randn(3, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
    return model, opt, ema


def _save(root, epoch, model, opt, ema, keep=0):
    state = {"epoch": epoch, "global_step": 2 * epoch, "sampler_position": epoch, "learning_rate": 1e-2,
             "healthy": True}
    return save_checkpoint(root, f"epoch_{epoch:04d}", model, opt, ema, state, keep=keep,
                           side_files={BASE_EVAL: BASE})


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reseal(ckpt):
    """Rewrite the manifest from the files as they are now: a checkpoint whose bytes agree with their checksums
    but whose contents were changed (the case the resume's cross-check exists for)."""
    files = {p.relative_to(ckpt).as_posix(): p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST}
    manifest = {"format": 1, "algorithm": "sha256",
                "files": {rel: {"bytes": p.stat().st_size, "sha256": _sha(p)} for rel, p in files.items()}}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk == {WEIGHTS, "model/config.json", TRAINER_TENSORS, TRAINER_STATE,
                                                  "state.json", BASE_EVAL}
    for rel, entry in manifest["files"].items():
        assert entry == {"bytes": (ckpt / rel).stat().st_size, "sha256": _sha(ckpt / rel)}
    got = read_checkpoint(ckpt, model)
    assert got.verified and got.base_eval == BASE and got.state["epoch"] == 1
    assert all(torch.equal(got.weights[k], v) for k, v in model.state_dict().items())
    assert latest_checkpoint(tmp_path) == ckpt and not list(tmp_path.glob(".tmp-*"))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path):
    # 4 KiB (or the whole file) of pseudo-random bytes in the middle, length unchanged
    data = bytearray(path.read_bytes())
    n = min(4096, len(data))
    start = (len(data) - n) // 2
    data[start:start + n] = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1),
                                          dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))


def _swap(path):
    """Other valid, finite contents of the same shape: what no parser can tell from the real thing."""
    if path.suffix == ".safetensors":
        save_file({k: v * 1.5 + 0.01 if v.is_floating_point() else v for k, v in load_file(path).items()}, path)
    else:
        obj = json.loads(path.read_text())
        key = next(k for k, v in obj.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        obj[key] = obj[key] + 1
        path.write_text(json.dumps(obj, indent=1))


@pytest.mark.parametrize("damage", [_truncate, _garble, _swap], ids=["truncated", "garbled", "swapped"])
@pytest.mark.parametrize("rel", [WEIGHTS, "model/config.json", TRAINER_TENSORS, TRAINER_STATE, "state.json", BASE_EVAL])
def test_a_damaged_file_is_named_in_one_line_and_never_loaded(tmp_path, rel, damage):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    before = (ckpt / rel).read_bytes()
    damage(ckpt / rel)
    assert (ckpt / rel).read_bytes() != before
    with pytest.raises(CheckpointCorrupt) as e:
        read_checkpoint(ckpt, model)
    message = str(e.value)
    assert str(ckpt / rel) in message and "\n" not in message
    # a size that differs is reported as such (before hashing); same-size damage by its checksum
    assert "bytes, " in message if damage is _truncate else ("SHA-256" in message or "bytes, " in message)


def test_resume_choice_skips_a_corrupt_checkpoint_for_the_intact_one_below_it(tmp_path):
    model, opt, ema = _trained()
    _save(tmp_path, 1, model, opt, ema)
    model2, opt2, ema2 = _trained(seed=1)
    newest = _save(tmp_path, 2, model2, opt2, ema2)
    _garble(newest / WEIGHTS)
    lines = []
    got = read_intact(tmp_path, newest, model, lines.append)
    assert got.path.name == "epoch_0001" and got.verified
    assert all(torch.equal(got.weights[k], v) for k, v in model.state_dict().items())
    assert len(lines) == 1 and "epoch_0002" in lines[0] and WEIGHTS in lines[0]
    newest = _save(tmp_path, 2, model2, opt2, ema2)
    (newest / "state.json").unlink()  # a folder that lost a file is skipped the same way
    assert read_intact(tmp_path, newest, model, lines.append).path.name == "epoch_0001"
    assert "state.json is missing" in lines[1]
    _truncate(tmp_path / "epoch_0001" / TRAINER_TENSORS)
    with pytest.raises(CheckpointCorrupt, match="no intact checkpoint"):
        read_intact(tmp_path, newest, model, lines.append)


def test_a_checkpoint_that_lost_its_manifest_or_gained_a_file_is_corrupt(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    (ckpt / "model" / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointCorrupt, match="stray.bin is not listed"):
        read_checkpoint(ckpt, model)
    (ckpt / "model" / "stray.bin").unlink()
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointCorrupt, match="manifest.json is missing"):
        read_checkpoint(ckpt, model)


def test_a_checkpoint_of_the_other_layout_is_a_config_error_not_a_corrupt_file(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    add_lora(model, rank=2, alpha=2, target_modules=["lin"])
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing.*LoRA"):
        read_intact(tmp_path, ckpt, model, print)


def _pickled(ckpt, payload=None):
    """The trainer state as the code before the pickle-free layout wrote it: trainer.pt, from torch.save; with
    `payload` among its entries. The manifest, when there is one, is resealed over it."""
    trainer = read_trainer_state(ckpt)
    if payload is not None:
        trainer["payload"] = payload
    torch.save(trainer, ckpt / LEGACY_TRAINER)
    (ckpt / TRAINER_TENSORS).unlink()
    (ckpt / TRAINER_STATE).unlink()
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "checkpoint_format": 1}))
    if (ckpt / MANIFEST).exists():
        _reseal(ckpt)
    return trainer


def _legacy(ckpt, payload=None):
    """The layout written before manifests: trainer.pt, no manifest.json, no format marker in state.json, no
    base_eval.json."""
    trainer = _pickled(ckpt, payload)
    (ckpt / MANIFEST).unlink()
    (ckpt / BASE_EVAL).unlink()
    state = json.loads((ckpt / "state.json").read_text())
    del state["checkpoint_format"]
    (ckpt / "state.json").write_text(json.dumps(state))
    return trainer


def test_an_older_checkpoint_without_manifest_loads_with_one_line_and_damage_still_names_the_file(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    _legacy(ckpt)
    lines = []
    got = read_intact(tmp_path, ckpt, model, lines.append, trust_legacy=True)
    assert not got.verified and got.base_eval is None and got.legacy
    assert all(torch.equal(got.weights[k], v) for k, v in model.state_dict().items())
    assert len(lines) == 1 and "no manifest.json" in lines[0]
    for damage, rel in ((_truncate, WEIGHTS), (_garble, WEIGHTS), (_truncate, LEGACY_TRAINER), (_garble, "state.json")):
        fresh = tmp_path / f"case-{damage.__name__}-{rel.replace('/', '_')}"
        shutil.copytree(ckpt, fresh)
        damage(fresh / rel)
        with pytest.raises(CheckpointCorrupt) as e:  # not the library's traceback
            read_checkpoint(fresh, model, trust_legacy=True)
        assert str(fresh / rel) in str(e.value) and "\n" not in str(e.value)


def test_an_older_checkpoint_with_a_non_finite_weight_is_corrupt(tmp_path):
    model, opt, ema = _trained()
    ckpt = _save(tmp_path, 1, model, opt, ema)
    _legacy(ckpt)
    tensors = load_file(ckpt / WEIGHTS)
    tensors["lin.bias"][2] = float("inf")
    save_file(tensors, ckpt / WEIGHTS)
    with pytest.raises(CheckpointCorrupt, match=r"non-finite values in lin\.bias"):
        read_checkpoint(ckpt, model, trust_legacy=True)


@pytest.mark.parametrize("where", ["weight", "optimizer", "ema"])
def test_a_non_finite_state_is_never_saved(tmp_path, where):
    model, opt, ema = _trained()
    _save(tmp_path, 1, model, opt, ema)
    with torch.no_grad():
        if where == "weight":
            model.lin.weight[0, 0] = float("nan")
        elif where == "optimizer":
            opt.state[model.lin.bias]["exp_avg_sq"][1] = float("inf")
        else:
            ema.shadow_params[0][0, 1] = float("nan")
    with pytest.raises(NonFiniteState, match="non-finite"):
        _save(tmp_path, 2, model, opt, ema)
    assert not (tmp_path / "epoch_0002").exists() and not list(tmp_path.glob(".tmp-*"))
    assert latest_checkpoint(tmp_path).name == "epoch_0001"


def test_metrics_lines_that_are_not_utf8_json_are_skipped_counted_and_kept(tmp_path, capsys):
    good = [{"type": "epoch", "epoch": 0, "step": 0}, {"type": "step", "step": 1, "epoch": 0}]
    noise = bytes(range(236, 256))  # 20 bytes, not UTF-8
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(json.dumps(good[0]).encode() + b"\n" + noise + b"\n" + json.dumps(good[1]).encode() + b"\n"
                     + b'{"type": "st')  # and a torn last line
    unreadable = []
    assert read_records(path, unreadable) == good
    assert unreadable == [noise, b'{"type": "st']
    log = RunLog.__new__(RunLog)
    log.enabled, log.run_dir, log.path = True, tmp_path, path
    log.truncate_after(5, base_record=BASE)
    assert "skipped 2 line(s)" in capsys.readouterr().out
    assert read_records(path) == [BASE, *good]  # the lost base evaluation goes first, where readers look for it
    assert (tmp_path / "metrics.unreadable").read_bytes() == noise + b"\n" + b'{"type": "st\n'


# ---------------------------------------------------------------------------------------------------------------
# end to end: one short smoke run, resumed from damaged copies

TRAIN = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:smoke",
         "--config.logging.wandb_mode=disabled", "--config.num_threads=1", "--config.num_epochs=2",
         "--config.eval.freq=100", "--config.data.num_heldout_conditions=2", "--config.eval.select_by=",
         "--config.eval.select_guard=", "--config.eval.num_videos=0"]
needs_base = pytest.mark.skipif(not (ROOT / "checkpoints" / "recam_tiny_base" / "config.json").exists(),
                                reason="base checkpoint checkpoints/recam_tiny_base not present")


def _run(run_dir, *extra, prefix=()):
    cmd = [sys.executable, *prefix, *TRAIN[1:], f"--config.run_dir={run_dir}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _records(run_dir, kind):
    return [r for r in read_records(Path(run_dir) / "metrics.jsonl") if r["type"] == kind]


def _base_column(run_dir):
    rows = (Path(run_dir) / "summary.md").read_text().split("\n")
    return {r.split("|")[1].strip(): float(r.split("|")[2]) for r in rows[2:] if r.startswith("| ")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished")
    p = _run(run_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir


def _copy(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _at_epoch_1(finished, tmp_path):
    """A copy of the finished run as if killed during epoch 1: its resume trains epoch 1 again."""
    run = _copy(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / "epoch_0002")
    (run / "checkpoints" / "latest").write_text("epoch_0001")
    return run


# an injection's last lines: run train_recam.py with the arguments after `-c CODE`
RUN_TRAIN = """
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@needs_base
def test_resume_skips_a_corrupt_latest_and_retrains_exactly_what_the_uninterrupted_run_did(finished, tmp_path):
    run = _copy(finished, tmp_path)
    _garble(run / "checkpoints" / "epoch_0002" / TRAINER_TENSORS)  # safetensors alone would accept these bytes
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(os.urandom(20).replace(b"\n", b"x") + b"\n")
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"skipping corrupt checkpoint epoch_0002: {run / 'checkpoints' / 'epoch_0002' / TRAINER_TENSORS}" in p.stdout
    assert "skipped 1 line(s)" in p.stdout and "resumed from" in p.stdout and "epoch_0001 at epoch 1" in p.stdout
    for kind, keys in (("epoch", ("rewards/avg", "advantages", "dataset_indices")),
                       ("step", ("loss", "mean_ratio", "kl_penalty", "grad_norm", "grad_cosine_prev"))):
        a, b = _records(finished, kind), _records(run, kind)
        assert len(a) == len(b) and a
        for ra, rb in zip(a, b, strict=True):
            assert {k: ra.get(k) for k in keys} == {k: rb.get(k) for k in keys}, kind
    def finals(path):  # train_seconds is wall-clock time: the one field two runs of the same weights differ in
        return [{k: v for k, v in r.items() if k != "train_seconds"} for r in _records(path, "eval")
                if r["tag"] == "final"]
    assert finals(finished) == finals(run)  # the same weights, bit for bit
    assert _sha(run / "checkpoints" / "epoch_0002" / WEIGHTS) == _sha(finished / "checkpoints" / "epoch_0002" / WEIGHTS)


@needs_base
def test_resume_with_an_emptied_log_reads_the_base_evaluation_from_the_checkpoint(finished, tmp_path):
    run = _copy(finished, tmp_path)
    (run / "metrics.jsonl").write_bytes(b"")
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _base_column(run) == _base_column(finished)
    start = [r for r in _records(finished, "eval") if r["tag"] == "start"]
    assert [r for r in _records(run, "eval") if r["tag"] == "start"] == start
    assert _records(run, "eval")[0] == start[0]


@needs_base
def test_resume_with_an_emptied_latest_pointer_takes_the_newest_intact_folder_and_names_the_pointer(finished,
                                                                                                   tmp_path):
    run = _copy(finished, tmp_path)
    (run / "checkpoints" / "latest").write_bytes(b"")
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{run / 'checkpoints' / 'latest'} names no epoch_NNNN checkpoint folder here" in p.stdout
    assert f"resumed from {run / 'checkpoints' / 'epoch_0002'}" in p.stdout and "state.json" not in p.stderr
    assert (run / "checkpoints" / "latest").read_text() == "epoch_0002"  # repaired


@needs_base
def test_resume_refuses_a_state_json_that_disagrees_with_its_checkpoint_and_the_log(finished, tmp_path):
    run = _copy(finished, tmp_path)
    ckpt = run / "checkpoints" / "epoch_0002"
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "epoch": 99}))
    _reseal(ckpt)  # checksums agree: only the cross-check can tell
    log_before = (run / "metrics.jsonl").read_bytes()
    p = _run(run)
    assert p.returncode == 4
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("[recam] cannot resume:") and f"refusing to resume from {ckpt / 'state.json'}" in last
    assert "epoch 99 in folder epoch_0002" in last and "records training up to epoch 1" in last
    assert (run / "metrics.jsonl").read_bytes() == log_before  # nothing trained, nothing rewritten


@needs_base
@pytest.mark.parametrize("damage", ["truncated", "edited"])
def test_a_damaged_run_config_in_latest_falls_back_to_the_previous_checkpoint_naming_it(finished, tmp_path, damage):
    """run_config.json is read only once its checkpoint's manifest vouches for it: a truncated one is not "the run's
    recorded config is unreadable", an edited one is not used to refuse (or allow) the resume."""
    run = _copy(finished, tmp_path)
    path = run / "checkpoints" / "epoch_0002" / "run_config.json"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:  # a fixed field changed: trusted, it would refuse the resume as a different run
        sealed = json.loads(path.read_text())
        sealed["config"]["sample"]["k"] = 2
        path.write_text(json.dumps(sealed, indent=1))
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"skipping corrupt checkpoint epoch_0002: {path}" in p.stdout
    assert f"resumed from {run / 'checkpoints' / 'epoch_0001'} at epoch 1" in p.stdout
    # epoch 1 retrained from the intact checkpoint ends where the uninterrupted run ended
    assert _sha(run / "checkpoints" / "epoch_0002" / WEIGHTS) == _sha(finished / "checkpoints" / "epoch_0002" / WEIGHTS)
    assert json.loads((run / "config.json").read_text())["resume_history"][0]["checkpoint"] == "epoch_0001"


@needs_base
def test_a_legacy_checkpoint_is_refused_in_one_line_then_resumes_exactly_with_the_flag_and_is_converted(finished,
                                                                                                        tmp_path):
    run = _at_epoch_1(finished, tmp_path)
    ckpt = run / "checkpoints" / "epoch_0001"
    _pickled(ckpt)  # as the code before the pickle-free layout wrote it: trainer.pt, sealed
    # an older legacy checkpoint kept beside it (epoch 1's files: only its layout matters here), which a later
    # fallback would otherwise stop at to ask for the setting again
    older = run / "checkpoints" / "epoch_0000"
    shutil.copytree(ckpt, older)
    def kept():  # the checkpoints and the log: what a refused resume must leave as it found them
        return {p.relative_to(run).as_posix(): p.read_bytes() for p in run.rglob("*") if p.is_file()
                and (p.name == "metrics.jsonl" or "checkpoints" in p.relative_to(run).parts)}
    before = kept()
    p = _run(run)
    assert p.returncode == 4, p.stderr[-3000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("[recam]")]
    assert len(err) == 1 and err[0].startswith(f"[recam] cannot resume: {ckpt / LEGACY_TRAINER} is a pickle")
    assert "--config.trust_legacy_checkpoint=True" in err[0] and "Traceback" not in p.stderr
    assert kept() == before
    p = _run(run, "--config.trust_legacy_checkpoint=True")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"converted {ckpt} to the pickle-free layout" in p.stdout
    assert f"converted {older} to the pickle-free layout" in p.stdout
    assert _sha(run / "checkpoints" / "epoch_0002" / WEIGHTS) == _sha(finished / "checkpoints" / "epoch_0002" / WEIGHTS)
    assert not list((run / "checkpoints").rglob(LEGACY_TRAINER))


NAN_AT_FIRST_STEP = """
import runpy, sys, torch
step = torch.optim.AdamW.step
def poisoned(self, *a, **k):
    out = step(self, *a, **k)
    with torch.no_grad():  # the update leaves a NaN in one weight
        self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
    torch.optim.AdamW.step = step
    return out
torch.optim.AdamW.step = poisoned
""" + RUN_TRAIN


@needs_base
def test_a_nan_written_by_the_optimizer_step_is_never_saved_as_healthy(finished, tmp_path):
    run = _at_epoch_1(finished, tmp_path)
    ckpts = run / "checkpoints"
    p = _run(run, "--config.health.action=stop", prefix=("-c", NAN_AT_FIRST_STEP))
    assert p.returncode == 3, p.stderr[-3000:]
    assert (ckpts / "latest").read_text() == "epoch_0001" and not (ckpts / "epoch_0002").exists()
    critical = [(h["epoch"], f["rule"]) for h in _records(run, "health") for f in h["findings"]
                if f["severity"] == "critical"]
    assert critical == [(1, "nonfinite_state")]
    final = [r for r in _records(run, "eval") if r["tag"] == "final"]
    # the stop restored epoch_0001's weights, so the final evaluation is epoch_0001's, and finite
    assert len(final) == 1 and final[0]["checkpoint"] == "epoch_0001"
    assert all(v == v for k, v in final[0].items() if k.startswith("eval/"))


# ---------------------------------------------------------------------------------------------------------------
# faults found by injection (issue 46): each ends in one line, loses nothing and never guesses


def test_a_first_save_that_runs_out_of_space_says_no_checkpoint_was_written(tmp_path, monkeypatch):
    import recam.infra.checkpoint as checkpoint

    model, opt, ema = _trained()

    def full(model, directory):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_model", full)
    with pytest.raises(checkpoint.DiskFull) as e:
        _save(tmp_path, 0, model, opt, ema)
    assert e.value.strerror == (f"no space left on the device writing checkpoint {tmp_path / 'epoch_0000'}; "
                                "no checkpoint had been written yet")
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_runs_out_of_space_leaves_no_temp_folder_and_latest_where_it_was(tmp_path, monkeypatch):
    import recam.infra.checkpoint as checkpoint

    model, opt, ema = _trained()
    _save(tmp_path, 1, model, opt, ema)

    def full(model, directory):  # a part of the weights written, then the device is full
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 64)
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                           "\"No space left on device\" })")  # what safetensors raises, not an OSError

    monkeypatch.setattr(checkpoint, "write_model", full)
    with pytest.raises(checkpoint.DiskFull, match="no space left on the device writing checkpoint .*epoch_0002; "
                                                  ".*latest still names epoch_0001"):
        _save(tmp_path, 2, model, opt, ema)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0001", "latest"]
    assert (tmp_path / "latest").read_text() == "epoch_0001"
    monkeypatch.setattr(checkpoint, "write_model", lambda *a: (_ for _ in ()).throw(ValueError("not a disk")))
    with pytest.raises(ValueError, match="not a disk"):  # any other failure goes through as itself, also cleaned
        _save(tmp_path, 2, model, opt, ema)
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_run_dir_that_cannot_hold_a_run_ends_before_anything_is_created(tmp_path):
    taken = tmp_path / "a_file"
    taken.write_text("")
    cases = [(f"--config.run_dir={taken}".encode(), "exists and is not a folder"),
             (b"--config.run_dir=" + bytes(tmp_path) + b"/run\xff", "is not valid UTF-8"),
             (b"--config.run_dir=/proc/recam_run", "cannot be written")]  # /proc refuses new folders, even to root
    for arg, problem in cases:
        p = subprocess.run([sys.executable.encode(), *[a.encode() for a in TRAIN[1:]], arg], cwd=ROOT,
                           capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        err = p.stderr.decode("utf-8", "replace").strip()
        assert p.returncode == 2, err[-2000:]
        assert len(err.splitlines()) == 1 and err.startswith("config error: run_dir ") and problem in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the non-UTF-8 folder was never made


FULL_DISK_AT_SECOND_SAVE = """
import runpy, sys
import recam.infra.checkpoint as c
write, calls = c.write_model, []
def full(model, directory):
    calls.append(directory)
    if len(calls) == 2:  # the first save of this resumed run succeeds, the second finds the disk full
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "diffusion_pytorch_model.safetensors").write_bytes(b"0" * 64)
        raise OSError(28, "No space left on device")
    return write(model, directory)
c.write_model = full
""" + RUN_TRAIN


@needs_base
def test_a_full_disk_ends_in_one_line_with_exit_3_and_the_same_command_resumes(finished, tmp_path):
    run = _at_epoch_1(finished, tmp_path)  # epochs 1 and 2 left to train: the first save works, the second not
    ckpts = run / "checkpoints"
    p = _run(run, "--config.num_epochs=3", prefix=("-c", FULL_DISK_AT_SECOND_SAVE))
    assert p.returncode == 3, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("[recam]")]
    assert len(lines) == 1 and "no space left on the device writing checkpoint" in lines[0], p.stderr[-3000:]
    assert "epoch_0003" in lines[0] and "latest still names epoch_0002" in lines[0] and "Traceback" not in p.stderr
    assert (ckpts / "latest").read_text() == "epoch_0002" and not list(ckpts.glob(".tmp-*"))
    p = _run(run, "--config.num_epochs=3")  # space freed: the same command goes on from the last intact checkpoint
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {ckpts / 'epoch_0002'}" in p.stdout
    assert [r["epoch"] for r in _records(run, "epoch")] == [0, 1, 2]


@needs_base
def test_a_deleted_latest_resumes_from_the_newest_folder_and_leftovers_are_removed(finished, tmp_path):
    run = _copy(finished, tmp_path)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "epoch_0002")
    (ckpts / "latest").unlink()
    (ckpts / ".tmp-epoch_0002").mkdir()  # a save killed half-way, and a pointer's temporary file
    (ckpts / ".tmp-epoch_0002" / "trainer.pt").write_bytes(b"partial")
    (ckpts / ".latest.tmp").write_text("epoch_0002")
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{ckpts / 'latest'} is missing beside 1 checkpoint folder(s): resuming from the newest, epoch_0001" \
        in p.stdout
    assert "removed what an interrupted save left" in p.stdout and ".tmp-epoch_0002, .latest.tmp" in p.stdout
    assert f"resumed from {ckpts / 'epoch_0001'}" in p.stdout
    assert [r["epoch"] for r in _records(run, "epoch")] == [0, 1]  # epoch 1 trained once, not twice
    assert (ckpts / "latest").read_text() == "epoch_0002" and not list(ckpts.glob(".tmp-*"))


@needs_base
def test_a_start_with_no_checkpoint_archives_the_records_it_finds(finished, tmp_path):
    run = _copy(finished, tmp_path)
    old = read_records(run / "metrics.jsonl")
    shutil.rmtree(run / "checkpoints")  # e.g. killed before its first checkpoint, or a folder reused
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "holds records but no checkpoint exists" in p.stdout
    archived = read_records(run / "rolled_back.jsonl")
    assert [{k: v for k, v in r.items() if k != "rolled_back"} for r in archived] == old
    assert {r["rolled_back"] for r in archived} == {"a fresh start: no checkpoint to resume from"}
    assert len([r for r in _records(run, "eval") if r["tag"] == "start"]) == 1
    assert len(_records(run, "reference")) <= 1 and [r["epoch"] for r in _records(run, "epoch")] == [0, 1]


@needs_base
def test_a_resume_refuses_a_changed_fixed_field_in_one_line_and_changes_nothing(finished, tmp_path):
    run = _at_epoch_1(finished, tmp_path)
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.json")}
    p = _run(run, "--config.sample.k=2", "--config.seed=7")
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("config error: resume: "), err
    assert "sample.k is 2 here but 4 in the run" in err and "seed is 7 here but 0 in the run" in err
    assert "epoch_0001/run_config.json" in err
    assert {name: (run / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch_0001", "latest"]


@needs_base
def test_a_resume_applies_a_changed_learning_rate_says_so_and_records_both_values(finished, tmp_path):
    run = _at_epoch_1(finished, tmp_path)
    old = json.loads((run / "checkpoints" / "epoch_0001" / "run_config.json").read_text())["config"]
    lr = old["train"]["learning_rate"]
    p = _run(run, f"--config.train.learning_rate={lr * 5}", "--config.num_epochs=3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming with train.learning_rate {json.dumps(lr)} -> {json.dumps(lr * 5)}: the learning rate" in p.stdout
    assert "resuming with num_epochs 2 -> 3: how far the run goes" in p.stdout
    steps = _records(run, "step")
    assert {s["epoch"]: s["learning_rate"] for s in steps}[0] == pytest.approx(lr)
    assert all(s["learning_rate"] == pytest.approx(lr * 5) for s in steps if s["epoch"] >= 1)
    assert f"resuming with run_dir {str(finished)!r} -> {str(run)!r}: where its folder is" in p.stdout  # copied
    change = {"checkpoint": "epoch_0001", "changes": {"num_epochs": [2, 3], "run_dir": [str(finished), str(run)],
                                                      "train.learning_rate": [lr, lr * 5]}}
    assert json.loads((run / "config.json").read_text())["resume_history"] == [change]
    sealed = json.loads((run / "checkpoints" / "epoch_0003" / "run_config.json").read_text())
    assert sealed["history"] == [change] and sealed["config"]["train"]["learning_rate"] == lr * 5


def test_the_guide_lists_exactly_the_fields_a_resume_may_change():
    from config.resume import MUTABLE

    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("### What a resume may change", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| `")]
    assert [field.strip("`") for field, _ in rows] == list(MUTABLE)
    # what each change does, word for word: the guide's reader and the resume's one-line notice are told the same
    assert {field.strip("`"): what for field, what in rows} == MUTABLE


@needs_base
def test_the_smoke_run_repeats_its_committed_numbers(finished):
    """The standing fingerprint of this module's smoke run (scripts/tools/run_fingerprint.py; the toy run's is in
    tests/test_fingerprint.py): the records' structure exactly, their floats and the final weights within the
    tolerances measured across CPU code paths and thread counts and recorded in the file."""
    from scripts.tools.run_fingerprint import check

    committed = ROOT / "tests" / "fingerprints" / "smoke.json"
    assert json.loads(committed.read_text())["command"] == ["scripts/train_recam.py", *TRAIN[2:]]
    assert check(finished, committed) is None


def _refit(ckpt, change):
    """Rewrite the checkpoint's weights through `change` (name -> tensor dict, in place) and reseal it: a checkpoint
    whose files agree with their checksums but whose tensors do not fit the model."""
    tensors = load_file(ckpt / WEIGHTS)
    change(tensors)
    save_file(tensors, ckpt / WEIGHTS)
    _reseal(ckpt)


def _reshape_first(tensors):
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(tensors[name].numel() + 1)


@needs_base
def test_a_checkpoint_whose_tensors_do_not_fit_the_model_is_skipped_like_a_corrupt_one(finished, tmp_path):
    """A sealed checkpoint holding a tensor of another shape, lacking one and holding an extra one: skipped in one
    line naming each, as a corrupt one is; the run resumes from the one below it and ends where the uninterrupted run
    ended."""
    run = _copy(finished, tmp_path)
    ckpts = run / "checkpoints"

    def misfit(tensors):
        first, last = sorted(tensors)[0], sorted(tensors)[-1]
        tensors[first] = torch.zeros(tensors[first].numel() + 1)
        del tensors[last]
        tensors["extra.weight"] = torch.zeros(2)

    _refit(ckpts / "epoch_0002", misfit)
    p = _run(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    (line,) = [x for x in p.stdout.splitlines() if "skipping corrupt checkpoint" in x]
    assert "epoch_0002" in line and "does not fit this run's model" in line
    assert "size mismatch" in line and "Missing key" in line and "Unexpected key" in line and "extra.weight" in line
    assert f"resumed from {ckpts / 'epoch_0001'} at epoch 1" in p.stdout
    assert _sha(ckpts / "epoch_0002" / WEIGHTS) == _sha(finished / "checkpoints" / "epoch_0002" / WEIGHTS)
