"""Real-style architectures nobody on the team wrote, fused: torchvision's DenseNet with
a per-model ``drop_rate`` (``if self.drop_rate > 0: F.dropout(...)``: a Python branch
that leaves the op out of the models at rate 0), and the same branch on an activation.

Each compares the fused module with a plain loop over the models (tests/equivalence.py)
and trains it with ``hftc.optim`` against each model alone with stock ``torch.optim``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from equivalence import check_equivalence
from optim_helpers import single_thread  # noqa: F401  (an autouse fixture)

import hftc


class _DenseLayer(nn.Module):
    """torchvision.models.densenet._DenseLayer (without the memory-efficient checkpoint)."""

    def __init__(self, num_input_features, growth_rate, bn_size, drop_rate):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    def bn_function(self, inputs):
        concated_features = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated_features)))

    def forward(self, input):
        prev_features = [input] if isinstance(input, torch.Tensor) else input
        bottleneck_output = self.bn_function(prev_features)
        new_features = self.conv2(self.relu2(self.norm2(bottleneck_output)))
        if self.drop_rate > 0:
            new_features = F.dropout(new_features, p=self.drop_rate, training=self.training)
        return new_features


class _DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers, num_input_features, bn_size, growth_rate, drop_rate):
        super().__init__()
        for i in range(num_layers):
            layer = _DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size,
                                drop_rate)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features):
        features = [init_features]
        for _name, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    def __init__(self, num_input_features, num_output_features):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, 1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    """torchvision.models.DenseNet, small."""

    def __init__(self, growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2,
                 drop_rate=0.0, num_classes=5):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, num_init_features, 3, padding=1, bias=False)),
            ("norm0", nn.BatchNorm2d(num_init_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))
        num_features = num_init_features
        for i, num_layers in enumerate(block_config):
            block = _DenseBlock(num_layers, num_features, bn_size, growth_rate, drop_rate)
            self.features.add_module(f"denseblock{i + 1}", block)
            num_features = num_features + num_layers * growth_rate
            if i != len(block_config) - 1:
                trans = _Transition(num_features, num_features // 2)
                self.features.add_module(f"transition{i + 1}", trans)
                num_features = num_features // 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        features = self.features(x)
        out = F.relu(features, inplace=True)
        out = F.adaptive_avg_pool2d(out, (1, 1))
        out = torch.flatten(out, 1)
        return self.classifier(out)


def _densenets(rates):
    models = []
    for seed, rate in enumerate(rates):
        torch.manual_seed(seed)
        models.append(DenseNet(drop_rate=rate))
    return models


RATES = [[0.0, 0.3, 0.0], [0.3, 0.0], [0.0, 0.0, 0.2, 0.5, 0.0]]


@pytest.mark.parametrize("rates", RATES, ids=lambda r: "-".join(map(str, r)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_densenet_per_model_drop_rate_fuses(rates, dtype):
    """torchvision's ``if self.drop_rate > 0:`` leaves the dropout out of the models at
    rate 0: they fuse, each model at its own rate (was: MismatchError, not the same
    program).  In train mode a model at rate 0 computes exactly what it computes alone, and
    the others do drop; in eval mode every model is its own, forward and backward."""
    models = [m.to(dtype) for m in _densenets(rates)]
    fused = hftc.fuse(copy.deepcopy(models))
    x = torch.randn(4, 3, 8, 8, dtype=dtype)
    out = fused(x)
    for i, (model, rate) in enumerate(zip(models, rates)):
        alone = model(x)
        if rate == 0:
            torch.testing.assert_close(out[i], alone)
        else:
            assert not torch.allclose(out[i], alone), f"model {i} does not drop at {rate}"
    check_equivalence(models, x, train=False, dtype=dtype)


def test_densenet_drop_rates_train_with_hftc_optim_as_each_alone():
    """Eval-mode training (the dropout a no-op, the branch still in the graph) with
    per-model AdamW: each model's weights after three steps equal stock AdamW's alone."""
    rates = [0.0, 0.3, 0.0]
    models = [m.double().eval() for m in _densenets(rates)]
    solos = copy.deepcopy(models)
    fused = hftc.fuse(copy.deepcopy(models))
    lrs, decays = [1e-3, 3e-3, 1e-2], [0.0, 0.01, 0.1]
    opt = hftc.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=decays)
    stock = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
             for m, lr, wd in zip(solos, lrs, decays)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
        for model, model_opt in zip(solos, stock):
            model_opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            model_opt.step()
    for solo, back in zip(solos, fused.unfuse()):
        for (name, p), (_, q) in zip(solo.state_dict().items(), back.state_dict().items()):
            torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12, msg=name)


class GatedHead(nn.Module):
    """A head whose Python flags leave ops out: ``if self.act: ...`` and a dropout then an
    activation that only some models run (two skipped ops in a row)."""

    def __init__(self, act=True, extra=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.act, self.extra = act, extra

    def forward(self, x):
        h = self.fc1(x)
        if self.act:
            h = F.relu(h)
        if self.extra:
            h = torch.tanh(F.dropout(h, p=0.0, training=self.training))
        return self.fc2(h) + h.sum(-1, keepdim=True)


@pytest.mark.parametrize("flags", [[(True, False), (False, False), (True, True)],
                                   [(False, True), (True, False)],
                                   [(True, True), (False, True), (False, False), (True, False),
                                    (True, True)]])
def test_python_flags_that_skip_elementwise_ops_fuse_exactly(flags):
    """The models that skip an op get an identity there; forward and backward equal the
    loop over the models in train and eval mode (was: MismatchError)."""
    models = []
    for seed, (act, extra) in enumerate(flags):
        torch.manual_seed(seed)
        models.append(GatedHead(act, extra))
    x = torch.randn(5, 6)
    for train in (True, False):
        check_equivalence(models, x, train=train)
    check_equivalence(models, x, dtype=torch.float32)
    # torch.export's graphs (example_inputs) skip the op as well
    check_equivalence(models, x, fuser=lambda ms, in_dims=None: hftc.fuse(
        ms, in_dims=in_dims, example_inputs=(x.double(),)))



class _MemoryEfficientDenseLayer(_DenseLayer):
    """torchvision's _DenseLayer with ``memory_efficient=True``: the bottleneck under
    ``torch.utils.checkpoint`` once any input requires grad."""

    def any_requires_grad(self, input):
        for tensor in input:
            if tensor.requires_grad:
                return True
        return False

    def call_checkpoint_bottleneck(self, input):
        def closure(*inputs):
            return self.bn_function(inputs)

        return torch.utils.checkpoint.checkpoint(closure, *input, use_reentrant=False)

    def forward(self, input):
        prev_features = [input] if isinstance(input, torch.Tensor) else input
        if self.any_requires_grad(prev_features):
            if torch.jit.is_scripting():
                raise Exception("Memory Efficient not supported in JIT")
            bottleneck_output = self.call_checkpoint_bottleneck(prev_features)
        else:
            bottleneck_output = self.bn_function(prev_features)
        return self.conv2(self.relu2(self.norm2(bottleneck_output)))


def _memory_efficient_densenets(n):
    models = _densenets([0.0] * n)
    for model in models:
        for block in model.features:
            if isinstance(block, _DenseBlock):
                for name, layer in list(block.items()):
                    efficient = _MemoryEfficientDenseLayer.__new__(_MemoryEfficientDenseLayer)
                    efficient.__dict__.update(layer.__dict__)
                    block[name] = efficient
    return models


def test_memory_efficient_densenet_names_requires_grad_and_fuses_with_example_inputs():
    """Symbolic tracing stops at ``if tensor.requires_grad:``; the error names
    ``requires_grad`` (was: "a tensor's dtype or device", with the advice to read it in
    __init__, where no input exists), and the example_inputs it points to fuse exactly."""
    models = _memory_efficient_densenets(2)
    with pytest.raises(hftc.errors.TraceError) as info:
        hftc.fuse(copy.deepcopy(models))
    message = str(info.value)
    assert "`requires_grad`" in message and "example_inputs" in message
    assert "dtype or device" not in message and "__init__" not in message
    x = torch.randn(2, 3, 8, 8)
    check_equivalence(models, x, fuser=lambda ms, in_dims=None: hftc.fuse(
        ms, in_dims=in_dims, example_inputs=(x.double().requires_grad_(),)))


def test_fuse_groups_keeps_models_that_skip_an_elementwise_op_in_one_array():
    """hftc.fuse fuses DenseNets at rates 0 and 0.3 as one program, so fuse_groups keeps
    them in one array (was: split at the rate, [[0, 2], [1]])."""
    models = _densenets([0.0, 0.3, 0.0])
    groups = hftc.fuse_groups(copy.deepcopy(models))
    assert [indices for _, indices in groups] == [[0, 1, 2]]
    fused = groups[0][0].eval()
    x = torch.randn(2, 3, 8, 8)
    out = fused(x)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model.eval()(x))


class _OptionalDropoutModule(nn.Module):
    """``self.drop = nn.Dropout(p)`` only where p > 0, called under the same branch."""

    def __init__(self, p):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.p = p
        if p > 0:
            self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.fc1(x)
        if self.p > 0:
            h = self.drop(h)
        return self.fc2(h)


def test_a_module_only_some_models_hold_is_split_by_fuse_groups_not_grouped():
    """A skipped module is another module tree (model 0 has no ``drop``): hftc.fuse still
    refuses it naming the module, and fuse_groups keeps splitting it rather than grouping
    what hftc.fuse then refuses; the function form (above) is what fuses."""
    models = []
    for seed, p in enumerate([0.0, 0.5, 0.0]):
        torch.manual_seed(seed)
        models.append(_OptionalDropoutModule(p))
    with pytest.raises(hftc.errors.MismatchError, match="nn.Dropout") as info:
        hftc.fuse(copy.deepcopy(models))
    assert "differing_ops.identity" not in str(info.value)
    assert [ix for _, ix in hftc.fuse_groups(copy.deepcopy(models))] == [[0, 2], [1]]
