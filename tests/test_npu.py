"""Device helpers (CPU/CUDA here; the NPU branch runs only where torch_npu and an NPU exist) and launch configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recam.infra import npu
from recam.infra.distributed import npu_available

ACCELERATE_DIR = Path(__file__).resolve().parents[1] / "config" / "accelerate"


def test_auto_device_is_cpu_or_cuda_without_npu():
    if npu_available():
        pytest.skip("an NPU is present; the NPU test below covers this machine")
    device = npu.get_device()
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert npu.dist_backend(device) == ("nccl" if device.type == "cuda" else "gloo")
    with pytest.raises(RuntimeError, match="torch_npu is not installed or no NPU is visible"):
        npu.memory_stats("npu")


def test_backend_names():
    assert npu.dist_backend("cpu") == "gloo"
    assert npu.dist_backend(torch.device("cpu")) == "gloo"
    assert npu.dist_backend("cuda:3") == "nccl"
    assert npu.dist_backend("npu:0") == "hccl"
    with pytest.raises(ValueError, match="unsupported device type 'xla'"):
        npu.dist_backend("xla")


def test_cpu_autocast_and_sync():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with npu.device_autocast("cpu", torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
    with npu.device_autocast("cpu", torch.float32):
        assert (a @ b).dtype == torch.float32
    with npu.device_autocast("cpu", None):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="autocast dtype"):
        npu.device_autocast("cpu", torch.float64)
    npu.synchronize("cpu")


_RSS_PROBE = """
import torch
from recam.infra import npu
before = npu.memory_stats("cpu")
block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
after = npu.memory_stats("cpu")
print(before["allocated"], before["peak"], after["allocated"], after["peak"], before["source"])
npu.reset_peak_memory("cpu")  # documented no-op on CPU, must not raise
"""


def test_cpu_memory_stats_track_rss():
    # A fresh process: inside pytest, memory freed by earlier tests stays resident (glibc keeps it),
    # so a new 64 MiB tensor can reuse it without the RSS moving.
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    before_alloc, before_peak, after_alloc, after_peak = map(int, out[:4])
    assert " ".join(out[4:]) == "process RSS"
    assert 0 < before_alloc <= before_peak
    assert after_peak >= after_alloc >= before_alloc + 32 * 1024 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_branch():
    device = torch.device("cuda")
    npu.reset_peak_memory(device)
    x = torch.ones(1024, 1024, device=device)
    npu.synchronize(device)
    stats = npu.memory_stats(device)
    assert stats["allocated"] >= x.numel() * 4 and stats["peak"] >= stats["allocated"]
    with npu.device_autocast(device, torch.float16):
        assert (x @ x).dtype == torch.float16


def test_npu_branch():
    if not npu_available():
        pytest.skip("torch_npu is not installed or no Ascend NPU is visible; the NPU branch cannot run here")
    device = npu.get_device()
    assert device.type == "npu" and npu.dist_backend(device) == "hccl"
    npu.reset_peak_memory(device)
    x = torch.ones(1024, 1024, device=device)
    npu.synchronize(device)
    stats = npu.memory_stats(device)
    assert stats["allocated"] >= x.numel() * 4
    with npu.device_autocast(device, torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------ accelerate launch configs


@pytest.mark.parametrize("name,kind,processes", [
    ("npu_8.yaml", "MULTI_NPU", 8),
    ("npu_multinode.yaml", "MULTI_NPU", 16),
    ("gpu_8.yaml", "MULTI_GPU", 8),
    ("deepspeed_zero2.yaml", "DEEPSPEED", 8),
    ("fsdp.yaml", "FSDP", 8),
])
def test_accelerate_configs_parse(name, kind, processes):
    from accelerate.commands.config.config_args import ClusterConfig

    path = ACCELERATE_DIR / name
    raw = yaml.safe_load(path.read_text())
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.distributed_type.value == kind
    assert config.num_processes == processes == raw["num_processes"]
    assert config.mixed_precision == "bf16" and not config.use_cpu
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == 2
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "WanTransformerBlock"
        # LoRA leaves most weights frozen inside each wrapped block; FSDP needs use_orig_params for that.
        assert config.fsdp_config["fsdp_use_orig_params"] is True
    if name == "npu_multinode.yaml":
        assert config.num_machines == 2 and config.num_processes == 8 * config.num_machines
