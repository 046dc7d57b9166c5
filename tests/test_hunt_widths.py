"""Bug hunt: models that differ in widths (``hftc.fuse(models, pad_widths=True)``,
``hftc.fuse_groups``, ``hftc.keep_models`` / ``replace_models``), each checked against the
same models trained alone with stock ``torch.optim``."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import UnsupportedOperatorError
from hftc.lowering.check import ConstantRandomness
from tests.optim_helpers import single_thread  # noqa: F401  (fixture)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


class ScaledEmbedding(nn.Module):
    """The Annotated Transformer's embedding: ``self.lut(x) * math.sqrt(self.d_model)``,
    d_model a per-model float read in C by math.sqrt."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = float(d_model)
        self.lut = nn.Embedding(11, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 11)

    def forward(self, idx):
        return self.head(self.norm(self.lut(idx) * math.sqrt(self.d_model)))


def test_a_per_model_width_read_in_c_pads_and_trains_as_alone():
    """d_model 8 and 16 padded into one array: each model scales by its own sqrt(d_model)
    and trains (Adam, weight decay, float64) as alone. Before, the number trace baked model
    0's math.sqrt(8) into every model's graph and pad_widths=True was refused with a
    MismatchError saying forward mixes across a padded width."""
    torch.manual_seed(0)
    models = [ScaledEmbedding(d).double() for d in (8, 16)]
    alone = [copy.deepcopy(m) for m in models]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = hftc.fuse(models, pad_widths=True)
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-2, 2e-2], weight_decay=[1e-2, 1e-2])
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2 * (i + 1), weight_decay=1e-2)
            for i, m in enumerate(alone)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        idx, y = torch.randint(0, 11, (3, 5), generator=g), torch.randint(0, 11, (3, 5), generator=g)
        opt.zero_grad()
        out = fused(idx)
        sum(F.cross_entropy(out[i].reshape(-1, 11), y.reshape(-1)) for i in range(2)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            want = m(idx)
            assert _relative(out[i].detach(), want.detach()) <= 1e-12
            F.cross_entropy(want.reshape(-1, 11), y.reshape(-1)).backward()
            o.step()
    assert fused.strategy == "fused" and fused.padding is not None
    for i, m in enumerate(alone):
        got = fused.model_state_dict(i)
        for name, want in m.state_dict().items():
            assert _relative(got[name], want) <= 1e-12, (i, name)


class SingleHead(nn.Module):
    """One attention head of width ``d`` (a width sweep), scaled by its key's size, and a
    hand-written centring by the hidden size: both read a padded dim's size in Python."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(6, d), nn.Linear(6, d), nn.Linear(6, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        h = att.softmax(-1) @ v
        h = h - h.sum(-1, keepdim=True) / h.shape[-1]
        return self.out(h * h.size(-1) ** -0.5)


def test_a_size_of_a_padded_dim_in_python_arithmetic_is_each_models():
    """k.size(-1), h.shape[-1] of a padded dim are each model's own width (d = 4 and 10
    padded to 10), trained with SGD momentum and weight decay as alone (float64), and
    unfuse() gives back each width. Before, the sizes were the padded width in every
    model, and pad_widths=True was refused (MismatchError, even with example_inputs)."""
    torch.manual_seed(2)
    models = [SingleHead(d).double() for d in (4, 10, 7)]
    alone = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, pad_widths=True)
    kwargs = [dict(lr=0.05 * (i + 1), momentum=0.9, weight_decay=1e-2) for i in range(3)]
    opt = hftc.optim.SGD(fused.parameters(), **{k: [d[k] for d in kwargs] for k in kwargs[0]})
    opts = [torch.optim.SGD(m.parameters(), **kw) for m, kw in zip(alone, kwargs)]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
        opt.zero_grad()
        out = fused(x)
        sum(out[i].square().mean() for i in range(3)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            want = m(x)
            assert _relative(out[i].detach(), want.detach()) <= 1e-12
            want.square().mean().backward()
            o.step()
    assert fused.strategy == "fused" and fused.padding is not None
    for i, (back, m) in enumerate(zip(fused.unfuse(), alone)):
        assert back.q.out_features == m.q.out_features
        for (name, got), want in zip(back.state_dict().items(), m.state_dict().values()):
            assert _relative(got, want) <= 1e-12, (i, name)


def test_a_size_of_a_padded_dim_float32():
    torch.manual_seed(4)
    models = [SingleHead(d) for d in (4, 10)]
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(3, 5, 6)
    out = fused(x)
    out.square().sum().backward()
    for i, model in enumerate(models):
        want = model(x)
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(fused.padding.unpad(i, name, dict(fused.named_parameters())[name].grad[i]),
                                       p.grad, rtol=1e-4, atol=1e-6)


class AnnotatedEmbeddings(nn.Module):
    """The Annotated Transformer's ``Embeddings``: an int ``d_model`` (which pad_widths
    widens, as a user's n_embd) read by ``math.sqrt`` to scale a padded tensor and an
    unpadded one."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.lut = nn.Embedding(11, d_model)
        self.proj = nn.Linear(d_model, 5)

    def forward(self, idx):
        h = torch.tanh(self.lut(idx) * math.sqrt(self.d_model))
        return self.proj(h) / math.sqrt(self.d_model) + self.d_model


def test_a_widened_int_attribute_in_arithmetic_is_each_models():
    """pad_widths widens the user's int d_model to the widest (for views of padded
    tensors); forward's arithmetic on it gets each model's own value. Before, every model
    scaled by the widest model's sqrt(d_model) and pad_widths=True was refused."""
    torch.manual_seed(5)
    models = [AnnotatedEmbeddings(d).double() for d in (4, 16, 9)]
    alone = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, pad_widths=True)
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-2] * 3, weight_decay=[1e-2] * 3)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-2) for m in alone]
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        idx = torch.randint(0, 11, (4, 3), generator=g)
        opt.zero_grad()
        out = fused(idx)
        sum(out[i].square().mean() for i in range(3)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            want = m(idx)
            assert _relative(out[i].detach(), want.detach()) <= 1e-12
            want.square().mean().backward()
            o.step()
    assert fused.strategy == "fused"
    for i, m in enumerate(alone):
        got = fused.model_state_dict(i)
        for name, want in m.state_dict().items():
            assert _relative(got[name], want) <= 1e-12, (i, name)
    assert [m.d_model for m in fused.unfuse()] == [4, 16, 9]


class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm (raw parameters, F.layer_norm over the padded dim)."""

    def __init__(self, n_embd: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_embd))
        self.bias = nn.Parameter(torch.zeros(n_embd))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: a packed q, k, v split, head dim 8, and its float
    ``self.dropout`` passed to scaled_dot_product_attention."""

    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_embd // 8, n_embd, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training
                                           else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoGPT(nn.Module):
    def __init__(self, n_embd: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(11, n_embd)
        self.ln, self.ln_f = NanoLayerNorm(n_embd), NanoLayerNorm(n_embd)
        self.attn = NanoAttention(n_embd, dropout)
        self.head = nn.Linear(n_embd, 11)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.attn(self.ln(x))
        return self.head(self.ln_f(x))


def test_a_sweep_over_widths_and_a_float_in_forward_trains_as_alone():
    """n_embd x dropout (nanoGPT's F.scaled_dot_product_attention(dropout_p=self.dropout)):
    padding's rewrite of the split and layer norms is one graph for all models, each
    reading its own dropout. Before, the padded models' graphs differed in that float, so
    nothing was rewritten and pad_widths=True was refused, blaming the split."""
    torch.manual_seed(7)
    models = [NanoGPT(d, p).double() for d, p in ((16, 0.0), (32, 0.3), (24, 0.1))]
    alone = [copy.deepcopy(m) for m in models]
    idx = torch.randint(0, 11, (2, 6))
    with ConstantRandomness():
        fused = hftc.fuse(models, pad_widths=True)
        opt = hftc.optim.Adam(fused.parameters(), lr=[1e-2, 2e-2, 3e-2], weight_decay=[1e-2] * 3)
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2 * (i + 1), weight_decay=1e-2)
                for i, m in enumerate(alone)]
        for _ in range(3):
            opt.zero_grad()
            out = fused(idx)
            sum(out[i].square().mean() for i in range(3)).backward()
            opt.step()
            for i, (m, o) in enumerate(zip(alone, opts)):
                o.zero_grad()
                want = m(idx)
                assert _relative(out[i].detach(), want.detach()) <= 1e-12
                want.square().mean().backward()
                o.step()
    assert fused.strategy == "fused" and fused.padding is not None
    for i, m in enumerate(alone):
        got = fused.model_state_dict(i)
        for name, want in m.state_dict().items():
            assert _relative(got[name], want) <= 1e-12, (i, name)
    fused.eval()
    out = fused(idx)
    for i, m in enumerate(alone):
        assert _relative(out[i], m.eval()(idx)) <= 1e-12


class SlopeSoftmax(nn.Module):
    def __init__(self, hidden: int, slope: float):
        super().__init__()
        self.slope = slope
        self.fc, self.out = nn.Linear(5, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.out(F.leaky_relu(self.fc(x), self.slope).softmax(-1))


def test_a_per_model_float_beside_an_op_padding_rewrites():
    torch.manual_seed(8)
    models = [SlopeSoftmax(4, 0.1).double(), SlopeSoftmax(8, 0.3).double()]
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(6, 5, dtype=torch.float64)
    out = fused(x)
    assert fused.strategy == "fused"
    for i, m in enumerate(models):
        assert _relative(out[i], m(x)) <= 1e-12


class TopTwo(nn.Module):
    def __init__(self, hidden: int, how: str):
        super().__init__()
        self.how = how
        self.fc, self.out = nn.Linear(5, hidden), nn.Linear(2, 3)

    def forward(self, x):
        h = self.fc(x)
        top = (h.topk(2, dim=-1).values if self.how == "topk"
               else h.sort(-1, descending=True).values[..., :2])
        return self.out(top)


@pytest.mark.parametrize("how", ["topk", "sort"])
def test_an_op_padding_cannot_compute_is_refused_even_where_the_check_passes(how):
    """topk(2) over model 0's 4 units padded with 4 zeros picks a zero once fewer than
    two units are positive. Model 0's units all positive on the first call: the check
    passed there and hftc went on with padding's own refusal dropped; a later batch then
    gave model 0 wrong outputs (0.28 relative) without a word. Now refused on the first
    call, naming the op and the user's line."""
    torch.manual_seed(9)
    models = [TopTwo(4, how).double(), TopTwo(8, how).double()]
    with torch.no_grad():
        models[0].fc.bias.fill_(10.0)  # the first call: every unit of model 0 positive
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(UnsupportedOperatorError, match=f"cannot compute `{how}` in the root "
                       r"\(.*test_hunt_widths.py:\d+"):
        fused(x)


class ShiftedLinear(nn.Linear):
    """A Linear subclass whose own forward calls F.linear with a computed weight (its
    padded columns 1, not 0) on an input whose padding is sigmoid(0) = 0.5."""

    def forward(self, x):
        return F.linear(x, self.weight + 1.0, self.bias)


def test_f_linear_over_a_padded_dim_zeroes_the_inputs_padding():
    """F.linear contracts its input's last dim: the input's padding is zeroed first
    (as a matmul's), so the product is each model's own whatever the weight's padding.
    It also keeps a Linear subclass's forward from being refused now that an op padding
    cannot compute is refused even where the check passes."""
    torch.manual_seed(10)
    models = [nn.Sequential(nn.Linear(5, h), nn.Sigmoid(), ShiftedLinear(h, 3)).double()
              for h in (4, 8)]
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(6, 5, dtype=torch.float64)
    out = fused(x)
    out.square().sum().backward()
    params = dict(fused.named_parameters())
    for i, m in enumerate(models):
        want = m(x)
        assert _relative(out[i].detach(), want.detach()) <= 1e-12
        want.square().sum().backward()
        for name, p in m.named_parameters():
            got = fused.padding.unpad(i, name, params[name].grad[i])
            assert _relative(got, p.grad) <= 1e-12, (i, name)
