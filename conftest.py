# Makes the repository root importable (config/, recam/, rewards/) for tests run from any folder.

import os

import torch

# CI runs the suite on two cores with two xdist workers: a worker, and each training run it launches, computes on
# one thread, since two threads each oversubscribe the cores (a pair of end-to-end tests took 62 s with two threads
# each and 48 s with one).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
