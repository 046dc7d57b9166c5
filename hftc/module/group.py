"""``hftc.fuse_groups``: split a mixed list of models into fusable groups and fuse each.

A sweep over widths (or any architectural hyper-parameter) gives models that
cannot all be fused together, but do fall into groups that can.  Each model is
traced once and keyed by the signature of its graph in trace order (the same
signatures the matcher compares); models with equal keys are fused together.

    groups = hftc.fuse_groups(models)       # [(fused, [indices]), ...]
    for fused, indices in groups:
        out = fused(x)                      # out[j] == models[indices[j]](x)

With ``pad_widths=True``, groups that differ only in widths are padded into one array
where that costs little, and split where it costs much (:func:`pad_or_split`)::

    widths 64, 64, 96, 128, 512, 512  ->  [64, 64, 96, 128] padded to 128 (1.21x the
                                          arithmetic), [512, 512] apart (padding them
                                          in too would be 3.2x)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ..errors import FusionArgumentError, MismatchError, TraceError, UnsupportedOperatorError
from ..frontends.same_program import alike_models
from ..frontends.symbolic import (
    constant_inputs,
    number_groups,
    trace_model,
    trace_number_variants,
)
from ..lowering import timing
from ..match import ELEMENTWISE, node_signature
from ..passes.differing_ops import op_input
from ..passes.registry import aten_spellings, per_model_table
from .fused import FusedModule, check_models, example_constants, takes_one_list_of_models
from .padding import padding_ratio, weight_shapes, widths_key


def structure_key(model: nn.Module, index: int, example_inputs: Any = None,
                  traced: fx.GraphModule | None = None) -> str:
    """A string equal for two models exactly when their traced graphs match in trace order.

    Traced symbolically (or ``traced``, the model's graph already made), or, where that
    fails and ``example_inputs`` (shared by all models) are given, by torch.export, as
    :func:`hftc.fuse` would trace them."""
    try:
        gm = traced if traced is not None else trace_model(
            model, index, training=model.training,
            constants=example_constants(model, example_inputs))
    except TraceError:
        if example_inputs is None:
            raise
        from ..frontends.export import export_model

        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        gm = export_model(model, index, training=model.training, args=args,
                          aten_spellings=aten_spellings())
    position: dict[fx.Node, int] = {}
    soft, parts = per_model_table(), []
    for node in gm.graph.nodes:
        sig = node_signature(node, gm, soft)
        if ELEMENTWISE in sig and node.op == "call_function" \
                and isinstance(op_input(node), fx.Node):
            # an activation or dropout function stands for its input: models whose Python
            # skips one (`if self.drop_rate > 0: F.dropout(...)`) fuse as one (hftc.match)
            position[node] = position[op_input(node)]
            continue
        position[node] = len(parts)
        inputs = [position[a] for a in node.all_input_nodes]
        parts.append(repr((sorted(sig.items(), key=lambda kv: kv[0]), inputs)))
    return "\n".join(parts)


#: ``fuse_groups(..., pad_widths=True)``'s default ``max_padding``: pad widths into one
#: array while it does at most this many times the models' own arithmetic (the case that
#: set it: docs/DESIGN_NOTES.md, "Padding's limit").
MAX_PADDING = 1.25


def pad_or_split(models: Sequence[nn.Module], groups: Sequence[list[int]],
                 max_padding: float,
                 measured: Callable[[list[int], list[int]], tuple[float, float] | None]
                 | None = None) -> list[tuple[list[int], str]]:
    """Structurally identical ``groups`` (model indices) joined into arrays padded to their
    widest where that is cheaper, and each array's reason.

    Groups alike up to widths (:func:`hftc.module.padding.widths_key`) are taken largest first,
    each joining the current array where ``measured(current, group)`` (the step times of
    the two padded into one array and of the two apart, or None) says one array is
    faster; without a measurement, while :func:`hftc.module.padding.padding_ratio` of the joined
    array stays within ``max_padding``.  Neighbouring widths share an array, far ones
    do not."""
    families: dict[str, list[list[int]]] = {}
    for indices in groups:
        families.setdefault(widths_key(models[indices[0]]), []).append(indices)
    shapes = {i: weight_shapes(models[i]) for indices in groups for i in indices}
    arrays: list[tuple[list[int], str]] = []
    for family in families.values():
        if len(family) == 1:
            arrays.append((family[0], "one width"))
            continue
        family = sorted(family, key=lambda g: -sum(s.numel() for s in shapes[g[0]].values()))
        current: list[int] = list(family[0])
        why_joined = ""  # the last join's measurement, for the array's reason
        for group in family[1:]:
            joined = current + group
            ratio = padding_ratio([shapes[i] for i in joined])
            times = measured(current, group) if measured is not None else None
            if times is not None:
                padded_s, apart_s = times
                verdict = (f"measured {padded_s * 1e3:.3g} ms a step padded into one array vs "
                           f"{apart_s * 1e3:.3g} ms apart ({ratio:.2f}x the models' own "
                           f"arithmetic padded)")
                # the one tie rule: one array unless apart is faster by timing.MARGIN
                if timing.choose({"pad": padded_s, "split": apart_s}, "pad") == "pad":
                    current, why_joined = joined, verdict
                    continue
                arrays.append((sorted(current), _padding_reason(
                    current, shapes, max_padding, why_joined,
                    apart=f"the next narrower models are apart: {verdict}")))
            else:
                if ratio <= max_padding:
                    current, why_joined = joined, ""
                    continue
                arrays.append((sorted(current), _padding_reason(
                    current, shapes, max_padding, why_joined,
                    apart=f"the next narrower models are apart: padding them in would be "
                          f"{ratio:.2f}x (> max_padding={max_padding}), estimated")))
            current, why_joined = list(group), ""
        arrays.append((sorted(current), _padding_reason(current, shapes, max_padding,
                                                        why_joined)))
    return sorted(arrays, key=lambda a: a[0][0])


def _padding_reason(indices: list[int], shapes: dict[int, dict], max_padding: float,
                    measured: str = "", apart: str = "") -> str:
    ratio = padding_ratio([shapes[i] for i in indices])
    widths = len({tuple(tuple(s) for s in shapes[i].values()) for i in indices})
    if widths == 1:
        reason = "one width"
    elif measured:
        reason = f"{widths} widths padded into one array: {measured}"
    else:
        reason = (f"{widths} widths padded into one array: {ratio:.2f}x the models' own "
                  f"arithmetic (<= max_padding={max_padding}), estimated")
    return f"{reason}; {apart}" if apart else reason


# ---------------------------------------------------------------- measured grouping cost
#
# fuse_groups(..., pad_widths=True, autotune=True) times, on the real example inputs, each
# pad-or-split decision (one padded array against the two arrays apart, forward and
# backward) and keeps the times in ``grouping.json`` next to the timing cache
# (:mod:`hftc.lowering.timing`); later calls (a sweep fuses an array per round) read them
# instead of the estimate.

def _grouping_path() -> Path:
    return timing.cache_path().with_name("grouping.json")


def grouping_key(models: Sequence[nn.Module], example_inputs: Any) -> str:
    """The measured-cost table's key for padding ``models`` into one array or not: the
    device and software (:func:`hftc.lowering.timing.device_key`), the structure up to
    widths, each model's weight shapes in order, and the inputs' shapes and dtypes."""
    tensors = [t for t in tree_leaves(example_inputs) if isinstance(t, Tensor)]
    first = next(iter(models[0].parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None else torch.get_default_dtype()
    return json.dumps(["grouping-1", timing.device_key(device), str(dtype),
                       hashlib.sha1(widths_key(models[0]).encode()).hexdigest(),
                       [[list(s) for s in weight_shapes(m).values()] for m in models],
                       [[list(t.shape), str(t.dtype)] for t in tensors]])


def record_grouping_cost(key: str, padded_s: float, apart_s: float) -> None:
    """Store a measured step time of one padded array (``padded_s``) and of the same models
    in their arrays apart (``apart_s``) under :func:`grouping_key`'s ``key``."""
    times = {"pad": padded_s, "split": apart_s}
    timing.store_entry(key, {"chosen": timing.choose(times, "pad"),
                               "times": {"pad": padded_s, "split": apart_s}},
                         _grouping_path())


def grouping_cost(key: str) -> tuple[float, float] | None:
    """The recorded ``(padded_s, apart_s)`` for ``key``, or None."""
    entry = timing.lookup_entry(key, _grouping_path())
    if entry is None or set(entry["times"]) != {"pad", "split"}:
        return None
    return entry["times"]["pad"], entry["times"]["split"]


def _step(fused: FusedModule, args: tuple) -> None:
    """One forward and backward of every output's sum (what a training step costs)."""
    out = fused(*args)
    loss = sum(t.float().sum() for t in tree_leaves(out) if isinstance(t, Tensor)
               and t.requires_grad)
    if isinstance(loss, Tensor):
        loss.backward()


def _measure_grouping(models: Sequence[nn.Module], current: list[int], group: list[int],
                      args: tuple, fuse_kwargs: dict[str, Any]) -> tuple[float, float]:
    """Median step times, interleaved rounds: ``current + group`` padded into one array,
    and ``current`` and ``group`` as two arrays.  The global random state is left as it
    was (dropout draws of the timing runs are not the caller's)."""
    def make(indices: list[int]) -> FusedModule:
        return FusedModule([models[i] for i in indices], **fuse_kwargs)

    padded, apart = make(current + group), [make(current), make(group)]
    device = args[0].device if args and isinstance(args[0], Tensor) else torch.device("cpu")
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        for candidate in [padded, *apart]:  # untimed: compile, autotune, first-call check
            _step(candidate, args)
        times = timing.medians(timing.measure(
            {"pad": lambda: _step(padded, args),
             "split": lambda: [_step(fused, args) for fused in apart]}, device))
    return times["pad"], times["split"]


def _grouping_measurement(models: Sequence[nn.Module], example_inputs: Any,
                          fuse_kwargs: dict[str, Any]
                          ) -> Callable[[list[int], list[int]], tuple[float, float] | None]:
    """``measured`` for :func:`pad_or_split`: with ``autotune=True``, the table's entry,
    else a new measurement, stored; without it None, whatever the table holds: the
    estimate decides, so the arrays (and so the bits) are the same every run."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)

    def measured(current: list[int], group: list[int]) -> tuple[float, float] | None:
        if example_inputs is None or not fuse_kwargs.get("autotune"):
            return None
        key = grouping_key([models[i] for i in current + group], example_inputs)
        found = grouping_cost(key)
        if found is not None:
            return found
        try:
            padded_s, apart_s = _measure_grouping(models, current, group, args, fuse_kwargs)
        except (MismatchError, UnsupportedOperatorError):
            return None  # not paddable: fuse_groups splits them and says why
        record_grouping_cost(key, padded_s, apart_s)
        return padded_s, apart_s

    return measured


def _number_variants(models: Sequence[nn.Module], alike: list[int],
                     example: Any) -> dict[int, fx.GraphModule]:
    """The graphs of the first models of the groups that differ from the first group's
    only in float attributes (dropout p), from one trace (frontends/numbers.py)."""
    firsts = [i for i in dict.fromkeys(alike)
              if models[i].training == models[alike[0]].training]
    if len(firsts) < 2:
        return {}
    constants = {i: example_constants(models[i], example) for i in firsts}
    constants = {i: constant_inputs(models[i]) if c is None else c
                 for i, c in constants.items()}  # (trace_model's default)
    numbers = number_groups(models, firsts, constants)
    if not numbers:
        return {}
    return trace_number_variants(models, numbers, models[firsts[0]].training, constants)


def _check_max_padding(max_padding: Any) -> None:
    if isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) or \
            not max_padding >= 1:
        raise FusionArgumentError(
            f"max_padding must be a number >= 1 (the padded arithmetic over the models' "
            f"own that fuse_groups may pad into one array), got {max_padding!r}")


def _arrays(models: list[nn.Module], max_padding: Any, fuse_kwargs: dict[str, Any]
            ) -> tuple[list[tuple[list[int], str]], dict[str, list[int]]]:
    """The arrays to fuse (indices, why together) and the structure groups (structure key
    -> indices), each in order of its first model."""
    _check_max_padding(max_padding)
    # Shared example inputs also trace the models that only torch.export can read.
    shared = fuse_kwargs.get("in_dims") is None and fuse_kwargs.get("frontend") != "symbolic"
    example = fuse_kwargs.get("example_inputs") if shared else None
    # Models proved to run one program (same code, equal Python state: same_program.py)
    # have one structure key: trace or export only the first of them.
    alike = alike_models(models)
    traced = _number_variants(models, alike, example)
    keys: dict[int, str] = {}
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(models):
        if alike[i] not in keys:
            keys[alike[i]] = structure_key(m, i, example, traced.get(alike[i]))
        groups.setdefault(keys[alike[i]], []).append(i)
    if fuse_kwargs.get("pad_widths"):
        arrays = pad_or_split(models, list(groups.values()), max_padding,
                              _grouping_measurement(models, example, fuse_kwargs))
    else:
        arrays = [(indices, "one structure") for indices in groups.values()]
    return arrays, groups


def group_models(models: Iterable[nn.Module], *, max_padding: float = MAX_PADDING,
                 **fuse_kwargs: Any) -> list[tuple[list[int], str]]:
    """The arrays :func:`fuse_groups` would fuse, without fusing them: ``[(indices, why),
    ...]`` in order of each array's first model (a sweep re-fuses only the arrays whose
    trials changed and keeps the others as they are). With ``pad_widths=True`` an array
    that fails to pad is split by fusing it; this does not try."""
    return _arrays(check_models(models), max_padding, fuse_kwargs)[0]


@takes_one_list_of_models
def fuse_groups(
    models: Iterable[nn.Module], *, max_padding: float = MAX_PADDING, **fuse_kwargs: Any
) -> list[tuple[FusedModule, list[int]]]:
    """Partition ``models`` into structurally identical groups and fuse each.

    Returns ``[(fused_module, indices), ...]`` in order of each group's first model;
    ``indices`` are positions in ``models``, so ``fused(x)[j]`` is
    ``models[indices[j]](x)``.  ``fuse_kwargs`` go to :func:`hftc.fuse`.  With
    ``pad_widths=True``, groups that differ only in widths share an array where padding
    them costs at most ``max_padding`` times their own arithmetic (:func:`pad_or_split`);
    each fused module's ``grouping`` says why it holds what it holds.
    """
    models = check_models(models)
    arrays, groups = _arrays(models, max_padding, fuse_kwargs)
    by_model = {i: indices for indices in groups.values() for i in indices}
    fused_arrays = []
    for indices, reason in arrays:
        try:
            fused = FusedModule([models[i] for i in indices], **fuse_kwargs)
        except (MismatchError, UnsupportedOperatorError) as exc:
            if all(by_model[i] == indices for i in indices):
                raise  # one width: nothing padded, the error is the models'
            # widths that cannot be padded (a module's own parameter of another width):
            # each structure group on its own, the reason said
            split = sorted({tuple(by_model[i]) for i in indices})
            fused_arrays += [(FusedModule([models[i] for i in part], **fuse_kwargs),
                              list(part), f"not padded with the other widths ({exc})")
                             for part in split]
            continue
        fused_arrays.append((fused, indices, reason))
    for fused, _, reason in fused_arrays:
        #: why fuse_groups put these models in one array (and the next ones apart)
        fused.grouping = reason
    return sorted(((fused, indices) for fused, indices, _ in fused_arrays),
                  key=lambda pair: pair[1][0])
