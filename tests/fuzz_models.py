"""Random architectures built from every supported rule, for property-based fuzzing.

A hypothesis strategy draws an architecture *spec* (plain data: a list of layer
tuples with their hyper-parameters), keeping track of shapes so every spec is a
valid model; :class:`FuzzNet` builds it.  Two families:

- images ``[B, C, H, W]``: convs (stride, padding incl. 'same', padding modes,
  groups, bias), batch/group/instance norm, activations, residual blocks,
  channel concatenation, pooling, then a flatten head and linears;
- sequences ``[B, T, D]``: linears, layer/RMS norm, activations, residual adds,
  conv1d through a transpose, softmax attention-like mixing with bmm, reductions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

ACTIVATIONS = ["relu", "gelu", "tanh", "silu", "leaky_relu", "elu", "sigmoid", "hardswish",
               "relu6", "prelu", "softplus", "identity"]


def _activation(name: str, channels: int) -> nn.Module:
    return {
        "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU,
        "leaky_relu": lambda: nn.LeakyReLU(0.1), "elu": nn.ELU, "sigmoid": nn.Sigmoid,
        "hardswish": nn.Hardswish, "relu6": nn.ReLU6, "prelu": lambda: nn.PReLU(channels),
        "softplus": nn.Softplus, "identity": nn.Identity,
    }[name]()


@st.composite
def image_spec(draw):
    c = draw(st.integers(1, 4))
    h = w = draw(st.integers(4, 9))
    spec = {"family": "image", "input": (draw(st.integers(1, 3)), c, h, w), "layers": []}
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["conv", "conv", "norm", "act", "residual", "concat",
                                     "pool", "dropout"]))
        if kind == "conv":
            groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
            # Mostly narrow; sometimes as wide as oneDNN's channel blocks (8, 16) and past them.
            out = groups * draw(st.sampled_from([1, 2, 3, 1, 2, 3, 8, 17]))
            k = draw(st.sampled_from([1, 2, 3]))
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
            spec["layers"].append(("dropout",))
    head = draw(st.sampled_from(["view", "flatten", "mean", "adaptive"]))
    features = c if head in ("mean", "adaptive") else c * h * w
    hidden = draw(st.integers(2, 8))
    spec["head"] = (head, features, hidden, draw(st.integers(1, 4)),
                    draw(st.sampled_from(ACTIVATIONS)))
    return spec


@st.composite
def sequence_spec(draw):
    d = draw(st.integers(2, 6))
    spec = {"family": "sequence", "input": (draw(st.integers(1, 3)), draw(st.integers(1, 5)), d),
            "layers": []}
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["linear", "linear", "norm", "act", "residual", "conv1d",
                                     "mix", "scale"]))
        if kind == "linear":
            out = draw(st.integers(2, 6))
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
    spec["head"] = ("seq", d, draw(st.integers(1, 4)), draw(st.sampled_from(["mean", "max", "last"])))
    return spec


architectures = st.one_of(image_spec(), sequence_spec())


_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


class FuzzNet(nn.Module):
    """A model built from a spec; its forward interprets the spec (unrolled by tracing)."""

    def __init__(self, spec: dict):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList()
        for layer in spec["layers"]:
            self.layers.append(self._build(layer))
        self.head = self._build_head(spec["head"])
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
    def _build(layer) -> nn.Module:
        kind = layer[0]
        if kind == "conv":
            _, c, out, k, stride, padding, groups, mode, bias = layer
            return nn.Conv2d(c, out, k, stride=stride, padding=padding, groups=groups,
                             padding_mode=mode, bias=bias)
        if kind == "batch":
            return nn.BatchNorm2d(layer[1], affine=layer[2])
        if kind == "instance":
            return nn.InstanceNorm2d(layer[1], affine=layer[2])
        if kind == "group":
            return nn.GroupNorm(layer[2], layer[1])
        if kind == "act" or kind == "concat":
            return _activation(layer[1], layer[2])
        if kind == "residual":
            return nn.Sequential(nn.Conv2d(layer[1], layer[1], 3, padding=1),
                                 _activation(layer[2], layer[1]))
        if kind == "pool":
            return {"max": nn.MaxPool2d(2), "avg": nn.AvgPool2d(2), "fmax": nn.Identity(),
                    "adaptive": nn.AdaptiveAvgPool2d(1)}[layer[1]]
        if kind == "dropout":
            return nn.Dropout(0.0)
        if kind == "linear":
            return nn.Linear(layer[1], layer[2], bias=layer[3])
        if kind == "layer":
            return nn.LayerNorm(layer[1])
        if kind == "rms":
            return nn.RMSNorm(layer[1])
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
    def _build_head(head) -> nn.Module:
        if head[0] == "seq":
            return nn.Linear(head[1], head[2])
        _, features, hidden, out, act = head
        return nn.Sequential(nn.Linear(features, hidden), _activation(act, hidden),
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
