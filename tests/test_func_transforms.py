"""``torch.func`` transforms through a fused module: ``grad``, ``vmap``, ``jacrev``.

hftc's own ``autograd.Function`` s (the batched linear, the linear chain, the 2-d max
pool through channels-last, the contiguous gradient of a reduction, softmax and
cross-entropy over short rows) define ``setup_context`` and vmap rules, so the
transforms run through a fused module as they run through the models: meta-learning
inner loops (``grad`` of ``functional_call``), per-sample gradients
(``vmap(grad(...))``), Jacobians.  Every result is checked against a plain loop over
the original models, and each test checks that the Function it is about ran.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import hftc
from hftc.lowering.runtime import layout as rt_layout
from hftc.lowering.runtime import linear as rt_linear
from hftc.lowering.runtime import losses as rt_losses
from hftc.lowering.runtime import reduction as rt_reduction
from hftc.lowering.runtime import spatial as rt_spatial


def counted(monkeypatch, function) -> list[int]:
    """``[calls]`` of ``function.forward`` from now on (a spy, the forward unchanged)."""
    calls = [0]
    forward = function.forward

    def spy(*args):
        calls[0] += 1
        return forward(*args)

    monkeypatch.setattr(function, "forward", staticmethod(spy))
    return calls


def mlp(sizes=(6, 16, 16, 4)) -> nn.Sequential:
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class CNN(nn.Module):
    # A 2-d max pool of an NCHW map (through channels-last, with the threshold lowered;
    # the fused convs' maps are channels-last, contiguous() makes them NCHW) and a global
    # max of its output, a permuted view (reduce_in_memory_order, whose gradient
    # _ContiguousGradient makes contiguous).  (No docstring: docs/COVERAGE.md lists the
    # test modules' documented models.)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(self.pool(x.contiguous()).amax(dim=(2, 3)))


class LogSoftmaxClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 32), nn.Linear(32, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(torch.tanh(self.fc1(x))), dim=-1)


@pytest.fixture
def pool_through_channels_last(monkeypatch):
    """Every 2-d max pool of the tests' small maps takes ``_MaxPool2dThroughChannelsLast``."""
    monkeypatch.setattr(rt_spatial, "_POOL_VIA_CHANNELS_LAST_MIN_NUMEL", 1)


@pytest.fixture
def short_rows(monkeypatch):
    """(Log-)softmax and cross-entropy over 10 classes take hftc's short-row Functions
    (float32), as under AVX512 (16 lanes)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


def fuse(models):
    return hftc.fuse(copy.deepcopy(models))


def parameters(fused) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in fused.named_parameters()}


def loop_grads(models, loss_of_model) -> dict[str, torch.Tensor]:
    """``name -> [N, *shape]``: each model's gradient of ``loss_of_model(model)``."""
    per_model = []
    for model in models:
        named = dict(model.named_parameters())
        grads = torch.autograd.grad(loss_of_model(model), list(named.values()))
        per_model.append(dict(zip(named, grads)))
    return {name: torch.stack([g[name] for g in per_model]) for name in per_model[0]}


def assert_grads_close(got: dict, want: dict, **tol) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


F64 = {"rtol": 1e-10, "atol": 1e-12}
F32 = {"rtol": 1e-4, "atol": 1e-6}


# ------------------------------------------------------------------ torch.func.grad


def test_grad_of_functional_call_through_a_fused_mlp(monkeypatch):
    # A meta-learning inner loop's gradient: the MLP's linears run as one linear chain.
    models = [mlp().double() for _ in range(3)]
    fused = fuse(models)
    x, t = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    chain = counted(monkeypatch, rt_linear._LinearChain)

    def loss(p):  # the first call, which compiles the fused program, is inside grad
        return (functional_call(fused, p, (x,)) - t).square().mean((1, 2)).sum()

    got, value = torch.func.grad_and_value(loss)(parameters(fused))
    assert chain[0] >= 1
    assert_grads_close(got, loop_grads(models, lambda m: (m(x) - t).square().mean()), **F64)
    torch.testing.assert_close(value, sum((m(x) - t).square().mean() for m in models), **F64)


def test_grad_through_a_fused_cnn_with_max_pool(monkeypatch, pool_through_channels_last):
    models = [CNN().double() for _ in range(3)]
    fused = fuse(models)
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))
    fused(x)
    pool = counted(monkeypatch, rt_spatial._MaxPool2dThroughChannelsLast)
    contiguous = counted(monkeypatch, rt_reduction._ContiguousGradient)
    linear = counted(monkeypatch, rt_linear._BatchedLinear)
    loss = lambda p: hftc.per_model(F.cross_entropy)(functional_call(fused, p, (x,)), y).sum()
    got = grad(loss)(parameters(fused))
    assert pool[0] == 1 and contiguous[0] == 1 and linear[0] == 1
    assert_grads_close(got, loop_grads(models, lambda m: F.cross_entropy(m(x), y)), **F64)


def test_grad_through_per_model_cross_entropy_over_few_classes(monkeypatch, short_rows):
    # float32 logits of 10 classes: hftc's _ShortRowCrossEntropy, ignored targets included.
    models = [mlp((12, 32, 10)) for _ in range(4)]
    fused = fuse(models)
    x, y = torch.randn(64, 12), torch.randint(0, 10, (64,))
    y[:3] = -100
    fused(x)
    cross_entropy = counted(monkeypatch, rt_losses._ShortRowCrossEntropy)
    for reduction in ("mean", "sum"):
        def loss(p, reduction=reduction):
            out = functional_call(fused, p, (x,))
            return hftc.per_model(F.cross_entropy)(out, y, reduction=reduction).sum()

        got = grad(loss)(parameters(fused))
        want = loop_grads(models, lambda m, r=reduction: F.cross_entropy(m(x), y, reduction=r))
        assert_grads_close(got, want, **F32)
    assert cross_entropy[0] == 2


def _fused_mlp(monkeypatch, n: int):
    """N float64 MLPs fused and called once, a regression input and target, and the
    count of linear-chain calls from now on."""
    models = [mlp().double() for _ in range(n)]
    fused = fuse(models)
    x, t = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    fused(x)
    return models, fused, x, t, counted(monkeypatch, rt_linear._LinearChain)


def test_second_order_grad_through_a_fused_mlp(monkeypatch):
    # MAML: the gradient of the loss after an inner step, differentiated through that step
    # (grad of grad: the chain's backward recomputes with autograd, one level each).
    models, fused, x, t, chain = _fused_mlp(monkeypatch, 2)

    def inner(p):
        return (functional_call(fused, p, (x,)) - t).square().mean((1, 2)).sum()

    def outer(p):
        step = grad(inner)(p)
        return inner({k: v - 0.1 * step[k] for k, v in p.items()})

    got = grad(outer)(parameters(fused))
    assert chain[0] >= 2

    def loop_outer(m):
        named = dict(m.named_parameters())
        loss = (m(x) - t).square().mean()
        step = torch.autograd.grad(loss, list(named.values()), create_graph=True)
        after = {k: v - 0.1 * s for (k, v), s in zip(named.items(), step)}
        return (functional_call(m, after, (x,)) - t).square().mean()

    assert_grads_close(got, loop_grads(models, loop_outer), **F64)


# ------------------------------------------------------------------ torch.func.vmap


@pytest.mark.parametrize("make", [mlp, CNN], ids=["mlp", "cnn"])
def test_vmap_over_a_batch_of_inputs(monkeypatch, pool_through_channels_last, make):
    models = [make().double() for _ in range(3)]
    fused = fuse(models)
    shape = (4, 6) if make is mlp else (4, 3, 10, 10)
    xs = torch.randn(2, *shape, dtype=torch.float64)   # vmapped over dim 0
    function = rt_linear._LinearChain if make is mlp else rt_spatial._MaxPool2dThroughChannelsLast
    calls = counted(monkeypatch, function)
    got = vmap(fused)(xs)                               # the first call inside vmap
    assert calls[0] >= 1
    want = torch.stack([torch.stack([m(x) for m in models]) for x in xs])
    torch.testing.assert_close(got, want, **F64)


@pytest.mark.parametrize("make", [mlp, CNN], ids=["mlp", "cnn"])
def test_per_sample_gradients_with_vmap_of_grad(monkeypatch, pool_through_channels_last, make):
    models = [make().double() for _ in range(3)]
    fused = fuse(models)
    classes = 4 if make is mlp else 3
    x = torch.randn(5, 6) if make is mlp else torch.randn(5, 3, 10, 10)
    x, y = x.double(), torch.randint(0, classes, (5,))
    fused(x)
    functions = [rt_linear._LinearChain] if make is mlp else [
        rt_spatial._MaxPool2dThroughChannelsLast, rt_reduction._ContiguousGradient, rt_linear._BatchedLinear]
    calls = [counted(monkeypatch, function) for function in functions]

    def loss_one(p, xi, yi):  # one sample: [N, 1, classes]
        out = functional_call(fused, p, (xi.unsqueeze(0),))
        return hftc.per_model(F.cross_entropy)(out, yi.unsqueeze(0)).sum()

    got = vmap(grad(loss_one), in_dims=(None, 0, 0))(parameters(fused), x, y)
    assert all(c[0] == 1 for c in calls)
    for b in range(len(x)):
        want = loop_grads(models, lambda m, b=b: F.cross_entropy(m(x[b:b + 1]), y[b:b + 1]))
        assert_grads_close({k: v[b] for k, v in got.items()}, want, **F64)


@pytest.mark.parametrize("head", ["logits", "log_softmax"])
def test_vmap_over_tasks_with_short_rows(monkeypatch, short_rows, head):
    # A batch of tasks (meta-learning): each task's 64 samples, 10 classes, float32, so
    # the loss (or the model's log_softmax) is hftc's short-row Function, under vmap; the
    # per-task gradients by vmap(grad) and their sum by grad(vmap), against the loop.
    if head == "logits":
        models, loss_fn, function = ([mlp((12, 32, 10)) for _ in range(4)], F.cross_entropy,
                                     rt_losses._ShortRowCrossEntropy)
    else:
        models, loss_fn, function = ([LogSoftmaxClassifier() for _ in range(4)], F.nll_loss,
                                     rt_reduction._ShortRowSoftmax)
    fused = fuse(models)
    xs, ys = torch.randn(3, 64, 12), torch.randint(0, 10, (3, 64))
    ys[1, :5] = -100                                    # ignored targets in one task only
    fused(xs[0])
    calls = counted(monkeypatch, function)
    linear = counted(monkeypatch, rt_linear._BatchedLinear)   # (the tanh head: no chain)

    def task_loss(p, x, y):
        return hftc.per_model(loss_fn)(functional_call(fused, p, (x,)), y).sum()

    params = parameters(fused)
    per_task = vmap(grad(task_loss), in_dims=(None, 0, 0))(params, xs, ys)
    summed = grad(lambda p: vmap(task_loss, in_dims=(None, 0, 0))(p, xs, ys).sum())(params)
    assert calls[0] == 2 and linear[0] == (0 if head == "logits" else 4)
    wants = [loop_grads(models, lambda m, x=x, y=y: loss_fn(m(x), y)) for x, y in zip(xs, ys)]
    for task, want in enumerate(wants):
        assert_grads_close({k: v[task] for k, v in per_task.items()}, want, **F32)
    assert_grads_close(summed, {k: sum(w[k] for w in wants) for k in wants[0]}, **F32)
    losses = vmap(task_loss, in_dims=(None, 0, 0))(params, xs, ys)
    want = torch.stack([sum(loss_fn(m(x), y) for m in models) for x, y in zip(xs, ys)])
    torch.testing.assert_close(losses, want, **F32)


def test_vmap_over_parameter_sets(monkeypatch):
    # vmap over the weights (several parameter sets of one fused module, as in ensembling
    # with torch.func.stack_module_state): the chain's vmap rule takes the vmapped dim
    # into the models; each set's outputs and gradients as its own models' alone.
    models, fused, x, t, chain = _fused_mlp(monkeypatch, 3)
    sets = [{k: v * (1 + 0.5 * s) for k, v in parameters(fused).items()} for s in range(2)]
    stacked = {k: torch.stack([p[k] for p in sets]) for k in sets[0]}

    def loss(p, x):
        return (functional_call(fused, p, (x,)) - t).square().mean((1, 2)).sum()

    outs = vmap(lambda p: functional_call(fused, p, (x,)))(stacked)  # (no grad: no Function)
    grads = vmap(grad(loss), in_dims=(0, None))(stacked, x)
    assert chain[0] == 1
    # (in grad(vmap(...)) the weights are vmap's tensors, which say they need no gradient:
    # the chain runs without its Function, as plain ops that grad records)
    summed = grad(lambda p: vmap(loss, in_dims=(0, None))(p, x).sum())(stacked)
    for s, p in enumerate(sets):
        alone = [copy.deepcopy(m) for m in models]
        for i, m in enumerate(alone):
            m.load_state_dict({k: v[i] for k, v in p.items()})
        torch.testing.assert_close(outs[s], torch.stack([m(x) for m in alone]), **F64)
        want = loop_grads(alone, lambda m: (m(x) - t).square().mean())
        assert_grads_close({k: v[s] for k, v in grads.items()}, want, **F64)
        assert_grads_close({k: v[s] for k, v in summed.items()}, want, **F64)


def test_max_pool_through_channels_last_under_vmap(monkeypatch, pool_through_channels_last):
    # The pool kernel itself on a batched map that vmap can hand it (contiguous): its vmap
    # rule pools the vmapped samples as more of the batch; values, indices and gradients
    # are the plain pool's, bit for bit.
    xs = torch.randint(-2, 3, (3, 2, 4, 3, 9, 9)).clamp_min(0).double()  # ties
    pool = nn.MaxPool2d(3, 2, 1, return_indices=True)
    fused_pool = lambda x: rt_spatial.channelwise(pool, x, spatial=2)
    plain_pool = lambda x: tuple(rt_layout.unfold_channels(t, 2, True) for t in
                                 F.max_pool2d_with_indices(rt_layout.fold_channels(x, True), 3, 2, 1))
    calls = counted(monkeypatch, rt_spatial._MaxPool2dThroughChannelsLast)
    values, indices = vmap(fused_pool)(xs)
    assert calls[0] == 1
    want_values, want_indices = zip(*[plain_pool(x) for x in xs])
    assert torch.equal(values, torch.stack(want_values))
    assert torch.equal(indices, torch.stack(want_indices))
    weights = torch.randn(values.shape[1:], dtype=torch.float64)
    loss = lambda f: (lambda x: (f(x)[0] * weights).sum())
    got = vmap(grad(loss(fused_pool)))(xs)
    assert torch.equal(got, torch.stack([grad(loss(plain_pool))(x) for x in xs]))
    got = grad(lambda x: vmap(loss(fused_pool))(x).sum())(xs)
    assert torch.equal(got, torch.stack([grad(loss(plain_pool))(x) for x in xs]))
    assert calls[0] == 3


# ------------------------------------------------------------------ torch.func.jacrev


def test_jacrev_through_a_tiny_fused_mlp(monkeypatch):
    models = [mlp((3, 5, 4, 2)).double() for _ in range(2)]
    fused = fuse(models)
    x = torch.randn(2, 3, dtype=torch.float64)
    fused(x)
    chain = counted(monkeypatch, rt_linear._LinearChain)
    linear = counted(monkeypatch, rt_linear._BatchedLinear)
    # d out / d x: [N, B, out, B, in], model i's block its own Jacobian (a shared input
    # that needs its gradient: the first layer is one GEMM, the others batched linears)
    got = jacrev(fused)(x)
    assert linear[0] >= 1
    want = torch.stack([jacrev(m)(x) for m in models])
    torch.testing.assert_close(got, want, **F64)
    # d out / d params (the linear chain): model i's output depends on its slice only
    params = parameters(fused)
    got = jacrev(lambda p: functional_call(fused, p, (x,)))(params)
    assert chain[0] == 1
    for i, m in enumerate(models):
        own = jacrev(lambda p, m=m: functional_call(m, p, (x,)))(
            {k: v.detach() for k, v in m.named_parameters()})
        for name, jac in got.items():                   # [N, B, out, N, *shape]
            torch.testing.assert_close(jac[i, :, :, i], own[name], **F64)
            others = [j for j in range(len(models)) if j != i]
            assert not jac[i, :, :, others].any()
