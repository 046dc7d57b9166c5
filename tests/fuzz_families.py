"""More random architectures for the fuzzer: the layers real models have beyond fuzz_models'.

Two more families, drawn as plain-data specs like :mod:`fuzz_models`' and built by
:class:`FamilyNet` (``FamilyNet(spec, i)`` is model i: some hyper-parameters differ per
model where ``spec["per_model"]``):

- ``tokens``: token ids ``[B, T]`` (an Embedding, with or without ``padding_idx``), and
  sometimes a second float input ``[B, D]`` (a context vector added to every position);
  then recurrent layers (RNN / LSTM / GRU, batch-first or not, 1-2 layers,
  bidirectional), ``nn.MultiheadAttention`` (causal mask or none, attention weights
  returned or not), minGPT-style attention through ``F.scaled_dot_product_attention``
  (``is_causal``), linears with in-place ops on their outputs (``relu_``, ``add_``,
  ``mul_``), layer norms, dropout, and a buffer the forward writes (an EMA of the
  activations, under ``torch.no_grad()`` or of a detached value, and a call counter).  Several outputs: a dict of the head's output and the
  last recurrent state or attention weights, or a tuple.
- ``grid``: 1-d, 2-d or 3-d maps ``[B, C, *S]``: convs, transposed convs (stride,
  output padding), ``nn.Upsample`` (nearest, (bi/tri)linear), batch norms, in-place
  activations, pooling; a mean over space and a linear head.

:func:`mutate` changes one structural thing of a spec (a width, a layer's kind, a kernel,
a layer more): models built from a spec and its mutation must be refused with an
``hftc.errors`` class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn


def dropout_p(base: float, i: int, per_model: bool) -> float:
    """Model i's dropout rate (per-model settings: what hftc fuses, each model its own)."""
    return min(0.9, base + 0.1 * i) if per_model and base > 0 else base


def _eps(i: int, per_model: bool) -> float:
    return 1e-5 * (1 + 3 * i) if per_model else 1e-5


def _slope(i: int, per_model: bool) -> float:
    return 0.01 + 0.05 * i if per_model else 0.01


GRID_ACTS = ["relu", "relu_", "leaky_relu", "elu", "gelu", "tanh_"]


@st.composite
def token_spec(draw):
    d = draw(st.sampled_from([4, 6, 8, 12, 32]))
    vocab = draw(st.integers(3, 12))
    spec = {"family": "tokens", "vocab": vocab, "d": d,
            "batch": draw(st.integers(1, 3)), "time": draw(st.integers(1, 6)),
            "padding_idx": draw(st.sampled_from([None, 0, 2])),
            "context": draw(st.booleans()), "per_model": draw(st.booleans()),
            "output": draw(st.sampled_from(["dict", "tuple", "tensor"])), "layers": []}
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["rnn", "rnn", "mha", "sdpa", "inplace", "norm", "dropout",
                                     "ema"]))
        if kind == "rnn":
            hidden = draw(st.sampled_from([2, 3, 5, 8]))
            bidirectional = draw(st.booleans())
            spec["layers"].append(("rnn", draw(st.sampled_from(["RNN", "LSTM", "GRU"])), d,
                                   hidden, draw(st.integers(1, 2)), bidirectional,
                                   draw(st.booleans()), draw(st.booleans())))
            d = hidden * (2 if bidirectional else 1)
        elif kind == "mha":
            heads = draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0]))
            spec["layers"].append(("mha", d, heads, draw(st.booleans()), draw(st.booleans()),
                                   draw(st.booleans()), draw(st.booleans())))
        elif kind == "sdpa":
            heads = draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0]))
            spec["layers"].append(("sdpa", d, heads, draw(st.booleans())))
        elif kind == "inplace":
            out = draw(st.sampled_from([d, d, 33]))
            spec["layers"].append(("inplace", d, out, draw(st.sampled_from(["relu_", "add_",
                                                                           "mul_"]))))
            d = out
        elif kind == "norm":
            spec["layers"].append(("layer_norm", d))
        elif kind == "dropout":
            spec["layers"].append(("dropout", draw(st.sampled_from([0.1, 0.3, 0.5]))))
        elif kind == "ema":
            spec["layers"].append(("ema", d, draw(st.booleans())))
    spec["head"] = (d, draw(st.integers(1, 4)))
    return spec


@st.composite
def grid_spec(draw):
    dims = draw(st.sampled_from([1, 2, 2, 3]))
    c = draw(st.integers(1, 4))
    size = draw(st.integers(2, 6)) if dims < 3 else draw(st.integers(2, 4))
    spec = {"family": "grid", "dims": dims, "input": (draw(st.integers(1, 3)), c) + (size,) * dims,
            "per_model": draw(st.booleans()), "layers": []}
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["conv", "convT", "convT", "upsample", "norm", "act",
                                     "pool"]))
        if kind == "conv":
            out = draw(st.sampled_from([1, 2, 3, 5, 17]))
            k = draw(st.sampled_from([1, 3])) if size >= 3 else 1
            spec["layers"].append(("conv", c, out, k, k // 2, draw(st.booleans())))
            c = out
        elif kind == "convT" and dims < 3 or kind == "convT" and size <= 3:
            out = draw(st.sampled_from([1, 2, 3, 5]))
            k = draw(st.sampled_from([1, 2, 3]))
            stride = draw(st.sampled_from([1, 2]))
            padding = draw(st.sampled_from([0, 1])) if k > 1 and size > 1 else 0
            output_padding = draw(st.sampled_from([0, 1])) if stride == 2 else 0
            groups = draw(st.sampled_from([g for g in (1, 2) if c % g == 0 and out % g == 0]))
            spec["layers"].append(("convT", c, out, k, stride, padding, output_padding, groups))
            size = (size - 1) * stride - 2 * padding + k + output_padding
            c = out
        elif kind == "upsample" and size <= 6:
            linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[dims]
            mode = draw(st.sampled_from(["nearest", linear]))
            align = draw(st.booleans()) if mode != "nearest" else None
            spec["layers"].append(("upsample", mode, align))
            size *= 2
        elif kind == "norm" and spec["input"][0] * size ** dims > 1:
            spec["layers"].append(("batch", c, dims))
        elif kind == "act":
            act = draw(st.sampled_from(GRID_ACTS))
            if act == "relu_" and (not spec["layers"] or spec["layers"][-1][0] == "act"):
                # Not in place on the caller's input (torch refuses a leaf's), nor on an
                # output whose own backward reads it (relu, tanh: eager fails too).
                act = "relu"
            spec["layers"].append(("act", act))
        elif kind == "pool" and size >= 2:
            spec["layers"].append(("pool", dims, draw(st.sampled_from(["max", "avg"]))))
            size //= 2
    spec["head"] = (c, draw(st.integers(1, 4)))
    return spec


families = st.one_of(token_spec(), grid_spec())


def exportable(spec: dict) -> dict:
    """``spec`` without ``no_grad`` blocks in forward, which the export front-end refuses
    (docs/API.md): its EMAs update from detached values instead."""
    if spec["family"] != "tokens":
        return spec
    return {**spec, "layers": [("ema", layer[1], False) if layer[0] == "ema" else layer
                               for layer in spec["layers"]]}


def spec_inputs(spec: dict, n: int, stacked: tuple[bool, ...], generator=None) -> tuple:
    """Random inputs for ``spec``: ids (and a context vector) with a model dim where stacked."""
    if spec["family"] == "grid":
        lead = (n,) if stacked[0] else ()
        return (torch.randn(lead + tuple(spec["input"]), generator=generator),)
    lead = (n,) if stacked[0] else ()
    ids = torch.randint(0, spec["vocab"], lead + (spec["batch"], spec["time"]),
                        generator=generator)
    if not spec["context"]:
        return (ids,)
    lead = (n,) if stacked[1] else ()
    return ids, torch.randn(lead + (spec["batch"], spec["d"]), generator=generator)


class _Attention(nn.Module):
    """minGPT's CausalSelfAttention, with F.scaled_dot_product_attention."""

    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` of a sequence with itself, batch-first or not, under a
    causal mask (a buffer, as minGPT keeps its mask) or none."""

    def __init__(self, d: int, heads: int, bias: bool, batch_first: bool, causal: bool,
                 weights: bool, time: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, bias=bias, batch_first=batch_first)
        self.batch_first, self.causal, self.weights = batch_first, causal, weights
        self.register_buffer("mask", torch.ones(time, time, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x):
        seq = x if self.batch_first else x.transpose(0, 1)
        out, attn = self.attn(seq, seq, seq, attn_mask=self.mask if self.causal else None,
                              need_weights=self.weights)
        return (out if self.batch_first else out.transpose(0, 1)), attn


class _Ema(nn.Module):
    """A layer with buffers its forward writes: an EMA of its input and a call counter."""

    def __init__(self, d: int, under_no_grad: bool):
        super().__init__()
        self.register_buffer("ema", torch.zeros(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.under_no_grad = under_no_grad

    def forward(self, x):
        if self.training:
            if self.under_no_grad:
                with torch.no_grad():
                    self.ema.mul_(0.9).add_(0.1 * x.mean((0, 1)))
            else:
                self.ema.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
            self.calls += 1
        return x - self.ema


class FamilyNet(nn.Module):
    """Model ``index`` of a :func:`token_spec` / :func:`grid_spec` spec."""

    def __init__(self, spec: dict, index: int = 0):
        super().__init__()
        self.spec = spec
        per_model = spec.get("per_model", False)
        self.layers = nn.ModuleList()
        if spec["family"] == "tokens":
            self.embed = nn.Embedding(spec["vocab"], spec["d"], padding_idx=spec["padding_idx"])
            if spec["context"]:
                self.context = nn.Linear(spec["d"], spec["d"])
        for layer in spec["layers"]:
            self.layers.append(self._build(layer, index, per_model, spec.get("dims", 1),
                                           spec.get("time", 1)))
        self.head = nn.Linear(*spec["head"])
        for m in self.modules():  # off the identity map (see fuzz_models.FuzzNet)
            if isinstance(m, (nn.LayerNorm, nn.modules.batchnorm._NormBase)) and m.weight is not None:
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.normal_(m.bias)

    @staticmethod
    def _build(layer, i: int, per_model: bool, dims: int, time: int) -> nn.Module:
        kind = layer[0]
        if kind == "rnn":
            _, cell, d, hidden, num_layers, bidirectional, batch_first, bias = layer
            return getattr(nn, cell)(d, hidden, num_layers, bias=bias, batch_first=batch_first,
                                     bidirectional=bidirectional)
        if kind == "mha":
            _, d, heads, bias, batch_first, causal, weights = layer
            return _SelfAttention(d, heads, bias, batch_first, causal, weights, time)
        if kind == "sdpa":
            return _Attention(layer[1], layer[2], layer[3])
        if kind == "inplace":
            return nn.Linear(layer[1], layer[2])
        if kind == "layer_norm":
            return nn.LayerNorm(layer[1], eps=_eps(i, per_model))
        if kind == "dropout":
            return nn.Dropout(dropout_p(layer[1], i, per_model))
        if kind == "ema":
            return _Ema(layer[1], layer[2])
        if kind == "conv":
            _, c, out, k, padding, bias = layer
            return getattr(nn, f"Conv{dims}d")(c, out, k, padding=padding, bias=bias)
        if kind == "convT":
            _, c, out, k, stride, padding, output_padding, groups = layer
            return getattr(nn, f"ConvTranspose{dims}d")(
                c, out, k, stride=stride, padding=padding, output_padding=output_padding,
                groups=groups)
        if kind == "upsample":
            _, mode, align = layer
            return nn.Upsample(scale_factor=2, mode=mode, align_corners=align)
        if kind == "batch":
            _, c, dims = layer
            return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1](
                c, eps=_eps(i, per_model), momentum=0.1 + (0.1 * i if per_model else 0))
        if kind == "act":
            name = layer[1]
            return {"relu": nn.ReLU(), "relu_": nn.ReLU(inplace=True),
                    "leaky_relu": nn.LeakyReLU(_slope(i, per_model)),
                    "elu": nn.ELU(1.0 + (0.25 * i if per_model else 0)), "gelu": nn.GELU(),
                    "tanh": nn.Tanh(),
                    "tanh_": nn.Identity(), "softmax": nn.Softmax(dim=1)}[name]
        if kind == "pool":
            _, dims, pool = layer
            return getattr(nn, f"{'Max' if pool == 'max' else 'Avg'}Pool{dims}d")(2)
        raise ValueError(kind)

    def forward(self, ids, context=None):
        if self.spec["family"] == "grid":
            return self._grid_forward(ids)
        x = self.embed(ids)
        if self.spec["context"]:
            x = x + self.context(context).unsqueeze(1)
        aux = None
        for layer, module in zip(self.spec["layers"], self.layers):
            kind = layer[0]
            if kind == "rnn":
                batch_first = layer[6]
                seq = x if batch_first else x.transpose(0, 1)
                out, state = module(seq)
                x = out if batch_first else out.transpose(0, 1)
                aux = state[0] if layer[1] == "LSTM" else state
            elif kind == "mha":
                out, attn = module(x)
                x = x + out
                if layer[6]:  # need_weights (else attn is None, which tracing cannot see)
                    aux = attn
            elif kind == "inplace":
                h = module(x)
                op = layer[3]
                if op == "relu_":
                    h.relu_()
                elif op == "add_" and layer[1] == layer[2]:
                    h.add_(x)
                elif op == "mul_":
                    h.mul_(torch.sigmoid(h.detach()) + 0.5)
                else:
                    h.add_(1.0)
                x = h
            else:
                x = module(x)
        y = self.head(x.mean(1))
        if self.spec["output"] == "tensor" or aux is None:
            return y
        if self.spec["output"] == "dict":
            return {"logits": y, "aux": aux}
        return y, aux

    def _grid_forward(self, x):
        for layer, module in zip(self.spec["layers"], self.layers):
            if layer[0] == "act" and layer[1] == "tanh_":
                x = (x * 1.5).tanh_()  # in place on a tensor forward made
            else:
                x = module(x)
        return self.head(x.flatten(2).mean(2))


def build(spec: dict, index: int = 0) -> nn.Module:
    """Model ``index`` of ``spec`` (either module of specs)."""
    if spec["family"] in ("tokens", "grid"):
        return FamilyNet(spec, index)
    from fuzz_models import FuzzNet

    return FuzzNet(spec, index)


def _act(spec: dict, name: str) -> tuple:
    return ("act", name) if spec["family"] == "grid" else ("act", name, 1)


@st.composite
def mutated(draw, specs=families):
    """``(spec, mutation, what)``: the mutation differs from ``spec`` in one structural
    thing (``what``): a layer's width, one layer more, a softmax where ``spec`` has an
    activation (another activation fuses: tests/test_differing_ops.py), a vocabulary."""
    spec = draw(specs)
    other = {**spec, "layers": list(spec["layers"])}
    choices = ["width", "extra", "act"] + (["vocab"] if spec["family"] == "tokens" else [])
    what = draw(st.sampled_from(choices))
    if what == "vocab":
        other["vocab"] = spec["vocab"] + 1
    elif what == "width":  # the head's output features
        head = list(spec["head"])
        at = 1 if spec["family"] in ("tokens", "grid") else 2
        head[at] += 1
        other["head"] = tuple(head)
    elif what == "extra":
        other["layers"].append(_act(spec, "gelu"))
    else:  # the same depth, another function, not one that may differ per model
        spec = {**spec, "layers": spec["layers"] + [_act(spec, "gelu")]}
        other["layers"].append(_act(spec, "softmax"))
    return spec, other, what
