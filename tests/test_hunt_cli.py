"""hftc's command line on a newcomer's mistakes: a FACTORY or SPEC that does not load, a
seed Optuna cannot take, an -o that cannot be written, bench's unknown names: each one
paragraph naming the user's file and line, exit status 2 (argparse's), no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hftc.__main__ import main
from hftc.errors import MissingExtraError, SpecError
from hftc.sweep.spec import SweepSpec, load_spec

ZOO = str(Path(__file__).parent / "zoo.py")


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_inspect_factory_file_with_a_syntax_error_names_its_line(tmp_path, capsys):
    path = _file(tmp_path, "models_syntax.py", "import torch\n\ndef make(:\n    pass\n")
    assert main(["inspect", f"{path}:make", "--input", "2,3"]) == 2
    err = capsys.readouterr().err
    assert f"SyntaxError at {path}:3" in err and "def make(:" in err
    assert "Traceback" not in err and "importlib" not in err


def test_inspect_factory_raising_names_the_users_line(tmp_path, capsys):
    path = _file(tmp_path, "models_raise.py",
                 "from torch import nn\n\ndef make():\n    return nn.Linear(3, 4, bais=True)\n")
    assert main(["inspect", f"{path}:make", "-n", "2", "--input", "2,3"]) == 2
    err = capsys.readouterr().err
    assert "the factory" in err and "raised TypeError" in err
    assert f"{path}:4" in err and "nn.Linear(3, 4, bais=True)" in err
    # an error at the module's import: the same, at its line
    path = _file(tmp_path, "models_import.py", "import torch\nSIZE = undefined_name\n")
    assert main(["inspect", f"{path}:make", "--input", "2,3"]) == 2
    err = capsys.readouterr().err
    assert "raised NameError" in err and f"{path}:2" in err and "SIZE = undefined_name" in err


@pytest.mark.parametrize("factory, says", [
    ("no/such/models.py:make", "no such file no/such/models.py"),
    ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    (f"{ZOO}:ZOO_NOT_THERE", "no attribute 'ZOO_NOT_THERE'"),
    (f"{ZOO}:__name__", "not a factory"),
])
def test_inspect_factory_that_does_not_load_is_a_usage_error(factory, says, capsys):
    assert main(["inspect", factory, "--input", "2,3"]) == 2
    assert says in capsys.readouterr().err


def test_inspect_output_that_cannot_be_written_is_a_usage_error(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for fmt in ("text", "dot"):
        assert main(["inspect", f"{ZOO}:mlp", "-n", "2", "--input-shape", "2,64",
                     "--format", fmt, "-o", str(a_file / "out.txt")]) == 2
        err = capsys.readouterr().err
        assert f"cannot write -o {a_file / 'out.txt'}" in err and "Traceback" not in err


def test_sweep_spec_with_a_syntax_error_names_its_line(tmp_path, capsys):
    path = _file(tmp_path, "spec_syntax.py", "def space(trial)\n    return {}\n")
    assert main(["sweep", path, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"SyntaxError at {path}:1" in err and "def space(trial)" in err
    assert "Traceback" not in err


def test_sweep_spec_raising_at_import_names_its_line(tmp_path):
    path = _file(tmp_path, "spec_raise.py", "import torch\nX = torch.zeros(2)[5]\n")
    with pytest.raises(SpecError, match=r"raised IndexError.*spec_raise.py:2: `X = torch"):
        load_spec(path)


def test_sweep_seed_optuna_cannot_take_is_refused_before_the_sweep(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", "hftc.sweep.digits", "--seed", "-1", "--trials", "2",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "2**32 - 1" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was made
    spec = load_spec("hftc.sweep.digits")
    with pytest.raises(SpecError, match="spec.seed"):
        spec.replace(seed=2**32)
    assert isinstance(spec.replace(seed=2**32 - 1), SweepSpec)


def test_bench_unknown_workload_is_a_usage_error(capsys):
    assert main(["bench", "--workloads", "mlpp"]) == 2
    err = capsys.readouterr().err
    assert "unknown workloads ['mlpp']" in err and "choose from" in err


@pytest.mark.parametrize("command", [
    ["sweep", "hftc.sweep.digits", "--trials", "2", "--no-progress"],
    ["demo", "--trials", "2"],
])
def test_sweep_without_optuna_says_what_to_install(monkeypatch, tmp_path, capsys, command):
    # a plain `pip install hftc`: the sweep's modules import optuna, which is not there
    monkeypatch.setitem(sys.modules, "optuna", None)
    import hftc.sweep

    for name in [m for m in sys.modules if m.startswith("hftc.sweep.")
                 and m not in ("hftc.sweep.cli", "hftc.sweep.clock", "hftc.sweep.spec")]:
        monkeypatch.delitem(sys.modules, name)
        short = name.split(".")[2]
        if hasattr(hftc.sweep, short):  # a re-import rebinds it: the old one comes back
            monkeypatch.setattr(hftc.sweep, short, getattr(hftc.sweep, short))
    assert main([*command, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "needs 'optuna'" in err and "pip install 'hftc[sweep]'" in err
    assert "Traceback" not in err


def test_lazy_sweep_names_without_optuna_raise_missing_extra(monkeypatch):
    import hftc.sweep

    monkeypatch.setitem(sys.modules, "optuna", None)
    monkeypatch.delitem(sys.modules, "hftc.sweep.engine", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'hftc\[sweep\]'") as caught:
        hftc.sweep.Sweep  # noqa: B018
    assert caught.value.extra == "sweep" and isinstance(caught.value, ModuleNotFoundError)


def test_bench_plots_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path,
                                                                   capsys):
    import hftc.bench.cli as bench_cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(bench_cli, "run_suite", lambda *a, **k: pytest.fail("it ran"))
    assert main(["bench", "--workloads", "mlp", "--sizes", "2", "--contenders", "serial",
                 "--plots", str(tmp_path / "plots"), "--out", str(tmp_path / "r.json")]) == 2
    assert "pip install 'hftc[plots]'" in capsys.readouterr().err


def test_inspect_inputs_the_model_cannot_take_name_the_option_not_hftcs_line(capsys):
    # the call comes from hftc's own command line: "the user's line" was hftc's
    # (frontends/symbolic.py's, or hftc/__main__.py's under python -m hftc)
    assert main(["inspect", f"{ZOO}:mlp", "-n", "2", "--input", "2,65"]) == 1
    err = capsys.readouterr().err
    assert "mat1 and mat2 shapes cannot be multiplied" in err
    assert "symbolic.py" not in err and "__main__.py" not in err
    assert "the example inputs came from --input 2,65" in err


def test_python_m_hftc_frames_are_not_the_users_line():
    import subprocess

    code = ("import runpy, sys\n"
            "sys.argv = ['hftc', 'inspect', sys.argv[1] + ':mlp', '-n', '2', '--input', "
            "'2,65']\n"
            "runpy.run_module('hftc', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", code, ZOO], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "mat1 and mat2" in out.stderr and "__main__.py" not in out.stderr, out.stderr


def test_user_line_skips_hftcs_frames():
    from hftc.errors import user_line

    assert user_line().startswith(f" at {__file__}:")  # this test's own line
    namespace = {"__name__": "hftc.fake", "user_line": user_line}
    exec(compile("def site():\n    return user_line()\n", "<hftc>", "exec"), namespace)
    assert namespace["site"]().startswith(f" at {__file__}:")  # hftc's frame skipped


@pytest.mark.parametrize("command", [
    ["bench", "--workloads", "mlp", "--sizes", "2", "--contenders", "serial"],
    ["bench", "--sweep"],
])
def test_bench_out_that_is_a_folder_is_refused_before_the_run(monkeypatch, tmp_path, capsys,
                                                              command):
    import hftc.bench.cli as bench_cli
    import hftc.bench.sweep as bench_sweep

    monkeypatch.setattr(bench_cli, "run_suite", lambda *a, **k: pytest.fail("it ran"))
    monkeypatch.setattr(bench_sweep, "run_sweep_bench", lambda *a, **k: pytest.fail("it ran"))
    assert main([*command, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is a folder" in err and "results.json" in err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main([*command, "--out", str(a_file / "r.json")]) == 2
    assert f"cannot create the output folder {a_file}" in capsys.readouterr().err


def test_inspect_factory_file_named_like_a_stdlib_module_replaces_nothing(tmp_path, capsys,
                                                                         monkeypatch):
    # models in copy.py were registered as sys.modules["copy"]: torch's and hftc's
    # `import copy` got the user's file, and the check of the fused program failed
    import copy

    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder it adds goes again
    folder = tmp_path / "models"
    folder.mkdir()
    _file(folder, "hunt_cli_blocks.py", "from torch import nn\n\nclass Block(nn.Sequential):\n"
                               "    def __init__(self):\n"
                               "        super().__init__(nn.Linear(3, 4), nn.ReLU())\n")
    path = _file(folder, "copy.py", "from hunt_cli_blocks import Block  # a neighbour\n"
                                    "\ndef make():\n    return Block()\n")
    assert main(["inspect", f"{path}:make", "-n", "2", "--input", "2,3"]) == 0
    out = capsys.readouterr().out
    assert sys.modules["copy"] is copy
    assert "values agree" in out and "raised" not in out
