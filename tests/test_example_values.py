"""Shape propagation (frontends/symbolic.py's annotate_example_values): a small model on the
CPU runs for real first, on copies of model 0's tensors; a large one, or one off the CPU,
on meta. Either way every node's example value is a meta tensor of the shape and dtype
model 0 computes there (its strides the CPU kernel's where it ran for real: a conv of a
channels-last input is channels-last, which torch's meta conv does not say), and nothing
the user sees changes: the models' tensors, the fused
module's buffers and the random generator are as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import WritesItsInput

import hftc
from hftc.frontends import symbolic
from hftc.frontends.symbolic import annotate_example_values, meta_copy, trace_model
from hftc.ir import EXAMPLE_VALUE


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn = nn.Linear(12, 16), nn.BatchNorm1d(16)
        self.drop, self.fc2 = nn.Dropout(0.3), nn.Linear(16, 5)

    def forward(self, x):
        h = self.drop(torch.tanh(self.bn(self.fc1(x))))
        return F.log_softmax(self.fc2(h), dim=1)


class ConvNet(nn.Module):
    """A conv of a channels-last input (the CPU keeps it channels-last, meta does not)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        pooled = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.head(pooled) + pooled.mean(1, keepdim=True).expand(-1, 4)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(20, 8), nn.LSTM(8, 6, batch_first=True)

    def forward(self, ids):
        out, _ = self.lstm(self.emb(ids))
        return out[:, -1].t()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.norm = nn.MultiheadAttention(8, 2, batch_first=True), nn.LayerNorm(8)

    def forward(self, x):
        out, _ = self.attn(x, x, x, need_weights=False)
        return self.norm(x + out).transpose(1, 2)


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    return [
        (MLP, torch.randn(7, 12, generator=g, dtype=dtype)),
        (ConvNet, torch.randn(2, 3, 5, 5, generator=g, dtype=dtype)
         .contiguous(memory_format=torch.channels_last)),
        (Recurrent, torch.randint(0, 20, (3, 4), generator=g)),
        (Attention, torch.randn(2, 5, 8, generator=g, dtype=dtype)),
    ]


def _propagated(model, x, training):
    graph = trace_model(model, 0, training=training)
    tensors = {name: t.detach().clone() for name, t in
               [*model.named_parameters(), *model.named_buffers()]}
    annotate_example_values(graph.graph, meta_copy(model), [x], {}, lambda: dict(tensors))
    values = []
    for node in graph.graph.nodes:
        value = node.meta.get(EXAMPLE_VALUE)
        leaves = torch.utils._pytree.tree_leaves(value)
        values.append([(tuple(v.shape), v.dtype, v.device.type)
                       if isinstance(v, torch.Tensor) else v for v in leaves])
    return values


@pytest.mark.parametrize("case", range(len(_cases(torch.float32))))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_the_real_run_records_what_the_meta_kernels_give(monkeypatch, case, dtype, training):
    cls, x = _cases(dtype)[case]
    torch.manual_seed(0)
    model = cls().to(dtype)
    model.train(training)
    ran = []
    real = symbolic._record_real
    monkeypatch.setattr(symbolic, "_record_real", lambda *a: (ran.append(1), real(*a)))
    first = _propagated(model, x, training)
    assert ran, f"{cls.__name__} is small: it runs for real first"
    monkeypatch.setattr(symbolic, "REAL_FIRST_MAX_WORK", 0)
    ran.clear()
    on_meta = _propagated(model, x, training)
    assert not ran, f"{cls.__name__} over the bound runs on meta"
    assert first == on_meta
    assert all(leaf[2] == "meta" for node in first for leaf in node if isinstance(leaf, tuple))


def _mlps():
    torch.manual_seed(0)
    models = [MLP() for _ in range(3)]
    for i, m in enumerate(models):
        m.drop.p = 0.1 * (i + 1)
    return models


def test_a_compiling_call_draws_and_updates_as_a_compiled_one():
    """The first call (shape propagation for real, the check) and a call of an already
    compiled fused module take the same random draws and leave the same buffers."""
    x = torch.randn(7, 12)
    warm = hftc.fuse(_mlps())
    warm(x)
    warm.load_state_dict(hftc.fuse(_mlps()).state_dict())  # its buffers back to the start
    cold = hftc.fuse(_mlps())
    outs, states = [], []
    for fused in (warm, cold):
        torch.manual_seed(5)
        outs.append(fused(x))
        states.append(torch.get_rng_state())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(states[0], states[1])
    for a, b in zip(warm.buffers(), cold.buffers()):
        assert torch.equal(a, b)
    # one forward's running statistics per model, as each model's own forward leaves them
    models = _mlps()
    for i, m in enumerate(models):
        m(x)
        state = cold.model_state_dict(i)
        torch.testing.assert_close(state["bn.running_mean"], m.bn.running_mean)
        torch.testing.assert_close(state["bn.running_var"], m.bn.running_var)
        assert int(state["bn.num_batches_tracked"]) == 1


def test_the_real_run_restores_the_generator_and_leaves_model_0_alone():
    torch.manual_seed(0)
    model = MLP().train()
    graph = trace_model(model, 0, training=True)
    tensors = {n: t.detach().clone() for n, t in
               [*model.named_parameters(), *model.named_buffers()]}
    x = torch.randn(4, 12)
    before = torch.get_rng_state()
    annotate_example_values(graph.graph, meta_copy(model), [x], {}, lambda: dict(tensors))
    assert torch.equal(torch.get_rng_state(), before)  # the dropout's draws undone
    assert int(model.bn.num_batches_tracked) == 0
    assert torch.equal(model.bn.running_mean, torch.zeros(16))


def test_a_model_the_real_run_refuses_is_propagated_on_meta(monkeypatch):
    """Ids past the embedding's rows fail for real (an IndexError of model 0's data) but
    not on meta, which reads no values: propagation goes on, as before the real run."""
    refused = []
    real = symbolic._record_real

    def noted(*args):
        try:
            return real(*args)
        except Exception as exc:
            refused.append(exc)
            raise

    monkeypatch.setattr(symbolic, "_record_real", noted)
    model = Recurrent()
    graph = trace_model(model, 0, training=False)
    tensors = {n: t.detach().clone() for n, t in
               [*model.named_parameters(), *model.named_buffers()]}
    ids = torch.full((2, 3), 25)
    with pytest.raises(IndexError):
        model(ids)
    annotate_example_values(graph.graph, meta_copy(model), [ids], {}, lambda: dict(tensors))
    assert len(refused) == 1 and isinstance(refused[0].__cause__, IndexError)
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    assert tuple(out.meta[EXAMPLE_VALUE].shape) == (6, 2)
    assert out.meta[EXAMPLE_VALUE].device.type == "meta"


def test_a_real_run_records_the_strides_the_cpu_kernels_give():
    """A conv of a channels-last input is channels-last on the CPU (torch's meta conv
    says contiguous): the recorded value has the eager conv's strides."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = _cases(torch.float32)[1][1]
    graph = trace_model(model, 0, training=False)
    tensors = {n: t.detach().clone() for n, t in
               [*model.named_parameters(), *model.named_buffers()]}
    annotate_example_values(graph.graph, meta_copy(model), [x], {}, lambda: dict(tensors))
    conv = next(n for n in graph.graph.nodes if n.op == "call_module"
                and isinstance(model.get_submodule(n.target), nn.Conv2d))
    recorded = conv.meta[EXAMPLE_VALUE]
    eager = model.features[0](x)
    assert recorded.shape == eager.shape and recorded.stride() == eager.stride()
    assert eager.is_contiguous(memory_format=torch.channels_last)


def test_the_real_run_writes_into_copies_of_the_inputs():
    model = WritesItsInput()
    graph = trace_model(model, 0, training=True)
    tensors = {n: t.detach().clone() for n, t in model.named_parameters()}
    x = torch.randn(3, 4)
    given = x.clone()
    annotate_example_values(graph.graph, meta_copy(model), [x], {}, lambda: dict(tensors))
    assert torch.equal(x, given)
    out = next(n for n in graph.graph.nodes if n.op == "output").args[0]
    assert tuple(out.meta[EXAMPLE_VALUE].shape) == (3, 4)
