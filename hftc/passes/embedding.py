"""Embedding lookups and PReLU: layers whose parameters index or scale per model.

::

    embedding:  table [N, V, D] -> [N*V, D]; model n's indices + n*V; one F.embedding
    prelu:      where(x > 0, x, slope[n] * x) with each model's own slopes
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedOperatorError
from ..frontends.export import Emitter
from ..ir import bind_arguments
from ..lowering.runtime import embedding as rt_embedding
from ..lowering.runtime import spatial as rt_spatial
from ..match import describe_node
from . import padded
from .registry import FusionGroup, GraphBuilder, Widens, rule

aten = torch.ops.aten


def _refuse_sparse(group: FusionGroup) -> None:
    """A sparse gradient cannot flow back into a stacked table: neither through the
    ``[N*V, D]`` reshape nor through a per-model ``select`` (torch has no sparse kernel
    for their backward), and the fused optimizers update dense gradients."""
    message = (f"{describe_node(group.node)}: an embedding with sparse=True cannot be "
               f"fused (its sparse gradient cannot reach the stacked [N, V, D] table); use "
               f"sparse=False: the same values, with a dense gradient")
    raise UnsupportedOperatorError(message, [message])


def embedding_as_functional(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``aten.embedding(weight, indices, padding_idx=-1, scale_grad, sparse)`` ->
    ``F.embedding(indices, weight, padding_idx or None, ...)``, bound by name."""
    a = bind_arguments(e.source.target, args, kwargs)
    padding_idx = None if a["padding_idx"] == -1 else a["padding_idx"]
    return e.call(F.embedding, a["indices"], a["weight"], padding_idx, None, 2.0,
                  a["scale_grad_by_freq"], a["sparse"])


def widened_embedding(embedding: nn.Embedding, others, widths, where) -> nn.Module:
    """``nn.Embedding`` at the widest vocabulary and width (pad_widths=True)."""
    if embedding.max_norm is not None or embedding.sparse:
        raise UnsupportedOperatorError(
            f"pad_widths=True cannot pad {where}: max_norm / sparse=True. Give every "
            f"model the same embedding widths", [type(embedding).__name__])
    num_embeddings, embedding_dim = widths["weight"]
    return padded.widened(embedding, widths, num_embeddings=num_embeddings,
                          embedding_dim=embedding_dim)


@rule(("call_module", nn.Embedding), ("call_function", F.embedding),
      aten={aten.embedding: embedding_as_functional},
      widens=Widens(widened_embedding, weight=True))
def fuse_embedding(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = group.arguments(builder, F.embedding)
    idx = a["input"]
    if a["sparse"]:
        _refuse_sparse(group)
    return builder.call(
        rt_embedding.embedding, idx, builder.broadcast(a["weight"]), a["padding_idx"],
        a["max_norm"], a["norm_type"], a["scale_grad_by_freq"], a["sparse"],
        indices_batched=builder.is_batched(idx),
    )


@rule(("call_module", nn.PReLU), ("call_function", F.prelu), aten={aten.prelu: F.prelu})
def fuse_prelu(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = group.arguments(builder, F.prelu)
    x = a["input"]
    return builder.call(rt_spatial.prelu, x, builder.broadcast(a["weight"]),
                        x_batched=builder.is_batched(x))
