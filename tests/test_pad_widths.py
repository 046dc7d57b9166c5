"""``hftc.fuse(models, pad_widths=True)``: models that differ only in widths fuse into one
array, and each trains exactly as it does alone (hftc/module/padding.py).

Each model is compared with the same model trained alone with stock ``torch.optim``; dropout
draws are made constants on both sides (``ConstantRandomness``: every unit kept, scaled by
1 / (1 - p)), since the fused module's random draws are never the solo run's.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
import hftc.module.padding
from hftc.errors import FusionArgumentError, MismatchError, UnsupportedOperatorError
from hftc.lowering.check import ConstantRandomness, first_differing_op
from tests.optim_helpers import single_thread  # noqa: F401  (fixture)

# ---------------------------------------------------------------- models


def mlp(hidden: int, p: float = 0.1) -> nn.Module:
    return nn.Sequential(nn.Linear(20, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(p),
                         nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
                         nn.Dropout(p), nn.Linear(hidden, 5))


def cnn(channels: int) -> nn.Module:
    """pytorch/examples-style: conv, batch norm, conv, group norm (4 groups of any size)."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.GroupNorm(4, channels),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


class SelfAttention(nn.Module):
    """minGPT's causal self-attention, its q, k, v projections as three Linears."""

    def __init__(self, d_model: int, n_head: int, block_size: int, p: float):
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop, self.resid_drop = nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, block_size: int, p: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, block_size, p)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(p))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT's layout: token and position embeddings (nn.Embedding), blocks, ln_f, head."""

    def __init__(self, d_model: int, head_dim: int = 16, vocab: int = 11, block_size: int = 8,
                 p: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(p)
        self.blocks = nn.Sequential(*[Block(d_model, d_model // head_dim, block_size, p)
                                      for _ in range(2)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return self.head(self.ln_f(self.blocks(x)))


class RawPositions(nn.Module):
    """minGPT keeps its position embedding as the root's own parameter."""

    def __init__(self, d_model: int):
        super().__init__()
        self.pos_emb = nn.Parameter(torch.zeros(1, 8, d_model))
        self.head = nn.Linear(d_model, 3)

    def forward(self, x):
        return self.head(x + self.pos_emb)


def gpt(d_model: int) -> nn.Module:
    return GPT(d_model)


class Mixed(nn.Module):
    """Embedding (with padding_idx) -> Linear -> RMSNorm -> Conv1d -> BatchNorm1d -> head."""

    def __init__(self, widths: tuple[int, int]):
        super().__init__()
        d, h = widths
        self.emb = nn.Embedding(11, d, padding_idx=0)
        self.fc = nn.Linear(d, h)
        self.norm = nn.RMSNorm(h)
        self.conv = nn.Conv1d(h, h, 3, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm1d(h)
        self.head = nn.Linear(h, 5)

    def forward(self, idx):
        x = F.silu(self.norm(self.fc(self.emb(idx))))
        x = torch.relu(self.bn(self.conv(x.transpose(1, 2))))
        return self.head(x.mean(-1))


def tied_gpt(d_model: int) -> nn.Module:
    """nanoGPT ties the token embedding and the head (weight tying)."""
    model = GPT(d_model)
    model.head.weight = model.wte.weight
    return model


# ---------------------------------------------------------------- training


def _batches(kind: str, steps: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(6, 20, generator=g, dtype=dtype),
                 torch.randint(0, 5, (6,), generator=g)) for _ in range(steps)]
    if kind == "cnn":
        return [(torch.randn(4, 3, 6, 6, generator=g, dtype=dtype),
                 torch.randint(0, 10, (4,), generator=g)) for _ in range(steps)]
    if kind == "mixed":
        return [(torch.randint(0, 11, (4, 6), generator=g),
                 torch.randint(0, 5, (4,), generator=g)) for _ in range(steps)]
    return [(torch.randint(0, 11, (3, 8), generator=g),  # gpt, tied_gpt, encoder
             torch.randint(0, 11, (3, 8), generator=g)) for _ in range(steps)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, hftc.optim.SGD,
            lambda i: dict(lr=0.05 * (i + 1), momentum=0.9, weight_decay=1e-2)),
    "adam": (torch.optim.Adam, hftc.optim.Adam,
             lambda i: dict(lr=1e-2 * (i + 1), weight_decay=1e-3)),
}


def _train_alone(model: nn.Module, optimizer: str, index: int, batches) -> nn.Module:
    stock, _, kwargs = OPTIMIZERS[optimizer]
    opt = stock(model.parameters(), **kwargs(index))
    for x, y in batches:
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return model


def _train_fused(fused: hftc.FusedModule, optimizer: str, batches):
    _, fused_class, kwargs = OPTIMIZERS[optimizer]
    per_model = [kwargs(i) for i in range(fused.num_models)]
    opt = fused_class(fused.parameters(),
                      **{k: [d[k] for d in per_model] for k in per_model[0]})
    for x, y in batches:
        opt.zero_grad()
        out = fused(x)
        sum(_loss(out[i], y) for i in range(fused.num_models)).backward()
        opt.step()
    return opt


def _trains_as_alone(models, optimizer: str, batches) -> hftc.FusedModule:
    """Fuse ``models`` padded, train them and copies alone on ``batches``: every weight
    and buffer within 1e-9, the padding exactly 0; the fused module."""
    alone = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, pad_widths=True)
    opt = _train_fused(fused, optimizer, batches)
    for i, model in enumerate(alone):
        _train_alone(model, optimizer, i, batches)
        got = fused.model_state_dict(i)
        for name, want in model.state_dict().items():
            assert _relative(got[name], want) <= 1e-9, (i, name)
    _assert_padding_zero(fused, opt)
    return fused


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _assert_padding_zero(fused: hftc.FusedModule, opt) -> None:
    """Every padded entry of every parameter, buffer and optimizer state is exactly 0."""
    padding = fused.padding
    named = dict(fused.named_parameters(remove_duplicate=False)) | dict(
        fused.named_buffers(remove_duplicate=False))
    state_names = {id(p): n for n, p in fused.named_parameters()}
    checked = 0
    for name in padding.padded_shapes:
        param = named[name]
        real = padding.real_mask(name, param)
        if real is None:
            continue
        tensors = [param]
        if id(param) in state_names:
            tensors += [s for s in opt.state[param].values()
                        if torch.is_tensor(s) and s.shape == param.shape]
        for t in tensors:
            rest = t.detach() * (1 - real)
            assert torch.equal(rest, torch.zeros_like(rest)), name
            checked += 1
    assert checked


def encoder(d_model: int) -> nn.Module:
    """torch's own Transformer layer (nn.MultiheadAttention inside), head dim 16."""
    return nn.Sequential(
        nn.Embedding(11, d_model),
        nn.TransformerEncoderLayer(d_model, d_model // 16, 2 * d_model, dropout=0.0,
                                   batch_first=True),
        nn.Linear(d_model, 11))


FAMILIES = {"mlp": (mlp, [16, 48, 100, 128]), "cnn": (cnn, [8, 12, 16, 32]),
            "gpt": (gpt, [32, 64]), "tied_gpt": (tied_gpt, [32, 48, 64]),
            "mixed": (Mixed, [(8, 12), (16, 24), (12, 20)]), "encoder": (encoder, [32, 64])}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("family", ["mlp", "cnn", "gpt", "tied_gpt", "mixed", "encoder"])
def test_padded_models_train_as_alone(family, optimizer):
    """float64, 10 steps: each padded model's weights, buffers equal the model trained
    alone with stock torch.optim (<= 1e-9 relative); every padded entry (parameters,
    buffers, momentum / Adam moments) stays exactly zero; unfuse() gives back the widths."""
    build, widths = FAMILIES[family]
    torch.manual_seed(0)
    models = [build(w).double() for w in widths]
    alone = [copy.deepcopy(m) for m in models]
    batches = _batches(family, 10, torch.float64)
    with ConstantRandomness():
        fused = hftc.fuse(models, pad_widths=True)
        opt = _train_fused(fused, optimizer, batches)
        for i, model in enumerate(alone):
            _train_alone(model, optimizer, i, batches)
    assert fused.padding is not None and fused.fusion_report.fallbacks == []
    assert "pad_widths=True" in str(fused.fusion_report)
    _assert_padding_zero(fused, opt)
    for i, (back, want) in enumerate(zip(fused.unfuse(), alone)):
        assert type(back) is type(want)
        got, expected = back.state_dict(), want.state_dict()
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name].shape == expected[name].shape, (i, name)
            if optimizer == "adam" and name.endswith("in_proj_bias"):
                # The key bias's gradient is 0 in exact arithmetic (softmax ignores a
                # shift shared by all keys): rounding noise, which Adam scales to +-lr
                # in any two runs. The query and value biases are compared.
                e = expected[name].shape[0] // 3
                got[name], expected[name] = (torch.cat([t[:e], t[2 * e:]])
                                             for t in (got[name], expected[name]))
            if expected[name].is_floating_point():
                assert _relative(got[name], expected[name]) <= 1e-9, (i, name)
            else:
                assert torch.equal(got[name], expected[name]), (i, name)
        own, back_state = fused.model_state_dict(i), back.state_dict()
        assert all(torch.equal(own[k], back_state[k]) for k in expected)
    # a new program (eval mode) is checked against every original again, then runs
    fused.eval()
    x = batches[0][0]
    out = fused(x)
    for i, back in enumerate(fused.unfuse()):
        assert _relative(out[i], back(x)) <= 1e-12
    for original, back in zip(models, fused.unfuse()):
        assert [m.__class__ for m in original.modules()] == [m.__class__ for m in back.modules()]
        assert len(list(back.parameters())) == len(list(original.parameters()))  # ties kept


@pytest.mark.parametrize("family", ["mlp", "cnn", "gpt", "mixed"])
def test_float32_forward_backward(family):
    """float32, training mode: with real random draws the padded gradients are exactly
    zero; with the draws made constant, outputs and gradients are each model's own."""
    build, widths = FAMILIES[family]
    torch.manual_seed(1)
    models = [build(w) for w in widths]
    fused = hftc.fuse(models, pad_widths=True)
    x, _ = _batches(family, 1, torch.float32)[0]
    out = fused(x)  # random draws: padded gradients are still exactly zero
    out.square().sum().backward()
    for i, shapes in enumerate(fused.padding.shapes):
        for name, p in fused.named_parameters():
            rest = p.grad[i].clone()
            rest[tuple(slice(0, s) for s in shapes[name])] = 0
            assert torch.equal(rest, torch.zeros_like(rest)), (i, name)
    fused.zero_grad()
    with ConstantRandomness():
        out = fused(x)
        out.square().sum().backward()
        assert_each_models_float32(fused, models, out, lambda o: o.square().sum(), x)


def assert_each_models_float32(fused, models, out, loss, x) -> None:
    """float32: ``out[i]`` and the padded gradients (``fused``'s backward already taken),
    in model ``i``'s own units, are what model ``i`` alone gives for ``loss(model(x))``."""
    for i, model in enumerate(models):
        want = model(x)
        loss(want).backward()
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-5)
        grads = dict(model.named_parameters())
        for name, p in fused.named_parameters():
            torch.testing.assert_close(fused.padding.unpad(i, name, p.grad[i]),
                                       grads[name].grad, rtol=1e-3, atol=1e-5)


def test_eval_mode_batch_norm_running_statistics():
    """Eval mode: batch norm uses the running statistics, padded channels stay zero."""
    torch.manual_seed(2)
    models = [cnn(c).double().eval() for c in (8, 12)]
    for m in models:
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    out = fused(x)
    for i, m in enumerate(models):
        assert _relative(out[i], m(x)) <= 1e-12


def test_same_widths_pad_nothing():
    models = [mlp(16) for _ in range(2)]
    fused = hftc.fuse(models, pad_widths=True)
    assert fused.padding is None
    assert type(fused.padded_model(0)[0]) is nn.Linear
    # an int attribute that differs at one width (n_head at one d_model) is a
    # hyper-parameter, not a width: nothing is padded or changed
    padding = hftc.module.padding.pad_models([GPT(32, head_dim=16), GPT(32, head_dim=8)])[1]
    assert padding is None


def test_one_width_of_other_activations_pads_nothing():
    """Models of one width whose activations differ (a categorical ReLU / GELU choice),
    which the ordinary fusion puts in one array: pad_widths=True fuses them as it would
    (it once refused them with the padding's same-layers check, and a sweep with
    pad_widths = True failed every trial); another width among them splits, as before."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, h), act(), nn.Linear(h, 3)).double()
              for h, act in [(6, nn.ReLU), (6, nn.GELU), (5, nn.GELU)]]
    x = torch.randn(4, 8, dtype=torch.float64)
    fused = hftc.fuse(models[:2], pad_widths=True)
    assert fused.padding is None
    out = fused(x)
    for i in range(2):
        assert _relative(out[i], models[i](x)) <= 1e-12
    groups = hftc.fuse_groups(models, pad_widths=True, example_inputs=x)
    assert [indices for _, indices in groups] == [[0, 1], [2]]
    for f, indices in groups:
        for j, i in enumerate(indices):
            assert _relative(f(x)[j], models[i](x)) <= 1e-12


# ---------------------------------------------------------------- refusals


class SortOverHidden(nn.Module):
    """A sort over hidden units, which no mask makes exact (hftc.module.padding_graph computes a
    softmax or mean over the real units, given example_inputs)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.sort(torch.sigmoid(self.fc1(x)), dim=-1).values)


class SoftmaxOverHidden(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, hidden), nn.Linear(hidden, 3)

    def forward(self, x):
        return self.fc2(torch.softmax(self.fc1(x), dim=-1))


class HandWrittenNorms(nn.Module):
    """Ops of forward's own code over the hidden units: a hand-written layer norm (mean,
    var), a softmax after a sigmoid (its padded units are 0.5, not 0), a log_softmax and
    a sum."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        h = torch.sigmoid(self.fc1(x))
        h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, unbiased=False)
                                              + 1e-5).sqrt()
        h = self.fc2(torch.softmax(h, dim=-1) + 0.1 * h)
        scale = torch.tanh(h).sum(-1, keepdim=True)
        return self.head(F.log_softmax(h, dim=1) * scale)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ops_over_a_padded_dim_are_computed_over_the_real_units(optimizer):
    """The first call finds the ops that mix across a padded dim, rewrites them to take
    each model's real units (hftc.module.padding_graph.compute_over_real_units) and runs; 10 steps: every
    model equals itself trained alone, the padding stays exactly 0."""
    torch.manual_seed(4)
    models = [HandWrittenNorms(h).double() for h in (8, 12, 16)]
    alone = [copy.deepcopy(m) for m in models]
    batches = _batches("mlp", 10, torch.float64)
    batches = [(x[:, :6], y % 4) for x, y in batches]
    fused = _trains_as_alone(models, optimizer, batches)
    for i, model in enumerate(alone):
        _train_alone(model, optimizer, i, batches)
    x = batches[0][0]
    out = fused(x)
    for i, back in enumerate(fused.unfuse()):
        assert type(back) is HandWrittenNorms
        assert _relative(out[i], back(x)) <= 1e-12
    # the models keep their own widths through keep_models after the rewrite
    hftc.keep_models(fused, [2, 0])
    out = fused(x)
    assert _relative(out[1], alone[0](x)) <= 1e-9


def test_a_float32_softmax_over_hidden_units():
    torch.manual_seed(5)
    models = [SoftmaxOverHidden(h) for h in (8, 16)]
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(3, 4)
    out = fused(x)
    out.square().sum().backward()
    for i, model in enumerate(models):
        want = model(x)
        want.square().sum().backward()
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)
        grads = dict(fused.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(fused.padding.unpad(i, name, grads[name].grad[i]),
                                       p.grad, rtol=1e-4, atol=1e-6)


def test_op_mixing_a_padded_dim_is_refused_on_the_first_call():
    fused = hftc.fuse([SortOverHidden(8), SortOverHidden(16)], pad_widths=True)
    with pytest.raises(UnsupportedOperatorError, match=r"cannot compute `sort` in the root"):
        fused(torch.randn(2, 4))
    with pytest.raises(UnsupportedOperatorError, match=r"cannot compute `sort` in the root"):
        hftc.fuse([SortOverHidden(8), SortOverHidden(16)], pad_widths=True,
                  example_inputs=(torch.randn(2, 4),))


class PackedAttention(nn.Module):
    """minGPT's CausalSelfAttention: q, k, v from one packed Linear, split."""

    def __init__(self, d_model: int):
        super().__init__()
        self.n_embd, self.n_head = d_model, d_model // 16
        self.c_attn, self.c_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_packed_q_k_v_split_trains_as_alone(optimizer):
    """minGPT's c_attn(x).split(n_embd, 2) at d_model 32 and 64, head dim 16, rewritten
    at the first call (no example_inputs): 10 steps, each model as alone."""
    torch.manual_seed(7)
    models = [nn.Sequential(nn.Linear(5, d), PackedAttention(d), nn.Linear(d, 3)).double()
              for d in (32, 64)]
    g = torch.Generator().manual_seed(8)
    batches = [(torch.randn(2, 6, 5, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (2, 6), generator=g)) for _ in range(10)]
    _trains_as_alone(models, optimizer, batches)


def test_the_locating_message_names_the_op():
    """Where the ops cannot be rewritten (forward not traceable by torch.fx alone), the
    first-call refusal still names the op that mixes."""
    original, padded = SoftmaxOverHidden(8), SoftmaxOverHidden(16)
    with torch.no_grad():
        padded.fc1.weight.zero_()
        padded.fc1.weight[:8] = original.fc1.weight
        padded.fc1.bias.zero_()
        padded.fc1.bias[:8] = original.fc1.bias
        padded.fc2.weight.zero_()
        padded.fc2.weight[:, :8] = original.fc2.weight
        padded.fc2.bias.copy_(original.fc2.bias)
    where = first_differing_op(original, padded, [torch.randn(2, 4)])
    assert re.search(r"^the op `softmax` \(.*test_pad_widths.py:\d+ in forward: `.*softmax.*`\)$",
                     where), where
    # the original against itself: nothing differs, nothing is named
    assert first_differing_op(original, original, [torch.randn(2, 4)]) == ""


def test_outputs_of_different_widths_are_refused():
    models = [nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(4, 16))]
    fused = hftc.fuse(models, pad_widths=True)
    with pytest.raises(MismatchError, match=r"pad_widths=True refused: model 0's .*shape"):
        fused(torch.randn(2, 4))


def test_multihead_attention_of_other_head_dims_is_refused():
    models = [nn.Sequential(nn.TransformerEncoderLayer(d, 2, 2 * d)) for d in (32, 64)]
    with pytest.raises(UnsupportedOperatorError,
                       match=r"model 0's module `0.self_attn` \(MultiheadAttention\): the "
                             r"models' head dims differ \(\[16, 32\]\)"):
        hftc.fuse(models, pad_widths=True)


def test_multihead_attention_pads_q_k_v_block_by_block():
    """in_proj_weight [3 e, e] is padded as three blocks: model 0's q, k, v rows lead
    each block of the widest model's."""
    models = [encoder(d).double() for d in (32, 64)]
    fused = hftc.fuse(models, pad_widths=True)
    weight = dict(fused.named_parameters())["1.self_attn.in_proj_weight"][0]
    own = models[0][1].self_attn.in_proj_weight
    for b in range(3):
        assert torch.equal(weight[64 * b:64 * b + 32, :32], own[32 * b:32 * (b + 1)])
        assert not weight[64 * b + 32:64 * (b + 1)].any() and not weight[:, 32:].any()
    assert torch.equal(fused.model_state_dict(0)["1.self_attn.in_proj_weight"], own)
    bias = dict(fused.named_parameters())["1.self_attn.in_proj_bias"][0]
    own_bias = models[0][1].self_attn.in_proj_bias
    assert torch.equal(bias.view(3, 64)[:, :32], own_bias.view(3, 32))
    assert not bias.view(3, 64)[:, 32:].any()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_raw_parameter_of_another_width_is_padded(optimizer):
    """minGPT's pos_emb, the model's own nn.Parameter: padded, its gradient masked."""
    torch.manual_seed(9)
    models = [RawPositions(d).double() for d in (32, 64)]
    with torch.no_grad():
        for m in models:
            m.pos_emb.normal_()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 8, 1, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (2, 8), generator=g)) for _ in range(5)]
    _trains_as_alone(models, optimizer, batches)


def test_grouped_conv_widths_are_refused():
    models = [nn.Sequential(nn.Conv2d(4, c, 3, groups=2)) for c in (4, 8)]
    with pytest.raises(UnsupportedOperatorError, match=r"`0` \(Conv2d\): groups=2"):
        hftc.fuse(models, pad_widths=True)


def test_other_layers_are_refused():
    with pytest.raises(MismatchError, match=r"model 1's modules differ from model 0's at `2`"):
        hftc.fuse([nn.Sequential(nn.Linear(4, 8), nn.ReLU()),
                   nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))],
                  pad_widths=True)


def test_pad_widths_needs_the_check():
    with pytest.raises(FusionArgumentError, match="pad_widths=True needs check=True"):
        hftc.fuse([mlp(8), mlp(16)], pad_widths=True, check=False)
    with pytest.raises(FusionArgumentError, match="pad_widths must be True or False"):
        hftc.fuse([mlp(8), mlp(16)], pad_widths="yes")


def test_keep_models_keeps_each_models_widths():
    torch.manual_seed(3)
    models = [mlp(h).double() for h in (16, 48, 100)]
    fused = hftc.fuse(models, pad_widths=True)
    x = torch.randn(4, 20, dtype=torch.float64)
    hftc.keep_models(fused, [2, 0])
    assert [m[0].out_features for m in fused.unfuse()] == [100, 16]
    with ConstantRandomness():
        out = fused(x)
        for j, i in enumerate((2, 0)):
            assert _relative(out[j], models[i](x)) <= 1e-12
    assert fused.fusion_report.padding is not None


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stock_optimizers_convert_at_their_own_widths(optimizer):
    """fuse_optimizers takes the original models' stepped optimizers (their state padded
    with zeros), unfuse_optimizers gives each back at its own widths, and training on
    continues exactly as alone."""
    torch.manual_seed(4)
    models = [mlp(h, p=0.0).double() for h in (16, 48)]
    stock, _, kwargs = OPTIMIZERS[optimizer]
    batches = _batches("mlp", 4, torch.float64)
    opts = [stock(m.parameters(), **kwargs(i)) for i, m in enumerate(models)]
    for (x, y) in batches[:2]:
        for m, o in zip(models, opts):
            o.zero_grad()
            _loss(m(x), y).backward()
            o.step()
    alone = [copy.deepcopy(m) for m in models]
    alone_opts = [stock(m.parameters(), **kwargs(i)) for i, m in enumerate(alone)]
    for o, a in zip(opts, alone_opts):
        a.load_state_dict(o.state_dict())
    fused = hftc.fuse(models, pad_widths=True)
    opt = hftc.optim.fuse_optimizers(fused, opts)
    for x, y in batches[2:]:
        opt.zero_grad()
        out = fused(x)
        sum(_loss(out[i], y) for i in range(2)).backward()
        opt.step()
        for m, o in zip(alone, alone_opts):
            o.zero_grad()
            _loss(m(x), y).backward()
            o.step()
    _assert_padding_zero(fused, opt)
    back = fused.unfuse()
    back_opts = hftc.optim.unfuse_optimizers(fused, opt, back)
    for m, o, want_m, want_o in zip(back, back_opts, alone, alone_opts):
        for (name, p), q in zip(m.named_parameters(), want_m.parameters()):
            assert _relative(p, q) <= 1e-9, name
            for key, value in want_o.state[q].items():
                if torch.is_tensor(value) and value.dim():
                    assert _relative(o.state[p][key], value) <= 1e-9, (name, key)


# ---------------------------------------------------------------- fuse_groups: pad or split


def test_fuse_groups_pads_near_widths_and_splits_far_ones():
    """fuse_groups(pad_widths=True): widths whose padding costs little share one array,
    far ones go apart, each array says why; every model's outputs are its own."""
    torch.manual_seed(5)
    widths = [64, 64, 96, 128, 512, 512]
    models = [nn.Sequential(nn.Linear(32, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                            nn.Linear(w, 4)).double() for w in widths]
    # largest first: [512, 512] + 128 is 1.45x the arithmetic, + 96 would be 1.89x;
    # [96] + 64 + 64 is 1.49x
    groups = hftc.fuse_groups(models, pad_widths=True, max_padding=1.5)
    assert [indices for _, indices in groups] == [[0, 1, 2], [3, 4, 5]]
    small, large = groups[0][0], groups[1][0]
    assert small.padding is not None and large.padding is not None
    assert "2 widths padded into one array: 1.49x" in small.grouping
    assert "2 widths padded into one array: 1.45x" in large.grouping
    assert "padding them in would be 1.89x (> max_padding=1.5)" in large.grouping
    groups_apart = hftc.fuse_groups(models, pad_widths=True, max_padding=1.2)
    assert [indices for _, indices in groups_apart] == [[0, 1], [2], [3], [4, 5]]
    assert groups_apart[0][0].padding is None
    x = torch.randn(5, 32, dtype=torch.float64)
    for fused, indices in groups:
        out = fused(x)
        for j, i in enumerate(indices):
            assert _relative(out[j], models[i](x)) <= 1e-12
    # today's grouping (no padding): one array per width
    assert len(hftc.fuse_groups(models)) == 4
    # a budget that takes every width: one array
    [(one, indices)] = hftc.fuse_groups(models, pad_widths=True, max_padding=10)
    assert indices == list(range(6)) and "4 widths" in one.grouping


def test_fuse_groups_splits_widths_that_cannot_be_padded():
    def grouped(channels):
        return nn.Sequential(nn.Conv2d(4, channels, 3, groups=2))

    groups = hftc.fuse_groups([grouped(4), grouped(4), grouped(8)], pad_widths=True,
                              max_padding=2)
    assert [indices for _, indices in groups] == [[0, 1], [2]]
    assert all("not padded with the other widths" in f.grouping and "groups=2" in f.grouping
               for f, _ in groups)
    with pytest.raises(FusionArgumentError, match="max_padding must be a number >= 1"):
        hftc.fuse_groups([mlp(8)], pad_widths=True, max_padding=0.5)


def test_norms_without_affine_parameters_take_the_models_dtype():
    """Norms without parameters have their width only in attributes (normalized_shape,
    num_features): padded too; RMSNorm(eps=None) takes float64's eps, as alone."""
    torch.manual_seed(6)
    models = [nn.Sequential(nn.Linear(4, h), nn.RMSNorm(h, elementwise_affine=False),
                            nn.LayerNorm(h, elementwise_affine=False),
                            nn.BatchNorm1d(h, affine=False, track_running_stats=False),
                            nn.Linear(h, 2)).double()
              for h in (3, 6)]
    fused = hftc.fuse(models, pad_widths=True)
    assert fused.padded_model(0)[1].eps == torch.finfo(torch.float64).eps
    x = torch.randn(5, 4, dtype=torch.float64) * 1e-7  # where eps shows
    out = fused(x)
    for i, m in enumerate(models):
        assert _relative(out[i], m(x)) <= 1e-9


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stock_optimizer_state_of_attention_goes_in_block_by_block(optimizer):
    """Stepped stock optimizers fused into a padded array with nn.MultiheadAttention: the
    momentum / moments of in_proj go into each q, k, v block, and come back out the same
    (unfuse_optimizers); then training goes on as alone."""
    torch.manual_seed(6)
    models = [encoder(d).double() for d in (32, 64)]
    batches = _batches("gpt", 4, torch.float64)
    stock_cls, _, kwargs = OPTIMIZERS[optimizer]
    stocks = [stock_cls(m.parameters(), **kwargs(i)) for i, m in enumerate(models)]
    for model, opt in zip(models, stocks):
        for x, y in batches[:2]:
            opt.zero_grad()
            _loss(model(x), y).backward()
            opt.step()
    alone = [copy.deepcopy(m) for m in models]
    alone_opts = [stock_cls(m.parameters(), **kwargs(i)) for i, m in enumerate(alone)]
    for a, opt in zip(alone_opts, stocks):
        a.load_state_dict(opt.state_dict())
    fused = hftc.fuse(models, pad_widths=True)
    fused_opt = hftc.optim.fuse_optimizers(fused, stocks)
    name = "1.self_attn.in_proj_weight"
    param = dict(fused.named_parameters())[name]
    state_key = "momentum_buffer" if optimizer == "sgd" else "exp_avg"
    own = stocks[0].state[models[0][1].self_attn.in_proj_weight][state_key]
    assert torch.equal(fused.padding.unpad(0, name, fused_opt.state[param][state_key][0]), own)
    back = hftc.optim.unfuse_optimizers(fused, fused_opt)
    back_state = back[0].state_dict()["state"]
    index = [n for n, _ in models[0].named_parameters()].index(name)
    assert torch.equal(back_state[index][state_key], own)
    for x, y in batches[2:]:
        fused_opt.zero_grad()
        out = fused(x)
        sum(_loss(out[i], y) for i in range(2)).backward()
        fused_opt.step()
    for i, (model, opt) in enumerate(zip(alone, alone_opts)):
        for x, y in batches[2:]:
            opt.zero_grad()
            _loss(model(x), y).backward()
            opt.step()
        got = fused.model_state_dict(i)
        for key, want in model.state_dict().items():
            if optimizer == "adam" and key.endswith("in_proj_bias"):
                e = want.shape[0] // 3  # the key bias: rounding noise under Adam (above)
                got_k, want = torch.cat([got[key][:e], got[key][2 * e:]]), torch.cat(
                    [want[:e], want[2 * e:]])
            else:
                got_k = got[key]
            assert _relative(got_k, want) <= 1e-9, (i, key)


def test_a_refused_padded_program_names_the_module_and_the_op(monkeypatch):
    """Where no rewrite helps, the refusal says where the padded program parts from the
    original model: the first module whose output differs on the model's own units (the
    one locate_difference of the first-call check) and the op of forward's own code."""
    import hftc.module.programs as programs

    monkeypatch.setattr(programs, "compute_over_real_units",
                        lambda originals, padded, args: padded)  # no rewrite helps
    torch.manual_seed(0)
    fused = hftc.fuse([SoftmaxOverHidden(8), SoftmaxOverHidden(16)], pad_widths=True)
    with pytest.raises(MismatchError) as caught:
        fused(torch.randn(2, 4))
    message = str(caught.value)
    assert "pad_widths=True refused" in message
    assert "the first module whose output differs is module `fc2` (Linear)" in message, message
    assert re.search(r"the first op of forward's own code that differs on the model's own "
                     r"units is the op `softmax` \(.*test_pad_widths.py:\d+ in forward: ",
                     message), message


def test_ops_over_a_padded_dim_are_computed_before_the_check(monkeypatch):
    """The pass over forward runs on the first call before the first-call check: the
    program the check compares is the one that runs (never refused, then rebuilt)."""
    import hftc.module.programs as programs

    checks = []
    real = programs.compare_with_models

    def recorded(*args, **kwargs):
        checks.append(real(*args, **kwargs))
        return checks[-1]

    monkeypatch.setattr(programs, "compare_with_models", recorded)
    torch.manual_seed(0)
    models = [SoftmaxOverHidden(8), SoftmaxOverHidden(16)]
    fused = hftc.fuse(copy.deepcopy(models), pad_widths=True)
    x = torch.randn(2, 4)
    out = fused(x)
    assert checks and all(c.passed for c in checks)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
