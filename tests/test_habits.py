"""Issue 32 part 4: PyTorch habits real scripts hit, each against N separate stock runs.

- ``unfuse_optimizers`` of a fused optimizer built with param-group dicts (nanoGPT's
  decay / no-decay groups) gives stock optimizers with those groups;
- ``in_dims`` for a tuple input (an LSTM's ``(h, c)``) as a pytree prefix, and per call
  (``fused.with_in_dims(...)``: a GAN discriminator on shared real, then stacked fake images);
- methods other than ``forward`` (``fused.decode(z)``, ``fused.init_hidden(b)``).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
import hftc.optim as ho
from hftc.errors import FusionArgumentError
from tests.real_style import GPT, GPTConfig

N = 3


# ------------------------------------------------- unfuse_optimizers with param groups


def _nanogpt_groups(model: nn.Module, weight_decay: float | list,
                    shapes_of: nn.Module | None = None) -> list[dict]:
    """nanoGPT's configure_optimizers: weight decay on the >= 2-d parameters only (their
    dims read on ``shapes_of``, a plain model, for a fused module's stacked ones)."""
    decayed = {name for name, p in (shapes_of or model).named_parameters() if p.dim() >= 2}
    params = list(model.named_parameters())
    return [{"params": [p for name, p in params if name in decayed],
             "weight_decay": weight_decay},
            {"params": [p for name, p in params if name not in decayed],
             "weight_decay": 0.0}]


def _gpt_step(model: nn.Module, optimizer: torch.optim.Optimizer, idx: torch.Tensor,
              targets: torch.Tensor) -> None:
    optimizer.zero_grad()
    _, loss = model(idx, targets)
    loss.sum().backward()
    optimizer.step()


def test_unfuse_optimizers_gives_back_nanogpts_two_param_groups():
    """A fused AdamW built with nanoGPT's two param groups (per-model weight decay on the
    matrices, none on biases and norms) was refused by unfuse_optimizers ("param-group
    dicts ... are not split back"): now each stock AdamW has the two groups with model
    i's values and state, and continues model i as N stock runs from the start do."""
    torch.manual_seed(0)
    config = GPTConfig()
    models = [GPT(config).double() for _ in range(N)]
    lrs, decays = [1e-3, 3e-3, 1e-2], [0.1, 0.0, 0.5]
    alone = [copy.deepcopy(m) for m in models]
    alone_opts = [torch.optim.AdamW(_nanogpt_groups(m, wd), lr=lr, betas=(0.9, 0.95))
                  for m, lr, wd in zip(alone, lrs, decays)]
    batches = [(torch.randint(0, config.vocab_size, (2, 8)),
                torch.randint(0, config.vocab_size, (2, 8))) for _ in range(4)]
    fused = hftc.fuse(models, example_inputs=batches[0])
    opt = ho.AdamW(_nanogpt_groups(fused, decays, models[0]), lr=lrs, betas=(0.9, 0.95))
    for idx, targets in batches[:2]:
        _gpt_step(fused, opt, idx, targets)
        for m, o in zip(alone, alone_opts):
            _gpt_step(m, o, idx, targets)
    plain = fused.unfuse()
    stock = ho.unfuse_optimizers(fused, opt, plain)
    for i, (o, ref) in enumerate(zip(stock, alone_opts)):
        assert type(o) is torch.optim.AdamW
        assert [len(g["params"]) for g in o.param_groups] == \
            [len(g["params"]) for g in ref.param_groups]
        assert [(g["lr"], g["weight_decay"], g["betas"]) for g in o.param_groups] == \
            [(g["lr"], g["weight_decay"], g["betas"]) for g in ref.param_groups], i
    for idx, targets in batches[2:]:
        for models_, opts in ((plain, stock), (alone, alone_opts)):
            for m, o in zip(models_, opts):
                _gpt_step(m, o, idx, targets)
    for i, (m, ref) in enumerate(zip(plain, alone)):
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=f"model {i} {name}")


def _configure_optimizers(model: nn.Module, weight_decay, learning_rate, betas,
                          cls=torch.optim.AdamW, decayed=lambda p: p.dim() >= 2):
    """nanoGPT's configure_optimizers, verbatim but for the class and the test of a
    decayed parameter."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if decayed(p)]
    nodecay_params = [p for n, p in param_dict.items() if not decayed(p)]
    optim_groups = [{"params": decay_params, "weight_decay": weight_decay},
                    {"params": nodecay_params, "weight_decay": 0.0}]
    return cls(optim_groups, lr=learning_rate, betas=betas)


@pytest.mark.parametrize("cls", [ho.AdamW, torch.optim.AdamW])
def test_nanogpts_grouping_by_dim_on_the_fused_parameters_warns_and_the_advice_trains_exactly(
        cls):
    """nanoGPT's configure_optimizers verbatim on the fused module put every bias and
    LayerNorm weight (2-d there: the model dim) in the decay group, and the no-decay
    group was empty: each model's biases decayed unlike its own run (0.02 off after 4
    steps), silently.  It warns at the user's line, naming the fix; the fix (each model's
    dims, ``p.dim() - 1 >= 2``) trains each model as its own run, and warns not."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
              .double() for _ in range(N)]
    alone = [copy.deepcopy(m) for m in models]
    batches = [(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,)))
               for _ in range(4)]
    for m in alone:
        opt = _configure_optimizers(m, 0.5, 1e-2, (0.9, 0.95))
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    fused = hftc.fuse(models)
    with pytest.warns(hftc.UsageWarning, match=r"param group 1 \(weight_decay=0\.0\) is "
                                               r"empty .*p\.dim\(\) - 1 >= 2") as caught:
        _configure_optimizers(fused, 0.5, 1e-2, (0.9, 0.95), cls)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _configure_optimizers(fused, 0.5, 1e-2, (0.9, 0.95), cls,
                                    decayed=lambda p: p.dim() - 1 >= 2)
    for x, y in batches:
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
    for i, m in enumerate(alone):
        for name, value in m.state_dict().items():
            torch.testing.assert_close(fused.model_state_dict(i)[name], value, rtol=0,
                                       atol=1e-12)


# ------------------------------------------------------------- in_dims for a tuple input


class StatefulLSTM(nn.Module):
    """An LSTM tagger whose state comes in as a tuple: ``forward(x, hc)``."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, num_layers=2)
        self.head = nn.Linear(5, 3)

    def forward(self, x, hc):
        out, (h, c) = self.lstm(x, hc)
        return self.head(out), (h, c)


def _weighted(out, seed: int) -> torch.Tensor:
    """A loss that reaches every output leaf with its own weights (so that each
    gradient is checked, not only that of a sum)."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in leaves)


def _assert_same_grads(fused: nn.Module, models, rtol: float = 1e-9,
                       atol: float = 1e-12) -> None:
    for name, p in fused.named_parameters():
        for i, m in enumerate(models):
            torch.testing.assert_close(p.grad[i], m.get_parameter(name).grad, rtol=rtol,
                                       atol=atol, msg=f"model {i}, grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("in_dims,c_stacked", [
    ((None, 0), True), ((None, (0, 0)), True), ((None, (0, None)), False),
    ((None, (1, 1)), True)], ids=["tuple-0", "per-leaf", "c-shared", "dim-1"])
def test_in_dims_applies_to_a_tuple_input(in_dims, c_stacked, dtype):
    """fuse(models, in_dims=(None, 0)) with forward(x, hc) raised "in_dims stacks tensor
    inputs only": in_dims is now a pytree prefix as torch.func.vmap's (0 for the tuple
    stacks h and c; a tuple gives each its own entry), checked against N stock calls,
    forward and backward (the gradients of h and c included)."""
    torch.manual_seed(0)
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else \
        {"rtol": 1e-5, "atol": 1e-6}
    models = [StatefulLSTM().to(dtype) for _ in range(N)]
    x = torch.randn(6, 2, 4, dtype=dtype)
    dim = 1 if in_dims[1] == (1, 1) else 0
    h = torch.randn(2, N, 2, 5, dtype=dtype).movedim(1, dim).requires_grad_()
    c_shape = (N, 2, 2, 5) if c_stacked else (2, 2, 5)
    c = torch.randn(c_shape, dtype=dtype)
    c = (c.movedim(0, dim) if c_stacked else c).requires_grad_()
    refs = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, in_dims=in_dims)
    out = fused(x, (h, c))
    expected = [r(x, (h.select(dim, i), c.select(dim, i) if c_stacked else c))
                for i, r in enumerate(refs)]
    for i, e in enumerate(expected):
        got = torch.utils._pytree.tree_map(lambda t, i=i: t[i], out)
        torch.testing.assert_close(got, e, **tol, msg=f"model {i}")
    _weighted(out, 1).backward()
    ref_h, ref_c = h.detach().clone().requires_grad_(), c.detach().clone().requires_grad_()
    ref_out = [r(x, (ref_h.select(dim, i), ref_c.select(dim, i) if c_stacked else ref_c))
               for i, r in enumerate(refs)]
    stacked = torch.utils._pytree.tree_map(lambda *ts: torch.stack(ts), *ref_out)
    _weighted(stacked, 1).backward()
    for g, r in zip((h.grad, c.grad), (ref_h.grad, ref_c.grad)):
        torch.testing.assert_close(g, r, **tol)
    _assert_same_grads(fused, refs, **tol)


def test_in_dims_for_a_tuple_input_refuses_a_structure_that_does_not_match():
    models = [StatefulLSTM().double() for _ in range(2)]
    fused = hftc.fuse(models, in_dims=(None, (0, 0, 0)))
    x, h = torch.randn(6, 2, 4, dtype=torch.float64), torch.zeros(2, 2, 2, 5, dtype=torch.float64)
    with pytest.raises(FusionArgumentError,
                       match=r"input `hc` \(input 1\) is a tuple whose structure "
                             r"in_dims=\(0, 0, 0\) does not match \(it holds \('\*', '\*'\)"):
        fused(x, (h, h))
    with pytest.raises(FusionArgumentError, match=r"in_dims must be None.*got \(None, 'a'\)"):
        hftc.fuse(models, in_dims=(None, "a"))


# ------------------------------------------------------------------ in_dims per call


class Discriminator(nn.Module):
    """pytorch/examples' DCGAN discriminator, small."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, 4, 4, 2, 1, bias=False), nn.LeakyReLU(0.2),
            nn.Conv2d(4, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.2),
            nn.Conv2d(8, 1, 2, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def test_in_dims_per_call_for_a_gan_discriminator_on_real_then_fake_images():
    """A fused discriminator sees the real images shared by all models and then each
    generator's own fakes: fused(real), then fused.with_in_dims(0)(fake), against N
    stock discriminators (forward, backward), the fused module's in_dims unchanged."""
    torch.manual_seed(0)
    models = [Discriminator().double() for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models)
    real = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    fake = torch.randn(N, 5, 1, 8, 8, dtype=torch.float64)
    label = torch.rand(5, dtype=torch.float64)
    loss = (F.binary_cross_entropy(fused(real), label.expand(N, 5), reduction="none").mean(1)
            + F.binary_cross_entropy(fused.with_in_dims(0)(fake), 1 - label.expand(N, 5),
                                     reduction="none").mean(1))
    assert fused.in_dims is None
    for i, r in enumerate(refs):
        ref = (F.binary_cross_entropy(r(real), label)
               + F.binary_cross_entropy(r(fake[i]), 1 - label))
        torch.testing.assert_close(loss[i], ref, rtol=1e-9, atol=1e-12)
        ref.backward()
    loss.sum().backward()
    _assert_same_grads(fused, refs)
    with pytest.raises(FusionArgumentError, match=r"input `input` \(input 0\) is "
                       r"stacked per model along dim 0 \(in_dims\) but has size 5"):
        fused.with_in_dims(0)(real)


def test_two_new_programs_in_one_graph_keep_batch_norms_saved_statistics():
    """The first call of a new program checks it against the models and puts the buffers
    back with copy_, which bumped the running statistics' version: an earlier call's
    batch norm (which saves them for backward) then failed in backward ("modified by an
    inplace operation"), as with D(real) + D(fake) of a GAN, two input signatures in one
    loss. Against N stock models (forward, backward, running statistics), float64."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.BatchNorm1d(4)).double() for _ in range(N)]
    for m in models:
        nn.init.normal_(m[0].weight)
    refs = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, strategy="fused")
    x2, x3 = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, 7, dtype=torch.float64)
    a, b = fused(x2), fused(x3)  # two ranks: two programs
    (a.pow(2).sum() + b.pow(3).sum()).backward()
    for i, r in enumerate(refs):
        ra, rb = r(x2), r(x3)
        (ra.pow(2).sum() + rb.pow(3).sum()).backward()
        torch.testing.assert_close((a[i], b[i]), (ra, rb), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fused.get_buffer("0.running_var")[i], r[0].running_var)
    _assert_same_grads(fused, refs)


# --------------------------------------------------------------- methods other than forward


class VAE(nn.Module):
    """pytorch/examples' VAE, small: ``decode(z)`` is what sampling calls."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(12, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.fc3, self.fc4 = nn.Linear(3, 8), nn.Linear(8, 12)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 12))
        return self.decode(mu), mu, logvar


def test_a_models_method_runs_fused_on_the_fused_modules_weights():
    """fused.decode(z) raised AttributeError ('FusedModule' object has no attribute
    'decode'): a model's method is now traced as its forward, fused, and run on the fused
    module's own parameters (gradients reach them; after a step it sees the new weights),
    its inputs shared or, per call, stacked; against N stock models, float64."""
    torch.manual_seed(0)
    models = [VAE().double() for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models)
    z, zs = torch.randn(4, 3, dtype=torch.float64), torch.randn(N, 4, 3, dtype=torch.float64)
    for step in range(2):
        out = fused.decode(z)
        own = fused.with_in_dims(0).decode(zs)
        mu, logvar = fused.encode(torch.randn(4, 12, dtype=torch.float64).expand(N, 4, 12)[0])
        loss = _weighted((out, own), step)
        ref_out = [r.decode(z) for r in refs]
        ref_own = [r.decode(zs[i]) for i, r in enumerate(refs)]
        torch.testing.assert_close(out, torch.stack(ref_out), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(own, torch.stack(ref_own), rtol=1e-9, atol=1e-12)
        assert mu.shape == logvar.shape == (N, 4, 3)
        loss.backward()
        _weighted((torch.stack(ref_out), torch.stack(ref_own)), step).backward()
        grads = {n: p.grad.clone() for n, p in fused.named_parameters()
                 if not n.startswith(("fc1", "fc2"))}
        for name, g in grads.items():
            for i, r in enumerate(refs):
                torch.testing.assert_close(g[i], r.get_parameter(name).grad, rtol=1e-9,
                                           atol=1e-12, msg=f"model {i}, {name}")
        with torch.no_grad():  # a step: the method sees the fused module's new weights
            for p in fused.parameters():
                p -= 0.1 * p.grad if p.grad is not None else 0
            for r in refs:
                for p in r.parameters():
                    p -= 0.1 * p.grad if p.grad is not None else 0
        fused.zero_grad()
        for r in refs:
            r.zero_grad()
    assert "decode" in fused.__dict__["_method_modules"]
    assert fused.__dict__["_method_modules"]["decode"] is not None  # fused, not a loop


def test_init_hidden_and_a_carried_state_against_stock_rnns():
    """word_language_model's loop: hidden = model.init_hidden(bsz), then the state each
    call returns fed back (repackaged). fused.init_hidden(b) gives the N states stacked,
    the fused module (in_dims=(None, 0)) takes them back; 3 steps of SGD against N stock
    models, float64."""
    from tests.real_style import RNNModel

    torch.manual_seed(0)
    models = [RNNModel().double() for _ in range(N)]
    refs = [copy.deepcopy(m) for m in models]
    fused = hftc.fuse(models, in_dims=(None, 0))
    opt = ho.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    ref_opts = [torch.optim.SGD(r.parameters(), lr=lr) for r, lr in zip(refs, [0.1, 0.2, 0.3])]
    hidden = fused.init_hidden(2)
    ref_hidden = [r.init_hidden(2) for r in refs]
    assert [t.shape for t in hidden] == [(N, 2, 2, 8)] * 2
    for _ in range(3):
        data = torch.randint(0, 19, (5, 2))
        targets = torch.randint(0, 19, (10,))
        opt.zero_grad()
        out, hidden = fused(data, tuple(t.detach() for t in hidden))
        hftc.per_model(F.nll_loss)(out, targets).sum().backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            o.zero_grad()
            ref_out, ref_hidden[i] = r(data, tuple(t.detach() for t in ref_hidden[i]))
            F.nll_loss(ref_out, targets).backward()
            o.step()
            torch.testing.assert_close(out[i], ref_out, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(tuple(t[i] for t in hidden), ref_hidden[i],
                                       rtol=1e-9, atol=1e-12)
    for i, r in enumerate(refs):
        for name, p in r.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name)[i], p, rtol=1e-9, atol=1e-12)


class GenerativeGPT(GPT):
    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's generate, as it is."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size \
                else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def test_nanogpt_generate_runs_per_model_where_it_does_not_trace():
    """nanoGPT's generate (a loop on sizes, sampling) does not trace: the N models run it
    one by one on the fused module's weights, results stacked; greedy (top_k=1) it is
    each stock model's own generate, past the block size."""
    torch.manual_seed(0)
    config = GPTConfig()
    models = [GenerativeGPT(config).double().eval() for _ in range(N)]
    idx = torch.randint(0, config.vocab_size, (2, 6))
    fused = hftc.fuse(models, example_inputs=(idx,))
    with torch.no_grad():
        for p in fused.parameters():  # the fused module's weights, not the models'
            p.mul_(1.5)
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
    out = fused.generate(idx, 5, top_k=1)
    assert fused.__dict__["_method_modules"]["generate"] is None  # not traced: a loop
    assert out.shape == (N, 2, 11)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.generate(idx, 5, top_k=1))
    stacked = torch.stack([idx, idx.flip(0), idx + 1 - (idx + 1) // config.vocab_size])
    out = fused.with_in_dims(0).generate(stacked, 2, top_k=1)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m.generate(stacked[i], 2, top_k=1))
    with pytest.raises(AttributeError, match="no attribute 'decode'"):
        fused.decode(idx)


# ------------------------------------------- the export front-end: a new sequence length


def test_a_length_export_fixed_is_exported_again_for_a_new_length():
    """Exported from a one-token example (export fixes sizes 0 and 1), the fused GPT
    refused a 6-token call ("the models were exported ... with shape [*, 1]"); it now
    exports again from the call's inputs (once per such shape), logits, loss and
    gradients as each stock model's, float64."""
    torch.manual_seed(0)
    config = GPTConfig()
    models = [GPT(config).double() for _ in range(N)]
    fused = hftc.fuse(models, example_inputs=(torch.randint(0, config.vocab_size, (2, 1)),))
    idx = torch.randint(0, config.vocab_size, (2, 6))
    targets = torch.randint(0, config.vocab_size, (2, 6))
    for _ in range(2):
        fused.zero_grad()
        logits, _ = fused(idx)
        _, loss = fused(idx, targets)
        (logits.pow(2).sum() + loss.sum()).backward()
        for i, m in enumerate(models):
            m.zero_grad()
            ref_logits, _ = m(idx)
            _, ref_loss = m(idx, targets)
            torch.testing.assert_close(logits[i], ref_logits, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(loss[i], ref_loss, rtol=1e-9, atol=1e-12)
            (ref_logits.pow(2).sum() + ref_loss).backward()
            for name, p in m.named_parameters():
                torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad,
                                           rtol=1e-9, atol=1e-12, msg=f"model {i} {name}")
    assert len(fused.__dict__["_reexported_graphs"]) == 2  # (idx) and (idx, targets)


# ------------------------------------------------- a user's loop, end to end


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.ln(self.fc1(x))))


def _groups(model: nn.Module, weight_decay, plain: nn.Module) -> list[dict]:
    matrices = {n for n, p in plain.named_parameters() if p.dim() >= 2}
    return [{"params": [p for n, p in model.named_parameters() if n in matrices],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in matrices],
             "weight_decay": 0.0}]


def test_accumulation_loss_weights_onecycle_clipping_and_an_ema_train_each_model_as_alone():
    """AdamW with per-model betas and decay on the matrices only, gradient accumulation
    over 2 batches, per-model loss weights, label smoothing, OneCycleLR, clipping,
    zero_grad(set_to_none=True) and a hand-written EMA of the weights: each model and its
    EMA as its own run, float64."""
    torch.manual_seed(0)
    models = [_MLP().double() for _ in range(N)]
    alone = [copy.deepcopy(m) for m in models]
    lrs, decays = [1e-3, 3e-3, 1e-2], [0.0, 0.1, 0.01]
    betas, weights = [(0.9, 0.999), (0.8, 0.99), (0.95, 0.95)], [1.0, 0.5, 2.0]
    batches = [(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,)))
               for _ in range(8)]

    def train(model, opt, sched, ema, loss_of):
        for k, (x, y) in enumerate(batches):
            (loss_of(model(x), y) / 2).backward()
            if k % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.mul_(0.9).add_(p, alpha=0.1)

    emas = []
    for m, lr, wd, b, w in zip(alone, lrs, decays, betas, weights):
        opt = torch.optim.AdamW(_groups(m, wd, m), lr=lr, betas=b)
        emas.append(copy.deepcopy(m))
        train(m, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr * 10, total_steps=4),
              emas[-1], lambda out, y, w=w: w * F.cross_entropy(out, y, label_smoothing=0.1))
    fused = hftc.fuse(models)
    opt = ho.AdamW(_groups(fused, decays, models[0]), lr=lrs, betas=betas)
    ema = copy.deepcopy(fused)
    w = torch.tensor(weights, dtype=torch.float64)
    train(fused, opt, torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[lr * 10 for lr in lrs], total_steps=4), ema,
        lambda out, y: (w * hftc.per_model(F.cross_entropy, label_smoothing=0.1)(out, y)).sum())
    for i in range(N):
        for fused_side, own in ((fused, alone[i]), (ema, emas[i])):
            for name, value in own.state_dict().items():
                torch.testing.assert_close(fused_side.model_state_dict(i)[name], value,
                                           rtol=0, atol=1e-12)


def test_a_checkpoint_mid_training_resumes_model_optimizer_plateau_and_swa_ema_exactly():
    """torch.save of the fused module's, the fused Adam's, hftc's ReduceLROnPlateau's (per
    model metrics) and an AveragedModel EMA's state dicts and the RNG state mid-training,
    loaded into a new array: the rest of the run (dropout included) as the uninterrupted
    run, bit for bit."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.drop, self.fc2 = nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(self.drop(F.relu(self.fc1(x))))

    torch.manual_seed(0)
    models = [Net().double() for _ in range(N)]
    batches = [(torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,)))
               for _ in range(6)]

    def make():
        fused = hftc.fuse(copy.deepcopy(models))
        opt = ho.Adam(fused.parameters(), lr=[1e-3, 3e-3, 1e-2])
        return (fused, opt, ho.ReduceLROnPlateau(opt, patience=0, factor=0.5),
                AveragedModel(fused, multi_avg_fn=get_ema_multi_avg_fn(0.9)))

    def run(fused, opt, plateau, ema, part):
        for x, y in part:
            fused.train()
            opt.zero_grad()
            hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
            opt.step()
            ema.update_parameters(fused)
            fused.eval()
            with torch.no_grad():
                plateau.step(hftc.per_model(F.cross_entropy)(fused(x), y))

    torch.manual_seed(1)
    whole = make()
    run(*whole, batches)
    torch.manual_seed(1)
    first = make()
    run(*first, batches[:3])
    buffer = io.BytesIO()
    torch.save({"parts": [part.state_dict() for part in first],
                "rng": torch.get_rng_state()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = make()
    for part, state in zip(resumed, saved["parts"]):
        part.load_state_dict(state)
    torch.set_rng_state(saved["rng"])
    run(*resumed, batches[3:])
    for a, b in ((whole[0], resumed[0]), (whole[3], resumed[3])):
        for name, value in a.state_dict().items():
            assert torch.equal(value, b.state_dict()[name]), name
    assert [g["lr"] for g in whole[1].param_groups] == \
        [g["lr"] for g in resumed[1].param_groups]


def test_a_fused_output_shared_by_another_fused_module_warns_at_the_users_line():
    """A GAN with a Linear discriminator fused with shared inputs (the default), called on
    the fused generator's fakes ``[N, B, 12]``: each discriminator ran on all N
    generators' fakes (``[N, N*B]``), silently, where a conv discriminator is refused.
    Now a UsageWarning at the user's line names in_dims; per-call ``with_in_dims(0)``,
    ``in_dims=0`` and the real images shared are quiet, and give each model its own."""
    class G(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 12)

        def forward(self, z):
            return torch.tanh(self.fc(z))

    class D(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(12, 1)

        def forward(self, x):
            return self.fc(x).view(-1)

    torch.manual_seed(0)
    gs, ds = [G() for _ in range(N)], [D() for _ in range(N)]
    fused_g, fused_d = hftc.fuse(gs), hftc.fuse(ds)
    z, real = torch.randn(5, 6), torch.randn(5, 12)
    fakes = fused_g(z)
    with pytest.warns(hftc.UsageWarning, match=r"(?s)input `x` \(input 0\) at .*test_habits"
                      r"\.py:\d+: `.*fused_d\(fakes\).*` is a fused module's output \[3, 5, 12\].*"
                      r"in_dims=0"):
        assert fused_d(fakes).shape == (N, N * 5)  # what it computed: every model all fakes
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.UsageWarning)
        out_real = fused_d(real)
        out_fake = fused_d.with_in_dims(0)(fakes)
        again = hftc.fuse(ds, in_dims=0)(fakes)
    for i, d in enumerate(ds):
        torch.testing.assert_close(out_real[i], d(real))
        torch.testing.assert_close(out_fake[i], d(gs[i](z)))
        torch.testing.assert_close(again[i], d(gs[i](z)))
