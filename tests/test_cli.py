"""python -m hftc: inspect prints each op (the user's names, shapes [N, ...], the strategy's
choice; the generated forward with --code); dot output; errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hftc.__main__ import main

ZOO = str(Path(__file__).parent / "zoo.py")
FACTORIES = str(Path(__file__).parent / "cli_factories.py")


def _row(out: str, node: str) -> list[str]:
    """The cells of ``node``'s row of the op table (columns two spaces apart)."""
    line = next(line for line in out.splitlines() if line.startswith(f"  {node} "))
    return re.split(r"\s{2,}", line.strip())


def test_inspect_prints_each_op_as_the_user_wrote_it(capsys):
    assert main(["inspect", f"{ZOO}:lenet5_mnist", "-n", "3", "--input-shape", "2,1,28,28"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hftc inspect {ZOO}:lenet5_mnist: 3 models (N = 3)")
    assert "13 ops fused, 0 computed once (shared), 0 run model by model" in out
    # the user's op names, the fused shapes with the model axis N, model 0's shape after it
    assert _row(out, "conv1") == ["conv1", "Conv2d", "conv1", "fused", "[N, 2, 6, 28, 28]"]
    assert _row(out, "max_pool2d") == ["max_pool2d", "max_pool2d", "-", "fused",
                                       "[N, 2, 6, 14, 14]"]
    assert _row(out, "view") == ["view", "view", "-", "fused", "[N, 2, 400]"]
    assert _row(out, "fc3") == ["fc3", "Linear", "fc3", "fused", "[N, 2, 10]"]
    assert "channelwise" not in out and "fuse_" not in out  # hftc's names stay inside
    assert "strategy: runs the fused program (forced)" in out  # the suite's HFTC_STRATEGY
    assert "def forward" not in out and "--code" in out  # the code only on request


def test_inspect_code_shows_the_generated_forward(capsys):
    assert main(["inspect", f"{ZOO}:lenet5_mnist", "-n", "2", "--input-shape", "2,1,28,28",
                 "--code"]) == 0
    out = capsys.readouterr().out
    assert "the generated forward:\ndef forward(self, x):" in out
    assert out.index("strategy:") < out.index("def forward")


def test_inspect_columns_hold_with_long_names(capsys):
    assert main(["inspect", f"{FACTORIES}:long_names", "-n", "2", "--input", "4,8"]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[1].splitlines()
    header = table[0]
    starts = [header.index(name) for name in ("op", "module path", "kind", "output")]
    long = "encoder_projection_to_hidden_features_layer"
    for line in table[1:]:  # every cell starts under its heading, after a gap of two
        for start in starts:
            assert line[start - 2:start] == "  " and line[start] != " ", (line, header)
    assert _row(out, long) == [long, "Linear", long, "fused", "[N, 4, 16]"]
    assert _row(out, "max_pool1d")[1] == "max_pool1d"


def test_inspect_says_what_the_timed_strategy_chose(capsys):
    """strategy='timed' times on the first calls: inspect calls until it has chosen and
    says which way runs, not that the calls still alternate."""
    assert main(["inspect", f"{ZOO}:mlp", "-n", "2", "--input-shape", "2,64",
                 "--strategy", "timed"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("strategy: "))
    assert re.match(r"strategy: runs (the fused program|the models one by one) \(timed", line)
    assert "alternates" not in out


def test_inspect_strategy_option(capsys):
    assert main(["inspect", f"{ZOO}:lenet5_mnist", "-n", "2", "--input-shape", "2,1,28,28",
                 "--strategy", "model_loop"]) == 0
    assert "strategy: runs the models one by one (forced)" in capsys.readouterr().out


def test_inspect_writes_dot(tmp_path):
    target = tmp_path / "g.dot"
    assert main(["inspect", f"{ZOO}:resnet_small", "--input-shape", "2,3,32,32",
                 "--format", "dot", "-o", str(target)]) == 0
    dot = target.read_text()
    assert dot.startswith('digraph "') and "fuse_batch_norm" in dot and "->" in dot
    # a frame per residual block, a legend, model 0's shapes and the lowering each conv runs
    assert "subgraph cluster_layer1_0 {" in dot and "subgraph cluster_legend {" in dot
    assert re.search(r'label="conv1: conv -> \w+\\n\[N, 2, 8, 32, 32\]"', dot), dot[:3000]


def test_inspect_dot_names_the_users_ops(tmp_path):
    target = tmp_path / "g.dot"
    assert main(["inspect", f"{ZOO}:lenet5_mnist", "--input-shape", "2,1,28,28",
                 "--format", "dot", "-o", str(target)]) == 0
    dot = target.read_text()
    assert re.search(r'label="max_pool2d\\n\[N, 2, 6, 14, 14\]"', dot), dot[:3000]
    assert re.search(r'label="max_pool2d_1: max_pool2d\\n\[N, 2, 16, 5, 5\]"', dot)
    assert not re.search(r'label="[^"]*channelwise', dot)  # hftc's kernel names stay out


def test_inspect_svg_without_graphviz_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert main(["inspect", f"{ZOO}:mlp", "--input-shape", "2,64", "--format", "svg",
                 "-o", str(tmp_path / "g.svg")]) == 2


def test_bad_factory_spec(capsys):
    # a usage error: argparse's exit status 2 and one line, not SystemExit's 1
    assert main(["inspect", "nofactory", "--input-shape", "2,3"]) == 2
    assert "expected MODULE:FACTORY" in capsys.readouterr().err
    assert main(["inspect", f"{ZOO}:nothing", "--input-shape", "2,3"]) == 2
    assert "no attribute 'nothing'" in capsys.readouterr().err


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "hftc", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("inspect", "demo", "bench", "sweep"):
        assert command in out


@pytest.mark.parametrize("command", [[], ["inspect"], ["demo"], ["bench"], ["sweep"]])
def test_help_answers_without_importing_torch(command):
    """torch costs 3-4 s to import: `hftc --help` took 4.5-5 s."""
    code = ("import sys, contextlib, io\n"
            "from hftc.__main__ import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try:\n"
            f"        main({command + ['--help']!r})\n"
            "    except SystemExit:\n"
            "        pass\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'numpy', 'optuna', 'matplotlib'))\n"
            "print(heavy, 'usage: hftc' in out.getvalue())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] True"


def test_bench_help_lists_workloads_and_contenders(capsys):
    from hftc.bench import names
    from hftc.bench.contenders import CONTENDERS
    from hftc.bench.workloads import WORKLOADS

    assert list(names.WORKLOADS) == list(WORKLOADS)
    assert list(names.CONTENDERS) == list(CONTENDERS)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(re.search(rf"^  {re.escape(name)} ", out, re.M)
               for name in [*WORKLOADS, *CONTENDERS])


def test_inspect_embedding_model_with_token_ids(capsys):
    """--input-shape built a float randn: nn.Embedding refused it."""
    assert main(["inspect", f"{FACTORIES}:tiny_gpt", "-n", "2", "--input", "long:4,16"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "wte") == ["wte", "Embedding", "wte", "fused", "[N, 4, 16, 32]"]
    assert _row(out, "arange") == ["arange", "arange", "-", "shared", "[16]"]  # once: no N
    assert "def forward" not in out


def test_inspect_model_with_two_inputs(capsys):
    assert main(["inspect", f"{FACTORIES}:ids_and_features", "-n", "2",
                 "--input", "long:4,16:30", "--input", "float:4,8"]) == 0
    out = capsys.readouterr().out
    assert "2 models (N = 2)" in out and _row(out, "embed")[1:] == ["Embedding", "embed",
                                                                    "fused", "[N, 4, 16, 16]"]


def test_inspect_names_a_missing_input(capsys):
    assert main(["inspect", f"{FACTORIES}:ids_and_features", "-n", "2",
                 "--input", "long:4,16"]) == 1
    assert "missing input `feats`" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("complex:4,4", "unknown dtype 'complex'"),
    ("float:4,4:10", "HIGH .* is for integer inputs"),
    ("long:4,x", "expected a whole number"),
    ("long:", "expected \\[DTYPE:\\]SHAPE"),
])
def test_bad_input_specs_are_usage_errors(spec, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "m:f", "--input", spec])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_bench_creates_its_output_folders(tmp_path, capsys):
    """--plots DIR crashed with FileNotFoundError after the whole run when DIR was missing."""
    out, plots = tmp_path / "new" / "run.json", tmp_path / "plots" / "deep"
    assert main(["bench", "--workloads", "mlp", "--sizes", "2", "--contenders", "serial,hftc",
                 "--rounds", "1", "--compile-sizes", "", "--max-n", "", "--out", str(out),
                 "--plots", str(plots)]) == 0
    text = capsys.readouterr()
    assert out.is_file() and sorted(p.name for p in plots.iterdir()) == [
        "bench_memory.png", "bench_throughput.png"]
    # the targets of workloads that did not run (lenet5, mlp at N=32) are left out
    assert "lenet5 N=16" not in text.out and "mlp N=32" not in text.out
    assert "USDT" not in text.out + text.err


def test_one_demo(monkeypatch):
    """`hftc demo` and `sweep --demo` were two different demos; both are now the sweep's."""
    import hftc.sweep.demo

    calls = []
    monkeypatch.setattr(hftc.sweep.demo, "run_demo", lambda out, **kw: calls.append((out, kw)))
    assert main(["demo", "--trials", "4", "-n", "2", "--epochs", "1", "--no-progress"]) == 0
    assert main(["sweep", "--demo", "--trials", "4", "-n", "2", "--epochs", "1",
                 "--no-progress"]) == 0
    assert calls[0] == calls[1] == ("sweeps/demo-digits", dict(
        n_trials=4, per_array=2, epochs=1, threads=1, progress=False))


def test_the_demo_refuses_no_estimate(capsys):
    """The demo is its measured speedup: `sweep --demo --no-estimate` says so (exit 2)
    instead of running it with the flag ignored."""
    assert main(["sweep", "--demo", "--no-estimate"]) == 2
    assert "--demo measures its speedup" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["sweep", "spec.py", "--threads", "-1"], "--threads: must be at least 1"),
    (["inspect", "m:f", "--input-shape", "8,x"], "--input-shape: '8,x': expected a whole"),
    (["bench", "--sizes", "0"], "--sizes: '0': must be at least 1"),
    (["bench", "--rounds", "-3"], "--rounds: must be 0 .the default. or more"),
    (["demo", "-n", "-2"], "-n/--per-array: must be at least 1"),
])
def test_bad_numbers_are_usage_errors(argv, message, capsys):
    """Such values gave a traceback from the command (set_num_threads, int()), a run that
    printed nonsense and exited 0 (--sizes 0), or 'N=-2 models' then an empty-list error."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
