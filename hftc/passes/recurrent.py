"""Recurrent layers: N LSTMs/GRUs/RNNs are one recurrence, one batched GEMM per time step.

::

    before (per model i):  out_i, (h_i, c_i) = lstm_i(x, (h0_i, c0_i))     N recurrences
    after:                 out, (h, c) = rnn("LSTM", x, (h0, c0), [W_ih, W_hh, b_ih, b_hh]
                                             stacked [N, ...], ...)          one recurrence:
                           xproj = baddbmm over all steps; per step one baddbmm for N*D cells

Both front-ends meet here: ``nn.LSTM`` & co. are leaves of the symbolic
front-end (``call_module``), and ``torch.export`` gives ``aten.lstm.input``,
normalised to ``torch.lstm`` (the function ``nn.LSTM`` calls), whose
parameter list holds the same stacked tensors.  Packed sequences
(``nn.utils.rnn.pack_padded_sequence``, a graph node of the tracer) run as per-model
loops (reported).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..runtime import recurrent as rt_recurrent
from .registry import FusionGroup, GraphBuilder, NotFusable, rule


def _hx_flags(group: FusionGroup, builder: GraphBuilder, hx: Any) -> tuple[bool, ...]:
    """Per part of the initial state ``hx``: does it carry the model dim?

    ``hx`` is a tensor, a tuple of nodes (``rnn(x, (h0, c0))``) or one node whose value
    is a tuple (``rnn(x, state)`` with ``state`` a forward input or another LSTM's
    returned ``(h, c)``): such a node's parts are all per-model or all shared."""
    if hx is None:
        return ()
    if isinstance(hx, (tuple, list)):
        return tuple(builder.is_batched(p) for p in hx)
    example = group.arg_example(1 if len(group.node.args) > 1 else "hx")
    parts = len(example) if isinstance(example, (tuple, list)) else 1
    return (builder.is_batched(hx),) * parts


def _check_tensor_input(group: FusionGroup) -> None:
    if not isinstance(group.arg_example(0), torch.Tensor):
        raise NotFusable("packed sequences (PackedSequence) are not fused")


@rule(("call_module", nn.LSTM), ("call_module", nn.GRU), ("call_module", nn.RNN))
def fuse_rnn_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.LSTM/GRU/RNN(x, hx)`` -> :func:`~hftc.runtime.recurrent.rnn` on stacked weights."""
    _check_tensor_input(group)
    m = group.module
    x, hx = group.arg(0, "input"), group.arg(1, "hx")
    weights = [builder.attr(f"{group.node.target}.{name}") for name in m._flat_weights_names]
    return builder.call(
        rt_recurrent.rnn, m.mode, x, hx, weights, m.bias, m.num_layers, float(m.dropout),
        builder.training_flag(group), m.bidirectional, m.batch_first,
        input_batched=builder.is_batched(x), hx_batched=_hx_flags(group, builder, hx),
    )


_FUNCTION_MODES = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH",
                   torch.rnn_relu: "RNN_RELU"}


@rule(*(("call_function", fn) for fn in _FUNCTION_MODES))
def fuse_rnn_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.lstm(x, hx, params, has_biases, layers, dropout, train, bidir, batch_first)``."""
    args = group.args
    if len(args) != 9 or not isinstance(args[2], (list, tuple)):
        raise NotFusable("the packed-sequence overload (data, batch_sizes, ...)")
    _check_tensor_input(group)
    x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
    mode = _FUNCTION_MODES[group.node.target]
    if mode != "LSTM":
        hx_flags = (builder.is_batched(hx),)
    else:
        hx_flags = _hx_flags(group, builder, hx)
    return builder.call(
        rt_recurrent.rnn, mode, x, hx, [builder.broadcast(p) for p in params], has_biases, layers,
        dropout, train, bidirectional, batch_first, input_batched=builder.is_batched(x),
        hx_batched=hx_flags, flat_states=True,
    )


_CELL_MODES = {nn.LSTMCell: "LSTM", nn.GRUCell: "GRU"}


@rule(("call_module", nn.LSTMCell), ("call_module", nn.GRUCell),
               ("call_module", nn.RNNCell))
def fuse_rnn_cell_module(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    m = group.module
    mode = next((v for k, v in _CELL_MODES.items() if isinstance(m, k)), None)
    if mode is None:
        mode = "RNN_TANH" if m.nonlinearity == "tanh" else "RNN_RELU"
    x, hx = group.arg(0, "input"), group.arg(1, "hx")
    attr = lambda name: builder.module_attr(group, name)  # noqa: E731
    return builder.call(
        rt_recurrent.rnn_cell, mode, x, hx, attr("weight_ih"), attr("weight_hh"), attr("bias_ih"),
        attr("bias_hh"), input_batched=builder.is_batched(x),
        hx_batched=_hx_flags(group, builder, hx),
    )


_CELL_FUNCTIONS = {torch.lstm_cell: "LSTM", torch.gru_cell: "GRU",
                   torch.rnn_tanh_cell: "RNN_TANH", torch.rnn_relu_cell: "RNN_RELU"}


@rule(*(("call_function", fn) for fn in _CELL_FUNCTIONS))
def fuse_rnn_cell_function(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``torch.lstm_cell(x, [h, c], w_ih, w_hh, b_ih, b_hh)`` and the GRU/RNN cells."""
    args = list(group.args) + [None] * (6 - len(group.args))
    x, hx, w_ih, w_hh, b_ih, b_hh = args[:6]
    optional = lambda t: None if t is None else builder.broadcast(t)  # noqa: E731
    return builder.call(
        rt_recurrent.rnn_cell, _CELL_FUNCTIONS[group.node.target], x, hx, builder.broadcast(w_ih),
        builder.broadcast(w_hh), optional(b_ih), optional(b_hh),
        input_batched=builder.is_batched(x), hx_batched=_hx_flags(group, builder, hx),
    )
