"""The trainer under PyTorch FSDP (v1), as config/accelerate/fsdp.yaml wraps it, on the CPU (tests/fsdp_cpu_run.py).

On the H100 the FSDP launch failed at its first training pass: sampling had gone through the unwrapped module,
so each wrapped block had initialised as a root of its own. This reproduced that failure on the CPU before the fix.
"""

import socket
import subprocess
import sys

import torch

from recam.infra.distributed import forward_module
from tests.smoke_runs import ROOT, SMOKE_SIZE, records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_forward_module_is_the_unwrapped_one_without_fsdp():
    net = torch.nn.Linear(2, 2)
    assert forward_module(net, net) is net
    wrapper = torch.nn.Sequential(net)  # any other container: forward passes use the unwrapped module
    assert forward_module(wrapper, net) is net


def test_fsdp_wrapped_policy_samples_trains_evaluates_and_checkpoints(tmp_path):
    from safetensors.torch import load_file

    run_dir = tmp_path / "fsdp"
    cmd = [sys.executable, str(ROOT / "tests" / "fsdp_cpu_run.py"), str(free_port()), "--config",
           "config/grpo.py:smoke", "--config.logging.wandb_mode=disabled", "--config.num_threads=2",
           f"--config.run_dir={run_dir}", *SMOKE_SIZE]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = records(run_dir, "step")
    assert len(steps) == 2 and all(s["grad_norm"] > 0 for s in steps)  # 8 samples in micro-batches of 4
    assert [r["tag"] for r in records(run_dir, "eval")][-1] == "final"
    weights = load_file(run_dir / "checkpoints" / "epoch_0001" / "model" / "diffusion_pytorch_model.safetensors")
    assert weights and not any("_fsdp" in k or k.startswith("module.") for k in weights)  # the model's own names
