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

from ..lowering.runtime import recurrent as rt_recurrent
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


def rnn_parameters(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                   batch_first):
    """``torch.lstm``'s parameters (and ``torch.gru``'s, ``torch.rnn_tanh``'s ...) for a
    padded input, to bind a call's arguments by (torch gives each function a second schema,
    for a packed sequence's ``data, batch_sizes``)."""


_FUNCTION_MODES = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH",
                   torch.rnn_relu: "RNN_RELU"}


@rule(*(("call_function", fn) for fn in _FUNCTION_MODES))
def fuse_rnn(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.LSTM/GRU/RNN(x, hx)`` and ``torch.lstm(x, hx, params, has_biases, num_layers,
    dropout, train, bidirectional, batch_first)`` (what ``aten.lstm`` becomes) ->
    :func:`~hftc.lowering.runtime.recurrent.rnn` on stacked weights, the arguments bound by
    ``torch.lstm``'s names (a module's: its ``_flat_weights`` and attributes)."""
    module = group.module
    if module is None:
        try:
            a = group.arguments(builder, rnn_parameters)
        except TypeError:
            a = {}
        if not isinstance(a.get("params"), (list, tuple)) or not isinstance(
                a.get("has_biases"), bool):
            raise NotFusable("the packed-sequence overload (data, batch_sizes, ...)")
        mode = _FUNCTION_MODES[group.node.target]
    else:
        weights = [builder.attr(f"{group.node.target}.{name}")
                   for name in module._flat_weights_names]
        rates = group.per_model_values("dropout")  # (a sweep's per-model dropout)
        a = group.arguments(builder, rnn_parameters, params=weights, has_biases=module.bias,
                            dropout=float(module.dropout) if rates is None
                            else tuple(float(r) for r in rates),
                            train=builder.training_flag(group))
        mode = module.mode
    _check_tensor_input(group)
    x, hx = a["input"], a["hx"]
    return builder.call(
        rt_recurrent.rnn, mode, x, hx, [builder.broadcast(p) for p in a["params"]],
        a["has_biases"], a["num_layers"], a["dropout"], a["train"], a["bidirectional"],
        a["batch_first"], input_batched=builder.is_batched(x),
        hx_batched=_hx_flags(group, builder, hx), flat_states=module is None,
    )


#: The modules' rule: each model its own ``dropout`` between layers.
rule(("call_module", nn.LSTM), ("call_module", nn.GRU), ("call_module", nn.RNN),
     per_model=("dropout",))(fuse_rnn)


_CELL_MODES = {nn.LSTMCell: "LSTM", nn.GRUCell: "GRU"}
_CELL_FUNCTIONS = {torch.lstm_cell: "LSTM", torch.gru_cell: "GRU",
                   torch.rnn_tanh_cell: "RNN_TANH", torch.rnn_relu_cell: "RNN_RELU"}


@rule(("call_module", nn.LSTMCell), ("call_module", nn.GRUCell), ("call_module", nn.RNNCell),
      *(("call_function", fn) for fn in _CELL_FUNCTIONS))
def fuse_rnn_cell(group: FusionGroup, builder: GraphBuilder) -> fx.Node:
    """``nn.LSTMCell/GRUCell/RNNCell(x, hx)`` and ``torch.lstm_cell(x, [h, c], w_ih, w_hh,
    b_ih, b_hh)`` and kin -> :func:`~hftc.lowering.runtime.recurrent.rnn_cell`, the arguments bound
    by ``torch.lstm_cell``'s names (a module's weights are its ``weight_ih`` ...)."""
    module = group.module
    if module is None:
        mode = _CELL_FUNCTIONS[group.node.target]
        a = group.arguments(builder, group.node.target)
    else:
        mode = next((v for k, v in _CELL_MODES.items() if isinstance(module, k)), None)
        if mode is None:
            mode = "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"
        attr = lambda name: builder.module_attr(group, name)  # noqa: E731
        a = group.arguments(builder, torch.lstm_cell, w_ih=attr("weight_ih"),
                            w_hh=attr("weight_hh"), b_ih=attr("bias_ih"), b_hh=attr("bias_hh"))
    optional = lambda t: None if t is None else builder.broadcast(t)  # noqa: E731
    x, hx = a["input"], a["hx"]
    return builder.call(
        rt_recurrent.rnn_cell, mode, x, hx, builder.broadcast(a["w_ih"]),
        builder.broadcast(a["w_hh"]), optional(a["b_ih"]), optional(a["b_hh"]),
        input_batched=builder.is_batched(x), hx_batched=_hx_flags(group, builder, hx),
    )
