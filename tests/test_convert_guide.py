"""docs/guides/convert.md: its script converts to N configurations fused in at most 15
changed lines, the page's diff is the diff of its two scripts, and the converted script
trains each configuration exactly as the original's separate runs (float64: the same
best checkpoints, within 1e-10; early stopping at the same epochs)."""

from __future__ import annotations

import difflib
import re
import runpy
from pathlib import Path

import pytest
import torch
from test_docs import python_blocks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "convert.md"


def _scripts() -> tuple[str, str]:
    """The page's first two python blocks: the script before and after."""
    (_, before), (_, after) = python_blocks(PAGE.read_text())[:2]
    return before, after


def _diff(before: str, after: str) -> list[str]:
    return list(difflib.unified_diff(before.splitlines(), after.splitlines(), "before.py",
                                     "after.py", n=1, lineterm=""))


def test_the_conversion_changes_at_most_15_lines_and_the_page_shows_its_diff():
    before, after = _scripts()
    diff = _diff(before, after)
    changed = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(changed) <= 15, changed
    shown = re.search(r"^```diff\n(.*?)^```", PAGE.read_text(), re.M | re.S).group(1)
    assert shown.splitlines() == diff
    assert f"**{len(changed)} changed lines**" in PAGE.read_text()


@pytest.fixture
def float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def _run(code: str, folder: Path) -> list[str]:
    """Run ``code`` as a script in ``folder``; its printed lines."""
    folder.mkdir()
    script = folder / "train_digits.py"
    script.write_text(code)
    printed: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
        runpy.run_path(str(script), run_name="__main__")
    return printed


def test_the_converted_script_trains_each_configuration_as_its_own_run(
        tmp_path, monkeypatch, float64):
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path / "cache"))
    before, after = _scripts()
    separate = _run(before, tmp_path / "separate")
    fused = _run(after, tmp_path / "fused")
    files = sorted(p.name for p in (tmp_path / "separate").glob("best_*.pt"))
    assert files == sorted(p.name for p in (tmp_path / "fused").glob("best_*.pt"))
    assert files == [f"best_{i}.pt" for i in range(4)]
    for name in files:
        ours = torch.load(tmp_path / "fused" / name, weights_only=True)
        theirs = torch.load(tmp_path / "separate" / name, weights_only=True)
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype == (
                torch.float64 if theirs[key].is_floating_point() else theirs[key].dtype)
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-10)
    # the same epochs: the separate runs print one line per epoch each, the fused run one
    # per epoch for all; a run that stopped early printed fewer (one did, here)
    epochs = [int(line.split()[1].rstrip(":")) for line in separate]
    runs = [k for k, e in enumerate(epochs) if e == 0] + [len(epochs)]
    lengths = [b - a for a, b in zip(runs, runs[1:])]
    assert len(lengths) == 4 and len(fused) == max(lengths) and min(lengths) < max(lengths)
    for epoch, line in enumerate(fused):
        losses = line.split("accuracy")[0]
        values = [float(v) for v in re.findall(r"[\d.]+(?:e-?\d+)?", losses)[1:]]
        expected = [float(separate[start + epoch].split()[4].rstrip(","))
                    for start, n in zip(runs, lengths) if epoch < n]
        assert values == pytest.approx(expected, abs=1e-4)
