"""The acceptance of issue 32 item 1 on two real-style scripts: pytorch/examples' MNIST
(Net with conv/dropout, Adadelta, StepLR) and DCGAN (a generator and a discriminator, two
Adam optimizers, the discriminator on real then stacked fake images), each a plain
PyTorch + Optuna loop made a fused sweep with array.fuse / array.report
(examples/trial_array_mnist.py, examples/trial_array_dcgan.py).  A pruned trial leaves
the array before its last epoch; every trial's reported values equal the same trial
trained alone with stock torch.optim (float64, <= 1e-9 relative)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("sklearn")

from optim_helpers import single_thread  # noqa: E402, F401  (one intra-op thread)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


class PruneAt(optuna.pruners.BasePruner):
    """Prune trial ``number`` at ``step`` (whatever its values): the test needs an array
    that shrinks in the middle of its loop, which a median pruner on a few noisy
    epochs gives only by luck."""

    def __init__(self, number: int, step: int):
        self.number, self.step = number, step

    def prune(self, study, trial):
        return trial.number == self.number and trial.last_step == self.step


def check_sweep(study, worst, pruned_number, epochs):
    trials = study.get_trials()
    states = {t.number: t.state.name for t in trials}
    assert states[pruned_number] == "PRUNED", states
    assert len(trials[pruned_number].intermediate_values) == 1  # left after epoch 0
    # the others of its array went on to the end, in the shrunk array
    assert all(states[k] == "COMPLETE" and len(trials[k].intermediate_values) == epochs
               for k in states if k != pruned_number), states
    assert worst <= 1e-9, worst


def test_mnist_script_fused_sweep_equals_each_trial_alone(tmp_path):
    example = runpy.run_path(str(EXAMPLES / "trial_array_mnist.py"))
    study, worst = example["main"](n_trials=6, array_size=3, pruner=PruneAt(4, 0),
                                   storage=f"sqlite:///{tmp_path / 'mnist.db'}", epochs=3,
                                   n_train=128, n_val=64, batch_size=32, log=lambda s: None)
    check_sweep(study, worst, pruned_number=4, epochs=3)


def test_dcgan_script_fused_sweep_equals_each_trial_alone(tmp_path):
    example = runpy.run_path(str(EXAMPLES / "trial_array_dcgan.py"))
    study, worst = example["main"](n_trials=6, array_size=3, pruner=PruneAt(3, 0),
                                   storage=f"sqlite:///{tmp_path / 'dcgan.db'}", epochs=3,
                                   n_train=96, n_val=32, log=lambda s: None)
    check_sweep(study, worst, pruned_number=3, epochs=3)


def test_refill_script_keeps_arrays_full_and_every_trial_equals_its_run_alone():
    example = runpy.run_path(str(EXAMPLES / "trial_array_refill.py"))
    lines = []
    study, worst = example["main"](n_trials=8, array_size=3, epochs=3,
                                   pruner=PruneAt(1, 0), log=lines.append)
    states = {t.number: t.state.name for t in study.get_trials()}
    assert len(states) == 8 and states[1] == "PRUNED"
    assert all(s == "COMPLETE" for k, s in states.items() if k != 1), states
    assert any("new trials in places [1]" in line for line in lines), lines
    assert worst <= 1e-9, worst
