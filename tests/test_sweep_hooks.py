"""The open sweep spec: train_step, several optimizers with param groups, per-trial
schedulers, a streaming DataLoader with augmentation, on_epoch; checked before training;
SQLite and PostgreSQL; SIGKILL and --resume; the end summary.

The spec is pytorch/examples' MNIST MLP in small, float64, so each fused trial equals the
same trial trained alone by a plain PyTorch loop to 1e-9.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import optuna
import pytest
import torch
import torch.nn.functional as F
from optuna.trial import TrialState
from test_sweep_distributed import postgres_url  # noqa: F401  (a fixture)

import hftc.errors
import hftc.sweep as hs
from hftc.__main__ import main
from hftc.sweep.training import round_seed

ROOT = Path(__file__).resolve().parents[1]

SPEC_SOURCE = '''
\"\"\"pytorch/examples' MNIST MLP in small, with every hook of an open sweep spec (float64).\"\"\"
import importlib.util
import json
import os
import re
import signal

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import hftc

name = "hooks"
metric = "loss"
epochs = 3
batch_size = 20
eval_batch_size = 50
n_trials = 5
per_array = 3
dtype = torch.float64
LOG = os.environ.get("HFTC_TEST_LOG")  # on_epoch's JSON lines
KILL = os.environ.get("HFTC_TEST_KILL", "")  # "step:N" / "epoch:N": SIGKILL at the Nth call
calls = {"step": 0, "epoch": 0}


def _maybe_die(where):
    calls[where] += 1
    if KILL == f"{where}:{calls[where]}":
        os.kill(os.getpid(), signal.SIGKILL)


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(12, width)
        self.norm = nn.LayerNorm(width)
        self.fc2 = nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.norm(self.fc1(x))))


class PruneTrialZeroAfterOneEpoch(optuna.pruners.BasePruner):
    \"\"\"Trial 0 leaves after epoch 1: its array is cut and re-fused with a newcomer.\"\"\"

    def prune(self, study, trial):
        return trial.number == 0 and max(trial.intermediate_values, default=0) >= 1


pruner = PruneTrialZeroAfterOneEpoch()


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 3e-2, log=True),
            "gamma": trial.suggest_float("gamma", 0.5, 0.95),
            "weight_decay": trial.suggest_float("weight_decay", 1e-3, 1e-1, log=True),
            "width": 16 if trial.number % 3 == 2 else 8}  # trials 2, 5, ...: another array


def model(params):
    return Net(params["width"])


def optimizer(params, module):
    \"\"\"nanoGPT's groups (no weight decay for biases and norms) for the body, and a second
    optimizer for the head.\"\"\"
    body = [(n, p) for n, p in module.named_parameters() if not n.startswith("fc2")]
    decay = [p for n, p in body if p.dim() >= 2]
    no_decay = [p for n, p in body if p.dim() < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": params["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}], lr=params["lr"])
    sgd = torch.optim.SGD(module.fc2.parameters(), lr=10 * params["lr"], momentum=0.9)
    return [adamw, sgd]


def scheduler(optimizer, params):
    if isinstance(optimizer, torch.optim.AdamW):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=params["gamma"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))


def train_step(model, batch, optimizers, params):
    \"\"\"The user's loss, two optimizers, gradient accumulation over two micro-batches.\"\"\"
    _maybe_die("step")
    x, y = batch
    for opt in optimizers:
        opt.zero_grad()
    total = 0.0
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        losses = hftc.per_model(F.cross_entropy)(model(xm), ym, label_smoothing=0.1)
        (losses.sum() / 2).backward()
        total = total + losses.detach() / 2
    for opt in optimizers:
        opt.step()
    return total


def _samples():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 12, generator=g, dtype=torch.float64)
    y = (x @ torch.randn(12, 3, generator=g, dtype=torch.float64)).argmax(1)
    return x, y


class Stream(IterableDataset):
    \"\"\"A streaming dataset: shuffled and augmented (noise) with torch's generator.\"\"\"

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in torch.randperm(len(self.y)).tolist():
            yield self.x[i] + 0.05 * torch.randn_like(self.x[i]), self.y[i]


def data():
    x, y = _samples()
    train = DataLoader(Stream(x[:120], y[:120]), batch_size=batch_size)
    val = DataLoader(TensorDataset(x[120:], y[120:]), batch_size=eval_batch_size)
    return train, val


TENSORBOARD = os.environ.get("HFTC_TEST_TENSORBOARD")  # a folder, where tensorboard imports
writer = None


def on_epoch(logs):
    global writer
    _maybe_die("epoch")
    if TENSORBOARD and importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        writer = writer or SummaryWriter(TENSORBOARD)
        for entry in logs:
            for key in ("loss", "train_loss", "lr"):
                writer.add_scalar(f"trial-{entry['trial']}/{key}", entry[key], entry["epoch"])
        writer.flush()
    if LOG:
        with open(LOG, "a") as f:
            for entry in logs:
                f.write(json.dumps({k: v for k, v in entry.items() if k != "params"}) + "\\n")
'''


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "hooks_spec.py"
    path.write_text(SPEC_SOURCE)
    return path


def plain_loop(spec_module, trial: optuna.trial.FrozenTrial) -> tuple[list[float], dict]:
    """The trial trained alone by plain PyTorch: stock model, AdamW with two param groups
    and SGD, StepLR and LambdaLR, two micro-batches per step, the streaming loader seeded
    as the sweep seeds each epoch. Returns the validation loss per epoch and the weights."""
    params = trial.user_attrs.get("hftc_params", trial.params)
    torch.manual_seed(trial.user_attrs["hftc_seed"])
    model = spec_module.model(params).to(torch.float64)
    optimizers = spec_module.optimizer(params, model)
    schedulers = [spec_module.scheduler(o, params) for o in optimizers]
    train, val = spec_module.data()
    history = []
    for key in trial.user_attrs["hftc_orders"]:
        torch.manual_seed(round_seed(key))
        model.train()
        for x, y in train:
            for o in optimizers:
                o.zero_grad()
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                (F.cross_entropy(model(xm), ym, label_smoothing=0.1) / 2).backward()
            for o in optimizers:
                o.step()
        model.eval()
        with torch.no_grad():
            out = torch.cat([model(x) for x, _ in val])
            target = torch.cat([y for _, y in val])
            history.append(F.cross_entropy(out, target).item())
        for s in schedulers:
            s.step()
    return history, model.state_dict()


def _module(spec_file: Path):
    loaded = importlib.util.spec_from_file_location("hooks_spec_for_test", spec_file)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def _assert_equal_to_plain_loop(spec_file: Path, trials) -> None:
    module = _module(spec_file)
    for t in trials:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        alone, _ = plain_loop(module, t)
        assert len(alone) == len(fused) >= 1
        for a, b in zip(alone, fused):
            assert abs(a - b) <= 1e-9 * abs(a), (t.number, alone, fused)


def test_every_hook_gives_what_each_trial_gives_trained_alone(spec_file: Path,
                                                               tmp_path: Path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("HFTC_TEST_LOG", str(log))
    monkeypatch.setenv("HFTC_TEST_TENSORBOARD", str(tmp_path / "runs"))
    result = hs.run(spec_file, out=tmp_path / "out", progress=False)
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.PRUNED] + [TrialState.COMPLETE] * 4
    _assert_equal_to_plain_loop(spec_file, trials)
    # best.pt holds the weights the plain loop ends with.
    best = result.study.best_trial
    _, weights = plain_loop(_module(spec_file), best)
    saved = torch.load(tmp_path / "out" / "best.pt", weights_only=True)
    assert saved.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(saved[k], weights[k], rtol=1e-9, atol=1e-12)
    # hftc.sweep.train_alone runs the same hooks on a stock model.
    _, history = hs.train_alone(hs.load_spec(spec_file), best.user_attrs["hftc_params"],
                                best.user_attrs["hftc_seed"], best.user_attrs["hftc_orders"])
    assert abs(history[-1] - best.value) <= 1e-9 * best.value
    # on_epoch: every trial's every epoch, its metric, mean training loss and current lr.
    logs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((e["trial"], e["epoch"]) for e in logs) == sorted(
        (t.number, s) for t in trials for s in t.intermediate_values)
    for e in logs:
        t = trials[e["trial"]]
        assert e["loss"] == t.intermediate_values[e["epoch"]]
        assert e["train_loss"] > 0
        # StepLR: lr * gamma ** epoch, after the epoch's step
        expected = t.params["lr"] * t.params["gamma"] ** e["epoch"]
        assert abs(e["lr"] - expected) <= 1e-12, (e, expected)
    if importlib.util.find_spec("tensorboard") is not None:  # (not installed everywhere)
        assert list((tmp_path / "runs").glob("events.out.tfevents.*"))


def test_the_summary_gives_time_speedup_arrays_and_why_apart(spec_file: Path,
                                                             tmp_path: Path, capsys):
    assert main(["sweep", str(spec_file), "--out", str(tmp_path / "out"), "--no-progress",
                 "--trials", "3", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "time: " in out and "training " in out and "fusing " in out and "Optuna " in out
    assert "speedup: " in out and "estimated" in out and "training alone: " in out
    assert "fused arrays: 2+1 trials per array" in out
    assert ("not in one array: trials [2] vs [0, 1]: `fc1` (nn.Linear): out_features 16 vs "
            "8; parameter `fc1.weight`: shape (16, 12) vs (8, 12)") in out
    assert "different shapes" in out


def test_the_summary_of_a_plain_spec(tmp_path: Path):
    """Any spec (here one without hooks, one array) gets the timing, speedup and arrays."""
    from test_sweep import SPEC_SOURCE as plain

    path = tmp_path / "plain_spec.py"
    path.write_text(plain)
    result = hs.run(path, out=tmp_path / "out", progress=False, n_trials=2, epochs=1)
    lines = result.summary.splitlines()
    assert lines[0].startswith("time: ") and "training" in lines[0]
    assert lines[1].startswith("speedup: ") and "x wall clock against the same study one " \
        "trial at a time with stock Optuna, estimated" in lines[1]
    assert lines[2] == "fused arrays: 2 trials per array as formed (mean 2.0)"
    assert len(lines) == 3  # nothing kept apart


TUPLE_MODEL = """
import torch.nn.functional as F


class _LogitsAndAux(nn.Module):  # (logits, an auxiliary scalar), as a model with aux heads
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        out = self.fc(x)
        return out, out.pow(2).mean()


def model(params):
    return _LogitsAndAux()


def loss(output, target):
    return F.cross_entropy(output[0], target) + 0.01 * output[1]
"""

BAD_SPECS = {
    "train_step of three arguments": (
        "def train_step(model, batch, optimizers):\n    pass\n",
        r"spec.train_step \(.*bad_spec.py:\d+\) has the signature train_step\(model, batch, "
        r"optimizers\), but the sweep calls it as train_step\(model, batch, optimizers, params\)"),
    "scheduler not a function": (
        "scheduler = 0.5\n",
        r"spec.scheduler must be a function scheduler\(optimizer, params\), got a float"),
    "on_epoch without its logs": (
        "def on_epoch():\n    pass\n",
        r"spec.on_epoch \(.*bad_spec.py:\d+\) has the signature on_epoch\(\)"),
    "optimizer returning names": (
        "def optimizer(params, module):\n    return ['adam']\n",
        r"spec.optimizer \(.*bad_spec.py:\d+\) returned str; return a torch.optim optimizer"),
    "scheduler on another optimizer": (
        "def scheduler(optimizer, params):\n"
        "    other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
        "    return torch.optim.lr_scheduler.StepLR(other, 1)\n",
        r"spec.scheduler \(.*bad_spec.py:\d+\) returned StepLR; return a "
        r"torch.optim.lr_scheduler scheduler built on the optimizer it was given"),
    "train_step returning one number": (
        "def train_step(model, batch, optimizers, params):\n"
        "    return torch.tensor(1.0)\n",
        r"spec.train_step \(.*bad_spec.py:\d+\) returned a tensor of shape \(\); return the 2 "
        r"models' training losses"),
    "loss per sample": (  # it trained on the batch's sum, then failed inside the sweep
        "import functools\nimport torch.nn.functional as F\n"
        "loss = functools.partial(F.cross_entropy, reduction='none')\n",
        r"spec.loss \(functools.partial of torch.nn.functional.cross_entropy\) returned a "
        r"tensor of shape \(16,\) on one model's output \(16, 3\) and "
        r"the targets \(16,\); the training loss must return a scalar tensor .* not "
        r"reduction='none'"),
    "loss on targets of another kind": (  # was per_model's error, of a call the user never made
        "import torch.nn.functional as F\nloss = F.mse_loss\n",
        r"spec.loss \(.*functional.py:\d+\), on one model's output \(16, 3\) \(torch.float32\) "
        r"and the targets \(16,\) \(torch.int64\), raised RuntimeError: The size of tensor a "
        r"\(3\) must match"),
    "a device torch does not have": (  # was torch's error from inside the data's move
        "device = 'gpu'\n",
        r"spec.device is 'gpu', which this process cannot use \(Expected one of cpu, cuda"),
    "accuracy of models returning a tuple": (  # was a TypeError from the outputs' torch.cat
        TUPLE_MODEL,
        r"spec.metric is 'accuracy' \(the argmax of the model's output\), but spec.model "
        r"\(.*bad_spec.py:\d+\)'s models return a tuple of \(\(16, 3\), \(1,\)\); give a "
        r"function metric\(output, target\)"),
    "one module for every trial": (  # each trial started from the others' weights, silently
        "_SHARED = nn.Linear(4, 3)\n\n\ndef model(params):\n    return _SHARED\n",
        r"spec.model \(.*bad_spec.py:\d+\) returned, for trial 1, the module it returned for "
        r"trial 0 \(the same objects\)"),
    "a layer shared by every trial": (
        "_EMBED = nn.Linear(4, 4)\n\n\ndef model(params):\n"
        "    return nn.Sequential(_EMBED, nn.Linear(4, 3))\n",
        r"returned, for trial 1, trainable parameters it returned for trial 0"),
    "param groups at two learning rates": (  # a backbone / head split: two optimizers
        "def optimizer(params, module):\n"
        "    return torch.optim.SGD([{'params': [module.weight], 'lr': params['lr']},\n"
        "                            {'params': [module.bias], 'lr': 10 * params['lr']}])\n",
        r"spec.optimizer \(.*bad_spec.py:\d+\) returned a torch.optim.sgd.SGD whose param "
        r"groups have different learning rates .*return one optimizer per learning rate"),
    "an optimizer hftc cannot fuse": (
        "def optimizer(params, module):\n"
        "    return torch.optim.LBFGS(module.parameters(), lr=params['lr'])\n",
        r"spec.optimizer \(.*bad_spec.py:\d+\) returned a torch.optim.lbfgs.LBFGS, which hftc "
        r"cannot fuse; return one of torch.optim.SGD, "),
}

BAD_BASE = """
import torch
from torch import nn
per_array = 2
n_trials = 2
epochs = 1


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.01, 0.1)}


def model(params):
    return nn.Linear(4, 3)


def data():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return (x, y), (x, y)
"""


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_a_bad_hook_is_named_with_its_problem(case: str, tmp_path: Path, capsys):
    source, message = BAD_SPECS[case]
    path = tmp_path / "bad_spec.py"
    path.write_text(BAD_BASE + source)
    with pytest.raises(hs.SpecError, match=message):
        hs.run(path, out=tmp_path / "out", progress=False)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out2"), "--no-progress"]) == 2
    assert "hftc sweep: spec." in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:Using a target size")  # (mse_loss's broadcasting)
@pytest.mark.parametrize("case", ["loss per sample", "loss on targets of another kind"])
def test_a_bad_loss_is_named_alone_too(case: str, tmp_path: Path):
    """train_alone (the serial side, --serial) says what the fused sweep says of a loss
    that gives one value per sample or fails on the targets, not torch's own error."""
    source, message = BAD_SPECS[case]
    path = tmp_path / "bad_spec.py"
    path.write_text(BAD_BASE + source)
    with pytest.raises(hs.SpecError, match=message):
        hs.train_alone(hs.load_spec(path), {"lr": 0.1}, 0, [0])


def test_models_returning_a_tuple_are_evaluated_field_by_field(tmp_path: Path):
    """Models returning (logits, aux): the validation outputs are joined field by field
    and each trial's metric gets its own model's fields (a metric of both), as alone."""
    path = tmp_path / "tuple_spec.py"
    path.write_text(BAD_BASE + TUPLE_MODEL + "dtype = torch.float64\n\n\n"
                    "def data():  # the same data for train_alone\n"
                    "    g = torch.Generator().manual_seed(0)\n"
                    "    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), "
                    "generator=g)\n"
                    "    return (x, y), (x, y)\n\n\n"
                    "def metric(output, target):\n"
                    "    return F.cross_entropy(output[0], target).item() + output[1].sum().item()\n")
    result = hs.run(path, out=tmp_path / "out", progress=False, pruner="none", epochs=2)
    trials = result.study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert trials[0].value != trials[1].value
    for t in trials:
        _, history = hs.train_alone(hs.load_spec(path), t.params, t.user_attrs["hftc_seed"],
                                    t.user_attrs["hftc_orders"])
        assert history == [t.intermediate_values[k] for k in sorted(t.intermediate_values)]


def test_a_space_naming_the_batch_size_is_warned_once(tmp_path: Path):
    """space() suggesting batch_size (or epochs) trained every trial with the spec's, and
    said nothing: a SweepWarning says so, once per sweep."""
    path = tmp_path / "batch_spec.py"
    path.write_text(BAD_BASE + "\n\ndef space(trial):\n    return {'lr': 0.05, "
                    "'batch_size': trial.suggest_categorical('batch_size', [4, 8])}\n")
    with pytest.warns(hftc.errors.SweepWarning, match=r"spec.space \(.*batch_spec.py:\d+\) "
                      r"returns batch_size, which the sweep does not read .* the spec's "
                      r"batch_size = 64") as caught:
        hs.run(path, out=tmp_path / "out", progress=False, estimate=False)
    assert sum("returns batch_size" in str(w.message) for w in caught) == 1


def test_postgresql_storage(spec_file: Path, tmp_path: Path, postgres_url: str):  # noqa: F811
    study = f"hooks-{uuid.uuid4().hex[:8]}"
    result = hs.run(spec_file, out=tmp_path / "out", storage=postgres_url, study_name=study,
                    progress=False, heartbeat_interval=1)
    trials = optuna.load_study(study_name=study, storage=postgres_url).trials
    assert [t.state for t in trials] == [TrialState.PRUNED] + [TrialState.COMPLETE] * 4
    assert [t.value for t in trials] == [t.value for t in result.study.trials]
    _assert_equal_to_plain_loop(spec_file, trials)


def _outcome(storage: str) -> list[tuple]:
    trials = optuna.load_study(study_name="hooks", storage=storage).trials
    return [(t.number, t.state, t.params, t.value, t.intermediate_values,
             t.user_attrs.get("hftc_seed"), t.user_attrs.get("hftc_orders")) for t in trials]


def _cli(spec_file: Path, out: Path, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HFTC_TEST_KILL=kill)
    return subprocess.run([sys.executable, "-m", "hftc", "sweep", str(spec_file), "--out",
                           str(out), "--no-progress", "--threads", "1", *extra], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(spec_file: Path, tmp_path_factory) -> list[tuple]:
    out = tmp_path_factory.mktemp("full") / "out"
    done = _cli(spec_file, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return _outcome(f"sqlite:///{out / 'study.db'}")


# train_step runs 6 times an epoch (120 samples, batches of 20) per fused array: 12 calls
# in round 1 (arrays of 2 and 1), 6 for the epoch trained alone after it (the speedup
# estimate), then round 2 from call 19. on_epoch runs once a round.
@pytest.mark.parametrize("kill", ["step:22", "epoch:2"])
def test_sigkill_then_resume_gives_the_uninterrupted_results(
        kill: str, spec_file: Path, uninterrupted: list[tuple], tmp_path: Path):
    """Killed mid-epoch (inside train_step, the schedulers stepped once, the stream half
    read) or in on_epoch (after a checkpoint, before Optuna heard of the epoch), then
    resumed: every trial as in the uninterrupted sweep, bit for bit, nothing lost or
    run twice."""
    out = tmp_path / "out"
    killed = _cli(spec_file, out, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    running = [t for t in optuna.load_study(study_name="hooks",
                                            storage=f"sqlite:///{out / 'study.db'}").trials
               if t.state == TrialState.RUNNING]
    assert running
    resumed = _cli(spec_file, out, "--resume", "-v")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # from checkpoints, epochs in: weights, optimizer and scheduler states came back
    assert re.search(r"resumed \d+ trial\(s\): .*@epoch [1-9]", resumed.stdout), resumed.stdout
    assert _outcome(f"sqlite:///{out / 'study.db'}") == uninterrupted


def test_the_serial_estimate_charges_the_one_at_a_time_side_its_start_up():
    """The one-at-a-time side's estimate: its epochs trained alone, its Optuna share, the
    data's loading and torch._dynamo's import (which the first torch.optim optimizer of
    any script makes), each said; an import the process had made before is not charged."""
    from types import SimpleNamespace

    from hftc.sweep.report import serial_estimate

    result = SimpleNamespace(serial_epoch_s=[0.03, 0.01, 0.02], trial_epochs=100,
                             serial_trial_epochs=90, serial_optuna_s=2.0, load_s=1.0,
                             dynamo_import_s=0.9)
    total, how = serial_estimate(result)
    assert total == pytest.approx(90 * 0.02 + 2.0 + 1.0 + 0.9)
    assert "90 trial-epochs x 20.0 ms" in how and "+ data 1.0 s" in how
    assert "torch._dynamo's import 0.9 s" in how
    result.dynamo_import_s = 0.0
    total, how = serial_estimate(result)
    assert total == pytest.approx(90 * 0.02 + 2.0 + 1.0) and "_dynamo" not in how


def _smoothed_loss(out, y, smoothing=0.0):
    return F.cross_entropy(out, y, label_smoothing=smoothing)


def test_a_partial_hook_is_named_by_the_function_it_wraps_and_where_that_is():
    """``loss = functools.partial(my_loss, smoothing=0.1)``: the messages name my_loss
    and its file:line (a partial has no code of its own)."""
    import functools

    from hftc.sweep.spec import defined_at, hook_name

    line = _smoothed_loss.__code__.co_firstlineno
    name = hook_name("loss", functools.partial(_smoothed_loss, smoothing=0.1))
    assert name == (f"spec.loss (functools.partial of {__name__}._smoothed_loss, "
                    f"{__file__}:{line})")
    assert defined_at("loss", functools.partial(_smoothed_loss)) == (
        f"spec.loss (functools.partial of {__name__}._smoothed_loss) is defined at "
        f"{__file__}:{line}")
    assert hook_name("loss", functools.partial(max)) == \
        "spec.loss (functools.partial of builtins.max)"
    assert hook_name("loss", _smoothed_loss) == f"spec.loss ({__file__}:{line})"
    # a library's function: its file is none of the user's
    assert hook_name("loss", functools.partial(F.cross_entropy, label_smoothing=0.1)) == \
        "spec.loss (functools.partial of torch.nn.functional.cross_entropy)"
