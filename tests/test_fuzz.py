"""Property-based fuzzing: random architectures, fused vs the loop, float64, forward and backward.

``make test`` runs the fixed-seed ``ci`` profile (derandomized, 200 examples);
``make fuzz`` runs the ``fuzz`` profile (HFTC_FUZZ_EXAMPLES examples, default 5000).
Every failure found becomes a regression test in tests/test_fuzz_regressions.py.
"""

from __future__ import annotations

import os

import torch
from equivalence import check_equivalence
from fuzz_models import FuzzNet, architectures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", max_examples=200, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz", max_examples=int(os.environ.get("HFTC_FUZZ_EXAMPLES", "5000")), deadline=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("HFTC_FUZZ_PROFILE", "ci")


def check_spec(spec: dict, n: int, stacked: bool, train: bool, seed: int) -> None:
    log = os.environ.get("HFTC_FUZZ_LOG")  # make fuzz counts the examples it checked
    if log:
        with open(log, "a") as f:
            f.write(f"{spec['family']} n={n} stacked={stacked} train={train}\n")
    torch.manual_seed(seed)
    models = [FuzzNet(spec) for _ in range(n)]
    shape = ((n,) if stacked else ()) + tuple(spec["input"])
    x = torch.randn(shape)
    check_equivalence(models, x, in_dims=0 if stacked else None, train=train,
                      dtype=torch.float64)


@settings(settings.get_profile(PROFILE))
@given(spec=architectures, n=st.sampled_from([1, 2, 3]), stacked=st.booleans(),
       train=st.booleans(), seed=st.integers(0, 2**16))
def test_random_architectures_fuse_exactly(spec, n, stacked, train, seed):
    check_spec(spec, n, stacked, train, seed)
