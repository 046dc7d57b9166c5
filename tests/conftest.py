"""Shared pytest setup: every test starts from the same global RNG state."""

import sys
from pathlib import Path

import pytest
import torch

# The helpers (zoo.py, equivalence.py) live next to the tests, not in a package.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield
