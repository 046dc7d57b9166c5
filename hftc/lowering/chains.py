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
for bit, a few % faster on the benchmark MLP (docs/DESIGN_NOTES.md).

What stays unchained, so each piece runs as before: a layer whose lowering is not
a batched product (``loop``, ``gemm``, ``einsum``, ``baddbmm_autograd``: autotune's
choice, or the cost model's ``gemm`` for a shared input that needs its gradient),
an intermediate value used twice, any activation but ReLU, and layers on the two
sides of a change of grad mode or autocast (``with torch.no_grad():`` around a frozen
backbone).  At run time the
chain runs its layers one by one (exactly the unchained program) under autocast,
and without the Function where no gradient is recorded.

This module is the graph pass (:func:`chain_linears`); what the rewritten graph calls,
``linear_chain`` and its ``_LinearChain`` Function, is in :mod:`hftc.lowering.runtime.linear`.
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.fx as fx
from torch import nn

from .. import ir
from ..passes.registry import chain_links
from .runtime import linear as rt_linear
from .runtime import reduction as rt_reduction
from .runtime import spatial as rt_spatial


def _is_linear(node: fx.Node) -> bool:
    """A fused linear a chain may take, as its rule declares (``@rule(chain=ChainLink("linear",
    ...))``: :func:`hftc.passes.linear.chained_linear`)."""
    return any(link.accepts(node, None) for link in chain_links("linear"))


def _is_relu(node: fx.Node, root: nn.Module) -> bool:
    """A ReLU between two linears, as its rules declare (``@rule(chain=ChainLink("relu",
    ...))``: :func:`hftc.passes.elementwise.chained_relu`)."""
    return any(link.accepts(node, root) for link in chain_links("relu"))



def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None



def chain_linears(graph: fx.Graph, root: nn.Module) -> fx.Graph:
    """``graph``, or a copy of it with each chain of two or more linears as one
    :func:`linear_chain` call (see the module docstring for which chain), and each
    remaining linear whose only use is a log-softmax as one :func:`linear_log_softmax`
    call (:func:`_find_log_softmax_tails`)."""
    if not _find_chains(graph, root) and not _find_log_softmax_tails(graph):
        return graph
    graph = deepcopy(graph)
    for links in _find_chains(graph, root):
        linears = [linear for _, linear in links]
        first, last = linears[0], linears[-1]
        with graph.inserting_before(last):
            chain = graph.call_function(
                rt_linear.linear_chain,
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
    for linear, view, log_softmax in _find_log_softmax_tails(graph):
        with graph.inserting_before(log_softmax):
            tail = graph.call_function(
                rt_linear.linear_log_softmax,
                (*linear.args, None if view is None else tuple(view.args[1:]),
                 log_softmax.args[1]),
                {"x_batched": linear.kwargs["x_batched"],
                 "lowering": linear.kwargs.get("lowering")})
        tail.meta = dict(log_softmax.meta)
        log_softmax.replace_all_uses_with(tail)
        for node in (log_softmax, view, linear):
            if node is not None:
                graph.erase_node(node)
    graph.lint()
    return graph


def _find_log_softmax_tails(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node | None, fx.Node]]:
    """``(linear, reshape or None, log_softmax)``: a batched linear whose only use is a
    log-softmax over one dim, through at most one reshape used only there (a language
    model's decoder, ``decoded.view(-1, ntoken)``, ``F.log_softmax(decoded, dim=1)``).
    :func:`~hftc.lowering.runtime.linear.linear_log_softmax` decides at run time, on the shapes,
    whether to run it one by one."""
    tails = []
    for node in graph.nodes:
        if not _is_linear(node) or not node.kwargs.get("x_batched"):
            continue
        view, user = None, _only_user(node)
        if (user is not None and user.op == "call_function" and user.target is rt_spatial.reshape
                and user.args[0] is node and not user.kwargs and len(user.args) >= 2):
            view, user = user, _only_user(user)
        if (user is not None and user.op == "call_function"
                and user.target is rt_reduction.softmax and len(user.args) == 2
                and user.args[0] is (view or node) and isinstance(user.args[1], int)
                and user.kwargs.get("log") is True and user.kwargs.get("dtype") is None
                and set(user.kwargs) <= {"log", "dtype"}
                and not _mode_switch_between(node, user)):
            tails.append((node, view, user))
    return tails



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

