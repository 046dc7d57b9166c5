"""Recurrent layers fused across models: LSTM, GRU, RNN and their cells.

Equivalence (float64, forward, every gradient, returned states) over a grid of
layers, directions, batch_first, initial states given or not, shared or stacked
inputs; structure: one fused recurrence, nothing run model by model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from equivalence import check_equivalence
from torch.nn.utils.rnn import pad_packed_sequence

import hftc

N = 3
T, B, IN, H = 4, 2, 3, 5


class Recurrent(nn.Module):
    """One LSTM/GRU/RNN, initial states given or not, states returned."""

    def __init__(self, cls, with_state: bool, **kwargs):
        super().__init__()
        self.rnn = cls(IN, H, **kwargs)
        self.with_state = with_state

    def forward(self, x, h0, c0):
        if not self.with_state:
            return self.rnn(x)
        if isinstance(self.rnn, nn.LSTM):
            return self.rnn(x, (h0, c0))
        return self.rnn(x, h0)


GRID = [
    dict(),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=2, batch_first=True, bias=False),
    dict(bidirectional=True, batch_first=True),
    dict(num_layers=3, dropout=0.0),
]


def _inputs(kwargs, cls, stacked: bool):
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    x = torch.randn(B, T, IN) if kwargs.get("batch_first") else torch.randn(T, B, IN)
    hout = kwargs.get("proj_size", 0) or H
    h0, c0 = torch.randn(layers, B, hout), torch.randn(layers, B, H)
    if stacked:
        x, h0, c0 = (torch.stack([t + k for k in range(N)]) for t in (x, h0, c0))
    return x, h0, c0


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("kwargs", GRID, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default")
def test_recurrent_grid(cls, kwargs):
    for with_state, stacked in ((False, False), (True, True)):
        models = [Recurrent(cls, with_state, **kwargs) for _ in range(N)]
        inputs = _inputs(kwargs, cls, stacked)
        fused = check_equivalence(models, inputs, in_dims=0 if stacked else None)
        assert fused.fusion_report.fallbacks == []
        assert fused.fusion_report.rule_counts()["fuse_rnn"] == 1


def test_lstm_projection_relu_rnn_and_unbatched():
    models = [Recurrent(nn.LSTM, True, proj_size=2, num_layers=2, bidirectional=True)
              for _ in range(N)]
    check_equivalence(models, _inputs(dict(proj_size=2, num_layers=2, bidirectional=True),
                                      nn.LSTM, False))
    models = [Recurrent(nn.RNN, True, nonlinearity="relu", num_layers=2) for _ in range(N)]
    check_equivalence(models, _inputs(dict(num_layers=2), nn.RNN, False), train=False)
    # unbatched input [T, IN] with state [layers, H]
    models = [Recurrent(nn.GRU, True, num_layers=2) for _ in range(N)]
    check_equivalence(models, (torch.randn(T, IN), torch.randn(2, H), torch.randn(2, H)))


def test_dropout_between_layers():
    """Dropout between layers: exact in eval; in train each model draws its own masks."""
    models = [Recurrent(nn.LSTM, False, num_layers=2, dropout=0.5) for _ in range(N)]
    x = torch.randn(T, B, IN)
    check_equivalence(models, (x, None, None), train=False)
    fused = hftc.fuse(models)
    for m in models:
        m.load_state_dict(models[0].state_dict())
    fused = hftc.fuse(models).train()
    out, _ = fused(x, None, None)
    assert not torch.allclose(out[0], out[1])  # same weights, different dropout masks


class Cells(nn.Module):
    """LSTMCell, GRUCell and RNNCell unrolled over time."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTMCell(IN, H)
        self.gru = nn.GRUCell(IN, H, bias=False)
        self.rnn = nn.RNNCell(IN, H, nonlinearity="relu")

    def forward(self, xs, h0):
        h, c = h0, h0
        g = r = None
        outs = []
        for t in range(T):  # unrolled by tracing
            h, c = self.lstm(xs[t], (h, c))
            g = self.gru(xs[t], g)
            r = self.rnn(xs[t], r)
            outs.append(h + g + r)
        return torch.stack(outs), c, self.lstm(xs[0][0])


def test_cells():
    xs, h0 = torch.randn(T, B, IN), torch.randn(B, H)
    fused = check_equivalence([Cells() for _ in range(N)], (xs, h0))
    assert fused.fusion_report.fallbacks == []
    counts = fused.fusion_report.rule_counts()
    assert counts["fuse_rnn_cell"] == 3 * T + 1


class LSTMClassifier(nn.Module):
    """An embedding, a 2-layer bidirectional LSTM (or GRU) and a linear head."""

    def __init__(self, vocab=20, classes=4, cls=nn.LSTM):
        super().__init__()
        self.embed = nn.Embedding(vocab, 6)
        self.rnn = cls(6, H, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * H, classes)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out.mean(1))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_classifier(cls):
    ids = torch.randint(0, 20, (3, 6))
    fused = check_equivalence([LSTMClassifier(cls=cls) for _ in range(N)], ids, steps=2)
    assert fused.fusion_report.fallbacks == []


def test_recurrent_through_export():
    """torch.export gives aten.lstm; normalised to torch.lstm, the same kernel fuses it.
    (Small: exporting an LSTM costs about a second per model and mode.)"""

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(IN, H, batch_first=True)
            self.head = nn.Linear(H, 2)

        def forward(self, x):
            out, (h, _) = self.rnn(x)
            return self.head(out), h

    x = torch.randn(2, T, IN)
    fused = check_equivalence(
        [Tagger() for _ in range(N)], x,
        fuser=lambda ms, in_dims: hftc.fuse(ms, in_dims=in_dims, example_inputs=(x.double(),),
                                            frontend="export"))
    assert fused.fusion_report.fallbacks == []
    assert fused.fusion_report.rule_counts()["fuse_rnn"] == 1


class Seq2Seq(nn.Module):
    """The state as one value: the encoder's ``(h, c)`` handed whole to a decoder LSTM and
    to an LSTMCell loop (``state = cell(x_t, state)``), and a forward input ``hc`` passed
    whole to an LSTM (the word-language-model habit ``rnn(x, hidden)``)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.LSTM(IN, H, num_layers=2)
        self.dec = nn.LSTM(IN, H, num_layers=2)
        self.cell = nn.LSTMCell(IN, H)
        self.given = nn.LSTM(IN, H)

    def forward(self, src, tgt, hc):
        _, state = self.enc(src)
        y, _ = self.dec(tgt, state)
        step = (state[0][0], state[1][0])
        for t in range(2):
            step = self.cell(tgt[t], step)
        z, _ = self.given(src, hc)
        return y, step[0], z


def test_a_state_passed_as_one_value():
    """Such a state was one node at fusion time: the LSTM got one per-model flag for its two
    parts and failed with an IndexError on the first call."""
    src, tgt = torch.randn(T, B, IN), torch.randn(T, B, IN)
    hc = (torch.randn(1, B, H), torch.randn(1, B, H))
    fused = check_equivalence([Seq2Seq() for _ in range(N)], (src, tgt, hc))
    assert fused.fusion_report.fallbacks == []


class PackedTagger(nn.Module):
    """Variable-length sequences as PyTorch's tutorials pack them: ``pack_padded_sequence``
    in, an LSTM over the PackedSequence, ``pad_packed_sequence`` out."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(IN, H, batch_first=True)
        self.head = nn.Linear(H, 3)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(padded), self.head(h[-1])


def test_packed_sequences_run_the_recurrence_per_model():
    """fx traced into pack_padded_sequence's Python and failed (`__cuda_array_interface__`
    must be a dict): no packed model could be fused. The packing helpers are graph nodes
    now; the LSTM over a PackedSequence runs model by model (reported), the rest fused."""
    x, lengths = torch.randn(4, T, IN), torch.tensor([T, 2, T - 1, 1])
    fused = check_equivalence([PackedTagger() for _ in range(N)], (x, lengths))
    assert [r.node for r in fused.fusion_report.fallbacks] == ["rnn", "pad_packed_sequence"]
    stacked = torch.randn(N, 4, T, IN)
    check_equivalence([PackedTagger() for _ in range(N)], (stacked, lengths), in_dims=(0, None))


class _LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x, state=None):
        out, (h, c) = self.rnn(x, state)
        return self.head(out[:, -1]), h, c


@pytest.mark.parametrize("given_state", [False, True], ids=["zero_state", "given_state"])
def test_lstm_under_cpu_autocast_runs_in_its_lower_precision(given_state):
    # ATen's autocast runs lstm in bf16, states included; the fused recurrence kept a
    # float32 cell state, returned float32, and the first-call check ran the models one
    # by one (blaming the user's code).  A FusionWarning would fail this test.
    torch.manual_seed(0)
    models = [_LSTMHead() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(2, 5, 8)
    state = (torch.randn(1, 2, 8), torch.randn(1, 2, 8)) if given_state else None
    try:  # stock torch's own bf16 LSTM first: oneDNN has none on some CPUs (AMD EPYC)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            models[0](x, state)
    except RuntimeError as exc:
        if "primitive descriptor" not in str(exc):
            raise
        pytest.skip(f"stock torch's bf16 LSTM does not run on this CPU: {exc}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = fused(x, state)
        wants = [m(x, state) for m in models]
    for got, *want in zip(outs, *wants):
        assert got.dtype == want[0].dtype == torch.bfloat16
        for i, w in enumerate(want):
            torch.testing.assert_close(got[i].float(), w.float(), rtol=5e-2, atol=5e-2)
    assert fused.last_program().one_by_one is None


class _ProjectedGRU(nn.Module):
    """A GRU fed by a layer autocast runs in bf16 (the long fuzz profile's token family:
    attention, then a GRU)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rnn = nn.GRU(8, 6, batch_first=True)

    def forward(self, x):
        out, h = self.rnn(self.proj(x))
        return out, h


@pytest.mark.parametrize("projected", [True, False], ids=["bf16_input", "float32_input"])
def test_gru_under_cpu_autocast_runs_at_its_inputs_precision(projected):
    # gru is on none of autocast's lists: ATen runs it at its input's precision (bf16 after
    # an autocast linear, float32 on a float32 input); the fused recurrence ran in the
    # weights' float32 and the first-call check ran the models one by one.
    torch.manual_seed(0)
    models = [_ProjectedGRU() if projected else _GRUOnly() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = fused(x)
        wants = [m(x) for m in models]
    for k, got in enumerate(outs):
        assert got.dtype == wants[0][k].dtype == (torch.bfloat16 if projected else torch.float32)
        for i, want in enumerate(wants):
            torch.testing.assert_close(got[i].float(), want[k].float(), rtol=2e-2, atol=2e-2)
    assert fused.last_program().one_by_one is None
    # backward: each model's gradients, as its own bf16 backward gives them
    sum(o.float().sum() for o in outs).backward()
    sum(o.float().sum() for want in wants for o in want).backward()
    for name, p in fused.named_parameters():
        for i, m in enumerate(models):
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad,
                                       rtol=5e-2, atol=5e-2)


class _GRUOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 6, batch_first=True)

    def forward(self, x):
        return self.rnn(x)


class WordLanguageModel(nn.Module):
    """pytorch/examples' word_language_model: Embedding -> 2-layer LSTM/GRU -> Linear."""

    def __init__(self, cls):
        super().__init__()
        self.encoder = nn.Embedding(20, 6)
        self.rnn = cls(6, 6, 2, dropout=0.0)
        self.decoder = nn.Linear(6, 20)

    def forward(self, tokens):
        return self.decoder(self.rnn(self.encoder(tokens))[0])


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_recurrence_backward_reads_each_step_once(cls):
    # Each step read its input projection as xproj[:, t], whose backward wrote a zero
    # [N, T, B, G*H] gradient per step and summed T of them (the LSTM language model
    # trained at 0.4x the serial loop).  Unbound steps: one stack in the backward.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    models = [WordLanguageModel(cls) for _ in range(N)]
    tokens = torch.randint(0, 20, (12, B))
    fused = hftc.fuse(models)
    out = fused(tokens)
    with Calls() as calls:
        out.square().sum().backward()
    assert calls.seen.count("select_backward") == 0, calls.seen
    for dtype in (torch.float64, torch.float32):
        check_equivalence(models, tokens, dtype=dtype)


class WideLSTM(nn.Module):
    """An LSTM with batch x hidden past the rows from which ATen's LSTM runs model by model."""

    def __init__(self, with_state: bool, **kwargs):
        super().__init__()
        self.rnn = nn.LSTM(4, 64, **kwargs)
        self.with_state = with_state

    def forward(self, x, h0, c0):
        return self.rnn(x, (h0, c0)) if self.with_state else self.rnn(x)


@pytest.mark.parametrize("kwargs", [dict(num_layers=2), dict(bidirectional=True, batch_first=True),
                                    dict(num_layers=2, dropout=0.3)], ids=str)
@pytest.mark.parametrize("with_state", [False, True])
def test_wide_lstm_runs_atens_lstm_per_model_and_equals_the_loop(kwargs, with_state):
    from torch.utils._python_dispatch import TorchDispatchMode

    from hftc.lowering.check import ConstantRandomness

    class Calls(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    batch, d = 32, 2 if kwargs.get("bidirectional") else 1
    layers = kwargs.get("num_layers", 1)
    x = torch.randn(batch, 3, 4) if kwargs.get("batch_first") else torch.randn(3, batch, 4)
    states = (torch.randn(N, layers * d, batch, 64), torch.randn(N, layers * d, batch, 64))
    models = [WideLSTM(with_state, **kwargs) for _ in range(N)]
    inputs, in_dims = (x, *states), (None, 0, 0)
    with ConstantRandomness():  # the first-call check's draws: the loop's values
        for dtype in (torch.float64, torch.float32):
            check_equivalence(models, inputs, in_dims=in_dims, dtype=dtype)
    fused = hftc.fuse(models, in_dims=in_dims)
    with Calls() as calls:
        fused(*inputs)
    assert "mkldnn_rnn_layer" in calls.seen or "lstm" in calls.seen, set(calls.seen)
    assert calls.seen.count("baddbmm") == 0


class KeywordRecurrence(nn.Module):
    """``torch.lstm`` / ``torch.gru_cell`` / ``torch.lstm_cell`` called with keyword
    arguments, as hand-written recurrences (and the export front-end) may pass them."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(IN, H, num_layers=1)
        self.cell = nn.LSTMCell(IN, H)
        self.gru_cell = nn.GRUCell(IN, H)

    def forward(self, x, h0):
        out, h, c = torch.lstm(x, (h0[None], h0[None]), self.lstm._flat_weights, has_biases=True,
                               num_layers=1, dropout=0.0, train=self.training,
                               bidirectional=False, batch_first=False)
        cell = self.cell
        hc, cc = torch.lstm_cell(x[0], (h0, h0), cell.weight_ih, cell.weight_hh,
                                 b_ih=cell.bias_ih, b_hh=cell.bias_hh)
        g = self.gru_cell
        hg = torch.gru_cell(x[0], hx=h0, w_ih=g.weight_ih, w_hh=g.weight_hh, b_ih=g.bias_ih,
                            b_hh=g.bias_hh)
        return out, h, c, hc, cc, hg


def test_recurrent_functions_bind_their_arguments_by_name():
    """A keyword argument of torch.lstm failed to unpack (the packed-sequence refusal) and
    the cells' keyword biases were dropped (the fused cell ran without them, so the
    first-call check ran the models one by one): one rule per op binds each call by name."""
    x, h0 = torch.randn(T, B, IN), torch.randn(B, H)
    fused = check_equivalence([KeywordRecurrence() for _ in range(N)], (x, h0))
    assert fused.fusion_report.fallbacks == []
    counts = fused.fusion_report.rule_counts()
    assert counts["fuse_rnn"] == 1 and counts["fuse_rnn_cell"] == 2
