"""scripts/pretrain/pretrain_motion_base.py: a run cut in two stages (--stop-at, then --resume) ends with the same
base, bit for bit, as the run in one go; a resume with other arguments is refused by name."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("pretrain_motion_base",
                                                  ROOT / "scripts" / "pretrain" / "pretrain_motion_base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ARGS = ["--steps", "4", "--batch-size", "4", "--num-train-conditions", "12", "--num-eval-conditions", "4",
        "--eval-every", "2", "--eval-steps", "2", "--save-every", "0"]


def _weights(folder: Path) -> dict:
    """The model's and the text encoder's tensors."""
    out = load_file(folder / "diffusion_pytorch_model.safetensors")
    out.update({f"text/{k}": v for k, v in load_file(folder / "text_encoder" / "model.safetensors").items()})
    return out


def test_two_stages_end_where_one_run_ends(tmp_path):
    pretrain = _script()
    torch.set_num_threads(1)
    one = pretrain.main(["--out", str(tmp_path / "one"), *ARGS])
    assert pretrain.main(["--out", str(tmp_path / "two"), *ARGS, "--stop-at", "2"]) == {"stopped_at": 2}
    assert (tmp_path / "two" / "resume" / "state.pt").is_file() and not (tmp_path / "two" / "config.json").exists()
    two = pretrain.main(["--out", str(tmp_path / "two"), *ARGS, "--resume"])
    assert not (tmp_path / "two" / "resume").exists()  # a finished base holds no resume state
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "one" / "text_encoder" / "config.json").read_text() == \
        (tmp_path / "two" / "text_encoder" / "config.json").read_text()
    assert one["history"] == two["history"] and one["final_train_loss"] == two["final_train_loss"]
    saved = json.loads((tmp_path / "two" / "provenance.json").read_text())
    assert saved["history"] == one["history"]


def test_resume_with_other_arguments_is_refused(tmp_path):
    pretrain = _script()
    pretrain.main(["--out", str(tmp_path / "r"), *ARGS, "--stop-at", "2"])
    other = [*ARGS, "--lr", "0.002"]
    with pytest.raises(SystemExit, match=r"other arguments \(\['lr'\]\)"):
        pretrain.main(["--out", str(tmp_path / "r"), *other, "--resume"])


class _Payload:
    """Unpickling this runs os.system: what a crafted resume state would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_resume_state_holding_code_is_refused_not_run(tmp_path):
    mod = _script()
    args = mod.parse_args(["--out", str(tmp_path / "out"), *ARGS])
    marker = tmp_path / "ran"
    path = mod.resume_file(args.out)
    path.parent.mkdir(parents=True)
    torch.save({"args": {}, "payload": _Payload(marker)}, path)
    with pytest.raises(SystemExit, match="cannot read the resume state"):
        mod.load_state(args.out, args)
    assert not marker.exists()
