"""Train N small CNNs with different learning rates at once, fused; compare with solo runs.

The data is scikit-learn's ``load_digits`` (8x8 images of digits, 10 classes; it
ships with scikit-learn, nothing is downloaded). The N models are fused with
``hftc.fuse`` and trained with one ``hftc.optim.Adam`` whose learning rate is a
list (one per model) and one stock cosine schedule (per model, since
``param_groups[i]`` is model i). Then each model is trained alone with stock
``torch.optim.Adam`` on the same batches, and the two test accuracies are
printed side by side::

    python examples/train_fused.py --num-models 4 --epochs 10
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hftc


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def load_data(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8]
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = 1400
    return (x[:split], y[:split]), (x[split:], y[split:])


def batches(n: int, batch_size: int, epochs: int, seed: int):
    """The same shuffled batch indices for the fused and the solo runs."""
    g = torch.Generator().manual_seed(seed)
    return [idx for _ in range(epochs) for idx in torch.randperm(n, generator=g).split(batch_size)]


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return (logits.argmax(-1) == y).float().mean().item()


def train_fused(models, lrs, train, order, steps):
    x, y = train
    # example_inputs compiles the fused forward now, so the timing below is training only.
    fused = hftc.fuse(models, example_inputs=(x[:2],))
    opt = hftc.optim.Adam(fused.parameters(), lr=lrs)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loss_fn = hftc.per_model(F.cross_entropy)     # [N, B, 10], [B] -> [N]
    start = time.perf_counter()
    for idx in order:
        opt.zero_grad()
        loss_fn(fused(x[idx]), y[idx]).sum().backward()   # each model gets its own gradient
        opt.step()
        sched.step()
    return fused, time.perf_counter() - start


def train_solo(model, lr, train, order, steps):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    x, y = train
    start = time.perf_counter()
    for idx in order:
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        sched.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-models", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    n = args.num_models
    lrs = [10 ** (-3.5 + 2.0 * i / max(n - 1, 1)) for i in range(n)]   # 3e-4 ... 3e-2
    train, (x_test, y_test) = load_data(args.seed)
    order = batches(len(train[1]), args.batch_size, args.epochs, args.seed)
    models = []
    for i in range(n):
        torch.manual_seed(args.seed + i)
        models.append(make_cnn())
    solos = [copy.deepcopy(m) for m in models]

    fused, fused_time = train_fused(models, lrs, train, order, len(order))
    solo_time = sum(train_solo(m, lr, train, order, len(order)) for m, lr in zip(solos, lrs))

    with torch.no_grad():
        fused.eval()
        fused_logits = fused(x_test)                       # [N, 397, 10]
        trained = fused.unfuse()
    print(f"{n} CNNs on load_digits, {args.epochs} epochs, {len(order)} steps, "
          f"{len(y_test)} test images")
    print(f"{'model':>5}  {'lr':>8}  {'fused acc':>9}  {'solo acc':>8}  "
          f"{'max |w_fused - w_solo|':>22}")
    for i, (solo, lr) in enumerate(zip(solos, lrs)):
        with torch.no_grad():
            solo.eval()
            solo_acc = accuracy(solo(x_test), y_test)
        diff = max((p - q).abs().max().item()
                   for p, q in zip(trained[i].parameters(), solo.parameters()))
        print(f"{i:>5}  {lr:>8.2e}  {accuracy(fused_logits[i], y_test):>9.4f}  "
              f"{solo_acc:>8.4f}  {diff:>22.2e}")
    print(f"training time: fused {fused_time:.2f} s, {n} solo runs {solo_time:.2f} s "
          f"({solo_time / fused_time:.2f}x)")


if __name__ == "__main__":
    main()
