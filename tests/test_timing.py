"""The one timing mechanism (hftc.lowering.timing): its measurement loop, its margin and
tie rule, and that every choice hftc makes by timing goes through it."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import hftc
from hftc.lowering import timing

CPU = torch.device("cpu")


def test_rounds_interleave_and_alternate_their_order():
    calls = []
    ways = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = timing.measure(ways, CPU, rounds=3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for row in times.values() for t in row)


def test_repeats_make_one_figure_and_a_budget_stops_after_the_minimum():
    calls = []
    times = timing.measure({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                           CPU, rounds=10, min_rounds=2, budget_s=0.0, repeats={"a": 4})
    assert calls.count("a") == 8 and calls.count("b") == 2  # two rounds, four calls of a each
    assert len(times["a"]) == len(times["b"]) == 2
    # a second block extends the same rows
    timing.measure({"a": lambda: None}, CPU, rounds=1, times=times)
    assert len(times["a"]) == 3 and len(times["b"]) == 2


@pytest.mark.parametrize("other, chosen", [
    (0.99, "default"),   # within the margin: the default stays
    (1.0 - timing.MARGIN / 2, "default"),
    (1.0, "default"),    # a tie
    (0.90, "other"),     # faster by more than the margin
    (1.20, "default"),
])
def test_another_way_than_the_default_must_win_by_the_margin(other, chosen):
    assert timing.choose({"default": 1.0, "other": other}, "default") == chosen
    # per round: the median of the per-round ratios, not the ratio of medians
    rows = {"default": [1.0, 2.0, 4.0], "other": [other, 2 * other, 4 * other]}
    assert timing.choose(rows, "default") == chosen


def test_the_ratio_is_per_round_so_drift_hits_both_ways():
    # the machine slowed down over the rounds: medians of the rows would mislead
    rows = {"default": [1.0, 3.0, 9.0], "other": [0.9, 2.7, 8.1]}
    assert timing.ratios(rows, "default")["other"] == pytest.approx(0.9)
    assert timing.choose(rows, "default") == "other"


def test_a_tie_on_time_goes_to_the_smaller_footprint():
    times = {"default": 1.0, "other": 1.01}
    assert timing.choose(times, "default", {"default": 100, "other": 70}) == "other"
    assert timing.choose(times, "default", {"default": 100, "other": 90}) == "default"
    assert timing.choose(times, "default", {"default": None, "other": 10}) == "default"
    # a clear winner on time stays, however much more it holds
    assert timing.choose({"default": 1.0, "other": 0.9}, "default",
                         {"default": 10, "other": 100}) == "other"


def test_the_cache_round_trips_and_ignores_damaged_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(timing, "_MEMORY", {})
    path = tmp_path / "autotune.json"
    timing.store_entry("k", {"chosen": "fused", "times": {"fused": 1.0}}, path)
    monkeypatch.setattr(timing, "_MEMORY", {})  # a new process: only the file is left
    assert timing.lookup_entry("k", path) == {"chosen": "fused", "times": {"fused": 1.0}}
    path.write_text('{"k": {"chosen": 3, "times": {}}}')
    monkeypatch.setattr(timing, "_MEMORY", {})
    assert timing.lookup_entry("k", path) is None


def test_deterministic_mode_turns_timing_off():
    assert timing.timing_allowed()
    torch.use_deterministic_algorithms(True)
    try:
        assert not timing.timing_allowed()
    finally:
        torch.use_deterministic_algorithms(False)


def _calls(tree: ast.AST, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                found.append(name)
    return found


def test_every_choice_by_timing_uses_the_one_mechanism():
    """No module that decides how a fused model runs keeps a timing loop, a margin or a
    tie rule of its own: the medians and the comparisons are timing.py's."""
    package = pathlib.Path(hftc.__file__).parent
    deciders = [*package.glob("lowering/*.py"), *package.glob("module/*.py"),
                *package.glob("training/*.py"), *package.glob("optim/*.py")]
    offenders = {}
    for path in deciders:
        if path.name == "timing.py":
            continue
        source = path.read_text()
        tree = ast.parse(source)
        medians = [n for n in _calls(tree, {"median"})]
        margins = [line for line in source.splitlines()
                   if line.lstrip().startswith("_") and "MARGIN" in line.split("=")[0]]
        if medians or margins:
            offenders[str(path.relative_to(package))] = (medians, margins)
    assert offenders == {}
