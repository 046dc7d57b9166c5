"""Shared pytest setup: every test starts from the same global RNG state."""

import os
import sys
from pathlib import Path

import pytest
import torch

# The helpers (zoo.py, equivalence.py) live next to the tests, not in a package.
sys.path.insert(0, str(Path(__file__).parent))

# The suite tests the fused program (its kernels, its report): the default strategy
# ("auto") would time it against the models one by one on every first call and could run
# the loop instead. tests/test_strategy.py tests "auto" itself.
os.environ.setdefault("HFTC_STRATEGY", "fused")


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _one_thread():
    # The test models are tiny: intra-op threads cost more than they give, and on a
    # busy 2-core machine they make the suite many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
