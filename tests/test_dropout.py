"""hftc's dropout kernel (``random.dropout``) against ``F.dropout``.

Dropout masks are random, so a fused model's masks never were the loop's draws;
what must hold is ``F.dropout``'s contract: each element kept with probability
``1 - p`` independently (so each model draws its own mask), kept elements scaled
by exactly ATen's ``1 / (1 - p)``, the gradient through the same mask, the same
edge cases (``p`` = 0 or 1, eval, in place, bad ``p``), and ``torch.manual_seed``
reproducing the draws.  On the CPU the mask comes from hftc's own sampler
(``random.bernoulli_mask``), which these tests exercise directly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.lowering.runtime import random as rt_random

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _sigmas(kept: float, keep: float, n: int) -> float:
    """How many standard deviations a kept fraction is from ``keep`` over ``n`` draws."""
    return abs(kept - keep) / math.sqrt(keep * (1 - keep) / n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1e-3])
def test_dropout_keeps_each_element_with_probability_one_minus_p(p, dtype):
    torch.manual_seed(0)
    x = torch.rand(4, 256, 512, dtype=dtype) + 0.5  # no zeros of its own
    out = rt_random.dropout(x, p, True)
    kept = out != 0
    n = kept.numel()
    assert _sigmas(kept.double().mean().item(), 1 - p, n) < 5
    # the kept elements: x times ATen's own scale, bit for bit
    reference = F.dropout(x, p, True)
    scale = reference[reference != 0][0] / x[reference != 0][0]
    assert torch.equal(out[kept], x[kept] * scale)
    # each model (the leading dim) its own draws: no two masks alike, no correlation
    masks = kept.reshape(4, -1).double()
    for i in range(4):
        assert _sigmas(masks[i].mean().item(), 1 - p, masks.shape[1]) < 5
        for j in range(i):
            both = (masks[i] * masks[j]).mean().item()
            assert _sigmas(both, (1 - p) ** 2, masks.shape[1]) < 5
            assert not torch.equal(masks[i], masks[j])


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_gradient_goes_through_the_same_mask(inplace):
    torch.manual_seed(0)
    leaf = torch.randn(3, 50, 40, dtype=torch.float64, requires_grad=True)
    x = leaf * 1.0 if inplace else leaf  # in place needs a non-leaf
    out = rt_random.dropout(x, 0.3, True, inplace)
    grad = torch.randn_like(out)
    out.backward(grad)
    noise = torch.where(out != 0, 1 / torch.tensor(0.7, dtype=torch.float64), 0)
    assert torch.equal(leaf.grad, grad * noise)
    assert torch.equal(out, leaf.detach() * noise)
    # double backward, as through F.dropout
    leaf.grad = None
    out = rt_random.dropout(leaf, 0.3, True)
    (g,) = torch.autograd.grad(out.square().sum(), leaf, create_graph=True)
    g.sum().backward()
    noise = torch.where(out != 0, 1 / torch.tensor(0.7, dtype=torch.float64), 0)
    assert torch.equal(leaf.grad, 2 * noise * noise)


def test_dropout_edge_cases_are_f_dropouts():
    x = torch.randn(8, 16)
    assert rt_random.dropout(x, 0.0, True) is x
    assert rt_random.dropout(x, 0.5, False) is x
    assert F.dropout(x, 0.0, True) is x  # ATen returns its input too
    nan = torch.tensor([1.0, float("nan"), -2.0])
    assert torch.equal(rt_random.dropout(nan, 1.0, True).isnan(),
                       F.dropout(nan, 1.0, True).isnan())
    assert torch.equal(rt_random.dropout(nan, 1.0, True)[[0, 2]], torch.zeros(2))
    y = x.clone()
    assert rt_random.dropout(y, 0.5, True, True) is y
    assert ((y == 0) | torch.isclose(y, 2 * x)).all() and (y == 0).any()
    for p in (-0.1, 1.5):
        for training in (True, False):
            with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
                rt_random.dropout(x, p, training)
    ints = torch.arange(6)  # not floating: ATen's error, from ATen
    with pytest.raises(RuntimeError) as aten:
        F.dropout(ints, 0.5, True)
    with pytest.raises(RuntimeError, match=str(aten.value)):
        rt_random.dropout(ints, 0.5, True)


def test_dropout_draws_follow_the_seed():
    x = torch.ones(1000)
    torch.manual_seed(3)
    first = rt_random.dropout(x, 0.5, True)
    torch.manual_seed(3)
    assert torch.equal(rt_random.dropout(x, 0.5, True), first)
    assert not torch.equal(rt_random.dropout(x, 0.5, True), first)


def test_bernoulli_mask_with_a_keep_probability_per_model():
    torch.manual_seed(0)
    keep = torch.tensor([1.0, 0.0, 0.25, 1 - 2**-31, 0.999]).reshape(5, 1, 1)
    mask = rt_random.bernoulli_mask((5, 300, 200), keep, torch.empty(0, dtype=torch.float32))
    assert mask.dtype == torch.float32 and set(mask.unique().tolist()) <= {0.0, 1.0}
    assert mask[0].all() and not mask[1].any()
    assert _sigmas(mask[2].mean().item(), 0.25, 60_000) < 5
    assert mask[3].sum() >= 59_999
    assert _sigmas(mask[4].mean().item(), 0.999, 60_000) < 5
    # a float keep probability that rounds to 2**31 of 2**31 keeps everything
    assert rt_random.bernoulli_mask((1000,), 1 - 1e-12, torch.empty(0)).all()
    assert not rt_random.bernoulli_mask((1000,), 1e-12, torch.empty(0)).any()


def _drawn_values(shape, thresholds, dim=0):
    """Each element's 31-bit value as ``random._keep_mask`` draws it, from the generator's
    state now: ``lead * 2**23 + rest``, the lead bytes of full-range int64 draws, the
    rests (low 23 bits of int32 draws, in order) only where the lead ties the threshold's
    (``thresholds``: one a slice along ``dim``); elsewhere ``lead * 2**23`` decides alike."""
    numel = math.prod(shape)
    words = torch.empty(-(-numel // 8), dtype=torch.int64).random_(-2**63, None)
    lead = words.view(torch.uint8)[:numel].view(shape).long()
    t_lead = torch.tensor([min(t >> 23, 255) for t in thresholds])
    t_lead = t_lead.view(-1, *[1] * (len(shape) - 1 - dim))
    ties = lead == t_lead
    rests = torch.empty(int(ties.sum()), dtype=torch.int32).random_().long() & (2**23 - 1)
    values = lead * 2**23
    values[ties] += rests
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_model_dropout_is_each_models_bits_below_its_threshold(dtype):
    """Per-model rates, against the rule written out model by model on the same draws:
    element kept where its 31-bit value is below round(keep * 2**31), scaled by
    1 / keep; the gradient through the same mask and scale. Rates 0 and 1, one a bit
    above 0 and one a bit below 1 (the thresholds' ends), and inf / NaN inputs."""
    p = [0.0, 1.0, 0.3, 2**-31, 1 - 2**-31, 0.5]
    x = torch.randn(len(p), 7, 50, dtype=dtype)
    x[2, 0, 0], x[3, 0, 1] = float("inf"), float("nan")
    x.requires_grad_()
    torch.manual_seed(11)
    out = rt_random.per_model_dropout(x, p, True)
    g = torch.randn_like(out)
    out.backward(g)
    keeps = [torch.tensor(1 - rate, dtype=dtype) for rate in p]
    thresholds = [round(float(keep.double()) * 2**31) for keep in keeps]
    torch.manual_seed(11)
    values = _drawn_values(x.shape, thresholds)
    for i, keep in enumerate(keeps):
        kept = (values[i] < thresholds[i]).to(dtype)
        scale = 1 / keep if keep > 0 else torch.zeros((), dtype=dtype)
        want = x[i].detach() * kept * scale
        assert torch.equal(out[i].detach().isnan(), want.isnan()), i
        assert torch.equal(out[i].detach().nan_to_num(), want.nan_to_num()), i
        assert torch.equal(x.grad[i], g[i] * kept * scale), i
    assert out[0].detach().nan_to_num().ne(0).all()  # p = 0 keeps every element


def test_a_per_model_keep_threshold_is_exact_at_its_ends():
    """Draws forced to one 31-bit value v = lead * 2**23 + rest (the int64 draws filled
    with the byte ``lead``, the int32 ones with ``rest`` and a high bit the sampler drops):
    an element is kept exactly where v < round(keep * 2**31), at both sides of every end:
    keep 0 and 1, and thresholds v and v + 1."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Drawn(TorchDispatchMode):
        def __init__(self, lead, rest):
            super().__init__()
            self.lead, self.rest = lead, rest

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.random_:
                if args[0].dtype == torch.int64:
                    word = int.from_bytes(bytes([self.lead] * 8), "little", signed=True)
                    return args[0].fill_(word)
                return args[0].fill_(self.rest | 2**30)
            return func(*args, **(kwargs or {}))

    for lead in (0, 1, 127, 128, 254, 255):
        for rest in (0, 1, 2**22, 2**23 - 1):
            v = lead * 2**23 + rest
            keeps = [0.0, 1.0, v / 2**31, (v + 1) / 2**31, (v + 2**23) / 2**31,
                     (v - 2**23) / 2**31]
            keeps = [k for k in keeps if 0 <= k <= 1]
            keep = torch.tensor(keeps, dtype=torch.float64).reshape(-1, 1)
            with Drawn(lead, rest):
                mask = rt_random.bernoulli_mask((len(keeps), 3), keep, torch.empty(0))
            want = [float(v < round(k * 2**31)) for k in keeps]
            assert mask[:, 0].tolist() == want and (mask == mask[:, :1]).all(), (v, mask)
            # a float keep, and with a scale
            for k in keeps[2:]:
                with Drawn(lead, rest):
                    one = rt_random.bernoulli_mask((5,), k, torch.empty(0))
                assert one.tolist() == [float(v < round(k * 2**31))] * 5, (v, k)
            scale = torch.arange(1.0, len(keeps) + 1).reshape(-1, 1)
            with Drawn(lead, rest):
                scaled = rt_random.bernoulli_mask((len(keeps), 3), keep, torch.empty(0),
                                                  scale)
            assert torch.equal(scaled, mask * scale)


class Dropouts(nn.Module):
    """Every spelling the dropout kernel takes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        x = self.drop(self.fc(x))
        x = F.dropout(x, 0.5, self.training)
        return torch.dropout(x, 0.1, self.training)


def test_fused_dropouts_run_hftcs_kernel_and_each_model_draws_its_own_mask():
    torch.manual_seed(0)
    models = [Dropouts() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(256, 16)
    out = fused(x)
    source = fused.last_program().source
    assert source.count("hftc_lowering_runtime_random_dropout(") == 3, source
    assert "functional_dropout" not in source and "torch.dropout" not in source
    keep = 0.75 * 0.5 * 0.9
    for i in range(3):
        kept = (out[i] != 0).double().mean().item()
        assert _sigmas(kept, keep, out[i].numel()) < 5
    assert not torch.equal(out[0] != 0, out[1] != 0)
    # eval: no dropout, the loop's values and gradients (float64 and float32)
    for dtype in (torch.float64, torch.float32):
        check_equivalence(models, x, train=False, dtype=dtype)


def test_dropout_masks_are_drawn_on_the_inputs_device_whatever_the_default():
    x, keep = torch.ones(64, 64), torch.tensor([[0.5], [1.0]])
    with torch.device("meta"):  # a default device other than the input's
        out = rt_random.dropout(x, 0.5, True)
        per_model = rt_random.bernoulli_mask((2, 8), keep, x)
    assert out.device.type == "cpu" and per_model.device.type == "cpu"
    assert per_model[1].all()


class _RandomLayerFirst(nn.Module):
    """A layer that draws (RReLU's slopes, fractional pooling's regions) on the input."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.pool = nn.FractionalMaxPool2d(2, output_size=5)
        self.act = nn.RReLU(0.1, 0.3)

    def forward(self, x):
        if self.kind == "rrelu":
            return self.act(x)
        if self.kind == "f.rrelu":
            return F.rrelu(x, 0.1, 0.3, training=True)
        return self.pool(x)


@pytest.mark.parametrize("kind", ["rrelu", "f.rrelu", "fractional_max_pool"])
def test_draws_on_a_shared_input_are_each_models_own(kind):
    # One draw for all models made every model's output the same: the loop over the
    # models draws for each.
    torch.manual_seed(0)
    fused = hftc.fuse([_RandomLayerFirst(kind) for _ in range(3)])
    x = torch.randn(2, 4, 8, 8) - 1
    out = fused(x)
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])
    if kind == "fractional_max_pool":
        assert out.shape == (3, 2, 4, 5, 5)
        return
    slopes = out[:, x < 0] / x[x < 0]  # each negative element's drawn slope, per model
    assert ((slopes >= 0.1 - 1e-6) & (slopes <= 0.3 + 1e-6)).all()
    torch.testing.assert_close(out[:, x >= 0], x[x >= 0].expand(3, -1))


class _GammaDraw(nn.Module):
    """torch.distributions' Gamma / Beta samplers draw with torch._standard_gamma."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x), torch._standard_gamma(torch.full((3,), 0.4))


class _ConstantTensorDraw(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x) + torch.empty(2).cauchy_()


def test_gamma_draws_are_drawn_per_call_and_per_model_and_frozen_ones_refused():
    # From constant concentrations the draw ran once, while tracing, and every call
    # returned it; an in-place draw on a tensor made from constants was frozen too.
    torch.manual_seed(0)
    fused = hftc.fuse([_GammaDraw() for _ in range(3)])
    x = torch.randn(5, 4)
    first, second = fused(x)[1], fused(x)[1]
    assert first.shape == (3, 3) and not torch.equal(first, second)
    assert not torch.equal(first[0], first[1])
    with pytest.raises(hftc.errors.TraceError, match=r"Tensor.cauchy_\(\) on a tensor made "
                                                     r"from constants.*empty_like"):
        hftc.fuse([_ConstantTensorDraw() for _ in range(2)])


@pytest.mark.parametrize("shape", [(5, 64, 33), (3, 7), (4, 2, 3, 5)], ids=str)
def test_a_rate_per_model_reads_each_tie_at_its_model_as_the_broadcast_path_does(shape):
    """A keep ``[N, 1, ...]`` reads a tie's threshold and scale at its model
    (``tie // (numel / N)``); the same keep expanded to the whole shape goes the general
    way (each tie's broadcast position): on the same draws, the same mask and scale."""
    n = shape[0]
    keep = torch.linspace(0.05, 0.95, n, dtype=torch.float64).reshape(n, *[1] * (len(shape) - 1))
    scale = (1 / keep).float()
    for s in (None, scale):
        torch.manual_seed(5)
        per_model = rt_random.bernoulli_mask(shape, keep, torch.empty(0), s)
        torch.manual_seed(5)
        whole = rt_random.bernoulli_mask(shape, keep.expand(shape).contiguous(), torch.empty(0),
                                         None if s is None else s.expand(shape).contiguous())
        assert torch.equal(per_model, whole)


def test_per_model_dropout_rates_are_made_once_and_follow_new_rates():
    """The thresholds of a rate list are kept between calls (the program's constants);
    other rates, dtypes or shapes get their own, and reusing them changes nothing."""
    x = torch.ones(3, 4000)
    torch.manual_seed(2)
    first = rt_random.per_model_dropout(x, [0.1, 0.5, 0.9], True)
    torch.manual_seed(2)
    assert torch.equal(rt_random.per_model_dropout(x, [0.1, 0.5, 0.9], True), first)
    other = rt_random.per_model_dropout(x, [0.9, 0.5, 0.1], True)
    kept = (other != 0).double().mean(dim=1)
    assert kept[0] < 0.2 and kept[2] > 0.8
    half = rt_random.per_model_dropout(x.double(), [0.1, 0.5, 0.9], True)
    assert half.dtype == torch.float64 and set((half[1][half[1] != 0]).tolist()) == {2.0}
