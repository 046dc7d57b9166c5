"""``hftc.fuse(models, pad_widths=True)``: models that differ only in layer widths,
padded with zeros to the widest so that they fuse into one array.

::

    model i:   Linear(20, h_i) -> LayerNorm(h_i) -> ReLU -> Linear(h_i, 5)
    padded i:  Linear(20, H) -> MaskedLayerNorm(H) -> ReLU -> Linear(H, 5)
               H = max_i h_i; model i's weights in the first rows / columns, zeros after

The padded models are the stock modules at the widest widths (nn.Linear, Conv, Embedding,
BatchNorm, MultiheadAttention, whose packed q, k, v rows are padded block by block), so
the fused forward is the one of equal-width models.  It is exact because a padded weight
entry is exactly 0: it adds exact zeros to the real units whatever the padded units hold
(a padded unit after a sigmoid is 0.5, times a zero column).  The padded entries stay 0
because their GRADIENTS are masked: :func:`mask_padded_gradients` hooks every padded
fused parameter, zeroing those entries of ``.grad`` as autograd accumulates it; every
stock optimizer's update of an entry whose gradient and state are 0 is 0 (SGD with
momentum, dampening, Nesterov and weight decay; Adam / AdamW / Adamax / NAdam / RAdam:
moments 0, so ``0 / (sqrt(0) + eps)``; RMSprop, Adagrad, Adadelta: the same products
with 0), so weights, momentum and Adam's moments of the padding stay exactly 0.  What
this does not guard: code that writes into the fused parameters itself (re-initialising
them after ``fuse``, ``torch.nn.init`` on ``fused.parameters()``) puts non-zeros in the
padding; initialise the models before fusing them.  Norms that mix across a padded dim
take their statistics over the real units only (:class:`MaskedLayerNorm`,
:class:`MaskedRMSNorm`, :class:`MaskedGroupNorm`); batch norm's statistics are per
channel, a padded channel's all zeros.  The first-call check compares the fused program
with every ORIGINAL model (``unfuse_model`` gives them back at their own widths); where
an op of forward's own code mixes across a padded dim, :mod:`hftc.module.padding_graph`
computes it over the real units (the module is fused again from the rewritten models),
or refuses it, named; nothing inexact runs.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import MismatchError, UnsupportedOperatorError
from ..frontends.symbolic import deepcopy_module, meta_copy
from ..lowering.check import ConstantRandomness

# ---------------------------------------------------------------- padded tensors and norms


def _mask(shape: Sequence[int], real: Sequence[int], like: Tensor) -> Tensor:
    """1 on ``[:real[0], :real[1], ...]`` of a ``shape`` tensor, 0 elsewhere."""
    mask = torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
    mask[tuple(slice(0, r) for r in real)] = 1
    return mask


def _padded(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``t`` in the first entries of a zero tensor of ``shape``."""
    out = torch.zeros(tuple(shape), dtype=t.dtype, device=t.device)
    out[tuple(slice(0, s) for s in t.shape)] = t.detach()
    return out


def _like(module: nn.Module) -> Tensor:
    """A tensor of the module's dtype and device, for its masks: its first parameter or
    buffer, else (a norm without affine parameters) the model's, which
    :func:`pad_models` records as ``module._hftc_model_like``."""
    own = next(iter(module.parameters()), None)
    return own if own is not None else module.__dict__["_hftc_model_like"]


class PaddedModule(nn.Module):
    """Holds padded parameters and their masks: ``self.masked(name)`` is the parameter
    times its mask (the mask a non-persistent buffer, so ``state_dict`` has only the
    parameters and buffers the original module had)."""

    def _take(self, source: nn.Module, widths: dict[str, Sequence[int]]) -> None:
        for name, p in source.named_parameters(recurse=False):
            shape = widths[name]
            self.register_parameter(name, nn.Parameter(_padded(p, shape), p.requires_grad))
            self.register_buffer(f"{name}_mask", _mask(shape, p.shape, p), persistent=False)
        for name, b in source.named_buffers(recurse=False):
            shape = widths.get(name, b.shape)
            self.register_buffer(name, _padded(b, shape) if b.dim() else b.detach().clone())
        for name in ("weight", "bias"):
            if name not in self._parameters:
                self.register_parameter(name, None)
        self.training = source.training

    def masked(self, name: str) -> Tensor | None:
        p = getattr(self, name)
        return None if p is None else p * getattr(self, f"{name}_mask")

    def _real_units(self, source: nn.Module, normalized_shape: Sequence[int]) -> None:
        """A norm over the widest ``normalized_shape``: ``unit_mask`` (1 on the source's
        real units) and ``count`` (how many), for statistics over the real units only."""
        real = tuple(source.normalized_shape)
        self.normalized_shape = tuple(normalized_shape)
        like = _like(source)
        self.register_buffer("unit_mask", _mask(normalized_shape, real, like), persistent=False)
        self.register_buffer("count", torch.tensor(float(torch.Size(real).numel()),
                                                   dtype=like.dtype), persistent=False)


def _widened(source: nn.Module, widths: dict[str, Sequence[int]],
              blocks: dict[str, int] | None = None, **sizes: int) -> nn.Module:
    """``source`` at the widest widths: a copy of the same class and settings whose own
    tensors are zero-padded to ``widths`` (``blocks[name]`` blocks along dim 0 padded
    each on its own: a packed q, k, v projection), with its size attributes ``sizes``.
    Its forward is the stock one: the padded entries are exactly zero and their
    gradients are masked (module docstring), so they add exact zeros to the real units."""
    wide = copy.deepcopy(source)
    wide.__dict__.pop("_hftc_model_like", None)  # pad_models' note on the source
    for name, p in source.named_parameters(recurse=False):
        value = _padded_blocks(p, widths[name], (blocks or {}).get(name, 1))
        wide._parameters[name] = nn.Parameter(value, p.requires_grad)
    for name, b in source.named_buffers(recurse=False):
        if b is not None and b.dim():
            wide._buffers[name] = _padded(b, widths.get(name, b.shape))
    for name, value in sizes.items():
        setattr(wide, name, value)
    return wide


def _padded_blocks(t: Tensor, shape: Sequence[int], blocks: int) -> Tensor:
    """``t`` padded to ``shape``, its dim 0 as ``blocks`` equal blocks each padded alone::

        [q_i; k_i; v_i]  ([3 e_i, e_i])  ->  [q_i, 0; k_i, 0; v_i, 0]  ([3 E, E])
    """
    if blocks == 1:
        return _padded(t, shape)
    inner = (shape[0] // blocks, *shape[1:])
    parts = [_padded(part, inner) for part in t.detach().chunk(blocks, 0)]
    return torch.cat(parts, 0)


class MaskedLayerNorm(PaddedModule):
    """``nn.LayerNorm`` over the widest normalized shape, its statistics over the real
    units only::

        mean = sum(x * m) / count;  xc = (x - mean) * m;  var = sum(xc**2) / count
        y = xc / sqrt(var + eps) * (weight * m) + bias * m
    """

    def __init__(self, source: nn.LayerNorm, widths: dict[str, Sequence[int]],
                 normalized_shape: Sequence[int]):
        super().__init__()
        self.eps = source.eps
        self._real_units(source, normalized_shape)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        mean = (x * self.unit_mask).sum(dims, keepdim=True) / self.count
        centred = (x - mean) * self.unit_mask
        var = (centred * centred).sum(dims, keepdim=True) / self.count
        y = centred * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.masked("weight")
        if self.bias is not None:
            y = y + self.masked("bias")
        return y


class MaskedRMSNorm(PaddedModule):
    """``nn.RMSNorm`` over the widest normalized shape, the mean square over the real
    units only: ``y = x * m / sqrt(sum((x * m)**2) / count + eps) * (weight * m)``."""

    def __init__(self, source: nn.Module, widths: dict[str, Sequence[int]],
                 normalized_shape: Sequence[int]):
        super().__init__()
        # eps=None is the input dtype's machine epsilon: the model's dtype (a traced
        # forward cannot read an input's dtype)
        self.eps = torch.finfo(_like(source).dtype).eps if source.eps is None else source.eps
        self._real_units(source, normalized_shape)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        dims = tuple(range(-len(self.normalized_shape), 0))
        eps = self.eps
        real = x * self.unit_mask
        y = real * torch.rsqrt((real * real).sum(dims, keepdim=True) / self.count + eps)
        return y if self.weight is None else y * self.masked("weight")


class MaskedGroupNorm(PaddedModule):
    """``nn.GroupNorm`` at the widest channels, each group's statistics over its real
    channels only.  Channel c of model i is in group ``c // (C_i / G_i)``
    (``group_onehot[c, g]``); padded channels are in none::

        group_sum[b, g] = sum_c,s x[b, c, s] * group_onehot[c, g]    (the same for var)
        mean[b, c] = (group_sum / group_size)[b, :] @ group_onehot[c, :]
    """

    def __init__(self, source: nn.GroupNorm, widths: dict[str, Sequence[int]],
                 channels: int, groups: int):
        super().__init__()
        self.num_channels, self.num_groups, self.eps = channels, groups, source.eps
        self.affine = source.affine
        like = _like(source)
        size = source.num_channels // source.num_groups
        onehot = torch.zeros(channels, groups, dtype=like.dtype)
        real = torch.arange(source.num_channels)
        onehot[real, real // size] = 1
        # a padded group counts 1 channel (its sums are zero): no 0 / 0
        group_size = torch.ones(groups, dtype=like.dtype)
        group_size[:source.num_groups] = size
        self.register_buffer("group_onehot", onehot, persistent=False)
        self.register_buffer("group_onehot_t", onehot.t().contiguous(), persistent=False)
        self.register_buffer("group_size", group_size, persistent=False)
        self.register_buffer("channel_mask", _mask([channels], [source.num_channels], like)
                             .unsqueeze(-1), persistent=False)
        self._take(source, widths)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(2) * self.channel_mask  # [B, C, L]
        count = self.group_size * flat.shape[-1]
        mean = (flat.sum(-1) @ self.group_onehot / count) @ self.group_onehot_t
        centred = (flat - mean.unsqueeze(-1)) * self.channel_mask
        var = (centred * centred).sum(-1) @ self.group_onehot / count
        y = centred * (torch.rsqrt(var + self.eps) @ self.group_onehot_t).unsqueeze(-1)
        y = y.view_as(x)
        if self.affine:
            shape = (-1,) + (1,) * (x.dim() - 2)
            y = y * self.masked("weight").view(shape) + self.masked("bias").view(shape)
        return y


# ---------------------------------------------------------------- the padding plan


@dataclass
class WidthPadding:
    """What ``pad_widths=True`` did: each model's own tensor shapes, the padded ones, and
    the original models' structure (on the meta device) that ``unfuse`` rebuilds."""

    #: per model: parameter / buffer name -> its own shape
    shapes: list[dict[str, torch.Size]]
    #: parameter / buffer name -> the padded (widest) shape
    padded_shapes: dict[str, torch.Size]
    #: the original models on the meta device (structure and attributes, no data)
    originals: list[nn.Module]
    #: the Linear / Conv / Embedding weights, whose entries count the arithmetic
    weight_names: tuple[str, ...] = ()
    #: tensors padded as equal blocks along dim 0, each on its own (name -> blocks):
    #: nn.MultiheadAttention's packed q, k, v projection
    blocks: dict[str, int] = field(default_factory=dict)
    #: real_mask's masks, by name, dtype and device (gradient_mask)
    _masks: dict[tuple, Tensor | None] = field(default_factory=dict, repr=False,
                                               compare=False)

    def gradient_mask(self, name: str, like: Tensor) -> Tensor | None:
        """:meth:`real_mask` of ``like``'s dtype and device, made once."""
        key = (name, like.dtype, like.device)
        if key not in self._masks:
            self._masks[key] = self.real_mask(name, like)
        return self._masks[key]

    @property
    def real_weight_elements(self) -> int:
        return sum(own[n].numel() for own in self.shapes for n in self.weight_names)

    @property
    def padded_weight_elements(self) -> int:
        return sum(self.padded_shapes[n].numel() for n in self.weight_names) * len(self.shapes)

    def subset(self, keep: Sequence[int]) -> WidthPadding:
        """The plan of models ``keep`` (``hftc.keep_models``), still padded to the widths
        of before: the stacked tensors keep their shapes."""
        return WidthPadding([self.shapes[i] for i in keep], self.padded_shapes,
                            [self.originals[i] for i in keep], self.weight_names, self.blocks)

    @property
    def arithmetic_ratio(self) -> float:
        """The padded array's arithmetic over the models' own: the Linear / Conv /
        Embedding weights' entries (a Linear's or Conv's multiply-adds per output
        position); 1.0: no padding cost."""
        return self.padded_weight_elements / max(self.real_weight_elements, 1)

    def summary(self) -> str:
        padded = sorted(n for n, s in self.padded_shapes.items()
                        if any(own.get(n) != s for own in self.shapes))
        return (f"padded widths (pad_widths=True): {len(padded)} tensors padded to the "
                f"widest model's; the Linear / Conv / Embedding weights hold "
                f"{self.padded_weight_elements}"
                f" entries for the models' {self.real_weight_elements}: about "
                f"{self.arithmetic_ratio:.2f}x the models' own arithmetic")

    def unpad(self, index: int, name: str, t: Tensor) -> Tensor:
        """Model ``index``'s own part of its padded tensor ``t`` (a view; a copy for a
        tensor padded block by block)."""
        shape = self.shapes[index].get(name)
        return t if shape is None else own_part(t, shape, self.blocks.get(name, 1))

    def real_mask(self, name: str, like: Tensor) -> Tensor | None:
        """``[N, *padded shape]``: 1 on each model's own entries of tensor ``name``, 0 on
        its padding; None where no model's is padded."""
        padded = self.padded_shapes[name]
        if all(own[name] == padded for own in self.shapes):
            return None
        mask = torch.zeros((len(self.shapes), *padded), dtype=like.dtype, device=like.device)
        for i, own in enumerate(self.shapes):
            rows = _own_rows(own[name][0], padded[0], self.blocks.get(name, 1))
            rows = torch.arange(own[name][0]) if rows is None else rows
            inner = torch.zeros(padded[1:], dtype=like.dtype, device=like.device)
            inner[tuple(slice(0, s) for s in own[name][1:])] = 1
            mask[i].index_copy_(0, rows.to(mask.device),
                                inner.expand(len(rows), *padded[1:]).contiguous())
        return mask

    def original_model(self, index: int, padded: nn.Module) -> nn.Module:
        """Model ``index`` at its own widths, with the padded model's weights, buffers and
        train / eval modes."""
        model = deepcopy_module(self.originals[index])
        modes = {path: sub.training for path, sub in padded.named_modules()}
        for path, sub in model.named_modules():
            sub.training = modes.get(path, sub.training)
        tensors = dict(padded.named_parameters(remove_duplicate=False)) | dict(
            padded.named_buffers(remove_duplicate=False))
        made: dict[int, Tensor] = {}  # tied tensors (an embedding and its head) stay tied
        for name, meta in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            owner_path, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            if id(meta) not in made:
                value = self.unpad(index, name, tensors[name].detach()).clone()
                made[id(meta)] = (nn.Parameter(value, meta.requires_grad)
                                  if isinstance(meta, nn.Parameter) else value)
            if isinstance(meta, nn.Parameter):
                owner._parameters[leaf] = made[id(meta)]
            else:
                owner._buffers[leaf] = made[id(meta)]
        return model


def _own_rows(own: int, padded: int, blocks: int) -> Tensor | None:
    """The rows of dim 0 that a model of ``own`` rows fills in a tensor padded to
    ``padded`` rows as ``blocks`` blocks (None: the leading ``own``, a slice)."""
    if blocks == 1:
        return None
    inner, own_inner = padded // blocks, own // blocks
    return torch.cat([torch.arange(b * inner, b * inner + own_inner) for b in range(blocks)])


def own_part(t: Tensor, shape: Sequence[int], blocks: int = 1) -> Tensor:
    """The entries of padded ``t`` that a model's tensor of ``shape`` fills (a view; a copy
    for a tensor padded block by block)."""
    rows = _own_rows(shape[0], t.shape[0], blocks) if len(shape) else None
    if rows is not None:
        t = t.index_select(0, rows.to(t.device))
    return t[tuple(slice(0, s) for s in shape)]


def into_padded(target: Tensor, value: Tensor, blocks: int = 1) -> None:
    """``target.copy_(value)`` for the ``value`` of a narrower model: its entries where
    :func:`own_part` reads them, zeros elsewhere."""
    target.zero_()
    rows = _own_rows(value.shape[0], target.shape[0], blocks) if value.dim() else None
    inner = tuple(slice(0, s) for s in value.shape[1:])
    if rows is None:
        target[tuple(slice(0, s) for s in value.shape)].copy_(value)
    else:
        for k, row in enumerate(rows.tolist()):
            target[(row, *inner)].copy_(value[k])


def width_blocks(model: nn.Module) -> dict[str, int]:
    """Tensor name -> blocks along dim 0, for ``model``'s tensors padded block by block:
    ``nn.MultiheadAttention``'s packed ``in_proj_weight`` / ``in_proj_bias`` (q, k, v)."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            prefix = f"{path}." if path else ""
            found.update({prefix + name: 3 for name in ("in_proj_weight", "in_proj_bias")
                          if getattr(module, name, None) is not None})
    return found


#: id -> the fused parameters whose gradients mask_padded_gradients masks, weakly (a
#: WeakSet would compare tensors with ==)
_MASKED: dict[int, weakref.ref] = {}


def mask_padded_gradients(fused: nn.Module) -> None:
    """Give each padded parameter of ``fused`` (``fused.padding`` set) a hook that zeroes
    the padded entries of its gradient as autograd accumulates it, so every
    optimizer, clipping and scaler sees exact zeros there (module docstring).  Called on
    every forward; a parameter has its hook once (a copy of the module gets its own).
    The masks are made here, not in backward (a CUDA graph captures the backward)."""
    plan = fused.padding
    for name, p in fused.named_parameters():
        if name not in plan.padded_shapes or (
                id(p) in _MASKED and _MASKED[id(p)]() is p):
            continue
        if plan.gradient_mask(name, p) is None:
            continue
        p.register_post_accumulate_grad_hook(_zero_padded_gradient(weakref.ref(fused), name))
        key = id(p)
        _MASKED[key] = weakref.ref(p, lambda _, key=key: _MASKED.pop(key, None))


def _zero_padded_gradient(fused_ref: weakref.ref, name: str) -> Any:
    def hook(p: Tensor) -> None:
        fused = fused_ref()
        plan = getattr(fused, "padding", None)
        if plan is None or p.grad is None:
            return
        real = plan.gradient_mask(name, p.grad)
        if real is not None and real.shape == p.grad.shape:
            p.grad.masked_fill_(real.logical_not(), 0)  # (an inf or nan there too)
    return hook


def locate_difference(original: nn.Module, padded: nn.Module, args: Sequence) -> str:
    """Where model ``original`` and its ``padded`` model first part (both run once, draws
    made constant): the first module, in call order, whose input or output differs in the
    original's units.  An input that differs where the modules before agree was changed
    by forward's own code between them."""
    def record(model: nn.Module) -> list[tuple[str, str, Tensor]]:
        seen: list[tuple[str, str, Tensor]] = []
        handles = []
        for path, sub in model.named_modules():
            def hook(module, inputs, output, path=path):
                if inputs and isinstance(inputs[0], Tensor):
                    seen.append((path, "input", inputs[0].detach()))
                if isinstance(output, Tensor):
                    seen.append((path, "output", output.detach()))
            if path:
                handles.append(sub.register_forward_hook(hook))
        try:
            with torch.no_grad(), ConstantRandomness():
                model(*args)
        except Exception:  # noqa: BLE001 - whatever ran until then is compared
            pass
        finally:
            for h in handles:
                h.remove()
        return seen

    wants, gots = record(original), record(padded)
    for (path, kind, want), (_, _, got) in zip(wants, gots):
        if got.dim() != want.dim() or any(g < w for g, w in zip(got.shape, want.shape)):
            differs = True
        else:
            got = got[tuple(slice(0, w) for w in want.shape)]
            differs = not torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)
        if differs:
            module = type(original.get_submodule(path)).__name__
            if kind == "input":
                op = _locate_op(original, padded, args)
                return (f"the input of `{path}` ({module}) differs while the modules before "
                        f"it agree: {op or 'an op of forward' + chr(39) + 's own code'} "
                        f"before `{path}` mixes across a padded width")
            return f"the output of `{path}` ({module}) differs"
    return ""


class PaddedLeafTracer(torch.fx.Tracer):
    """torch.nn's modules and the padded modules as leaves, the user's own traced through,
    so that a model and its padded model give graphs that match node by node.  Buffers are
    proxies (``self.mask[:T, :T]`` is a node); every node keeps its stack trace (the
    refusal names the user's line)."""

    proxy_buffer_attributes = True

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, PaddedModule) or super().is_leaf_module(m, qualname)


class NodeRecorder(torch.fx.Interpreter):
    """Runs a graph once, keeping every node's value in ``values``."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[torch.fx.Node, object] = {}

    def run_node(self, n: torch.fx.Node) -> object:
        self.values[n] = out = super().run_node(n)
        return out


def _node_values(model: nn.Module, args: Sequence) -> tuple[torch.fx.Graph, dict[str, object]]:
    tracer = PaddedLeafTracer()
    graph = tracer.trace(model)
    recorder = NodeRecorder(torch.fx.GraphModule(tracer.root, graph))
    with torch.no_grad(), ConstantRandomness():
        recorder.run(*args)
    return graph, {n.name: v for n, v in recorder.values.items()}


def _agree(want: object, got: object) -> bool:
    """``got`` (the padded model's) equals ``want`` on the original's units."""
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)):
        return len(want) == len(got) and all(_agree(w, g) for w, g in zip(want, got))
    if not isinstance(want, Tensor) or not isinstance(got, Tensor):
        return True  # sizes and Python values: the widths differ on purpose
    if got.dim() != want.dim() or any(g < w for g, w in zip(got.shape, want.shape)):
        return False
    got = got[tuple(slice(0, w) for w in want.shape)]
    if not want.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def _user_frame(stack_trace: str) -> str:
    """``file:line, in function`` of the innermost frame of a node's stack trace outside
    torch and hftc: the model's own line."""
    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent))  # hftc/
    for found in reversed(re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stack_trace)):
        if not found[0].startswith(skip):
            return f"{found[0]}:{found[1]}, in {found[2]}"
    return ""


def _locate_op(original: nn.Module, padded: nn.Module, args: Sequence) -> str:
    """The first op of forward's own code whose inputs agree on the original's units and
    whose output does not (both models traced with :class:`PaddedLeafTracer` and run on
    ``args``), named with its source line; "" where the models do not trace alike."""
    try:
        graph, wants = _node_values(original, args)
        padded_graph, gots = _node_values(padded, args)
    except Exception:  # noqa: BLE001 - an untraceable forward: the module-level answer
        return ""
    nodes, padded_nodes = list(graph.nodes), list(padded_graph.nodes)
    if [n.op for n in nodes] != [n.op for n in padded_nodes]:
        return ""
    at = _first_differing(nodes, wants, gots, dict(zip(nodes, padded_nodes)))
    if at is None:
        return ""
    where = _user_frame(nodes[at].stack_trace or "")
    name = _op_name(nodes[at])
    return f"the op `{name}` ({where})" if where else f"the op `{name}`"


def _first_differing(nodes: Sequence[torch.fx.Node], wants: dict, gots: dict,
                     to_padded: dict[torch.fx.Node, torch.fx.Node]) -> int | None:
    """The position of the first op whose inputs agree on the original's units
    (``wants``: the original graph's values, ``gots``: the padded one's) and whose
    output does not."""
    for k, node in enumerate(nodes):
        if node.op not in ("call_function", "call_method") or node.name not in wants:
            continue
        inputs_agree = all(_agree(wants[a.name], gots.get(to_padded[a].name))
                           for a in node.all_input_nodes if a.name in wants)
        if inputs_agree and not _agree(wants[node.name], gots.get(to_padded[node].name)):
            return k
    return None


_WEIGHTED = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)


def widths_key(model: nn.Module) -> str:
    """Equal for two models that ``pad_widths=True`` may pad into one array: the same
    module paths and classes, the same tensor names and ranks, whatever their widths."""
    return repr(([(p, type(m).__qualname__) for p, m in model.named_modules()],
                 [(n, t.dim()) for n, t in _tensors(model).items()]))


def weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The Linear / Conv / Embedding weights' shapes: their entries count the arithmetic
    (per output position) that padding multiplies."""
    return {f"{p}.weight" if p else "weight": m.weight.shape
            for p, m in model.named_modules() if isinstance(m, _WEIGHTED)}


def padding_ratio(shapes: Sequence[dict[str, torch.Size]]) -> float:
    """The arithmetic of models of these :func:`weight_shapes` padded into one array over
    their own (1.0: one width)."""
    real = sum(s.numel() for own in shapes for s in own.values())
    widest = {n: torch.Size(max(d) for d in zip(*(own[n] for own in shapes)))
              for n in shapes[0]}
    return sum(s.numel() for s in widest.values()) * len(shapes) / max(real, 1)


def _tie_as_in(original: nn.Module, padded: nn.Module) -> None:
    """Parameters the original ties (nanoGPT's ``wte.weight`` is ``lm_head.weight``) one
    padded parameter again, with one mask: the padded modules made a copy each."""
    first: dict[int, str] = {}
    for name, p in original.named_parameters(remove_duplicate=False):
        source = first.setdefault(id(p), name)
        if source == name:
            continue
        source_owner, _, source_leaf = source.rpartition(".")
        owner_path, _, leaf = name.rpartition(".")
        source_module = padded.get_submodule(source_owner)
        owner = padded.get_submodule(owner_path)
        owner._parameters[leaf] = source_module._parameters[source_leaf]
        mask = source_module._buffers.get(f"{source_leaf}_mask")
        if mask is not None:
            owner._buffers[f"{leaf}_mask"] = mask


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer by name, a tied one under each of its names."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False))


def _check_same_structure(models: Sequence[nn.Module]) -> None:
    """Same module paths and classes, same tensor names and ranks, or a MismatchError."""
    paths0 = {p: type(m) for p, m in models[0].named_modules()}
    tensors0 = _tensors(models[0])
    for i, model in enumerate(models[1:], start=1):
        paths = {p: type(m) for p, m in model.named_modules()}
        if paths != paths0:
            diff = sorted(set(paths.items()) ^ set(paths0.items()), key=str)[0]
            raise MismatchError(
                f"pad_widths=True pads widths only, but model {i}'s modules differ from "
                f"model 0's at `{diff[0] or '<root>'}` ({diff[1].__name__}): the models must "
                f"have the same layers, in the same order, of any widths")
        tensors = _tensors(model)
        for name, t in tensors.items():
            t0 = tensors0.get(name)
            if t0 is None or t0.dim() != t.dim():
                raise MismatchError(
                    f"pad_widths=True: model {i}'s tensor `{name}` "
                    f"({'missing in model 0' if t0 is None else f'{t.dim()}-d'}) does not "
                    f"match model 0's; the models must have the same layers")


def _widest_int_attributes(modules: Sequence[nn.Module]) -> dict[str, int]:
    """Plain int attributes (``n_head``, ``n_embd``) that differ among the models: the
    largest, which the padded module takes (the widest model's structure)."""
    found: dict[str, int] = {}
    for name, value in vars(modules[0]).items():
        if name.startswith("_") or type(value) is not int:
            continue
        values = [vars(m).get(name) for m in modules]
        if all(type(v) is int for v in values) and len(set(values)) > 1:
            found[name] = max(values)
    return found


def _own_shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {n: t.shape for n, t in list(module.named_parameters(recurse=False))
            + list(module.named_buffers(recurse=False))}


#: norms that may have no parameter, their width only in their attributes
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def _width_attributes(module: nn.Module) -> dict[str, object]:
    """A module's plain int and int-tuple attributes (``normalized_shape``,
    ``num_features``): a norm without parameters has its width only there."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and (
        type(v) is int or (type(v) is tuple and all(type(e) is int for e in v)))}


def _padded_module(path: str, index: int, module: nn.Module, others: Sequence[nn.Module],
                   widths: dict[str, Sequence[int]], blocks: dict[str, int]
                   ) -> nn.Module | None:
    """The padded module for model ``index``'s ``module`` (``others``: every model's at
    this path), or None where no model's module holds a tensor of its own narrower than
    the widest.  ``blocks`` gets the tensors padded block by block (name -> blocks)."""
    if all(tuple(s) == tuple(widths[n]) for m in others for n, s in _own_shapes(m).items()) \
            and (not isinstance(module, _NORMS) or all(
                _width_attributes(m) == _width_attributes(module) for m in others)):
        return None
    own = _own_shapes(module)
    where = f"model {index}'s module `{path or '<root>'}` ({type(module).__name__})"
    if isinstance(module, nn.Linear):
        out_features, in_features = widths["weight"]
        return _widened(module, widths, in_features=in_features, out_features=out_features)
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        if module.groups != 1:
            raise UnsupportedOperatorError(
                f"pad_widths=True cannot pad {where}: groups={module.groups} (a grouped "
                f"conv's channels per group would move with the padding). Give every model "
                f"the same channels there, or groups=1", [type(module).__name__])
        out_channels, in_channels = widths["weight"][:2]
        return _widened(module, widths, in_channels=in_channels, out_channels=out_channels)
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise UnsupportedOperatorError(
                f"pad_widths=True cannot pad {where}: max_norm / sparse=True. Give every "
                f"model the same embedding widths", [type(module).__name__])
        num_embeddings, embedding_dim = widths["weight"]
        return _widened(module, widths, num_embeddings=num_embeddings,
                        embedding_dim=embedding_dim)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return _widened(module, widths, num_features=max(m.num_features for m in others))
    if isinstance(module, nn.MultiheadAttention):
        return _widened_attention(module, others, widths, blocks, where)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shapes = [tuple(m.normalized_shape) for m in others]
        if len({len(s) for s in shapes}) > 1:
            raise MismatchError(f"pad_widths=True: {where} normalizes over another number "
                                f"of dims than other models' ({shapes})")
        widest = tuple(max(d) for d in zip(*shapes))
        cls = MaskedLayerNorm if isinstance(module, nn.LayerNorm) else MaskedRMSNorm
        return cls(module, widths, widest)
    if isinstance(module, nn.GroupNorm):
        return MaskedGroupNorm(module, widths, max(m.num_channels for m in others),
                               max(m.num_groups for m in others))
    if type(module).__module__.startswith("torch.nn"):
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: its tensors "
            + ", ".join(f"`{n}` {tuple(own[n])}" for n in own
                        if tuple(own[n]) != tuple(widths[n]))
            + " differ in width from the widest model's, and hftc pads only nn.Linear, "
            "nn.Conv1d/2d/3d, nn.Embedding, nn.BatchNorm, nn.LayerNorm, nn.RMSNorm, "
            "nn.GroupNorm and nn.MultiheadAttention among torch.nn's layers. Give every "
            "model the same widths there", [type(module).__name__])
    # The model's own module holding tensors of its own (minGPT's pos_emb, nanoGPT's
    # LayerNorm weight): padded with zeros, gradients masked; its forward's ops over a
    # padded dim are hftc.module.padding_graph's, the first-call check judges the rest.
    return _widened(module, widths)


def _widened_attention(module: nn.MultiheadAttention, others: Sequence[nn.Module],
                       widths: dict[str, Sequence[int]], blocks: dict[str, int],
                       where: str) -> nn.Module:
    """``nn.MultiheadAttention`` at the widest ``embed_dim`` and ``num_heads`` of an equal
    head dim: ``in_proj_weight`` / ``in_proj_bias`` padded as three blocks (q, k, v),
    so that each model's heads are the first of the widest model's and the padded heads
    (q, k, v all zero) add exact zeros through the zero columns of ``out_proj``."""
    head_dims = {m.embed_dim // m.num_heads for m in others}
    if not module._qkv_same_embed_dim or len(head_dims) > 1:
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: "
            + ("kdim / vdim other than embed_dim" if not module._qkv_same_embed_dim else
               f"the models' head dims differ ({sorted(head_dims)})")
            + "; pad attention of one head dim, q, k and v of embed_dim (more heads for a "
            "wider model)", [type(module).__name__])
    embed_dim = max(m.embed_dim for m in others)
    for name in ("in_proj_weight", "in_proj_bias"):
        if getattr(module, name, None) is not None:
            blocks[name] = 3
    return _widened(module, widths, blocks, embed_dim=embed_dim, kdim=embed_dim,
                    vdim=embed_dim, num_heads=embed_dim // head_dims.pop())


def pad_models(models: Sequence[nn.Module]) -> tuple[list[nn.Module], WidthPadding | None]:
    """Each model rebuilt at the widest model's widths (see the module docstring), and
    the plan; the models themselves when every tensor already has one shape (None)."""
    _check_same_structure(models)
    own_shapes = [{n: t.shape for n, t in _tensors(m).items()} for m in models]
    padded_shapes = {name: torch.Size(max(dims) for dims in zip(*(s[name] for s in own_shapes)))
                     for name in own_shapes[0]}
    paths = [p for p, _ in models[0].named_modules()]
    if all(s == padded_shapes for s in own_shapes):
        # one width: attributes that differ (n_head at one d_model) are per-model
        # hyper-parameters for the ordinary fusion, not widths
        return list(models), None
    plan = WidthPadding(own_shapes, padded_shapes, [meta_copy(m) for m in models])
    padded_models = []
    for i, model in enumerate(models):
        padded = copy.deepcopy(model)
        like = next((t for t in _tensors(model).values() if t.is_floating_point()),
                    torch.zeros(()))
        for path in paths:
            at_path = [m.get_submodule(path) for m in models]
            source = model.get_submodule(path)
            source.__dict__["_hftc_model_like"] = like  # (read by _like; removed below)
            prefix = f"{path}." if path else ""
            widths = {n[len(prefix):]: s for n, s in padded_shapes.items()
                      if n.startswith(prefix) and "." not in n[len(prefix):]}
            blocks: dict[str, int] = {}
            try:
                replacement = _padded_module(path, i, source, at_path, widths, blocks)
                plan.blocks.update({f"{prefix}{n}": k for n, k in blocks.items()})
            finally:
                del source.__dict__["_hftc_model_like"]
            if replacement is None:
                if not type(source).__module__.startswith("torch.nn"):
                    # the user's n_head / n_embd: a width; a torch.nn module's own ints
                    # (an Embedding's padding_idx) are per-model settings, not widths
                    for name, value in _widest_int_attributes(at_path).items():
                        setattr(padded.get_submodule(path), name, value)
                continue
            if not path and not type(source).__module__.startswith("torch.nn"):
                # the model's root holds tensors of its own (minGPT's pos_emb): its
                # padded copy takes them, its children padded as the loop goes on
                padded._parameters.update(replacement._parameters)
                padded._buffers.update(replacement._buffers)
                continue
            if not path:
                raise UnsupportedOperatorError(
                    f"pad_widths=True: model {i} is itself a {type(source).__name__}; pad a "
                    f"model that holds it (nn.Sequential(model))", [type(source).__name__])
            parent, _, leaf = path.rpartition(".")
            setattr(padded.get_submodule(parent), leaf, replacement)
        _tie_as_in(model, padded)
        padded_models.append(padded)
    plan.weight_names = tuple(
        name for name in padded_shapes if name.rpartition(".")[2] == "weight" and isinstance(
            models[0].get_submodule(name.rpartition(".")[0]),
            (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)))
    return padded_models, plan





def _op_name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))


__all__ = ["WidthPadding", "into_padded", "locate_difference", "mask_padded_gradients",
           "own_part", "pad_models", "padding_ratio", "weight_shapes", "width_blocks",
           "widths_key"]
