"""Real training scripts converted as docs/guides/convert.md says, each against the N
original runs with the same seeds (hunt 4, scripts):

- pytorch/examples' VAE: ``loss_function(recon_batch, data, mu, logvar)`` given to
  ``hftc.per_model`` as the guide's ``hftc.per_model(loss)(out, y)``: ``mu`` and
  ``logvar``, past the default ``in_dims=(0, None)``, were shared, so each model's KLD
  summed all N models' (silently); refused now, naming ``in_dims=(0, None, 0, 0)``.
- SimCLR's ``info_nce_loss`` with a temperature per model (``in_dims=(0, 0)``, ``[N]``)
  crashed in per_model's flattening fast path (IndexError) meant for stock losses only.
- nanoGPT's ``for param_group in optimizer.param_groups: param_group['lr'] = lr`` with
  ``lr`` the N models' values was "lr[0] must be a number": it now says that group i is
  model i's and gives the loop.
- the SWA tutorial's ``update_bn(loader, swa_model)`` on a fused module was refused with
  advice (``update_bn`` on ``unfuse()``'s copies) that left ``swa_model`` predicting with
  stale statistics; it now recomputes each model's, as its own run's ``update_bn``.
- word_language_model's ``nn.LSTM(..., dropout=p)`` with p per model was refused.
- a distiller whose ``train(mode)`` keeps the teacher in eval: ``fused.train()`` put the
  teacher's batch norm in training mode, silently.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn
from torch.utils.data import DataLoader, TensorDataset

import hftc
from hftc.errors import FusionArgumentError, FusionTypeError

N = 3
DTYPE = torch.float64


def _close_state(fused, i, state, atol=1e-12):
    for name, value in state.items():
        torch.testing.assert_close(fused.model_state_dict(i)[name], value, rtol=0,
                                   atol=atol, msg=f"model {i} {name}")


# ------------------------------------------------------------------------------ the VAE


class VAE(nn.Module):
    """pytorch/examples' vae/main.py, small (16 inputs, a latent of 3)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(16, 12), nn.Linear(12, 3), nn.Linear(12, 3)
        self.fc3, self.fc4 = nn.Linear(3, 12), nn.Linear(12, 16)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std) * 0  # (the draws of N models are not N runs' draws)
        return mu + eps * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 16))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def vae_loss(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 16), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def test_vae_loss_with_mu_and_logvar_shared_by_default_is_refused_naming_in_dims():
    torch.manual_seed(0)
    fused = hftc.fuse([VAE().to(DTYPE) for _ in range(N)])
    x = torch.rand(8, 1, 4, 4, dtype=DTYPE)
    recon, mu, logvar = fused(x)
    with pytest.raises(FusionArgumentError, match=r"mu.*logvar.*fused outputs.*in_dims=\(0, "
                                                  r"None, 0, 0\)") as caught:
        hftc.per_model(vae_loss)(recon, x, mu, logvar)
    assert __file__ in str(caught.value)
    with pytest.raises(FusionArgumentError, match=r"logvar.*fused output"):
        hftc.per_model(vae_loss, in_dims=(0, None, 0))(recon, x, mu, logvar=logvar)
    hftc.per_model(vae_loss)(recon, x, mu.clone(), logvar.clone())  # shared on purpose


def test_vae_refused_with_the_default_in_dims_trains_as_three_runs_with_the_one_named():
    data = torch.rand(32, 1, 4, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    lrs = [1e-3, 3e-3, 1e-2]
    models = []
    for seed in range(N):
        torch.manual_seed(seed)
        models.append(VAE().to(DTYPE))
    alone = copy.deepcopy(models)
    fused = hftc.fuse(models)
    opt = hftc.optim.Adam(fused.parameters(), lr=lrs)
    loss_fn = hftc.per_model(vae_loss, in_dims=(0, None, 0, 0))
    fused_losses = []
    for b in range(0, 32, 8):
        opt.zero_grad()
        recon, mu, logvar = fused(data[b:b + 8])
        with pytest.raises(FusionArgumentError):  # the guide's (0, None): mu, logvar shared
            hftc.per_model(vae_loss)(recon, data[b:b + 8], mu, logvar)
        losses = loss_fn(recon, data[b:b + 8], mu, logvar)
        losses.sum().backward()
        opt.step()
        fused_losses.append(losses.detach())
    for i, model in enumerate(alone):
        stock = torch.optim.Adam(model.parameters(), lr=lrs[i])
        for k, b in enumerate(range(0, 32, 8)):
            stock.zero_grad()
            recon, mu, logvar = model(data[b:b + 8])
            loss = vae_loss(recon, data[b:b + 8], mu, logvar)
            loss.backward()
            stock.step()
            torch.testing.assert_close(fused_losses[k][i], loss.detach(), rtol=0, atol=1e-10)
        _close_state(fused, i, model.state_dict())


# ------------------------------------------------------------------- SimCLR's NT-Xent


def info_nce_loss(features, temperature, batch_size=4, n_views=2):
    """sthalles/SimCLR's ``info_nce_loss`` (then ``CrossEntropyLoss``), temperature given."""
    labels = torch.cat([torch.arange(batch_size) for _ in range(n_views)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    features = F.normalize(features, dim=1)
    similarity_matrix = torch.matmul(features, features.T)
    mask = torch.eye(labels.shape[0], dtype=torch.bool)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
    positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1)
    labels = torch.zeros(logits.shape[0], dtype=torch.long)
    return F.cross_entropy(logits / temperature, labels)


def test_simclr_loss_with_a_temperature_per_model_matches_each_models_own():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6)).to(DTYPE)
              for _ in range(N)]
    fused = hftc.fuse(models)
    images = torch.randn(8, 5, dtype=DTYPE)
    temperatures = torch.tensor([0.07, 0.2, 0.5], dtype=DTYPE)
    losses = hftc.per_model(info_nce_loss, in_dims=(0, 0))(fused(images), temperatures)
    shared = hftc.per_model(info_nce_loss)(fused(images), torch.tensor(0.5))  # a 0-d shared
    for i, model in enumerate(models):
        torch.testing.assert_close(losses[i], info_nce_loss(model(images), temperatures[i]))
        torch.testing.assert_close(shared[i], info_nce_loss(model(images), 0.5))


# ------------------------------------------------- nanoGPT's learning rate per param group


def test_a_list_of_n_learning_rates_set_into_every_param_group_names_the_loop():
    fused = hftc.fuse([nn.Linear(3, 2) for _ in range(N)])
    opt = hftc.optim.AdamW(fused.parameters(), lr=[1e-3, 2e-3, 3e-3])
    for lr in ([1e-3, 2e-3, 4e-3], torch.tensor([1e-3, 2e-3, 4e-3])):
        for param_group in opt.param_groups:
            param_group['lr'] = lr
        fused(torch.randn(4, 3)).sum().backward()
        with pytest.raises(FusionTypeError, match=r"param_groups\[i\] is model i's.*enumerate"
                                                  r"\(optimizer.param_groups\)"):
            opt.step()
    for i, param_group in enumerate(opt.param_groups):  # the loop it names
        param_group['lr'] = [1e-3, 2e-3, 4e-3][i]
    opt.step()
    assert [g['lr'] for g in opt.param_groups] == [1e-3, 2e-3, 4e-3]


# --------------------------------------------------------------- SWA with batch norms


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def _swa_run(models, fused):
    """The SWA tutorial's loop (AveragedModel, CosineAnnealingLR then SWALR, update_bn)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 6, dtype=DTYPE, generator=g),
                         torch.randint(0, 3, (48,), generator=g))
    lrs, swa_lrs = [0.05, 0.1, 0.2], [0.01, 0.02, 0.05]
    model = hftc.fuse(models) if fused else models[0]
    k = slice(None) if fused else slice(models[0].index, models[0].index + 1)
    sgd = hftc.optim.SGD if fused else torch.optim.SGD
    lr = lrs[k] if fused else lrs[k][0]
    optimizer = sgd(model.parameters(), lr=lr, momentum=0.9)
    swa_model = AveragedModel(model)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    swa_scheduler = SWALR(optimizer, swa_lr=swa_lrs[k] if fused else swa_lrs[k][0],
                          anneal_epochs=2)
    loss_fn = hftc.per_model(F.cross_entropy) if fused else F.cross_entropy
    loader = DataLoader(data, batch_size=12, shuffle=True,  # reshuffled by update_bn too
                        generator=torch.Generator().manual_seed(1))
    for epoch in range(4):
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).sum().backward()
            optimizer.step()
        if epoch > 1:
            swa_model.update_parameters(model)
            swa_scheduler.step()
        else:
            scheduler.step()
    update_bn(loader, swa_model)
    swa_model.eval()
    return swa_model


def test_swa_tutorial_update_bn_on_the_averaged_fused_module_matches_three_runs():
    models = []
    for seed in range(N):
        torch.manual_seed(seed)
        models.append(_BNNet().to(DTYPE))
        models[-1].index = seed
    alone = [_swa_run([copy.deepcopy(m)], fused=False) for m in models]
    swa = _swa_run(models, fused=True)
    x = torch.randn(5, 6, dtype=DTYPE)
    out = swa(x)
    for i, ref in enumerate(alone):
        torch.testing.assert_close(out[i], ref(x), rtol=0, atol=1e-12)
        _close_state(swa.module, i, ref.module.state_dict())


def test_update_bn_on_a_module_holding_a_fused_module_is_refused():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = hftc.fuse([_BNNet() for _ in range(N)])

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(FusionArgumentError, match=r"Wrapper holds a fused module.*"
                                                  r"update_bn\(loader, fused\)"):
        update_bn([torch.randn(4, 6)], Wrapper())


# ------------------------------------- word_language_model's LSTM dropout per model


class _WordLSTM(nn.Module):
    """pytorch/examples' word_language_model RNNModel, small: ``nn.LSTM(..., dropout=p)``
    (between layers), a sweep's per-model rate."""

    def __init__(self, dropout, hidden=6, mode="LSTM"):
        super().__init__()
        self.encoder = nn.Embedding(12, 5)
        self.rnn = getattr(nn, mode)(5, hidden, 2, dropout=dropout)
        self.decoder = nn.Linear(hidden, 12)

    def forward(self, input, hidden=None):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden


@pytest.mark.parametrize("mode, hidden, batch", [("LSTM", 6, 3), ("GRU", 6, 3),
                                                 ("LSTM", 64, 200)])  # (ATen's LSTMs)
def test_word_language_model_with_a_per_model_lstm_dropout_fuses(mode, hidden, batch):
    """``nn.LSTM(..., dropout=p)`` with p per model was refused ("dropout 0.5 vs 0.1"),
    though the guide says models differing in a dropout rate fuse: each model now drops
    at its own rate between layers (rate 0 and rate 1 are exact: no draw, all zeros)."""
    rates = [0.0, 1.0, 0.0]
    torch.manual_seed(0)
    models = [_WordLSTM(p, hidden, mode).to(DTYPE) for p in rates]
    fused = hftc.fuse(models)
    tokens = torch.randint(0, 12, (4, batch))
    out, _ = fused(tokens)
    for i, model in enumerate(models):
        torch.testing.assert_close(out[i], model(tokens)[0], rtol=0, atol=1e-12)
    fused.eval()
    models[1].eval()
    torch.testing.assert_close(fused(tokens)[0][1], models[1](tokens)[0], rtol=0, atol=1e-12)


def test_update_bn_on_a_fused_module_of_padded_widths_is_refused_saying_what_works():
    models = [nn.Sequential(nn.Linear(4, w), nn.BatchNorm1d(w), nn.Linear(w, 2))
              for w in (6, 8, 5)]
    fused = hftc.fuse(models, pad_widths=True)
    loader = [torch.randn(16, 4) for _ in range(2)]
    with pytest.raises(FusionArgumentError, match=r"pad_widths=True.*fused.unfuse\(\)"):
        update_bn(loader, AveragedModel(fused))


# ------------------------------------------- a distiller whose train() keeps the teacher in eval


class _Distiller(nn.Module):
    """A knowledge-distillation wrapper (a teacher shared by all students, frozen, its batch
    norm kept in eval mode by the wrapper's own ``train``), the KD loss in forward."""

    def __init__(self, teacher, temperature):
        super().__init__()
        self.teacher = teacher
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))
        self.T = temperature

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x, y):
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        soft = F.kl_div(F.log_softmax(s / self.T, -1), F.softmax(t / self.T, -1),
                        reduction="batchmean") * self.T ** 2
        return soft + F.cross_entropy(s, y)


def test_a_models_own_train_keeping_its_teacher_in_eval_is_followed():
    """``fused.train()`` set every module's flag to train, ignoring the models' own
    ``train`` that keeps the teacher in eval: the teacher's batch norm normalised by batch
    statistics and updated its running ones, and each student learned from other targets
    than its own run's (0.03 off after 3 steps), silently."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
    teacher.requires_grad_(False).eval()
    models = [_Distiller(teacher, t).to(DTYPE) for t in (1.0, 2.0, 4.0)]
    alone = copy.deepcopy(models)
    x, y = torch.randn(10, 4, dtype=DTYPE), torch.randint(0, 5, (10,))
    fused = hftc.fuse(models)
    opt = hftc.optim.Adam([p for p in fused.parameters() if p.requires_grad], lr=1e-2)
    fused.train()
    assert not fused.teacher[1].training and fused.student[0].training
    for _ in range(3):
        opt.zero_grad()
        fused(x, y).sum().backward()
        opt.step()
    for i, model in enumerate(alone):
        stock = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.train()
        for _ in range(3):
            stock.zero_grad()
            model(x, y).backward()
            stock.step()
        _close_state(fused, i, model.state_dict())
    fused.eval()
    assert not any(m.training for m in fused.modules())
