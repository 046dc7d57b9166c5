"""Attention fused across models: MultiheadAttention, SDPA, the nn.Transformer family.

Every case is the equivalence harness (fused vs a loop over the originals,
float64, forward + every gradient), plus structure checks: attention is one
fused op, never run model by model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence

import hftc

N = 3
E, H = 8, 2


def _no_loops(fused) -> None:
    assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)


# --------------------------------------------------------------------------- MultiheadAttention


class _Attend(nn.Module):
    """Cross attention with every mask and both weight modes."""

    def __init__(self, batch_first: bool, **kwargs):
        super().__init__()
        self.att = nn.MultiheadAttention(E, H, batch_first=batch_first, **kwargs)

    def forward(self, q, k, v, kpm, am):
        a, w = self.att(q, k, v, key_padding_mask=kpm, attn_mask=am)
        b, w2 = self.att(q, k, v, need_weights=True, average_attn_weights=False)
        c, _ = self.att(q, k, v, key_padding_mask=kpm, need_weights=False)
        return a, w, b, w2, c


MHA_CASES = [dict(), dict(kdim=6, vdim=5), dict(bias=False),
             dict(add_bias_kv=True, add_zero_attn=True), dict(dropout=0.3)]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kwargs", MHA_CASES, ids=lambda k: ",".join(k) or "default")
def test_multihead_attention(batch_first, kwargs):
    L, S, B = 4, 5, 3
    shape = (lambda n: (B, n)) if batch_first else (lambda n: (n, B))
    q = torch.randn(*shape(L), E)
    k = torch.randn(*shape(S), kwargs.get("kdim", E))
    v = torch.randn(*shape(S), kwargs.get("vdim", E))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -2:] = True
    am = torch.randn(L, S)
    models = [_Attend(batch_first, **kwargs) for _ in range(N)]
    # dropout draws differ from the loop's: compare in eval mode only
    modes = [False] if kwargs.get("dropout") else [True, False]
    for train in modes:
        fused = check_equivalence(models, (q, k, v, kpm, am), train=train)
        _no_loops(fused)
        assert fused.fusion_report.rule_counts()["fuse_multihead_attention"] == 3


class _SelfAttend(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.att = nn.MultiheadAttention(E, H, batch_first=batch_first)

    def forward(self, x, kpm, am):
        y, w = self.att(x, x, x, key_padding_mask=kpm, attn_mask=am)
        z, _ = self.att(x, x, x, attn_mask=am, is_causal=True, need_weights=False)
        return y, w, z


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_stacked_inputs_and_masks(batch_first):
    """Inputs and masks stacked per model (in_dims=0), causal hint, float key padding."""
    L, B = 5, 2
    x = torch.randn(N, *((B, L) if batch_first else (L, B)), E)
    kpm = torch.zeros(N, B, L)
    kpm[1, 0, -1] = float("-inf")
    causal = nn.Transformer.generate_square_subsequent_mask(L).expand(N, L, L).clone()
    models = [_SelfAttend(batch_first) for _ in range(N)]
    fused = check_equivalence(models, (x, kpm, causal), in_dims=0)
    _no_loops(fused)


def test_attention_3d_mask_and_unbatched_input():
    L, B = 4, 2

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(E, H)

        def forward(self, x, mask3, x1, kpm1):
            a, wa = self.att(x, x, x, attn_mask=mask3)
            b, wb = self.att(x1, x1, x1, key_padding_mask=kpm1)  # unbatched: [L, E]
            return a, wa, b, wb

    x, x1 = torch.randn(L, B, E), torch.randn(L, E)
    mask3 = torch.randn(B * H, L, L)
    kpm1 = torch.tensor([False, False, True, False])
    fused = check_equivalence([M() for _ in range(N)], (x, mask3, x1, kpm1))
    _no_loops(fused)


# --------------------------------------------------------------------------- SDPA


class _Sdpa(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, E // H).permute(2, 0, 3, 1, 4)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        three_d = F.scaled_dot_product_attention(q[:, 0], k[:, 0], v[:, 0])
        return causal, masked, three_d


def test_scaled_dot_product_attention():
    B, T = 2, 5
    x = torch.randn(B, T, E)
    mask = torch.rand(B, 1, T, T) > 0.3  # shared by all models, per batch entry
    mask[..., 0] = True
    fused = check_equivalence([_Sdpa() for _ in range(N)], (x, mask))
    _no_loops(fused)
    counts = fused.fusion_report.rule_counts()
    assert counts["fuse_scaled_dot_product_attention"] == 3


def test_sdpa_dropout_draws_per_model():
    """Shared q, k, v with dropout: each model draws its own mask (no shared result)."""

    class M(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)

    q = torch.randn(2, 4, 6, 8)
    fused = hftc.fuse([M() for _ in range(N)])
    out = fused(q)
    assert out.shape == (N, 2, 4, 6, 8)
    assert not torch.allclose(out[0], out[1])


# --------------------------------------------------------------------------- Transformer family


class EncoderLM(nn.Module):
    """A Transformer encoder language model over padded batches."""

    def __init__(self, vocab=20, norm_first=False, batch_first=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, E, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(16, E) * 0.1)
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0,
                                           norm_first=norm_first, batch_first=batch_first,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(E),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(E, vocab)
        self.batch_first = batch_first

    def forward(self, ids, pad_mask):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        if not self.batch_first:
            x = x.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.encoder(x, mask=causal, src_key_padding_mask=pad_mask)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_language_model(norm_first, batch_first):
    ids = torch.randint(1, 20, (3, 6))
    ids[0, 4:] = 0
    pad = ids == 0
    models = [EncoderLM(norm_first=norm_first, batch_first=batch_first) for _ in range(N)]
    for train in (True, False):
        fused = check_equivalence(models, (ids, pad), train=train)
        _no_loops(fused)
        counts = fused.fusion_report.rule_counts()
        assert counts["fuse_multihead_attention"] == 2
        assert counts.get("loop", 0) == 0


class Seq2Seq(nn.Module):
    """An encoder-decoder nn.Transformer over padded sources with a causal target mask."""

    def __init__(self, norm_first=False):
        super().__init__()
        self.src_embed = nn.Linear(4, E)
        self.tgt_embed = nn.Linear(4, E)
        self.transformer = nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=16, dropout=0.0, batch_first=True,
                                          norm_first=norm_first)
        self.out = nn.Linear(E, 4)

    def forward(self, src, tgt, src_pad):
        t = tgt.shape[1]
        mask = self.transformer.generate_square_subsequent_mask(t)
        h = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=mask,
                             src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                             tgt_is_causal=True)
        return self.out(h)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_transformer(norm_first):
    src, tgt = torch.randn(2, 6, 4), torch.randn(2, 5, 4)
    src_pad = torch.zeros(2, 6, dtype=torch.bool)
    src_pad[1, -2:] = True
    models = [Seq2Seq(norm_first) for _ in range(N)]
    fused = check_equivalence(models, (src, tgt, src_pad))
    _no_loops(fused)
    assert fused.fusion_report.rule_counts()["fuse_multihead_attention"] == 6
    check_equivalence(models, (src, tgt, src_pad), train=False)


@pytest.mark.parametrize("final_norm", [False, True], ids=["no_norm", "final_norm"])
def test_encoder_nested_tensor_fast_path_zeros_are_kept(final_norm):
    """Eval + no_grad + padding mask: PyTorch's encoder returns zeros at padded positions
    (nested tensors), then its final norm (padded rows: norm(0), the norm's bias); the
    fused encoder returns what each original returns (it normed, then zeroed)."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    # (each model its own final norm: one LayerNorm given to all N would be one parameter
    # the models share, which hftc refuses)
    models = [nn.TransformerEncoder(layer, num_layers=2,
                                    norm=nn.LayerNorm(E) if final_norm else None).eval()
              for _ in range(N)]
    for m in models:
        for p in m.parameters():
            nn.init.normal_(p)
    x = torch.randn(3, 5, E)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    fused = hftc.fuse(models)
    with torch.no_grad():
        fused(x, src_key_padding_mask=pad)  # checked on a mask that pads nothing
        pad[0, 3:] = True
        out = fused(x, src_key_padding_mask=pad)  # the same program
        refs = [m(x, src_key_padding_mask=pad) for m in models]
    for i, (m, ref) in enumerate(zip(models, refs)):
        padded_row = m.norm.bias if final_norm else torch.zeros(E)
        assert torch.equal(ref[0, 3], padded_row)  # the fast path was taken by the original
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)
    # with autograd on, neither takes it
    out = fused(x, src_key_padding_mask=pad)
    ref = models[1](x, src_key_padding_mask=pad)
    assert not (ref[0, 3:] == 0).all()
    torch.testing.assert_close(out[1], ref, rtol=1e-5, atol=1e-5)


class ViT(nn.Module):
    """A ViT-style classifier: conv patch embedding, class token, encoder, head."""

    def __init__(self, classes=5, patch=4):
        super().__init__()
        self.patch = nn.Conv2d(3, E, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, E) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 5, E) * 0.1)
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, classes)

    def forward(self, img):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def test_vit_classifier():
    img = torch.randn(2, 3, 8, 8)
    fused = check_equivalence([ViT() for _ in range(N)], img)
    _no_loops(fused)
    check_equivalence([ViT() for _ in range(N)], torch.randn(N, 2, 3, 8, 8), in_dims=0,
                      train=False)


class SdpaDropout(nn.Module):
    """Attention dropout as Hugging Face models pass it to SDPA."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_per_model_attention_dropout_rate_in_sdpa(frontend):
    """A sweep over the attention dropout rate (attention_probs_dropout_prob) raised a
    MismatchError: torch records dropout_p=0.0 as no argument at all. The rate may differ
    per model: in training the SDPA runs model by model, each with its own rate."""
    x = torch.randn(2, 5, 8)
    models = [SdpaDropout(p) for p in (0.0, 0.5, 0.0)]
    fused = hftc.fuse(models, frontend=frontend, example_inputs=(x,))  # compiled, training
    assert [r.node for r in fused.fusion_report.fallbacks] == ["scaled_dot_product_attention"]
    out = fused(x)
    torch.testing.assert_close(out[0], models[0](x))  # rate 0: exact
    torch.testing.assert_close(out[2], models[2](x))
    torch.testing.assert_close(fused.eval()(x), torch.stack([m.eval()(x) for m in models]))
    assert not torch.allclose(out[1], models[1](x))  # rate 0.5: dropped, unlike eval


class _BroadcastKeys(nn.Module):
    """SDPA with per-model queries [B, H, L, D] and keys/values broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(self.wq(q), self.wk(k), v)


@pytest.mark.parametrize("shape", [(1, 2, 5, 4), (2, 5, 4), (5, 4)], ids=str)
def test_sdpa_keys_broadcast_over_the_batch(shape):
    # A [1, H, S, D] or [H, S, D] key crashed in a bare size error; a per-model [S, D]
    # key was folded as [N*S, D]: each model attended over every model's keys.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(*shape), torch.randn(*shape)
    check_equivalence([_BroadcastKeys() for _ in range(3)], (q, k, v), steps=2)


class _Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_decoder_layer_with_a_module_activation():
    # TransformerDecoderLayer.__setstate__ puts F.relu in front of a module activation on
    # every deep copy: fusing crashed ("`activation` is not an nn.Module"), and a copy
    # would have run ReLU.  (Copies made here by hand: the harness deep-copies.)
    torch.manual_seed(0)
    models = [nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, activation=_Swish())
              for _ in range(2)]
    tgt, memory = torch.randn(4, 3, 8), torch.randn(5, 3, 8)
    fused = hftc.fuse(models)
    out = fused(tgt, memory)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(tgt, memory))
        back = fused.unfuse_model(i)
        assert isinstance(back.activation, _Swish)
        torch.testing.assert_close(back(tgt, memory), m(tgt, memory))
