"""Models whose Python symbolic tracing stops in, written as the real ones (real_style.py).

Each one either fuses now and equals the loop over the originals, or fails with a
TraceError that names the model, the line of its code and a fix, and the test then
applies that fix and checks that it works.  No message carries torch.fx's or
torch.export's debugging text.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from equivalence import check_equivalence
from real_style import GPT, RNNModel, TransformerModel, ViT

import hftc
from hftc.errors import TraceError

N = 3

DEBUGGING_TEXT = ("tlparse", "While executing", "TORCH_LOGS", "Original traceback",
                  "torch.fx.wrap", "torch.cond")


def _plain(message: str) -> None:
    for text in DEBUGGING_TEXT:
        assert text not in message, f"{text!r} in: {message}"


def _no_check(models, in_dims=None, **kwargs):
    """Fused without the first-call check: a wrong graph would show as wrong numbers."""
    return hftc.fuse(models, in_dims=in_dims, check=False, **kwargs)


# --------------------------------------------------------------------------- nanoGPT


def test_nanogpt_assert_on_the_sequence_length_names_the_line_and_the_fix():
    torch.manual_seed(0)
    models = [GPT() for _ in range(N)]
    with pytest.raises(TraceError, match=r"model 0 \(GPT\) cannot be traced by torch.fx."
                                         r"symbolic_trace at tests.real_style.py:\d+ in forward: "
                                         r"`assert t <= self.config.block_size.*the size of input "
                                         r"`idx`.*example_inputs=\(\.\.\.\)") as caught:
        hftc.fuse(models)
    _plain(str(caught.value))
    # The fix it gives: torch.export follows the assert, with the sequence length free.
    idx, targets = torch.randint(0, 17, (4, 8)), torch.randint(0, 17, (4, 8))
    check_equivalence(models, (idx, targets), steps=2,
                      fuser=lambda ms, in_dims: _no_check(ms, in_dims,
                                                          example_inputs=(idx, targets)))
    fused = hftc.fuse(copy.deepcopy(models), example_inputs=(idx,), check=False)
    shorter = torch.randint(0, 17, (3, 5))
    logits, loss = fused(shorter)
    assert loss is None
    for i, m in enumerate(models):
        torch.testing.assert_close(logits[i], m(shorter)[0])


# --------------------------------------------------------------------------- timm's ViT


@pytest.mark.parametrize("fused_attn", [True, False])
def test_vit_is_causal_flag_is_a_constant_of_the_trace(fused_attn):
    """timm's ``Attention.forward(x, attn_mask=None, is_causal: bool = False)``: with
    ``fused_attn=False`` it branches ``if is_causal:``, which failed to trace (the flag was
    a traced value).  The flag is traced as its default, and a call that passes another
    value gets a graph traced with that value (without the first-call check: a graph of
    the default would give wrong numbers)."""
    torch.manual_seed(0)
    models = [ViT(fused_attn=fused_attn) for _ in range(N)]
    x = torch.randn(2, 3, 8, 8)
    fused = check_equivalence(models, (x,), steps=2, fuser=_no_check)
    assert fused.last_program().one_by_one is None
    check_equivalence(models, (x, None, True), steps=2, fuser=_no_check)
    # one fused module, the flag changing from call to call
    fused = hftc.fuse(copy.deepcopy(models), check=False)
    for flag in (False, True, False, True):
        out = fused(x, is_causal=flag)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x, is_causal=flag))


# --------------------------------------------------------------------------- word_language_model


def test_word_language_model_transformer_names_the_line_and_the_fix():
    """``forward(src, has_mask=True)``: ``if has_mask:`` is Python again (the flag traced as
    its default), and the next line, ``len(src)``, is named with its fix."""
    torch.manual_seed(0)
    models = [TransformerModel() for _ in range(N)]
    with pytest.raises(TraceError, match=r"model 0 \(TransformerModel\) cannot be traced by "
                                         r"torch.fx.symbolic_trace at tests.real_style.py:\d+ in "
                                         r"forward: `mask = self._generate_square_subsequent_mask"
                                         r"\(len\(src\)\).*size of input `src`.*example_inputs") \
            as caught:
        hftc.fuse(models)
    _plain(str(caught.value))


def test_word_language_model_transformer_through_example_inputs():
    """The fix the error gives: torch.export traces it.  nn.TransformerEncoder's check
    whether the mask is causal (it compares the mask's values) failed to export, with the
    partial graph printed to stderr; the encoder now runs hftc's forward of the same math.
    The sequence length is fixed (``len(src)`` in Python), the batch size free."""
    torch.manual_seed(0)
    models = [TransformerModel() for _ in range(N)]
    src = torch.randint(0, 19, (6, 2))
    for train in (True, False):
        check_equivalence(models, (src,), train=train, steps=2,
                          fuser=lambda ms, in_dims: _no_check(ms, in_dims, example_inputs=(src,)))
    for m in models:
        assert m.src_mask is None  # fusing left the models' cached mask alone
    fused = hftc.fuse(copy.deepcopy(models), example_inputs=(src,), check=False)
    wider = torch.randint(0, 19, (6, 5))
    out = fused(wider)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(wider))


def test_word_language_model_without_a_mask_through_example_inputs():
    """``has_mask=False`` in example_inputs: traced symbolically with that constant."""
    torch.manual_seed(0)
    models = [TransformerModel() for _ in range(N)]
    src = torch.randint(0, 19, (6, 2))
    fused = check_equivalence(
        models, (src, False), steps=2,
        fuser=lambda ms, in_dims: _no_check(ms, in_dims, example_inputs=(src, False)))
    assert fused.last_program().one_by_one is None
    fused = hftc.fuse(copy.deepcopy(models), example_inputs=(src, False), check=False)
    longer = torch.randint(0, 19, (9, 3))  # the sequence length is not fixed
    out = fused(longer, False)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(longer, False))


def test_word_language_model_rnn():
    torch.manual_seed(0)
    models = [RNNModel() for _ in range(N)]
    src = torch.randint(0, 19, (6, 2))
    check_equivalence(models, (src, models[0].init_hidden(2)), steps=2, fuser=_no_check)


# --------------------------------------------------------------------------- flags and sizes


class FlagWithoutDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, has_mask):
        h = self.fc(x)
        if has_mask:
            h = h.masked_fill(torch.ones_like(h, dtype=torch.bool).triu(1), 0.0)
        return h


def test_a_flag_without_default_names_the_input_and_the_fix():
    torch.manual_seed(0)
    models = [FlagWithoutDefault() for _ in range(N)]
    x = torch.randn(4, 4)
    with pytest.raises(TraceError, match=r"model 0 \(FlagWithoutDefault\).*test_trace_errors.py:"
                                         r"\d+ in forward: `if has_mask:`.*input `has_mask`.*"
                                         r"example_inputs") as caught:
        hftc.fuse(models)
    _plain(str(caught.value))
    # The fix: its value in example_inputs; a call with the other value is traced again.
    fused = hftc.fuse(copy.deepcopy(models), example_inputs=(x, True), check=False)
    for flag in (True, False, True):
        out = fused(x, flag)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x, flag))
    check_equivalence(models, (x, False), steps=2,
                      fuser=lambda ms, in_dims: _no_check(ms, in_dims, example_inputs=(x, False)))


class SizedZeros(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 51)

    def forward(self, x):
        return self.fc(x) + torch.zeros(x.size(0), 51, dtype=x.dtype)


def test_a_factory_given_a_size_of_an_input_traces():
    """``torch.zeros(x.size(0), 51)`` failed ("zeros() takes 1 positional argument but 2
    were given"): the sizes are packed into one tuple while tracing."""
    torch.manual_seed(0)
    models = [SizedZeros() for _ in range(N)]
    check_equivalence(models, torch.randn(4, 6), steps=2, fuser=_no_check)
    check_equivalence(models, torch.randn(N, 5, 6), in_dims=0, steps=2, fuser=_no_check)


def test_a_call_with_inputs_the_models_do_not_take_names_the_node():
    fused = hftc.fuse([SizedZeros() for _ in range(N)])
    with pytest.raises(TraceError, match=r"model 0 \(SizedZeros\) fails on this call's inputs "
                                         r"\(`x` \[4, 7\] float32.*node `fc` \(module path `fc`, "
                                         r"Linear\).*Call the fused module with inputs") as caught:
        fused(torch.randn(4, 7))
    _plain(str(caught.value))
