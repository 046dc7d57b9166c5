"""``hftc inspect --format dot|svg|png``: the fused graph as a Graphviz picture.

One box per fused op (parameters and buffers left out), e.g.::

    conv1: conv -> grouped      <- the module path (within its block's frame), hftc's kernel
                                   and the lowering it runs (autotune's, else the cost model's)
    [N, 2, 8, 32, 32]           <- the fused output's shape: the model axis N, then model 0's
                                   (a tuple: each part's; a shared value has no N)

coloured by what hftc did with it (the legend: fused, computed once for all models, run
model by model, a different op per model), as the fusion report's table says (each box's
record in ``fused.fusion_report``: one owner for both), and grouped in one frame per block
of the model (``layer1.0``, ``features.3``: the module path up to its first index), so a
ResNet-18 reads block by block.
"""

from __future__ import annotations

import re

from ..ir import EXAMPLE_VALUE, ORIGIN, RULE, SOURCE
from ..lowering.runtime.tuning import lowerings_of
from ..passes.report_text import record_op, shape_text

_KINDS = {  # rule -> (legend text, fill colour)
    "fused": ("fused: one op for all N models", "lightblue"),
    "shared": ("shared: computed once, same for all models", "lightgrey"),
    "loop": ("model by model: no rule fuses it, each model runs it in turn", "mistyrose"),
    "per_model": ("per model: the models' ops differ, each runs its own on its slice",
                  "khaki"),
    "io": ("input / output", "white"),
}
_MODULE_PATH = re.compile(r"module path `([^`]*)`")


def _kind(node, record) -> str:
    """The legend's kind of a fused node: its record's (the report's "kind" column)."""
    if node.op in ("placeholder", "output"):
        return "io"
    kind = getattr(record, "kind", "")
    return kind if kind in _KINDS else "fused"


def _module_path(node) -> str:
    found = _MODULE_PATH.search(str(node.meta.get(SOURCE, "")))
    if found:
        return found.group(1)
    if node.op == "call_module":
        return str(node.target)
    return ""


def _block(path: str, root) -> str:
    """``layer1.0.conv1`` -> ``layer1.0``; ``features.3.conv.0`` -> ``features.3``; a path
    without an index (``conv1``, ``fc``) belongs to no block, nor a leaf layer at an index
    (``features.0``, a VGG's Conv2d); a block itself (``encoder.layers.1``, the module path
    of an op written in its forward, the residual add) is its own block."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            block = ".".join(parts[: i + 1])
            if i < len(parts) - 1 or _has_children(root, block):
                return block
    return ""


def _has_children(root, path: str) -> bool:
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
    return any(True for _ in getattr(module, "children", list)())


def _shape(node, kind: str) -> str:
    """The fused value's shape, ``[N, ...]`` where it has the model axis; "" for none."""
    shape = shape_text(node.meta.get(EXAMPLE_VALUE), kind not in ("shared", "io"))
    return "" if shape == "-" else shape


def _user_name(node) -> str:
    """The user's node (model 0's) a fused node computes: ``max_pool2d``, not hftc's
    ``channelwise__max_pool2d``."""
    origin = node.meta.get(ORIGIN)
    return str(origin[0]) if isinstance(origin, (list, tuple)) and origin else node.name


def _cost_model_lowering(node, root) -> str | None:
    """The lowering an hftc kernel (``conv.conv``) runs when autotune chose none: the
    first of its ``conv_lowerings(...)`` for the node's stacked weights and example input."""
    lowerings = lowerings_of(node.target)
    if lowerings is None or not node.args:
        return None
    n = next((a.shape[0] for a in _values(node.args[1:], root) if hasattr(a, "shape")), None)

    def value(arg, batched=False):
        v = _values([arg], root)[0]
        return v.expand(n, *v.shape) if batched and n and hasattr(v, "expand") else v

    try:
        kwargs = {k: v for k, v in node.kwargs.items() if k != "lowering"}
        args = [value(node.args[0], kwargs.get("x_batched", False)),
                *_values(node.args[1:], root)]
        return lowerings(*args, **kwargs)[0]
    except Exception:  # a kernel whose lowerings want more than the example shapes
        return None


def _values(args, root) -> list:
    """fx arguments -> example values: a node's example tensor, a get_attr's stacked tensor."""
    out = []
    for arg in args:
        if getattr(arg, "op", None) == "get_attr":
            obj = root
            for part in str(arg.target).split("."):
                obj = getattr(obj, part, None)
            out.append(obj)
        elif hasattr(arg, "meta"):
            out.append(arg.meta.get(EXAMPLE_VALUE))
        else:
            out.append(arg)
    return out


def _operation(node, root, record) -> str:
    """What the box computes: hftc's kernel and the lowering it runs, or the op's name; for
    an op run model by model the user's op (``linalg.qr``, not hftc's
    ``loop_over_models__linalg_qr``), for a differing op each model's."""
    if node.op in ("placeholder", "output"):
        return node.op
    if getattr(record, "kind", "") in ("loop", "per_model"):
        return record_op(record)
    if record is not None and record.value and node.name != record.value:
        # a helper the rule made for the op (each model's scalars of ``h / self.cfg.t``):
        # its own kernel, not a second box named as the op
        return getattr(node.target, "__name__", str(node.target))
    rule = str(node.meta.get(RULE, ""))
    if node.op == "call_module":
        inner = re.search(r"\[(.*)\]", rule)
        return inner.group(1) if inner else rule or "module"
    inner = re.search(r"\[(.*)\]", rule)  # fuse_channelwise[max_pool2d]: the user's op
    name = inner.group(1) if inner else getattr(node.target, "__name__", str(node.target))
    lowering = node.kwargs.get("lowering")
    if lowering:
        return f"{name} -> {lowering} (autotune)"
    lowering = _cost_model_lowering(node, root)
    return f"{name} -> {lowering}" if lowering else name


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def graph_to_dot(fused, title: str = "fused") -> str:
    """A fused module's last compiled program (``fused.last_program()``) as Graphviz DOT."""
    program = fused.last_program()
    nodes = [n for n in program.graph.nodes if n.op != "get_attr"]
    record_of = {name: record for record in program.report.records
                 for name in record.fused_nodes}
    block_of: dict[str, str] = {}
    for node in nodes:
        path = _module_path(node)
        block = _block(path, fused)
        if not path and node.op not in ("placeholder", "output"):
            # a node that names no module path joins the block of its first input; one
            # written in the root's forward (`<root>`: the head's pooling) stays outside
            block = next((block_of[a.name] for a in node.all_input_nodes
                          if block_of.get(a.name)), "")
        block_of[node.name] = block
    lines = [f'digraph "{_quote(title)}" {{', "  rankdir=TB; newrank=true; ranksep=0.25; "
             "nodesep=0.2;", '  node [shape=box, style="rounded,filled", fontname="monospace", '
             'fontsize=10, margin="0.1,0.03"];', '  edge [arrowsize=0.6];']
    # pad_widths: every model's value is padded to the widest model's, not model 0's own
    shapes = "the widest model's" if program.report.padding else "model 0's"
    lines += ['  subgraph cluster_legend {', f'    label="legend (shapes: [N, {shapes} ...])"; '
              'fontname="monospace"; '
              'fontsize=10; style=dashed;']
    legend = [f"legend_{kind}" for kind in _KINDS]
    for name, (text, color) in zip(legend, _KINDS.values()):
        lines.append(f'    {name} [label="{text}", fillcolor={color}];')
    lines.append(f'    {" -> ".join(legend)} [style=invis];')
    lines.append("  }")
    by_block: dict[str, list[str]] = {}
    for node in nodes:
        # within a block's frame its path is relative: conv1, not layer1.0.conv1
        block = block_of[node.name]
        path = _module_path(node).removeprefix(f"{block}.") if block else _module_path(node)
        name = path if path and path not in (block, "<root>") else _user_name(node)
        record, kind = record_of.get(node.name), _kind(node, record_of.get(node.name))
        operation = _operation(node, fused, record)
        head = name if operation == name or node.op == "placeholder" else f"{name}: {operation}"
        label = "\\n".join(_quote(part) for part in (
            head, _shape(node, kind)) if part)
        color = _KINDS[kind][1]
        tooltip = _quote(f"{node.name}: {node.meta.get('hftc_rule', node.op)}")
        by_block.setdefault(block_of[node.name], []).append(
            f'"{node.name}" [label="{label}", fillcolor={color}, tooltip="{tooltip}"];')
    for block, entries in by_block.items():
        indent = "    " if block else "  "
        if block:
            cluster = re.sub(r"\W", "_", block)
            lines += [f"  subgraph cluster_{cluster} {{", f'    label="{_quote(block)}"; '
                      'fontname="monospace"; fontsize=11; style="rounded"; color=grey50;']
        lines += [indent + entry for entry in entries]
        if block:
            lines.append("  }")
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                lines.append(f'  "{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines)
