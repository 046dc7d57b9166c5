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

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from .errors import FusionArgumentError, MismatchError, TraceError, UnsupportedOperatorError
from .frontends.same_program import alike_models
from .frontends.symbolic import trace_model
from .fused import FusedModule, _check_models, _example_constants
from .match import node_signature
from .padding import padding_ratio, weight_shapes, widths_key
from .passes.registry import aten_spellings, per_model_table


def structure_key(model: nn.Module, index: int, example_inputs: Any = None) -> str:
    """A string equal for two models exactly when their traced graphs match in trace order.

    Traced symbolically, or, where that fails and ``example_inputs`` (shared by all
    models) are given, by torch.export, as :func:`hftc.fuse` would trace them."""
    try:
        gm = trace_model(model, index, training=model.training,
                         constants=_example_constants(model, example_inputs))
    except TraceError:
        if example_inputs is None:
            raise
        from .frontends.export import export_model

        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        gm = export_model(model, index, training=model.training, args=args,
                          aten_spellings=aten_spellings())
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    soft, parts = per_model_table(), []
    for node in gm.graph.nodes:
        sig = node_signature(node, gm, soft)
        inputs = [position[a] for a in node.all_input_nodes]
        parts.append(repr((sorted(sig.items(), key=lambda kv: kv[0]), inputs)))
    return "\n".join(parts)


#: ``fuse_groups(..., pad_widths=True)``'s default ``max_padding``: pad widths into one
#: array while it does at most this many times the models' own arithmetic (on one CPU
#: thread padding 2.39x cost 2.6x the serial step: docs/BENCHMARKS.md).
MAX_PADDING = 1.25


def pad_or_split(models: Sequence[nn.Module], groups: Sequence[list[int]],
                 max_padding: float) -> list[tuple[list[int], str]]:
    """Structurally identical ``groups`` (model indices) joined into arrays padded to their
    widest where the padded arithmetic is at most ``max_padding`` times the models' own,
    and each array's reason.

    Groups alike up to widths (:func:`hftc.padding.widths_key`) are taken largest first,
    each joining the current array while :func:`hftc.padding.padding_ratio` of the joined
    array stays within ``max_padding``, else starting the next array: neighbouring widths
    share an array, far ones do not."""
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
        for group in family[1:]:
            joined = current + group
            ratio = padding_ratio([shapes[i] for i in joined])
            if ratio <= max_padding:
                current = joined
                continue
            arrays.append((sorted(current), _padding_reason(current, shapes, max_padding,
                                                            split_at=ratio)))
            current = list(group)
        arrays.append((sorted(current), _padding_reason(current, shapes, max_padding)))
    return sorted(arrays, key=lambda a: a[0][0])


def _padding_reason(indices: list[int], shapes: dict[int, dict], max_padding: float,
                    split_at: float | None = None) -> str:
    ratio = padding_ratio([shapes[i] for i in indices])
    widths = len({tuple(tuple(s) for s in shapes[i].values()) for i in indices})
    reason = (f"{widths} widths padded into one array: {ratio:.2f}x the models' own "
              f"arithmetic (<= max_padding={max_padding})" if widths > 1 else "one width")
    if split_at is not None:
        reason += (f"; the next narrower models are apart: padding them in would be "
                   f"{split_at:.2f}x (> max_padding={max_padding})")
    return reason


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
    models = _check_models(models)
    if isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) or \
            not max_padding >= 1:
        raise FusionArgumentError(
            f"max_padding must be a number >= 1 (the padded arithmetic over the models' "
            f"own that fuse_groups may pad into one array), got {max_padding!r}")
    # Shared example inputs also trace the models that only torch.export can read.
    shared = fuse_kwargs.get("in_dims") is None and fuse_kwargs.get("frontend") != "symbolic"
    example = fuse_kwargs.get("example_inputs") if shared else None
    # Models proved to run one program (same code, equal Python state: same_program.py)
    # have one structure key: trace or export only the first of them.
    alike = alike_models(models)
    keys: dict[int, str] = {}
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(models):
        if alike[i] not in keys:
            keys[alike[i]] = structure_key(m, i, example)
        groups.setdefault(keys[alike[i]], []).append(i)
    if fuse_kwargs.get("pad_widths"):
        arrays = pad_or_split(models, list(groups.values()), max_padding)
    else:
        arrays = [(indices, "one structure") for indices in groups.values()]
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
