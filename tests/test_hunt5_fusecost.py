"""What each new fused array costs before it trains, cut without weakening the check.

* The token trace's second run (the guard against a float read in C) compares each
  model's signature read off the one trace, with no graph copied per model.
* ``output_difference`` skips its NaN / inf mask work where both sides are finite.
* A model copy's function rebinding passes plain values and empty containers by.

Each test compares with the models run alone (or the old computation), never timings.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionWarning
from hftc.frontends.closures import rebind_functions
from hftc.frontends.symbolic import deepcopy_module
from hftc.lowering.check import output_difference


class DropNet(nn.Module):
    """Each model its own dropout p: every model's Python state differs from model 0's,
    so the check runs each one's own forward."""

    def __init__(self, p: float):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(p)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.bn(self.drop(self.fc1(x)).relu()))


def _models(cls=DropNet, n=4, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return [cls(0.1 * k, **kw).to(dtype) for k in range(n)]


def _fused_rows(fused, index):
    return {name: p.detach()[index] for name, p in fused.named_parameters()}


def test_the_eval_check_compares_the_trained_weights():
    """Train 3 steps (the optimizer writes the fused weights), then eval: the eval
    program's check compares every model (each its own dropout p) with its own forward
    at the trained weights, passes, and the outputs are each model's own (float64 and
    float32)."""
    for dtype in (torch.float64, torch.float32):
        models = _models(dtype=dtype)
        fused = hftc.fuse(models)
        opt = hftc.optim.SGD(fused.parameters(), lr=0.5, momentum=0.9)
        loss = hftc.per_model(F.mse_loss)
        for _ in range(3):
            x, y = torch.randn(6, 4, dtype=dtype), torch.randn(6, 3, dtype=dtype)
            opt.zero_grad()
            loss(fused(x), y).sum().backward()
            opt.step()
        assert fused.fusion_report.check.passed
        assert fused.fusion_report.check.models == (0, 1, 2, 3)  # each differs from model 0
        fused.eval()
        x = torch.randn(5, 4, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FusionWarning)
            with torch.no_grad():
                out = fused(x)
        assert fused.fusion_report.check.passed
        assert fused.fusion_report.check.models == (0, 1, 2, 3)
        for i, model in enumerate(fused.unfuse()):
            for name, row in _fused_rows(fused, i).items():
                assert torch.equal(model.get_parameter(name), row)
            assert not model.training and not model.bn.training
            assert torch.equal(model.bn.running_mean, fused.bn.running_mean[i])
            torch.testing.assert_close(out[i], model(x), rtol=1e-6, atol=1e-6)


class ChangesItselfWhenRun(nn.Module):
    """Its forward, run on tensors (not while traced: x is a Proxy then), doubles the
    output the first time and remembers it did: the traced program never doubles."""

    def __init__(self, p: float):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.p = p
        self.done = False

    def forward(self, x):
        first = isinstance(x, torch.Tensor) and not self.done
        if isinstance(x, torch.Tensor):
            self.done = True
        return self.fc(x) * (2.0 if first else 1.0) + self.p


def test_each_programs_check_runs_a_fresh_copy():
    """The train program's check runs each copy once (done becomes True there): a copy
    kept so would let the eval program's check pass (no doubling). Each check gets a
    fresh copy instead, fails for both programs and the models run one by one."""
    models = _models(ChangesItselfWhenRun, n=3)
    fused = hftc.fuse(models)
    x = torch.randn(5, 4, dtype=torch.float64)
    with pytest.warns(FusionWarning, match="one by one"):
        fused(x)
    assert not fused.fusion_report.check.passed
    fused.eval()
    with pytest.warns(FusionWarning, match="one by one"):
        fused(x)
    assert not fused.fusion_report.check.passed


def test_a_model_holding_a_function_or_a_loose_tensor_is_checked_in_both_modes():
    """A closure over the model's own module (rebound in each copy) and a plain tensor
    attribute: both programs' checks pass and the outputs are the models' own."""
    class Held(DropNet):
        def __init__(self, p):
            super().__init__(p)
            drop = self.drop
            self.act = lambda h: drop(h).relu()

        def forward(self, x):
            return self.fc2(self.bn(self.act(self.fc1(x))))

    class Loose(DropNet):
        def __init__(self, p):
            super().__init__(p)
            self.scale = torch.tensor(2.0)

        def forward(self, x):
            return super().forward(x) * self.scale

    for cls in (Held, Loose):
        fused = hftc.fuse(_models(cls, n=3))
        x = torch.randn(5, 4, dtype=torch.float64)
        fused(x)
        assert fused.fusion_report.check.passed
        fused.eval()  # (compared without dropout's draws)
        out = fused(x)
        assert fused.fusion_report.check.passed
        for i, m in enumerate(fused.unfuse()):
            torch.testing.assert_close(out[i], m(x))


def test_a_fused_module_moved_to_another_dtype_builds_its_copies_anew():
    """fused.float() after the first check: the eval program's check compares float32
    copies and passes."""
    models = _models(n=3)
    fused = hftc.fuse(models)
    fused(torch.randn(5, 4, dtype=torch.float64))
    fused.float().eval()
    x = torch.randn(5, 4)
    out = fused(x)
    assert fused.fusion_report.check.passed
    for i, m in enumerate(fused.unfuse()):
        assert m.fc1.weight.dtype == torch.float32
        torch.testing.assert_close(out[i], m(x))


class ScaleInC(nn.Module):
    """Reads its float in C (math.exp: no method a token notes): the second token trace
    must still find the graphs differ, and each model be traced itself."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = scale

    def forward(self, x):
        return self.fc(x) * math.exp(self.scale)


def test_a_float_read_in_c_still_gives_each_model_its_own_value():
    models = [ScaleInC(s).double() for s in (0.5, 2.0, -1.0)]
    x = torch.randn(5, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FusionWarning)
        fused = hftc.fuse(models)
        out = fused(x)
    assert fused.fusion_report.check.passed
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(x), rtol=1e-12, atol=1e-12)


def test_dropout_p_per_model_shares_one_trace_and_trains_as_a_loop():
    """The sweep's case (only dropout p differs): fused forward, backward and SGD steps
    in training mode equal each model alone (dropout p=0 and 1 as the extremes: the
    values each model's graph got from the token trace)."""
    torch.manual_seed(1)
    ps = (0.0, 1.0, 0.0, 1.0)
    models = [DropNet(p).double() for p in ps]
    originals = copy.deepcopy(models)
    fused = hftc.fuse(models)
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in originals]
    for _ in range(2):
        x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
        opt.zero_grad()
        out = fused(x)
        ((out - y) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for k, (m, o) in enumerate(zip(originals, opts)):
            o.zero_grad()
            want = m(x)
            ((want - y) ** 2).mean().backward()
            o.step()
            torch.testing.assert_close(out[k], want, rtol=1e-10, atol=1e-10)
    for k, m in enumerate(fused.unfuse()):
        for (name, a), b in zip(m.named_parameters(), originals[k].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def _old_tensor_error(got, want):
    """The relative difference as output_difference computed it before (masks always)."""
    finite = torch.isfinite(want)
    got, want = got[finite].double(), want[finite].double()
    diff = (got - want).norm().item()
    scale = max(got.norm().item(), want.norm().item())
    return diff / scale if scale else 0.0


def test_output_difference_reads_what_it_read_with_and_without_non_finite_values():
    torch.manual_seed(2)
    want = torch.randn(4, 5, 3)
    got = want + 1e-5 * torch.randn(4, 5, 3)
    errors: list[float] = []
    assert output_difference(got, want, errors=errors) is None
    assert errors == [_old_tensor_error(got, want)]
    strided = torch.randn(5, 4).t()  # not contiguous: compared element by element too
    errors = []
    assert output_difference(strided + 1e-6, strided, errors=errors) is None
    assert errors == [_old_tensor_error(strided + 1e-6, strided)]
    assert "differs from the model's own forward" in output_difference(got * 2, want)
    nan = want.clone()
    nan[0, 0, 0] = float("nan")
    errors = []
    assert output_difference(nan.clone(), nan, errors=errors) is None
    assert errors == [_old_tensor_error(nan, nan)]
    assert output_difference(nan, want) == (
        "output has NaN or infinite elements where the model's own forward does not")
    assert output_difference(want, nan) == (
        "output is finite where the model's own forward has NaN or infinite elements")
    inf = nan.clone()
    inf[0, 0, 0] = float("inf")
    assert output_difference(inf, nan) == (
        "output has other NaN or infinite values than the model's own forward")
    complex_want = torch.randn(3, 2, dtype=torch.complex128)
    assert output_difference(complex_want * 1.5, complex_want).startswith(
        "output differs from the model's own forward by")


def test_rebinding_passes_plain_values_by_and_still_rebinds_functions():
    """The walk's fast path (plain values, empty containers) leaves what it rebinds as
    before: a closure in a list, a dict and a tuple calls the copy's module, a partial
    too, and the empty hook dicts are the copy's own."""
    import functools

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            fc = self.fc
            self.fns = [lambda x: fc(x), 3, "a", None, ()]
            self.table = {"f": lambda x: fc(x) * 2, "empty": {}, "n": 1.5}
            self.pair = (1, lambda x: fc(x) + 1)
            self.part = functools.partial(lambda m, x: m(x), fc)

    model = Holder()
    twin = deepcopy_module(model)
    with torch.no_grad():
        twin.fc.weight.fill_(0.0)
        twin.fc.bias.fill_(1.0)
    x = torch.randn(3, 2)
    ones = torch.ones(3, 2)
    assert torch.equal(twin.fns[0](x), ones)
    assert torch.equal(twin.table["f"](x), 2 * ones)
    assert torch.equal(twin.pair[1](x), 2 * ones)
    assert torch.equal(twin.part(x), ones)
    assert twin.fns[1:] == [3, "a", None, ()] and twin.table["n"] == 1.5
    assert twin.table["empty"] == {} and twin.table["empty"] is not model.table["empty"]
    assert twin._forward_hooks is not model._forward_hooks
    assert not torch.equal(model.fns[0](x), ones)  # the original's own, untouched
    rebind_functions(twin, {})  # (nothing in the memo: everything kept as it is)
    assert torch.equal(twin.fns[0](x), ones)


class _Config:
    def __init__(self):
        self.widths = [4, 4]
        self.opts = {"scale": 1.5, "names": ("a", "b")}


class _Custom(nn.Module):
    """Its own __deepcopy__: left to copy.deepcopy (which marks the copy)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def __deepcopy__(self, memo):
        twin = _Custom().to(self.fc.weight.dtype)
        twin.load_state_dict(self.state_dict())
        twin.marked = True
        return twin

    def forward(self, x):
        return self.fc(x)


class _Zoo(nn.Module):
    """A submodule under two paths, a config object, a dict, a closure over a module,
    a torch module with its own __setstate__, a recurrent layer, a custom copier."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.seq = nn.Sequential(self.shared, nn.ReLU(), nn.LayerNorm(4))
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.table = nn.ModuleDict({"a": nn.Tanh()})
        self.decoder = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0,
                                                  activation=nn.GELU(), batch_first=True)
        self.rnn = nn.LSTM(4, 4, batch_first=True)
        self.custom = _Custom()
        self.cfg = _Config()
        self.plain = {"k": [1, 2.5, None], "t": (3, "x")}
        blocks = self.blocks
        self.head = lambda h: blocks[1](h)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.table["a"](self.seq(x)) * self.cfg.opts["scale"]
        h = self.head(self.blocks[0](h) + self.shared(h))
        h = self.decoder(h.unsqueeze(1), h.unsqueeze(1)).squeeze(1)
        out, _ = self.rnn(h.unsqueeze(1))
        return self.custom(out.squeeze(1))


def test_deepcopy_module_is_copy_deepcopy_step_for_step():
    """deepcopy_module's own module copy gives what copy.deepcopy gave: the same Python
    state (program_difference), sharing (one Linear under two paths), tensors, the same
    outputs, a custom __deepcopy__ still called, and nothing of the original's reached."""
    from hftc.frontends.same_program import program_difference
    from hftc.frontends.symbolic import _module_copy

    torch.manual_seed(3)
    model = _Zoo().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    slow, fast = copy.deepcopy(model), _module_copy(model, {})
    assert program_difference(slow, fast) is None
    assert fast.seq[0] is fast.shared and fast.shared is not model.shared
    assert fast.custom.marked and not hasattr(model.custom, "marked")
    assert fast.cfg is not model.cfg and fast.cfg.widths == [4, 4]
    assert fast.cfg.widths is not model.cfg.widths and fast.plain["k"] is not model.plain["k"]
    assert vars(fast.decoder).keys() == vars(slow.decoder).keys()  # (its __setstate__)
    for (name, a), (_, b) in zip(slow.state_dict().items(), fast.state_dict().items()):
        assert torch.equal(a, b), name
        assert b.data_ptr() != model.state_dict()[name].data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), slow(x), rtol=0, atol=0)
    # the copy made by deepcopy_module (rebound closure) computes with its own modules
    twin = deepcopy_module(model)
    with torch.no_grad():
        for p in twin.blocks[1].parameters():
            p.zero_()
        assert torch.equal(twin.head(x), torch.zeros(3, 4, dtype=torch.float64))
        assert not torch.equal(model.head(x), torch.zeros(3, 4, dtype=torch.float64))
    # a memo shared with the caller: what it maps is what the copy holds
    stand_in = nn.Parameter(torch.ones(4, 4, dtype=torch.float64))
    mapped = _module_copy(model, {id(model.shared.weight): stand_in})
    assert mapped.shared.weight is stand_in and mapped.seq[0].weight is stand_in


def test_program_difference_still_sees_small_differences_the_fast_paths_pass():
    """The comparison's shortcuts (exact ints, strs, None; empty dicts, lists and hook
    dicts) answer as the full walk did: an int against a bool, a str, a hook dict with
    an attribute or an entry, an empty list against a non-empty one all differ."""
    from collections import OrderedDict

    from hftc.frontends.same_program import program_difference

    def pair():
        torch.manual_seed(0)
        return DropNet(0.1), DropNet(0.1)

    a, b = pair()
    assert program_difference(a, b) is None
    for change in (lambda m: setattr(m, "k", True), lambda m: setattr(m, "k", "2"),
                   lambda m: setattr(m, "k", None), lambda m: setattr(m, "k", [1]),
                   lambda m: setattr(m, "k", {"x": 1})):
        a, b = pair()
        a.k, b.k = 1, 1
        change(b)
        assert program_difference(a, b) is not None
    a, b = pair()
    a.k, b.k = [], [0]
    assert program_difference(a, b) is not None
    b.k.pop()
    assert program_difference(a, b) is None
    a, b = pair()
    a.extra = OrderedDict()
    b.extra = OrderedDict()
    assert program_difference(a, b) is None
    b.extra.tag = 1  # an attribute on the dict object itself
    assert program_difference(a, b) is not None
    a, b = pair()
    b.fc1.register_forward_hook(lambda *args: None)
    assert program_difference(a, b) is not None
