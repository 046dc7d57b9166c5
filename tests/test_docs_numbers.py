"""The docs agree with each other and with docs/BENCHMARKS.md.

* Every ``<!-- hftc:numbers name=... -->`` block of README.md, docs/index.md and
  docs/guides/*.md holds what :mod:`hftc.bench.docs_numbers` generates from
  BENCHMARKS.md's tables (``python -m hftc.bench.docs_numbers`` rewrites them).
* No measured ratio (``1.64x``, ``0.58-0.81x``) stands in those pages outside a block,
  code aside: a new one is written as a block, so it cannot go stale.
* Every guide is listed by docs/index.md, README.md and mkdocs.yml's nav.
* Widths are described one way: where a page says models of other widths cannot or do
  not fuse, the same paragraph names ``pad_widths``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hftc.bench import docs_numbers
from hftc.bench.docs_numbers import BLOCK, Benchmarks, FigureError, figure

ROOT = Path(__file__).resolve().parents[1]
PAGES = docs_numbers.pages(ROOT)
#: A ratio as the docs write a measured speedup: 1.64x, 0.58-0.81x, 16x (not 3x32x32).
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?x(?![\w])")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_pages_are_found():
    names = {_page_id(p) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/guides/performance.md"} <= names


def test_every_block_holds_what_benchmarks_md_gives():
    found = docs_numbers.stale(ROOT)
    assert not found, ("blocks that differ from docs/BENCHMARKS.md (run `python -m "
                       "hftc.bench.docs_numbers` to rewrite them):\n" + "\n".join(found))


def _prose(text: str) -> str:
    """``text`` with the generated blocks, fenced code and code spans blanked (lines kept)."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m.group())
    for pattern in (BLOCK, _FENCE, _CODE_SPAN):
        text = pattern.sub(blank, text)
    return text


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_no_measured_ratio_outside_a_block(path):
    text = _prose(path.read_text())
    loose = [f"{_page_id(path)}:{text[:m.start()].count(chr(10)) + 1}: {m.group()}"
             for m in RATIO.finditer(text)]
    assert not loose, (
        "measured ratios written by hand: put each in a block generated from "
        "docs/BENCHMARKS.md, `<!-- hftc:numbers name=BLOCK/WORKLOAD/N/COLUMN -->"
        "<!-- /hftc:numbers -->` (hftc/bench/docs_numbers.py says the names), then run "
        "`python -m hftc.bench.docs_numbers`:\n" + "\n".join(loose))


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_an_inline_block_does_not_start_a_line(path):
    # Markdown (Python-Markdown, CommonMark) reads a line that starts with `<!--` as a
    # raw HTML block, which cuts the paragraph and leaves the figure unrendered.
    starts = [f"{_page_id(path)}:{path.read_text()[:m.start()].count(chr(10)) + 1}"
              for m in BLOCK.finditer(path.read_text())
              if "\n" not in m.group(2)
              and re.search(r"(?:^|\n) {0,3}$", path.read_text()[:m.start()])]
    assert not starts, f"inline blocks at the start of a line (move a word before): {starts}"


def test_the_pages_use_blocks():
    names = {m.group(1) for p in PAGES for m in BLOCK.finditer(p.read_text())}
    assert {"speedup-table", "h200-mps-beat-eager"} <= names


# --------------------------------------------------------------------------- the machinery

_BENCH = """# Benchmarks

<!-- bench:gpu:begin -->
### hftc (eager) against each baseline

| workload | N | vs serial | vs concurrent-mps | vs serial, per round |
|---|---|---|---|---|
| mlp | 1 | 0.80x | 0.75x | 0.79x [0.55-1.03] |
| mlp | 8 | 5.00x | 0.72x | 5.15x [3.73-6.84] |
| mlp | 32 | 18.96x | 1.68x | 18.69x [15.60-24.12] |
| lenet5 | 8 | 4.71x | n/a | 4.63x [3.75-5.56] |

### mlp

Throughput, samples/s summed over the N models: median [min-max] over rounds.

| N | serial | concurrent-mps | hftc | hftc+step |
|---|---|---|---|---|
| 1 | 100 [90-110] | 120 [100-130] | 80 [70-90] | 300 [250-310] |
| 8 | 100 [90-110] | 1,000 [900-1,100] | 720 [700-800] | 2,000 [1,800-2,100] |
| 32 | 100 [90-110] | 1,000 [900-1,100] | 1,680 [1,600-1,700] | 900 [800-950] |

### lenet5

Throughput, samples/s summed over the N models: median [min-max] over rounds.

| N | serial | hftc |
|---|---|---|
| 8 | 100 [90-110] | 471 [400-500] |

<!-- bench:gpu:end -->
"""


@pytest.fixture
def bench() -> Benchmarks:
    return Benchmarks(_BENCH)


def test_a_figure_is_a_cell_or_the_range_of_cells(bench):
    assert figure(bench, "gpu/mlp/32/vs-serial") == "18.96x"
    assert figure(bench, "gpu/mlp/>=2/vs-serial") == "5.00-18.96x"
    assert figure(bench, "gpu/*/8/vs-serial") == "4.71-5.00x"
    assert figure(bench, "gpu/*/8/vs-concurrent-mps") == "0.72x"   # n/a left out
    assert figure(bench, "gpu/mlp/8/hftc+step:concurrent-mps") == "2.00x"
    assert figure(bench, "gpu/mlp/32/hftc|hftc+step:serial") == "16.80x"   # the better


def test_mps_is_counted_over_the_points_it_ran(bench):
    assert docs_numbers._mps_wins(bench, "gpu", "hftc") == ([("mlp", 1), ("mlp", 8)], 3)
    assert docs_numbers._mps_wins(bench, "gpu", "hftc|hftc+step") == ([], 3)


@pytest.mark.parametrize("name", ["gpu/resnet18/8/vs-serial", "gpu/mlp/8/vs-torch.func",
                                  "cpu/mlp/8/vs-serial", "gpu/mlp/64/vs-serial",
                                  "no-such-figure"])
def test_a_figure_benchmarks_md_does_not_have_is_an_error(bench, name):
    with pytest.raises(FigureError):
        figure(bench, name)


def _repo(tmp_path: Path, readme: str) -> Path:
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "docs" / "BENCHMARKS.md").write_text(_BENCH)
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def test_update_rewrites_a_stale_block_and_check_finds_it(tmp_path, capsys):
    root = _repo(tmp_path, "MLP: <!-- hftc:numbers name=gpu/mlp/32/vs-serial -->16.5x"
                           "<!-- /hftc:numbers --> serial.\n")
    assert docs_numbers.main(["--check", "--root", str(root)]) == 1
    assert "gpu/mlp/32/vs-serial: has '16.5x', docs/BENCHMARKS.md gives '18.96x'" in \
        capsys.readouterr().err
    assert docs_numbers.main(["--root", str(root)]) == 0
    assert (root / "README.md").read_text() == (
        "MLP: <!-- hftc:numbers name=gpu/mlp/32/vs-serial -->18.96x<!-- /hftc:numbers --> "
        "serial.\n")
    assert docs_numbers.main(["--check", "--root", str(root)]) == 0


def test_a_new_benchmarks_table_updates_the_readme(tmp_path):
    # what `hftc bench --docs docs/BENCHMARKS.md` / `report --docs` does after a new run
    from hftc.bench import report

    root = _repo(tmp_path, "<!-- hftc:numbers name=gpu/mlp/8/vs-serial -->5.00x"
                           "<!-- /hftc:numbers -->\n")
    table = _BENCH.split("<!-- bench:gpu:begin -->\n")[1].split("<!-- bench:gpu:end -->")[0]
    report.update_docs(root / "docs" / "BENCHMARKS.md", table.replace("5.00x", "6.10x"), "gpu")
    assert "-->6.10x<!--" in (root / "README.md").read_text()


def test_a_block_whose_figure_is_gone_fails_the_check(tmp_path, capsys):
    root = _repo(tmp_path, "<!-- hftc:numbers name=gpu/lenet5/32/vs-serial -->13.66x"
                           "<!-- /hftc:numbers -->\n")
    assert docs_numbers.main(["--check", "--root", str(root)]) == 1
    assert "no value for 'gpu/lenet5/32/vs-serial'" in capsys.readouterr().err


# --------------------------------------------------------------------------- agreement


def test_every_guide_is_listed():
    guides = sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md"))
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = {where: [g for g in guides if f"guides/{g}" not in text]
               for where, text in (("docs/index.md", index), ("README.md", readme),
                                   ("mkdocs.yml", nav))}
    assert not any(missing.values()), f"guides not listed: {missing}"


def _paragraphs(text: str) -> list[str]:
    return [p for chunk in re.split(r"\n\s*\n", _FENCE.sub("", text))
            for p in re.split(r"\n\s*[-*] ", chunk)]


def test_widths_are_described_with_pad_widths():
    pages = [*PAGES, *sorted((ROOT / "docs" / "reference").glob("*.md"))]
    wrong = [f"{_page_id(path)}: {p.strip()[:120]!r}" for path in pages
             for p in _paragraphs(path.read_text())
             if re.search(r"\bwidths?\b", p) and re.search(r"\bcannot\b|\bdo not\b", p)
             and "pad_widths" not in p]
    assert not wrong, ("where models of other widths cannot fuse, say what fuses them "
                       "(pad_widths=True, fuse_groups):\n" + "\n".join(wrong))
    for page in ("README.md", "docs/guides/sweep-with-optuna.md", "docs/reference/fuse.md"):
        assert "pad_widths=True" in (ROOT / page).read_text(), page


@pytest.mark.parametrize("path", docs_numbers.pages(ROOT, also=True), ids=_page_id)
def test_every_opened_block_is_closed(path):
    text = path.read_text()
    assert text.count("<!-- hftc:numbers name=") == len(BLOCK.findall(text)), (
        f"{_page_id(path)}: a `<!-- hftc:numbers name=... -->` without its "
        f"`<!-- /hftc:numbers -->`")


def test_the_sweep_table_is_the_sweeps_blocks_table_less_the_best_column():
    text = ("<!-- bench:sweeps:begin -->\n\n"
            "| sweep | machine | hftc sweep | speedup (median of rounds) | best (hftc / stock) |\n"
            "|---|---|---|---|---|\n"
            "| MLP | CPU | 6.8 s | 1.25x [1.21-1.29] | 0.97 / 0.98 |\n\n"
            "<!-- bench:sweeps:end -->\n")
    assert figure(Benchmarks(text), "sweep-table") == (
        "| sweep | machine | hftc sweep | speedup (median of rounds) |\n|---|---|---|---|\n"
        "| MLP | CPU | 6.8 s | 1.25x [1.21-1.29] |")
    with pytest.raises(FigureError, match="no generated block 'sweeps'"):
        figure(Benchmarks(_BENCH), "sweep-table")
