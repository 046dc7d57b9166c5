"""Fused linear algebra: N models' ``nn.Linear`` / ``matmul`` as batched products,
and chains of them as one autograd node.

::

    before:  y_n = x_n @ W_n.T + b_n                 for n in 0..N-1
    after:   y = linear(x, W, b)  ->  baddbmm(b[:, None], x3, W.transpose(1, 2))  (or another
             lowering of ``linear_lowerings``: gemm, einsum, loop, ...)

A chain of batched linears and the ReLUs between them (rewritten by
:func:`hftc.lowering.chains.chain_linears`) runs as one ``autograd.Function``::

    before:  h = linear(x, W1, b1); h = relu(h); h = linear(h, W2, b2)   (2 Functions + ReLU)
    after:   y = linear_chain(x, (W1, W2), (b1, b2), activations=('relu',), lowerings=(...))

``_LinearChain`` runs the very ops the separate layers run, in the same order, so the
results are the same bit for bit; at run time the chain runs its layers one by one
under autocast, and without the Function where no gradient is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .function_apply import apply_function_fast, unwrap_dead_wrappers
from .layout import batched_gradient, pad_model_dims
from .tuning import check_lowering, tunable


def linear_lowerings(x: Tensor, weight: Tensor, bias: Tensor | None, *,
                     x_batched: bool) -> list[str]:
    """:func:`linear`'s lowerings, the cost model's choice first.

    Batched input: ``baddbmm`` (one batched GEMM whose weight gradient comes out
    in the weight's layout, :class:`_BatchedLinear`), ``baddbmm_t`` (the same, with
    the forward product computed transposed, ``(W @ x^T)^T``), ``baddbmm_autograd``
    (the product with autograd's own backward), ``einsum`` (``torch.einsum`` picks the
    product's layout and backward), ``loop`` (N ``F.linear``).
    Shared input: ``baddbmm`` (the input broadcast to ``[N, M, in]`` without a copy,
    then as batched), ``gemm`` (one ``F.linear`` with ``N*out`` outputs, viewed as
    ``[N, *lead, out]``) or ``loop``.  The cost model puts ``baddbmm`` first: the
    products cost the same, but ``gemm``'s output is a permuted view of
    ``[M, N*out]`` memory that every following op reads strided, and its gradient
    must be copied back into that layout; with ``baddbmm`` the layer's output is a
    contiguous ``[N, M, out]`` (a few % faster per MLP step: docs/DESIGN_NOTES.md).
    Not where the
    shared input needs a gradient of its own: ``gemm``'s is one product, where the
    broadcast's is N products ``[N, M, in]`` summed over the models.

    The cost model puts ``baddbmm_t`` first for narrow outputs (a classifier head):
    CPU BLAS kernels run ``[M, in] @ [in, out]`` with ``out`` of 10 at a third of the
    speed of the transposed product ``[out, in] @ [in, M]``, copy back included
    (docs/DESIGN_NOTES.md), while wide outputs run alike either way.
    """
    if x.is_complex() or weight.is_complex():
        # _BatchedLinear's backward is written for real tensors (no conjugates): a complex
        # layer's weight gradient came out wrong.  Autograd's own backward for complex.
        return ["gemm", "loop"] if not x_batched else ["baddbmm_autograd", "einsum", "loop"]
    if not x_batched:
        return ["gemm", "baddbmm", "loop"] if x.requires_grad else ["baddbmm", "gemm", "loop"]
    if weight.shape[1] < _NARROW_OUTPUT:
        return ["baddbmm_t", "baddbmm", "baddbmm_autograd", "einsum", "loop"]
    return ["baddbmm", "baddbmm_t", "baddbmm_autograd", "einsum", "loop"]


#: Output widths below this take the transposed forward product by default.
_NARROW_OUTPUT = 32


@tunable(linear_lowerings)
def linear(x: Tensor, weight: Tensor, bias: Tensor | None, *, x_batched: bool,
           lowering: str | None = None) -> Tensor:
    """N linears as one batched product (``baddbmm``), or one wide GEMM of a shared input.

    ``weight``: ``[N, out, in]``.  Shared ``x`` ``[*lead, in]``:
    ``F.linear(x, W.view(N*out, in))`` -> ``[*lead, N*out]`` viewed as ``[N, *lead, out]``
    (``gemm``), or ``x`` broadcast to ``[N, M, in]`` (stride 0 over the models) and the
    batched products below.  Batched ``x`` ``[N, *lead, in]`` -> ``[N, M, in]`` and
    ``baddbmm(bias[:, None], x, W^T)``.
    """
    lowering = check_lowering("linear", lowering,
                               linear_lowerings(x, weight, bias, x_batched=x_batched))
    n, out_features, in_features = weight.shape
    if lowering == "loop":
        return torch.stack([F.linear(x[i] if x_batched else x, weight[i],
                                     None if bias is None else bias[i]) for i in range(n)])
    if lowering == "gemm":
        y = F.linear(x, weight.reshape(n * out_features, in_features),
                     bias.flatten() if bias is not None else None)
        return y.unflatten(-1, (n, out_features)).movedim(-2, 0)
    x3, lead = rows_per_model(x, n, x_batched)
    if lowering == "baddbmm_autograd":
        wt = weight.transpose(1, 2)
        y = torch.bmm(x3, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x3, wt)
    elif lowering == "einsum":
        y = torch.einsum("nmi,noi->nmo", x3, weight)
        if bias is not None:
            y = y + bias.unsqueeze(1)
    else:
        y = apply_function_fast(_BatchedLinear, x3, weight, bias, lowering == "baddbmm_t")
    return y if len(lead) == 1 else y.reshape(n, *lead, out_features)


def rows_per_model(x: Tensor, n: int, x_batched: bool) -> tuple[Tensor, torch.Size]:
    """A linear's input as ``[N, M, in]`` rows per model, and its lead dims (the ``M``
    before flattening, to restore on the output).

    Batched ``x`` ``[N, *lead, in]`` is reshaped; a shared ``x`` ``[*lead, in]`` is
    broadcast over the models (stride 0: every model reads the same rows, no copy).
    Reshapes only where the rank differs: a no-op reshape is still a view, and one
    more node for autograd to run on every backward.
    """
    if x_batched:
        return (x if x.dim() == 3 else x.reshape(n, -1, x.shape[-1])), x.shape[1:-1]
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows.expand(n, -1, -1), x.shape[:-1]


class _BatchedLinear(torch.autograd.Function):
    """``baddbmm(b[:, None], x, W^T)`` whose backward gives ``W`` its gradient in ``W``'s layout.

    ::

        autograd's bmm:  dW^T = x^T @ dy   [N, in, out]  -> W.grad = a transposed view
                         -> AccumulateGrad copies it into W's [N, out, in] strides
        here:            dW   = dy^T @ x   [N, out, in]  (the transpose is a GEMM flag)

    The strided copy it saves costs about as much as the product itself for the
    small layers of a sweep (as ``torch.mm``'s backward already avoids for
    ``nn.Linear``).  With ``transposed``, the forward computes
    ``baddbmm(b[:, :, None], W, x^T)`` ``[N, out, M]`` and returns it transposed
    into ``[N, M, out]`` (the backward is the same).  Under autocast the products
    run in the output's dtype and each gradient is cast back to its input's dtype,
    as the recorded casts would do.
    The backward is made of differentiable ops, so double backward works; and of ops
    with vmap rules, so ``torch.func.vmap`` vmaps the forward and backward as they are.
    Called through :func:`apply_function_fast`.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x3: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
        return batched_product(x3, weight, bias, transposed)

    #: Under forward-mode AD (:func:`apply_function_fast`): the forward is stock ops.
    in_plain_ops = forward

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x3, weight, bias, _ = inputs
        ctx.save_for_backward(x3, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x3, weight = ctx.saved_tensors
        dtype = grad.dtype
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if dtype == x3.dtype == weight.dtype:  # no autocast: no casts (each a call per step)
            if need_x:
                grad_x = torch.bmm(grad, weight)
            if need_w:
                grad_w = torch.bmm(grad.transpose(1, 2), x3)
        else:
            if need_x:
                grad_x = torch.bmm(grad, weight.to(dtype)).to(x3.dtype)
            if need_w:
                grad_w = torch.bmm(grad.transpose(1, 2), x3.to(dtype)).to(weight.dtype)
        if ctx.bias_dtype is not None and need_b:
            grad_b = grad.sum(1)
            if grad_b.dtype != ctx.bias_dtype:
                grad_b = grad_b.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def batched_product(x3: Tensor, weight: Tensor, bias: Tensor | None,
                    transposed: bool = False) -> Tensor:
    """``x3 @ W^T + b`` per model (``[N, M, in]``, ``[N, out, in]`` -> ``[N, M, out]``), or
    with ``transposed`` as ``(W @ x3^T + b)^T``, made contiguous."""
    if transposed:
        xt = x3.transpose(1, 2)
        yt = torch.bmm(weight, xt) if bias is None else torch.baddbmm(
            bias.unsqueeze(2), weight, xt)
        # Contiguous, as nn.Linear's output is: model code may .view() it.  A copy also
        # where the transpose is contiguous already (one row or one output feature): a view
        # returned by _BatchedLinear could not be modified in place (`h.relu_()`).
        return yt.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    wt = weight.transpose(1, 2)
    return torch.bmm(x3, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), x3, wt)


def matmul(a: Tensor, b: Tensor, *, a_batched: bool, b_batched: bool,
           sparse_gradient: bool = False) -> Tensor:
    """Per-model ``torch.matmul(a, b)`` (also ``bmm``, ``mm`` and ``@``) with either operand
    shared.

    1-D operands become matrices (and the added dim is dropped after); batched
    operands get their per-model batch dims padded after the model dim so that
    ``torch.matmul``'s broadcasting lines up per model, not across models.
    A sparse operand goes to :func:`sparse_matmul` (``torch.matmul``'s broadcasting views
    a sparse tensor with ``as_strided``, which sparse tensors do not have); its product is
    ``torch.sparse.mm`` with ``sparse_gradient`` (the models' call: the sparse operand's
    gradient sparse as it is), else ``torch.mm``.
    """
    if a.layout is not torch.strided or b.layout is not torch.strided:
        return sparse_matmul(a, b, a_batched=a_batched, b_batched=b_batched,
                             product=torch.sparse.mm if sparse_gradient else torch.mm)
    a_nd = a.dim() - a_batched
    b_nd = b.dim() - b_batched
    if a_nd == 1:
        a = a.unsqueeze(-2)
    if b_nd == 1:
        b = b.unsqueeze(-1)
    rank = max(a.dim() - a_batched, b.dim() - b_batched)
    if a_batched:
        a = pad_model_dims(a, rank)
    if b_batched:
        b = pad_model_dims(b, rank)
    if a_batched and not b_batched:
        b = b.unsqueeze(0) if b.dim() == rank else b
    if b_batched and not a_batched:
        a = a.unsqueeze(0) if a.dim() == rank else a
    y = torch.matmul(a, b)
    if b_nd == 1:
        y = y.squeeze(-1)
    if a_nd == 1:
        y = y.squeeze(-2 if b_nd != 1 else -1)
    return y


def sparse_matmul(a: Tensor, b: Tensor, *, a_batched: bool, b_batched: bool,
                  product: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Per-model ``product(a, b)`` (``torch.mm`` or ``torch.sparse.mm``) where an operand is
    sparse.  A sparse matrix all models share times a stacked dense one is one product,
    the models' columns side by side (graph convolution's ``torch.spmm(adj, support)``)::

        adj [n, k] sparse, support [N, k, f]
            -> adj @ support.permute(1, 0, 2).reshape(k, N*f)  [n, N*f]  -> [N, n, f]

    and a stacked dense matrix times a shared sparse one is one product over the models'
    rows: ``x [N, m, k] -> x.reshape(N*m, k) @ W -> [N, m, f]``.  Each output element sums
    the same terms in the same order as the model's own product, so the values are the
    models' bit for bit; gradients flow through the dense side's reshape (and to a shared
    sparse operand that requires one, summed over the models as their N products give it).
    A sparse operand per model (stacked), or anything but matrices, runs one by one.
    """
    a_sparse, b_sparse = a.layout is not torch.strided, b.layout is not torch.strided
    n = a.shape[0] if a_batched else b.shape[0] if b_batched else None
    if n is None:  # (both shared: the driver computes such a product once, as it is)
        return product(a, b)
    if a_sparse and not b_sparse and not a_batched and a.dim() == 2 and b.dim() == 3:
        k, f = b.shape[1:]
        columns = product(a, b.permute(1, 0, 2).reshape(k, n * f))
        return columns.reshape(a.shape[0], n, f).permute(1, 0, 2)
    if b_sparse and not a_sparse and not b_batched and b.dim() == 2 and a.dim() == 3:
        m, k = a.shape[1:]
        return product(a.reshape(n * m, k), b).reshape(n, m, b.shape[1])
    return torch.stack([product(a[i] if a_batched else a, b[i] if b_batched else b)
                        for i in range(n)])


def linear_chain(x: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...], *,
                 x_batched: bool, activations: tuple[str | None, ...],
                 lowerings: tuple[str | None, ...]) -> Tensor:
    """``linear(relu(... linear(x, W1, b1) ...), Wk, bk)``: k fused linears as one node.

    ``weights[i]`` ``[N, out_i, in_i]``, ``biases[i]`` ``[N, out_i]`` or ``None``;
    ``activations[i]`` (``"relu"`` or ``None``) follows layer ``i`` (k - 1 of them: the
    chain ends with a linear); ``lowerings[i]`` is layer ``i``'s ``linear``
    lowering.  ``x``: ``[N, *lead, in]`` (``x_batched``) or ``[*lead, in]`` shared.
    """
    transposed = _transposed(x, weights, biases, x_batched, lowerings)
    if transposed is None or torch.is_autocast_enabled(x.device.type):
        return _one_by_one(x, weights, biases, x_batched, activations, lowerings)
    n = weights[0].shape[0]
    x3, lead = rows_per_model(x, n, x_batched)
    params = [t for pair in zip(weights, biases) for t in pair]
    if torch.is_grad_enabled() and (x3.requires_grad or any(
            p is not None and p.requires_grad for p in params)):
        y = apply_function_fast(_LinearChain, x3, activations, transposed, *params)[0]
    else:
        y = _forward(x3, params, activations, transposed)[0]
    return y if len(lead) == 1 else y.reshape(n, *lead, y.shape[-1])


def _transposed(x: Tensor, weights, biases, x_batched: bool,
                lowerings) -> tuple[bool, ...] | None:
    """Per layer, whether its product runs transposed (``baddbmm_t``); ``None`` where a
    layer's lowering (the cost model's, for ``None``) is not a batched product."""
    flags = []
    for i, (w, b, lowering) in enumerate(zip(weights, biases, lowerings)):
        if lowering is None:  # the cost model's, as linear would choose it
            lowering = linear_lowerings(x, w, b, x_batched=x_batched or i > 0)[0]
        if lowering not in ("baddbmm", "baddbmm_t"):
            return None
        flags.append(lowering == "baddbmm_t")
    return tuple(flags)


def _one_by_one(x, weights, biases, x_batched, activations, lowerings) -> Tensor:
    """The chain as the unchained program runs it: each layer its own ``linear``."""
    h = x
    for i, (w, b, lowering) in enumerate(zip(weights, biases, lowerings)):
        h = linear(h, w, b, x_batched=x_batched or i > 0, lowering=lowering)
        if i < len(activations) and activations[i] == "relu":
            h = F.relu(h)
    return h


def _forward(x3: Tensor, params: list[Tensor | None], activations, transposed,
             ) -> tuple[Tensor, list[Tensor]]:
    """The chain's output and each layer's input (``x3``, then the activations)."""
    inputs, h = [], x3
    for i, flag in enumerate(transposed):
        inputs.append(h)
        h = batched_product(h, params[2 * i], params[2 * i + 1], flag)
        if i < len(activations) and activations[i] == "relu":
            h = h.relu_()  # its own fresh output: in place, as no one else sees it
    return h, inputs


class _LinearChain(torch.autograd.Function):
    """The chain forward and backward, one autograd node (see the module docstring).

    Backward, layer by layer from the last (``g`` the gradient of layer i's output)::

        dW_i = g^T @ h_i    db_i = g.sum(1)    g = g @ W_i, then threshold_backward(g,
        h_i, 0) where a ReLU made h_i (as autograd's ReluBackward)

    A double backward (``create_graph=True``) recomputes the chain with autograd and
    differentiates that (so does the backward under ``torch.func.grad``, which always
    differentiates with ``create_graph=True``), where the gradient or the chain's
    inputs require a gradient: else (``torch.func.jacrev``'s cotangents, under vmap, of
    a finished ``vjp``) there is no graph to record, and the backward is the one above.

    The forward returns ``(y, *hidden)``, the chain's output and each later layer's input,
    which the backward reads (``setup_context``, which ``torch.func`` transforms need, sees
    only inputs and outputs); the hidden ones are non-differentiable, callers take
    ``[0]``.  Under ``torch.func.vmap`` the vmapped dim joins the rows (``[N, V*M, in]``:
    each row's layers are its own) or, where the weights are vmapped too (an ensemble
    of weights per sample), the models (``[V*N, M, in]``), and the chain runs once on
    that.  Called through :func:`apply_function_fast`.
    """

    @staticmethod
    def forward(x3: Tensor, activations: tuple, transposed: tuple,
                *params: Tensor | None) -> tuple[Tensor, ...]:
        y, inputs = _forward(x3, list(params), activations, transposed)
        return (y, *inputs[1:])

    #: Under forward-mode AD (:func:`apply_function_fast`): the forward is stock ops (its
    #: in-place ReLUs on the products' fresh outputs, which forward mode differentiates).
    in_plain_ops = forward

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # (no zeros made for the hidden outputs)
        ctx.save_for_backward(inputs[0], *inputs[3:], *output[1:])
        ctx.activations, ctx.transposed = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        x3, *saved = ctx.saved_tensors
        params, hidden = saved[:2 * len(ctx.transposed)], saved[2 * len(ctx.transposed):]
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled() and _records_graph(grad, x3, params):
            return (*_recomputed_gradients(ctx, grad, x3, params),)
        grads: list[Tensor | None] = [None] * len(params)
        g = grad
        for i in reversed(range(len(ctx.transposed))):
            w, b = params[2 * i], params[2 * i + 1]
            h = x3 if i == 0 else hidden[i - 1]
            if needs[3 + 2 * i]:
                grads[2 * i] = torch.bmm(g.transpose(1, 2), h)
            if b is not None and needs[4 + 2 * i]:
                grads[2 * i + 1] = g.sum(1)
            if i == 0:
                g = torch.bmm(g, w) if needs[0] else None
            else:
                g = torch.bmm(g, w)
                if ctx.activations[i - 1] == "relu":
                    g = _relu_backward_into(g, h)
        return (g, None, None, *grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x3: Tensor, activations: tuple, transposed: tuple,
             *params: Tensor | None) -> tuple:
        v, x_dim, param_dims = info.batch_size, in_dims[0], in_dims[3:]
        if all(d is None for d in param_dims):  # [V, N, M, in] -> [N, V*M, in]
            x3 = x3.movedim(x_dim, 1)
            output = apply_function_fast(
                _LinearChain, x3.flatten(1, 2), activations, transposed, *params)
            return tuple(t.unflatten(1, x3.shape[1:3]) for t in output), (1,) * len(output)

        def models(t: Tensor | None, dim: int | None) -> Tensor | None:  # -> [V*N, ...]
            if t is None:
                return None
            return (t.expand(v, *t.shape) if dim is None else t.movedim(dim, 0)).flatten(0, 1)

        output = apply_function_fast(
            _LinearChain, models(x3, x_dim), activations, transposed,
            *(models(p, d) for p, d in zip(params, param_dims)))
        return tuple(t.unflatten(0, (v, -1)) for t in output), (0,) * len(output)


def _relu_backward_into(g: Tensor, h: Tensor) -> Tensor:
    """ReLU's backward, ``threshold_backward(g, h, 0)``, written over ``g`` (the chain's
    own fresh product, which nothing else reads): the same values, without a new
    ``[N, M, width]`` tensor each layer (its pages cost about as much as the pass).
    Out of place under torch.func transforms and torch.compile, which take no ``out=``."""
    if torch.compiler.is_compiling() or batched_gradient(g):
        return torch.ops.aten.threshold_backward(g, h, 0)
    return torch.ops.aten.threshold_backward.grad_input(g, h, 0, grad_input=g)


def _records_graph(grad: Tensor, x3: Tensor, params: list) -> bool:
    """Whether a backward under ``create_graph=True`` has a graph to record: whether the
    gradient or an input of the chain requires a gradient (``torch.func`` wrappers of a
    finished transform unwrapped, as ops unwrap them)."""
    tensors = unwrap_dead_wrappers((grad, x3, *params))
    return any(t is not None and t.requires_grad for t in tensors)


def _recomputed_gradients(ctx: Any, grad: Tensor, x3: Tensor, params: list) -> list:
    """The chain's gradients with a graph of their own (``create_graph=True``)."""
    needs = ctx.needs_input_grad
    x3, *params = unwrap_dead_wrappers((x3, *params))  # (graphed: the live ones)
    inputs = [x3, *params]
    flags = [needs[0], *needs[3:]]
    wanted = [t for t, flag in zip(inputs, flags) if flag]
    with torch.enable_grad():  # the forward again, this time recorded
        y = _forward(x3, params, ctx.activations, ctx.transposed)[0]
        got = iter(torch.autograd.grad(y, wanted, grad, create_graph=True, allow_unused=True))
    out = [next(got) if flag else None for flag in flags]
    return [out[0], None, None, *out[1:]]


def linear_log_softmax(x: Tensor, weight: Tensor, bias: Tensor | None, shape: tuple | None,
                       dim: int, *, x_batched: bool, lowering: str | None = None) -> Tensor:
    """``softmax(reshape(linear(x, W, b), *shape), dim, log=True)``: a fused decoder and
    its log-softmax, one by one where the logits are large (``shape`` None: no reshape).

    ::

        before:  logits = baddbmm(b, x, W^T)            [N, M, out], then log_softmax over it
        after:   for each model n: out[n] = log_softmax(addmm(b_n, x_n, W_n^T))
                 backward, for each n: d = log_softmax_backward(g[n], out[n]);
                 dx_n = d @ W_n, dW_n = d^T @ x_n, db_n = d.sum(0)

    One model's logits (a language model's ``[T*B, vocabulary]``, megabytes) are still in
    the cache when its log-softmax reads them and when its GEMMs read its gradient; all N
    models' at once are not, and each of these memory-bound passes over them took about
    twice as long per byte as the serial loop's (docs/BENCHMARKS.md, lstm_lm).  Taken where
    :func:`_one_by_one_log_softmax` says so; elsewhere (and with a ``lowering`` autotune
    chose) the unchanged ops, :func:`linear` then :func:`~hftc.lowering.runtime.reduction.softmax`.
    Same formulas as ``F.linear`` + ``F.log_softmax`` per model (the serial loop's
    ``addmm``), so results agree with the batched product within a rounding.
    """
    from .reduction import softmax
    from .spatial import reshape

    rows = _one_by_one_log_softmax(x, weight, bias, shape, dim, x_batched, lowering)
    if rows is None:
        y = linear(x, weight, bias, x_batched=x_batched, lowering=lowering)
        return softmax(y if shape is None else reshape(y, *shape), dim, log=True)
    y = apply_function_fast(_PerModelLinearLogSoftmax, x.reshape(x.shape[0], rows, -1),
                            weight, bias)
    return y.reshape(x.shape[:-1] + (weight.shape[1],)) if shape is None else reshape(y, *shape)


#: The per-model schedule of :func:`linear_log_softmax` where one model's logits take at
#: least this many bytes (smaller ones stay in the cache batched, and N small GEMMs lose
#: to one batched product) and all N models' at least ``_PER_MODEL_TOTAL_BYTES``.
_PER_MODEL_BLOCK_BYTES = 512 * 1024
_PER_MODEL_TOTAL_BYTES = 4 * 1024 * 1024


def _one_by_one_log_softmax(x: Tensor, weight: Tensor, bias: Tensor | None, shape: tuple | None,
                           dim: int, x_batched: bool, lowering: str | None) -> int | None:
    """Each model's row count ``M`` where :func:`linear_log_softmax` runs one by one,
    else None: the CPU, float32/64 alike, no autocast, ``torch.func`` or ``torch.compile``
    (the Function's backward writes into preallocated outputs), the cost model's lowering,
    a batched input, and a log-softmax over the logits' last dim."""
    n, out_features, _ = weight.shape
    if (not x_batched or lowering is not None or x.device.type != "cpu"
            or x.dtype not in (torch.float32, torch.float64) or weight.dtype != x.dtype
            or (bias is not None and bias.dtype != x.dtype) or x.dim() < 3
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()):
        return None
    rows = math.prod(x.shape[1:-1])
    if shape is None:
        last_dim = x.dim() - 1
    else:
        from .spatial import shape_arg

        target = shape_arg(shape)
        # Only a reshape that keeps each row of logits a row (its last size given).
        if not target or target[-1] != out_features:
            return None
        last_dim = len(target)
    if dim % (last_dim + 1) != last_dim:
        return None
    block = rows * out_features * x.element_size()
    if n < 2 or block < _PER_MODEL_BLOCK_BYTES or n * block < _PER_MODEL_TOTAL_BYTES:
        return None
    return rows


class _PerModelLinearLogSoftmax(torch.autograd.Function):
    """``log_softmax(x3[n] @ W[n]^T + b[n])`` one by one (:func:`linear_log_softmax`).

    ``x3`` ``[N, M, in]``, ``W`` ``[N, out, in]``, ``b`` ``[N, out]`` -> ``[N, M, out]``.
    The backward runs ATen's ``_log_softmax_backward_data`` and the GEMMs per model into
    preallocated gradients; under ``create_graph`` it computes the same in
    differentiable whole-tensor ops (log_softmax's ``g - exp(y) * g.sum(-1)``), so a
    double backward works.
    """

    @staticmethod
    def forward(x3: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        n, rows, _ = x3.shape
        out = x3.new_empty(n, rows, weight.shape[1])
        for i in range(n):
            logits = (torch.mm(x3[i], weight[i].t()) if bias is None
                      else torch.addmm(bias[i], x3[i], weight[i].t()))
            torch._log_softmax(logits, 1, False, out=out[i])
        return out

    @staticmethod
    def in_plain_ops(x3: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The forward in differentiable ops, for forward-mode AD (:func:`apply_function_fast`)."""
        logits = torch.bmm(x3, weight.transpose(1, 2)) if bias is None else torch.baddbmm(
            bias.unsqueeze(1), x3, weight.transpose(1, 2))
        return F.log_softmax(logits, -1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x3, weight, bias = inputs
        ctx.save_for_backward(x3, weight, output)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x3, weight, out = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        need_b = need_b and ctx.has_bias
        # create_graph, or gradients vmap batches (no out=): differentiable ops
        if torch.is_grad_enabled() or batched_gradient(grad):
            d = grad - out.exp() * grad.sum(-1, keepdim=True)
            return (torch.bmm(d, weight) if need_x else None,
                    torch.bmm(d.transpose(1, 2), x3) if need_w else None,
                    d.sum(1) if need_b else None)
        grad_x = torch.empty_like(x3) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = x3.new_empty(weight.shape[:2]) if need_b else None
        for i in range(x3.shape[0]):
            d = torch._log_softmax_backward_data(grad[i], out[i], 1, out.dtype)
            if need_x:
                torch.mm(d, weight[i], out=grad_x[i])
            if need_w:
                torch.mm(d.t(), x3[i], out=grad_w[i])
            if need_b:
                torch.sum(d, 0, out=grad_b[i])
        return grad_x, grad_w, grad_b
