"""``hftc.fuse(models, pad_widths=True, example_inputs=...)``: ops of the models' own forward
over a padded dim (a softmax, mean, var over hidden units; minGPT's split of a packed q, k, v
Linear) compute over each model's real units (hftc/module/padding_graph.py).

Each model is compared with the same model trained alone with stock ``torch.optim``.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import UnsupportedOperatorError
from tests.optim_helpers import single_thread  # noqa: F401  (fixture)
from tests.test_pad_widths import assert_each_models_float32

# ---------------------------------------------------------------- models


class SoftmaxAfterSigmoid(nn.Module):
    """A softmax over hidden units whose padding is not zero (sigmoid(0) = 0.5)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).sigmoid().softmax(-1))


class MeanVarOverHidden(nn.Module):
    """Mean and (unbiased) variance over hidden units, used as features."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, hidden), nn.Linear(hidden, 3)
        self.out = nn.Linear(2, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) + 0.3
        stats = torch.stack([h.mean(-1), torch.var(h, dim=-1)], -1)
        return self.fc2(torch.relu(h)) + self.out(stats)


class HandLayerNorm(nn.Module):
    """A LayerNorm written in forward's own code."""

    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, hidden), nn.Linear(hidden, 3)
        self.eps = eps

    def forward(self, x):
        h = self.fc1(x) + 1.0
        h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, unbiased=False)
                                              + self.eps).sqrt()
        return self.fc2(F.gelu(h))


class FunctionalLayerNorm(nn.Module):
    """nanoGPT's LayerNorm without its raw weight / bias: F.layer_norm over ``ndim`` (an int
    attribute, the widest model's once padded)."""

    def __init__(self, ndim: int):
        super().__init__()
        self.ndim = ndim

    def forward(self, x):
        return F.layer_norm(x, (self.ndim,), None, None, 1e-5)


class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: its own weight and bias (raw nn.Parameter)."""

    def __init__(self, ndim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """minGPT's attention: one packed c_attn Linear, split into q, k, v by n_embd."""

    def __init__(self, n_embd: int, n_head: int, block_size: int = 8):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MinGPT(nn.Module):
    """Token / position embeddings, two blocks (F.layer_norm in forward's code, packed
    attention, MLP), a head over the vocabulary."""

    def __init__(self, n_embd: int, head_dim: int = 16, vocab: int = 11):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(8, n_embd)
        self.ln = nn.ModuleList(FunctionalLayerNorm(n_embd) for _ in range(5))
        self.attn = nn.ModuleList(CausalSelfAttention(n_embd, n_embd // head_dim)
                                  for _ in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(n_embd, 2 * n_embd), nn.GELU(),
                                               nn.Linear(2 * n_embd, n_embd))
                                 for _ in range(2))
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for k in range(2):
            x = x + self.attn[k](self.ln[2 * k](x))
            x = x + self.mlp[k](self.ln[2 * k + 1](x))
        return self.head(self.ln[4](x))


class NanoGPTHead(nn.Module):
    """nanoGPT's final LayerNorm (raw weight and bias) before the head."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(11, n_embd)
        self.ln_f = NanoLayerNorm(n_embd)
        self.head = nn.Linear(n_embd, 11)

    def forward(self, idx):
        return self.head(self.ln_f(self.wte(idx)))


# ---------------------------------------------------------------- training


def _batches(tokens: bool, steps: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    if tokens:
        return [(torch.randint(0, 11, (3, 8), generator=g),
                 torch.randint(0, 11, (3, 8), generator=g)) for _ in range(steps)]
    return [(torch.randn(5, 6, generator=g, dtype=dtype),
             torch.randint(0, 3, (5,), generator=g)) for _ in range(steps)]


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, hftc.optim.SGD,
            lambda i: dict(lr=0.05 * (i + 1), momentum=0.9, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, hftc.optim.Adam,
             lambda i: dict(lr=1e-2 * (i + 1), weight_decay=1e-3)),
}


def _relative(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


FAMILIES = {
    "softmax_after_sigmoid": (SoftmaxAfterSigmoid, [8, 16, 24], False),
    "mean_var": (MeanVarOverHidden, [8, 20], False),
    "hand_layer_norm": (HandLayerNorm, [12, 32], False),
    "min_gpt": (MinGPT, [32, 64], True),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ops_over_a_padded_dim_train_as_alone(family, optimizer):
    """float64, 10 steps: outputs, and each model's weights after training, equal the
    model's own trained alone with stock torch.optim (<= 1e-9 relative)."""
    build, widths, tokens = FAMILIES[family]
    torch.manual_seed(0)
    models = [build(w).double() for w in widths]
    alone = [copy.deepcopy(m) for m in models]
    batches = _batches(tokens, 10, torch.float64)
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(batches[0][0],))
    assert fused.padding is not None
    _, fused_class, kwargs = OPTIMIZERS[optimizer]
    per_model = [kwargs(i) for i in range(fused.num_models)]
    opt = fused_class(fused.parameters(), **{k: [d[k] for d in per_model] for k in per_model[0]})
    stock = [OPTIMIZERS[optimizer][0](m.parameters(), **kwargs(i)) for i, m in enumerate(alone)]
    for x, y in batches:
        opt.zero_grad()
        out = fused(x)
        sum(_loss(out[i], y) for i in range(fused.num_models)).backward()
        opt.step()
        for i, (model, o) in enumerate(zip(alone, stock)):
            o.zero_grad()
            want = model(x)
            assert _relative(out[i], want) <= 1e-9, i
            _loss(want, y).backward()
            o.step()
    assert fused.fusion_report.fallbacks == []
    for i, (back, want) in enumerate(zip(fused.unfuse(), alone)):
        got, expected = back.state_dict(), want.state_dict()
        assert got.keys() == expected.keys()  # the masks are no state
        for name in expected:
            assert got[name].shape == expected[name].shape, (i, name)
            if expected[name].is_floating_point():
                assert _relative(got[name], expected[name]) <= 1e-9, (i, name)
    assert fused.state_dict().keys() == fused.padded_model(0).state_dict().keys()
    # eval mode: a new program, still each model's own
    fused.eval()
    x = batches[0][0]
    out = fused(x)
    for i, model in enumerate(alone):
        assert _relative(out[i], model.eval()(x)) <= 1e-9


def test_float32_forward_backward():
    """float32: outputs and gradients (in each model's own units) are each model's."""
    torch.manual_seed(1)
    models = [MinGPT(w) for w in (32, 64)]
    x, y = _batches(True, 1, torch.float32)[0]
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    out = fused(x)
    sum(_loss(out[i], y) for i in range(2)).backward()
    assert_each_models_float32(fused, models, out, lambda o: _loss(o, y), x)


def test_keep_models_keeps_each_models_masks():
    torch.manual_seed(2)
    models = [SoftmaxAfterSigmoid(w).double() for w in (8, 16, 24)]
    x = torch.randn(4, 6, dtype=torch.float64)
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    fused(x)
    hftc.keep_models(fused, [2, 0])
    out = fused(x)
    assert _relative(out[0], models[2](x)) <= 1e-12
    assert _relative(out[1], models[0](x)) <= 1e-12


def test_nanogpt_layer_norm_with_raw_parameters():
    torch.manual_seed(3)
    models = [NanoGPTHead(w).double() for w in (16, 32)]
    x = torch.randint(0, 11, (2, 8))
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    out = fused(x)
    for i, model in enumerate(models):
        assert _relative(out[i], model(x)) <= 1e-9


class OneOp(nn.Module):
    """``op`` over hidden units that are not zero-padded (after a sigmoid); an op that keeps
    the shape feeds the head, a reduced one is added to it."""

    def __init__(self, hidden: int, op, keeps_shape: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, hidden), nn.Linear(hidden, 3)
        self.op, self.keeps_shape = op, keeps_shape

    def forward(self, x):
        h = self.fc1(x).sigmoid()
        if self.keeps_shape:
            return self.fc2(self.op(h))
        return self.fc2(h) + self.op(h)


class GatedLinear(nn.Module):
    """A GLU: one Linear of 2 * hidden outputs, chunked into value and gate."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 2 * hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        value, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(value * gate.sigmoid())


OPS = {
    "amax": (lambda h: h.amax(-1, keepdim=True), False),
    "logsumexp": (lambda h: torch.logsumexp(h, -1, keepdim=True), False),
    "max_values": (lambda h: h.max(-1).values[:, None], False),
    "min_keepdim": (lambda h: h.min(dim=-1, keepdim=True)[0], False),
    "std": (lambda h: torch.std(h, -1, keepdim=True), False),
    "var_correction": (lambda h: h.var(-1, correction=0, keepdim=True), False),
    "norm": (lambda h: h.norm(dim=-1, keepdim=True), False),
    "vector_norm": (lambda h: torch.linalg.vector_norm(h, 3, -1, True), False),
    "sum_all": (lambda h: h.sum(), False),
    "log_softmax": (lambda h: F.log_softmax(h, -1), True),
    "normalize": (lambda h: F.normalize(h, dim=-1), True),
    "softmax_module": (nn.Softmax(dim=-1), True),
}


@pytest.mark.parametrize("op", sorted(OPS) + ["glu_chunk"])
def test_each_op_forward_and_backward(op):
    """float64: each op's output and every parameter's gradient (in the model's own
    units) are the model's own."""
    torch.manual_seed(4)
    if op == "glu_chunk":
        models = [GatedLinear(w).double() for w in (8, 20)]
    else:
        models = [OneOp(w, *OPS[op]).double() for w in (8, 20)]
    x = torch.randn(5, 6, dtype=torch.float64)
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    out = fused(x)
    out.square().sum().backward()
    for i, model in enumerate(models):
        want = model(x)
        want.square().sum().backward()
        assert _relative(out[i], want) <= 1e-12, i
        grads = dict(model.named_parameters())
        for name, p in fused.named_parameters():
            assert _relative(fused.padding.unpad(i, name, p.grad[i]), grads[name].grad) \
                <= 1e-12, (i, name)


@pytest.mark.parametrize("family", ["mlp", "cnn", "gpt", "mixed", "encoder"])
def test_models_that_need_no_rewrite_are_left_as_they_are(family):
    """tests/test_pad_widths.py's families (their norms, attention, pools are modules that
    pad): with example_inputs nothing is refused or rewritten, the outputs are the models'."""
    from tests import test_pad_widths

    build, widths = test_pad_widths.FAMILIES[family]
    torch.manual_seed(6)
    models = [build(w).double().eval() for w in widths]
    x = test_pad_widths._batches(family, 1, torch.float64)[0][0]
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    assert type(fused.padded_model(0)).__mro__[1] is not type(models[0])  # no subclass
    out = fused(x)
    for i, model in enumerate(models):
        assert _relative(out[i], model(x)) <= 1e-12


def test_masks_are_no_state_and_the_module_pickles():
    torch.manual_seed(5)
    models = [SoftmaxAfterSigmoid(w).double() for w in (8, 16)]
    x = torch.randn(4, 6, dtype=torch.float64)
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    out = fused(x)
    assert any("_hftc_real_units" in n for n, _ in fused.named_buffers())
    assert not any("_hftc_real_units" in k for k in fused.state_dict())
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), out)
    assert torch.equal(copy.deepcopy(fused)(x), out)


# ---------------------------------------------------------------- refusals


class SortOverHidden(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.sort(self.fc1(x).sigmoid(), dim=-1).values)


class HeadsInnermost(nn.Module):
    """A view that puts the padded heads inside each unit's block: [B, C] -> [B, 4, C/4]
    moves model i's units among the padding."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, hidden), nn.Linear(hidden // 4, 3)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h.view(h.shape[0], 4, -1)).sum(1)


def test_an_op_that_cannot_be_made_exact_is_refused_naming_it():
    x = torch.randn(2, 4)
    with pytest.raises(UnsupportedOperatorError,
                       match=r"pad_widths=True cannot compute `sort` in the root "
                             r"\(.*test_padding_graph.py:\d+.*torch.sort"):
        hftc.fuse([SortOverHidden(8), SortOverHidden(16)], pad_widths=True,
                  example_inputs=(x,))


def test_a_view_that_moves_units_among_the_padding_is_refused():
    x = torch.randn(2, 4)
    with pytest.raises(UnsupportedOperatorError,
                       match=r"cannot compute `view` .*moves model 0's real units"):
        hftc.fuse([HeadsInnermost(8), HeadsInnermost(16)], pad_widths=True,
                  example_inputs=(x,))


def test_without_example_inputs_the_first_call_rewrites():
    """Without example_inputs the first call's check against the original models fails,
    the ops are rewritten on that call's inputs and the module fused again in place:
    an optimizer built before the first call keeps stepping the same parameters."""
    torch.manual_seed(3)
    models = [SoftmaxAfterSigmoid(8).double(), SoftmaxAfterSigmoid(16).double()]
    fused = hftc.fuse(models, pad_widths=True)
    params = list(fused.parameters())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
    x = torch.randn(2, 6, dtype=torch.float64)
    out = fused(x)
    assert list(fused.parameters()) == params and opt.param_groups[0]["params"] == params
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x), rtol=1e-12, atol=1e-12)


class _NormThenSoftmax(nn.Module):
    """Batch norm, then a softmax over hidden units whose padding is not zero (an op the
    rewrite computes over each model's real units)."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, hidden), nn.BatchNorm1d(6), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(self.fc1(self.norm(x)).sigmoid().softmax(-1))


def test_the_rewrite_leaves_each_models_state_as_it_found_it(monkeypatch):
    # The rewrite's analysis runs every model in both modes on the first inputs; training
    # mode moves the running statistics, which must be the models' own when the fused
    # module starts.
    from hftc.module import padding_graph

    runs = []
    run = padding_graph._run
    monkeypatch.setattr(padding_graph, "_run", lambda *a: runs.append(a[1]) or run(*a))
    torch.manual_seed(4)
    models = [_NormThenSoftmax(w).double() for w in (8, 16)]
    alone = [copy.deepcopy(m) for m in models]
    x = torch.randn(5, 6, dtype=torch.float64)
    fused = hftc.fuse(models, pad_widths=True, example_inputs=(x,))
    assert type(fused.padded_model(0)).__mro__[1] is _NormThenSoftmax  # (rewritten)
    assert sorted(set(runs)) == [False, True]  # (each model analysed in both modes)
    for i, (back, want) in enumerate(zip(fused.unfuse(), alone)):
        got = back.state_dict()
        for name, value in want.state_dict().items():
            assert torch.equal(got[name], value), (i, name)
        assert back.training and all(m.training for m in back.modules())
    out = fused(x)
    for i, model in enumerate(alone):
        assert _relative(out[i], model(x)) <= 1e-12, i
    fused.eval()
    out = fused(x)
    for i, model in enumerate(alone):
        assert _relative(out[i], model.eval()(x)) <= 1e-12, i
