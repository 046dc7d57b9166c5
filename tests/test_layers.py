"""The package's import graph: no cycle, and no module importing a higher layer.

Every ``import`` / ``from ... import`` of every module of ``hftc``, at module level and
inside functions alike (a function-level import is a dependency all the same: it only
runs later), is read with ``ast``; relative imports are resolved, and ``from pkg import
name`` counts as importing ``pkg.name`` where that is a module, else ``pkg``.

The layers, lowest first (issue 31's layout; a lower layer may never import a higher
one; modules of one layer may import each other)::

    ir, errors, compile_guard  <  runtime  <  frontends, match  <  passes  <  compile
    <  fused, group, stacking  <  optim, amp, utils, step, shrink, patches  <  sweep, ray, bench, the command
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hftc"

#: Module-name prefixes -> layer (the longest matching prefix decides); the rest: TOP.
LAYERS = {
    "hftc.ir": 0,
    "hftc.errors": 0,
    "hftc.lowering.runtime": 1,
    "hftc.frontends": 2,
    "hftc.match": 2,
    "hftc.passes": 3,
    "hftc.lowering": 4,
    "hftc.module": 5,
    "hftc.optim": 6,
    "hftc.training": 6,
    "hftc.utils": 6,
    "hftc.patches": 6,
    "hftc.sweep": 7,
    "hftc.integrations": 7,
    "hftc.bench": 7,
    "hftc.cli": 7,
    "hftc.__main__": 7,
}
TOP = 7  # the package itself (its lazy loader)


def test_every_module_has_its_layer():
    # A new top-level module must be placed, not land in the top layer unseen.
    unplaced = sorted(name for name in module_names()
                      if name != "hftc" and not any(name == p or name.startswith(p + ".")
                                                    for p in LAYERS))
    assert not unplaced, unplaced


def module_names() -> dict[str, Path]:
    """``hftc.a.b`` -> its file, for every module of the package (``__init__`` as the package)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + is_package]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import hftc.a.b.c` of a name in b
                target = target.rpartition(".")[0]
            if target.startswith("hftc") and target != name:
                found.add(target)
    return found


def layer(name: str) -> int:
    matches = [prefix for prefix in LAYERS if name == prefix or name.startswith(prefix + ".")]
    return LAYERS[max(matches, key=len)] if matches else TOP


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    modules = module_names()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        g.add_edges_from((name, target) for target in imports_of(name, path, modules))
    return g


def test_the_import_graph_is_read():
    # A check that reads no edges would pass on anything: pin a few known ones.
    modules = module_names()
    assert "hftc.lowering.runtime.conv" in modules and "hftc.module.fused" in modules
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_edges_from((name, t) for t in imports_of(name, path, modules))
    assert g.has_edge("hftc.module.fused", "hftc.lowering.runtime.modules")  # from .runtime.modules import
    assert g.has_edge("hftc.lowering.runtime.conv", "hftc.lowering.runtime.layout")  # from . import layout
    assert g.has_edge("hftc.lowering.runtime.tuning", "hftc.errors")  # from ..errors import ...
    assert g.has_edge("hftc.lowering.pipeline", "hftc.passes")  # from ..passes import (pkg)
    assert g.has_edge("hftc.frontends.export", "hftc.frontends.symbolic")  # from .symbolic


def test_no_import_cycle(graph):
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join([*cycle, cycle[0]]) for cycle in cycles[:20])


def test_no_module_imports_a_higher_layer(graph):
    upward = sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                    for a, b in graph.edges if layer(b) > layer(a))
    assert not upward, "\n".join(upward)


def test_runtime_exists_and_imports_only_ir_errors_and_itself(graph):
    runtime = [name for name in graph if name.startswith("hftc.lowering.runtime")]
    assert "hftc.lowering.runtime.linear" in runtime and "hftc.lowering.runtime.norms" in runtime
    for name in runtime:
        for target in graph.successors(name):
            assert target in ("hftc.ir", "hftc.errors") or target.startswith("hftc.lowering.runtime"), \
                f"{name} imports {target}"


def test_the_top_of_the_package_shows_the_pipeline():
    # The layout's folders hold the stages; at most six modules sit at the top.
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 6, top
    assert {"frontends", "passes", "lowering", "module", "training", "integrations"} <= {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_no_private_name_is_imported_across_modules():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "")
                                                     .startswith("hftc")):
                found += [f"{path.relative_to(PACKAGE)}: {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def test_the_old_module_names_are_the_new_modules():
    # Users' imports and pickles of an earlier layout: the one module, not a second copy.
    import importlib

    import hftc

    for old, new in hftc.OLD_NAMES.items():
        if old.endswith((".hf", ".lightning", ".ray")):
            continue  # optional integrations (tests/test_extras.py imports them)
        assert importlib.import_module(old) is importlib.import_module(new), old
    import hftc.runtime.modules as old_modules

    from hftc.lowering.runtime.modules import StackedModule

    assert old_modules.StackedModule is StackedModule
    # The one-word renames (docs/ARCHITECTURE.md's "Words"): the old class names too.
    from hftc.lowering.runtime.model_loop import ModelLoop
    from hftc.passes.per_model_ops import PerModelOp

    from hftc.lowering.runtime.one_by_one import OneByOne
    from hftc.passes.differing_ops import DifferingOp

    assert ModelLoop is OneByOne and PerModelOp is DifferingOp


def test_no_function_is_over_100_lines():
    # A function a newcomer reads in one sitting: longer ones are split into named steps.
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                if node.end_lineno - start + 1 > 100:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.name} "
                                f"({node.end_lineno - start + 1} lines)")
    assert not long, long
