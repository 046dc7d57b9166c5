"""Fused recurrent kernels: N models' (and both directions') time steps as one batched GEMM.

Per layer, the two directions of a bidirectional RNN join the model dim (``N*D``
"models"), so::

    per model, per direction, per step t:   gates = W_ih x_t + b_ih + W_hh h + b_hh
    fused, per layer:  xproj = baddbmm(b_ih, x, W_ih^T)        [N*D, T, B, G*H]  (all steps)
                       per step: gates = baddbmm(b_hh, h, W_hh^T) + xproj[:, t]
                       -> one bmm per time step for all N models and directions

(the reverse direction reads ``xproj`` flipped in time).  A shared input (a
sweep's batch) is broadcast over the models for the first projection (or, with the
``gemm`` lowering, is one GEMM with ``N*D*G*H`` outputs).
Gate formulas follow ATen's CPU cells (``aten/src/ATen/native/RNN.cpp``):

- LSTM (i, f, g, o): ``c' = f*c + i*g``, ``h' = o*tanh(c')`` (then ``W_hr h'`` with ``proj_size``)
- GRU (r, z, n): ``n = tanh(x_n + r*(W_hn h + b_hn))``, ``h' = n + z*(h - n)``
- RNN: ``h' = tanh|relu(x + W_hh h + b_hh)``

Between layers, dropout (training only) draws each model's own mask.

An LSTM on the CPU with many rows per step (batch x hidden >= 2048) runs instead as
ATen's LSTM one by one (:func:`_aten_lstm_one_by_one`), whose oneDNN backward
computes each weight gradient over all the steps at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .layout import expand_models
from .linear import linear
from .random import dropout as dropout_kernel
from .random import per_model_dropout

GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _bmm_bias(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``h @ W^T + b`` for ``h [M, B, H]``, ``W [M, G, H]``, ``b [M, G]``."""
    if bias is None:
        return torch.bmm(h, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))


def cell_step(mode: str, gates_x: Tensor, h: Tensor, c: Tensor | None, w_hh: Tensor,
              b_hh: Tensor | None, w_hr: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """One step of M cells at once: ``gates_x`` ``[M, B, G*H]`` (input projection incl. bias),
    ``h`` ``[M, B, Hout]``, ``c`` ``[M, B, H]`` (LSTM).  Returns ``(h', c')``."""
    gates_h = _bmm_bias(h, w_hh, b_hh)
    if mode == "LSTM":
        i, f, g, o = (gates_x + gates_h).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if w_hr is not None:
            h = torch.bmm(h, w_hr.transpose(1, 2))
        return h, c
    if mode == "GRU":
        xr, xz, xn = gates_x.chunk(3, dim=-1)
        hr, hz, hn = gates_h.chunk(3, dim=-1)
        r = torch.sigmoid(hr + xr)
        z = torch.sigmoid(hz + xz)
        n = torch.tanh(xn + hn * r)
        return (h - n) * z + n, None
    pre = gates_x + gates_h
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


def _layer_weights(weights: Sequence[Tensor], layer: int, num_directions: int, has_biases: bool,
                   proj: bool) -> list[list[Tensor | None]]:
    """``[w_ih, w_hh, b_ih, b_hh, w_hr]`` per direction of one layer (``_flat_weights`` order)."""
    per = 2 + 2 * has_biases + proj
    out = []
    for d in range(num_directions):
        chunk = list(weights[(layer * num_directions + d) * per:][:per])
        w_ih, w_hh = chunk[0], chunk[1]
        b_ih, b_hh = (chunk[2], chunk[3]) if has_biases else (None, None)
        w_hr = chunk[-1] if proj else None
        out.append([w_ih, w_hh, b_ih, b_hh, w_hr])
    return out


def _join(parts: Sequence[Tensor | None]) -> Tensor | None:
    """Per-direction stacked tensors ``[N, ...]`` -> ``[N*D, ...]`` (model-major)."""
    if parts[0] is None:
        return None
    if len(parts) == 1:
        return parts[0]
    return torch.stack(list(parts), dim=1).flatten(0, 1)


#: Rows per step (batch x hidden) from which ATen's LSTM, one by one, beats the batched
#: recurrence on the CPU (docs/BENCHMARKS.md, "EfficientNet's blocks and the word
#: language model").
_ATEN_LSTM_MIN_ROWS_X_HIDDEN = 2048


def _aten_lstm_wins(mode: str, input: Tensor, weights: Sequence[Tensor], proj: bool,
                    unbatched: bool, batch_first: bool, input_batched: bool) -> bool:
    """ATen's CPU LSTM (oneDNN) computes each weight gradient as one GEMM over all the
    steps; the batched recurrence computes one per step over the batch's rows, which
    loses to N ATen LSTMs once those rows are many (docs/DESIGN_NOTES.md); GRU's
    batched recurrence wins at every size measured."""
    if mode != "LSTM" or proj or unbatched or input.device.type != "cpu":
        return False
    if torch.is_autocast_enabled("cpu") or not weights[0].dtype.is_floating_point:
        return False
    rows = input.shape[int(input_batched) + (0 if batch_first else 1)]
    return rows * weights[1].shape[-1] >= _ATEN_LSTM_MIN_ROWS_X_HIDDEN


def _aten_lstm_one_by_one(
    input: Tensor, hx: Sequence[Tensor] | None, weights: Sequence[Tensor], has_biases: bool,
    num_layers: int, dropout: float | tuple[float, ...], training: bool, bidirectional: bool,
    batch_first: bool, *, input_batched: bool, hx_batched: Sequence[bool], flat_states: bool,
) -> tuple:
    """N LSTMs as ``nn.LSTM.forward`` runs each: ATen's ``lstm`` on model i's slice of the
    stacked weights (so each model's values, gradients and dropout draws are its own
    LSTM's), the results stacked ``[N, ...]``."""
    n = weights[0].shape[0]

    def per_model(t: Tensor, batched: bool = True) -> Sequence[Tensor]:
        # unbind, not t[i]: each select's backward wrote a zero gradient of all N models
        return t.unbind(0) if batched else [t] * n

    inputs, params = per_model(input, input_batched), [per_model(w) for w in weights]
    rates = dropout if isinstance(dropout, tuple) else (dropout,) * n
    states = None if hx is None else [per_model(s, b) for s, b in zip(hx, hx_batched)]
    outputs, h_n, c_n = [], [], []
    for i, x in enumerate(inputs):
        batch = x.shape[0 if batch_first else 1]
        if states is None:
            size = (num_layers * (2 if bidirectional else 1), batch, weights[1].shape[-1])
            h0 = c0 = torch.zeros(size, dtype=x.dtype, device=x.device)
        else:
            h0, c0 = states[0][i], states[1][i]
        out, h, c = torch._VF.lstm(x, (h0, c0), [w[i] for w in params], has_biases,
                                   num_layers, rates[i], training, bidirectional, batch_first)
        outputs.append(out)
        h_n.append(h)
        c_n.append(c)
    output, h_n, c_n = torch.stack(outputs), torch.stack(h_n), torch.stack(c_n)
    return (output, h_n, c_n) if flat_states else (output, (h_n, c_n))


def _state_dtype(mode: str, input: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the recurrence's states run in: the weights', or under autocast ATen's."""
    dtype = weight.dtype
    if dtype.is_floating_point and torch.is_autocast_enabled(weight.device.type):
        if mode == "LSTM":
            # ATen's autocast runs lstm in its lower precision (states included): a float32
            # cell state kept the fused recurrence, and its outputs, in float32.
            return torch.get_autocast_dtype(weight.device.type)
        if mode == "GRU" and input.is_floating_point():
            # gru is not on autocast's lists: ATen runs it at its input's precision (a bf16
            # input from an autocast layer gives bf16 states and outputs).
            return input.dtype
    return dtype


def rnn(
    mode: str, input: Tensor, hx: Tensor | Sequence[Tensor] | None, weights: Sequence[Tensor],
    has_biases: bool, num_layers: int, dropout: float | tuple[float, ...], training: bool,
    bidirectional: bool, batch_first: bool, *, input_batched: bool,
    hx_batched: Sequence[bool], flat_states: bool = False,
) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
    """N ``nn.LSTM``/``GRU``/``RNN`` modules (or ``torch.lstm`` calls) as one recurrence.

    ``weights`` are the stacked ``[N, ...]`` parameters in ``_flat_weights`` order;
    ``hx`` is ``None``, a tensor (GRU/RNN) or ``(h0, c0)`` (LSTM), each batched or
    shared per ``hx_batched``.  Returns ``(output, h_n)`` / ``(output, (h_n, c_n))``
    with the model dim first, as ``nn.LSTM`` returns them per model
    (``flat_states``: ``(output, h_n, c_n)``, as ``torch.lstm`` does).  ``dropout``
    (between layers, training only) is one rate or each model's, a tuple of N.
    """
    n = weights[0].shape[0]
    d = 2 if bidirectional else 1
    per = len(weights) // (num_layers * d)
    proj = mode == "LSTM" and per == 2 + 2 * has_biases + 1
    unbatched = input.dim() - input_batched == 2
    if _aten_lstm_wins(mode, input, weights, proj, unbatched, batch_first, input_batched):
        return _aten_lstm_one_by_one(input, hx, weights, has_biases, num_layers, dropout,
                                    training, bidirectional, batch_first,
                                    input_batched=input_batched, hx_batched=hx_batched,
                                    flat_states=flat_states)
    x = input
    if unbatched:
        x = x.unsqueeze(1 + int(input_batched))
    elif batch_first:
        x = x.transpose(int(input_batched), int(input_batched) + 1)
    x_batched = input_batched  # x: [N, T, B, I] or shared [T, B, I]
    bsz = x.shape[int(x_batched) + 1]
    hidden = weights[1].shape[-1]  # W_hh: [N, G*H, Hout]
    cell_size = weights[0].shape[1] // GATES[mode]
    dtype, device = _state_dtype(mode, input, weights[0]), weights[0].device
    states: list[Tensor | None] = []
    hx_parts = [] if hx is None else ([hx] if isinstance(hx, Tensor) else list(hx))
    for k, size in enumerate([hidden, cell_size][: 2 if mode == "LSTM" else 1]):
        if hx is None:
            states.append(torch.zeros(n, num_layers * d, bsz, size, dtype=dtype, device=device))
            continue
        h0 = hx_parts[k]
        if h0.is_floating_point() and h0.dtype != dtype and dtype != weights[0].dtype:
            h0 = h0.to(dtype)  # (the autocast dtype above)
        if not hx_batched[k]:
            h0 = expand_models(h0, n)
        if unbatched:
            h0 = h0.unsqueeze(2)
        states.append(h0)

    finals: list[list[Tensor]] = [[] for _ in states]
    for layer in range(num_layers):
        w = _layer_weights(weights, layer, d, has_biases, proj)
        w_ih, w_hh, b_ih, b_hh, w_hr = (_join([w[k][j] for k in range(d)]) for j in range(5))
        # input projection for every step: [N*D, T, B, G*H]
        if x_batched:
            xs = x if d == 1 else x.unsqueeze(1).expand(n, d, *x.shape[1:]).flatten(0, 1)
            xproj = linear(xs, w_ih, b_ih, x_batched=True)
        else:
            xproj = linear(x, w_ih, b_ih, x_batched=False)
        if d == 2:
            xproj = xproj.unflatten(0, (n, d))
            xproj = torch.stack([xproj[:, 0], xproj[:, 1].flip(1)], dim=1).flatten(0, 1)
        h = states[0][:, layer * d:(layer + 1) * d].flatten(0, 1)
        c = states[1][:, layer * d:(layer + 1) * d].flatten(0, 1) if mode == "LSTM" else None
        outs = []
        # unbind, not xproj[:, t]: each select's backward wrote a zero [N*D, T, B, G*H]
        # gradient and autograd summed the T of them (T^2 traffic); unbind's is one stack.
        for gates_x in xproj.unbind(1):
            h, c = cell_step(mode, gates_x, h, c, w_hh, b_hh, w_hr)
            outs.append(h)
        out = torch.stack(outs, dim=1)  # [N*D, T, B, Hout]
        if d == 2:
            out = out.unflatten(0, (n, d))
            out = torch.cat([out[:, 0], out[:, 1].flip(1)], dim=-1)  # [N, T, B, 2*Hout]
        x, x_batched = out, True
        finals[0].append(h.unflatten(0, (n, d)))
        if mode == "LSTM":
            finals[1].append(c.unflatten(0, (n, d)))
        if training and layer < num_layers - 1:
            if isinstance(dropout, tuple):  # each model its own rate
                x = per_model_dropout(x, dropout, True)
            elif dropout > 0:
                x = dropout_kernel(x, dropout)
    h_n = [torch.cat(f, dim=1) for f in finals]  # [N, L*D, B, H]
    output = x
    if unbatched:
        output = output.squeeze(2)
        h_n = [s.squeeze(2) for s in h_n]
    elif batch_first:
        output = output.transpose(1, 2)
    if flat_states:
        return (output, *h_n)
    if mode == "LSTM":
        return output, (h_n[0], h_n[1])
    return output, h_n[0]


def rnn_cell(
    mode: str, input: Tensor, hx: Tensor | Sequence[Tensor] | None, w_ih: Tensor, w_hh: Tensor,
    b_ih: Tensor | None, b_hh: Tensor | None, *, input_batched: bool,
    hx_batched: Sequence[bool],
) -> Tensor | tuple[Tensor, Tensor]:
    """N ``nn.LSTMCell``/``GRUCell``/``RNNCell`` (or ``torch.lstm_cell`` ...) steps as one."""
    n = w_ih.shape[0]
    hidden = w_hh.shape[-1]
    unbatched = input.dim() - input_batched == 1
    gates_x = linear(input, w_ih, b_ih, x_batched=input_batched)  # [N, (B,) G*H]
    if unbatched:
        gates_x = gates_x.unsqueeze(1)
    bsz = gates_x.shape[1]
    parts = [] if hx is None else ([hx] if isinstance(hx, Tensor) else list(hx))
    states = []
    for k in range(2 if mode == "LSTM" else 1):
        if hx is None:
            states.append(torch.zeros(n, bsz, hidden, dtype=gates_x.dtype, device=gates_x.device))
            continue
        s = parts[k] if hx_batched[k] else expand_models(parts[k], n)
        states.append(s.unsqueeze(1) if unbatched else s)
    h, c = cell_step(mode, gates_x, states[0], states[1] if mode == "LSTM" else None, w_hh, b_hh)
    if unbatched:
        h = h.squeeze(1)
        c = c.squeeze(1) if c is not None else None
    return (h, c) if mode == "LSTM" else h
