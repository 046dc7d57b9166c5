"""Bad input gets an error that names the model, the node, its module path and the difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionArgumentError, FusionError, FusionTypeError, MismatchError, TraceError


class Block(nn.Module):
    def __init__(self, width=8, kernel=3, act=nn.ReLU, extra=False):
        super().__init__()
        self.conv = nn.Conv2d(3, width, kernel, padding=kernel // 2)
        self.act = act()
        self.extra = nn.Conv2d(width, width, 1) if extra else None

    def forward(self, x):
        x = self.act(self.conv(x))
        if self.extra is not None:
            x = self.extra(x)
        return x


class Net(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.layer1 = nn.Sequential(Block(), Block(**kw) if kw else Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.layer1[0](x)
        x = self.layer1[1].act(self.layer1[1].conv(x[:, :3]))
        return self.head(x.mean((2, 3)))


def test_width_mismatch_names_model_node_path_and_attribute():
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(3)]
    models.append(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)))
    with pytest.raises(MismatchError, match=r"model 3 of 4") as info:
        hftc.fuse(models)
    msg = str(info.value)
    assert "module path `0`, Linear" in msg
    assert "out_features: 8 in models 0, 1, 2; 16 in model 3" in msg
    assert "in_features: 8 in models 0, 1, 2; 16 in model 3" in msg  # the second linear too


def test_kernel_size_mismatch_in_nested_module():
    models = [Net(), Net(), Net(kernel=5)]
    with pytest.raises(MismatchError) as info:
        hftc.fuse(models)
    msg = str(info.value)
    assert "model 2 of 3" in msg
    assert "module path `layer1.1.conv`" in msg
    assert "kernel_size: (3, 3) in models 0, 1; (5, 5) in model 2" in msg


def test_extra_layer_is_reported():
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(MismatchError, match=r"(?s)model 1 of 2.*extra or missing layer\): 4 in model 0; 5 in model 1"):
        hftc.fuse([a, b])


def test_different_activation_is_reported():
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(MismatchError, match=r"class: ReLU in model 0; Tanh in model 1"):
        hftc.fuse([a, b])


def test_functional_activation_difference():
    class A(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.fn = fn

        def forward(self, x):
            return self.fn(self.fc(x))

    with pytest.raises(MismatchError, match=r"target: torch.nn.functional.relu in model 0; "
                                            r"torch.nn.functional.gelu in model 1"):
        hftc.fuse([A(F.relu), A(F.gelu)])


def test_bias_flag_difference():
    with pytest.raises(MismatchError, match=r"parameter `bias`"):
        hftc.fuse([nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3, bias=False))])


def test_isomorphic_models_from_different_code_fuse():
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.left = nn.Linear(4, 4)
            self.right = nn.Linear(4, 4)

        def forward(self, x):
            a = self.left(x)
            b = self.right(x)
            return a * b.relu()

    class B(nn.Module):  # other names, other attribute order, branches computed in another order
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4, 4)
            self.p = nn.Linear(4, 4)

        def forward(self, x):
            g = self.q(x).relu()
            f = self.p(x)
            return f * g

    a, b = A(), B()
    fused = hftc.fuse([a, b])
    x = torch.randn(2, 4)
    out = fused(x)
    torch.testing.assert_close(out[0], a(x))
    torch.testing.assert_close(out[1], b(x))
    assert fused.fusion_report.match_method == "vf2"


def test_empty_list():
    with pytest.raises(FusionArgumentError, match="at least one model"):
        hftc.fuse([])


def test_non_module():
    with pytest.raises(FusionTypeError, match=r"model 1 is a str, not a torch.nn.Module"):
        hftc.fuse([nn.Linear(2, 2), "linear"])
    with pytest.raises(FusionTypeError, match="wrap it in a list"):
        hftc.fuse(nn.Linear(2, 2))


def test_generator_of_models_is_accepted():
    fused = hftc.fuse(nn.Linear(2, 3) for _ in range(3))
    assert fused.num_models == 3


def test_stacked_input_with_wrong_leading_dim():
    fused = hftc.fuse([nn.Linear(2, 3) for _ in range(3)], in_dims=0)
    with pytest.raises(FusionArgumentError, match=r"size 4 there .* needs size 3"):
        fused(torch.randn(4, 5, 2))


def test_in_dims_tuple_of_wrong_length():
    fused = hftc.fuse([nn.Linear(2, 3) for _ in range(2)], in_dims=(0, None))
    with pytest.raises(FusionArgumentError, match="in_dims has 2 entries"):
        fused(torch.randn(2, 5, 2))


def test_mixed_modes_are_refused():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2).eval()
    with pytest.raises(MismatchError, match=r"model 0: train; model 1: eval"):
        hftc.fuse([a, b])


def test_a_branch_on_tensor_values_says_to_use_torch_where():
    # It said to pass example_inputs, with which torch.export fails on the same line.
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return x

    with pytest.raises(TraceError, match=r"model 0 \(DataDependent\).*test_errors.py:\d+ in "
                                         r"forward: `if x.sum\(\) > 0:`.*neither symbolic tracing "
                                         r"nor torch.export.*torch.where"):
        hftc.fuse([DataDependent(), DataDependent()])


def test_errors_are_fusion_errors():
    assert issubclass(MismatchError, FusionError)
    assert issubclass(FusionArgumentError, ValueError)
    assert issubclass(FusionTypeError, TypeError)


def test_a_dataclass_inside_an_output_container_gets_a_clear_error():
    # It crashed in "Boolean value of Tensor with more than one value is ambiguous".
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        n: int = 3

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 5)

        def forward(self, x):
            return [Out(self.a(x), 1)]

    with pytest.raises(hftc.errors.FusionError, match="`Out` returned a Out that holds tensors"):
        hftc.fuse([Model() for _ in range(3)])(torch.randn(4, 6))


@pytest.mark.parametrize("returns", ["x", "pair", "constant"])
def test_a_forward_that_computes_nothing_fuses(returns):
    # A graph of placeholders alone compiled to a function with no body (IndentationError).
    class Passthrough(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 5)

        def forward(self, x):
            return {"x": x, "pair": (x, x), "constant": 3}[returns]

    models = [Passthrough() for _ in range(2)]
    x = torch.randn(4, 6)
    out = hftc.fuse(models)(x)
    if returns == "constant":
        assert out == 3
    else:
        for got in (out if returns == "pair" else (out,)):
            assert got.shape == (2, 4, 6) and torch.equal(got[0], x) and torch.equal(got[1], x)
