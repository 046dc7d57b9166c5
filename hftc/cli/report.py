"""``hftc inspect``'s text: what became of each op of the user's model, for a person::

    hftc inspect tests/zoo.py:lenet5_mnist: 3 models (N = 3), matched by trace order
    13 ops fused, 0 computed once (shared), 0 run model by model

      node          op          module path  kind   output
      conv1         Conv2d      conv1        fused  [N, 2, 6, 28, 28]
      max_pool2d    max_pool2d  -            fused  [N, 2, 6, 14, 14]
      size          size        -            fused  -
      ...
    strategy: runs the fused program (checked; not timed, the same program every run)

Each row is one op of model 0 as the user wrote it (its node, the op's own name:
``Conv2d``, ``max_pool2d``, ``view``; not hftc's kernel ``channelwise__max_pool2d``), the
fused output's shape with the model axis written ``N`` (model 0's shape after it; a value
computed once for all models has none); the columns are as wide as their longest entry.
The generated forward follows only with ``--code``.
"""

from __future__ import annotations

import re
from typing import Any

from ..ir import EXAMPLE_VALUE

_KIND = {"fused": "fused", "shared": "shared", "loop": "model by model",
         "per_model": "per model (ops differ)"}
_SOURCE = re.compile(r"module path `([^`]*)`, (.*)\)$")
_PREFIXES = ("torch.nn.functional.", "torch.Tensor.", "Tensor.", "torch.", "operator.",
             "_operator.", "builtins.")


def user_op(source: str) -> str:
    """The op as the user wrote it, from a record's source: ``node `fc1` (module path
    `fc1`, Linear)`` -> ``Linear``; ``..., torch.nn.functional.max_pool2d)`` ->
    ``max_pool2d``; ``..., Tensor.view)`` -> ``view``."""
    found = _SOURCE.search(source)
    if not found:
        return source
    op = found.group(2)
    for prefix in _PREFIXES:
        if op.startswith(prefix):
            return op[len(prefix):]
    return op


def _module_path(source: str) -> str:
    found = _SOURCE.search(source)
    path = found.group(1) if found else ""
    return "-" if path in ("", "<root>") else path


def shape_text(value: Any, batched: bool) -> str:
    """Model 0's value ``[2, 6, 28, 28]`` -> ``[N, 2, 6, 28, 28]``, the fused value with
    its model axis (``batched``); a value computed once keeps its own shape; a tuple's
    parts in parentheses; ``-`` for a non-tensor."""
    if hasattr(value, "shape"):
        return "[" + ", ".join(["N"] * batched + [str(d) for d in value.shape]) + "]"
    if isinstance(value, (tuple, list)):
        parts = [shape_text(v, batched) for v in value]
        parts = [p for p in parts if p != "-"]
        return "(" + ", ".join(parts) + ")" if parts else "-"
    return "-"


def _table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, each as wide as its longest entry (long names keep the
    columns straight)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def _rows(program: Any) -> list[tuple[str, ...]]:
    # (each fused node's example value is model 0's: the model axis is added back)
    values = {n.name: n.meta.get(EXAMPLE_VALUE) for n in program.graph.nodes}
    rows = [("node", "op", "module path", "kind", "output")]
    for record in program.report.records:
        if record.kind in ("input", "parameter"):
            continue
        value = values.get(record.value or (record.fused_nodes or [""])[-1])
        rows.append((record.node, user_op(record.source), _module_path(record.source),
                     _KIND.get(record.kind, record.kind),
                     shape_text(value, record.kind != "shared")))
    return rows


def inspect_text(fused: Any, title: str, code: bool = False) -> str:
    """The text ``hftc inspect`` prints for ``fused``'s last compiled program."""
    program = fused.last_program()
    report = program.report
    n = report.num_models
    shared = sum(r.kind == "shared" for r in report.records)
    lines = [f"hftc inspect {title}: {n} models (N = {n}), matched by {report.match_method}",
             f"{len(report.fused)} ops fused, {shared} computed once (shared), "
             f"{len(report.fallbacks)} run model by model"
             + (f", {len(report.per_model)} that differ per model" if report.per_model else ""),
             "", *_table(_rows(program))]
    for title_, records in (("run model by model (exact, but not faster):", report.fallbacks),
                            ("run on each model's slice (the models' ops differ; exact):",
                             report.per_model)):
        if records:
            lines += ["", title_, *(f"  {r.source}: {r.reason}" for r in records)]
    lines.append("")
    if report.strategy is not None:
        lines.append(f"strategy: {report.strategy}")
    if report.check is not None:
        lines.append(str(report.check))
    if report.padding is not None:
        lines.append(report.padding)
    if report.exported is not None:
        lines.append(f"torch.export: the example inputs exported {report.exported}")
    if report.lowerings:
        lines.append("lowerings chosen by autotune (median forward + backward per call):")
        lines.extend(f"  {choice}" for choice in report.lowerings)
    if code:
        lines += ["", "the generated forward:", program.source.strip("\n")]
    else:
        lines += ["", "(--code: the generated forward; --format dot|svg|png: the graph)"]
    return "\n".join(lines)
