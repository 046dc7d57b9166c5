"""Random architectures built from every supported rule, for property-based fuzzing.

A hypothesis strategy draws an architecture *spec* (plain data: a list of layer
tuples with their hyper-parameters), keeping track of shapes so every spec is a
valid model; :class:`FuzzNet` builds it.  Two families:

- images ``[B, C, H, W]``: convs (stride, padding incl. 'same', padding modes,
  groups, bias, 1x1 to 5x5), batch/group/instance norm, activations, residual blocks,
  channel concatenation, pooling, dropout, in-place ops, then a flatten head and linears;
- sequences ``[B, T, D]``: linears, layer/RMS norm, activations, residual adds,
  conv1d through a transpose, softmax attention-like mixing with bmm, log-softmax,
  dropout, in-place ops, reductions.

Shapes are mostly tiny, and sometimes large enough for each size-gated kernel of
hftc/runtime (linear outputs >= 32, >= 16 input channels per group, a 2-d max pool of
>= 65,536 elements, softmax rows under one SIMD vector over >= 2,048 elements).
``spec["per_model"]``: model i has its own dropout rates, norm eps / momentum, LeakyReLU
slopes and ELU alphas (``FuzzNet(spec, i)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

DROPOUT_RATES = st.sampled_from([0.0, 0.1, 0.5])

ACTIVATIONS = ["relu", "gelu", "tanh", "silu", "leaky_relu", "elu", "sigmoid", "hardswish",
               "relu6", "prelu", "softplus", "identity"]


def _activation(name: str, channels: int, index: int = 0) -> nn.Module:
    """``index``: model i of a spec with per-model settings (0: the defaults)."""
    return {
        "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU,
        "leaky_relu": lambda: nn.LeakyReLU(0.1 + 0.05 * index),
        "elu": lambda: nn.ELU(1.0 + 0.25 * index), "sigmoid": nn.Sigmoid,
        "hardswish": nn.Hardswish, "relu6": nn.ReLU6, "prelu": lambda: nn.PReLU(channels),
        "softplus": nn.Softplus, "identity": nn.Identity,
        "softmax": lambda: nn.Softmax(dim=1),  # (only fuzz_families.mutated's: not elementwise)
    }[name]()


#: Layers whose output an in-place op may change: a fresh tensor (or a view of one) that
#: their own backward does not read (a ReLU's, a softmax's does: eager fails too).
_FRESH_OUTPUTS = {"conv", "batch", "instance", "group", "residual", "concat", "pool", "linear",
                  "layer", "rms", "seq_residual", "conv1d", "mix", "scale"}


def _may_modify_in_place(spec: dict) -> bool:
    return bool(spec["layers"]) and spec["layers"][-1][0] in _FRESH_OUTPUTS


@st.composite
def image_spec(draw):
    # Mostly small; sometimes wide and large enough for the size-gated kernels (a max pool
    # of >= 65,536 stacked elements pools channels-last; >= 16 input channels per group
    # is past oneDNN's channel block).
    large = draw(st.integers(0, 3)) == 0
    c = draw(st.integers(1, 4)) if not large else draw(st.sampled_from([4, 16, 17]))
    h = w = draw(st.integers(4, 9)) if not large else draw(st.sampled_from([16, 23]))
    batch = draw(st.integers(1, 3)) if not large else draw(st.integers(2, 4))
    spec = {"family": "image", "input": (batch, c, h, w), "layers": [],
            "per_model": draw(st.booleans())}
    for j in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["conv", "conv", "norm", "act", "residual", "concat",
                                     "pool", "dropout", "inplace"]))
        if large and j == 0:
            kind = draw(st.sampled_from(["pool", "conv"]))  # the pool before it shrinks
        if kind == "conv":
            groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
            # Mostly narrow; sometimes as wide as oneDNN's channel blocks (8, 16) and past them.
            out = groups * draw(st.sampled_from([1, 2, 3, 1, 2, 3, 8, 17]))
            # 5x5 over <= 8 input channels per group: the cost model's channels-last conv;
            # Cin * k * k <= 32 of a shared input: im2col.
            k = draw(st.sampled_from([1, 2, 3, 5] if h >= 5 else [1, 2, 3]))
            stride = draw(st.sampled_from([1, 2])) if h >= 4 else 1
            padding = draw(st.sampled_from([0, 1, "same"])) if stride == 1 else draw(
                st.sampled_from([0, 1]))
            if padding == 0 and h < k:
                padding = k // 2
            mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "circular", "replicate"]))
            if mode == "reflect" and (padding == "same" and k > h or padding == 1 and h < 2):
                mode = "zeros"
            bias = draw(st.booleans())
            spec["layers"].append(("conv", c, out, k, stride, padding, groups, mode, bias))
            pad = (k - 1) if padding == "same" else 2 * padding
            h = w = (h + pad - k) // stride + 1
            c = out
        elif kind == "norm":
            # torch refuses to normalise a single value: keep every norm well-posed.
            batch = spec["input"][0]
            options = [n for n, ok in (("batch", batch * h * w > 1), ("instance", h * w > 1),
                                       ("group", h * w > 1)) if ok]
            if not options:
                continue
            norm = draw(st.sampled_from(options))
            if norm == "group":
                groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
                spec["layers"].append(("group", c, groups))
            else:
                spec["layers"].append((norm, c, draw(st.booleans())))
        elif kind == "act":
            spec["layers"].append(("act", draw(st.sampled_from(ACTIVATIONS)), c))
        elif kind == "residual":
            spec["layers"].append(("residual", c, draw(st.sampled_from(ACTIVATIONS))))
        elif kind == "concat":
            spec["layers"].append(("concat", draw(st.sampled_from(ACTIVATIONS)), c))
            c = 2 * c
        elif kind == "pool" and h >= 2:
            pool = draw(st.sampled_from(["max", "avg", "fmax", "adaptive"]))
            spec["layers"].append(("pool", pool))
            h = w = 1 if pool == "adaptive" else h // 2
        elif kind == "dropout":
            spec["layers"].append(("dropout", draw(DROPOUT_RATES)))
        elif kind == "inplace" and _may_modify_in_place(spec):
            spec["layers"].append(("inplace",))
    head = draw(st.sampled_from(["view", "flatten", "mean", "adaptive"]))
    features = c if head in ("mean", "adaptive") else c * h * w
    if features > 4096:  # a flatten of a large map: pool it first
        head, features = "mean", c
    hidden = draw(st.sampled_from([2, 3, 5, 8, 32, 40]))  # outputs >= 32: another product
    spec["head"] = (head, features, hidden, draw(st.integers(1, 4)),
                    draw(st.sampled_from(ACTIVATIONS)))
    return spec


@st.composite
def sequence_spec(draw):
    # Sometimes long enough for the short-row softmax (rows under one SIMD vector, >= 2,048
    # stacked elements, float32) and wide enough for the linears' other product (>= 32).
    large = draw(st.integers(0, 3)) == 0
    d = draw(st.integers(2, 6)) if not large else draw(st.sampled_from([3, 7, 32]))
    batch, time = (draw(st.integers(1, 3)), draw(st.integers(1, 5))) if not large else (
        draw(st.integers(4, 8)), draw(st.sampled_from([12, 33])))
    spec = {"family": "sequence", "input": (batch, time, d), "layers": [],
            "per_model": draw(st.booleans())}
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["linear", "linear", "norm", "act", "residual", "conv1d",
                                     "mix", "scale", "log_softmax", "log_softmax", "dropout",
                                     "inplace"]))
        if kind == "linear":
            out = draw(st.sampled_from([2, 3, 4, 5, 6, 32, 33]))
            spec["layers"].append(("linear", d, out, draw(st.booleans())))
            d = out
        elif kind == "norm":
            spec["layers"].append((draw(st.sampled_from(["layer", "rms"])), d))
        elif kind == "act":  # PReLU's channel dim is dim 1 (T here): one shared slope
            spec["layers"].append(("act", draw(st.sampled_from(ACTIVATIONS)), 1))
        elif kind == "residual":
            spec["layers"].append(("seq_residual", d))
        elif kind == "conv1d":
            spec["layers"].append(("conv1d", d, draw(st.sampled_from([1, 3]))))
        elif kind == "mix":
            spec["layers"].append(("mix", d))
        elif kind == "scale":
            spec["layers"].append(("scale", d))
        elif kind == "log_softmax":
            spec["layers"].append(("log_softmax",))
        elif kind == "dropout":
            spec["layers"].append(("dropout", draw(DROPOUT_RATES)))
        elif kind == "inplace" and _may_modify_in_place(spec):
            spec["layers"].append(("inplace",))
    spec["head"] = ("seq", d, draw(st.integers(1, 4)), draw(st.sampled_from(["mean", "max", "last"])))
    return spec


architectures = st.one_of(image_spec(), sequence_spec())


def without_dropout(spec: dict) -> dict:
    """``spec`` with every dropout's rate 0: in training, hftc draws each model's mask
    itself (docs/API.md), never the loop's, so exact comparisons leave dropout out (its
    rates and masks are tests/test_fuzz_families.py's)."""
    return {**spec, "layers": [(layer[0], 0.0) if layer[0] == "dropout" else layer
                               for layer in spec["layers"]]}


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


class FuzzNet(nn.Module):
    """A model built from a spec; its forward interprets the spec (unrolled by tracing).

    ``FuzzNet(spec, i)`` is model i: where ``spec["per_model"]``, its dropout rates, norm
    eps and momentum, LeakyReLU slopes and ELU alphas are its own (what hftc fuses with
    each model keeping its value)."""

    def __init__(self, spec: dict, index: int = 0):
        super().__init__()
        self.spec = spec
        i = index if spec.get("per_model") else 0
        self.layers = nn.ModuleList()
        for layer in spec["layers"]:
            self.layers.append(self._build(layer, i))
        self.head = self._build_head(spec["head"], i)
        # A norm starts as the identity map (weight 1, bias 0): an instance norm then an
        # average pool gives exactly its bias, 0, and a ReLU after that sits on a tie
        # that rounding breaks either way (found: the loop's gradient 0, a lowering's
        # 0.15).  Random affine parameters keep the examples off such ties.
        for m in self.modules():
            if isinstance(m, _NORMS):
                if getattr(m, "weight", None) is not None:
                    nn.init.uniform_(m.weight, 0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    nn.init.normal_(m.bias)

    @staticmethod
    def _build(layer, i: int = 0) -> nn.Module:
        kind = layer[0]
        eps = 1e-5 * (1 + 3 * i)
        if kind == "conv":
            _, c, out, k, stride, padding, groups, mode, bias = layer
            return nn.Conv2d(c, out, k, stride=stride, padding=padding, groups=groups,
                             padding_mode=mode, bias=bias)
        if kind == "batch":
            return nn.BatchNorm2d(layer[1], affine=layer[2], eps=eps, momentum=0.1 + 0.1 * i)
        if kind == "instance":
            return nn.InstanceNorm2d(layer[1], affine=layer[2], eps=eps)
        if kind == "group":
            return nn.GroupNorm(layer[2], layer[1], eps=eps)
        if kind == "act" or kind == "concat":
            return _activation(layer[1], layer[2], i)
        if kind == "residual":
            return nn.Sequential(nn.Conv2d(layer[1], layer[1], 3, padding=1),
                                 _activation(layer[2], layer[1], i))
        if kind == "pool":
            return {"max": nn.MaxPool2d(2), "avg": nn.AvgPool2d(2), "fmax": nn.Identity(),
                    "adaptive": nn.AdaptiveAvgPool2d(1)}[layer[1]]
        if kind == "dropout":
            p = layer[1] if len(layer) > 1 else 0.0
            return nn.Dropout(min(0.9, p + 0.1 * i) if p > 0 else 0.0)
        if kind == "linear":
            return nn.Linear(layer[1], layer[2], bias=layer[3])
        if kind == "layer":
            return nn.LayerNorm(layer[1], eps=eps)
        if kind == "rms":
            return nn.RMSNorm(layer[1], eps=eps)
        if kind == "log_softmax":
            return nn.LogSoftmax(dim=-1)
        if kind == "inplace":
            return nn.Identity()
        if kind == "seq_residual":
            return nn.Sequential(nn.Linear(layer[1], layer[1]), nn.GELU())
        if kind == "conv1d":
            return nn.Conv1d(layer[1], layer[1], layer[2], padding=layer[2] // 2)
        if kind == "mix":
            return nn.Linear(layer[1], layer[1], bias=False)
        if kind == "scale":
            return nn.ParameterList([nn.Parameter(torch.randn(layer[1]))])
        raise ValueError(kind)

    @staticmethod
    def _build_head(head, i: int = 0) -> nn.Module:
        if head[0] == "seq":
            return nn.Linear(head[1], head[2])
        _, features, hidden, out, act = head
        return nn.Sequential(nn.Linear(features, hidden), _activation(act, hidden, i),
                             nn.Linear(hidden, out))

    def forward(self, x):
        for layer, module in zip(self.spec["layers"], self.layers):
            kind = layer[0]
            if kind == "residual":
                x = x + module(x)
            elif kind == "concat":
                x = torch.cat([x, module(x)], dim=1)
            elif kind == "pool" and layer[1] == "fmax":
                x = F.max_pool2d(x, kernel_size=2)
            elif kind == "seq_residual":
                x = x + module(x)
            elif kind == "conv1d":
                x = module(x.transpose(1, 2)).transpose(1, 2)
            elif kind == "mix":  # attention-like mixing over the sequence
                scores = torch.bmm(module(x), x.transpose(1, 2)) / x.size(-1) ** 0.5
                x = torch.bmm(F.softmax(scores, dim=-1), x)
            elif kind == "scale":
                x = x * module[0] + 0.1
            elif kind == "inplace":  # on the fused kernel's own output
                x.mul_(1.5).add_(0.1)
            else:
                x = module(x)
        head = self.spec["head"]
        if head[0] == "seq":
            pooled = {"mean": lambda t: t.mean(1), "max": lambda t: t.max(dim=1)[0],
                      "last": lambda t: t[:, -1]}[head[3]](x)
            return self.head(pooled)
        if head[0] == "view":
            x = x.view(x.size(0), -1)
        elif head[0] == "flatten":
            x = torch.flatten(x, 1)
        elif head[0] == "mean":
            x = x.mean((2, 3))
        else:
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)
