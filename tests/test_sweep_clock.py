"""The sweep's whole-process clock (hftc/sweep/clock.py): the seconds before the sweep
counted on both sides of the speedup, and the result files inside the sweep's clock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_sweep_bench import SPEC

import hftc.sweep as hs
from hftc.sweep.clock import before_sweep, command_process
from hftc.sweep.report import fused_seconds, serial_estimate, speedup_line


def test_before_sweep_is_none_outside_the_command():
    assert before_sweep() is None
    with command_process():
        inside = before_sweep()
        with command_process():  # nested: still the command's
            assert before_sweep() is not None
        assert before_sweep() is not None
    assert before_sweep() is None
    if Path("/proc/self/stat").exists():
        assert inside is not None and inside > 0.0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux's /proc")
def test_before_sweep_counts_from_the_process_start():
    """A process that sleeps 0.6 s before asking: at least that, and not the machine's
    uptime (a few seconds at most on top, Python's start and the import)."""
    code = ("import time; time.sleep(0.6)\n"
            "from hftc.sweep.clock import before_sweep, command_process\n"
            "with command_process():\n    print(before_sweep())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    seconds = float(out.stdout.strip())
    assert 0.6 <= seconds < 30.0


def _result(**over):
    base = dict(wall_s=10.0, trial_epochs=100, timings={"train": 4.0},
                serial_epoch_s=[0.10, 0.12, 0.20], serial_trial_epochs=80,
                serial_optuna_s=2.0, load_s=0.5, dynamo_import_s=0.0, before_s=3.0,
                hftc_import_s=0.25)
    base.update(over)
    return SimpleNamespace(**base)


def test_both_sides_are_charged_their_process_start():
    """serial: 80 x 0.12 + Optuna 2.0 + data 0.5 + start 3.0 less hftc's 0.25 = 14.85 s;
    fused: the sweep's 10 s + its start 3 s = 13 s."""
    result = _result()
    serial_s, how = serial_estimate(result)
    assert serial_s == pytest.approx(80 * 0.12 + 2.0 + 0.5 + 2.75)
    assert "its process's start 2.8 s" in how and "hftc's import 0.2 s" in how
    assert fused_seconds(result) == pytest.approx(13.0)
    line = speedup_line(result)
    assert f"{serial_s / 13.0:.2f}x" in line and "13.0 s, the process's start included" in line


def test_neither_side_is_charged_a_start_not_measured():
    """No start measured (a sweep from a notebook): neither side; no Optuna share
    measured (a shared study): the start is not charged to the fused side alone."""
    not_command = _result(before_s=None)
    serial_s, how = serial_estimate(not_command)
    assert serial_s == pytest.approx(80 * 0.12 + 2.0 + 0.5)
    assert "process's start" not in how
    assert fused_seconds(not_command) == 10.0
    shared = _result(serial_optuna_s=None)
    serial_s, how = serial_estimate(shared)
    assert serial_s == pytest.approx(80 * 0.12) and "leaves out" in how
    assert fused_seconds(shared) == 10.0
    assert "start included" not in speedup_line(shared)


def test_a_start_shorter_than_hftcs_import_charges_nothing():
    result = _result(before_s=0.1, hftc_import_s=0.25)
    serial_s, _ = serial_estimate(result)
    assert serial_s == pytest.approx(80 * 0.12 + 2.0 + 0.5)


def test_result_files_are_inside_the_sweeps_clock(tmp_path: Path):
    spec_file = tmp_path / "benchtiny.py"
    spec_file.write_text(SPEC)
    result = hs.run(hs.load_spec(spec_file), out=tmp_path / "out", progress=False)
    assert result.before_s is None  # in-process, not the command
    assert result.timings["results"] > 0.0
    assert (tmp_path / "out" / "results.csv").exists()
    assert result.wall_s >= sum(result.timings.values())


def test_the_command_reports_its_start(tmp_path: Path):
    """``hftc sweep`` in its own process: the summary says what ran before the sweep."""
    spec_file = tmp_path / "benchtiny.py"
    spec_file.write_text(SPEC)
    out = subprocess.run([sys.executable, "-m", "hftc", "sweep", str(spec_file), "--out",
                          str(tmp_path / "out"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "before it: Python, the imports, the spec" in out.stdout
    # The fused side never imports torch._dynamo (hftc/patches.py); the one-at-a-time
    # script's first stock step does, and its estimate is charged the import, measured.
    assert "torch._dynamo's import" in out.stdout
