"""Crash-safe, verified checkpoints: written to a temporary folder, sealed with a manifest of checksums, renamed
into place, then `latest` is repointed.

A crash at any moment leaves the previous checkpoint and the `latest` pointer intact. A checkpoint holds the
policy (diffusers layout, safetensors), optimizer, optional EMA and RNG states (trainer.pt), a JSON state
(epoch, global step, sampler position, health flag), optional JSON side files (base_eval.json: the base's
evaluation, so a resumed run never has to recompute it from other weights), and manifest.json:

    {"format": 1, "algorithm": "sha256",
     "files": {"state.json": {"bytes": 212, "sha256": "9f2c..."}, "model/config.json": {...}, ...}}

Every other file of the folder is listed with its size and SHA-256; the manifest is written last, so a folder
is either sealed whole or (a crash before the rename) never appears. Reading checks the manifest first, so a
truncated, garbled, or swapped file is named before any of its bytes are trusted (torch.load checks no CRC,
and a plausible float is still a float). Folders written before manifests existed still load, unverified.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"
RUN_CONFIG = "run_config.json"  # the config a run asked for and its resume history (config/resume.py)
SELECTED = "selected"  # the checkpoint a run reports (chosen on validation conditions, see recam.engine.selection)
MANIFEST = "manifest.json"
BASE_EVAL = "base_eval.json"
MANIFEST_FORMAT = 1
FULL_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, altered, unreadable or non-finite; the message names the file."""


class ResumeMismatch(ValueError):
    """A checkpoint's state disagrees with itself or with the run's log: resuming would continue the wrong run."""


class DiskFull(OSError):
    """Something of the run could not be written for want of space (ENOSPC, or a quota's EDQUOT): what was being
    written was removed, and `latest` names the last intact checkpoint. Its strerror is the one line the run stops
    with."""


class NonFiniteState(ValueError):
    """The state to be saved holds NaN or inf: it is never written as a healthy checkpoint."""


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def write_model(model, directory: Path) -> None:
    """The policy's weights: the LoRA adapter alone when there is one, else the whole model (diffusers layout)."""
    from recam.infra.lora import has_lora, save_adapter

    if has_lora(model):
        save_adapter(model, directory)
    else:
        model.save_pretrained(directory, safe_serialization=True)


def model_weights_file(model, directory: Path) -> Path:
    """Where `write_model` puts the weights of this model's layout (adapter or whole model)."""
    from recam.infra.lora import ADAPTER_WEIGHTS_NAME, has_lora

    path = directory / (ADAPTER_WEIGHTS_NAME if has_lora(model) else FULL_WEIGHTS_NAME)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the checkpoint does not match this run's model "
                                f"({'LoRA' if has_lora(model) else 'full fine-tuning'})")
    return path


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, every one finite, or CheckpointCorrupt naming the file."""
    from safetensors.torch import load

    try:
        tensors = load(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types, and a short read others
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    bad = nonfinite_names(tensors.items())
    if bad:
        raise CheckpointCorrupt(f"{path} holds non-finite values in {_few(bad)}")
    return tensors


def apply_model_weights(model, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Load tensors read from `path` into a live model of the same layout, in place."""
    from recam.infra.lora import has_lora, set_adapter_state

    if has_lora(model):
        result = set_adapter_state(model, tensors)
        missing = [k for k in result.missing_keys if ".lora_A." in k or ".lora_B." in k]
        if result.unexpected_keys or missing:  # an adapter file without some of the weights would load silently
            raise ValueError(f"{path}: unexpected adapter keys {list(result.unexpected_keys)[:5]}, missing "
                             f"{missing[:5]}")
    else:
        try:
            model.load_state_dict(tensors)
        except RuntimeError as e:
            raise ValueError(f"{path} does not fit this run's model: {str(e).splitlines()[0]}") from e


# ---------------------------------------------------------------------------------------------------------------
# finiteness


def nonfinite_names(named_tensors) -> list[str]:
    """Names of the floating-point tensors holding NaN or inf, from (name, tensor) pairs."""
    named = [(n, t) for n, t in named_tensors if torch.is_tensor(t) and t.is_floating_point() and t.numel()]
    if not named:
        return []
    # one device sync per device: an accelerator run mixes devices (Adam keeps its step counts on the CPU)
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    finite = [True] * len(named)
    for idx in by_device.values():
        for i, ok in zip(idx, torch.stack([torch.isfinite(named[i][1]).all() for i in idx]).cpu().tolist(),
                         strict=True):
            finite[i] = ok
    return [n for (n, _), ok in zip(named, finite, strict=True) if not ok]


def _optimizer_tensors(optimizer_state: dict):
    for pid, per_param in optimizer_state.get("state", {}).items():
        for key, value in per_param.items():
            yield f"optimizer.state.{pid}.{key}", value


def nonfinite_tensors(model, optimizer=None, ema=None, optimizer_state: dict | None = None) -> list[str]:
    """Names of the model parameters/buffers, optimizer state and EMA tensors holding NaN or inf. optimizer_state:
    the optimizer's state dict when given (a gathered one, under FSDP), else optimizer.state_dict()."""
    named = [(f"model.{n}", t.detach()) for n, t in model.state_dict().items()]
    if optimizer_state is None and optimizer is not None:
        optimizer_state = optimizer.state_dict()
    if optimizer_state is not None:
        named += list(_optimizer_tensors(optimizer_state))
    if ema is not None:
        named += [(f"ema.shadow_params.{i}", t) for i, t in enumerate(ema.shadow_params)]
    return nonfinite_names(named)


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ---------------------------------------------------------------------------------------------------------------
# manifest


def _files(folder: Path) -> list[str]:
    """Every file under `folder` but its manifest, as posix paths relative to it."""
    rels = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return sorted(rel for rel in rels if rel != MANIFEST)


def _digest(path: Path, sync: bool = False) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
        if sync:  # the rename that publishes the folder must not outrun the bytes it publishes
            os.fsync(f.fileno())
    return size, h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Seal `folder`: list every file in it with its size and SHA-256, in manifest.json (written atomically)."""
    files = {}
    for rel in _files(folder):
        size, sha = _digest(folder / rel, sync=True)
        files[rel] = {"bytes": size, "sha256": sha}
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
    tmp = folder / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def verify_checkpoint(ckpt: Path) -> bool:
    """Check every file of checkpoint folder `ckpt` against its manifest. True: verified; False: an older checkpoint
    without a manifest (only parsing can check it). Raises CheckpointCorrupt naming the file and what is wrong."""
    path = ckpt / MANIFEST
    if not path.exists():
        state = ckpt / "state.json"
        try:
            sealed = "checkpoint_format" in json.loads(state.read_bytes())
        except (OSError, ValueError):
            sealed = False  # parsing state.json reports what is wrong with it
        if sealed:
            raise CheckpointCorrupt(f"{path} is missing, though {state} was written with one")
        return False
    try:
        manifest = json.loads(path.read_bytes())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("algorithm") != "sha256" \
                or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}, algorithm {manifest.get('algorithm')!r}")
        expected = {rel: (int(e["bytes"]), str(e["sha256"])) for rel, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorrupt(f"{path} is not a readable manifest ({type(e).__name__}: {e})") from e
    for rel, (size, sha) in sorted(expected.items()):
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointCorrupt(f"{f} is missing (listed in {path})")
        got_size = f.stat().st_size
        if got_size != size:
            raise CheckpointCorrupt(f"{f} is {got_size} bytes, {path} says {size} (truncated or overwritten)")
        if _digest(f)[1] != sha:
            raise CheckpointCorrupt(f"{f} does not match its SHA-256 in {path} (its bytes were altered)")
    unlisted = [rel for rel in _files(ckpt) if rel not in expected]
    if unlisted:
        raise CheckpointCorrupt(f"{ckpt / unlisted[0]} is not listed in {path} (the folder was altered after sealing)")
    return True


# ---------------------------------------------------------------------------------------------------------------
# writing


def save_checkpoint(ckpt_root: Path, name: str, model, optimizer, ema, state: dict, keep: int = 2,
                    protect: tuple[str, ...] = (), side_files: dict[str, dict] | None = None,
                    optimizer_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `name` under ckpt_root atomically and point `latest` at it; prune old ones.

    side_files: extra JSON files (e.g. BASE_EVAL) sealed with the rest; extra: more entries of trainer.pt (the
    gradient cosine's last gradient). optimizer_state: what to save of the
    optimizer, when not optimizer.state_dict() (under FSDP, the gathered state). Raises NonFiniteState, writing
    nothing, when the model, optimizer or EMA holds NaN or inf."""
    if optimizer_state is None:
        optimizer_state = optimizer.state_dict()
    bad = nonfinite_tensors(model, None, ema, optimizer_state)
    if bad:
        raise NonFiniteState(f"not saving checkpoint {ckpt_root / name}: non-finite values in {_few(bad)}")
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_model(model, tmp / "model")
        torch.save({"optimizer": optimizer_state, "ema": ema.state_dict() if ema is not None else None,
                    "rng": rng_state(), **(extra or {})}, tmp / "trainer.pt")
        # the marker tells a reader that a missing manifest was lost, not never written
        (tmp / "state.json").write_text(json.dumps({**state, "checkpoint_format": MANIFEST_FORMAT}, indent=1))
        for file_name, content in (side_files or {}).items():
            (tmp / file_name).write_text(json.dumps(content, indent=1))
        write_manifest(tmp)
    except Exception as e:  # a half-written folder is never left behind; `latest` has not moved
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise DiskFull(28, f"no space left on the device writing checkpoint {final}; "
                               f"{ckpt_root / LATEST} still names {read_pointer(ckpt_root)}") from e
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _sync_dir(ckpt_root)
    point_latest(ckpt_root, name)
    _prune(ckpt_root, keep, protect=(name, *protect))
    return final


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an error anywhere in its cause chain, is a write that found no space: an OSError with
    ENOSPC or EDQUOT, or a writer's own error that says so without an errno. safetensors (SafetensorError) and other
    Rust writers put the OS error in the message; torch.save's zip writer drops the errno and reports only that its
    stream failed ("basic_ios::clear: iostream error", "unexpected pos N vs M", "file write failed"), which a full
    disk is what causes in practice: a short write."""
    import errno

    says_so = re.compile(r"No space left on device|Disk quota exceeded|os error (28|122)\b|code: (28|122)\b|"
                         r"StorageFull|QuotaExceeded|basic_ios::clear|unexpected pos \d+ vs \d+|file write failed")
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or says_so.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def remove_leftovers(ckpt_root: Path) -> list[str]:
    """Remove what an interrupted save leaves (.tmp-epoch_NNNN folders, a pointer's temporary file); their names."""
    gone = []
    for p in sorted(ckpt_root.glob(".tmp-*")) + sorted(ckpt_root.glob(".*.tmp")):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        gone.append(p.name)
    return gone


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point(ckpt_root: Path, pointer: str, name: str) -> None:
    """Atomically make the pointer file `pointer` (e.g. LATEST, SELECTED) name checkpoint folder `name`."""
    pointer_tmp = ckpt_root / f".{pointer}.tmp"
    pointer_tmp.write_text(name)
    os.replace(pointer_tmp, ckpt_root / pointer)


def point_latest(ckpt_root: Path, name: str) -> None:
    """Atomically make `latest` name checkpoint folder `name`."""
    point(ckpt_root, LATEST, name)


def epoch_of(folder: Path) -> int | None:
    """NNNN of a folder named epoch_NNNN, else None."""
    m = re.fullmatch(r"epoch_(\d+)", folder.name)
    return int(m.group(1)) if m else None


def checkpoint_before(ckpt_root: Path, epoch: int) -> Path | None:
    """The newest complete epoch_NNNN folder with NNNN < epoch (epoch_NNNN holds the weights that sample epoch
    NNNN), or None. Its files are checked when it is read (`read_intact`)."""
    older = [p for p in ckpt_root.glob("epoch_*") if p.is_dir() and (p / "state.json").exists()
             and (n := epoch_of(p)) is not None and n < epoch]
    return max(older, default=None)


def _prune(ckpt_root: Path, keep: int, protect: tuple[str, ...]) -> None:
    names = sorted(p.name for p in ckpt_root.glob("epoch_*") if p.is_dir())
    for old in names[:-keep] if keep > 0 else []:
        if old not in protect:
            shutil.rmtree(ckpt_root / old, ignore_errors=True)


def read_pointer(ckpt_root: Path, pointer: str = LATEST) -> str | None:
    """The checkpoint folder name a pointer file holds, or None when the file is missing, empty, not UTF-8, or
    holds anything but an epoch_NNNN name (a torn or garbled write)."""
    try:
        name = (ckpt_root / pointer).read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if re.fullmatch(r"epoch_\d+", name) else None


def pointed_checkpoint(ckpt_root: Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The folder `latest` names, whatever state it is in (reading it checks it), or None for a fresh run.

    A damaged or missing pointer (empty, garbled, naming no folder that exists, deleted) loses nothing: the
    newest epoch_NNNN folder beside it stands in (reading it, `read_intact` walks down to the newest intact one),
    and say() gets one line naming the pointer. Without it a run would start again from epoch 0 over good
    checkpoints."""
    pointer = ckpt_root / LATEST
    name = read_pointer(ckpt_root) if pointer.exists() else None
    if name is not None and (ckpt_root / name).is_dir():
        return ckpt_root / name
    folders = sorted(p for p in ckpt_root.glob("epoch_*") if p.is_dir() and epoch_of(p) is not None)
    if not folders and not pointer.exists():
        return None  # a fresh run
    what = (f"{pointer} is missing beside {len(folders)} checkpoint folder(s)" if not pointer.exists() else
            f"{pointer} names no epoch_NNNN checkpoint folder here (it holds {pointer.read_bytes()[:40]!r})")
    if not folders:
        raise CheckpointCorrupt(f"{what} and {ckpt_root} has none: nothing to resume from")
    if say is not None:
        say(f"{what}: resuming from the newest, {folders[-1].name}, or the newest intact one below it")
    return folders[-1]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The folder `latest` points to, or None for a fresh run. A dangling pointer is an error, not a restart."""
    target = pointed_checkpoint(ckpt_root)
    if target is not None and not (target / "state.json").exists():
        raise FileNotFoundError(f"{ckpt_root / LATEST} points to {target}, which holds no state.json: the checkpoint "
                                "is incomplete; point `latest` at an intact epoch_* folder or remove it")
    return target


# ---------------------------------------------------------------------------------------------------------------
# reading


@dataclass
class Checkpoint:
    """Everything a checkpoint folder holds, read and checked, not yet applied to a live run."""

    path: Path
    state: dict
    trainer: dict
    weights: dict[str, torch.Tensor]
    weights_path: Path
    base_eval: dict | None
    verified: bool  # False: an older checkpoint without a manifest, checked only by parsing


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError covers bad UTF-8 as well as bad JSON
        raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise CheckpointCorrupt(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def read_checkpoint(ckpt: Path, model) -> Checkpoint:
    """Read checkpoint folder `ckpt` for a run with this model's layout: the manifest first, then every file parsed
    and every tensor checked finite. Raises CheckpointCorrupt naming the first file that fails."""
    verified = verify_checkpoint(ckpt)
    state = _read_json(ckpt / "state.json")
    for key, kind in (("epoch", int), ("global_step", int), ("learning_rate", (int, float))):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise CheckpointCorrupt(f"{ckpt / 'state.json'} has no valid {key!r} (got {state.get(key)!r})")
    path = ckpt / "trainer.pt"
    try:
        # pickle, so only after the manifest vouched for these bytes (or, for an older checkpoint, as before)
        trainer = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(trainer, dict) or not {"optimizer", "ema", "rng"} <= set(trainer):
        raise CheckpointCorrupt(f"{path} does not hold the optimizer, EMA and RNG states")
    bad = nonfinite_names(_optimizer_tensors(trainer["optimizer"]))
    if trainer["ema"] is not None:
        bad += nonfinite_names((f"ema.shadow_params.{i}", t) for i, t in enumerate(trainer["ema"]["shadow_params"]))
    if bad:
        raise CheckpointCorrupt(f"{path} holds non-finite values in {_few(bad)}")
    # a missing weights file of a sealed checkpoint was reported above; here it means LoRA vs full fine-tuning, a
    # config mismatch that every older checkpoint shares, so it is raised as it is rather than walked past
    weights_path = model_weights_file(model, ckpt / "model")
    weights = read_weights(weights_path)
    base_eval = _read_json(ckpt / BASE_EVAL) if (ckpt / BASE_EVAL).exists() else None
    return Checkpoint(ckpt, state, trainer, weights, weights_path, base_eval, verified)


def read_intact(ckpt_root: Path, newest: Path, model, say: Callable[[str], None]) -> Checkpoint:
    """`newest` read, or when it is corrupt the newest epoch_NNNN folder below it that reads intact. say() gets one
    line per skipped folder (which, and why) and one for an older, unverified checkpoint. Raises CheckpointCorrupt
    when none is intact."""
    top = epoch_of(newest)
    older = sorted((p for p in ckpt_root.glob("epoch_*") if p.is_dir() and p != newest
                    and (n := epoch_of(p)) is not None and top is not None and n < top), reverse=True)
    reasons = []
    for ckpt in [newest, *older]:
        try:
            found = read_checkpoint(ckpt, model)
        except CheckpointCorrupt as e:
            reasons.append(str(e))
            say(f"skipping corrupt checkpoint {ckpt.name}: {e}")
            continue
        if not found.verified:
            say(f"{ckpt} has no {MANIFEST} (written before checkpoints were checksummed): loaded unverified")
        return found
    raise CheckpointCorrupt(f"no intact checkpoint under {ckpt_root}: " + "; ".join(reasons))
