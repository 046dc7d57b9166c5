"""Real-style architectures (tests/hunt_models_zoo.py: timm's ConvNeXt and DropPath,
transformers' T5 ...) fused with per-model hyper-parameters kept where real code keeps them.

- timm's ``drop_path`` at each model's own rate (``x.new_empty(shape).bernoulli_(keep)``,
  ``random_tensor.div_(keep)``) fuses: each model draws its mask at its own rate and scales
  by its own ``1 / keep`` (it was a MismatchError; the draw into the shared ``new_empty``
  took model 0's rate for every model once the rate could differ).
- T5's ``if self.weight.dtype in [torch.float16, torch.bfloat16]`` in forward: the trace
  error says to pass example_inputs (torch.export follows it), not that nothing can.
- A per-model float in ``x.pow(self.p)`` or ``x.clamp(min=self.lo, max=self.hi)`` fuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from equivalence import check_equivalence
from hunt_models_zoo import (
    BertConfig,
    BertModel,
    CheckpointedMLP,
    ConvNeXt,
    DropPath,
    LlamaConfig,
    LlamaForCausalLM,
    Swin,
    T5Encoder,
)

import hftc
from hftc.errors import FusionWarning, MismatchError, RaggedResultError, TraceError
from hftc.lowering.check import ConstantRandomness

DTYPES = [torch.float64, torch.float32]
RATES = [0.1, 0.5, 0.8]


def test_drop_path_draws_each_model_at_its_own_rate():
    fused = hftc.fuse([DropPath(p) for p in RATES])
    x = torch.ones(20000, 3, dtype=torch.float64)
    out = fused(x)
    assert fused.fusion_report.fallbacks == []
    for i, p in enumerate(RATES):
        dropped = (out[i] == 0).double().mean().item()
        assert abs(dropped - p) < 0.02, (i, p, dropped)   # 20000 draws: sd < 0.004
        kept = out[i][out[i] != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)), rtol=0, atol=0)
        # a sample is dropped whole (timm's shape (B, 1, ...))
        assert ((out[i] == 0).all(1) | (out[i] != 0).all(1)).all()
    fused.eval()
    torch.testing.assert_close(fused(x), x.expand(3, -1, -1))


class OwnMask(nn.Module):
    """A mask drawn into a tensor of the model's own (not a shared new_empty)."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.empty_like(self.fc(x)).bernoulli_(1 - self.p)


def test_bernoulli_into_a_per_model_tensor_at_per_model_rates():
    fused = hftc.fuse([OwnMask(p) for p in RATES])
    masks = fused(torch.randn(20000, 4))
    assert fused.fusion_report.fallbacks == []
    for i, p in enumerate(RATES):
        assert abs((masks[i] == 0).double().mean().item() - p) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_convnext_per_model_drop_path_and_layer_scale(dtype):
    """Forward, backward and two SGD steps, with every draw made a constant on both sides
    (each mask keeps all: the per-model 1 / keep scales are compared exactly)."""
    models = [ConvNeXt(drop_path_rate=p, ls_init_value=ls) for p, ls in zip(RATES, [0.5, 0.1, 1.0])]
    x = torch.randn(2, 3, 8, 8)
    with ConstantRandomness():
        fused = check_equivalence(models, x, dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []
    check_equivalence(models, x, dtype=dtype, train=False)


def test_t5_dtype_branch_points_to_example_inputs():
    models = [T5Encoder(eps=eps) for eps in (1e-6, 1e-3, 1e-5)]
    ids = torch.randint(1, 19, (2, 6))
    with pytest.raises(TraceError) as info:
        hftc.fuse(models)(ids)
    message = str(info.value)
    assert "self.weight.dtype" in message and "hunt_models_zoo.py" in message
    assert "example_inputs=(...)" in message and "neither" not in message

    def fuser(ms, in_dims=None):
        return hftc.fuse(ms, in_dims=in_dims, example_inputs=(ids,))

    for dtype in DTYPES:
        check_equivalence(models, ids, dtype=dtype, fuser=fuser)


@pytest.mark.parametrize("repeat_interleave", [False, True])
def test_llama_gqa_rope_per_model_eps(repeat_interleave):
    models = [LlamaForCausalLM(LlamaConfig(rms_norm_eps=eps), repeat_interleave)
              for eps in (1e-6, 1e-3)]
    check_equivalence(models, torch.randint(0, 29, (2, 6)), steps=2)


class GeM(nn.Module):
    """timm's generalized-mean pooling at a per-model exponent."""

    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p, self.eps = p, eps
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x = self.conv(x)
        x = F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), (x.size(-2), x.size(-1)))
        return x.pow(1.0 / self.p).flatten(1)


class Clipped(nn.Module):
    """Bounds kept on the module, by position and by keyword (an RL value clip)."""

    def __init__(self, lo=-1.0, hi=1.0):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = x.clamp(self.lo, self.hi)
        return torch.clamp(self.fc(h), min=self.lo, max=self.hi) + torch.clip(h, max=self.hi)[:, :5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_model_exponent_and_clamp_bounds_fuse(dtype):
    """A per-model float in pow's exponent or clamp's bounds fuses, as a per-model scale
    does (they were a MismatchError)."""
    fused = check_equivalence([GeM(p) for p in (3.0, 2.0, 4.0)], torch.randn(2, 3, 6, 6),
                              dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []
    fused = check_equivalence([Clipped(lo, hi) for lo, hi in ((-1.0, 1.0), (-0.2, 0.3))],
                              torch.randn(5, 6), dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []


class EMAHead(nn.Module):
    """A linear head centred by an EMA of its outputs, updated in forward at the model's own
    decay, written as ``lerp_`` or as ``mul_(d).add_(y, alpha=1 - d)`` (DINO's centre)."""

    def __init__(self, decay=0.99, lerp=True):
        super().__init__()
        self.decay, self.lerp = decay, lerp
        self.fc = nn.Linear(6, 4)
        self.register_buffer("center", torch.zeros(4))

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            with torch.no_grad():
                if self.lerp:
                    self.center.lerp_(y.mean(0), 1 - self.decay)
                else:
                    self.center.mul_(self.decay).add_(y.mean(0), alpha=1 - self.decay)
        return y - self.center


@pytest.mark.parametrize("lerp", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ema_buffer_at_per_model_decay(lerp, dtype):
    """The buffer of each model moves at its own decay (was a MismatchError on lerp_'s
    weight / add_'s alpha); the buffers are compared after every forward."""
    models = [EMAHead(d, lerp) for d in (0.99, 0.9, 0.5)]
    fused = check_equivalence(models, torch.randn(5, 6), dtype=dtype, steps=3)
    assert fused.fusion_report.fallbacks == []
    check_equivalence(models, torch.randn(5, 6), dtype=dtype, train=False)


class GrowingRotary(nn.Module):
    """transformers 4.3x's LlamaRotaryEmbedding: the cos/sin cache re-registered, longer,
    when a call is longer than the cache."""

    def __init__(self, dim=8, max_position_embeddings=8, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        freqs = torch.outer(torch.arange(seq_len, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x):
        seq_len = x.shape[1]
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return x * self.cos_cached[:seq_len] + x.flip(-1) * self.sin_cached[:seq_len]


def test_a_cache_grown_in_forward_names_the_buffer_first():
    """A longer call than the exported one: neither the fused program nor the loop can keep
    the longer buffer. The error leads with the buffer forward re-registers and the fix
    (it led with the fused check's generic 'isinstance(x, torch.Tensor) ...' causes)."""
    models = [nn.Sequential(nn.Linear(8, 8), GrowingRotary(base=b)) for b in (1e4, 500.0)]
    short = torch.randn(2, 6, 8)
    fused = hftc.fuse(models, example_inputs=(short,), strategy="auto")
    torch.testing.assert_close(fused(short)[1], models[1](short))
    with pytest.raises(TraceError) as info:
        fused(torch.randn(2, 12, 8))
    message = str(info.value)
    assert message.startswith("The models can run neither fused nor one by one")
    assert "`1.cos_cached` anew ([12, 8] torch.float32" in message
    assert "largest size in __init__" in message
    assert message.index("anew") < message.index("isinstance")


def test_prelu_init_sweep_fuses():
    """Conv-TasNet's PReLU at a per-model initial slope: only the weights differ (``init`` is
    read by reset_parameters alone), so the models fuse (was a MismatchError on `init`)."""
    models = [nn.Sequential(nn.Conv1d(1, 4, 3), nn.PReLU(4, init=a), nn.Conv1d(4, 2, 1))
              for a in (0.25, 0.1, 0.5)]
    fused = check_equivalence(models, torch.randn(2, 1, 16), steps=2)
    assert fused.fusion_report.fallbacks == []
    fused = hftc.fuse(models)
    for alone, a in zip(fused.unfuse(), (0.25, 0.1, 0.5)):
        assert alone[1].init == a      # each model's own attribute, as its weights
        torch.testing.assert_close(alone[1].weight, torch.full((4,), a))


@pytest.mark.parametrize("make, n_inputs", [
    (lambda: nn.MultiheadAttention(8, 2, batch_first=True), 3),
    (lambda: nn.LSTM(8, 4, batch_first=True), 1),
    (lambda: nn.BatchNorm1d(5), 1),
])
def test_a_bare_torch_module_is_told_to_pass_example_inputs(make, n_inputs):
    """hftc.fuse([nn.MultiheadAttention(...), ...]): torch's own forward, which symbolic
    tracing cannot follow and the user cannot rewrite. The error says to pass example_inputs
    or to hold the module in a model of one's own (for MultiheadAttention it said that
    neither symbolic tracing nor torch.export could follow it, and to rewrite forward)."""
    models = [make() for _ in range(2)]
    x = (torch.randn(2, 5, 8),) * n_inputs
    cls = type(models[0]).__name__
    with pytest.raises(TraceError) as info:
        hftc.fuse(models)(*x)
    message = str(info.value)
    assert f"torch.nn's own {cls}" in message and "example_inputs=(...)" in message
    assert f"self.layer = nn.{cls}(...)" in message and "neither" not in message

    def fuser(ms, in_dims=None):  # the harness's float64 copies: float64 example inputs
        return hftc.fuse(ms, in_dims=in_dims, example_inputs=tuple(t.double() for t in x))

    check_equivalence(models, x, fuser=fuser, check_input_grads=False)


class TableLookup(nn.Module):
    """A table indexed by a per-model index buffer, and a shared table by a per-model one."""

    def __init__(self, perm):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 3))
        self.register_buffer("index", torch.tensor(perm).view(2, 3))
        self.register_buffer("shared", torch.arange(18.0).view(6, 3))

    def forward(self, x):
        return x @ self.table[self.index].sum(0).t() + self.shared[self.index[0]].sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexing_with_a_per_model_index_buffer_fuses(dtype):
    """Swin's relative_position_bias_table[relative_position_index.view(-1)]: each model's
    rows of its own table, fused (it ran model by model: 'indexing with per-model index
    tensors'), with the index buffer differing per model too."""
    fused = check_equivalence([Swin(attn_drop=0.0) for _ in range(3)], torch.randn(2, 3, 8, 8),
                              dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []
    models = [TableLookup(p) for p in ([0, 1, 2, 3, 4, 5], [5, 5, -1, 0, 2, 2], [1, 0, 3, 3, 3, 4])]
    fused = check_equivalence(models, torch.randn(4, 3), dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []


class CheckpointedPair(nn.Module):
    """A reentrant checkpoint of a function returning a tuple, then a head outside it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def pair(self, x):
        return torch.tanh(self.a(x)), self.b(x)

    def forward(self, x):
        h, g = torch.utils.checkpoint.checkpoint(self.pair, x, use_reentrant=True)
        return self.head(h * g)


@pytest.mark.parametrize("make", [lambda: CheckpointedMLP(use_reentrant=True), CheckpointedPair])
def test_reentrant_checkpoint_without_input_grad_trains_as_torch_does(make):
    """torch's reentrant checkpoint gives the checkpointed layers no gradient where no input
    requires grad (with its warning); the fused program gave them one, so training with an
    optimizer diverged from the models' own (the blocks moved, stock's did not)."""
    models = [make() for _ in range(3)]
    x = torch.randn(5, 6)                       # a data batch: no grad
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        fused = check_equivalence(models, x, steps=3, check_input_grads=False)
    inside = [n for n, _ in models[0].named_parameters() if not n.startswith("head")]
    assert inside and all(fused.get_parameter(n).grad is None for n in inside)
    assert fused.get_parameter("head.weight").grad is not None
    check_equivalence(models, x, steps=2)       # an input that requires grad: all train


class Gated(nn.Module):
    """A per-model temperature and threshold kept on the module (a sparse gate)."""

    def __init__(self, temperature=1.0, threshold=0.0):
        super().__init__()
        self.temperature, self.threshold = temperature, threshold
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x) / self.temperature
        return h * (h > self.threshold) + (h <= -self.threshold).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_model_threshold_fuses(dtype):
    """``h > self.threshold`` at a per-model float fuses (was a MismatchError)."""
    models = [Gated(t, c) for t, c in ((1.0, 0.0), (2.0, 0.5), (0.5, -0.1))]
    fused = check_equivalence(models, torch.randn(8, 6), dtype=dtype, steps=2)
    assert fused.fusion_report.fallbacks == []


def test_per_model_int_constants_are_told_to_be_floats():
    """``x / self.temperature`` with temperatures 1 and 2.5 (or 1 and 2): the error names
    the values, not the matcher's '<per-model scalar>' stand-in, and says to make them
    floats, with which they fuse."""
    for temps in ((1, 2.5), (1, 2)):
        with pytest.raises(MismatchError) as info:
            hftc.fuse([Gated(t) for t in temps])
        message = str(info.value)
        assert "<per-model scalar>" not in message
        assert f"argument 1: {temps[1]!r} vs {temps[0]!r}" in message
        assert f"make them {float(temps[1])!r} and {float(temps[0])!r}" in message
        assert "test_hunt_models.py" in message and "self.temperature" in message
    check_equivalence([Gated(float(t)) for t in (1, 2)], torch.randn(8, 6))


class BertMaskFromHidden(BertModel):
    """The extended attention mask built from the hidden states' dtype (older BERT ports)."""

    def forward(self, input_ids, attention_mask):
        h = self.embeddings(input_ids)
        ext = self.get_extended_attention_mask(attention_mask, h.dtype)
        for layer in self.layer:
            h = layer(h, ext)
        return h


def test_finfo_of_a_traced_dtype_says_what_to_do():
    """``torch.finfo(h.dtype).min`` in forward: torch's TypeError ('requires a floating point
    input type. Use torch.iinfo') now comes with the fix, and the model fuses either way."""
    ids, mask = torch.randint(1, 23, (2, 6)), torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    models = [BertMaskFromHidden(BertConfig(layer_norm_eps=e)) for e in (1e-12, 1e-5)]
    with pytest.raises(TraceError) as info:
        hftc.fuse(models)(ids, mask)
    message = str(info.value)
    assert "torch.finfo(dtype).min" in message and "hunt_models_zoo.py" in message
    assert "next(self.parameters()).dtype" in message and "example_inputs=(...)" in message

    def fuser(ms, in_dims=None):
        return hftc.fuse(ms, in_dims=in_dims, example_inputs=(ids, mask))

    check_equivalence(models, (ids, mask), fuser=fuser)
    check_equivalence([BertModel(BertConfig(layer_norm_eps=e)) for e in (1e-12, 1e-5)],
                      (ids, mask))   # transformers' way: the parameters' dtype


class SizeScaled(nn.Module):
    """timm-style scale from a size and a per-model number, computed before the tensor."""

    def __init__(self, t):
        super().__init__()
        self.t = t
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        scale = x.shape[-1] ** -0.5 / self.t
        return self.fc(x) * scale


def test_a_per_model_number_in_size_arithmetic_is_never_model_0s():
    """``x.shape[-1] ** -0.5 / self.t`` is a Python number per model. The fused program
    computed it with model 0's t for every model: with check=False model 1's output was
    wrong, and the check's warning blamed isinstance checks. Now that op runs per model:
    a RaggedResultError (check=False) or the models one by one, with a warning naming the
    op and the fix; written tensor first it fuses."""
    models, x = [SizeScaled(t) for t in (1.0, 3.0)], torch.randn(3, 4)
    with pytest.raises(RaggedResultError, match=r"`truediv` returned different Python values "
                                                r"for different models \(\[0.5, 0.1666"):
        hftc.fuse(models, check=False, strategy="fused")(x)
    fused = hftc.fuse(models)
    with pytest.warns(FusionWarning, match=r"model's own number in arithmetic on a size.*"
                                           r"the tensor first"):
        out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    assert fused.plan.chosen == "model_loop"


class ScaledAttention(nn.Module):
    """Attention at a per-model softmax scale (a muP sweep: 1 / d against 1 / sqrt(d))."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_model_attention_scale_fuses_around_sdpa(dtype):
    """F.scaled_dot_product_attention(..., scale=self.scale) at per-model scales was a
    MismatchError; now the models fuse and only the attention call runs per model."""
    models = [ScaledAttention(s) for s in (0.25, 0.5, 1.0)]
    fused = check_equivalence(models, torch.randn(2, 5, 8), dtype=dtype, steps=2)
    assert [r.reason for r in fused.fusion_report.fallbacks] == ["a per-model attention scale"]
