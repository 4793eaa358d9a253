"""Crash-safe, verified checkpoints that hold data only: written to a temporary folder, sealed with a manifest of
checksums, renamed into place, then `latest` is repointed.

A crash at any moment leaves the previous checkpoint and the `latest` pointer intact. A checkpoint folder holds

    model/                      the policy (diffusers layout or a LoRA adapter): config JSON + safetensors
    trainer.safetensors         every tensor of the optimizer, EMA, RNG and gradient-cosine state, by name
    trainer.json                the rest of that state, with each tensor replaced by {"$tensor": its name}
    state.json                  epoch, global step, sampler position, guard (rollbacks), budget, hooks' state
    base_eval.json, run_config.json, ...   JSON side files (the base's evaluation, the config the run asked for)
    manifest.json               {"format": 1, "algorithm": "sha256",
                                 "files": {"state.json": {"bytes": 212, "sha256": "9f2c..."}, ...}}

Nothing in it is a pickle: safetensors and JSON are parsed, never executed, so a folder anyone could write can at
worst be refused, never run code. The manifest lists every other file with its size and SHA-256 and is written
last, so a folder is either sealed whole or (a crash before the rename) never appears. Reading checks the manifest
first (every entry a file inside the folder), so a truncated, garbled or swapped file is named before any of its
bytes are trusted.

Checkpoints written before this layout hold trainer.pt, a pickle. They are read only when the run sets
trust_legacy_checkpoint (their own run's files: a pickle can run code), and then only with torch's weights-only
unpickler, which refuses anything but tensors and plain data; the folder is converted once to this layout.
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
from pathlib import Path, PurePosixPath

import numpy as np
import torch

LATEST = "latest"
RUN_CONFIG = "run_config.json"  # the config a run asked for and its resume history (config/resume.py)
SELECTED = "selected"  # the checkpoint a run reports (chosen on validation conditions, see recam.engine.selection)
NO_CHECKPOINT_YET = "no checkpoint had been written yet"  # what a full disk at a run's first save says
MANIFEST = "manifest.json"
BASE_EVAL = "base_eval.json"
STATE = "state.json"
TRAINER_TENSORS = "trainer.safetensors"
TRAINER_STATE = "trainer.json"
LEGACY_TRAINER = "trainer.pt"  # the pickle older checkpoints hold
MANIFEST_FORMAT = 1
# state.json's "checkpoint_format": 1 = sealed, trainer.pt; 2 = sealed, trainer.safetensors + trainer.json. Its
# presence also tells a reader that a missing manifest was lost, not never written.
CHECKPOINT_FORMAT = 2
TRAINER_FORMAT = 1
FULL_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
TRUST_LEGACY = "--config.trust_legacy_checkpoint=True"
DISPLACED = ".displaced-"  # a folder moved aside while its replacement is renamed in (see _publish)


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, altered, unreadable, non-finite or outside its folder; the message names the
    file."""


class LegacyCheckpoint(CheckpointCorrupt):
    """A checkpoint from before the pickle-free layout, met without trust_legacy_checkpoint: the resume stops here
    rather than walking past it to an older one (which would silently lose training)."""


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
        except RuntimeError as e:  # torch's first line only names the model; what does not fit is on the next ones
            lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()] or [str(e).strip()]
            why = "; ".join(lines)
            raise ValueError(f"{path} does not fit this run's model: {why[:400]}{'...' if len(why) > 400 else ''}") \
                from e


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
# trainer state as named tensors + a JSON skeleton
#
# The optimizer's state dict (int keys, tuples such as Adam's betas), the EMA's, numpy's RNG state (a tuple holding
# a uint32 array) and python's (nested tuples of ints) must come back with their exact types and values: Optimizer.
# load_state_dict maps int keys, random.setstate wants tuples, and a resume is checked byte for byte. Plain JSON
# loses all three, so the few non-JSON shapes are tagged with a one-key object whose key starts with "$"; a dict of
# the data whose keys are not all strings, or that has a key starting with "$", is written as "$items" pairs, so a
# tag can never be mistaken for data.

_NDARRAY_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                   "float32", "float64"}


def _encode_tree(value, path: str, tensors: dict[str, torch.Tensor], storages: set[int]):
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        # safetensors refuses tensors that share memory (views of one buffer); a copy costs only for those
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            t = t.clone()
        elif t.numel():
            storages.add(ptr)
        name = path.lstrip("/") or "tensor"
        while name in tensors:
            name += "~"
        tensors[name] = t
        return {"$tensor": name}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray):
        if value.dtype.name not in _NDARRAY_DTYPES:
            raise TypeError(f"{path}: a numpy array of dtype {value.dtype} has no checkpoint encoding")
        return {"$ndarray": {"dtype": value.dtype.name, "shape": list(value.shape),
                             "data": value.reshape(-1).tolist()}}
    if isinstance(value, tuple):
        return {"$tuple": [_encode_tree(v, f"{path}/{i}", tensors, storages) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode_tree(v, f"{path}/{i}", tensors, storages) for i, v in enumerate(value)]
    if isinstance(value, dict):
        plain = all(isinstance(k, str) and not k.startswith("$") for k in value)
        if plain:
            return {k: _encode_tree(v, f"{path}/{k}", tensors, storages) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"{path}: a dict key of type {type(k).__name__} has no checkpoint encoding")
            items.append([k, _encode_tree(v, f"{path}/{k}", tensors, storages)])
        return {"$items": items}
    raise TypeError(f"{path or 'the trainer state'}: a {type(value).__name__} has no checkpoint encoding (only "
                    "tensors, numpy arrays and plain data are saved)")


def encode_tree(value) -> tuple[object, dict[str, torch.Tensor]]:
    """(a JSON-able skeleton of `value`, its tensors by the names the skeleton gives them)."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode_tree(value, "", tensors, set()), tensors


def decode_tree(skeleton, tensors: dict[str, torch.Tensor], used: set[str] | None = None):
    """What encode_tree encoded, from its skeleton and tensors. Raises ValueError on anything encode_tree does not
    write (an unknown tag, a missing tensor, an array of another dtype): data is rebuilt, never constructed by
    name."""
    used = set() if used is None else used
    if isinstance(skeleton, list):
        return [decode_tree(v, tensors, used) for v in skeleton]
    if not isinstance(skeleton, dict):
        if skeleton is None or isinstance(skeleton, (bool, int, float, str)):
            return skeleton
        raise ValueError(f"unexpected {type(skeleton).__name__}")
    tags = [k for k in skeleton if k.startswith("$")]
    if not tags:
        return {k: decode_tree(v, tensors, used) for k, v in skeleton.items()}
    if len(skeleton) != 1:
        raise ValueError(f"an object mixing the tag {tags[0]!r} with other keys")
    tag, body = next(iter(skeleton.items()))
    if tag == "$tensor":
        if not isinstance(body, str) or body not in tensors:
            raise ValueError(f"tensor {body!r} is not in the tensor file")
        used.add(body)
        return tensors[body]
    if tag == "$tuple" and isinstance(body, list):
        return tuple(decode_tree(v, tensors, used) for v in body)
    if tag == "$items" and isinstance(body, list):
        out = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                    and not isinstance(pair[0], bool)):
                raise ValueError(f"a malformed $items entry {str(pair)[:60]}")
            out[pair[0]] = decode_tree(pair[1], tensors, used)
        return out
    if tag == "$ndarray" and isinstance(body, dict):
        dtype, shape, data = body.get("dtype"), body.get("shape"), body.get("data")
        if dtype not in _NDARRAY_DTYPES or not isinstance(shape, list) or not isinstance(data, list) \
                or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"a malformed $ndarray (dtype {dtype!r})")
        return np.asarray(data, dtype=np.dtype(dtype)).reshape(shape)
    raise ValueError(f"unknown tag {tag!r}")


def write_trainer_state(folder: Path, trainer: dict) -> None:
    """trainer (optimizer, EMA, RNG and other state) as TRAINER_TENSORS + TRAINER_STATE in `folder`."""
    from safetensors.torch import save_file

    skeleton, tensors = encode_tree(trainer)
    save_file(tensors, folder / TRAINER_TENSORS)
    (folder / TRAINER_STATE).write_text(json.dumps({"format": TRAINER_FORMAT, "state": skeleton}))


def read_trainer_state(folder: Path) -> dict:
    """What write_trainer_state wrote, or CheckpointCorrupt naming the file at fault."""
    from safetensors.torch import load

    skeleton_path, tensors_path = folder / TRAINER_STATE, folder / TRAINER_TENSORS
    doc = _read_json(skeleton_path)
    if doc.get("format") != TRAINER_FORMAT or "state" not in doc:
        raise CheckpointCorrupt(f"{skeleton_path} is not a trainer state of format {TRAINER_FORMAT} (format "
                                f"{doc.get('format')!r})")
    try:
        tensors = load(tensors_path.read_bytes())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types, and a short read others
        raise CheckpointCorrupt(f"{tensors_path} is not a readable safetensors file ({type(e).__name__}: {e})") from e
    used: set[str] = set()
    try:
        trainer = decode_tree(doc["state"], tensors, used)
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CheckpointCorrupt(f"{skeleton_path} does not describe {tensors_path} ({e})") from e
    if set(tensors) - used:
        raise CheckpointCorrupt(f"{tensors_path} holds tensors {skeleton_path} does not name: "
                                f"{_few(sorted(set(tensors) - used))}")
    if not isinstance(trainer, dict):
        raise CheckpointCorrupt(f"{skeleton_path} holds a {type(trainer).__name__}, not the trainer state")
    return trainer


def _legacy_globals() -> list:
    """The globals a trainer.pt's numpy RNG state names (numpy 2 and numpy 1 spellings): the weights-only
    unpickler rebuilds these and tensors, and refuses every other global."""
    from numpy._core.multiarray import _reconstruct

    return [_reconstruct, (_reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
            type(np.dtype(np.uint32))]


def read_legacy_trainer(path: Path, trust: bool) -> dict:
    """A trainer.pt of the layout before this one. Refused (LegacyCheckpoint) unless `trust`; even then read with
    torch's weights-only unpickler, so a file holding anything but tensors and plain data is refused, not run."""
    if not trust:
        raise LegacyCheckpoint(
            f"{path} is a pickle written before checkpoints were pickle-free, and loading a pickle can run code: if "
            f"this run folder holds only checkpoints you wrote, resume once with {TRUST_LEGACY} (the checkpoint is "
            "then converted and the setting no longer needed)")
    import pickle

    try:
        with torch.serialization.safe_globals(_legacy_globals()):
            trainer = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        why = f"it names {named.group(1)}, which" if named else "what"
        raise CheckpointCorrupt(f"{path} holds more than tensors and plain data ({why} the weights-only unpickler "
                                "refuses): not loaded, even with trust_legacy_checkpoint") from e
    except Exception as e:  # noqa: BLE001 - a torn or garbled file surfaces as any error type of the unpickler
        raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from e
    if not isinstance(trainer, dict):
        raise CheckpointCorrupt(f"{path} holds a {type(trainer).__name__}, not the trainer state")
    return trainer
# ---------------------------------------------------------------------------------------------------------------
# manifest


def _files(folder: Path) -> list[str]:
    """Every entry under `folder` but its manifest, as posix paths relative to it: files, and links of any kind
    (a linked folder is an entry of its own, never walked into, so nothing outside the folder is listed as in it)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):  # followlinks=False: a linked folder is not entered
        base = Path(dirpath)
        out += [(base / n).relative_to(folder).as_posix() for n in filenames]
        out += [(base / n).relative_to(folder).as_posix() for n in dirnames if (base / n).is_symlink()]
    return sorted(rel for rel in out if rel != MANIFEST)


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


def _name_problem(rel) -> str | None:
    """Why a manifest entry cannot name a file inside its folder, or None."""
    if not isinstance(rel, str) or not rel:
        return "is not a file name"
    if rel.startswith("/") or PurePosixPath(rel).is_absolute():
        return "is an absolute path"
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in rel or "\0" in rel:
        return "is not a plain relative path (empty, '.' or '..' parts, backslashes)"
    return None


def own_file(ckpt: Path, rel: str) -> Path:
    """ckpt / rel, when that is a path inside the folder `ckpt` (a link inside it that leads outside it does not
    count), else CheckpointCorrupt naming it. A linked checkpoint folder is followed: inside means inside its
    target."""
    problem = _name_problem(rel)
    if problem:
        raise CheckpointCorrupt(f"{ckpt / MANIFEST}: entry {rel!r} {problem}; a checkpoint names only files inside "
                                "its folder")
    path = ckpt / rel
    real, root = os.path.realpath(path), os.path.realpath(ckpt)
    if os.path.commonpath([real, root]) != root or real == root:
        raise CheckpointCorrupt(f"{path} leads outside {ckpt} (to {real}); a checkpoint's files must be inside its "
                                "folder")
    return path


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
    """Check every file of checkpoint folder `ckpt` against its manifest: each entry a file inside the folder, of
    the listed size and SHA-256, and no file unlisted. True: verified; False: an older checkpoint without a
    manifest (only parsing can check it). Raises CheckpointCorrupt naming the file and what is wrong."""
    path = own_file(ckpt, MANIFEST)
    if not path.exists():
        state = own_file(ckpt, STATE)
        try:
            sealed = "checkpoint_format" in json.loads(state.read_bytes())
        except (OSError, ValueError, TypeError):
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
    # every name is checked before any file is opened: an entry outside the folder is never read, even to hash it
    listed = {rel: own_file(ckpt, rel) for rel in sorted(expected)}
    for rel, f in listed.items():
        size, sha = expected[rel]
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


def _remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a folder."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the sealed folder `tmp` to `final`. A folder or link already at `final` (a checkpoint saved again,
    after a rollback or a conversion) is first renamed aside, to DISPLACED + name, and removed after: a crash between
    the two renames leaves it there, and remove_leftovers puts it back. A link is removed as a link: what it points
    to is not this run's to delete."""
    aside = final.parent / f"{DISPLACED}{final.name}"
    _remove(aside)  # an earlier copy, when `final` exists too (else remove_leftovers would have put it back)
    if final.is_symlink() or final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    _sync_dir(final.parent)
    _remove(aside)


def save_checkpoint(ckpt_root: Path, name: str, model, optimizer, ema, state: dict, keep: int = 2,
                    protect: tuple[str, ...] = (), side_files: dict[str, dict] | None = None,
                    optimizer_state: dict | None = None, extra: dict | None = None) -> Path:
    """Write checkpoint `name` under ckpt_root atomically and point `latest` at it; prune old ones.

    side_files: extra JSON files (e.g. BASE_EVAL) sealed with the rest; extra: more entries of the trainer state
    (the gradient cosine's last gradient): tensors, numpy arrays and plain data. optimizer_state: what to save of
    the optimizer, when not optimizer.state_dict() (under FSDP, the gathered state). Raises NonFiniteState, writing
    nothing, when the model, optimizer or EMA holds NaN or inf."""
    if optimizer_state is None:
        optimizer_state = optimizer.state_dict()
    bad = nonfinite_tensors(model, None, ema, optimizer_state)
    if bad:
        raise NonFiniteState(f"not saving checkpoint {ckpt_root / name}: non-finite values in {_few(bad)}")
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    try:
        _remove(tmp)
        write_model(model, tmp / "model")
        write_trainer_state(tmp, {"optimizer": optimizer_state, "ema": ema.state_dict() if ema is not None else None,
                                  "rng": rng_state(), **(extra or {})})
        (tmp / STATE).write_text(json.dumps({**state, "checkpoint_format": CHECKPOINT_FORMAT}, indent=1))
        for file_name, content in (side_files or {}).items():
            (tmp / file_name).write_text(json.dumps(content, indent=1))
        write_manifest(tmp)
    except Exception as e:  # a half-written folder is never left behind; `latest` has not moved
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            name = read_pointer(ckpt_root)  # None at a run's first save: there is no `latest` to name
            raise DiskFull(28, f"no space left on the device writing checkpoint {final}; " + (
                f"{ckpt_root / LATEST} still names {name}" if name else NO_CHECKPOINT_YET)) from e
        raise
    _publish(tmp, final)
    point_latest(ckpt_root, name)
    _prune(ckpt_root, keep, protect=(name, *protect))
    return final


def convert_legacy(ckpt: Path, trainer: dict) -> None:
    """Rewrite checkpoint folder `ckpt` of the older layout (trainer.pt) in this one, its trainer state being
    `trainer` (read from it with read_legacy_trainer): every other file byte for byte, state.json marked, a new
    manifest. The converted copy is built beside it and swapped in (_publish): a crash leaves one of the two."""
    root, real = ckpt.parent, Path(os.path.realpath(ckpt))
    tmp = root / f".tmp-{ckpt.name}"
    try:
        _remove(tmp)
        # hard links where the file system has them: the weights are the bulk of a checkpoint, and no file is ever
        # written in place (state.json, the one rewritten, is left out and written anew)
        shutil.copytree(real, tmp, symlinks=True, copy_function=_link_or_copy,
                        ignore=lambda d, names: [n for n in names if Path(d) == real
                                                 and n in (LEGACY_TRAINER, MANIFEST, STATE)])
        state = json.loads((real / STATE).read_bytes())
        write_trainer_state(tmp, trainer)
        (tmp / STATE).write_text(json.dumps({**state, "checkpoint_format": CHECKPOINT_FORMAT}, indent=1))
        write_manifest(tmp)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, ckpt)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
    """Undo what an interrupted save left: .tmp-epoch_NNNN folders and a pointer's temporary file are removed, and a
    checkpoint renamed aside to be replaced (DISPLACED) is put back when its replacement never arrived. Returns a
    few words for each."""
    done = []
    for p in sorted(ckpt_root.glob(f"{DISPLACED}*")):
        final = ckpt_root / p.name.removeprefix(DISPLACED)
        if final.is_symlink() or final.exists():
            _remove(p)
            done.append(p.name)
        else:
            os.replace(p, final)
            done.append(f"{p.name} (put back as {final.name})")
    for p in sorted(ckpt_root.glob(".tmp-*")) + sorted(ckpt_root.glob(".*.tmp")):
        _remove(p)
        done.append(p.name)
    return done


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pointer_folder(path: Path) -> CheckpointCorrupt | None:
    """The error for a pointer that is a real folder (it can be neither read as a name nor replaced atomically)."""
    if path.is_dir() and not path.is_symlink():
        return CheckpointCorrupt(f"{path} is a folder, not the pointer file recam keeps there (a file holding the "
                                 f"name of a checkpoint folder): move it out of {path.parent}")
    return None


def check_pointers(ckpt_root: Path) -> None:
    """Raise CheckpointCorrupt, before anything is written, when `latest` or `selected` is a folder."""
    for pointer in (LATEST, SELECTED):
        if (error := _pointer_folder(ckpt_root / pointer)) is not None:
            raise error


def point(ckpt_root: Path, pointer: str, name: str) -> None:
    """Atomically make the pointer file `pointer` (e.g. LATEST, SELECTED) name checkpoint folder `name`. A pointer
    kept as a link is replaced by the file (the rename replaces the link, not what it points to)."""
    if (error := _pointer_folder(ckpt_root / pointer)) is not None:
        raise error
    pointer_tmp = ckpt_root / f".{pointer}.tmp"
    _remove(pointer_tmp)
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
    older = [p for p in ckpt_root.glob("epoch_*") if p.is_dir() and (p / STATE).exists()
             and (n := epoch_of(p)) is not None and n < epoch]
    return max(older, default=None)


def _prune(ckpt_root: Path, keep: int, protect: tuple[str, ...]) -> None:
    names = sorted(p.name for p in ckpt_root.glob("epoch_*") if p.is_dir())
    for old in names[:-keep] if keep > 0 else []:
        if old not in protect:
            try:
                _remove(ckpt_root / old)
            except OSError:
                pass  # an old checkpoint left behind costs space, never the run


def read_pointer(ckpt_root: Path, pointer: str = LATEST) -> str | None:
    """The checkpoint folder name a pointer holds, or None when it is missing, empty, not UTF-8, holds anything but
    an epoch_NNNN name (a torn or garbled write), or is a folder. A pointer kept as a link (as some tools keep
    `latest`) names the folder it links to, when that is an epoch_NNNN folder beside it."""
    path = ckpt_root / pointer
    if path.is_symlink():
        target = Path(os.readlink(path))
        name = target.name
        beside = os.path.realpath(ckpt_root / name) == os.path.realpath(path)
        return name if beside and re.fullmatch(r"epoch_\d+", name) else None
    try:
        name = path.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if re.fullmatch(r"epoch_\d+", name) else None


def _pointer_contents(path: Path) -> str:
    if path.is_symlink():
        return f"it links to {os.readlink(path)}"
    try:
        return f"it holds {path.read_bytes()[:40]!r}"
    except OSError as e:
        return f"it cannot be read: {e.strerror}"


def pointed_checkpoint(ckpt_root: Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The folder `latest` names, whatever state it is in (reading it checks it), or None for a fresh run.

    A damaged or missing pointer (empty, garbled, naming no folder that exists, deleted) loses nothing: the
    newest epoch_NNNN folder beside it stands in (reading it, `read_intact` walks down to the newest intact one),
    and say() gets one line naming the pointer. Without it a run would start again from epoch 0 over good
    checkpoints. A `latest` that is a folder is refused (CheckpointCorrupt): what it holds is not known."""
    pointer = ckpt_root / LATEST
    if (error := _pointer_folder(pointer)) is not None:
        raise error
    present = pointer.exists() or pointer.is_symlink()
    name = read_pointer(ckpt_root) if present else None
    if name is not None and (ckpt_root / name).is_dir():
        return ckpt_root / name
    folders = sorted(p for p in ckpt_root.glob("epoch_*") if p.is_dir() and epoch_of(p) is not None)
    if not folders and not present:
        return None  # a fresh run
    what = (f"{pointer} is missing beside {len(folders)} checkpoint folder(s)" if not present else
            f"{pointer} names no epoch_NNNN checkpoint folder here ({_pointer_contents(pointer)})")
    if not folders:
        raise CheckpointCorrupt(f"{what} and {ckpt_root} has none: nothing to resume from")
    if say is not None:
        say(f"{what}: resuming from the newest, {folders[-1].name}, or the newest intact one below it")
    return folders[-1]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The folder `latest` points to, or None for a fresh run. A dangling pointer is an error, not a restart."""
    target = pointed_checkpoint(ckpt_root)
    if target is not None and not (target / STATE).exists():
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
    run_config: dict | None = None
    legacy: bool = False  # its trainer state came from a trainer.pt (convert_legacy rewrites the folder)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError covers bad UTF-8 as well as bad JSON
        raise CheckpointCorrupt(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(value, dict):
        raise CheckpointCorrupt(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _read_sealed(ckpt: Path) -> tuple[bool, dict, dict | None]:
    """(verified, state.json, run_config.json or None) of checkpoint folder `ckpt`: the manifest first, so neither
    JSON file is parsed, let alone used, before its bytes are vouched for."""
    verified = verify_checkpoint(ckpt)
    path = own_file(ckpt, STATE)
    state = _read_json(path)
    for key, kind in (("epoch", int), ("global_step", int), ("learning_rate", (int, float))):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise CheckpointCorrupt(f"{path} has no valid {key!r} (got {state.get(key)!r})")
    config_path = own_file(ckpt, RUN_CONFIG)
    run_config = _read_json(config_path) if config_path.exists() else None
    if run_config is not None and not isinstance(run_config.get("config"), dict):
        raise CheckpointCorrupt(f"{config_path} holds no 'config' object")
    return verified, state, run_config


def _read_trainer(ckpt: Path, trust_legacy: bool) -> tuple[dict, bool]:
    """(the trainer state, whether it came from a legacy trainer.pt)."""
    new, legacy = own_file(ckpt, TRAINER_STATE), own_file(ckpt, LEGACY_TRAINER)
    if new.exists() or own_file(ckpt, TRAINER_TENSORS).exists():
        if legacy.exists():
            raise CheckpointCorrupt(f"{legacy} is beside {new}: which is the run's trainer state is not known")
        return read_trainer_state(ckpt), False
    if legacy.exists():
        return read_legacy_trainer(legacy, trust_legacy), True
    raise CheckpointCorrupt(f"{new} is missing (and there is no {LEGACY_TRAINER}): the checkpoint holds no optimizer "
                            "state")


def _check_trainer(trainer: dict, where: Path) -> None:
    """CheckpointCorrupt naming `where` unless the trainer state holds the optimizer, EMA and RNG states, finite."""
    ema, optimizer, rng = trainer.get("ema"), trainer.get("optimizer"), trainer.get("rng")
    per_param = optimizer.get("state", {}) if isinstance(optimizer, dict) else None
    shaped = isinstance(per_param, dict) and all(isinstance(v, dict) for v in per_param.values())
    if "ema" not in trainer or not shaped or not isinstance(rng, dict) or not {"torch", "numpy", "python"} <= set(rng) \
            or not (ema is None or isinstance(ema, dict) and isinstance(ema.get("shadow_params"), list)):
        raise CheckpointCorrupt(f"{where} does not hold the optimizer, EMA and RNG states")
    bad = nonfinite_names(_optimizer_tensors(trainer["optimizer"]))
    if ema is not None:
        bad += nonfinite_names((f"ema.shadow_params.{i}", t) for i, t in enumerate(ema["shadow_params"]))
    if bad:
        raise CheckpointCorrupt(f"{where} holds non-finite values in {_few(bad)}")


def convert_legacy_folder(ckpt: Path) -> bool:
    """Convert checkpoint folder `ckpt` to this layout when it holds a trainer.pt (the caller vouches for it, as
    trust_legacy_checkpoint does); False when it does not. Its manifest, JSON files and trainer state are checked
    first, as a resume checks them."""
    _read_sealed(ckpt)
    if not own_file(ckpt, LEGACY_TRAINER).exists():
        return False
    trainer, _ = _read_trainer(ckpt, trust_legacy=True)
    _check_trainer(trainer, ckpt / LEGACY_TRAINER)
    convert_legacy(ckpt, trainer)
    return True


def convert_legacy_folders(ckpt_root: Path, say: Callable[[str], None]) -> list[str]:
    """Convert every epoch_NNNN folder under ckpt_root still holding a trainer.pt, for a run that vouched for its
    folder (trust_legacy_checkpoint): the checkpoint a resume reads is not the only one it may come back to (the
    selected one, the one below a damaged newer one), and each would otherwise ask for the setting again. One that
    does not convert is named and left as it is. Returns the names converted."""
    done = []
    for ckpt in sorted(p for p in ckpt_root.glob("epoch_*") if p.is_dir() and epoch_of(p) is not None):
        if not (ckpt / LEGACY_TRAINER).exists():
            continue
        try:
            convert_legacy_folder(ckpt)
        except CheckpointCorrupt as e:
            say(f"not converting {ckpt}: {' '.join(str(e).split())}")
            continue
        say(f"converted {ckpt} to the pickle-free layout ({LEGACY_TRAINER} -> {TRAINER_TENSORS} + {TRAINER_STATE})")
        done.append(ckpt.name)
    return done


def read_checkpoint(ckpt: Path, model, trust_legacy: bool = False) -> Checkpoint:
    """Read checkpoint folder `ckpt` for a run with this model's layout: the manifest first, then every file parsed
    and every tensor checked finite. Raises CheckpointCorrupt naming the first file that fails, LegacyCheckpoint
    for a trainer.pt when not trust_legacy."""
    verified, state, run_config = _read_sealed(ckpt)
    trainer, legacy = _read_trainer(ckpt, trust_legacy)
    _check_trainer(trainer, ckpt / (LEGACY_TRAINER if legacy else TRAINER_TENSORS))
    # a missing weights file of a sealed checkpoint was reported above; here it means LoRA vs full fine-tuning, a
    # config mismatch that every older checkpoint shares, so it is raised as it is rather than walked past
    weights_path = model_weights_file(model, ckpt / "model")
    weights = read_weights(own_file(ckpt, weights_path.relative_to(ckpt).as_posix()))
    base_eval_path = own_file(ckpt, BASE_EVAL)
    base_eval = _read_json(base_eval_path) if base_eval_path.exists() else None
    return Checkpoint(ckpt, state, trainer, weights, weights_path, base_eval, verified, run_config, legacy)


def _newest_first(ckpt_root: Path, newest: Path) -> list[Path]:
    """`newest`, then the epoch_NNNN folders below it, newest first: the order a resume tries them in."""
    top = epoch_of(newest)
    older = sorted((p for p in ckpt_root.glob("epoch_*") if p.is_dir() and p != newest
                    and (n := epoch_of(p)) is not None and top is not None and n < top), reverse=True)
    return [newest, *older]


def read_intact(ckpt_root: Path, newest: Path, model, say: Callable[[str], None],
                trust_legacy: bool = False) -> Checkpoint:
    """`newest` read, or when it is corrupt the newest epoch_NNNN folder below it that reads intact. say() gets one
    line per skipped folder (which, and why) and one for an older, unverified checkpoint. Raises CheckpointCorrupt
    when none is intact, LegacyCheckpoint at the first legacy one when not trust_legacy (walking past it would
    resume from an older one, silently losing what it holds)."""
    reasons = []
    for ckpt in _newest_first(ckpt_root, newest):
        try:
            found = read_checkpoint(ckpt, model, trust_legacy)
        except LegacyCheckpoint:
            raise
        except CheckpointCorrupt as e:
            reasons.append(str(e))
            say(f"skipping corrupt checkpoint {ckpt.name}: {e}")
            continue
        if not found.verified:
            say(f"{ckpt} has no {MANIFEST} (written before checkpoints were checksummed): loaded unverified")
        return found
    raise CheckpointCorrupt(f"no intact checkpoint under {ckpt_root}: " + "; ".join(reasons))


def older_checkpoint(ckpt_root: Path, ckpt: Path) -> Path | None:
    """The epoch_NNNN folder a resume tries after `ckpt`, or None when there is none below it."""
    return next(iter(_newest_first(ckpt_root, ckpt)[1:]), None)


def resumable_checkpoint(ckpt_root: Path, newest: Path) -> Path:
    """The checkpoint a resume reads, for what must be known before the model exists (the config it recorded):
    `newest`, or the newest folder below it whose manifest verifies and whose state.json and run_config.json parse.
    read_intact walks the same folders in the same order, reads the rest and names what it skips. Raises
    CheckpointCorrupt when none is."""
    reasons = []
    for ckpt in _newest_first(ckpt_root, newest):
        try:
            _read_sealed(ckpt)
        except CheckpointCorrupt as e:
            reasons.append(str(e))
            continue
        return ckpt
    raise CheckpointCorrupt(f"no intact checkpoint under {ckpt_root}: " + "; ".join(reasons))
