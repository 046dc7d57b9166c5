"""The documentation's code runs, and every public name has a reference entry with an example.

Every ```python block of docs/index.md, docs/guides/*.md and docs/reference/*.md runs, page by page, in
order, in one namespace per page (a later block uses what an earlier one defined), in a
temporary folder. A block that needs what CI does not have (a GPU, several processes)
starts with ``# not run here:`` and the reason; it is only compiled. The README's first
example runs with a small ``MyCNN`` and ``loader`` defined for it.

``make docs`` builds the same pages with ``mkdocs build --strict``.
"""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hftc
import hftc.errors

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [DOCS / "index.md", *sorted((DOCS / "guides").glob("*.md")),
         *sorted((DOCS / "reference").glob("*.md"))]
PAGES.remove(DOCS / "reference" / "index.md")  # a table of links
NOT_RUN = "# not run here:"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.M)

# FusedModule's own public API (its nn.Module methods are torch's).
FUSED_MODULE_API = ("compile", "last_program", "fusion_report", "plan", "fused_graph",
                    "model_state_dict", "unfuse", "unfuse_model", "source_parameter_names",
                    "with_in_dims", "model_ids")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of a Markdown page."""
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def run_blocks(path: Path, text: str) -> int:
    namespace: dict = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    ran = 0
    for line, code in python_blocks(text):
        compiled = compile(code, f"{path.relative_to(ROOT)}:{line}", "exec")
        if code.startswith(NOT_RUN):
            continue
        exec(compiled, namespace)
        ran += 1
    return ran


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # sweeps write their folders, checkpoints are saved
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path / "cache"))  # autotune's choices
    torch.manual_seed(0)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(path):
    assert run_blocks(path, path.read_text()) > 0, f"{path.name} has no code that runs"


def test_readme_first_example_runs():
    text = (ROOT / "README.md").read_text()
    line, code = python_blocks(text)[0]

    class MyCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.fc = nn.Linear(4 * 6 * 6, 10)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).flatten(1))

    loader = [(torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))) for _ in range(3)]
    namespace = {"MyCNN": MyCNN, "loader": loader}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
    assert isinstance(namespace["best"], MyCNN)


def public_names() -> dict[str, str]:
    """Each public name (as a user spells it) -> the path of the object that defines it."""
    names: dict[str, object] = {}
    for name in hftc.__all__:
        obj = getattr(hftc, name)
        if not inspect.ismodule(obj):
            names[f"hftc.{name}"] = obj
    for module in ("optim", "amp", "utils", "sweep"):
        mod = __import__(f"hftc.{module}", fromlist=["_"])
        for name in mod.__all__:
            names[f"hftc.{module}.{name}"] = getattr(mod, name)
    for name, obj in vars(hftc.errors).items():
        if inspect.isclass(obj) and obj.__module__ == "hftc.errors":
            names[f"hftc.errors.{name}"] = obj
    where = {name: f"{obj.__module__}.{obj.__qualname__}" for name, obj in names.items()}
    for name in FUSED_MODULE_API:
        where[f"FusedModule.{name}"] = f"hftc.module.fused.FusedModule.{name}"
    return where


def reference_entries() -> dict[str, str]:
    """``::: path`` directive of docs/reference/*.md -> the text up to the next one."""
    entries = {}
    for path in sorted((DOCS / "reference").glob("*.md")):
        text = path.read_text()
        found = list(_DIRECTIVE.finditer(text))
        for m, after in zip(found, [*found[1:], None]):
            entries[m.group(1)] = text[m.end():after.start() if after else len(text)]
    return entries


def test_every_public_name_has_a_reference_entry_with_an_example():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna's experimental-feature warnings on import
        names = public_names()
    entries = reference_entries()
    missing = [name for name, path in names.items() if path not in entries]
    assert not missing, f"no reference entry (::: path) for {missing}"
    without_example = [name for name, path in names.items()
                       if not any(not code.startswith(NOT_RUN)
                                  for _, code in python_blocks(entries[path]))]
    assert not without_example, f"no example that runs under the entry of {without_example}"
