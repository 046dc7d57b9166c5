"""The measured numbers of README.md and the guides, generated from docs/BENCHMARKS.md.

A number in README.md, docs/index.md or docs/guides/*.md that states a measurement is
written between markers, and this module writes what goes between them from the
tables of docs/BENCHMARKS.md (which ``python -m hftc.bench.report --docs`` generates
from the runs' JSON), so that they cannot disagree::

    MLP at N = 32: <!-- hftc:numbers name=cuda-h200/mlp/32/vs-serial -->18.96x<!-- /hftc:numbers -->

    python -m hftc.bench.docs_numbers            # rewrite every block from BENCHMARKS.md
    python -m hftc.bench.docs_numbers --check    # exit 1 and say which block differs

A ``name`` is either a figure's address in BENCHMARKS.md, ``BLOCK/WORKLOADS/NS/COLUMN``:

* ``BLOCK``: a generated block of BENCHMARKS.md, ``<!-- bench:BLOCK:begin -->``
  (``cuda-h200``, ``cuda``, ``cores-2``, ``defaults``, ``zoo``, ...; ``main`` is the
  unnamed ``<!-- bench:begin -->``);
* ``WORKLOADS``: ``mlp``, ``mlp,lenet5`` or ``*``; ``NS``: ``32``, ``2,4,8``, ``>=2`` or ``*``;
* ``COLUMN``: a column of the block's speedup table (``vs-serial``, ``vs-concurrent-mps``,
  ``vs-torch.func``, ``vs-hand-fused``: its header with ``-`` for spaces), or
  ``A:B``, contender A's throughput over B's (``hftc+step:concurrent-mps``;
  ``hftc|hftc+step:concurrent-mps``: the better of the two);

which gives one value (``18.96x``) or, over several cells, the lowest and the highest
(``0.58-0.81x``); or the name of a figure or table defined in :data:`NAMED` (counts,
the README's table). Kept out of ``import hftc``: it reads and writes the repository's
Markdown, nothing else (no torch).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = Path("docs") / "BENCHMARKS.md"
#: The pages whose measured numbers come from BENCHMARKS.md (relative to the repository):
#: every measured ratio of theirs is in a block (tests/test_docs_numbers.py).
PAGES = ("README.md", "docs/index.md", "docs/guides/*.md")
#: Pages that hold blocks too, beside hand-written numbers (BENCHMARKS.md's own prose).
ALSO = (str(BENCHMARKS),)

BLOCK = re.compile(r"<!-- hftc:numbers name=(\S+) -->((?:(?!<!-- hftc:numbers ).)*?)"
                   r"<!-- /hftc:numbers -->", re.S)
_BENCH_BEGIN = re.compile(r"<!-- bench:(?:([\w.+-]+):)?begin -->")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class FigureError(ValueError):
    """A figure's name that BENCHMARKS.md has no value for (the message says which)."""


# --------------------------------------------------------------------------- the tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[int, list[str], list[list[str]]]]:
    """Every Markdown table of ``text``: (offset of its header, header cells, rows)."""
    found, lines, offset, k = [], text.split("\n"), 0, 0
    starts = []
    for line in lines:
        starts.append(offset)
        offset += len(line) + 1
    while k < len(lines) - 1:
        if lines[k].startswith("|") and re.match(r"^\|[\s:|-]+\|$", lines[k + 1].strip()):
            header, rows, j = _cells(lines[k]), [], k + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            found.append((starts[k], header, rows))
            k = j
        else:
            k += 1
    return found


def _value(cell: str) -> float | None:
    """The median of a cell (``33,740 [27,481-42,979]``, ``18.96x``), or None (``n/a``)."""
    m = _NUMBER.match(cell.strip())
    return float(m.group().replace(",", "")) if m else None


class Benchmarks:
    """The generated blocks of docs/BENCHMARKS.md, read as tables."""

    def __init__(self, text: str):
        self.text = text
        self.blocks = {}
        for m in _BENCH_BEGIN.finditer(text):
            end = f"<!-- bench:{m.group(1)}:end -->" if m.group(1) else "<!-- bench:end -->"
            self.blocks[m.group(1) or "main"] = text[m.end():text.find(end, m.end())]

    @classmethod
    def read(cls, root: Path = ROOT) -> Benchmarks:
        return cls((root / BENCHMARKS).read_text())

    def block(self, name: str) -> str:
        if name not in self.blocks:
            raise FigureError(f"docs/BENCHMARKS.md has no generated block {name!r} "
                              f"(it has {sorted(self.blocks)})")
        return self.blocks[name]

    def speedups(self, block: str) -> dict[tuple[str, int], dict[str, str]]:
        """(workload, N) -> {column slug: cell} of the block's speedup table."""
        for _, header, rows in tables(self.block(block)):
            if header[:2] == ["workload", "N"]:
                slugs = [h.replace(" ", "-") for h in header]
                return {(r[0], int(r[1])): dict(zip(slugs, r)) for r in rows}
        raise FigureError(f"block {block!r} of docs/BENCHMARKS.md has no speedup table")

    def throughput(self, block: str, workload: str) -> dict[int, dict[str, float | None]]:
        """N -> {contender: samples/s} of the workload's throughput table in the block."""
        body = self.block(block)
        start = body.find(f"\n### {workload}\n")
        if start < 0:
            raise FigureError(f"block {block!r} of docs/BENCHMARKS.md has no ### {workload}")
        after = body[start:]
        table = after.find("Throughput, samples/s")
        for offset, header, rows in tables(after):
            if offset > table >= 0 and header[0] == "N":
                return {int(r[0]): {h: _value(c) for h, c in zip(header[1:], r[1:])}
                        for r in rows}
        raise FigureError(f"### {workload} of block {block!r} has no throughput table")


# --------------------------------------------------------------------------- figures


def ratio(values: list[float]) -> str:
    """One ratio as ``1.64x``; several as their range, ``0.58-0.81x``."""
    if not values:
        raise FigureError("no value")
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _pick(spec: str, available: list) -> list:
    if spec == "*":
        return available
    if spec.startswith(">="):
        return [a for a in available if a >= int(spec[2:])]
    wanted = [int(s) if s.isdigit() else s for s in spec.split(",")]
    return [w for w in wanted if w in available]


def cell_values(bench: Benchmarks, name: str) -> list[float]:
    """The values a ``BLOCK/WORKLOADS/NS/COLUMN`` address names (n/a cells left out)."""
    try:
        block, workloads, ns, column = name.split("/")
    except ValueError:
        raise FigureError(f"{name!r} is neither a named figure nor "
                          f"BLOCK/WORKLOADS/NS/COLUMN") from None
    table = bench.speedups(block)
    values = []
    for workload in _pick(workloads, sorted({w for w, _ in table})):
        for n in _pick(ns, sorted(n for w, n in table if w == workload)):
            if ":" in column:
                a, b = column.split(":")
                row = bench.throughput(block, workload).get(n, {})
                best = [row.get(c) for c in a.split("|")]
                if b in row and None not in best and row[b]:
                    values.append(max(best) / row[b])
            elif (workload, n) in table:
                if column not in table[workload, n]:
                    raise FigureError(f"the speedup table of block {block!r} has no column "
                                      f"{column!r} (it has {list(table[workload, n])[2:]})")
                value = _value(table[workload, n][column])
                if value is not None:
                    values.append(value)
    if not values:
        raise FigureError(f"docs/BENCHMARKS.md has no value for {name!r}")
    return values


def figure(bench: Benchmarks, name: str) -> str:
    """What the block ``name`` holds: a :data:`NAMED` figure or table, or an address."""
    if name in NAMED:
        return NAMED[name](bench)
    return ratio(cell_values(bench, name))


#: The workloads as the prose names them.
LABELS = {"mlp": "the MLP", "lenet5": "LeNet-5", "pointnet": "PointNet",
          "resnet18": "ResNet-18", "mobilenet_v2": "MobileNetV2",
          "transformer": "the Transformer", "transformer_stock": "the stock Transformer",
          "convnext": "ConvNeXt", "efficientnet": "EfficientNet",
          "style_transfer": "style transfer", "lstm_lm": "the LSTM language model",
          "gpt": "GPT"}


def _mps_wins(bench: Benchmarks, block: str, contenders: str
              ) -> tuple[list[tuple[str, int]], int]:
    """(the points where N processes under MPS beat ``contenders``, points measured)."""
    table = bench.speedups(block)
    beaten, total = [], 0
    for workload in sorted({w for w, _ in table}):
        for n, row in bench.throughput(block, workload).items():
            best = [row.get(c) for c in contenders.split("|")]
            if row.get("concurrent-mps") and None not in best:
                total += 1
                if row["concurrent-mps"] > max(best):
                    beaten.append((workload, n))
    return beaten, total


def _mps_count(block: str, contenders: str) -> Callable[[Benchmarks], str]:
    def count(bench: Benchmarks) -> str:
        beaten, total = _mps_wins(bench, block, contenders)
        return f"{len(beaten)} of the {total}"
    return count


def _mps_where(block: str, contenders: str) -> Callable[[Benchmarks], str]:
    """Where MPS won: ``PointNet at N = 2 and 8``."""
    def where(bench: Benchmarks) -> str:
        beaten, _ = _mps_wins(bench, block, contenders)
        by_workload: dict[str, list[str]] = {}
        for workload, n in beaten:
            by_workload.setdefault(workload, []).append(str(n))
        parts = [f"{LABELS.get(w, w)} at N = " + (" and ".join(ns) if len(ns) < 3 else
                                                  ", ".join(ns[:-1]) + " and " + ns[-1])
                 for w, ns in by_workload.items()]
        return "; ".join(parts) or "nowhere"
    return where


def _hfta_published(bench: Benchmarks) -> str:
    m = re.search(r"hftc >= ([\d.]+x) serial \(HFTA's lowest published\)", bench.text)
    if not m:
        raise FigureError("docs/BENCHMARKS.md's targets name no HFTA's lowest published")
    return m.group(1)


#: The speedup table's rows: (workload, machine, N, block, ``WORKLOAD/N`` in the block).
_SPEEDUP_ROWS = [
    ("MLP", "NVIDIA H200", "32", "cuda-h200", "mlp/32"),
    ("LeNet-5", "NVIDIA H200", "32", "cuda-h200", "lenet5/32"),
    ("Transformer", "NVIDIA H200", "32", "cuda-h200", "transformer/32"),
    ("PointNet", "NVIDIA H200", "8", "cuda-h200", "pointnet/8"),
    ("ResNet-18, batch 128", "NVIDIA H100", "8", "cuda", "resnet18/8"),
    ("MLP", "CPU, 2 cores", "32", "cores-2", "mlp/32"),
    ("LeNet-5", "CPU, 2 cores", "16", "cores-2", "lenet5/16"),
    ("MLP", "CPU, 1 core", "32", "main", "mlp/32"),
    ("LeNet-5", "CPU, 1 core", "16", "main", "lenet5/16"),
]


def _cell(bench: Benchmarks, name: str) -> str:
    try:
        return figure(bench, name)
    except FigureError:
        return ""  # a contender the run did not have (no MPS on a CPU)


def speedup_table(bench: Benchmarks) -> str:
    """hftc (eager, under the user's loop) and ``hftc.compile_step`` against each way of
    running N models, at the largest N of each run."""
    lines = ["| workload | machine | N | vs serial | vs concurrent | vs MPS | "
             "`compile_step` vs MPS |", "|---|---|---|---|---|---|---|"]
    for label, machine, n_label, block, at in _SPEEDUP_ROWS:
        cells = [_cell(bench, f"{block}/{at}/{c}")
                 for c in ("vs-serial", "vs-concurrent", "vs-concurrent-mps",
                           "hftc+step:concurrent-mps")]
        lines.append(f"| {label} | {machine} | {n_label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def h200_mps_table(bench: Benchmarks) -> str:
    """On the H200: the better of eager hftc and ``compile_step`` against N processes
    under MPS, per workload and N (as docs/BENCHMARKS.md's own table)."""
    ns = (2, 8, 32)
    lines = ["| workload | " + " | ".join(f"N = {n}" for n in ns) + " |",
             "|---|" + "---|" * len(ns)]
    for workload, label in (("mlp", "MLP"), ("lenet5", "LeNet-5"),
                            ("transformer", "Transformer"), ("pointnet", "PointNet")):
        cells = [_cell(bench, f"cuda-h200/{workload}/{n}/hftc|hftc+step:concurrent-mps")
                 or "not run" for n in ns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(bench: Benchmarks) -> str:
    """Whole sweeps, ``hftc sweep`` against the same study run one trial at a time with
    stock Optuna, both as whole processes (the block ``sweeps``: the latest run's)."""
    for _, header, rows in tables(bench.block("sweeps")):
        if header[:2] == ["sweep", "machine"]:
            keep = [header.index(c) for c in header if c != "best (hftc / stock)"]
            lines = ["| " + " | ".join(header[k] for k in keep) + " |",
                     "|" + "---|" * len(keep)]
            lines += ["| " + " | ".join(row[k] for k in keep) + " |" for row in rows]
            return "\n".join(lines)
    raise FigureError("docs/BENCHMARKS.md's block `sweeps` holds no table headed "
                      "| sweep | machine | ...")


#: Figures and tables that are more than one address.
NAMED: dict[str, Callable[[Benchmarks], str]] = {
    "speedup-table": speedup_table,
    "sweep-table": sweep_table,
    "h200-mps-table": h200_mps_table,
    "h200-mps-beat-eager": _mps_count("cuda-h200", "hftc"),
    "h200-mps-beat-step": _mps_count("cuda-h200", "hftc|hftc+step"),
    "h200-mps-beat-step-where": _mps_where("cuda-h200", "hftc|hftc+step"),
    "h100-mps-beat-eager": _mps_count("cuda", "hftc"),
    "hfta-lowest-published": _hfta_published,
}


# --------------------------------------------------------------------------- the pages


def pages(root: Path = ROOT, also: bool = False) -> list[Path]:
    """The pages whose numbers come from BENCHMARKS.md (``also``: and :data:`ALSO`)."""
    return sorted(p for pattern in (*PAGES, *(ALSO if also else ())) for p in root.glob(pattern))


def _body(text: str) -> str:
    # a table on lines of its own, blank lines around, so that Markdown reads the
    # markers as comments and the table as a table
    return f"\n\n{text}\n\n" if "\n" in text else text


def render(text: str, bench: Benchmarks) -> str:
    """``text`` with every block's content rewritten from ``bench``."""
    def one(m: re.Match) -> str:
        name = m.group(1)
        return (f"<!-- hftc:numbers name={name} -->{_body(figure(bench, name))}"
                f"<!-- /hftc:numbers -->")
    return BLOCK.sub(one, text)


def stale(root: Path = ROOT) -> list[str]:
    """Each block whose content differs from BENCHMARKS.md: ``file: name: has X, source Y``."""
    bench, found = Benchmarks.read(root), []
    for path in pages(root, also=True):
        for m in BLOCK.finditer(path.read_text()):
            want = _body(figure(bench, m.group(1)))
            if m.group(2) != want:
                found.append(f"{path.relative_to(root)}: {m.group(1)}: has "
                             f"{m.group(2).strip()!r}, docs/BENCHMARKS.md gives {want.strip()!r}")
    return found


def update(root: Path = ROOT, benchmarks: str | None = None) -> list[Path]:
    """Rewrite every block of the pages from BENCHMARKS.md (``benchmarks``: its new text,
    written with them); the files changed.  Every page is rendered before any is
    written: a figure the tables lack (FigureError) leaves every file as it was."""
    source = root / BENCHMARKS
    bench, new = Benchmarks(benchmarks) if benchmarks is not None else Benchmarks.read(root), {}
    for path in pages(root, also=True):
        text = path.read_text()
        if benchmarks is not None and path.resolve() == source.resolve():
            new[path] = text = benchmarks  # written whether or not its own blocks change
        rendered = render(text, bench)
        if rendered != path.read_text():
            new[path] = rendered
    for path, text in new.items():
        path.write_text(text)
    return list(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hftc.bench.docs_numbers",
                                description="README's and the guides' numbers from "
                                            "docs/BENCHMARKS.md")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if a block differs from BENCHMARKS.md")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = p.parse_args(argv)
    try:
        if args.check:
            found = stale(args.root)
            for line in found:
                print(line, file=sys.stderr)
            return 1 if found else 0
        for path in update(args.root):
            print(f"updated {path}")
    except FigureError as exc:
        print(f"hftc.bench.docs_numbers: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
