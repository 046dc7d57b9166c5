"""python -m hftc: inspect prints the fusion report and the fused graph; dot output; errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hftc.__main__ import main

ZOO = str(Path(__file__).parent / "zoo.py")


def test_inspect_prints_report_and_graph(capsys):
    assert main(["inspect", f"{ZOO}:lenet5_mnist", "-n", "3", "--input-shape", "2,1,28,28"]) == 0
    out = capsys.readouterr().out
    assert "hftc fusion report: 3 models" in out
    assert "fuse_conv_module" in out and "fuse_linear_module" in out
    assert "0 per-model loops" in out
    assert "def forward(self, x):" in out  # the generated fused forward


def test_inspect_writes_dot(tmp_path):
    target = tmp_path / "g.dot"
    assert main(["inspect", f"{ZOO}:resnet_small", "--input-shape", "2,3,32,32",
                 "--format", "dot", "-o", str(target)]) == 0
    dot = target.read_text()
    assert dot.startswith('digraph "') and "fuse_batch_norm_module" in dot and "->" in dot


def test_inspect_svg_without_graphviz_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert main(["inspect", f"{ZOO}:mlp", "--input-shape", "2,64", "--format", "svg",
                 "-o", str(tmp_path / "g.svg")]) == 2


def test_bad_factory_spec():
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        main(["inspect", "nofactory", "--input-shape", "2,3"])
    with pytest.raises(SystemExit, match="no attribute 'nothing'"):
        main(["inspect", f"{ZOO}:nothing", "--input-shape", "2,3"])


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "hftc", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("inspect", "demo", "bench"):
        assert command in out


@pytest.mark.parametrize("argv, message", [
    (["sweep", "spec.py", "--threads", "-1"], "--threads: must be at least 1"),
    (["inspect", "m:f", "--input-shape", "8,x"], "--input-shape: '8,x': expected a whole"),
    (["bench", "--sizes", "0"], "--sizes: '0': must be at least 1"),
    (["bench", "--rounds", "-3"], "--rounds: must be 0 .the default. or more"),
    (["demo", "-n", "-2"], "-n: must be at least 1"),
])
def test_bad_numbers_are_usage_errors(argv, message, capsys):
    """Such values gave a traceback from the command (set_num_threads, int()), a run that
    printed nonsense and exited 0 (--sizes 0), or 'N=-2 models' then an empty-list error."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
