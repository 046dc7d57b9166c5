"""Linear chains (hftc/lowering/chains.py): consecutive linears and ReLUs as one autograd node.

The chain runs the very ops of the unchained layers, so it is checked three ways:
against the loop over the original models (tests/equivalence.py), bit for bit
against the same fused program with chaining turned off, and through the cases that
must stay unchained.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
import hftc.module.fused
from hftc.lowering import chains
from hftc.lowering.runtime import linear as rt_linear

DTYPES = [torch.float64, torch.float32]


class FunctionalMLP(nn.Module):
    def __init__(self, sizes=(6, 9, 7, 4), bias=True, relu="functional"):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(sizes, sizes[1:]))
        self.relu, self.act = relu, nn.ReLU()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = {"functional": F.relu, "torch": torch.relu, "module": self.act,
                     "method": lambda t: t.relu(), "none": lambda t: t}[self.relu](x)
        return x


def sequential(sizes=(6, 9, 7, 4)):
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers[:-1])


def chain_calls(fused) -> int:
    return fused.last_program().source.count("hftc_lowering_runtime_linear_linear_chain(")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("relu", ["functional", "torch", "module", "method", "none"])
def test_chained_mlp_matches_the_loop(relu, n, dtype):
    torch.manual_seed(n)
    models = [FunctionalMLP(relu=relu) for _ in range(n)]
    fused = check_equivalence(models, torch.randn(5, 6), dtype=dtype, steps=2)
    assert chain_calls(fused) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6), (6,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
@pytest.mark.parametrize("bias", [True, False])
def test_chain_inputs_shared_or_stacked_any_lead_dims(shape, stacked, bias, dtype):
    torch.manual_seed(0)
    n = 3
    models = [FunctionalMLP(bias=bias) for _ in range(n)]
    x = torch.randn(n, *shape) if stacked else torch.randn(*shape)
    fused = check_equivalence(models, x, in_dims=0 if stacked else None, dtype=dtype, steps=2)
    assert chain_calls(fused) == 1


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_sequential_with_inplace_relus_and_a_narrow_head(train):
    # 10 outputs: the head's product runs transposed (baddbmm_t) inside the chain
    torch.manual_seed(0)
    models = [sequential((16, 32, 32, 10)) for _ in range(4)]
    fused = check_equivalence(models, torch.randn(8, 16), train=train, dtype=torch.float32)
    assert chain_calls(fused) == 1


def _unchained(monkeypatch):
    monkeypatch.setattr(hftc.lowering.pipeline, "chain_linears", lambda graph, root: graph)


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
def test_the_chain_is_the_unchained_program_bit_for_bit(monkeypatch, stacked):
    torch.manual_seed(0)
    models = [sequential((16, 32, 32, 10)) for _ in range(4)]
    x = torch.randn(4, 8, 16) if stacked else torch.randn(8, 16)
    results = []
    for chained in (True, False):
        if not chained:
            _unchained(monkeypatch)
        fused = hftc.fuse(models, in_dims=0 if stacked else None)
        xi = x.clone().requires_grad_()
        out = fused(xi)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        assert chain_calls(fused) == (1 if chained else 0)
        with torch.no_grad():  # no Function: the plain ops
            again = fused(x)
        results.append([out.detach(), again, xi.grad, *(p.grad for p in fused.parameters())])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_double_backward_through_a_chain(monkeypatch):
    # A gradient penalty: the chain's backward recomputes with autograd under create_graph.
    torch.manual_seed(0)
    models = [FunctionalMLP() for _ in range(3)]
    x = torch.randn(5, 6, dtype=torch.float64)
    results = []
    for chained in (True, False):
        if not chained:
            _unchained(monkeypatch)
        fused = hftc.fuse([m.double() for m in models])
        xi = x.clone().requires_grad_()
        out = fused(xi)
        (g,) = torch.autograd.grad(out.square().sum(), xi, create_graph=True)
        penalty = g.square().sum()
        penalty.backward()
        assert chain_calls(fused) == (1 if chained else 0)
        results.append([g.detach(), *(p.grad for p in fused.parameters())])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert results[0][1].abs().sum() > 0


def test_under_autocast_the_chain_runs_its_layers_one_by_one(monkeypatch):
    torch.manual_seed(0)
    models = [sequential() for _ in range(3)]
    x = torch.randn(5, 6)
    outs = []
    for chained in (True, False):
        if not chained:
            _unchained(monkeypatch)
        fused = hftc.fuse(models)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused(x)
        out.float().sum().backward()
        outs.append([out, *(p.grad for p in fused.parameters())])
    assert outs[0][0].dtype == torch.bfloat16
    for a, b in zip(*outs):
        assert torch.equal(a, b)


class Branchy(nn.Module):
    """fc1's output is used twice: no chain through it; fc2 -> tanh -> fc3 neither."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc3(torch.tanh(self.fc2(h) + h))


class TwoChains(nn.Module):
    """Two chains joined by a residual add: each chained on its own."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2 = nn.Linear(6, 8), nn.Linear(8, 6)
        self.b1, self.b2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = x + self.a2(F.relu(self.a1(x)))
        return self.b2(F.relu(self.b1(h)))


@pytest.mark.parametrize("model, chains_expected", [(Branchy, 0), (TwoChains, 2)])
def test_what_is_chained_and_what_is_not(model, chains_expected):
    torch.manual_seed(0)
    fused = check_equivalence([model() for _ in range(3)], torch.randn(5, 6), steps=2)
    assert chain_calls(fused) == chains_expected


def test_an_autotuned_loop_lowering_breaks_the_chain(monkeypatch, tmp_path):
    # A layer autotune runs model by model (lowering "loop") is left to linear.linear.
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    models = [sequential((6, 9, 7, 4)) for _ in range(3)]
    fused = hftc.fuse(models)
    fused(torch.randn(5, 6))
    graph = fused.fused_graph
    linears = [n for n in graph.nodes if n.target is hftc.lowering.runtime.linear.linear]
    linears[1].kwargs = {**linears[1].kwargs, "lowering": "loop"}
    rewritten = chains.chain_linears(graph, fused)
    calls = [n.target for n in rewritten.nodes if n.op == "call_function"]
    assert calls.count(hftc.lowering.runtime.linear.linear) == 3  # 0 and 2 are no chain alone
    assert rt_linear.linear_chain not in calls
    linears[1].kwargs = {**linears[1].kwargs, "lowering": "baddbmm"}
    rewritten = chains.chain_linears(graph, fused)
    calls = [n.target for n in rewritten.nodes if n.op == "call_function"]
    assert calls.count(rt_linear.linear_chain) == 1 and hftc.lowering.runtime.linear.linear not in calls
    assert graph is fused.fused_graph and len(linears) == 3  # the rewrite copies


def test_a_shared_input_that_needs_its_gradient_runs_the_wide_gemm_unchained():
    # The cost model's choice for that first layer is gemm: the chain runs one by one.
    torch.manual_seed(0)
    models = [sequential() for _ in range(3)]
    fused = check_equivalence(models, torch.randn(5, 6), dtype=torch.float32)
    assert chain_calls(fused) == 1
    x = torch.randn(5, 6)
    assert rt_linear._transposed(x.requires_grad_(), [p for n, p in fused.named_parameters()
                                                   if n.endswith("weight")],
                              [None] * 3, False, (None, None, None)) is None


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
def test_linear_chain_kernel_against_its_layers_one_by_one(stacked):
    # Every input needing a gradient, the shared one included (its gradient is the sum
    # over the models of the broadcast's), each layer's lowering given explicitly.
    torch.manual_seed(0)
    n, sizes = 3, (5, 8, 8, 4)
    weights = [torch.randn(n, b, a, dtype=torch.float64, requires_grad=True)
               for a, b in zip(sizes, sizes[1:])]
    biases = [torch.randn(n, b, dtype=torch.float64, requires_grad=True) for b in sizes[1:]]
    x = torch.randn(*((n,) if stacked else ()), 7, sizes[0], dtype=torch.float64,
                    requires_grad=True)
    kwargs = dict(x_batched=stacked, activations=("relu", "relu"),
                  lowerings=("baddbmm", "baddbmm_t", "baddbmm_t"))
    results = []
    for run in (rt_linear.linear_chain, rt_linear._one_by_one):
        args = (x, tuple(weights), tuple(biases))
        out = run(*args, **kwargs) if run is rt_linear.linear_chain else run(
            *args, kwargs["x_batched"], kwargs["activations"], kwargs["lowerings"])
        grads = torch.autograd.grad(out, [x, *weights, *biases], torch.ones_like(out))
        results.append([out, *grads])
    for a, b in zip(*results):
        assert torch.equal(a, b)


class FrozenBackbone(nn.Module):
    """A linear probe: the backbone under no_grad, the head trained (or the head under
    autocast): the two linears must not run as one chain in one mode."""

    def __init__(self, region: str):
        super().__init__()
        self.region = region
        self.backbone, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        if self.region == "no_grad":
            with torch.no_grad():
                h = F.relu(self.backbone(x))
            return self.head(h)
        h = self.backbone(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(h)


def test_no_chain_across_a_change_of_grad_mode_or_autocast():
    # Chained, the frozen backbone ran with the head after grad mode was back on and got
    # gradients; under autocast the float32 layer ran in bf16 (within the check's
    # tolerance, so only bit-equality with the loop shows it).
    torch.manual_seed(0)
    models = [FrozenBackbone("no_grad") for _ in range(3)]
    fused = check_equivalence(models, torch.randn(5, 8), steps=2)
    assert chain_calls(fused) == 0
    assert fused.get_parameter("backbone.weight").grad is None
    models = [FrozenBackbone("autocast") for _ in range(2)]
    fused = hftc.fuse(models)
    x = torch.randn(5, 8) * 3
    out = fused(x)
    assert chain_calls(fused) == 0
    for i, m in enumerate(models):
        assert torch.equal(out[i], m(x))


# --------------------------------------------------------------------------- decoder + log-softmax
# pytorch/examples word_language_model's RNNModel: its Linear decoder's [T*B, ntoken] logits
# go through log_softmax; lowering/chains.py makes the pair one linear_log_softmax call,
# which runs model by model where the logits are large (lowering/runtime/linear.py).


class WordLanguageModel(nn.Module):
    """word_language_model's RNNModel (LSTM), small, without dropout (hftc's dropout
    draws other masks than the models' own)."""

    def __init__(self, ntoken=50, ninp=8, nhid=12, nlayers=2, bias=True, dim=1, view=True):
        super().__init__()
        self.ntoken, self.dim, self.view = ntoken, dim, view
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder = nn.Linear(nhid, ntoken, bias=bias)

    def forward(self, input, hidden=None):
        output, hidden = self.rnn(self.encoder(input), hidden)
        decoded = self.decoder(output)
        if self.view:
            decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=self.dim), hidden


@pytest.fixture
def every_size_model_by_model(monkeypatch):
    """The per-model schedule at test sizes; counts its forwards."""
    monkeypatch.setattr(rt_linear, "_PER_MODEL_BLOCK_BYTES", 0)
    monkeypatch.setattr(rt_linear, "_PER_MODEL_TOTAL_BYTES", 0)
    calls = []
    forward = rt_linear._PerModelLinearLogSoftmax.forward

    def counted(*args):
        calls.append(args[0].shape)
        return forward(*args)

    monkeypatch.setattr(rt_linear._PerModelLinearLogSoftmax, "forward", staticmethod(counted))
    return calls


def tail_calls(fused) -> int:
    return fused.last_program().source.count("hftc_lowering_runtime_linear_linear_log_softmax(")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", [{}, {"bias": False}, {"dim": -1}, {"view": False, "dim": 2}],
                         ids=["view", "no-bias", "dim-1", "no-view"])
def test_decoder_and_log_softmax_run_model_by_model_as_the_loop(every_size_model_by_model,
                                                                 variant, dtype):
    torch.manual_seed(0)
    models = [WordLanguageModel(**variant) for _ in range(3)]
    tokens = torch.randint(0, 50, (7, 4))
    fused = check_equivalence(models, tokens, dtype=dtype, steps=2)
    assert tail_calls(fused) == 1
    assert every_size_model_by_model, "the per-model Function did not run"
    assert every_size_model_by_model[-1] == (3, 28, 12)


def test_linear_log_softmax_at_a_language_models_size_against_the_differing_ops():
    # word_language_model's decoder at the benchmark's size (bptt 35, batch 20, 200 ->
    # 2,000 words: 5.6 MB of logits a model): the default thresholds take the per-model
    # schedule; forward and every gradient against F.linear + F.log_softmax per model.
    torch.manual_seed(0)
    n, rows, cols = 3, (35, 20), (200, 2000)
    for dtype in DTYPES:
        x = torch.randn(n, *rows, cols[0], dtype=dtype, requires_grad=True)
        w = (0.1 * torch.randn(n, cols[1], cols[0], dtype=dtype)).requires_grad_()
        b = torch.randn(n, cols[1], dtype=dtype, requires_grad=True)
        assert rt_linear._one_by_one_log_softmax(x, w, b, (-1, cols[1]), 2, True, None) == 700
        out = rt_linear.linear_log_softmax(x, w, b, (-1, cols[1]), 2, x_batched=True)
        node = out.grad_fn  # (through the reshape's view)
        while node.name() == "ViewBackward0":
            node = node.next_functions[0][0]
        assert node.name() == "_PerModelLinearLogSoftmaxBackward"
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (x, w, b), g)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
        for i in range(n):
            ref = F.log_softmax(F.linear(x[i], w[i], b[i]).view(-1, cols[1]), dim=1)
            torch.testing.assert_close(out[i], ref, **tol)
            ref_grads = torch.autograd.grad(ref, (x, w, b), g[i])
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(got[i], want[i], **tol)


def test_double_backward_through_the_per_model_decoder(every_size_model_by_model):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, b: rt_linear.linear_log_softmax(x, w, b, None, -1, x_batched=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))
    assert every_size_model_by_model


def test_what_takes_the_per_model_decoder_and_what_runs_the_ops_unchanged(
        every_size_model_by_model):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, requires_grad=True)
    w, b = torch.randn(2, 5, 4), torch.randn(2, 5)
    per_model = rt_linear._one_by_one_log_softmax
    assert per_model(x, w, b, None, -1, True, None) == 3
    assert per_model(x, w, b, (-1, 5), 2, True, None) == 3
    assert per_model(x, w, b, None, 1, True, None) is None          # not over the logits
    assert per_model(x, w, b, (15,), 1, True, None) is None         # rows of logits merged
    assert per_model(x, w, b, None, -1, True, "loop") is None       # autotune's lowering
    assert per_model(x, w, b, None, -1, False, None) is None        # a shared input
    assert per_model(x.double(), w, b, None, -1, True, None) is None
    with torch.autocast("cpu"):
        assert per_model(x, w, b, None, -1, True, None) is None
    # The unchanged ops where it does not: the same tensors bit for bit.
    out = rt_linear.linear_log_softmax(x, w, b, None, 1, x_batched=True)
    torch.testing.assert_close(out, torch.log_softmax(torch.baddbmm(
        b[:, None], x, w.transpose(1, 2)), 1), rtol=0, atol=0)
    assert not every_size_model_by_model


def test_default_sizes_keep_small_heads_batched():
    # An MNIST-style 10-class head: 40 bytes a row; batched, as before.
    x, w, b = torch.randn(4, 64, 32), torch.randn(4, 10, 32), torch.randn(4, 10)
    assert rt_linear._one_by_one_log_softmax(x, w, b, None, -1, True, None) is None


def test_a_chain_ending_in_log_softmax_stays_a_chain():
    # pytorch/examples mnist-style MLP with log_softmax: the chain keeps its last linear.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 9), nn.Linear(9, 4)

        def forward(self, x):
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    torch.manual_seed(0)
    fused = check_equivalence([Net() for _ in range(3)], torch.randn(5, 6), steps=2)
    assert chain_calls(fused) == 1 and tail_calls(fused) == 0
