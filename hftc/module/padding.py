"""``hftc.fuse(models, pad_widths=True)``: models that differ only in layer widths,
padded with zeros to the widest so that they fuse into one array.

::

    model i:   Linear(20, h_i) -> LayerNorm(h_i) -> ReLU -> Linear(h_i, 5)
    padded i:  Linear(20, H) -> MaskedLayerNorm(H) -> ReLU -> Linear(H, 5)
               H = max_i h_i; model i's weights in the first rows / columns, zeros after

The padded models are the stock modules at the widest widths (nn.Linear, Conv, Embedding,
BatchNorm, MultiheadAttention, whose packed q, k, v rows are padded block by block: each
module class as its rule declares, ``@rule(..., widens=Widens(...))``, built from
:mod:`hftc.passes.padded`), so the fused forward is the one of equal-width models.  It
is exact because a padded weight entry is exactly 0: it adds exact zeros to the real
units whatever the padded units hold (a padded unit after a sigmoid is 0.5, times a zero
column).  The padded entries stay 0
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
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import MismatchError, UnsupportedOperatorError
from ..frontends.symbolic import deepcopy_module, meta_copy
from ..passes import padded as padded_modules
from ..passes.differing_ops import is_elementwise_module
from ..passes.registry import widened_modules, widens_of

# the padded modules (hftc.passes.padded), by their old names too (pickles name them so)
MaskedGroupNorm, MaskedLayerNorm, MaskedRMSNorm = (
    padded_modules.MaskedGroupNorm, padded_modules.MaskedLayerNorm, padded_modules.MaskedRMSNorm)
PaddedModule = padded_modules.PaddedModule


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
        fact = widens_of(module)
        if fact is not None and fact.blocks is not None:
            prefix = f"{path}." if path else ""
            found.update({prefix + name: k for name, k in fact.blocks(module).items()})
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


def is_padded(module: nn.Module) -> bool:
    """A padded module (a leaf of :func:`~hftc.frontends.symbolic.trace_with_leaves`)."""
    return isinstance(module, PaddedModule)


def widths_key(model: nn.Module) -> str:
    """Equal for two models that ``pad_widths=True`` may pad into one array: the same
    module paths and classes, the same tensor names and ranks, whatever their widths."""
    return repr(([(p, type(m).__qualname__) for p, m in model.named_modules()],
                 [(n, t.dim()) for n, t in _tensors(model).items()]))


def weight_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The Linear / Conv / Embedding weights' shapes: their entries count the arithmetic
    (per output position) that padding multiplies."""
    return {f"{p}.weight" if p else "weight": m.weight.shape
            for p, m in model.named_modules() if _counts_weight(m)}


def _counts_weight(module: nn.Module) -> bool:
    """Its ``weight``'s entries count its arithmetic, as its rule declares
    (``Widens(weight=True)``: a Linear's, Conv's, Embedding's)."""
    fact = widens_of(module)
    return fact is not None and fact.weight


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
    """Same module paths and classes (an elementwise module may differ: a ReLU in one model,
    a Tanh in another, a differing op to the fusion), same tensor names and ranks, or a
    MismatchError."""
    def classes(model: nn.Module) -> dict[str, Any]:
        return {p: "elementwise" if is_elementwise_module(m) else type(m)
                for p, m in model.named_modules()}

    paths0 = classes(models[0])
    tensors0 = _tensors(models[0])
    for i, model in enumerate(models[1:], start=1):
        paths = classes(model)
        if paths != paths0:
            differing = {p for p in paths.keys() | paths0.keys()
                         if paths.get(p) != paths0.get(p)}
            path = sorted(differing)[0]
            diff = (path, type((model if path in paths else models[0]).get_submodule(path)))
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


def _width_attributes(module: nn.Module) -> dict[str, object]:
    """A module's plain int and int-tuple attributes (``normalized_shape``,
    ``num_features``): a norm without parameters has its width only there."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and (
        type(v) is int or (type(v) is tuple and all(type(e) is int for e in v)))}


def _padded_module(path: str, index: int, module: nn.Module, others: Sequence[nn.Module],
                   widths: dict[str, Sequence[int]], blocks: dict[str, int]
                   ) -> nn.Module | None:
    """The padded module for model ``index``'s ``module`` (``others``: every model's at
    this path), as its rule pads it (``@rule(..., widens=Widens(...))``), or None where no
    model's module holds a tensor of its own narrower than the widest.  ``blocks`` gets
    the tensors padded block by block (name -> blocks)."""
    fact = widens_of(module)
    if all(tuple(s) == tuple(widths[n]) for m in others for n, s in _own_shapes(m).items()) \
            and (fact is None or not fact.attributes or all(
                _width_attributes(m) == _width_attributes(module) for m in others)):
        return None
    own = _own_shapes(module)
    where = f"model {index}'s module `{path or '<root>'}` ({type(module).__name__})"
    if fact is not None:
        if fact.blocks is not None:
            blocks.update(fact.blocks(module))
        return fact.pad(module, others, widths, where)
    if type(module).__module__.startswith("torch.nn"):
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: its tensors "
            + ", ".join(f"`{n}` {tuple(own[n])}" for n in own
                        if tuple(own[n]) != tuple(widths[n]))
            + " differ in width from the widest model's, and hftc pads only "
            + ", ".join(widened_modules()) + " among torch.nn's layers. Give every "
            "model the same widths there", [type(module).__name__])
    # The model's own module holding tensors of its own (minGPT's pos_emb, nanoGPT's
    # LayerNorm weight): padded with zeros, gradients masked; its forward's ops over a
    # padded dim are hftc.module.padding_graph's, the first-call check judges the rest.
    return padded_modules.widened(module, widths)


def pad_models(models: Sequence[nn.Module]) -> tuple[list[nn.Module], WidthPadding | None]:
    """Each model rebuilt at the widest model's widths (see the module docstring), and
    the plan; the models themselves when every tensor already has one shape (None)."""
    own_shapes = [{n: t.shape for n, t in _tensors(m).items()} for m in models]
    if all(s == own_shapes[0] for s in own_shapes):
        # One width: nothing to pad, and the ordinary fusion judges what differs (n_head at
        # one d_model, a ReLU in one model where another has a GELU), not the padding's
        # stricter same-layers check
        return list(models), None
    _check_same_structure(models)
    padded_shapes = {name: torch.Size(max(dims) for dims in zip(*(s[name] for s in own_shapes)))
                     for name in own_shapes[0]}
    paths = [p for p, _ in models[0].named_modules()]
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
        name for name in padded_shapes if name.rpartition(".")[2] == "weight"
        and _counts_weight(models[0].get_submodule(name.rpartition(".")[0])))
    return padded_models, plan





__all__ = ["WidthPadding", "into_padded", "is_padded", "mask_padded_gradients",
           "own_part", "pad_models", "padding_ratio", "weight_shapes", "width_blocks",
           "widths_key"]
