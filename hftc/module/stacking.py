"""Building the fused module's tree: model 0's module tree, every parameter and buffer
stacked over the N models, after checking that every model holds the same tensors.

::

    models[i].layer1[0].conv1.weight  (i = 0..N-1)
    -> fused.layer1[0].conv1.weight = torch.stack([...])   on a StackedModule at that path

The tree's classes (:class:`~hftc.lowering.runtime.modules.StackedModule`, what the generated code
reads at run time) are in :mod:`hftc.lowering.runtime.modules`; building it compares the models
(:mod:`hftc.match`'s words for a difference) and copies stateless modules
(:func:`hftc.frontends.symbolic.deepcopy_module`), so it sits above the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import MismatchError
from ..lowering.runtime.modules import StackedModule, stacked_module
from ..match import describe_differences, fixes_for, tensor_signature
from .copies import has_extra_state


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def build_module_tree(
    models: Sequence[nn.Module], templates: nn.Module, name_maps: Sequence[dict[str, str]]
) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """Mirror model 0's module tree with every parameter and buffer stacked over the N models.

    ``name_maps[i]`` maps a tensor name of model 0 onto model i's name for the same
    tensor (identity for same-class models).  Tied tensors (one Parameter under two
    names, such as an embedding shared with an output projection) stay tied: both
    names hold the one stacked Parameter.  Returns the root and, for
    ``fuse_optimizers``, the fused parameter behind each original parameter id.
    """
    num_models = len(models)
    model0 = models[0]
    root = _make_node(model0, templates, num_models, "")
    nodes: dict[str, nn.Module] = {"": root}
    for path, sub in model0.named_modules(remove_duplicate=False):
        if path == "":
            continue
        parent_path, _, leaf = path.rpartition(".")
        if path in nodes:
            continue
        node = _make_node(sub, templates.get_submodule(path), num_models, path,
                          [_submodule_or_none(m, path) for m in models])
        setattr(nodes[parent_path], leaf, node)
        nodes[path] = node

    named = [dict(m.named_parameters(remove_duplicate=False)) for m in models]
    named_buffers = [dict(m.named_buffers(remove_duplicate=False)) for m in models]
    for kind, tables in (("parameter", named), ("buffer", named_buffers)):
        _check_same_tensors(kind, tables, name_maps)
    stacked: dict[int, torch.Tensor] = {}  # id(model 0's tensor) -> stacked tensor (ties)
    sources: dict[int, nn.Parameter] = {}  # id(any model's parameter) -> fused parameter
    for kind, tables in (("parameter", named), ("buffer", named_buffers)):
        for name, t0 in tables[0].items():
            owner_path, _, leaf = name.rpartition(".")
            owner = nodes[owner_path]
            if not isinstance(owner, StackedModule) and owner is not root:
                continue
            per_model = [table[name_maps[i].get(name, name)] for i, table in enumerate(tables)]
            if id(t0) not in stacked:
                _check_ties(name, per_model, tables, name_maps)
                with torch.no_grad():
                    data = torch.stack([t.detach() for t in per_model])
                if kind == "parameter":
                    fused = nn.Parameter(data, requires_grad=t0.requires_grad)
                    for t in per_model:
                        sources[id(t)] = fused
                else:
                    fused = data
                stacked[id(t0)] = fused
            fused = stacked[id(t0)]
            if kind == "parameter":
                owner.register_parameter(leaf, fused)
            else:
                source_owner = model0.get_submodule(owner_path)
                persistent = leaf not in source_owner._non_persistent_buffers_set
                owner.register_buffer(leaf, fused, persistent=persistent)
    return root, sources


def _check_same_tensors(kind: str, tables: Sequence[dict[str, torch.Tensor]],
                        name_maps: Sequence[dict[str, str]]) -> None:
    """Every model holds the same parameters (or buffers) as model 0, each of the same
    shape, dtype and ``requires_grad``, or a :class:`MismatchError` names the one that is
    not.  Matching compared the tensors forward reads; these are the ones it does not:
    one registered in model i only was dropped from its ``model_state_dict()`` and
    ``unfuse()``, one of another shape crashed in ``torch.stack``."""
    fix = (f"Register the same {kind}s in every model (hftc fuses models of the same "
           f"architecture; hftc.fuse_groups splits a mixed list into groups that can be fused).")
    for i, table in enumerate(tables[1:], start=1):
        mapped = {name: name_maps[i].get(name, name) for name in tables[0]}
        for name, other in mapped.items():
            if other not in table:
                alias = "" if other == name else f" (model 0's `{name}`)"
                raise MismatchError(
                    f"model {i} has no {kind} `{other}`{alias}, which model 0 has "
                    f"({tensor_signature(tables[0][name])}). {fix}")
        extra = sorted(table.keys() - set(mapped.values()))
        if extra:
            listed = ", ".join(f"`{other}` ({tensor_signature(table[other])})" for other in extra)
            raise MismatchError(
                f"model {i} has {kind}(s) that model 0 lacks: {listed}. Forward does not "
                f"read them, and the fused module, built on model 0's {kind}s, would drop "
                f"them from model {i}'s model_state_dict() and unfuse(). {fix}")
        for name, other in mapped.items():
            mine, theirs_sig = tensor_signature(table[other]), tensor_signature(tables[0][name])
            if mine == theirs_sig:  # (describe_differences finds nothing in equal ones)
                continue
            label = f"{kind} `{other}`"
            texts, kinds = describe_differences({label: mine}, {label: theirs_sig})
            if texts:
                theirs = "model 0's" if other == name else f"model 0's `{name}`"
                raise MismatchError(
                    f"model {i}'s {kind} `{other}` differs from {theirs}: "
                    f"{'; '.join(t.partition(': ')[2] for t in texts)}. {fixes_for(kinds)}")


def _check_ties(name, per_model, tables, name_maps) -> None:
    # A tensor tied to another in model 0 must be tied the same way in every model.
    ids0 = [n for n, t in tables[0].items() if t is per_model[0]]
    for i, table in enumerate(tables[1:], start=1):
        ids_i = [n for n, t in table.items() if t is per_model[i]]
        if len(ids_i) != len(ids0):
            raise MismatchError(
                f"`{name}` is shared by {ids0} in model 0 but by {ids_i} in model {i}: "
                f"weight tying differs between the models"
            )


def _submodule_or_none(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:  # (a model of another class names its modules its own way)
        return None


def _make_node(source: nn.Module, template: nn.Module, num_models: int,
               path: str, peers: Sequence[nn.Module | None] = ()) -> nn.Module:
    """The fused tree's module for model 0's ``source``: a StackedModule, or a copy of a
    module with neither tensors nor extra state (an ``nn.ReLU`` the program may call).
    A copy of one with extra state would save model 0's as every model's::

        fused.state_dict()["gate._extra_state"] == [s_0, ..., s_N-1]   (not s_0)
    """
    if not _has_state(source) and not has_extra_state(source):
        from ..frontends.symbolic import deepcopy_module

        return deepcopy_module(source)
    node = stacked_module(source, num_models, peers)
    object.__setattr__(node, "_hftc_template", template)
    object.__setattr__(node, "_hftc_path", path)  # (what an error names it by)
    return node
