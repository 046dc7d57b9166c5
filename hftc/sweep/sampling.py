"""A sampler whose draws for trial k depend on nothing but the study's seed, k, what is
drawn and the trials before k: the same parameters however often the sweep was killed.

Optuna's samplers draw from one random stream, in the order trials are asked::

    uninterrupted:  ask 0, 1, 2, 3 | ask 4, 5 ...         stream: d0 d1 d2 d3 d4 d5
    killed, resumed: ask 0, 1, 2 | (kill) new process, new stream: trial 3 gets d0'

so a resumed worker asked other parameters than the uninterrupted one, wherever the stream
it restored (if any) stood. :class:`TrialSeededSampler` reseeds the wrapped sampler's
random streams before each call that may draw, from ``(seed, trial number, the call, the
stream's attribute path)``::

    trial k, param "lr":  streams <- seed_of(seed, k, "param:lr", path); draw

so each draw is a pure function of that key and of the history the sampler reads (the
study's trials), and the sweep makes that history the uninterrupted run's (engine.py).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

__all__ = ["TrialSeededSampler", "draw_seed", "grid_left", "random_streams"]


def draw_seed(*key: Any) -> int:
    """A 32-bit seed from ``key`` (ints and strings), the same in every process (unlike
    ``hash()``, which Python salts per process for strings)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def random_streams(sampler: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(attribute path, stream)`` for every random stream ``sampler`` draws from: a
    NumPy ``RandomState`` (Optuna's ``LazyRandomState`` holds one), a NumPy
    ``Generator`` or a ``random.Random``, in the sampler and in the samplers it holds
    (TPE's ``_random_sampler``, CMA-ES's ``_independent_sampler``, ...)."""
    for name, value in sorted(vars(sampler).items()):
        where = f"{path}{name}"
        if isinstance(value, (np.random.RandomState, np.random.Generator, random.Random)):
            yield where, value
        elif isinstance(getattr(value, "rng", None), np.random.RandomState):
            yield where, value.rng  # Optuna's LazyRandomState
        elif isinstance(value, optuna.samplers.BaseSampler):
            yield from random_streams(value, f"{where}.")


def _reseed(stream: Any, seed: int) -> None:
    if isinstance(stream, np.random.RandomState):
        stream.seed(seed)
    elif isinstance(stream, np.random.Generator):
        stream.bit_generator.state = type(stream.bit_generator)(seed).state
    else:
        stream.seed(seed)


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """``sampler``, with every random stream reseeded before each of its calls from
    ``(seed, trial.number, the call, the stream's path)`` (see the module docstring).

    The calls: ``before_trial`` (a GridSampler picks its grid point there),
    ``sample_relative`` (TPE samples all its multivariate parameters at once),
    ``sample_independent`` (one parameter, keyed by its name) and ``after_trial``.
    The wrapped sampler's own seed does not matter, only ``seed``; every other attribute
    (``is_exhausted``, ``_n_startup_trials`` ...) is the wrapped sampler's. A sampler
    keeping randomness the sweep cannot find (not in one of :func:`random_streams`'
    kinds) keeps drawing from its own stream, and a resumed sweep may ask other
    parameters for it."""

    def __init__(self, sampler: optuna.samplers.BaseSampler, seed: int):
        self.wrapped = sampler
        self.seed = int(seed)

    def __getattr__(self, name: str) -> Any:
        # (only for attributes not found on the wrapper: the wrapped sampler's own)
        wrapped = self.__dict__.get("wrapped")
        if wrapped is None:
            raise AttributeError(name)
        return getattr(wrapped, name)

    def __repr__(self) -> str:
        return f"TrialSeededSampler({self.wrapped!r}, seed={self.seed})"

    def _seed_for(self, trial: FrozenTrial, call: str) -> None:
        for path, stream in random_streams(self.wrapped):
            _reseed(stream, draw_seed(self.seed, trial.number, call, path))

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._seed_for(trial, "before_trial")
        self.wrapped.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial,
                                    ) -> dict[str, BaseDistribution]:
        return self.wrapped.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        self._seed_for(trial, "sample_relative")
        return self.wrapped.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        self._seed_for(trial, f"sample_independent:{param_name}")
        return self.wrapped.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._seed_for(trial, "after_trial")
        self.wrapped.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.wrapped.reseed_rng()


def grid_left(study: optuna.Study) -> int | None:
    """How many points of a ``GridSampler`` 's grid no trial has taken (``None``: another
    sampler).  Asked N at a time past them, the grid would repeat points (Optuna gives a
    running grid's points to no other trial while some are free), where study.optimize
    stops: the sampler's ``after_trial`` calls ``study.stop()`` at the last one.

    A ``BruteForceSampler`` 's too (a define-by-run grid): at least this many points no
    trial has taken, as far as the trials so far show its space (1 before any shows it)."""
    sampler = study.sampler
    while isinstance(sampler, TrialSeededSampler):  # hftc sweep's wrapper: the grid inside
        sampler = sampler.wrapped
    if isinstance(sampler, optuna.samplers.BruteForceSampler):
        return _brute_force_left(sampler, study)
    grids = getattr(sampler, "_all_grids", None)
    same = getattr(sampler, "_same_search_space", None)
    if not isinstance(sampler, optuna.samplers.GridSampler) or grids is None or same is None:
        return None
    taken = set()
    for t in study.get_trials(deepcopy=False):
        attrs = t.system_attrs
        if "grid_id" in attrs and same(attrs.get("search_space", {})):
            taken.add(attrs["grid_id"])  # finished or running: either way not free
    return len(grids) - len(taken)


def _brute_force_left(sampler: optuna.samplers.BruteForceSampler, study: optuna.Study
                      ) -> int | None:
    """The branches of ``sampler`` 's tree of the study's trials that no trial has taken
    (each holds one free point at least): the tree its ``after_trial`` builds to decide
    ``study.stop()``, with the running trials too (asked N at a time, a done tree would
    give the last ones repeated points, where study.optimize stops at it)."""
    from optuna.samplers._brute_force import _TreeNode

    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.FAIL)
    trials = [t for t in study._storage.get_all_trials(study._study_id, deepcopy=False,
                                                       states=states) if t.params]
    tree = _TreeNode()
    try:
        sampler._populate_tree(tree, trials, {})
    except ValueError:  # a space it cannot enumerate (a float without step): the sampler's
        return None     # own error comes at its next draw, as in study.optimize
    if tree.children is None:  # no trial has shown the space yet: the first one will
        return 1
    return tree.count_unexpanded(exclude_running=not sampler._avoid_premature_stop)
