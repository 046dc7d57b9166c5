"""pytorch/examples' DCGAN (dcgan/main.py) as a fused Optuna sweep, on digits.

    python examples/trial_array_dcgan.py      # 8 trials, 4 per fused array, then a check

A generator and a discriminator per trial (DCGAN's, sized for 8x8 digits: transposed
convs, batch norm, ReLU / LeakyReLU, Tanh / Sigmoid), two Adam optimizers with
``betas=(0.5, 0.999)`` and per-trial learning rates, and dcgan/main.py's step: the
discriminator on real images, then on the generator's fakes (detached), then the
generator through the discriminator.  ``run_alone`` is that script for one trial; the
fused version differs in four places:

    netG, netD = build(...)            ->  netG = array.fuse(gens); netD = array.fuse(discs)
    optim.Adam(netD.parameters(), lr)  ->  hftc.optim.Adam(netD.parameters(), lr=lrs_d, ...)
    netD(fake)                         ->  netD.with_in_dims(0)(fake)   # [N, B, ...]: model i's
    F.binary_cross_entropy(out, label) ->  hftc.per_model(F.binary_cross_entropy)(out, label)

Real images are shared by the N discriminators; the fakes are stacked, one batch per
generator, so the discriminator takes them with ``in_dims=0`` for that call.  Each epoch
reports the discriminator's loss on held-out digits and on fakes from fixed noise; a
pruned trial leaves both fused modules and both optimizers in place.  At the end each
trial's values are compared with the same trial trained alone (float64, 1e-9 relative).
"""

from __future__ import annotations

import argparse

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hftc
import hftc.sweep
from hftc.sweep import digits

DTYPE = torch.float64
NZ, NGF, NDF = 8, 16, 8  # latent size, generator and discriminator widths
REAL, FAKE = 1.0, 0.0


class Generator(nn.Module):
    """z [B, NZ, 1, 1] -> 4x4 -> an 8x8 image in [-1, 1]."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, 1, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    """An 8x8 image -> 4x4 -> the probability that it is real, [B, 1, 1, 1]."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(1, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 3, 1, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x)


class Setup:
    """The script's settings and data: digits scaled to [-1, 1], as dcgan/main.py's."""

    def __init__(self, epochs=4, batch_size=32, n_train=None, n_val=128, log=print):
        (x, _), (vx, _) = digits.data(n_train, n_val)
        self.train = TensorDataset(x.to(DTYPE) * 2 - 1)
        self.val = vx.to(DTYPE) * 2 - 1
        self.fixed_noise = torch.randn(len(self.val), NZ, 1, 1, dtype=DTYPE,
                                       generator=torch.Generator().manual_seed(3))
        self.epochs, self.batch_size, self.log = epochs, batch_size, log

    def build(self, seed: int) -> tuple[Generator, Discriminator]:
        torch.manual_seed(seed)  # each trial's own initial weights (its number)
        return Generator().to(DTYPE), Discriminator().to(DTYPE)

    def loaders(self):
        """The DataLoader and the noise's generator, seeded: every trial sees the same
        batches and noise, fused or alone."""
        loader = DataLoader(self.train, batch_size=self.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(1))
        return loader, torch.Generator().manual_seed(2)


def suggest(trial: optuna.Trial) -> tuple[float, float]:
    return (trial.suggest_float("lr_d", 1e-4, 1e-2, log=True),
            trial.suggest_float("lr_g", 1e-4, 1e-2, log=True))


def flat(output: torch.Tensor) -> torch.Tensor:
    """[B, 1, 1, 1] -> [B]; fused [N, B, 1, 1, 1] -> [N, B]."""
    return output.flatten(output.dim() - 4)


def run_alone(setup: Setup, seed: int, lr_d: float, lr_g: float, report) -> float:
    """dcgan/main.py's loop for one trial; ``report(value, epoch)`` after each epoch."""
    netG, netD = setup.build(seed)
    optD = torch.optim.Adam(netD.parameters(), lr=lr_d, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=lr_g, betas=(0.5, 0.999))
    bce = F.binary_cross_entropy
    loader, noise_generator = setup.loaders()
    for epoch in range(setup.epochs):
        netG.train()
        netD.train()
        for (real,) in loader:
            b = real.shape[0]
            netD.zero_grad()
            label = torch.full((b,), REAL, dtype=DTYPE)
            errD_real = bce(flat(netD(real)), label)
            errD_real.backward()
            noise = torch.randn(b, NZ, 1, 1, dtype=DTYPE, generator=noise_generator)
            fake = netG(noise)
            label.fill_(FAKE)
            errD_fake = bce(flat(netD(fake.detach())), label)
            errD_fake.backward()
            optD.step()
            netG.zero_grad()
            label.fill_(REAL)
            errG = bce(flat(netD(fake)), label)
            errG.backward()
            optG.step()
        netG.eval()
        netD.eval()
        with torch.no_grad():
            n = len(setup.val)
            value = (bce(flat(netD(setup.val)), torch.full((n,), REAL, dtype=DTYPE))
                     + bce(flat(netD(netG(setup.fixed_noise))), torch.full((n,), FAKE,
                                                                         dtype=DTYPE)))
        setup.log(f"seed {seed} epoch {epoch}: D loss {value.item():.4f}")
        report(value.item(), epoch)
    return value.item()


def d_loss(setup: Setup, netG, netD, bce) -> torch.Tensor:
    """Each discriminator's loss on held-out digits and its generator's fixed-noise fakes."""
    netG.eval()
    netD.eval()
    with torch.no_grad():
        n = len(setup.val)
        fakes = netG(setup.fixed_noise)                     # [N, n, 1, 8, 8]
        return (bce(flat(netD(setup.val)), torch.full((n,), REAL, dtype=DTYPE))
                + bce(flat(netD.with_in_dims(0)(fakes)), torch.full((n,), FAKE, dtype=DTYPE)))


def objective(setup: Setup, array: hftc.sweep.TrialArray) -> torch.Tensor:
    """The same loop, fused: the N trials of ``array`` at once."""
    lrs_d, lrs_g = zip(*(suggest(t) for t in array.trials))
    gens, discs = zip(*(setup.build(t.number) for t in array.trials))
    netG, netD = array.fuse(gens), array.fuse(discs)
    optD = hftc.optim.Adam(netD.parameters(), lr=list(lrs_d), betas=(0.5, 0.999))
    optG = hftc.optim.Adam(netG.parameters(), lr=list(lrs_g), betas=(0.5, 0.999))
    bce = hftc.per_model(F.binary_cross_entropy)            # [N] losses
    loader, noise_generator = setup.loaders()
    for epoch in range(setup.epochs):
        netG.train()
        netD.train()
        for (real,) in loader:
            b = real.shape[0]
            netD.zero_grad()
            label = torch.full((b,), REAL, dtype=DTYPE)
            errD_real = bce(flat(netD(real)), label)        # real: shared by the N models
            errD_real.sum().backward()
            noise = torch.randn(b, NZ, 1, 1, dtype=DTYPE, generator=noise_generator)
            fake = netG(noise)                              # [N, B, 1, 8, 8]
            label.fill_(FAKE)
            errD_fake = bce(flat(netD.with_in_dims(0)(fake.detach())), label)
            errD_fake.sum().backward()
            optD.step()
            netG.zero_grad()
            label.fill_(REAL)
            errG = bce(flat(netD.with_in_dims(0)(fake)), label)
            errG.sum().backward()
            optG.step()
        value = d_loss(setup, netG, netD, bce)
        setup.log(f"epoch {epoch}: trials {array.numbers} D loss "
                  f"{[round(v, 4) for v in value.tolist()]}")
        dropped = array.report(value, epoch)               # cuts netG, netD, optG, optD
        if dropped:
            setup.log(f"  models {dropped} pruned; {len(array)} go on")
    return d_loss(setup, netG, netD, bce)


def check(setup: Setup, study: optuna.Study) -> float:
    """Each trial's reported values against its run alone; the largest relative error."""
    worst, epochs = 0.0, setup.epochs
    try:
        for frozen in study.get_trials():
            history: list[float] = []
            setup.epochs = len(frozen.intermediate_values)
            run_alone(setup, frozen.number, frozen.params["lr_d"], frozen.params["lr_g"],
                      lambda v, e, history=history: history.append(v))
            fused_values = [frozen.intermediate_values[s]
                            for s in sorted(frozen.intermediate_values)]
            for a, b in zip(fused_values, history, strict=True):
                worst = max(worst, abs(a - b) / max(abs(b), 1e-300))
    finally:
        setup.epochs = epochs
    return worst


def main(n_trials=8, array_size=4, pruner=None, storage=None,
         **setup_kwargs) -> tuple[optuna.Study, float]:
    setup = Setup(**setup_kwargs)
    study = optuna.create_study(
        direction="minimize", storage=storage, sampler=optuna.samplers.TPESampler(seed=0),
        pruner=pruner or optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    hftc.sweep.optimize(study, lambda array: objective(setup, array), n_trials=n_trials,
                        array_size=array_size)
    states = [t.state.name for t in study.get_trials()]
    setup.log(f"best: trial {study.best_trial.number}, D loss {study.best_value:.4f}; "
              f"{states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned")
    worst = check(setup, study)
    setup.log(f"each trial against its run alone: largest relative difference {worst:.1e}")
    return study, worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--array-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    _, worst = main(args.trials, args.array_size, epochs=args.epochs, n_train=512)
    assert worst <= 1e-9, worst
