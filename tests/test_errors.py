"""Bad input gets an error that names the model, the node, its module path and the difference."""

from __future__ import annotations

import re

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
    assert "model 3's `0` (nn.Linear) differs from model 0's: out_features 16 vs 8" in msg
    assert "model 3's `2` (nn.Linear) differs from model 0's: in_features 16 vs 8" in msg
    assert "parameter `2.weight`: shape (2, 16) vs (2, 8)" in msg  # in words, no tuples
    assert "('parameter'" not in msg and "torch.float32" not in msg


def test_kernel_size_mismatch_in_nested_module():
    models = [Net(), Net(), Net(kernel=5)]
    with pytest.raises(MismatchError) as info:
        hftc.fuse(models)
    msg = str(info.value)
    assert "model 2 of 3" in msg
    assert "model 2's `layer1.1.conv` (nn.Conv2d) differs from model 0's: kernel_size (5, 5) " \
        "vs (3, 3); padding (2, 2) vs (1, 1); parameter `layer1.1.conv.weight`: shape " \
        "(8, 3, 5, 5) vs (8, 3, 3, 3)" in msg
    assert "hftc fuses models of the same architecture" in msg


def test_extra_layer_is_reported():
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(MismatchError, match=r"(?s)model 1 of 2.*model 1's graph has 5 nodes, "
                                            r"model 0's 4 \(an extra or missing layer\)"):
        hftc.fuse([a, b])


def test_an_activation_that_cannot_differ_per_model_is_reported():
    # (ReLU against Tanh fuses: tests/test_differing_ops.py)
    a = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    b = nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=-1))
    with pytest.raises(MismatchError, match=r"class Softmax vs ReLU; only an elementwise op"):
        hftc.fuse([a, b])


def test_functional_activation_difference():
    class A(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.fn = fn

        def forward(self, x):
            return self.fn(self.fc(x))

    # (F.relu against F.gelu fuses: tests/test_differing_ops.py)
    with pytest.raises(MismatchError, match=r"model 1's node `normalize` \(torch.nn.functional."
                                            r"normalize in the model's own forward\) differs "
                                            r"from model 0's node `relu` \(torch.nn.functional."
                                            r"relu in the model's own forward\): target "
                                            r"torch.nn.functional.normalize vs "
                                            r"torch.nn.functional.relu"):
        hftc.fuse([A(F.relu), A(F.normalize)])


def test_bias_flag_difference():
    with pytest.raises(MismatchError, match=r"parameter `0.bias`: none vs a float32 parameter"):
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


class TwoLayer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.fc = nn.Linear(8, hidden)
        self.out = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def _frozen_fc(model):
    model.fc.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize(("models", "expected"), [
    ([TwoLayer(), TwoLayer().double()],
     r"model 1's `fc` \(nn.Linear\) differs from model 0's: parameter `fc.weight`: dtype float64 "
     r"vs float32; parameter `fc.bias`: dtype float64 vs float32\n(?s:.*)Convert every model to "
     r"one dtype with \.to\(dtype\) before fusing"),
    ([TwoLayer(), _frozen_fc(TwoLayer())],
     r"model 1's `fc` \(nn.Linear\) differs from model 0's: parameter `fc.weight`: requires_grad "
     r"False vs True\nFreeze the same parameters in every model"),
    ([TwoLayer(), TwoLayer(), TwoLayer(32)],
     r"model 2's `fc` \(nn.Linear\) differs from model 0's: out_features 32 vs 16; parameter "
     r"`fc.weight`: shape \(32, 8\) vs \(16, 8\); parameter `fc.bias`: shape \(32,\) vs \(16,\)"
     r"(?s:.*)Models that differ only in layer widths fuse with hftc.fuse\(models, "
     r"pad_widths=True\)"),
    ([nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 5)],
     r"model 1 \(the model itself, nn.Conv2d\) differs from model 0: kernel_size \(5, 5\) vs "
     r"\(3, 3\); parameter `weight`: shape \(4, 3, 5, 5\) vs \(4, 3, 3, 3\)\n"
     r"hftc fuses models of the same architecture"),  # a kernel size is no width
    ([nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3).double()],
     r"model 2 \(the model itself, nn.Conv2d\) differs from model 0: parameter `weight`: dtype "
     r"float64 vs float32; parameter `bias`: dtype float64 vs float32\nConvert every model"),
], ids=["dtype", "requires_grad", "shape", "bare-conv-kernel", "bare-conv-dtype"])
def test_mismatch_says_in_words_what_differs_and_what_to_change(models, expected):
    # It printed the internal signature tuples ("('parameter', (16, 8), torch.float32, 'cpu',
    # True) in model 0; ..."), and for a bare nn.Conv2d only its weight's, never kernel_size.
    with pytest.raises(MismatchError, match=expected) as info:
        hftc.fuse(models)
    assert "('parameter'" not in str(info.value) and "torch.float" not in str(info.value)


def _with_unused(model, **tensors):
    for name, value in tensors.items():
        if isinstance(value, nn.Parameter):
            model.register_parameter(name, value)
        else:
            model.register_buffer(name, value)
    return model


@pytest.mark.parametrize(("models", "expected"), [
    ([TwoLayer(), _with_unused(TwoLayer(), extra=nn.Parameter(torch.zeros(3)))],
     r"model 1 has parameter\(s\) that model 0 lacks: `extra` \(a float32 parameter of shape "
     r"\(3,\)\)\. Forward does not read them, and the fused module, built on model 0's "
     r"parameters, would drop them from model 1's model_state_dict\(\) and unfuse\(\)\. "
     r"Register the same parameters in every model"),
    ([_with_unused(TwoLayer(), extra=nn.Parameter(torch.zeros(3))), TwoLayer()],
     r"model 1 has no parameter `extra`, which model 0 has \(a float32 parameter of shape "
     r"\(3,\)\)\. Register the same parameters in every model"),
    ([_with_unused(TwoLayer(), extra=nn.Parameter(torch.zeros(3))),
      _with_unused(TwoLayer(), extra=nn.Parameter(torch.zeros(5)))],
     r"model 1's parameter `extra` differs from model 0's: shape \(5,\) vs \(3,\)\. Models "
     r"that differ only in layer widths fuse with hftc.fuse\(models, pad_widths=True\)"),
    ([_with_unused(TwoLayer(), steps=torch.zeros(2)),
      _with_unused(TwoLayer(), steps=torch.zeros(2, dtype=torch.float64))],
     r"model 1's buffer `steps` differs from model 0's: dtype float64 vs float32\. Convert "
     r"every model to one dtype"),
    ([TwoLayer(), _with_unused(TwoLayer(), count=torch.zeros(()))],
     r"model 1 has buffer\(s\) that model 0 lacks: `count` \(a float32 tensor of shape \(\)\)"),
], ids=["extra-in-model-1", "extra-in-model-0", "other-shape", "other-dtype", "extra-buffer"])
def test_a_tensor_forward_does_not_read_must_agree_too(models, expected):
    # Registered in model 1 only, it fused silently and was dropped from model 1's
    # model_state_dict() and unfuse(); of another shape, it crashed in torch.stack.
    with pytest.raises(MismatchError, match=expected):
        hftc.fuse(models)


def test_a_parameter_two_models_share_is_refused():
    # m1.fc.weight = m0.fc.weight: the user's two models train one tensor; it was fused as
    # two independent copies without a word.
    models = [TwoLayer() for _ in range(3)]
    models[2].fc.weight = models[1].fc.weight
    with pytest.raises(FusionArgumentError,
                       match=r"model 2's parameter `fc.weight` is model 1's `fc.weight` \(the "
                             r"same tensor\): the models train it together .* would train the "
                             r"copies apart, silently\. Give each model its own parameters: "
                             r"build each model anew, or fuse copies \(hftc\.fuse\(\[copy\."
                             r"deepcopy\(m\) for m in models\]\)\)"):
        hftc.fuse(models)
    shared_norm = nn.BatchNorm1d(16).requires_grad_(False)  # frozen, but in training mode
    with_norm = [nn.Sequential(nn.Linear(8, 16), shared_norm) for _ in range(2)]
    with pytest.raises(FusionArgumentError, match=r"model 1's buffer `1.running_mean` is model "
                                                  r"0's `1.running_mean` \(the same tensor\)"):
        hftc.fuse(with_norm)


def test_a_frozen_shared_backbone_fuses_as_copies_that_compute_the_same():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)).requires_grad_(False).eval()

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.head = backbone, nn.Linear(16, 2)

        def forward(self, x):
            return self.head(torch.relu(self.backbone(x)))

    models = [Probe().eval() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(5, 8)
    out = fused(x)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(x))


def test_an_integer_input_to_float_models_says_to_cast_it():
    # It raised the batched kernel's "Input dtypes must be the same, got: input float,
    # batch1: long int, batch2: float".
    fused = hftc.fuse([TwoLayer() for _ in range(2)])
    with pytest.raises(FusionArgumentError,
                       match=r"input 0 \(`x`\) is int64, but the models' parameters are float32 "
                             r"and an op of their forward needs the input in float32 \(.*\): "
                             r"pass x\.float\(\) \(x\.to\(torch\.float32\)\)"):
        fused(torch.randint(0, 5, (4, 8)))


@pytest.mark.parametrize("in_dims", ["0", 0.0, True, (0, "1"), {0: 0}])
def test_in_dims_of_another_type_is_refused_when_fusing(in_dims):
    # in_dims="0" failed on the first call with "'<=' not supported between instances of
    # 'int' and 'str'".
    with pytest.raises(FusionArgumentError, match=r"in_dims must be None \(every input shared "
                                                  r"by the models\), an int .* or a tuple with "
                                                  r"one entry per input of forward .*; "
                                                  rf"got {re.escape(repr(in_dims))}"):
        hftc.fuse([TwoLayer() for _ in range(2)], in_dims=in_dims)


def test_in_dims_of_numpy_integers_are_ints():
    import numpy as np

    fused = hftc.fuse([TwoLayer() for _ in range(2)], in_dims=[np.int64(0)])
    assert fused.in_dims == (0,) and type(fused.in_dims[0]) is int
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(fused(x)[1], fused.unfuse_model(1)(x[1]))


def test_too_many_inputs_says_what_forward_takes():
    # It spoke of torch.export and example_inputs for a symbolically traced model.
    fused = hftc.fuse([TwoLayer() for _ in range(2)])
    x = torch.randn(3, 8)
    with pytest.raises(FusionArgumentError, match=r"the fused module got 2 positional inputs, "
                                                  r"but the models' forward takes 1 input "
                                                  r"\(`x`\) at .*test_errors.py:\d+: "
                                                  r"`fused\(x, x\)`: call it as you would "
                                                  r"call one model \(fused\(x\)") as info:
        fused(x, x)
    assert "export" not in str(info.value)


def test_a_model_index_must_be_an_int_in_range():
    fused = hftc.fuse([TwoLayer() for _ in range(3)])
    with pytest.raises(hftc.errors.FusionTypeError, match=r"a model index must be an int, got "
                                                          r"'1' \(str\): pass an int in "
                                                          r"range\(3\)"):
        fused.model_state_dict("1")
    with pytest.raises(IndexError, match=r"model index 3 out of range for 3 models: pass an int "
                                         r"in range\(3\)") as info:
        fused.unfuse_model(3)
    assert isinstance(info.value, FusionError)
    assert torch.equal(fused.model_state_dict(torch.tensor(2))["fc.weight"],
                       fused.model_state_dict(-1)["fc.weight"])


def test_fusing_fused_modules_says_to_fuse_the_originals():
    # It raised a TraceError that advised example_inputs, which then failed in torch.export.
    fused_a = hftc.fuse([TwoLayer() for _ in range(2)])
    fused_b = hftc.fuse([TwoLayer() for _ in range(2)])
    for example in (None, (torch.randn(3, 8),)):
        with pytest.raises(FusionTypeError,
                           match=r"model 0 is a FusedModule \(2 models fused\): hftc fuses the "
                                 r"original models, not fused modules\. Fuse the original "
                                 r"models together \(hftc\.fuse\(models_a \+ models_b\)\), or "
                                 r"unfuse first: hftc\.fuse\(fused_a\.unfuse\(\) \+ "
                                 r"fused_b\.unfuse\(\)\)"):
            hftc.fuse([fused_a, fused_b], example_inputs=example)
    wrapper = nn.Sequential(nn.Linear(8, 8), fused_a)
    with pytest.raises(FusionTypeError, match=r"model 1's submodule `1` is a FusedModule"):
        hftc.fuse([nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), wrapper])


def test_models_wrapped_in_data_parallel_say_to_fuse_the_models_inside():
    """The ImageNet example's ``model = torch.nn.DataParallel(model)`` before fusing was a
    TraceError about "Proxy object cannot be iterated" and tensor-valued branches; it names
    the wrapper and says to fuse ``m.module`` and wrap the fused module."""
    models = [nn.DataParallel(TwoLayer()) for _ in range(2)]
    with pytest.raises(FusionTypeError,
                       match=r"model 0 is wrapped in nn\.DataParallel \(TwoLayer inside\).*"
                             r"hftc\.fuse\(\[m\.module for m in models\]\).*"
                             r"DistributedDataParallel\(fused\)"):
        hftc.fuse(models)
    fused = hftc.fuse([m.module for m in models])  # the advice works
    x = torch.randn(3, 8)
    torch.testing.assert_close(fused(x)[1], models[1](x))


class Generator(nn.Module):
    """A DCGAN-style generator (pytorch/examples dcgan, small): z -> 3x8x8 images."""

    def __init__(self, nz=6):
        super().__init__()
        self.project = nn.Linear(nz, 8 * 4 * 4)
        self.up = nn.ConvTranspose2d(8, 3, 4, stride=2, padding=1)

    def forward(self, z):
        return torch.tanh(self.up(F.relu(self.project(z)).view(-1, 8, 4, 4)))


class Discriminator(nn.Module):
    """A DCGAN-style discriminator: 3x8x8 images -> one logit."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=2, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 1)

    def forward(self, images):
        return self.head(F.leaky_relu(self.conv(images), 0.2).flatten(1))


def test_gan_discriminator_fused_with_shared_inputs_says_to_pass_in_dims_for_fakes():
    # D fused with shared inputs, then called on a fused generator's fakes [N, B, 3, 8, 8]:
    # it failed deep inside ("running model 0 to learn its shapes failed: ... Expected 3D
    # (unbatched) or 4D (batched) input to conv2d") with no word of in_dims.
    torch.manual_seed(0)
    n, batch = 3, 5
    generators, discriminators = [Generator() for _ in range(n)], [Discriminator() for _ in range(n)]
    fused_g, fused_d = hftc.fuse(generators), hftc.fuse(discriminators)
    real = torch.randn(batch, 3, 8, 8)
    fused_d(real)  # real images are shared: fine
    fakes = fused_g(torch.randn(batch, 6))
    assert fakes.shape == (n, batch, 3, 8, 8)
    with pytest.raises(FusionArgumentError,
                       match=r"the models cannot run on input 0 \(`images`\) \(RuntimeError: "
                             r"Expected 3D \(unbatched\) or 4D \(batched\) input to conv2d.*\), "
                             r"which the fused module shares among the 3 models \(in_dims=None "
                             r"gives every model the whole tensor\), but model 0 runs on its "
                             r"slice \[0\].* To give model i slice i, fuse with in_dims: "
                             r"hftc\.fuse\(models, in_dims=0\); an input all models share is "
                             r"then passed expanded, one slice per model \(x\.expand\(3, "
                             r"\*x\.shape\)\)"):
        fused_d(fakes.detach())
    # What the message says to do computes what each discriminator computes on its fakes.
    per_model_d = hftc.fuse(discriminators, in_dims=0)
    out_fake = per_model_d(fakes.detach())
    out_real = per_model_d(real.expand(n, *real.shape))
    for i, d in enumerate(discriminators):
        torch.testing.assert_close(out_fake[i], d(fakes[i].detach()))
        torch.testing.assert_close(out_real[i], d(real))


class CharRNN(nn.Module):
    """A char-RNN (pytorch/examples word_language_model style, GRU): the hidden state is
    returned and fed back on the next chunk (truncated BPTT)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.rnn = nn.GRU(6, 7, batch_first=True)
        self.decoder = nn.Linear(7, 12)

    def forward(self, tokens, hidden=None):
        output, hidden = self.rnn(self.embed(tokens), hidden)
        return self.decoder(output), hidden


def test_rnn_hidden_state_fed_back_says_to_pass_in_dims_for_it():
    # The fused module returns the N hidden states stacked [N, 1, B, H]; fed back as a
    # shared input, it failed deep inside ("For batched 3-D input, hx should also be 3-D
    # but got 4-D tensor") with no word of in_dims.
    torch.manual_seed(0)
    n = 3
    models = [CharRNN() for _ in range(n)]
    fused = hftc.fuse(models)
    chunks = torch.randint(0, 12, (2, 4, 5))
    _, hidden = fused(chunks[0])
    assert hidden.shape == (n, 1, 4, 7)
    with pytest.raises(FusionArgumentError,
                       match=r"the models cannot run on input 1 \(`hidden`\) \(RuntimeError: "
                             r"For batched 3-D input, hx should also be 3-D but got 4-D "
                             r"tensor\).* To give model i slice i, fuse with in_dims: "
                             r"hftc\.fuse\(models, in_dims=\(None, 0\)\)$"):
        fused(chunks[0], hidden)
    # As the message says: tokens shared, the hidden state one slice per model.
    fused = hftc.fuse(models, in_dims=(None, 0))
    hidden, hiddens = None, [None] * n
    for chunk in chunks:
        out, hidden = fused(chunk) if hidden is None else fused(chunk, hidden)
        for i, model in enumerate(models):
            expected, hiddens[i] = model(chunk, hiddens[i])
            torch.testing.assert_close(out[i], expected)
            torch.testing.assert_close(hidden[i], hiddens[i])


def test_models_of_another_dtype_traced_by_export_say_so():
    # Exporting model 1 on the example inputs failed in torch first: "Input type (float)
    # and bias type (double) should be the same", as a TraceError about example_inputs.
    with pytest.raises(MismatchError, match=r"model 1's parameter `fc.weight` is float64, where "
                                            r"model 0's parameters are float32\. Convert every "
                                            r"model to one dtype with \.to\(dtype\)"):
        hftc.fuse([TwoLayer(), TwoLayer().double()], example_inputs=(torch.randn(3, 8),),
                  frontend="export")


class _WordLSTM(nn.Module):
    """pytorch/examples' word language model in small: its LSTM state (h, c) is carried."""

    def __init__(self, state_as_tuple: bool):
        super().__init__()
        self.state_as_tuple = state_as_tuple
        self.encoder, self.rnn, self.decoder = nn.Embedding(10, 8), nn.LSTM(8, 8), nn.Linear(8, 10)

    def forward(self, x, h, c=None):
        output, (h, c) = self.rnn(self.encoder(x), h if self.state_as_tuple else (h, c))
        return self.decoder(output), h, c


def test_a_carried_lstm_state_tuple_with_in_dims_stacks_its_tensors():
    torch.manual_seed(0)
    x = torch.randint(0, 10, (5, 2))
    # A tuple's in_dims entry stacks every tensor in it (vmap's pytree prefix; it was
    # refused with "in_dims stacks tensor inputs only").
    models = [_WordLSTM(True) for _ in range(3)]
    h, c = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8)
    out, h2, c2 = hftc.fuse(models, in_dims=(None, 0))(x, (h, c))
    for i, m in enumerate(models):
        torch.testing.assert_close((out[i], h2[i], c2[i]), m(x, (h[i], c[i])))
    # The state's tensors as inputs of their own, each model its slice.
    models = [_WordLSTM(False) for _ in range(3)]
    fused = hftc.fuse(models, in_dims=(None, 0, 0))
    h, c = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8)
    for _ in range(2):  # the state each call returns is fed back
        out, h2, c2 = fused(x, h, c)
        for i, m in enumerate(models):
            want = m(x, h[i], c[i])
            for got, expected in zip((out[i], h2[i], c2[i]), want):
                torch.testing.assert_close(got, expected)
        h, c = h2.detach(), c2.detach()
