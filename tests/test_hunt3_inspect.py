"""``hftc inspect`` on a user's models and mistakes: a factory that returns something other
than N new models of one class, raises inside torch or takes arguments, an output pipe
closed early; and that what the report and the graph say of each op is true for every
model (a per-model op is not drawn as "one op for all N models")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hftc.__main__ import main

MODELS = '''\
import itertools
import torch
from torch import nn

_calls = itertools.count()
_one = nn.Linear(8, 4)


def not_a_module():
    return 3


def the_class():
    return nn.Linear


def mixed_classes():
    return nn.Linear(8, 4) if next(_calls) % 2 == 0 else nn.Sequential(nn.Linear(8, 4))


def the_same_model():
    return _one


def takes_a_width(width):
    return nn.Linear(8, width)


def bad_layer_argument():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding_mode="mirror"))


def local_class():
    class Net(nn.Module):  # a new class object each call, one class all the same
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x).relu()
    return Net()


class ActNet(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = act
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def activations():
    return ActNet([nn.ReLU(), nn.GELU(), nn.Tanh()][next(_calls) % 3])


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3), nn.Flatten(), nn.Linear(16 * 12 * 12, 10))

    def forward(self, x):
        return self.net(x)


class TwoLayer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def widths():
    return TwoLayer(16 * (1 + next(_calls) % 3))


class Bag(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.fc = nn.Linear(16, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def vocabularies():
    return Bag([50, 30, 40][next(_calls) % 3])


class ShapeChecked(nn.Module):
    """A forward that checks its input's rank in Python, as many user models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        if x.dim() != 3:
            raise ValueError(f"expected [B, T, 8], got {tuple(x.shape)}")
        return self.fc(x)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Stack(nn.Module):
    """Residual blocks (blocks.0, blocks.1), leaf layers at an index (features.0), a head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.blocks = nn.Sequential(Residual(), Residual())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(self.features(x)).mean(1))


class Tempered(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.temperature = temperature

    def forward(self, x):
        return self.fc(x) / self.temperature


def temperatures():
    return Tempered([1.0, 2.0, 0.5][next(_calls) % 3])


class FFTNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.rfft(self.fc(x)).abs()
'''


@pytest.fixture
def models_file(tmp_path: Path) -> str:
    path = tmp_path / "user_models.py"
    path.write_text(MODELS)
    return str(path)


def _line_of(path: str, text: str) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1)
                if text in line)


def _inspect_error(capsys, *argv: str) -> str:
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("factory, says", [
    ("not_a_module", "returned 3 (int) on call 1, not a torch.nn.Module"),
    ("the_class", "return an instance, Linear(...), not the class"),
    ("the_same_model", "returned the same Linear object on calls 1 and 2"),
])
def test_a_factory_that_does_not_return_n_new_models_of_one_class_is_a_usage_error(
        models_file, factory, says, capsys):
    # before: hftc.fuse's FusionTypeError about "model 0" (exit 1), a MismatchError, or
    # (the same object N times) a report as if N models had fused
    err = _inspect_error(capsys, f"{models_file}:{factory}", "--input", "2,8")
    assert says in err, err
    assert f"{models_file}:{_line_of(models_file, f'def {factory}(')}" in err


def test_a_factory_failing_inside_torch_names_the_users_line_not_torchs(models_file, capsys):
    err = _inspect_error(capsys, f"{models_file}:bad_layer_argument", "--input", "2,8")
    assert f"{models_file}:{_line_of(models_file, 'padding_mode=')}" in err, err
    assert "site-packages" not in err and "torch/nn" not in err


def test_a_factory_that_takes_arguments_names_its_definition(models_file, capsys):
    # before: "raised TypeError: takes_a_width() missing ..." and no file or line at all
    err = _inspect_error(capsys, f"{models_file}:takes_a_width", "--input", "2,8")
    assert "missing 1 required positional argument" in err
    assert f"{models_file}:{_line_of(models_file, 'def takes_a_width(')}" in err


def test_output_pipe_closed_early_is_not_a_traceback(models_file):
    process = subprocess.Popen(
        [sys.executable, "-m", "hftc", "inspect", f"{models_file}:FFTNet", "--input", "2,8",
         "--code"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    process.stdout.close()  # `| head -0`: the reader is gone before hftc prints
    err = process.stderr.read().decode()
    process.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _dot_labels(capsys, *argv: str) -> dict[str, str]:
    """``hftc inspect --format dot``'s boxes: label -> the box's line."""
    assert main(["inspect", *argv, "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    return {line.split('label="')[1].split('"')[0]: line
            for line in dot.splitlines() if 'label="' in line and "legend" not in line}


def test_dot_draws_a_per_model_op_as_each_models_op_not_one_op_for_all(models_file, capsys):
    # before: lightblue, the legend's "fused: one op for all N models", labelled with hftc's
    # kernel `differing_elementwise` while model 1 ran GELU and model 2 Tanh
    boxes = _dot_labels(capsys, f"{models_file}:activations", "--input", "2,8")
    (act,) = [line for label, line in boxes.items() if label.startswith("act")]
    assert "relu (model 0)" in act and "gelu (model 1)" in act and "tanh (model 2)" in act
    assert "fillcolor=lightblue" not in act and "differing_elementwise\\n" not in act
    assert main(["inspect", f"{models_file}:activations", "--input", "2,8"]) == 0
    text = capsys.readouterr().out
    # the text table's op column too: each model's op, not model 0's ReLU alone
    (row,) = [line for line in text.splitlines() if line.startswith("  act ")]
    assert "relu (model 0), gelu (model 1), tanh (model 2)" in row
    assert "per model (ops differ)" in row


def test_dot_names_the_users_op_of_a_box_run_model_by_model(models_file, capsys):
    # before: "fft_rfft: loop_over_models__fft_rfft", hftc's name for its loop
    boxes = _dot_labels(capsys, f"{models_file}:FFTNet", "--input", "2,8")
    (fft,) = [line for label, line in boxes.items() if label.startswith("fft_rfft")]
    assert 'label="fft_rfft: fft.rfft\\n' in fft and "fillcolor=mistyrose" in fft


def test_inspect_output_is_the_same_run_to_run(models_file, capsys):
    # before: unseeded models and example inputs, so the check's "largest difference"
    # changed from run to run of the same command
    for fmt in ("text", "dot"):
        outputs = []
        for _ in range(3):
            assert main(["inspect", f"{models_file}:ConvNet", "--input", "4,3,16,16",
                         "--format", fmt]) == 0
            outputs.append(capsys.readouterr().out)
        assert outputs[0] == outputs[1] == outputs[2]


MISSING_DEPENDENCY = "import torch\nimport a_package_not_installed_xyz\n\n\ndef make():\n    " \
                     "return torch.nn.Linear(8, 4)\n"


def test_a_module_whose_own_import_fails_names_its_line(tmp_path, monkeypatch, capsys):
    # before: "cannot import 'models_dep': No module named 'a_package_not_installed_xyz'",
    # as if models_dep itself were missing, with no file or line (a path FACTORY named both)
    (tmp_path / "models_dep.py").write_text(MISSING_DEPENDENCY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _inspect_error(capsys, "models_dep:make", "--input", "2,8")
    assert "raised ModuleNotFoundError" in err, err
    assert f"{tmp_path / 'models_dep.py'}:2" in err and "import a_package_not_installed" in err
    # the sweep spec's MODULE form is loaded the same way
    from hftc.errors import SpecError
    from hftc.sweep.spec import load_spec
    with pytest.raises(SpecError, match=r"raised ModuleNotFoundError.*models_dep.py:2"):
        load_spec("models_dep")
    # a module that is not there is still said so
    err = _inspect_error(capsys, "models_not_there_xyz:make", "--input", "2,8")
    assert "cannot import 'models_not_there_xyz': No module named" in err


def test_models_of_different_widths_inspect_with_pad_widths(models_file, capsys):
    # before: the MismatchError's advice, hftc.fuse(models, pad_widths=True), had no option
    assert main(["inspect", f"{models_file}:widths", "--input", "2,8"]) == 1
    assert "hftc inspect: --pad-widths fuses them" in capsys.readouterr().err
    assert main(["inspect", f"{models_file}:widths", "--input", "2,8", "--pad-widths"]) == 0
    out = capsys.readouterr().out
    assert "padded widths (pad_widths=True)" in out and "values agree" in out
    # the graph's shapes are the widest model's (fc1: 48), not "model 0's" (16)
    assert main(["inspect", f"{models_file}:widths", "--input", "2,8", "--pad-widths",
                 "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert "[N, 2, 48]" in dot and "shapes: [N, the widest model's ...]" in dot


def test_token_ids_drawn_for_padded_vocabularies_are_valid_for_every_model(models_file, capsys):
    # before: ids in [0, model 0's 50), out of range for model 1's 30: an IndexError in
    # model 1's own forward, reported as a MismatchError about state kept outside the model
    assert main(["inspect", f"{models_file}:vocabularies", "--input", "long:4,8",
                 "--pad-widths"]) == 0
    assert "values agree" in capsys.readouterr().out


def test_a_model_fx_cannot_trace_is_inspected_with_the_example_inputs(models_file, capsys):
    # before: inspect fused without its --input as example_inputs: a TraceError whose
    # advice was to "pass example_inputs=(...) to hftc.fuse", which the command had
    import torch

    import hftc
    shape_checked = _load(models_file, "ShapeChecked")
    models = [shape_checked() for _ in range(2)]
    hftc.fuse(models, example_inputs=(torch.randn(2, 5, 8),))  # the library takes them
    assert main(["inspect", f"{models_file}:ShapeChecked", "--input", "2,5,8"]) == 0
    out = capsys.readouterr().out
    assert "values agree" in out
    # the input guard torch.export's graph holds is hftc's, not a path into its internals
    assert "hftc's check_input_shape" in out and "hftc.lowering" not in out


def _load(path: str, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("_hunt3_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@pytest.mark.parametrize("fmt", ["text", "dot"])
def test_o_file_holds_what_stdout_shows(models_file, tmp_path, capsys, fmt):
    # before: the file lacked stdout's last newline (a DOT or text file not ending in one)
    argv = ["inspect", f"{models_file}:ConvNet", "--input", "4,3,16,16", "--format", fmt]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").read_text() == shown and shown.endswith("}\n" * (fmt == "dot"))


def test_png_that_cannot_be_drawn_is_refused_before_the_models_are_made(tmp_path, capsys):
    # before: the factory ran and the models fused (minutes for a large one), then the
    # usage error: no Graphviz `dot`, or no -o
    path = tmp_path / "counted.py"
    path.write_text("from pathlib import Path\nfrom torch import nn\n\n\ndef make():\n"
                    f"    Path({str(tmp_path / 'called')!r}).write_text('yes')\n"
                    "    return nn.Linear(8, 4)\n")
    assert main(["inspect", f"{path}:make", "--input", "2,8", "--format", "png"]) == 2
    assert "needs" in capsys.readouterr().err
    assert not (tmp_path / "called").exists()


@pytest.mark.parametrize("typed, says", [
    ("2,,3", "expected a whole number, got ''"),   # before: silently the shape (2, 3)
    ("2.5,3", "expected a whole number, got '2.5'"),  # before: "unknown dtype '2.5,3'"
    ("", "expected [DTYPE:]SHAPE"),                # before: "unknown dtype ''"
])
def test_input_typos_are_named_as_shape_errors(typed, says):
    import argparse

    from hftc.cli.args import input_spec
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
        input_spec(typed)
    assert input_spec("long:8,16,").shape == (8, 16)  # a trailing comma, as Python's


def _clusters(dot: str) -> dict[str, list[str]]:
    """The DOT's frames: block -> the labels of its boxes ("" for those in no frame)."""
    clusters: dict[str, list[str]] = {"": []}
    current = ""
    for line in dot.splitlines():
        if line.startswith("  subgraph cluster_") and "legend" not in line:
            current = line.split("cluster_")[1].split(" ")[0]
            clusters[current] = []
        elif line == "  }":
            current = ""
        elif 'label="' in line and "legend" not in line and line.strip().startswith('"'):
            clusters[current].append(line.split('label="')[1].split('"')[0].split("\\n")[0])
    return clusters


def test_dot_frames_hold_their_blocks_ops_and_the_head_stays_outside(models_file, capsys):
    # before: the head (mean, fc) was drawn inside the last block's frame, blocks.1's
    # residual add inside blocks.0's (each joined the frame of its first input)
    assert main(["inspect", f"{models_file}:Stack", "--input", "2,4,8", "--format", "dot"]) == 0
    clusters = _clusters(capsys.readouterr().out)
    assert set(clusters) == {"", "blocks_0", "blocks_1"}  # features.0 is a layer, no frame
    assert any(label.startswith("head") for label in clusters[""])
    assert any(label.startswith("mean") for label in clusters[""])
    adds = {block: [x for x in labels if x.startswith("add")]
            for block, labels in clusters.items()}
    assert adds == {"": [], "blocks_0": ["add"], "blocks_1": ["add_1: add"]}, clusters


def test_dot_labels_a_rules_helper_by_its_kernel_not_as_the_op_again(models_file, capsys):
    # before: two boxes "truediv", one of them each model's temperatures (no shape)
    boxes = _dot_labels(capsys, f"{models_file}:temperatures", "--input", "2,8")
    heads = [label.split("\\n")[0] for label in boxes]
    assert heads.count("truediv") == 1, heads
    assert any(head.startswith("truediv: ") and "scalars" in head for head in heads), heads


def test_a_factory_returning_models_of_two_classes_is_a_usage_error(models_file, capsys):
    # before: a MismatchError (exit 1) about node `0` vs "the model itself"
    err = _inspect_error(capsys, f"{models_file}:mixed_classes", "--input", "2,8")
    assert "returned a torch.nn.modules.linear.Linear on call 1 and a " \
           "torch.nn.modules.container.Sequential on call 2" in err, err
    # a class defined in the factory's body, a new class object each call, is one class
    assert main(["inspect", f"{models_file}:local_class", "--input", "2,8"]) == 0
    assert "values agree" in capsys.readouterr().out
