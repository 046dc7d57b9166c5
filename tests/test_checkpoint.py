"""Checkpoints: k steps, save, load into fresh objects, k steps == 2k steps straight, bit for bit.

Everything goes through ``torch.save`` and ``torch.load(weights_only=True)``: the
fused module, the fused optimizer (per-model hyper-parameters in its N groups,
stacked state, per-model step counters), schedulers and the per-model scaler.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from hftc.amp import GradScaler
from optim_helpers import (
    StackedModels,
    make_batches,
    make_models,
    per_model_losses,
    single_thread,  # noqa: F401  (autouse fixture)
)

import hftc
import hftc.optim as ho

OPTIMIZERS = {
    "sgd": lambda ps: ho.SGD(ps, lr=[0.1, 0.05, 0.02], momentum=[0.9, 0.0, 0.5],
                             nesterov=[True, False, False]),
    "adam": lambda ps: ho.Adam(ps, lr=[1e-2, 3e-2, 1e-3], betas=[(0.9, 0.99), (0.8, 0.9),
                                                                (0.5, 0.999)],
                               amsgrad=[False, True, False]),
    "adamw": lambda ps: ho.AdamW(ps, lr=[1e-2, 3e-2, 1e-3], weight_decay=[0.0, 0.1, 0.01]),
    "rmsprop": lambda ps: ho.RMSprop(ps, lr=[1e-2, 3e-3, 1e-3], momentum=[0.0, 0.9, 0.5],
                                     centered=[True, False, True]),
    "adagrad": lambda ps: ho.Adagrad(ps, lr=[1e-2, 3e-2, 1e-1], lr_decay=[0.0, 0.01, 0.1],
                                     initial_accumulator_value=[0.0, 0.1, 0.5]),
}

SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
}


def save_and_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Run:
    """A fused module with an optimizer, a scheduler and optionally a per-model scaler."""

    def __init__(self, opt_name, fuser, seed, sched_name="step", scaler=False):
        self.fused = fuser(make_models(3, torch.float64, seed=seed))
        self.opt = OPTIMIZERS[opt_name](self.fused.parameters())
        self.sched = SCHEDULERS[sched_name](self.opt)
        self.plateau = ho.ReduceLROnPlateau(self.opt, patience=0, factor=0.5)
        self.scaler = GradScaler(init_scale=2.0**100, growth_interval=2) if scaler else None

    def train(self, batches, boost=(1.0, 1.0, 1.0)):
        for x, y in batches:
            self.opt.zero_grad()
            out = self.fused(x)
            losses = torch.stack([F.cross_entropy(out[i] * boost[i], y) for i in range(3)])
            if self.scaler is None:
                losses.sum().backward()
                self.opt.step()
            else:
                self.scaler.scale(losses.float()).sum().backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            self.sched.step()
            self.plateau.step(losses.detach().neg())  # rising metrics: reduces every model

    def state_dict(self):
        return {
            "model": self.fused.state_dict(),
            "opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "plateau": self.plateau.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state):
        self.fused.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.plateau.load_state_dict(state["plateau"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def assert_same(a: Run, b: Run):
    for (name, p), q in zip(a.fused.named_parameters(), b.fused.parameters()):
        assert torch.equal(p, q), name
    pa, pb = list(a.fused.parameters()), list(b.fused.parameters())
    for p, q in zip(pa, pb):
        assert a.opt.state[p].keys() == b.opt.state[q].keys()
        for key, value in a.opt.state[p].items():
            assert torch.equal(value, b.opt.state[q][key]), key
            assert value.device == b.opt.state[q][key].device, key
    assert a.opt.param_groups[1:] == b.opt.param_groups[1:]
    assert [g["lr"] for g in a.opt.param_groups] == [g["lr"] for g in b.opt.param_groups]
    if a.scaler is not None:
        assert torch.equal(a.scaler.get_scale(), b.scaler.get_scale())


def check_resume(opt_name, fuser, sched_name="step", scaler=False, boost=(1.0, 1.0, 1.0), k=3):
    batches = make_batches(2 * k)
    straight = Run(opt_name, fuser, seed=0, sched_name=sched_name, scaler=scaler)
    straight.train(batches, boost)

    first = Run(opt_name, fuser, seed=0, sched_name=sched_name, scaler=scaler)
    first.train(batches[:k], boost)
    state = save_and_load(first.state_dict())
    resumed = Run(opt_name, fuser, seed=100, sched_name=sched_name, scaler=scaler)
    resumed.load_state_dict(state)
    resumed.train(batches[k:], boost)
    assert_same(straight, resumed)
    return straight


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_resume_is_bit_exact(opt_name):
    check_resume(opt_name, StackedModels)


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_resume_with_hftc_fuse(opt_name):
    check_resume(opt_name, hftc.fuse, sched_name="cosine")


def test_resume_with_per_model_scaler_and_diverged_step_counts():
    # Model 1 overflows every step: it never steps, its scale keeps backing off.
    run = check_resume("adam", StackedModels, scaler=True, boost=(1.0, 1e300, 1.0))
    steps = run.opt.state[next(run.fused.parameters())]["step"].tolist()
    assert steps[0] == steps[2] == 6.0 and steps[1] < 6.0


def test_loading_into_a_different_number_of_models_fails():
    run = Run("adam", StackedModels, seed=0)
    run.train(make_batches(1))
    other = ho.Adam(StackedModels(make_models(2)).parameters())
    with pytest.raises(ValueError, match="3 param group.*one per model, 2"):
        other.load_state_dict(save_and_load(run.opt.state_dict()))


def test_per_model_step_counters_stay_on_the_cpu_after_loading():
    run = Run("adam", StackedModels, seed=0)
    run.train(make_batches(2))
    fresh = Run("adam", StackedModels, seed=1)
    fresh.opt.load_state_dict(save_and_load(run.opt.state_dict()))
    state = fresh.opt.state[next(fresh.fused.parameters())]
    assert state["step"].device.type == "cpu" and state["step"].shape == (3,)
    assert state["exp_avg"].dtype == torch.float64
    x, y = make_batches(1)[0]
    per_model_losses(fresh.fused, x, y).sum().backward()
    fresh.opt.step()
    assert state["step"].tolist() == [3.0, 3.0, 3.0]
