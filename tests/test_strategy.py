"""The first-call choice between the fused program and the models one by one
(``hftc.fuse(models, strategy=...)``, hftc/lowering/strategy.py).

Speed is never asserted: the timing is made deterministic by slowing one way down
(``_slow``), and the tests check what the choice must never change (outputs, gradients,
parameters, optimizer state, RNG draws, buffers) and the mechanism (taken, cached,
forced, per mode).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
import hftc.lowering.strategy as strategy
import hftc.lowering.timing as timing
from hftc.errors import FusionArgumentError
from tests.equivalence import check_equivalence


class ConvNet(nn.Module):
    """A pytorch/examples mnist-style net: conv, batch norm, dropout, a linear head."""

    def __init__(self, p: float = 0.25):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Each test its own disk cache, none in memory, and the timed strategy ("timed")."""
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HFTC_STRATEGY", "timed")
    saved = dict(timing._MEMORY)
    timing._MEMORY.clear()
    yield
    timing._MEMORY.clear()
    timing._MEMORY.update(saved)


class _Clock:
    """The timing's clock, made deterministic: each reading advances it by 1 ms, and a
    run of the slowed way by 50 ms more (a loaded machine cannot flip the choice)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


def _slow(monkeypatch, which: str) -> list[str]:
    """Make the timed runs of ``which`` ("fused" or "model_loop") 50 ms slower on the
    timing's clock, extra steps and timed calls alike; returns the names of the ways
    run, in order (a timed call's as "call:fused" / "call:model_loop")."""
    real, real_way = strategy.run_tuning_step, strategy.CallTiming.way
    clock = _Clock()
    ran: list[str] = []

    def run_step(fused, forward, how, *args, **kwargs):
        name = "fused" if how.one_by_one is None else "model_loop"
        ran.append(name)
        if name == which:
            clock.now += 0.05
        return real(fused, forward, how, *args, **kwargs)

    def way(self, program, call_number):
        how = real_way(self, program, call_number)
        name = "fused" if how is None or how.one_by_one is None else "model_loop"
        ran.append(f"call:{name}")
        if name == which:  # counted in this call's interval (up to the next call)
            clock.now += 0.05
        return how

    monkeypatch.setattr(strategy, "run_tuning_step", run_step)
    monkeypatch.setattr(strategy.CallTiming, "way", way)
    monkeypatch.setattr(strategy, "time", clock)
    monkeypatch.setattr(timing, "time", clock)  # the one measurement loop's clock
    return ran


def _models(n: int = 3, dtype=torch.float64) -> list[nn.Module]:
    torch.manual_seed(1)
    return [ConvNet(p=0.1 * (i + 1)).to(dtype) for i in range(n)]


def _x(dtype=torch.float64) -> torch.Tensor:
    return torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(2), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("forced", ["fused", "model_loop"])
def test_forced_strategy_equals_the_serial_loop(monkeypatch, forced, dtype):
    """Either way: the serial loop's outputs, buffers, gradients and SGD steps (the
    harness fuses with the default strategy, which HFTC_STRATEGY sets)."""
    monkeypatch.setenv("HFTC_STRATEGY", forced)
    models = [m.eval() for m in _models(dtype=dtype)]  # dropout off: the draws differ fused
    check_equivalence(models, _x(dtype), dtype=dtype, train=False, steps=2)
    models = [nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 14 * 14, 5)).to(dtype) for _ in range(3)]
    check_equivalence(models, _x(dtype), dtype=dtype, train=True, steps=2)
    fused = hftc.fuse(copy.deepcopy(models))
    fused(_x(dtype))
    assert fused.plan.chosen == forced and fused.plan.reason == "forced"
    assert (fused.last_program().one_by_one is not None) == (forced == "model_loop")
    assert fused.last_program().model_loop is fused.last_program().one_by_one  # the old name


def test_model_loop_is_the_serial_loop_with_dropout():
    """The loop draws dropout's numbers as the serial loop does (model 0's, then model
    1's ...): seeded, the same outputs and gradients, exactly."""
    models = _models()
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    x = _x()
    torch.manual_seed(5)
    out = fused(x)
    out.square().sum().backward()
    torch.manual_seed(5)
    for i, m in enumerate(models):
        want = m(x)
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, rtol=0, atol=0)
        torch.testing.assert_close(fused.fc.weight.grad[i], m.fc.weight.grad, rtol=0, atol=0)
        torch.testing.assert_close(fused.bn.running_mean[i], m.bn.running_mean, rtol=0, atol=0)


def _calls_until_decided(fused, x, limit: int = 40) -> int:
    """Call ``fused(x)`` (forward + backward in training mode) until the strategy is
    chosen; the number of calls."""
    for calls in range(1, limit + 1):
        out = fused(x)
        if fused.training:
            out.square().sum().backward()
        if fused.plan.reason != strategy.TIMING_CALLS:
            return calls
    raise AssertionError(f"not decided after {limit} calls: {fused.plan}")


def test_auto_takes_the_faster_on_the_first_calls_keeping_parameters_and_optimizer(
        monkeypatch):
    """Models that draw no random numbers are timed on the user's own calls, which
    alternate the two ways (warm-ups, then cycles fused, loop, loop, fused), no extra
    step; each call is the serial loop's step, and the parameters stay the objects the
    optimizer was built on; the loop measured faster is then kept."""
    ran = _slow(monkeypatch, "fused")
    models = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
              for _ in range(3)]
    serial = copy.deepcopy(models)
    fused = hftc.fuse(copy.deepcopy(models))
    assert fused.strategy == "timed"
    params = list(fused.parameters())
    lrs = [0.1, 0.05, 0.01]
    opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    serial_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
                   for m, lr in zip(serial, lrs)]
    x = torch.randn(5, 8, dtype=torch.float64)
    decided_at = None
    for step in range(40):
        opt.zero_grad()
        out = fused(x)
        out.square().sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(serial, serial_opts)):
            o.zero_grad()
            want = m(x)
            want.square().sum().backward()
            o.step()
            torch.testing.assert_close(out[i], want, rtol=1e-12, atol=1e-12)
        if decided_at is None and fused.plan.reason != strategy.TIMING_CALLS:
            decided_at = step
        if step == 0:
            assert str(fused.plan) == ("alternates the fused program and the models one by "
                                       "one (timing the first calls; then runs the faster; "
                                       "chosen by timing: the bits may differ between runs)")
    assert decided_at is not None
    # 2 warm-ups + 6 cycles of 4 (the budget of 1 s is not reached at ~55 ms a call)
    assert decided_at == 2 + strategy._MAX_CYCLES * 4
    assert ran[:10] == ["call:fused", "call:model_loop"] + [
        f"call:{name}" for name in strategy._CYCLE * 2]
    assert all(name.startswith("call:") for name in ran)  # no extra step ran
    plan = fused.plan
    assert plan.chosen == "model_loop" and plan.reason == "timed on the first calls"
    assert plan.backward and plan.rounds == strategy._MAX_CYCLES and plan.ratio < 0.97
    assert 0 < plan.seconds < 2  # the 14 fused calls' extra 50 ms (and the check run)
    assert fused.last_program().one_by_one is not None
    assert [id(p) for p in fused.parameters()] == [id(p) for p in params]
    assert {id(p) for p in opt.state} == {id(p) for p in params}
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    for i, m in enumerate(serial):
        torch.testing.assert_close(fused.get_parameter("0.weight")[i], m[0].weight,
                                   rtol=1e-12, atol=1e-12)
    assert "strategy: runs the models one by one (timed on the first calls" in str(
        fused.fusion_report)


def test_auto_keeps_the_fused_program_where_it_is_faster(monkeypatch):
    _slow(monkeypatch, "model_loop")
    fused = hftc.fuse([m.eval() for m in _models()])  # eval: no dropout, timed on calls
    _calls_until_decided(fused, _x())
    assert fused.plan.chosen == "fused" and fused.plan.reason == "timed on the first calls"
    assert fused.last_program().one_by_one is None
    assert set(fused.plan.times) == {"fused", "model_loop"}


def test_calls_of_another_program_between_are_not_counted(monkeypatch):
    """An eval call between two training calls (validation) breaks the interval: it is
    not counted and the training program's next call runs the same way again; a program
    whose calls are always interrupted gives up and keeps the fused program."""
    ran = _slow(monkeypatch, "model_loop")
    monkeypatch.setattr(strategy, "_MAX_CYCLES", 1)
    monkeypatch.setattr(strategy, "_MAX_TRIAL_CALLS", 20)
    fused = hftc.fuse([nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
                       for _ in range(2)])
    x = torch.randn(5, 8)
    for call in range(66):
        fused.train(call % 3 != 2)  # every third call evaluates
        fused(x)
    train = fused._programs[(True, fused._signature([x], [False]))]
    evaluation = fused._programs[(False, fused._signature([x], [False]))]
    assert train.plan.chosen == "fused" and train.plan.reason == "timed on the first calls"
    assert evaluation.plan.reason.startswith("not timed")  # never two eval calls in a row
    assert train.trial is None and evaluation.trial is None
    # the training call after an eval call ran the way of the one before it again
    train_ways = [name for call, name in enumerate(ran) if call % 3 != 2][:6]
    assert train_ways[:3] == ["call:fused", "call:model_loop", "call:model_loop"]


def test_torch_compile_of_the_fused_module_times_the_first_calls_too(monkeypatch):
    """Under torch.compile the timing runs eagerly (with the program lookup, torch.compile's
    one graph break a call), so the calls still alternate and the choice is made; the
    outputs are the models'."""
    _slow(monkeypatch, "fused")
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
              for _ in range(2)]
    fused = hftc.fuse(copy.deepcopy(models))
    compiled = torch.compile(fused, backend="eager")
    x = torch.randn(5, 8, dtype=torch.float64)
    for _ in range(2 + 4 * strategy._MAX_CYCLES + 1):
        out = compiled(x)
        out.sum().backward()
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x), rtol=1e-12, atol=1e-12)
    assert fused.plan.chosen == "model_loop" and fused.plan.reason == "timed on the first calls"


def test_choice_is_cached_on_disk_per_mode(monkeypatch, tmp_path):
    """Train (dropout draws: extra timed steps, forward + backward) and eval (no draws:
    timed on the calls, forward only) are chosen apart and stored; a new process (the
    memory cache emptied) with the same shapes times nothing."""
    ran = _slow(monkeypatch, "fused")
    models = _models()
    fused = hftc.fuse(copy.deepcopy(models))
    fused(_x())
    train_plan = fused.plan
    fused.eval()
    _calls_until_decided(fused, _x())
    assert train_plan.backward and not fused.plan.backward
    assert train_plan.reason == "timed" and fused.plan.reason == "timed on the first calls"
    entries = json.loads((tmp_path / "autotune.json").read_text())
    strategy_entries = [e for k, e in entries.items() if '"strategy-1"' in k]
    assert len(strategy_entries) == 2
    assert all(e["chosen"] == "model_loop" for e in strategy_entries)

    timing._MEMORY.clear()
    ran.clear()
    again = hftc.fuse(copy.deepcopy(models))
    again(_x())
    assert again.plan.reason == "cache" and again.plan.chosen == "model_loop"
    assert again.last_program().one_by_one is not None
    again.eval()
    again(_x())
    assert again.plan.reason == "cache" and again.plan.chosen == "model_loop"
    assert ran == []
    # Another N is another key: timed again.
    other = hftc.fuse(copy.deepcopy(models[:2]))
    other(_x())
    assert other.plan.reason == "timed" and ran


@pytest.mark.parametrize("chosen", ["fused", "model_loop"])
def test_timing_draws_no_random_numbers_and_keeps_buffers(monkeypatch, chosen):
    """A model with dropout and batch norm, seeded: with the timing on ("timed", which
    chooses ``chosen``) the same outputs, gradients and running statistics as that way
    forced (no timing), over two calls: the timing's dropout draws and batch norm
    updates are undone."""
    results = []
    real_run_step, time = strategy.run_tuning_step, strategy.time
    for how in ("timed", chosen):
        if how == "timed":
            _slow(monkeypatch, "fused" if chosen == "model_loop" else "model_loop")
        else:
            monkeypatch.setattr(strategy, "run_tuning_step", real_run_step)
            monkeypatch.setattr(strategy, "time", time)
        fused = hftc.fuse(_models(), strategy=how)
        torch.manual_seed(7)
        outs = [fused(_x()) for _ in range(2)]
        outs[1].sum().backward()
        assert fused.plan.chosen == chosen
        assert fused.plan.reason == ("timed" if how == "timed" else "forced")  # dropout
        results.append((outs, fused.conv.weight.grad.clone(),
                        fused.bn.running_mean.clone(), torch.random.get_rng_state()))
    (auto_outs, auto_grad, auto_mean, auto_rng), (outs, grad, mean, rng) = results
    for a, b in zip(auto_outs, outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(auto_grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(auto_mean, mean, rtol=0, atol=0)
    assert torch.equal(auto_rng, rng)
    assert (auto_outs[0] != auto_outs[1]).any()  # the dropout draws are real


def test_long_steps_cost_a_warm_up_and_two_rounds(monkeypatch):
    """A step longer than the budget: the choice runs one warm-up of each way and two
    timed rounds (one in each order), six steps in all, not more."""
    ran = _slow(monkeypatch, "fused")
    real_run_step = strategy.run_tuning_step
    clock = strategy.time

    def long_step(*args, **kwargs):
        clock.now += 0.6  # both ways: 0.6 s a step on the timing's clock
        return real_run_step(*args, **kwargs)

    monkeypatch.setattr(strategy, "run_tuning_step", long_step)
    fused = hftc.fuse(_models())
    fused(_x())
    assert fused.plan.chosen == "model_loop" and fused.plan.rounds == 2
    assert ran == ["fused", "model_loop", "fused", "model_loop", "model_loop", "fused"]
    # short steps take rounds until the budget (1 s, the warm-up included) is spent
    ran.clear()
    monkeypatch.setattr(strategy, "run_tuning_step", real_run_step)
    short = hftc.fuse(_models(2))
    short(_x())
    assert short.plan.rounds > 2


def test_model_loop_follows_each_modules_mode_across_calls():
    """The loop sets each model's modules to the fused module's modes at every call
    (batch norm frozen, then training again): the serial loop's outputs and running
    statistics each time."""
    models = [nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                            nn.Linear(4 * 14 * 14, 5)).double() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    x = _x()
    for freeze in (False, True, False):
        fused[1].train(not freeze)
        for m in models:
            m[1].train(not freeze)
        out = fused(x)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x), rtol=0, atol=0)
            torch.testing.assert_close(fused[1].running_mean[i], m[1].running_mean,
                                       rtol=0, atol=0)


def test_bad_strategy_is_refused(monkeypatch):
    models = _models(2)
    with pytest.raises(FusionArgumentError, match=r"strategy must be 'auto'.*got 'fast'"):
        hftc.fuse(models, strategy="fast")
    monkeypatch.setenv("HFTC_STRATEGY", "loop")
    with pytest.raises(FusionArgumentError, match=r"\$HFTC_STRATEGY must be .*got 'loop'"):
        hftc.fuse(models)
    assert hftc.fuse(models, strategy="fused").strategy == "fused"  # the argument wins
    monkeypatch.setenv("HFTC_STRATEGY", "fused")
    assert hftc.fuse(models, autotune=True).strategy == "auto"  # autotune times the loop


def test_autotune_with_strategy_fused_never_takes_the_loop(monkeypatch):
    """autotune=True's whole-forward choice leaves the loop out when the fused program
    is forced (and times it otherwise)."""
    ran = _slow(monkeypatch, "fused")
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(2)]
    fused = hftc.fuse(copy.deepcopy(models), autotune=True, strategy="fused")
    fused(torch.randn(4, 8))
    whole = fused.fusion_report.lowerings[-1]
    assert whole.node == "<whole model>" and "model_loop" not in whole.times
    assert fused.plan.chosen == "fused" and fused.plan.reason == "autotune"
    assert ran == []  # the strategy stage does not run under autotune
    tuned = hftc.fuse(copy.deepcopy(models), autotune=True)
    tuned(torch.randn(4, 8))
    assert "model_loop" in tuned.fusion_report.lowerings[-1].times


def test_a_choice_cached_by_other_hftc_code_is_timed_again(monkeypatch, tmp_path):
    """The cache key holds a fingerprint of hftc's own source: a kernel choice that changed
    inside a runtime function leaves the generated program as it was, so a choice timed on
    the old code must not be taken."""
    ran = _slow(monkeypatch, "fused")
    models = _models()
    hftc.fuse(copy.deepcopy(models))(_x())
    assert ran
    timing._MEMORY.clear()
    ran.clear()
    monkeypatch.setattr(timing, "hftc_code_fingerprint", lambda: "other-hftc")
    again = hftc.fuse(copy.deepcopy(models))
    again(_x())
    assert again.plan.reason == "timed" and ran


class Reassigns(nn.Module):
    """Buffers assigned anew in forward, as statistics code writes them: a call count and
    a running mean of the input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        self.calls = self.calls + 1
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return self.fc(x)


@pytest.mark.parametrize("way", ["model_loop", "in order"])
def test_buffers_assigned_anew_in_forward_are_kept_one_by_one(way):
    # They were dropped with the shell's registry entry: the N models' counts stayed 0
    # where each stock model counts its calls (a silent wrong answer of the loop).
    torch.manual_seed(0)
    models = [Reassigns() for _ in range(3)]
    xs = [torch.randn(5, 4) for _ in range(4)]
    fused = hftc.fuse(copy.deepcopy(models), strategy="model_loop")
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    step = hftc.compile_step(fused, lambda out, y: out.pow(2).mean(), opt)
    for x in xs:
        if way == "in order":
            step(x, None)
        else:
            fused(x)
    if way == "in order":
        assert step.order.chosen == "in_order"
    for i, m in enumerate(models):
        for x in xs:
            m(x)
        assert fused.state_dict()["calls"][i] == m.calls == 4
        assert torch.equal(fused.state_dict()["avg"][i], m.avg)


class HalfCounts(Reassigns):
    """A long count assigned a float (stock: the buffer becomes a float tensor)."""

    def forward(self, x):
        self.calls = self.calls + 0.5
        return self.fc(x)

    def count(self, x):
        if float(x.sum()) > -1e9:  # a value read in Python: hftc runs it one by one
            self.calls = self.calls + 0.5
        return x


@pytest.mark.parametrize("strategy", ["fused", "model_loop"])
def test_a_buffer_assigned_another_dtype_is_refused(strategy):
    # It was cast into the buffer's dtype: every model's count stayed 0, stock's 1.5.
    fused = hftc.fuse([HalfCounts() for _ in range(2)], strategy=strategy)
    with pytest.raises(hftc.errors.TraceError, match=r"assigns their buffer `calls` a new "
                                                     r"tensor of \[\] torch.float32, where "
                                                     r"the buffer is \[\] torch.int64"):
        fused(torch.randn(5, 4))
    with pytest.raises(hftc.errors.TraceError, match=r"model 0's count assigns its buffer "
                                                     r"`calls` anew \(\[\] torch.float32, "
                                                     r"where .* \[\] torch.int64 per model\)"
                                                     r".*Update it in place"):
        fused.count(torch.randn(5, 4))
    assert torch.equal(fused.state_dict()["calls"], torch.zeros(2, dtype=torch.long))
