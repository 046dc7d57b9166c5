"""Property-based fuzzing: random architectures, fused vs the loop, forward and backward.

In float64 with the harness's tolerance, and (every lowering) in float32, where the CPU
runs other kernels (oneDNN convolutions), with a tolerance set by the float32 loop's own
distance from float64 (:func:`equivalence.loop_rounding_error`); and three training
steps with each fused optimizer against stock optimizers on the original models.

``make test`` runs the fixed-seed ``ci`` profile (derandomized; 200 examples, fewer for
the slower tests); ``make fuzz`` runs the ``fuzz`` profile (HFTC_FUZZ_EXAMPLES examples
per test, default 5000); both in tests/fuzz_profiles.py.
Every failure found becomes a regression test in tests/test_fuzz_regressions.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from unittest import mock

import torch
from equivalence import DEFAULT_TOL, check_equivalence, loop_rounding_error
from fuzz_models import FuzzNet, architectures, without_dropout
from fuzz_profiles import FUZZ, examples
from hypothesis import assume, given
from hypothesis import strategies as st

import hftc
import hftc.module.fused
import hftc.optim as ho
from hftc.lowering import autotune, pipeline
from hftc.lowering.check import preserved_state
from hftc.lowering.runtime.tuning import lowerings_of


def check_spec(spec: dict, n: int, stacked: bool, train: bool, seed: int,
               fuser=None, dtype: torch.dtype = torch.float64, **check) -> None:
    """``check``: more of :func:`check_equivalence`'s arguments (steps, optimizers)."""
    log = os.environ.get("HFTC_FUZZ_LOG")  # make fuzz counts the examples it checked
    if log:
        with open(log, "a") as f:
            # The whole example, flushed before it runs: a crash's example is the last line.
            f.write(f"{spec!r} n={n} stacked={stacked} train={train} seed={seed} "
                    f"dtype={dtype} {check}\n")
    if train:
        spec = without_dropout(spec)  # hftc draws its own masks: see test_fuzz_families
    torch.manual_seed(seed)
    models = [FuzzNet(spec, i) for i in range(n)]
    shape = ((n,) if stacked else ()) + tuple(spec["input"])
    x = torch.randn(shape)
    in_dims = 0 if stacked else None
    tol = None
    if dtype != torch.float64:
        # The loop's own distance from float64 sets the bar (ill-conditioned specs, such
        # as a layer norm over two features, round far above the fixed tolerance); specs
        # too ill-conditioned to tell rounding from a wrong result are not examples.
        # The factor: the loop's error is one sample of its order's rounding; a sum that
        # cancels to ~0 (a conv's bias gradient before a training-mode batch norm) came
        # out 17x the loop's error with oneDNN's channels-last reduction order (3.5e-4
        # vs 2.1e-5, terms of ~100); wrong results are off by their whole scale.
        rounding = loop_rounding_error(models, x, in_dims=in_dims, train=train, dtype=dtype)
        assume(rounding < 1e-4)
        tol = max(DEFAULT_TOL[dtype], 30 * rounding)
    check_equivalence(models, x, in_dims=in_dims, train=train, dtype=dtype, fuser=fuser,
                      tol=tol, **check)


#: Model counts: mostly few (fast), sometimes as many as a sweep's array.
MODEL_COUNTS = st.sampled_from([1, 2, 3, 2, 3, 5, 8])


@FUZZ
@given(spec=architectures, n=MODEL_COUNTS, stacked=st.booleans(),
       train=st.booleans(), seed=st.integers(0, 2**16))
def test_random_architectures_fuse_exactly(spec, n, stacked, train, seed):
    check_spec(spec, n, stacked, train, seed)


@contextlib.contextmanager
def random_lowerings(pick: random.Random):
    """Autotune with a random lowering per node, and a random one of the ways to run the
    whole forward that run (fused with those lowerings or the cost model's, or whole-model
    loop; inputs as given or channels-last), instead of the timed choice: every lowering a
    kernel lists must be exact anywhere."""
    def tune_call(kernel, args, kwargs, grad_flags, *, node="?", path=None):
        names = lowerings_of(kernel)(*args, **kwargs)
        return autotune.LoweringChoice(node, kernel.__name__, pick.choice(names), names[0])

    def choose_program(fused, forward, values, batched, *, backward, **kwargs):
        with preserved_state(fused):
            valid, _ = autotune.program_candidates(
                fused, forward, values, batched, backward=backward,
                channels_last=kwargs.get("channels_last", True),
                cost_model=kwargs.get("cost_model"))
        how = pick.choice(list(valid.values()))
        return how, autotune.LoweringChoice("<whole model>", "forward", how.name, "fused")

    with mock.patch.object(autotune, "tune_call", tune_call), \
            mock.patch.object(pipeline, "choose_program", choose_program):
        yield


@examples(ci=60)
@given(spec=architectures, n=st.sampled_from([2, 3, 8]), stacked=st.booleans(),
       train=st.booleans(), seed=st.integers(0, 2**16), pick=st.randoms(use_true_random=False))
def test_random_architectures_with_random_lowerings(spec, n, stacked, train, seed, pick):
    with random_lowerings(pick):
        check_spec(spec, n, stacked, train, seed,
                   fuser=functools.partial(hftc.fuse, autotune=True))


@examples(ci=60)
@given(spec=architectures, n=st.sampled_from([2, 3, 8]), stacked=st.booleans(),
       train=st.booleans(), seed=st.integers(0, 2**16), pick=st.randoms(use_true_random=False))
def test_random_architectures_in_float32_with_random_lowerings(spec, n, stacked, train, seed,
                                                                pick):
    """float32 takes other kernels than float64 on the CPU (oneDNN convolutions, in
    channels-last too), so every lowering is fuzzed in float32 as well."""
    with random_lowerings(pick):
        check_spec(spec, n, stacked, train, seed, dtype=torch.float32,
                   fuser=functools.partial(hftc.fuse, autotune=True))


# Per-model settings of each optimizer: (hftc.optim class, torch.optim class, model i's).
# Adam and RMSprop step by g / (sqrt(v) + eps): a gradient that is 0 in exact arithmetic
# (a conv's bias before a training-mode batch norm) comes out as rounding noise of
# either sign, ~1e-16 in the loop and ~1e-14 in another summation order, and with the
# default eps = 1e-8 that noise moves the bias by lr * noise / eps (8.7e-10 after two
# steps, against the 1e-10 tolerance: a float64 false alarm).  eps = 1e-3 keeps the
# noise at rounding level; the update's own arithmetic, every eps included, is checked
# bit for bit against stock in tests/test_fuzz_optim.py.
TRAINING = {
    "sgd": (ho.SGD, torch.optim.SGD,
            lambda i: dict(lr=0.01 * (i + 1), momentum=0.9 * (i % 2), weight_decay=1e-3 * i)),
    "adam": (ho.Adam, torch.optim.Adam,
             lambda i: dict(lr=1e-3 * (i + 1), betas=((0.9, 0.999), (0.8, 0.99))[i % 2],
                            amsgrad=i == 1, eps=1e-3)),
    "adamw": (ho.AdamW, torch.optim.AdamW,
              lambda i: dict(lr=1e-3 * (i + 1), weight_decay=0.1 * i, eps=1e-3)),
    "rmsprop": (ho.RMSprop, torch.optim.RMSprop,
                lambda i: dict(lr=1e-3 * (i + 1), momentum=0.5 * i, centered=i == 2, eps=1e-3)),
}


@examples(ci=25)
@given(spec=architectures, n=st.sampled_from([2, 3]), stacked=st.booleans(),
       seed=st.integers(0, 2**16), pick=st.randoms(use_true_random=False),
       optimizer=st.sampled_from(sorted(TRAINING)))
def test_random_architectures_train_with_fused_optimizers(spec, n, stacked, seed, pick,
                                                         optimizer):
    """Three training steps, in train mode (batch norms update their running statistics)
    with a random lowering per node: each model's parameters, buffers and gradients
    after every step equal its own stock optimizer's run on the original model."""
    fused_cls, stock_cls, settings_of = TRAINING[optimizer]
    per_model = [settings_of(i) for i in range(n)]

    def fused_optimizer(fused):
        return fused_cls(fused, **{k: [s[k] for s in per_model] for k in per_model[0]})

    def model_optimizer(i, model):
        return stock_cls(model.parameters(), **per_model[i])

    with random_lowerings(pick):
        check_spec(spec, n, stacked, True, seed, steps=3,
                   optimizers=(fused_optimizer, model_optimizer),
                   fuser=functools.partial(hftc.fuse, autotune=True))
