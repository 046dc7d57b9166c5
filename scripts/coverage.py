"""Generate docs/COVERAGE.md: every operator a fusion rule covers and every tested model.

Read from the code, so the page cannot drift from it:

- operators: the rule registry (``hftc.passes.RULES``), grouped by rule, every
  spelling (``torch.relu``, ``F.relu``, ``x.relu()``, ``nn.ReLU``) listed;
- the export front-end's ATen normalisation (the rules' ``aten=`` spellings,
  ``hftc.frontends.export.DROPPED``)
  and the modules traced through (``hftc.frontends.symbolic.TRACEABLE_FORWARDS``);
- models: the test zoo (``tests/zoo.py``'s ``ZOO``), every documented ``nn.Module``
  defined in a test file, and every ``transformers`` model the tests build.

Usage::

    python scripts/coverage.py            # rewrite docs/COVERAGE.md
    python scripts/coverage.py --check    # exit 1 if docs/COVERAGE.md is stale

``tests/test_coverage.py`` runs the check.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "COVERAGE.md"
TESTS = ROOT / "tests"


def _spelling(op: str, target: object) -> str:
    import torch

    from hftc.match import target_name

    if op == "call_module":
        return f"`nn.{target.__name__}`" if getattr(torch.nn, target.__name__, None) is target \
            else f"`{target.__module__}.{target.__qualname__}`"
    if op == "call_method":
        return f"`Tensor.{target}`"

    class _Node:  # what target_name reads
        pass

    node = _Node()
    node.op, node.target = op, target
    name = target_name(node)  # type: ignore[arg-type]
    return f"`{name.replace('torch.nn.functional.', 'F.')}`"


def operator_table() -> list[str]:
    from hftc.passes import RULES
    from hftc.passes.registry import runs_one_by_one

    groups: dict[str, list[str]] = defaultdict(list)
    count = 0
    for (op, target), entry in RULES.items():
        if op == "call_function" and not callable(target):
            continue  # ``torch.float`` is a dtype, not a function: no spelling to list
        if entry.rule is runs_one_by_one:
            continue  # declared (it draws random numbers), not fused
        groups[entry.name].append(_spelling(op, target))
        count += 1
    lines = [f"{count} operator spellings, {len(groups)} rules.", "",
             "| rule | operators (every spelling) |", "|---|---|"]
    for name in sorted(groups):
        spellings = ", ".join(sorted(set(groups[name])))
        lines.append(f"| `{name}` | {spellings} |")
    return lines


def export_tables() -> list[str]:
    from hftc.frontends.export import DROPPED
    from hftc.frontends.symbolic import TRACEABLE_FORWARDS
    from hftc.passes.registry import aten_spellings

    converted = [op._qualified_op_name.split("::")[1] for op in aten_spellings()]

    lines = [
        "ATen ops with their own converter (any other `aten.NAME` becomes `torch.NAME`, "
        "`F.NAME` or `Tensor.NAME` when that binds the same ATen function, and is then "
        "fused by the rule above):", "",
        ", ".join(f"`aten.{name}`" for name in sorted(converted)), "",
        "Dropped (assertions only): " + ", ".join(f"`aten.{n}`" for n in sorted(DROPPED)), "",
        "Traced through by the symbolic front-end (a traceable forward of the same math): "
        + ", ".join(sorted(f"`nn.{cls.__name__}`" for cls in TRACEABLE_FORWARDS)) + ".",
    ]
    return lines


def _module_classes(path: Path) -> list[tuple[str, str]]:
    """Documented module-level ``nn.Module`` subclasses of a test file."""
    tree = ast.parse(path.read_text())
    found = []
    module_bases = {"Module", "Sequential", "ModuleList"}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                 for b in node.bases}
        doc = ast.get_docstring(node)
        if bases & module_bases and doc:
            found.append((node.name, doc.strip().splitlines()[0]))
    return found


def _transformers_models(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name) and node.func.value.id == "transformers" \
                and not node.func.attr.endswith("Config") and node.func.attr[0].isupper():
            names.add(node.func.attr)
    return sorted(names)


def model_table() -> list[str]:
    sys.path.insert(0, str(TESTS))
    import zoo

    lines = ["| model | where | what |", "|---|---|---|"]
    for name, entry in sorted(zoo.ZOO.items()):
        factory = entry.factory
        returned = getattr(zoo, str(factory.__annotations__.get("return", "")), None)
        doc = (factory.__doc__ or getattr(returned, "__doc__", None) or "").strip().splitlines()
        lines.append(f"| `{name}` | `tests/zoo.py` (`{factory.__name__}`) | "
                     f"{doc[0] if doc else 'zoo model'} |")
    for path in sorted(TESTS.glob("test_*.py")):
        for cls, doc in _module_classes(path):
            lines.append(f"| `{cls}` | `tests/{path.name}` | {doc} |")
        for model in _transformers_models(path):
            lines.append(f"| `transformers.{model}` (tiny config) | `tests/{path.name}` | "
                         f"third-party model, fused through torch.export |")
    return lines


def render() -> str:
    parts = [
        "# hftc coverage",
        "",
        "Generated by `python scripts/coverage.py` from the rule registry and the tests; "
        "do not edit by hand (`tests/test_coverage.py` fails when it is stale).",
        "",
        "Every operator below is fused (one fused op for N models); anything else runs "
        "model by model, exactly, and is listed in `fused.fusion_report`.",
        "",
        "## Operators",
        "",
        *operator_table(),
        "",
        "## The torch.export front-end",
        "",
        *export_tables(),
        "",
        "## Tested models",
        "",
        "Each is checked against a loop over the original models (float64, forward and "
        "gradients) by the test file named.",
        "",
        *model_table(),
        "",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run `python scripts/coverage.py`")
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
