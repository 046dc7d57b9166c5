"""Linear layers and matrix products: N GEMMs are one batched GEMM.

::

    before (per model i):  y_i = x_i @ W_i^T + b_i              W_i: [out, in]
    after, batched x:      y   = baddbmm(b[:, None], x.view(N, M, in), W.transpose(1, 2))
    after, shared x:       y   = baddbmm(b[:, None], x.expand(N, M, in), W.transpose(1, 2))
                           (the broadcast is a view), or as one GEMM:
                           y   = F.linear(x, W.view(N*out, in), b.view(N*out))

``x @ W`` with a parameter, ``torch.matmul``/``bmm``/``mm`` between activations
go through :func:`~hftc.lowering.runtime.linear.matmul`, which pads per-model batch
dims after the model dim so broadcasting stays within each model.

``torch.einsum`` gets one more index, the model dim, on its per-model operands and
its result: ``einsum("bhid,bhjd->bhij", q, k)`` -> ``einsum("Abhid,Abhjd->Abhij", q, k)``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..frontends.export import Emitter, aten_name
from ..ir import bind_arguments
from ..lowering.runtime import linear as rt_linear
from . import padded
from .registry import CONTRACTS, ChainLink, FusionGroup, GraphBuilder, NotFusable, Widens, rule

aten = torch.ops.aten


#: Lowerings of ``runtime.linear.linear`` a linear chain can run (``None``: the cost
#: model's, decided on the shapes at run time; the chain falls back to the layers one by
#: one where that is none of these).
CHAINABLE_LOWERINGS = (None, "baddbmm", "baddbmm_t")


def chained_linear(node: fx.Node, root: nn.Module) -> bool:
    """Is this fused node a linear a chain may take (:mod:`hftc.lowering.chains`)?"""
    return (node.op == "call_function" and node.target is rt_linear.linear
            and len(node.args) == 3 and "x_batched" in node.kwargs
            and set(node.kwargs) <= {"x_batched", "lowering"}
            and node.kwargs.get("lowering") in CHAINABLE_LOWERINGS)


def widened_linear(linear: nn.Linear, others, widths, where) -> nn.Module:
    """``nn.Linear`` at the widest ``in_features`` / ``out_features`` (pad_widths=True)."""
    out_features, in_features = widths["weight"]
    return padded.widened(linear, widths, in_features=in_features, out_features=out_features)


@rule(("call_module", nn.Linear), ("call_function", F.linear), aten={aten.linear: F.linear},
      chain=ChainLink("linear", chained_linear), widens=Widens(widened_linear, weight=True),
      # F.linear(x, w) contracts x's last dim (a Linear subclass's own forward calls it);
      # an nn.Linear over a padded dim is padding's own padded module
      padding=lambda node: CONTRACTS if node.op == "call_function" else None)
def fuse_linear(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    a = group.arguments(builder, F.linear)
    x, bias = a["input"], a["bias"]
    return builder.call(
        rt_linear.linear, x, builder.broadcast(a["weight"]),
        None if bias is None else builder.broadcast(bias), x_batched=builder.is_batched(x),
    )


def add_product(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
    """``addmm(b, x, w, beta, alpha)`` -> ``beta * b + alpha * (x @ w)``: the product is a
    matmul (fused as one batched GEMM), the bias an elementwise add."""
    bound = bind_arguments(e.source.target, args, kwargs)
    # (input, mat1, mat2) / (input, batch1, batch2) / (input, mat, vec): the operands by order
    bias, a, b = list(bound.values())[:3]
    beta, alpha = bound["beta"], bound["alpha"]
    product = e.call(torch.matmul, a, b)
    if aten_name(e) == "addbmm":
        product = e.call(torch.sum, product, 0)
    if alpha != 1:
        product = e.call(torch.mul, product, alpha)
    if beta == 0:
        return product
    if beta != 1:
        bias = e.call(torch.mul, bias, beta)
    return e.call(torch.add, bias, product)


@rule(
    ("call_function", torch.matmul), ("call_function", operator.matmul),
    ("call_method", "matmul"), ("call_method", "__matmul__"),
    ("call_function", torch.bmm), ("call_method", "bmm"),
    ("call_function", torch.mm), ("call_method", "mm"),
    ("call_function", torch.mv), ("call_method", "mv"),
    ("call_function", torch.sparse.mm),
    aten={**dict.fromkeys((aten.addmm, aten.baddbmm, aten.addbmm, aten.addmv), add_product),
          aten._sparse_mm: torch.sparse.mm},
    # over a padded dim: the first operand's padding zeroed where it is contracted (not
    # known for a matrix-vector or sparse product: refused)
    padding=lambda node: None if node.target in (torch.mv, "mv", torch.sparse.mm) else CONTRACTS,
)
def fuse_matmul(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """Every spelling of a matrix product, sparse operands included (``torch.spmm`` is
    traced as ``torch.mm``; ``torch.sparse.mm`` keeps its sparse operand's gradient sparse)."""
    if len(group.args) > 2 or group.kwargs:  # torch.sparse.mm(a, b, reduce="amax")
        raise NotFusable("a product with a reduction other than the sum")
    a, b = group.args[0], group.args[1]
    sparse = {"sparse_gradient": True} if group.node.target is torch.sparse.mm else {}
    return builder.call(
        rt_linear.matmul, a, b, a_batched=builder.is_batched(a), b_batched=builder.is_batched(b),
        **sparse)


_EINSUM_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def batched_equation(equation: str, batched: list[bool]) -> str:
    """``equation`` with a fresh index for the model dim on the ``batched`` operands and
    on the result (which is then explicit: ``"ij,jk"`` means ``"ij,jk->ik"``)::

        batched_equation("b i d, b j d -> b i j", [True, False]) == "Abid,bjd->Abij"
    """
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(batched):
        raise NotFusable(f"einsum equation {equation!r} for {len(batched)} operands")
    if not arrow:  # implicit: the indices used once, in order, after any ellipsis
        letters = inputs.replace(".", "").replace(",", "")
        output = ("..." if "..." in inputs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    model = next(c for c in _EINSUM_LETTERS if c not in equation)
    terms = [model + t if b else t for t, b in zip(terms, batched)]
    return ",".join(terms) + "->" + model + output


@rule(("call_function", torch.einsum))
def fuse_einsum(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.einsum(equation, *operands)`` (or a list of operands) as one einsum."""
    equation, *operands = group.args
    if not isinstance(equation, str) or group.kwargs:
        raise NotFusable("einsum in the sublist form")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    batched = [builder.is_batched(op) for op in operands]
    return builder.call(torch.einsum, batched_equation(equation, batched), *operands)
