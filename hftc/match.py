"""Stage 2: are the N graphs the same program?  Which node of model i is node k of model 0?

Every node gets a *signature*: its op, its target (the function, the method name,
or the module's class with its constructor hyper-parameters and the shapes,
dtypes and devices of its own parameters and buffers), and the constant part of
its arguments (``x.view(-1, 400)`` keeps ``-1`` and ``400``; each tensor argument
becomes a numbered slot).  Two models fuse when their graphs are isomorphic as
labelled DAGs: a bijection of nodes that keeps signatures and maps every
argument edge (producer -> consumer, slot number) onto an edge with the same slot.

Algorithm (:func:`match_graphs`):

1. Trace order, fast path: models built by the same code give their nodes in the
   same order.  Zip the node lists, compare signatures and argument slots
   (slot ``j`` of node ``k`` must point at the same position in both lists).
   Cost ``O(V + E)`` per model; this is what every same-class sweep hits.
2. Otherwise build a ``networkx.DiGraph`` per model (nodes labelled with their
   signature, edges with their slots) and ask VF2
   (``networkx.algorithms.isomorphism.DiGraphMatcher``) for an isomorphism.
   Models written by different code (another attribute order, branches computed
   in another order) land here.  VF2 is exponential in the worst case, but with
   every node labelled by op and target and every edge by slot the candidate
   pairs are few and the search stays close to linear on real networks.
3. If neither finds a mapping, the models differ: the nodes whose signatures
   differ at the same trace position are reported, every differing attribute
   with the values of every model (``kernel_size: (3, 3) in models 0, 1;
   (5, 5) in model 2``), as a :class:`~hftc.errors.MismatchError`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize

from .errors import MismatchError

#: Stand-in for a tensor argument inside a node's constant-argument skeleton.
_SLOT = "<tensor>"
#: Stand-in for a scalar hyper-parameter that may differ per model.
_PER_MODEL = "<per-model scalar>"
#: ``node.meta`` key: ``{key: [value of model 0, ..., model N-1]}`` for hyper-parameters
#: that differ between the models (absent when they all agree).
PER_MODEL = "hftc_per_model"

#: Module hyper-parameters that may differ between models: the node still fuses, and
#: its rule receives one value per model (HFTA and Hydro force these to be equal).
SOFT_MODULE_ATTRIBUTES: list[tuple[type, tuple[str, ...]]] = [
    (nn.modules.dropout._DropoutNd, ("p",)),
    (nn.LeakyReLU, ("negative_slope",)),
    (nn.ELU, ("alpha",)),
    (nn.CELU, ("alpha",)),
    (nn.modules.batchnorm._BatchNorm, ("momentum", "eps")),
    (nn.modules.instancenorm._InstanceNorm, ("momentum", "eps")),
    (nn.LayerNorm, ("eps",)),
    (nn.GroupNorm, ("eps",)),
    (nn.RMSNorm, ("eps",)),
]
#: Function arguments that may differ between models: ``{function: {position: keyword}}``.
SOFT_FUNCTION_ARGUMENTS: dict[Any, dict[int, str]] = {
    torch.nn.functional.dropout: {1: "p"},
    torch.nn.functional.leaky_relu: {1: "negative_slope"},
    torch.nn.functional.elu: {1: "alpha"},
    torch.nn.functional.celu: {1: "alpha"},
    torch.nn.functional.batch_norm: {6: "momentum", 7: "eps"},
    torch.nn.functional.layer_norm: {4: "eps"},
    torch.nn.functional.group_norm: {4: "eps"},
    torch.nn.functional.rms_norm: {3: "eps"},
    torch.nn.functional.scaled_dot_product_attention: {4: "dropout_p"},
}
#: Arithmetic whose float constants may differ between models (a per-model scale).
SCALAR_ARITHMETIC = {
    operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
    torch.mul, torch.div, "add", "sub", "mul", "div", "__mul__", "__rmul__", "__add__",
    "__radd__", "__sub__", "__rsub__", "__truediv__", "__rtruediv__",
}


def soft_module_attributes(module: nn.Module) -> tuple[str, ...]:
    for cls, names in SOFT_MODULE_ATTRIBUTES:
        if isinstance(module, cls):
            return names
    return ()


#: The defaults of the positional arguments up to the last per-model-able one, for the
#: functions that torch records without trailing defaults: ``F.scaled_dot_product_attention(
#: q, k, v, dropout_p=0.0)`` arrives as ``(q, k, v)``, with ``dropout_p=0.1`` as ``(q, k, v,
#: None, 0.1)``; both are read as ``(q, k, v, None, <per-model>)``.
SOFT_FUNCTION_DEFAULTS: dict[Any, tuple] = {
    torch.nn.functional.scaled_dot_product_attention: (None, 0.0),  # attn_mask, dropout_p
    # torch.export's graphs leave an argument at its default out: LeakyReLU(0.01) in
    # model 0 against LeakyReLU(0.02) was (x,) against (x, 0.02), refused as structure
    torch.nn.functional.leaky_relu: (0.01,),
    torch.nn.functional.elu: (1.0,),
    torch.nn.functional.celu: (1.0,),
    torch.nn.functional.batch_norm: (None, None, False, 0.1, 1e-5),
}


def canonical_args(node: fx.Node) -> tuple:
    """``node.args`` with the trailing defaults of :data:`SOFT_FUNCTION_DEFAULTS` filled in
    up to the per-model-able position, where it is not given by keyword."""
    args = tuple(node.args)
    defaults = SOFT_FUNCTION_DEFAULTS.get(node.target) if node.op == "call_function" else None
    if defaults is None:
        return args
    positions = SOFT_FUNCTION_ARGUMENTS[node.target]
    last = max(positions)
    if len(args) > last or positions[last] in node.kwargs:
        return args
    first = last + 1 - len(defaults)
    return args + defaults[len(args) - first:] if len(args) >= first else args


def _soft_argument_keys(node: fx.Node) -> dict[str, Any]:
    """``{"args[1]": value, "kwargs[p]": value}`` for the node's per-model-able scalars."""
    found: dict[str, Any] = {}
    if node.op not in ("call_function", "call_method"):
        return found
    positions = SOFT_FUNCTION_ARGUMENTS.get(node.target, {})
    args = canonical_args(node)
    for pos, name in positions.items():
        if pos < len(args) and isinstance(args[pos], (int, float)):
            found[f"args[{pos}]"] = args[pos]
        elif isinstance(node.kwargs.get(name), (int, float)):
            found[f"kwargs[{name}]"] = node.kwargs[name]
    if node.target in SCALAR_ARITHMETIC and any(isinstance(a, fx.Node) for a in node.args):
        for pos, a in enumerate(node.args):
            if isinstance(a, float):
                found[f"args[{pos}]"] = a
    return found


def per_model_values(node: fx.Node, root: nn.Module) -> dict[str, Any]:
    """The node's hyper-parameters that are allowed to differ between models, by key.

    Keys: a module attribute name (``"p"``, ``"eps"``) or an argument slot
    (``"args[1]"``, ``"kwargs[p]"``).
    """
    values = _soft_argument_keys(node)
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        for name in soft_module_attributes(module):
            values[name] = getattr(module, name)
    return values


@dataclass(frozen=True)
class ArgSkeleton:
    """The constant part of a node's arguments; graph inputs become :data:`_SLOT`."""

    args: Any
    kwargs: Any


def _simple(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_simple(v) for v in value)
    return False


def _tensor_signature(t: torch.Tensor) -> tuple:
    kind = "parameter" if isinstance(t, nn.Parameter) else "tensor"
    return (kind, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)


def module_hyperparameters(module: nn.Module) -> dict[str, Any]:
    """The constructor hyper-parameters of a module, as a user would compare them.

    Public, simple-valued attributes (``in_channels``, ``kernel_size``,
    ``padding_mode`` ...).  Private attributes are derived from public ones and
    left out, and so are the scalars that may differ per model (``p``, ``eps``).
    """
    soft = soft_module_attributes(module)
    params = {
        k: _python_scalars(v) for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and k not in soft
    }
    return {k: v for k, v in sorted(params.items()) if _simple(v)}


def _python_scalars(value: Any) -> Any:
    """NumPy scalars (``np.float32(0.1)``, ``np.int64(2)``: a sweep's ``np.linspace``
    grid) as the Python numbers they are, in tuples and lists too: ``_simple`` took them
    for objects and left them out of the signature, so models that differed in one
    were fused with model 0's value."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, list)):
        return type(value)(_python_scalars(v) for v in value)
    return value


def module_signature(module: nn.Module) -> dict[str, Any]:
    sig: dict[str, Any] = {"class": type(module).__qualname__}
    sig.update(module_hyperparameters(module))
    for name, p in module.named_parameters(recurse=False):
        sig[f"parameter `{name}`"] = _tensor_signature(p)
    for name, b in module.named_buffers(recurse=False):
        sig[f"buffer `{name}`"] = _tensor_signature(b)
    # Not "mode": a module's own hyper-parameter of that name (Upsample's, EmbeddingBag's)
    # was overwritten, and models differing in it were fused with model 0's.
    sig["train/eval mode"] = "train" if module.training else "eval"
    if parametrize.is_parametrized(module):
        sig.update(_parametrizations_signature(module))
    return sig


def _parametrizations_signature(module: nn.Module) -> dict[str, Any]:
    """A parametrized module's parametrizations (``weight_norm``, ``spectral_norm``, a
    user's ``Clamp(c)``), which run per model as model 0's code: each one's own
    :func:`module_signature`, so that models whose differ are refused, not run with model
    0's (spectral norm's ``n_power_iterations``, a clamp's bound, weight norm's ``dim``)."""
    return {f"parametrization `{path}` {key}" if path else f"parametrizations {key}": value
            for path, sub in module.parametrizations.named_modules()
            for key, value in module_signature(sub).items()}


def target_name(node: fx.Node) -> str:
    """A readable name for what a node calls (``torch.nn.functional.relu``, ``.view``)."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        for prefix, namespace in (("torch.nn.functional", torch.nn.functional), ("torch", torch)):
            if name and getattr(namespace, name, None) is node.target:
                return f"{prefix}.{name}"
        return fx.node._get_qualified_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return str(node.target)


def module_path(node: fx.Node) -> str:
    """Where a node lives in the user's code: the module path (``layer3.1.conv2``)."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0]) or "<root>"
    return "<root>"


def describe_node(node: fx.Node, root: nn.Module | None = None) -> str:
    """``node `conv1` (module path `conv1`, Conv2d)``: how errors name a node."""
    what = target_name(node)
    if node.op == "call_module" and root is not None:
        what = type(root.get_submodule(node.target)).__name__
    return f"node `{node.name}` (module path `{module_path(node)}`, {what})"


def _fold_constant(value: Any) -> Any:
    # NaN != NaN would make two identical graphs differ.
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def node_signature(node: fx.Node, root: nn.Module) -> dict[str, Any]:
    """Everything about a node that must agree across models, as ``{attribute: value}``."""
    sig: dict[str, Any] = {"op": node.op}
    if node.op == "call_module":
        sig.update(module_signature(root.get_submodule(node.target)))
    elif node.op == "get_attr":
        value = _get_attr(root, node.target)
        if isinstance(value, torch.Tensor):
            sig["attribute"] = _tensor_signature(value)
        elif isinstance(value, nn.Module):
            sig["attribute"] = module_signature(value)
        else:
            sig["attribute"] = repr(value)
    elif node.op in ("call_function", "call_method"):
        sig["target"] = target_name(node)
    soft = _soft_argument_keys(node)
    args, kwargs = list(canonical_args(node)), dict(node.kwargs)
    for key in soft:  # scalars that may differ per model are not part of the signature
        if key.startswith("args["):
            args[int(key[5:-1])] = _PER_MODEL
        else:
            kwargs[key[7:-1]] = _PER_MODEL
    skeleton = fx.node.map_aggregate(
        (tuple(args), kwargs),
        lambda a: _SLOT if isinstance(a, fx.Node) else _fold_constant(a),
    )
    if node.op != "placeholder":  # input names differ between codebases; order is what counts
        sig["arguments"] = repr(skeleton)
    return sig


def _get_attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def argument_nodes(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued arguments of ``node`` in a fixed order (slot 0, 1, ...)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


@dataclass
class GraphMatch:
    """For each model i, ``mapping[i][node_of_model_0] -> node_of_model_i``."""

    mapping: list[dict[fx.Node, fx.Node]]
    method: str  # "trace order" or "vf2"


def _try_trace_order(
    nodes0: list[fx.Node], sigs0: list[dict], nodes: list[fx.Node], sigs: list[dict]
) -> dict[fx.Node, fx.Node] | None:
    if len(nodes0) != len(nodes):
        return None
    pos0 = {n: k for k, n in enumerate(nodes0)}
    pos = {n: k for k, n in enumerate(nodes)}
    for a, b, sa, sb in zip(nodes0, nodes, sigs0, sigs):
        if sa != sb:
            return None
        if [pos0[x] for x in argument_nodes(a)] != [pos[x] for x in argument_nodes(b)]:
            return None
    return dict(zip(nodes0, nodes))


def _to_networkx(nodes: list[fx.Node], sigs: list[dict]) -> nx.DiGraph:
    g = nx.DiGraph()
    for n, s in zip(nodes, sigs):
        g.add_node(n, sig=s)
    for n in nodes:
        for slot, a in enumerate(argument_nodes(n)):
            if g.has_edge(a, n):
                g[a][n]["slots"] = g[a][n]["slots"] + (slot,)
            else:
                g.add_edge(a, n, slots=(slot,))
    return g


def _vf2(g0: nx.DiGraph, gi: nx.DiGraph) -> dict[fx.Node, fx.Node] | None:
    matcher = nx.algorithms.isomorphism.DiGraphMatcher(
        g0,
        gi,
        node_match=lambda a, b: a["sig"] == b["sig"],
        edge_match=lambda a, b: a["slots"] == b["slots"],
    )
    if matcher.is_isomorphic():
        return dict(matcher.mapping)
    return None


def _group_values(values: list[Any], indices: list[int]) -> str:
    """``(3, 3) in models 0, 1; (5, 5) in model 2`` (most common value first)."""
    groups: list[tuple[Any, list[int]]] = []
    for idx, v in zip(indices, values):
        for g in groups:
            if g[0] == v:
                g[1].append(idx)
                break
        else:
            groups.append((v, [idx]))
    groups.sort(key=lambda g: -len(g[1]))
    parts = []
    for v, idxs in groups:
        label = "model" if len(idxs) == 1 else "models"
        parts.append(f"{v} in {label} {', '.join(map(str, idxs))}")
    return "; ".join(parts)


def _explain_mismatch(
    graphs: Sequence[fx.GraphModule], models: Sequence[nn.Module], sigs: list[list[dict]],
    failed: list[int],
) -> str:
    """Compare the graphs position by position and list every differing node."""
    nodes = [list(g.graph.nodes) for g in graphs]
    lines: list[str] = []
    lengths = [len(n) for n in nodes]
    everyone = list(range(len(graphs)))
    if len(set(lengths)) > 1:
        lines.append(
            "  the graphs have different numbers of nodes (an extra or missing layer): "
            + _group_values(lengths, everyone)
        )
    for k in range(max(lengths)):
        present = [i for i in everyone if k < lengths[i]]
        if len(present) < len(everyone):
            break
        row = [sigs[i][k] for i in present]
        if all(s == row[0] for s in row):
            continue
        where = describe_node(nodes[0][k], graphs[0])
        diffs = []
        for attr in dict.fromkeys(a for s in row for a in s):
            vals = [s.get(attr, "<absent>") for s in row]
            if any(v != vals[0] for v in vals):
                diffs.append(f"{attr}: {_group_values(vals, present)}")
        others = ", ".join(
            f"model {i} has {describe_node(nodes[i][k], graphs[i])}"
            for i in present[1:]
            if i in failed and nodes[i][k].name != nodes[0][k].name
        )
        lines.append(f"  at {where}" + (f" ({others})" if others else "") + ":")
        lines.extend(f"    {d}" for d in diffs)
        if len(lines) > 30:
            lines.append("  ... (more differences follow)")
            break
    if not lines:
        lines.append("  the nodes agree one by one, but their argument edges differ")
    return "\n".join(lines)


def match_graphs(graphs: Sequence[fx.GraphModule], models: Sequence[nn.Module]) -> GraphMatch:
    """Map every node of model 0's graph onto its counterpart in each model's graph.

    ``graphs[i]`` is model i traced (its ``GraphModule`` is the root its call_module
    and get_attr targets resolve against).  Raises :class:`MismatchError` listing
    every difference when some model is not isomorphic to model 0.
    """
    node_lists = [list(g.graph.nodes) for g in graphs]
    sigs = [[node_signature(n, g) for n in nodes] for g, nodes in zip(graphs, node_lists)]
    mapping: list[dict[fx.Node, fx.Node]] = [{n: n for n in node_lists[0]}]
    method = "trace order"
    failed: list[int] = []
    g0_nx: nx.DiGraph | None = None
    for i in range(1, len(graphs)):
        found = _try_trace_order(node_lists[0], sigs[0], node_lists[i], sigs[i])
        if found is None:
            if g0_nx is None:
                g0_nx = _to_networkx(node_lists[0], sigs[0])
            found = _vf2(g0_nx, _to_networkx(node_lists[i], sigs[i]))
            method = "vf2"
        if found is None:
            failed.append(i)
        else:
            mapping.append(found)
    if failed:
        label = "model" if len(failed) == 1 else "models"
        raise MismatchError(
            f"{label} {', '.join(map(str, failed))} of {len(graphs)} cannot be fused with model 0: "
            f"the models are not structurally identical.\n"
            + _explain_mismatch(graphs, models, sigs, failed)
            + "\nFuse only models built with the same architecture and hyper-parameters "
            "(hftc.fuse_groups splits a mixed list into groups that can be fused)."
        )
    _record_per_model_values(graphs, mapping)
    return GraphMatch(mapping=mapping, method=method)


def _record_per_model_values(
    graphs: Sequence[fx.GraphModule], mapping: list[dict[fx.Node, fx.Node]]
) -> None:
    """Store each node's differing per-model scalars on model 0's node (``meta[PER_MODEL]``)."""
    for node in graphs[0].graph.nodes:
        per_model = [per_model_values(m[node], g) for m, g in zip(mapping, graphs)]
        differing = {
            key: [values.get(key) for values in per_model]
            for key in per_model[0]
            if any(values.get(key) != per_model[0][key] for values in per_model)
        }
        if differing:
            node.meta[PER_MODEL] = differing
            node.args = canonical_args(node)  # the per-model slot exists in model 0's call
        else:
            node.meta.pop(PER_MODEL, None)
