"""Models whose forward calls a function over their own submodules (hftc/frontends/closures.py).

minGPT's ``Block`` keeps ``self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))``
over its ModuleDict ``m``.  ``copy.deepcopy`` keeps the function, so every copy hftc made
of model 0 (the first-call check's references, the models run one by one, ``unfuse()``)
ran model 0's own MLP: the check failed falsely and the fallback trained every model with
model 0's MLP.  Each copy now holds its own function over its own modules; what cannot be
made right (another model's module in a closure) is refused.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionArgumentError, FusionWarning

VOCAB, BLOCK, EMBD = 11, 6, 8


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_head=2, pdrop=0.0):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.attn_dropout = nn.Dropout(pdrop)
        self.resid_dropout = nn.Dropout(pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    """minGPT's block; ``style`` picks how the MLP function holds the block's modules."""

    def __init__(self, style="lambda", pdrop=0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention(pdrop=pdrop)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(EMBD, 4 * EMBD),
                                      c_proj=nn.Linear(4 * EMBD, EMBD),
                                      act=NewGELU(), dropout=nn.Dropout(pdrop)))
        m = self.mlp
        if style == "lambda":  # minGPT's own
            self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))
        elif style == "nested":  # a closure calling a closure, and a default argument
            up = lambda x, fc=m.c_fc: m.act(fc(x))  # noqa: E731
            self.mlpf = lambda x: m.dropout(m.c_proj(up(x)))
        elif style == "partial":  # a partial of a closure, and a tuple of modules
            layers = (m.c_fc, m.act)

            def mlp(x, proj):
                return m.dropout(proj(layers[1](layers[0](x))))

            self.mlpf = functools.partial(mlp, proj=m.c_proj)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, style="lambda", n_layer=2, pdrop=0.0):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
            drop=nn.Dropout(pdrop),
            h=nn.ModuleList([Block(style, pdrop) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def gpts(seeds=(0, 1, 2), style="lambda"):
    """One GPT per seed, float64; the same seeds give the same weights again (a deepcopy
    of such a model would call the original's MLP, so references are built anew)."""
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(GPT(style).double())
    return models


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (4, BLOCK), generator=g),
            torch.randint(0, VOCAB, (4, BLOCK), generator=g))


def fuse(models, frontend, check=True):
    idx, _ = batch()
    return hftc.fuse(models, frontend=frontend, check=check,
                     example_inputs=(idx,) if frontend == "export" else None)


def force_one_by_one(monkeypatch):
    """The first-call check's fallback, whatever the check finds: the N models one by one."""
    monkeypatch.setattr(hftc.module.fused.FusedModule, "_why_not_fused",
                        lambda self, *args: "the test asks for it")


def losses(outs, targets):
    """Model i's loss, weighted by i + 1 so that models' gradients cannot be swapped unseen."""
    return [F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)) * (i + 1)
            for i, out in enumerate(outs)]


def assert_fused_equals(fused, models, tol=1e-10):
    named = [dict(m.named_parameters()) for m in models]
    for name, p in fused.named_parameters():
        for i, own in enumerate(named):
            torch.testing.assert_close(p[i], own[name], atol=tol, rtol=tol, msg=name)
            if own[name].grad is not None:
                torch.testing.assert_close(p.grad[i], own[name].grad, atol=tol, rtol=tol,
                                           msg=f"{name}.grad")


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("check", [True, False])
def test_fused_mingpt_forward_and_backward_equal_the_models(frontend, check):
    """Before: with check=True the check compared with copies of model 0 that ran the
    original's MLP, failed, and the models ran one by one on model 0's MLP weights."""
    models = gpts()
    fused = fuse(models, frontend, check)
    idx, targets = batch()
    out = fused(idx)
    want = [m(idx) for m in models]
    for i in range(3):
        torch.testing.assert_close(out[i], want[i], atol=1e-10, rtol=1e-10)
    sum(losses(out, targets)).backward()
    sum(losses(want, targets)).backward()
    assert_fused_equals(fused, models)
    assert fused.last_program().one_by_one is None
    if check:
        assert fused.fusion_report.check.passed


@pytest.mark.parametrize("style", ["nested", "partial"])
def test_functions_in_other_shapes_are_each_models_own(style, monkeypatch):
    """Nested closures, default arguments, a partial and a tuple of modules in a closure:
    the models run one by one (each copy's functions over its own modules) equal the
    models."""
    force_one_by_one(monkeypatch)
    models = gpts(style=style)
    fused = fuse(models, "symbolic")
    idx, _ = batch()
    with pytest.warns(FusionWarning, match="one by one.*the test asks for it"):
        out = fused(idx)
    assert fused.last_program().one_by_one is not None
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(idx), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("how", ["symbolic", "export", "one by one"])
def test_mingpt_trains_as_three_separate_runs(how, monkeypatch):
    """10 AdamW steps of the fused GPTs (different seeds, float64, dropout 0) equal 3
    stock runs: the fused program in both front-ends, and the models run one by one
    (before: every model computed its MLP with model 0's weights, whose gradients went to
    the user's model 0)."""
    if how == "one by one":
        force_one_by_one(monkeypatch)
    models = gpts()
    alone = gpts()  # the same weights again
    fused = fuse(models, "export" if how == "export" else "symbolic")
    lrs = [1e-2, 3e-3, 2e-2]
    opt = hftc.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.1)
    stock = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1)
             for m, lr in zip(alone, lrs)]
    with torch.no_grad():  # the user's models: neither run by hftc nor trained
        before = [p.clone() for m in models for p in m.parameters()]
    for step in range(10):
        idx, targets = batch(step)
        opt.zero_grad()
        if how == "one by one" and step == 0:
            with pytest.warns(FusionWarning, match="one by one"):
                out = fused(idx)
        else:
            out = fused(idx)
        sum(losses(out, targets)).backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, stock)):
            o.zero_grad()
            (losses([m(idx)], targets)[0] * (i + 1)).backward()
            o.step()
    assert (fused.last_program().one_by_one is not None) == (how == "one by one")
    assert_fused_equals(fused, alone, tol=1e-9)
    assert all(p.grad is None for m in models for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, [p for m in models
                                                            for p in m.parameters()]))


class MinGPT(GPT):
    """minGPT's own signature: the loss when targets are given, None otherwise."""

    def forward(self, idx, targets=None):
        logits = super().forward(idx)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def test_mingpt_without_targets_is_traced_again_from_each_models_copy():
    """``fused(idx)`` leaves ``targets`` None: forward is traced again from each model's
    meta copy (before: the copies' mlpf called the original's modules, which symbolic
    tracing did not find in the copy, and it raised a TraceError)."""
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(MinGPT().double())
    fused = hftc.fuse(models)
    idx, targets = batch()
    logits, loss = fused(idx, targets)
    for i, m in enumerate(models):
        want_logits, want_loss = m(idx, targets)
        torch.testing.assert_close(logits[i], want_logits, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(loss[i], want_loss, atol=1e-10, rtol=1e-10)
    logits, loss = fused(idx)
    assert loss is None
    for i, m in enumerate(models):
        torch.testing.assert_close(logits[i], m(idx)[0], atol=1e-10, rtol=1e-10)


def test_unfused_models_run_their_own_weights():
    models = gpts()
    fused = fuse(models, "symbolic")
    idx, _ = batch()
    fused(idx)
    unfused = fused.unfuse()
    for u, m in zip(unfused, models):
        torch.testing.assert_close(u(idx), m(idx), atol=1e-10, rtol=1e-10)
        block = u.transformer.h[0]
        assert block.mlpf.__closure__[0].cell_contents is block.mlp
    with torch.no_grad():
        before = unfused[1](idx)
        models[1].transformer.h[0].mlp.c_fc.weight.mul_(2)  # the original: not the copy's
        torch.testing.assert_close(unfused[1](idx), before, atol=0, rtol=0)
        unfused[1].transformer.h[0].mlp.c_fc.weight.mul_(2)  # the copy's own: it changes
        assert (unfused[1](idx) - before).abs().max() > 1e-3
        torch.testing.assert_close(unfused[1](idx), models[1](idx), atol=1e-10, rtol=1e-10)


def test_a_copy_of_the_fused_module_unfuses_its_own_weights():
    """``copy.deepcopy(fused)``: the twin's templates hold the twin's functions (before:
    its unfused models called the original's meta template and raised)."""
    models = gpts()
    fused = fuse(models, "symbolic")
    idx, _ = batch()
    want = torch.stack([m(idx) for m in models]).detach()
    torch.testing.assert_close(fused(idx), want, atol=1e-10, rtol=1e-10)
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        for p in fused.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(twin(idx), want, atol=1e-10, rtol=1e-10)
    for i, u in enumerate(twin.unfuse()):
        torch.testing.assert_close(u(idx), want[i], atol=1e-10, rtol=1e-10)


def test_a_model_deep_copied_from_another_is_refused():
    """copy.deepcopy(model 0) keeps model 0's mlpf: model 1 would run model 0's MLP."""
    first = gpts(seeds=(0,))[0]
    copied = copy.deepcopy(first)
    for frontend in ("symbolic", "export"):
        with pytest.raises(FusionArgumentError,
                           match=r"model 1's `transformer\.h\.0\.mlpf \(closure variable `m`\)` "
                                 r"holds a module \(ModuleDict\) that is not model 1's own: it "
                                 r"is model 0's `transformer\.h\.0\.mlp`.*its constructor"):
            fuse([first, copied], frontend)


class Scaled(nn.Module):
    """A function over a module or a value that is none of the model's registered state."""

    def __init__(self, scale=1.0, unregistered=False):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        if unregistered:
            hidden = nn.Linear(3, 3)
            self.f = lambda x: hidden(x) * scale
        else:
            self.f = lambda x: x * scale

    def forward(self, x):
        return self.f(self.fc(x))


def test_a_module_each_model_keeps_outside_its_registered_state_is_refused():
    torch.manual_seed(0)
    with pytest.raises(FusionArgumentError,
                       match=r"model 1's `f \(closure variable `hidden`\)` holds a module "
                             r"\(Linear\) that is none of model 1's submodules.*"
                             r"self\.name = module"):
        hftc.fuse([Scaled(unregistered=True), Scaled(unregistered=True)])


def test_a_value_in_a_closure_is_each_models_own():
    """Before: the copies of model 0 scaled by 1.0 for every model (check=True: the models
    ran one by one, all of them wrong; check=False: unfuse() was); then it was refused.
    Each copy is now of the model's own function (hftc.module.copies)."""
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    for check in (True, False):
        for strategy in ("fused", "model_loop"):
            models = [Scaled(1.0), Scaled(1.0), Scaled(3.0)]
            fused = hftc.fuse(models, check=check, strategy=strategy)
            out = fused(x)
            for i, m in enumerate(models):
                torch.testing.assert_close(out[i], m(x))
                torch.testing.assert_close(fused.unfuse()[i](x), m(x))


def test_a_value_and_a_constant_every_model_shares_are_fused():
    shared = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)

    class SharedConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3).double()
            self.f = lambda x: x * shared * 2.0

        def forward(self, x):
            return self.f(self.fc(x))

    torch.manual_seed(0)
    models = [SharedConstant() for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(4, 3, dtype=torch.float64)
    out = fused(x)
    assert fused.fusion_report.check.passed
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x), atol=1e-12, rtol=1e-12)


def test_a_function_that_holds_nothing_of_the_model_stays_itself():
    """nn.TransformerEncoderLayer keeps ``activation = F.relu`` (a function with a default
    argument), which tracing and the fusion rules know by identity: a copy keeps it."""
    from hftc.frontends.symbolic import deepcopy_module

    layer = nn.TransformerEncoderLayer(8, 2, 16)
    assert deepcopy_module(layer).activation is F.relu
    copied = deepcopy_module(gpts(seeds=(0,))[0])
    assert copied.transformer.h[1].mlpf.__closure__[0].cell_contents is copied.transformer.h[1].mlp
