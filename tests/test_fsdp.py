"""The trainer under PyTorch FSDP (v1), wrapped as config/accelerate/fsdp.yaml wraps it, on two CPU processes
with full sharding (tests/fsdp_cpu_run.py).

On one H100 the FSDP launch failed at its first training pass: sampling had gone through the unwrapped module,
so each wrapped block had initialised as a root of its own. On two processes more faults showed, which one GPU
cannot show: the camera blocks read their weights as shards, the checkpoint hung (only the main process gathered),
a resume changed the optimizer's moments, peft saved an empty adapter and loaded none back, and the gradient
cosine of a shard holding only LoRA's zero-initialised half was NaN, which the guard took for an overflow. These
tests failed on each of them.
"""

import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from config.grpo import get_config
from recam.domains.camera.model import ReCamTransformer3DModel
from recam.infra.checkpoint import point_latest, read_trainer_state
from recam.infra.distributed import FSDP_OPTIMIZER_LAYOUT, forward_module
from tests.smoke_runs import ROOT, SHORT, records

SIZE = ("--config.data.num_train_conditions=16", "--config.data.num_heldout_conditions=4",
        "--config.data.num_val_conditions=4", "--config.sample.num_batches_per_epoch=1", *SHORT,
        "--config.eval.freq=100", "--config.eval.num_videos=0", "--config.expected_num_processes=2")


def fsdp_run(run_dir, *overrides, check=True):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "tests" / "fsdp_cpu_run.py"), "--config", "config/grpo.py:smoke",
           "--config.logging.wandb_mode=disabled", "--config.num_threads=1", f"--config.run_dir={run_dir}", *SIZE,
           *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def weights(run_dir, epoch: int) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights: the whole model's, or the LoRA adapter's."""
    folder = run_dir / "checkpoints" / f"epoch_{epoch:04d}" / "model"
    (path,) = [folder / n for n in ("diffusion_pytorch_model.safetensors", "adapter_model.safetensors")
               if (folder / n).exists()]
    return load_file(path)


def test_forward_module_is_the_unwrapped_one_without_fsdp():
    net = torch.nn.Linear(2, 2)
    assert forward_module(net, net) is net
    wrapper = torch.nn.Sequential(net)  # any other container: forward passes use the unwrapped module
    assert forward_module(wrapper, net) is net


LORA = ("--config.model.lora_rank=4", "--config.model.lora_alpha=8")


@pytest.mark.parametrize("model", [(), LORA], ids=["full", "lora"])
def test_full_shard_on_two_processes_trains_checkpoints_whole_weights_and_resumes_exactly(tmp_path, model):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fsdp_run(straight, "--config.num_epochs=2", *model)
    # the same run as if it had died after checkpointing epoch 1: resumed from there
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "epoch_0002")
    point_latest(resumed / "checkpoints", "epoch_0001")
    fsdp_run(resumed, "--config.num_epochs=2", *model)

    steps = records(straight, "step")
    assert [s["epoch"] for s in steps] == [0, 1] and all(s["grad_norm"] > 0 for s in steps)
    log = (straight / "run.log").read_text()
    assert "resumed from" in (resumed / "run.log").read_text() and "health guard" not in log, log
    folder = straight / "checkpoints" / "epoch_0001" / "model"
    saved = weights(straight, 1)
    optimizer = read_trainer_state(folder.parent)["optimizer"]
    assert optimizer["layout"] == FSDP_OPTIMIZER_LAYOUT
    if model == LORA:  # the adapter whole: every LoRA matrix at its full shape
        assert len(saved) == 16 and all(v.shape in ((4, 96), (96, 4)) for v in saved.values())
        assert len(optimizer["state"]) == 16
    else:  # whole weights under the model's own names: the checkpoint loads as a model of the run's config
        reloaded = ReCamTransformer3DModel.from_pretrained(folder)
        assert all(torch.equal(saved[n], p) for n, p in reloaded.state_dict().items())
        for name, state in optimizer["state"].items():  # one flattened tensor per parameter and moment
            assert state["exp_avg"].numel() == state["exp_avg_sq"].numel() == saved[name].numel()
    moved = [st for st in optimizer["state"].values() if st["exp_avg"].any()]  # LoRA's A has no gradient yet
    assert moved and all(not torch.equal(st["exp_avg"], st["exp_avg_sq"]) for st in moved)
    # a run resumed from epoch 1 ends bit for bit where the straight run ends
    a, b = weights(straight, 2), weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], saved[k]) for k in a)  # and the second epoch moved the weights


def test_a_policy_copy_under_sharding_is_refused_with_the_field_named(monkeypatch):
    import recam.engine.policy as policy

    train = get_config("smoke").train
    monkeypatch.setattr(policy, "fsdp_root", lambda module: module)  # as if accelerate had wrapped it in FSDP
    net = torch.nn.Linear(2, 2)
    policy.refuse_sharded_copies(net, 1, train, object(), {})  # one process: nothing is sharded
    policy.refuse_sharded_copies(net, 2, train, None, {})  # no copy to make
    with pytest.raises(ValueError, match=r"FSDP shards the policy, and train.ema=\S+ would copy shards"):
        policy.refuse_sharded_copies(net, 2, train, object(), {})
    with pytest.raises(ValueError, match=r"its old_policy \(train.objective='grpo'\) would copy shards: run it"):
        policy.refuse_sharded_copies(net, 2, train, None, {"old_policy": net})
