"""Shared pytest setup: every test starts from the same global RNG state."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The helpers (zoo.py, equivalence.py) live next to the tests, not in a package.
sys.path.insert(0, str(Path(__file__).parent))

# The suite tests the fused program (its kernels, its report): the default strategy
# ("auto") would time it against the models one by one on every first call and could run
# the loop instead. tests/test_strategy.py tests "auto" itself.
os.environ.setdefault("HFTC_STRATEGY", "fused")

# Autotune's and fuse_groups' timing caches in a directory of the suite's own: a test that
# expects a first call to be timed must not find a choice an earlier run (a user's sweep,
# `make demo`, a previous CI attempt) left in ~/.cache/hftc.
_CACHE_DIR = tempfile.mkdtemp(prefix="hftc-test-cache-")
os.environ["HFTC_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


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


@pytest.fixture(autouse=True)
def _deterministic_mode_restored():
    # Lightning's Trainer(deterministic=True) turns torch.use_deterministic_algorithms on
    # for the process, under which hftc times nothing (strategy="timed", autotune): each
    # test starts with the mode it found.
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
