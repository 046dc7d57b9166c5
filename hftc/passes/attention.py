"""Attention: ``nn.MultiheadAttention``, ``F.scaled_dot_product_attention`` and the
``nn.Transformer*`` family, fused as batched matmuls over ``N*B*H`` heads.

Per module, the choice between a rule on the leaf and tracing through:

| module                        | how it fuses                                                   |
|-------------------------------|----------------------------------------------------------------|
| ``nn.MultiheadAttention``     | leaf, one rule: ``runtime.attention.multi_head_attention``   |
| ``F.scaled_dot_product_attention`` | rule: the model dim folded into the batch, one SDPA call  |
| ``nn.TransformerEncoderLayer``| traced through (its slow path): attention leaf, linears, norms  |
| ``nn.TransformerDecoderLayer``| traced through (its own forward)                               |
| ``nn.TransformerEncoder``     | traced through, + the nested-tensor fast path's zeros, explicit |
| ``nn.TransformerDecoder`` / ``nn.Transformer`` | traced through (shape checks dropped)          |

::

    before (per model i, self-attention, shared x [L, B, E]):
        q, k, v = linear(x, W_in_i, b_in_i).chunk(3)         # N GEMMs
        softmax(q_h k_h^T / sqrt(d) + mask) v_h  for each of B*H heads
        y_i = linear(., W_out_i, b_out_i)
    after:
        qkv = linear(x, W_in.view(N*3E, E))                   # one GEMM, [N, L, B, 3E]
        one bmm / softmax / bmm (or one SDPA) over N*B*H heads
        y = baddbmm(b_out, ., W_out^T)                        # [N, L, B, E]

The encoder's and encoder layer's fast paths (``torch._transformer_encoder_layer_fwd``,
nested tensors) are never taken silently: the traced forwards are the slow
paths, which compute the same numbers, except that the encoder's nested-tensor
path returns zeros at padded positions; :func:`encoder_nested_padding` makes
that explicit and checks at run time, per model, whether PyTorch would have
taken it (eval mode, no autograd, a left-aligned padding mask, ...).  The traced
forwards live with the front-end that reads them (``hftc.frontends.symbolic.TRACEABLE_FORWARDS``);
this file holds the rules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedOperatorError
from ..frontends.symbolic import encoder_nested_padding
from ..ir import ArgKey, bind_arguments
from ..lowering.runtime import attention as rt_attention
from . import padded
from .registry import ATTENDS, FusionGroup, GraphBuilder, NotFusable, Widens, rule


def _bind(group: FusionGroup, fn: Any, *leading: Any) -> tuple[dict, dict]:
    """Fused and original (model 0's) values of a call's arguments, by parameter name
    (``leading``: a method's ``self``)."""
    return (bind_arguments(fn, (*leading, *group.args), group.kwargs),
            bind_arguments(fn, (*leading, *group.node.args), group.node.kwargs))


def _constant(value: Any, what: str) -> Any:
    if isinstance(value, fx.Node):
        raise NotFusable(f"{what} computed in the graph (it must be a Python constant)")
    return value


def packed_projections(mha: nn.Module) -> dict[str, int]:
    """The tensors of ``nn.MultiheadAttention`` padded as three blocks (q, k, v) each."""
    return {name: 3 for name in ("in_proj_weight", "in_proj_bias")
            if getattr(mha, name, None) is not None}


def widened_attention(mha: nn.MultiheadAttention, others, widths, where) -> nn.Module:
    """``nn.MultiheadAttention`` at the widest ``embed_dim`` and ``num_heads`` of an equal
    head dim (pad_widths=True): ``in_proj_weight`` / ``in_proj_bias`` padded as three
    blocks (q, k, v), so that each model's heads are the first of the widest model's and
    the padded heads (q, k, v all zero) add exact zeros through the zero columns of
    ``out_proj``."""
    head_dims = {m.embed_dim // m.num_heads for m in others}
    if not mha._qkv_same_embed_dim or len(head_dims) > 1:
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: "
            + ("kdim / vdim other than embed_dim" if not mha._qkv_same_embed_dim else
               f"the models' head dims differ ({sorted(head_dims)})")
            + "; pad attention of one head dim, q, k and v of embed_dim (more heads for a "
            "wider model)", [type(mha).__name__])
    embed_dim = max(m.embed_dim for m in others)
    return padded.widened(mha, widths, packed_projections(mha), embed_dim=embed_dim,
                          kdim=embed_dim, vdim=embed_dim, num_heads=embed_dim // head_dims.pop())


@rule(("call_module", nn.MultiheadAttention),
      widens=Widens(widened_attention, blocks=packed_projections))
def fuse_multihead_attention(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """N attention modules -> one :func:`~hftc.lowering.runtime.attention.multi_head_attention`."""
    mha = group.module
    fused, original = _bind(group, nn.MultiheadAttention.forward, mha)
    target = group.node.target

    def attr(path: str) -> fx.Node | None:
        owner, _, leaf = f"{target}.{path}".rpartition(".")
        module = mha.get_submodule(owner[len(target) + 1:]) if owner != target else mha
        return None if getattr(module, leaf, None) is None else builder.attr(f"{owner}.{leaf}")

    flags = tuple(builder.is_batched(fused[name]) for name in
                  ("query", "key", "value", "key_padding_mask", "attn_mask"))
    self_attention = original["query"] is original["key"] is original["value"]
    return builder.call(
        rt_attention.multi_head_attention, fused["query"], fused["key"], fused["value"],
        fused["key_padding_mask"], fused["attn_mask"], attr("in_proj_weight"),
        attr("in_proj_bias"), attr("q_proj_weight"), attr("k_proj_weight"),
        attr("v_proj_weight"), attr("bias_k"), attr("bias_v"), attr("out_proj.weight"),
        attr("out_proj.bias"), builder.training_flag(group),
        num_heads=mha.num_heads, dropout=mha.dropout, batch_first=mha.batch_first,
        add_zero_attn=mha.add_zero_attn,
        need_weights=fused["need_weights"], average_attn_weights=fused["average_attn_weights"],
        is_causal=fused["is_causal"],  # flags may be graph values (a traced root's inputs)
        flags=flags, self_attention=self_attention,
    )


@rule(("call_function", F.scaled_dot_product_attention), random=True,
      aten={torch.ops.aten.scaled_dot_product_attention: F.scaled_dot_product_attention},
      per_model=("dropout_p",), padding=ATTENDS)
def fuse_scaled_dot_product_attention(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """The model dim joins the batch dim: one SDPA over ``N*B`` batches (random: dropout)."""
    if group.per_model_values("dropout_p") is not None:
        # one SDPA call takes one rate: models with their own run one by one
        raise NotFusable("a per-model attention dropout rate")
    if ArgKey(keyword="scale") in group.per_model:  # keyword-only: match.SCALAR_KEYWORDS
        # a sweep over the softmax scale (muP's 1 / d against 1 / sqrt(d)): one SDPA call
        # takes one scale, so the models run it one by one, the rest fused
        raise NotFusable("a per-model attention scale")
    fused, _ = _bind(group, F.scaled_dot_product_attention)
    flags = tuple(builder.is_batched(fused[name]) for name in
                  ("query", "key", "value", "attn_mask"))
    dropout_p = _constant(fused["dropout_p"], "dropout_p")
    if not any(flags) and dropout_p == 0:
        return builder.copy(group, batched=False)
    return builder.call(
        rt_attention.scaled_dot_product_attention, fused["query"], fused["key"], fused["value"],
        fused["attn_mask"], dropout_p, _constant(fused["is_causal"], "is_causal"),
        _constant(fused["scale"], "scale"), _constant(fused["enable_gqa"], "enable_gqa"),
        n=builder.num_models, flags=flags,
    )


@rule(("call_function", encoder_nested_padding))
def fuse_encoder_nested_padding(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    output, src, kpm, mask, training, *params = group.args
    return builder.call(
        rt_attention.encoder_nested_padding, output, src, kpm, mask, training, *params,
        **group.kwargs, flags=(builder.is_batched(output), builder.is_batched(src),
                                 builder.is_batched(kpm)), n=builder.num_models,
    )


# --------------------------------------------------------------------------- Swin

#: torchvision's Swin functions (fx-wrapped: leaves of the traced graph) and their
#: stand-ins for machines without torchvision, by name: the passes import neither.
_SWIN_MODULES = ("torchvision.models.swin_transformer", "hftc.bench.torchvision_ops")

_SWA_CONSTANTS = ("window_size", "num_heads", "shift_size", "attention_dropout", "dropout",
                  "training")


@rule(*(("call_function", f"{module}._get_relative_position_bias") for module in _SWIN_MODULES))
def fuse_relative_position_bias(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Every model's bias table gathered at once: ``[N, 1, heads, T, T]``."""
    table, index = group.arg(0, "relative_position_bias_table"), \
        group.arg(1, "relative_position_index")
    window_size = _constant(group.arg(2, "window_size"), "window_size")
    return builder.call(rt_attention.relative_position_bias, builder.broadcast(table), index,
                        tuple(window_size), index_batched=builder.is_batched(index))


@rule(*(("call_function", f"{module}.shifted_window_attention") for module in _SWIN_MODULES),
      random=True)
def fuse_shifted_window_attention(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Swin's window attention as batched matmuls over every model's windows
    (:func:`~hftc.lowering.runtime.attention.shifted_window_attention`); dropout draws per model."""
    fused, _ = _bind(group, group.node.target)  # torchvision's function (or its stand-in)
    constants = {name: _constant(fused[name], name) for name in _SWA_CONSTANTS}
    example = group.arg_example(0)
    if not isinstance(example, torch.Tensor) or example.dim() != 4:
        raise NotFusable("shifted window attention of an input that is not [B, H, W, C]")
    tensors = {name: None if fused[name] is None else builder.broadcast(fused[name])
               for name in ("qkv_weight", "proj_weight", "relative_position_bias", "qkv_bias",
                            "proj_bias", "logit_scale")}
    return builder.call(
        rt_attention.shifted_window_attention, fused["input"], tensors["qkv_weight"],
        tensors["proj_weight"], tensors["relative_position_bias"],
        tuple(constants["window_size"]), constants["num_heads"],
        tuple(constants["shift_size"]), constants["attention_dropout"], constants["dropout"],
        tensors["qkv_bias"], tensors["proj_bias"], tensors["logit_scale"],
        constants["training"], x_batched=builder.is_batched(fused["input"]),
    )
