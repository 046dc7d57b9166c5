"""hftc.keep_models: a subset of a fused module's models, in place, with its optimizers
and schedulers, continuing exactly as the subset trained alone with stock torch.optim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import single_thread  # noqa: F401  (one intra-op thread)
from torch import nn

import hftc
from hftc.errors import FusionArgumentError, FusionIndexError, FusionTypeError

N = 4
KEEP = [1, 3]  # model 0 goes: the fused module's template model is among those dropped
MOMENTA = [0.1, 0.2, 0.3, 0.05]  # BatchNorm momentum differs per model (a per-model scalar)
ATOL = {1e-9: 1e-12, 1e-5: 1e-6}  # by rtol: float64, float32
LRS = [0.05, 0.02, 0.1, 0.03]
DECAYS = [1e-3, 0.0, 1e-2, 5e-3]


def make_model(i: int, dtype=torch.float64) -> nn.Module:
    # (no bias before BatchNorm: its gradient is rounding noise, which Adam would amplify)
    torch.manual_seed(100 + i)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8, momentum=MOMENTA[i]), nn.Tanh(),
                         nn.Linear(8, 3)).to(dtype)


def batches(steps: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 6, generator=g, dtype=dtype), torch.randint(0, 3, (16,), generator=g))
            for _ in range(steps)]


def lambdas():
    return [lambda e, k=k: 1.0 / (1.0 + 0.3 * k * e) for k in range(N)]


def make_stock(kind: str, model: nn.Module, i: int):
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LRS[i], momentum=0.9,
                              weight_decay=DECAYS[i])
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=LRS[i] / 10, weight_decay=DECAYS[i])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas()[i])


def make_fused_optimizer(kind: str, fused: hftc.FusedModule):
    if kind == "sgd":
        opt = hftc.optim.SGD(fused.parameters(), lr=LRS, momentum=0.9, weight_decay=DECAYS)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt = hftc.optim.Adam(fused.parameters(), lr=[lr / 10 for lr in LRS], weight_decay=DECAYS)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas())


def train_fused(fused, opt, sched, data):
    for x, y in data:
        opt.zero_grad()
        out = fused(x)  # [N, B, 3]
        n = out.shape[0]
        losses = F.cross_entropy(out.reshape(-1, 3), y.repeat(n), reduction="none")
        losses.view(n, -1).mean(1).sum().backward()
        opt.step()
        sched.step()


def train_alone(model, opt, sched, data):
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()


def assert_close(fused, models, rtol):
    for j, model in enumerate(models):
        state = fused.model_state_dict(j)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=rtol, atol=ATOL[rtol],
                                       msg=lambda m, j=j, name=name: f"model {j} {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strategy", ["fused", "model_loop"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("passed", ["given", "found"])
def test_kept_models_continue_as_if_trained_alone(kind, strategy, dtype, passed):
    data = batches(6, dtype)
    fused = hftc.fuse([make_model(i, dtype) for i in range(N)], strategy=strategy)
    opt, sched = make_fused_optimizer(kind, fused)
    params_before = list(fused.parameters())
    train_fused(fused, opt, sched, data[:3])
    if passed == "given":
        kept = hftc.keep_models(fused, KEEP, optimizers=[opt], schedulers=[sched])
    else:  # each fused optimizer and its scheduler registered themselves when built
        kept = hftc.keep_models(fused, KEEP)
    assert kept == KEEP and fused.num_models == len(KEEP) and opt.num_models == len(KEEP)
    # The same Parameter objects: the optimizer's groups and the user's references hold.
    assert all(a is b for a, b in zip(fused.parameters(), params_before))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params_before))
    assert len(sched.base_lrs) == len(sched.get_last_lr()) == len(KEEP)
    train_fused(fused, opt, sched, data[3:])

    alone = []
    for i in KEEP:
        model = make_model(i, dtype)
        stock, stock_sched = make_stock(kind, model, i)
        train_alone(model, stock, stock_sched, data)
        alone.append((model, stock_sched))
    rtol = 1e-9 if dtype == torch.float64 else 1e-5
    assert_close(fused, [m for m, _ in alone], rtol)
    assert sched.get_last_lr() == pytest.approx([s.get_last_lr()[0] for _, s in alone], rel=1e-12)
    # The per-model BatchNorm momentum went with its model (not model 0's).
    fused.eval()
    x = data[0][0]
    out = fused(x)
    for j, (model, _) in enumerate(alone):
        model.eval()
        torch.testing.assert_close(out[j], model(x), rtol=rtol, atol=ATOL[rtol])


def test_keep_models_slices_gradients_and_plateau_scheduler():
    data = batches(2)
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS, momentum=0.9)
    plateau = hftc.optim.ReduceLROnPlateau(opt, patience=[0, 1, 2, 3], factor=0.5)
    x, y = data[0]
    out = fused(x)
    F.cross_entropy(out.reshape(-1, 3), y.repeat(N), reduction="sum").backward()
    grads = [p.grad.clone() for p in fused.parameters()]
    hftc.keep_models(fused, [3, 0], optimizers=[opt], schedulers=[plateau])  # reordered too
    for p, g in zip(fused.parameters(), grads):
        assert torch.equal(p.grad, g[[3, 0]])
    assert [g["lr"] for g in opt.param_groups] == [LRS[3], LRS[0]]
    assert [s.patience for s in plateau.schedulers] == [3, 0]
    plateau.step([1.0, 1.0])
    plateau.step([2.0, 2.0])  # model 1 (old model 0, patience 0) reduces, model 0 does not
    assert plateau.get_last_lr() == [LRS[3], LRS[0] * 0.5]


def test_schedulers_are_found_also_when_a_list_leaves_them_out():
    # A LambdaLR left with 4 models' lambdas and base lrs would give the kept model j old
    # model j's schedule (zip with the cut groups): every scheduler on a cut optimizer is cut.
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    schedules = lambdas()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    chained = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])
    plateau = hftc.optim.ReduceLROnPlateau(opt, patience=[0, 1, 2, 3])
    hftc.keep_models(fused, [3, 1], optimizers=[opt], schedulers=[])
    assert sched.lr_lambdas == [schedules[3], schedules[1]]
    assert sched.base_lrs == [LRS[3], LRS[1]]
    # SequentialLR and its schedulers are each found, and each cut once.
    assert warm.lr_lambdas == [schedules[3], schedules[1]] and len(chained._last_lr) == 2
    assert [s.patience for s in plateau.schedulers] == [3, 1]


def test_a_stock_optimizer_on_the_fused_parameters_is_refused_at_the_shrink():
    data = batches(1)
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    stock = torch.optim.Adam(fused.parameters(), lr=1e-3)
    x, y = data[0]
    F.cross_entropy(fused(x).reshape(-1, 3), y.repeat(N)).backward()
    stock.step()  # its moments are [4, ...]: one state for all models
    with pytest.raises(FusionTypeError, match=r"a stock torch.optim.Adam steps the fused "
                                              r"module's parameters; its state holds all 4 "
                                              r"models .* Build it as hftc.optim.Adam\("):
        hftc.keep_models(fused, [0, 2])
    assert fused.num_models == N  # nothing changed
    del stock
    hftc.keep_models(fused, [0, 2])  # (a stock optimizer that is gone is not in the way)
    assert fused.num_models == 2


def test_keep_models_refuses_bad_arguments_and_changes_nothing():
    fused = hftc.fuse([make_model(i) for i in range(N)])
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    other = hftc.fuse([make_model(i) for i in range(N)])
    other_opt = hftc.optim.SGD(other.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(FusionIndexError, match=r"keep holds model index 4, out of range for 4 models"):
        hftc.keep_models(fused, [0, 4], optimizers=[opt])
    with pytest.raises(FusionArgumentError, match=r"keep names model\(s\) \[1\] more than once"):
        hftc.keep_models(fused, [1, 1])
    with pytest.raises(FusionArgumentError, match=r"keep is empty"):
        hftc.keep_models(fused, [])
    with pytest.raises(FusionArgumentError, match=r"optimizers\[1\] \(SGD\) is not built on this "
                                                  r"fused module"):
        hftc.keep_models(fused, [0], optimizers=[opt, other_opt])
    with pytest.raises(FusionTypeError, match=r"optimizers\[0\] is a SGD, not an hftc.optim"):
        hftc.keep_models(fused, [0], optimizers=[torch.optim.SGD(make_model(0).parameters(),
                                                                 lr=0.1)])
    with pytest.raises(FusionArgumentError, match=r"schedulers\[0\] \(StepLR\) is not built on "
                                                  r"one of the optimizers given"):
        hftc.keep_models(fused, [0], optimizers=[], schedulers=[sched])
    assert fused.num_models == N and opt.num_models == N
    assert all(p.shape[0] == N for p in fused.parameters())


def test_an_optimizer_left_out_refuses_its_next_step():
    data = batches(1)
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    opt = hftc.optim.Adam(fused.parameters(), lr=1e-3)
    hftc.keep_models(fused, [0, 2], optimizers=[])  # opt left out of an explicit list
    x, y = data[0]
    F.cross_entropy(fused(x).reshape(-1, 3), y.repeat(2)).backward()
    with pytest.raises(FusionArgumentError, match=r"Adam.step: the parameters hold 2 models but "
                                                  r"this optimizer 4: hftc.keep_models cut"):
        opt.step()


def test_sequential_schedulers_are_cut_too():
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    schedules = lambdas()
    warm = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])
    for _ in range(3):
        opt.step()
        sched.step()
    before = sched.get_last_lr()
    hftc.keep_models(fused, [2, 3], optimizers=[opt], schedulers=[sched])
    assert sched.get_last_lr() == [before[2], before[3]]
    assert warm.lr_lambdas == schedules[2:] and warm.base_lrs == LRS[2:]
    sched.step()
    assert sched.get_last_lr() == pytest.approx([before[2] * 0.5, before[3] * 0.5], rel=1e-12)


def test_a_loss_still_held_from_before_the_cut_does_not_stop_the_next_backward():
    # The loop's last loss (a GAN's errG, alive across the epoch's report) holds the
    # parameters' gradient accumulators, made for 4 models: the next backward refused
    # the 2 models' gradients ("ViewBackward0 returned an invalid gradient").
    data = batches(2)
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    opt = hftc.optim.SGD(fused.parameters(), lr=LRS)
    x, y = data[0]
    loss = F.cross_entropy(fused(x).reshape(-1, 3), y.repeat(N), reduction="sum")
    loss.backward()
    opt.step()
    hftc.keep_models(fused, KEEP)
    opt.zero_grad()
    x, y = data[1]
    F.cross_entropy(fused(x).reshape(-1, 3), y.repeat(2), reduction="sum").backward()
    opt.step()
    models = [make_model(i) for i in KEEP]
    for model, i in zip(models, KEEP):
        stock = torch.optim.SGD(model.parameters(), lr=LRS[i])
        for xb, yb in data:
            stock.zero_grad()
            F.cross_entropy(model(xb), yb, reduction="sum").backward()
            stock.step()
    assert_close(fused, models, 1e-9)
    assert loss.requires_grad  # (held to the end)


# ------------------------------------------------------------ the checks a cut keeps


@pytest.fixture
def checks_run(monkeypatch):
    """The first-call checks compare_with_models runs, each as the fused module's mode."""
    import hftc.module.programs as programs

    run = []
    compare = programs.compare_with_models

    def counted(fused, *args, **kwargs):
        run.append("train" if fused.training else "eval")
        return compare(fused, *args, **kwargs)

    monkeypatch.setattr(programs, "compare_with_models", counted)
    return run


def test_a_cut_keeps_the_checks_its_programs_passed(checks_run):
    # The kept models ran these programs on the checks' word: compiled again for fewer
    # models, the programs are not checked again, and compute what the models compute.
    x = batches(1)[0][0]
    models = [make_model(i) for i in range(N)]  # (BatchNorm momenta differ: all checked)
    fused = hftc.fuse(models, strategy="fused")
    fused(x)
    fused.eval()
    fused(x)
    assert checks_run == ["train", "eval"]
    hftc.keep_models(fused, [3, 1])
    out = fused(x)
    fused.train()
    fused(x)
    assert checks_run == ["train", "eval"]  # nothing checked again
    check = fused.last_program().report.check
    assert check.before_cut and check.passed and check.models == (0, 1)
    assert str(check).startswith("checked against models 0 and 1's own forward (before "
                                  "hftc.keep_models cut the module): values agree")
    for j, i in enumerate([3, 1]):
        model = make_model(i)
        model(x)  # (the first call, in training mode, moved the running statistics)
        torch.testing.assert_close(out[j], model.eval()(x), rtol=1e-9, atol=1e-12)
    # A second cut keeps them too, the one compiled since and the one not.
    hftc.keep_models(fused, [1])
    fused(x)
    fused.eval()
    fused(x)
    assert checks_run == ["train", "eval"]
    assert fused.last_program().report.check.models == (0,)


def test_a_program_compiled_first_after_a_cut_is_checked(checks_run):
    x = batches(1)[0][0]
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    fused(x)  # training mode only
    hftc.keep_models(fused, [0, 2])
    fused.eval()
    fused(x)
    assert checks_run == ["train", "eval"]
    assert not fused.last_program().report.check.before_cut


class _TensorOnly(nn.Module):
    """forward branches on isinstance(x, Tensor), which a traced Proxy is not: the check
    finds the fused program (traced without the doubling) off."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(6, 3).double()

    def forward(self, x):
        y = self.fc(x)
        if isinstance(x, torch.Tensor):
            y = y * 2
        return y


def test_a_failed_check_is_not_kept_over_a_cut(checks_run):
    x = batches(1)[0][0]
    fused = hftc.fuse([_TensorOnly(i) for i in range(3)])
    with pytest.warns(hftc.errors.FusionWarning):
        fused(x)
    hftc.keep_models(fused, [2, 0])
    with pytest.warns(hftc.errors.FusionWarning):
        out = fused(x)  # checked again, and refused again: the models run one by one
    assert checks_run == ["train", "train"]
    for j, i in enumerate([2, 0]):
        torch.testing.assert_close(out[j], _TensorOnly(i)(x), rtol=1e-12, atol=0)


def test_replacing_models_after_a_cut_checks_the_new_ones(checks_run):
    x = batches(1)[0][0]
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    hftc.optim.SGD(fused.parameters(), lr=0.1)
    fused(x)
    hftc.keep_models(fused, [0, 1, 2])  # the kept check waits for the next compile
    hftc.replace_models(fused, {1: make_model(3)})
    out = fused(x)
    assert checks_run == ["train", "train"]
    assert not fused.last_program().report.check.before_cut
    torch.testing.assert_close(out[1], make_model(3)(x), rtol=1e-9, atol=1e-12)


def test_copies_of_a_cut_module_check_again(checks_run):
    import copy

    x = batches(1)[0][0]
    fused = hftc.fuse([make_model(i) for i in range(N)], strategy="fused")
    fused(x)
    hftc.keep_models(fused, [1, 2])
    twin = copy.deepcopy(fused)
    twin(x)
    assert checks_run == ["train", "train"]
