"""Linear chains: consecutive fused linears (and the ReLUs between them) as one autograd node.

A fused MLP runs each layer as its own op: one Python ``autograd.Function`` per
linear, one autograd node per ReLU and per view, each with its Python and engine
cost on every forward and backward.  At a sweep's sizes that fixed cost is a good
part of the step.  Codegen therefore rewrites a chain of batched linears into one
call::

    before:  h = linear(x, W1, b1); h = relu(h); h = linear(h, W2, b2); h = relu(h)
             y = linear(h, W3, b3)                      (3 Functions + 2 ReLU nodes)
    after:   y = linear_chain(x, (W1, W2, W3), (b1, b2, b3),
                              activations=('relu', 'relu'), lowerings=(...))
                                                         (1 Function)

``_LinearChain`` runs the very ops the separate layers run, in the same order
(``baddbmm`` per layer, ``relu``; backward ``threshold_backward``, ``bmm`` for the
weight and input gradients, ``sum`` for the bias), so the results are the same bit
for bit.  The benchmark MLP (64-128-128-10, batch 64) at N = 32, forward + loss +
backward, the same fused module with and without chains (medians of 31 interleaved
rounds, two runs each): 3.12-3.20 against 3.26-3.33 ms on one core, 1.93-1.96 against
2.00-2.04 ms with two threads.

What stays unchained, so each piece runs as before: a layer whose lowering is not
a batched product (``loop``, ``gemm``, ``einsum``, ``baddbmm_autograd``: autotune's
choice, or the cost model's ``gemm`` for a shared input that needs its gradient),
an intermediate value used twice, any activation but ReLU, and layers on the two
sides of a change of grad mode or autocast (``with torch.no_grad():`` around a frozen
backbone).  At run time the
chain runs its layers one by one (exactly the unchained program) under autocast,
and without the Function where no gradient is recorded.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ir
from . import kernels

#: Lowerings of ``kernels.linear`` a chain can run (``None``: the cost model's, decided
#: on the shapes at run time; the chain falls back to the layers one by one where that
#: is none of these).
_CHAINABLE = (None, "baddbmm", "baddbmm_t")


# --------------------------------------------------------------------------- run time


def linear_chain(x: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...], *,
                 x_batched: bool, activations: tuple[str | None, ...],
                 lowerings: tuple[str | None, ...]) -> Tensor:
    """``linear(relu(... linear(x, W1, b1) ...), Wk, bk)``: k fused linears as one node.

    ``weights[i]`` ``[N, out_i, in_i]``, ``biases[i]`` ``[N, out_i]`` or ``None``;
    ``activations[i]`` (``"relu"`` or ``None``) follows layer ``i`` (k - 1 of them: the
    chain ends with a linear); ``lowerings[i]`` is layer ``i``'s ``kernels.linear``
    lowering.  ``x``: ``[N, *lead, in]`` (``x_batched``) or ``[*lead, in]`` shared.
    """
    transposed = _transposed(x, weights, biases, x_batched, lowerings)
    if transposed is None or torch.is_autocast_enabled(x.device.type):
        return _one_by_one(x, weights, biases, x_batched, activations, lowerings)
    n = weights[0].shape[0]
    x3, lead = kernels.rows_per_model(x, n, x_batched)
    params = [t for pair in zip(weights, biases) for t in pair]
    if torch.is_grad_enabled() and (x3.requires_grad or any(
            p is not None and p.requires_grad for p in params)):
        y = kernels.apply_function_fast(_LinearChain, x3, activations, transposed, *params)[0]
    else:
        y = _forward(x3, params, activations, transposed)[0]
    return y if len(lead) == 1 else y.reshape(n, *lead, y.shape[-1])


def _transposed(x: Tensor, weights, biases, x_batched: bool,
                lowerings) -> tuple[bool, ...] | None:
    """Per layer, whether its product runs transposed (``baddbmm_t``); ``None`` where a
    layer's lowering (the cost model's, for ``None``) is not a batched product."""
    flags = []
    for i, (w, b, lowering) in enumerate(zip(weights, biases, lowerings)):
        if lowering is None:  # the cost model's, as kernels.linear would choose it
            lowering = kernels.linear_lowerings(x, w, b, x_batched=x_batched or i > 0)[0]
        if lowering not in ("baddbmm", "baddbmm_t"):
            return None
        flags.append(lowering == "baddbmm_t")
    return tuple(flags)


def _one_by_one(x, weights, biases, x_batched, activations, lowerings) -> Tensor:
    """The chain as the unchained program runs it: each layer its own ``kernels.linear``."""
    h = x
    for i, (w, b, lowering) in enumerate(zip(weights, biases, lowerings)):
        h = kernels.linear(h, w, b, x_batched=x_batched or i > 0, lowering=lowering)
        if i < len(activations) and activations[i] == "relu":
            h = F.relu(h)
    return h


def _forward(x3: Tensor, params: list[Tensor | None], activations, transposed,
             ) -> tuple[Tensor, list[Tensor]]:
    """The chain's output and each layer's input (``x3``, then the activations)."""
    inputs, h = [], x3
    for i, flag in enumerate(transposed):
        inputs.append(h)
        h = kernels.batched_product(h, params[2 * i], params[2 * i + 1], flag)
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
    that.  Called through :func:`hftc.lowering.kernels.apply_function_fast`.
    """

    @staticmethod
    def forward(x3: Tensor, activations: tuple, transposed: tuple,
                *params: Tensor | None) -> tuple[Tensor, ...]:
        y, inputs = _forward(x3, list(params), activations, transposed)
        return (y, *inputs[1:])

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
                    g = torch.ops.aten.threshold_backward(g, h, 0)
        return (g, None, None, *grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x3: Tensor, activations: tuple, transposed: tuple,
             *params: Tensor | None) -> tuple:
        v, x_dim, param_dims = info.batch_size, in_dims[0], in_dims[3:]
        if all(d is None for d in param_dims):  # [V, N, M, in] -> [N, V*M, in]
            x3 = x3.movedim(x_dim, 1)
            output = kernels.apply_function_fast(
                _LinearChain, x3.flatten(1, 2), activations, transposed, *params)
            return tuple(t.unflatten(1, x3.shape[1:3]) for t in output), (1,) * len(output)

        def models(t: Tensor | None, dim: int | None) -> Tensor | None:  # -> [V*N, ...]
            if t is None:
                return None
            return (t.expand(v, *t.shape) if dim is None else t.movedim(dim, 0)).flatten(0, 1)

        output = kernels.apply_function_fast(
            _LinearChain, models(x3, x_dim), activations, transposed,
            *(models(p, d) for p, d in zip(params, param_dims)))
        return tuple(t.unflatten(0, (v, -1)) for t in output), (0,) * len(output)


def _records_graph(grad: Tensor, x3: Tensor, params: list) -> bool:
    """Whether a backward under ``create_graph=True`` has a graph to record: whether the
    gradient or an input of the chain requires a gradient (``torch.func`` wrappers of a
    finished transform unwrapped, as ops unwrap them)."""
    tensors = kernels._unwrap_dead_wrappers((grad, x3, *params))
    return any(t is not None and t.requires_grad for t in tensors)


def _recomputed_gradients(ctx: Any, grad: Tensor, x3: Tensor, params: list) -> list:
    """The chain's gradients with a graph of their own (``create_graph=True``)."""
    needs = ctx.needs_input_grad
    x3, *params = kernels._unwrap_dead_wrappers((x3, *params))  # (graphed: the live ones)
    inputs = [x3, *params]
    flags = [needs[0], *needs[3:]]
    wanted = [t for t, flag in zip(inputs, flags) if flag]
    with torch.enable_grad():  # the forward again, this time recorded
        y = _forward(x3, params, ctx.activations, ctx.transposed)[0]
        got = iter(torch.autograd.grad(y, wanted, grad, create_graph=True, allow_unused=True))
    out = [next(got) if flag else None for flag in flags]
    return [out[0], None, None, *out[1:]]


# --------------------------------------------------------------------------- the rewrite


def _is_linear(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is kernels.linear
            and len(node.args) == 3 and "x_batched" in node.kwargs
            and set(node.kwargs) <= {"x_batched", "lowering"}
            and node.kwargs.get("lowering") in _CHAINABLE)


def _is_relu(node: fx.Node, root: nn.Module) -> bool:
    if len(node.args) != 1 or set(node.kwargs) - {"inplace"}:
        return False
    if node.op == "call_function":
        return node.target in (F.relu, torch.relu)
    if node.op == "call_method":
        return node.target == "relu"
    if node.op == "call_module":
        return type(root.get_submodule(node.target)) is nn.ReLU
    return False


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def chain_linears(graph: fx.Graph, root: nn.Module) -> fx.Graph:
    """``graph``, or a copy of it with each chain of two or more linears as one
    :func:`linear_chain` call (see the module docstring for which chain)."""
    if not _find_chains(graph, root):
        return graph
    graph = deepcopy(graph)
    for links in _find_chains(graph, root):
        linears = [linear for _, linear in links]
        first, last = linears[0], linears[-1]
        with graph.inserting_before(last):
            chain = graph.call_function(
                linear_chain,
                (first.args[0], tuple(n.args[1] for n in linears),
                 tuple(n.args[2] for n in linears)),
                {"x_batched": first.kwargs["x_batched"],
                 "activations": tuple(None if a is None else "relu" for a, _ in links[1:]),
                 "lowerings": tuple(n.kwargs.get("lowering") for n in linears)},
            )
        chain.meta = dict(last.meta)
        last.replace_all_uses_with(chain)
        for activation, linear in reversed(links):  # users before what they use
            graph.erase_node(linear)
            if activation is not None:
                graph.erase_node(activation)
    graph.lint()
    return graph


def _find_chains(graph: fx.Graph, root: nn.Module) -> list[list[tuple[fx.Node | None, fx.Node]]]:
    """Each chain as ``[(None, linear_0), (relu_0_or_None, linear_1), ...]``: every linear
    with the ReLU node before it, if any; two linears or more."""
    chains, taken = [], set()
    for node in graph.nodes:
        if node in taken or not _is_linear(node):
            continue
        links = [(None, node)]
        while True:
            step = _link(links[-1][1], root)
            if step is None:
                break
            links.append(step)
        if len(links) >= 2:
            chains.append(links)
            taken.update(linear for _, linear in links)
    return chains


def _link(linear: fx.Node, root: nn.Module) -> tuple[fx.Node | None, fx.Node] | None:
    """(the ReLU node or None, the next linear) where ``linear``'s only user leads there."""
    user = _only_user(linear)
    if user is None:
        return None
    activation = None
    if _is_relu(user, root):
        activation, user = user, _only_user(user)
        if user is None:
            return None
    source = linear if activation is None else activation
    if _is_linear(user) and user.args[0] is source and user.kwargs.get("x_batched") \
            and not _mode_switch_between(linear, user):
        return activation, user
    return None


#: Nodes that change how the ops after them run: a chain runs its layers in one mode.
_MODE_SWITCHES = (torch._C._set_grad_enabled, ir.enter_autocast, ir.exit_autocast)


def _mode_switch_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether grad mode or autocast changes between ``first`` and ``last`` (graph order).

    ``with torch.no_grad(): h = backbone(x)`` then ``head(h)``: chained, the frozen
    backbone ran with the head after grad was back on, and got gradients (a frozen
    feature extractor trained); a layer before an autocast region ran inside it."""
    node = first.next
    while node is not last and node.op != "root":
        if node.op == "call_function" and node.target in _MODE_SWITCHES:
            return True
        node = node.next
    return False
