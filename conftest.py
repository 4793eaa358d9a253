# Makes the repository root importable (config/, recam/, rewards/) for tests run from any folder.

import os

import pytest
import torch

# CI runs the suite on two cores with two xdist workers: a worker, and each training run it launches, computes on
# one thread, since two threads each oversubscribe the cores (a pair of end-to-end tests took 62 s with two threads
# each and 48 s with one).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """torch on one thread for the test, restored afterwards: tests of tiny tensors on a shared two-core machine,
    where a second OpenMP thread spin-waiting on a busy core only adds contention (steps ~100x slower seen)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
