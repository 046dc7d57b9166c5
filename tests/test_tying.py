"""Weight tying inside a model (an output projection sharing the embedding) stays tied,
per model: in the fused module, through fused training, and after ``unfuse()``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc

N = 3
V, D = 11, 6


class TiedLM(nn.Module):
    """A language model whose output projection is the embedding table (tied)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class TiedLMUntraceable(TiedLM):
    def forward(self, ids):
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        return super().forward(ids)


@pytest.mark.parametrize("cls", [TiedLM, TiedLMUntraceable])
def test_tied_pair_stays_tied_through_fused_sgd(cls):
    models = [cls().double() for _ in range(N)]
    refs = copy.deepcopy(models)
    ids = torch.randint(0, V, (4, 5))
    targets = torch.randint(0, V, (4, 5))
    fused = hftc.fuse(models, example_inputs=(ids,))
    assert fused.head.weight is fused.embed.weight
    assert len(list(fused.parameters())) == 3  # embed/head, mix.weight, mix.bias
    lrs = [0.1, 0.2, 0.3]
    opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(refs, lrs)]
    for _ in range(5):
        out = fused(ids)
        loss = sum(F.cross_entropy(out[i].reshape(-1, V), targets.reshape(-1)) for i in range(N))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for m, o in zip(refs, ref_opts):
            o.zero_grad()
            F.cross_entropy(m(ids).reshape(-1, V), targets.reshape(-1)).backward()
            o.step()
    assert fused.head.weight is fused.embed.weight
    for i, (model, ref) in enumerate(zip(fused.unfuse(), refs)):
        assert model.head.weight is model.embed.weight  # tied after unfuse
        torch.testing.assert_close(model.embed.weight, ref.embed.weight, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fused.state_dict()["head.weight"][i], ref.head.weight,
                                   rtol=1e-9, atol=1e-12)
        assert torch.equal(fused.model_state_dict(i)["head.weight"],
                           fused.model_state_dict(i)["embed.weight"])


def test_tying_must_agree_across_models():
    models = [TiedLM() for _ in range(N)]
    models[1].head.weight = nn.Parameter(models[1].embed.weight.detach().clone())  # untied
    with pytest.raises(hftc.errors.FusionError, match="tying"):
        hftc.fuse(models)
