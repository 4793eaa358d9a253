import importlib.util

import pytest
import torch

from recam.engine.advantages import local_slice
from recam.infra.distributed import npu_available, select_device


def test_device_selection_prefers_npu_then_cuda_then_cpu():
    d = select_device()
    if importlib.util.find_spec("torch_npu") is None:
        assert not npu_available()
        assert d.type == ("cuda" if torch.cuda.is_available() else "cpu")
    else:
        assert d.type == ("npu" if npu_available() else ("cuda" if torch.cuda.is_available() else "cpu"))


def test_npu_branch_skipped_with_reason_when_absent():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu present: the absent-NPU path is not reachable here")
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        select_device("npu")


def test_local_slice_inverts_rank_order_concat():
    per_rank = [torch.arange(6).reshape(3, 2) + 100 * r for r in range(4)]
    gathered = torch.cat(per_rank)  # what accelerator.gather returns: rank order
    for r in range(4):
        assert torch.equal(local_slice(gathered, r, 4), per_rank[r])
    with pytest.raises(ValueError, match="not divisible"):
        local_slice(torch.zeros(5), 0, 2)
