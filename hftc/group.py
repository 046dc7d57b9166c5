"""``hftc.fuse_groups``: split a mixed list of models into fusable groups and fuse each.

A sweep over widths (or any architectural hyper-parameter) gives models that
cannot all be fused together, but do fall into groups that can.  Each model is
traced once and keyed by the signature of its graph in trace order (the same
signatures the matcher compares); models with equal keys are fused together.

    groups = hftc.fuse_groups(models)       # [(fused, [indices]), ...]
    for fused, indices in groups:
        out = fused(x)                      # out[j] == models[indices[j]](x)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .errors import TraceError
from .frontends.same_program import alike_models
from .frontends.symbolic import trace_model
from .fused import FusedModule, _check_models, _example_constants
from .match import node_signature
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


def fuse_groups(
    models: Iterable[nn.Module], **fuse_kwargs: Any
) -> list[tuple[FusedModule, list[int]]]:
    """Partition ``models`` into structurally identical groups and fuse each group.

    Returns ``[(fused_module, indices), ...]`` in order of each group's first model;
    ``indices`` are positions in ``models``, so ``fused(x)[j]`` is
    ``models[indices[j]](x)``.  ``fuse_kwargs`` go to :func:`hftc.fuse`.
    """
    models = _check_models(models)
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
    return [
        (FusedModule([models[i] for i in indices], **fuse_kwargs), indices)
        for indices in groups.values()
    ]
