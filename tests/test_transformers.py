"""Models from Hugging Face transformers, built from tiny configs (never downloaded),
fused through the torch.export front-end: logits and every gradient equal the originals.

transformers 5.x models do not trace symbolically; ``example_inputs`` route them
through ``torch.export``.  Their ``ModelOutput`` keeps its type, each tensor stacked.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import check_equivalence

import hftc

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

N = 3


def _fuser(example):
    return lambda models, in_dims: hftc.fuse(models, in_dims=in_dims, example_inputs=example)


def _batch(vocab=50, batch=3, length=7):
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 5:] = 0
    return ids, mask


def test_bert_sequence_classifier():
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)
    models = [transformers.BertForSequenceClassification(config) for _ in range(N)]
    ids, mask = _batch()
    fused = check_equivalence(models, (ids, mask), fuser=_fuser((ids, mask)))
    out = fused(ids, mask)
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert out.logits.shape == (N, 3, 3)
    assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)
    # eval mode, another batch size and length: the same exported graphs
    fused.eval()
    ids2, mask2 = _batch(batch=5, length=9)
    with torch.no_grad():
        out = fused(ids2, mask2)
        for i, m in enumerate(models):
            ref = m.double().eval()(ids2, mask2).logits
            torch.testing.assert_close(out.logits[i].double(), ref, rtol=1e-9, atol=1e-9)


def test_gpt2_language_model():
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    models = [transformers.GPT2LMHeadModel(config) for _ in range(N)]
    assert models[0].lm_head.weight is models[0].transformer.wte.weight  # tied
    ids, mask = _batch()
    example = (ids, None, mask)  # forward(input_ids, past_key_values, attention_mask)
    fused = check_equivalence(models, example, fuser=_fuser(example))
    assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)
    assert fused.lm_head.weight is fused.transformer.wte.weight  # still tied, per model
    out = fused(*example)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (N, 3, 7, 50)
    unfused = fused.unfuse()
    assert unfused[1].lm_head.weight is unfused[1].transformer.wte.weight


def test_a_returned_cache_says_to_turn_use_cache_off():
    """A config left at use_cache=True returns a DynamicCache, which torch.export cannot
    flatten; the error quoted torch's pytree advice only. It now says what to change."""
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    ids, _ = _batch()
    with pytest.raises(hftc.errors.TraceError, match=r"DynamicCache.*use_cache=False"):
        hftc.fuse([transformers.GPT2LMHeadModel(config) for _ in range(2)],
                  example_inputs=(ids,))


class _HeadWithModelOutput(torch.nn.Module):
    """A custom model that returns a transformers ModelOutput (a dataclass and a dict)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x, labels):
        from transformers.modeling_outputs import SequenceClassifierOutput

        logits = self.fc(x)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def test_a_model_output_from_a_symbolically_traced_model_keeps_its_class():
    # fx records a dict for a dict subclass before it looks for a dataclass: the fused
    # module returned a plain dict (out.logits raised AttributeError).
    from transformers.modeling_outputs import SequenceClassifierOutput

    torch.manual_seed(0)
    models = [_HeadWithModelOutput() for _ in range(3)]
    x, labels = torch.randn(4, 6), torch.randint(0, 3, (4,))
    out = hftc.fuse(models)(x, labels)
    assert type(out) is SequenceClassifierOutput and list(out.keys()) == ["loss", "logits"]
    assert out.logits.shape == (3, 4, 3) and out[0] is out.loss
    for i, m in enumerate(models):
        want = m(x, labels)
        torch.testing.assert_close(out.logits[i], want.logits)
        torch.testing.assert_close(out.loss[i], want.loss)
    check_equivalence(models, (x, labels), steps=2)


def test_a_call_with_other_keyword_inputs_exports_again():
    """Fused from example_inputs=(input_ids, attention_mask), the module refused
    fused(input_ids=ids, labels=labels) ("unexpected keyword inputs ['labels']") and
    fused(ids, None) (a tensor in example_inputs, None now): such a call now exports the
    models again with its own inputs as the example (once per pattern of inputs), and
    gives each model's logits, loss and gradients as the model alone, float64."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)
    models = [transformers.BertForSequenceClassification(config).double() for _ in range(N)]
    ids, mask = _batch()
    fused = hftc.fuse(models, example_inputs=(ids, mask))
    labels = torch.tensor([0, 2, 1])
    ids2, _ = _batch(batch=4, length=6)
    for call, ref_call in (
            (lambda: fused(input_ids=ids, labels=labels),
             lambda m: m(input_ids=ids, labels=labels)),
            (lambda: fused(ids2, None), lambda m: m(ids2, None)),
            (lambda: fused(ids, labels=labels, attention_mask=mask),
             lambda m: m(ids, labels=labels, attention_mask=mask))):
        fused.zero_grad()
        out = call()
        (out.logits.pow(2).sum() + (out.loss.sum() if out.loss is not None else 0)).backward()
        for i, m in enumerate(models):
            m.zero_grad()
            ref = ref_call(m)
            torch.testing.assert_close(out.logits[i], ref.logits, rtol=1e-9, atol=1e-12)
            if ref.loss is not None:
                torch.testing.assert_close(out.loss[i], ref.loss, rtol=1e-9, atol=1e-12)
            (ref.logits.pow(2).sum() + (ref.loss if ref.loss is not None else 0)).backward()
            for name, p in m.named_parameters():
                if p.grad is not None:
                    torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad,
                                               rtol=1e-9, atol=1e-12, msg=name)
    exported = fused.__dict__["_reexported_graphs"]
    assert len(exported) == 3
    fused(input_ids=ids2, labels=labels.repeat(2)[:4])  # the same pattern: no new export
    assert len(exported) == 3
    # `label` (not `labels`) goes to forward's **kwargs, which BERT ignores: so does the
    # fused module (logits, no loss), as each model alone
    out = fused(input_ids=ids, label=labels)
    assert out.loss is None and models[0](input_ids=ids, label=labels).loss is None
    torch.testing.assert_close(out.logits[1], models[1](input_ids=ids).logits)


def test_keyword_inputs_taken_by_forwards_kwargs_reach_each_model_as_keywords():
    """The Hugging Face Trainer calls model(input_ids=..., labels=..., num_items_in_batch=n),
    n going to forward's **kwargs. The fused module refused it ("got keyword input(s)
    ['num_items_in_batch'], which are not among its named inputs"); it now exports the
    models with n as a keyword, and runs the models' own forward (the first-call check)
    with n as a keyword too: passed by position after `labels`, n became GPT-2's
    `use_cache` (a DynamicCache came back). Loss (sum over tokens / n), logits and
    gradients equal each model's, float64."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    models = [transformers.GPT2LMHeadModel(config).double() for _ in range(N)]
    ids, _ = _batch()
    fused = hftc.fuse(models, example_inputs=(ids,))
    count = torch.tensor(11.0)  # not the 18 predicted tokens: the loss is not a mean
    out = fused(input_ids=ids, labels=ids, num_items_in_batch=count)
    (out.loss.sum() + out.logits.pow(2).sum() / 100).backward()
    for i, m in enumerate(models):
        ref = m(input_ids=ids, labels=ids, num_items_in_batch=count)
        assert list(ref.keys()) == list(out.keys()) == ["loss", "logits"]
        # transformers computes the LM loss in float32 (logits.float()): float32's rounding
        torch.testing.assert_close(out.loss[i], ref.loss, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(out.logits[i], ref.logits, rtol=1e-9, atol=1e-12)
        (ref.loss + ref.logits.pow(2).sum() / 100).backward()
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad,
                                       rtol=1e-6, atol=1e-9, msg=name)
    assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)


class _NoKwargs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x, labels=None):
        return self.fc(x)


def test_a_keyword_input_forward_cannot_take_is_refused():
    models = [_NoKwargs() for _ in range(2)]
    x = torch.randn(4, 6)
    fused = hftc.fuse(models, example_inputs=(x,), frontend="export")
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"_NoKwargs.forward: got an unexpected keyword argument 'label'.*"
                             r"call the fused module as you would call one model"):
        fused(x, label=torch.zeros(4))
