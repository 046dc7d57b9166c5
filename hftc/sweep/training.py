"""The training loop a sweep runs, fused and alone, from the same pieces.

A trial's epoch is: the training set in the order :func:`epoch_order` gives for
the epoch's *order key*, in batches of ``spec.batch_size``; per batch forward,
loss, backward, optimizer step; then the metric on the validation set, in eval
mode. Fused, all N trials of an array share the batches (one key per round,
recorded per trial as the user attribute ``hftc_orders``); alone,
:func:`train_alone` replays a trial from its seed and its recorded keys. The
demo's serial baseline is ``train_alone`` too, so the speedup compares like with
like.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .spec import SpecError, SweepSpec

__all__ = ["SweepData", "epoch_order", "batches", "build_model", "metric_value",
           "train_alone", "evaluate"]


@dataclass
class SweepData:
    """The spec's data as tensors on the sweep's device: inputs are tuples of tensors."""

    x_train: tuple[Tensor, ...]
    y_train: Tensor
    x_val: tuple[Tensor, ...]
    y_val: Tensor

    @property
    def n_train(self) -> int:
        return len(self.y_train)

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> SweepData:
        raw = spec.data()
        if not (isinstance(raw, (tuple, list)) and len(raw) == 2):
            raise SpecError(
                f"spec.data() must return ((x_train, y_train), (x_val, y_val)), got a "
                f"{type(raw).__name__} of length {len(raw) if hasattr(raw, '__len__') else '?'}"
            )
        (xt, yt), (xv, yv) = (_split(spec, raw[0], "train"), _split(spec, raw[1], "val"))
        _check_splits_agree(xt, yt, xv, yv)
        return cls(xt, yt, xv, yv)


def _check_splits_agree(xt: tuple[Tensor, ...], yt: Tensor, xv: tuple[Tensor, ...],
                        yv: Tensor) -> None:
    """The validation split's samples have the training split's shapes (and are floating
    where those are), input by input: a model trained on 64 features cannot be evaluated
    on 65, and the sweep says so before training, not after an epoch inside a matmul."""
    if len(xt) != len(xv):
        raise SpecError(f"spec.data(): the train split has {len(xt)} input(s) per sample, the "
                        f"val split {len(xv)}; give both splits the same inputs")
    pairs = [(f"input {k}", a, b) for k, (a, b) in enumerate(zip(xt, xv))]
    for what, a, b in [*pairs, ("targets", yt, yv)]:
        if a.shape[1:] != b.shape[1:] or a.is_floating_point() != b.is_floating_point():
            raise SpecError(
                f"spec.data(): the val split's {what} has samples of shape "
                f"{tuple(b.shape[1:])} ({b.dtype}), the train split's {tuple(a.shape[1:])} "
                f"({a.dtype}): the models are evaluated on what they are trained on; give "
                f"data() validation {what} of the training ones' width and kind")


def _materialize(dataset: Any, name: str) -> tuple[Any, Tensor]:
    """A map-style Dataset of (x, y) samples, read once into stacked tensors."""
    from torch.utils.data import default_collate

    if len(dataset) == 0:
        raise SpecError(f"spec.data(): the {name} dataset is empty")
    samples = [dataset[i] for i in range(len(dataset))]
    if not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples[:1]):
        raise SpecError(f"spec.data(): the {name} dataset must give (x, y) pairs, got "
                        f"{type(samples[0]).__name__}")
    x, y = default_collate(samples)
    return x, torch.as_tensor(y)


def _split(spec: SweepSpec, split: Any, name: str) -> tuple[tuple[Tensor, ...], Tensor]:
    if isinstance(split, torch.utils.data.Dataset) and hasattr(split, "__len__"):
        split = _materialize(split, name)  # the sweep indexes batches itself, in memory
    if not (isinstance(split, (tuple, list)) and len(split) == 2):
        raise SpecError(f"spec.data(): the {name} split must be a pair (x_{name}, y_{name}) "
                        f"or a Dataset of (x, y), got {type(split).__name__}")
    x, y = split
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    out = []
    for k, t in enumerate(xs + (y,)):
        if not isinstance(t, Tensor):
            try:
                t = torch.as_tensor(t)
            except Exception as exc:
                raise SpecError(f"spec.data(): {name} input {k} is a {type(t).__name__}, not "
                                f"a tensor (or array)") from exc
        if t.is_floating_point():
            t = t.to(spec.dtype)
        out.append(t.to(spec.device))
    n = len(out[-1])
    for k, t in enumerate(out[:-1]):
        if len(t) != n:
            raise SpecError(f"spec.data(): {name} input {k} has {len(t)} samples but the "
                            f"targets have {n}")
    if n == 0:
        raise SpecError(f"spec.data(): the {name} split is empty")
    return tuple(out[:-1]), out[-1]


def epoch_order(key: int, n: int) -> Tensor:
    """The order of the ``n`` training samples in an epoch with order key ``key``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(int(key)))


def batches(order: Tensor, batch_size: int) -> Iterator[Tensor]:
    """Index batches of ``order`` (the last one may be smaller)."""
    for start in range(0, len(order), batch_size):
        yield order[start:start + batch_size]


def build_model(spec: SweepSpec, params: dict[str, Any], seed: int) -> nn.Module:
    """``spec.model(params)`` under ``torch.manual_seed(seed)``, in the sweep's dtype and device."""
    torch.manual_seed(seed)
    model = spec.model(params)
    if not isinstance(model, nn.Module):
        raise SpecError(f"spec.model(params) returned a {type(model).__name__}, not an nn.Module")
    return model.to(device=spec.device, dtype=spec.dtype)


def metric_value(spec: SweepSpec, output: Tensor, target: Tensor) -> float:
    """One model's metric from its validation output (all samples)."""
    if spec.metric == "accuracy":
        return (output.argmax(-1) == target).double().mean().item()
    if spec.metric == "loss":
        return float(spec.loss(output, target))
    value = spec.metric(output, target)
    return float(value.item() if isinstance(value, Tensor) else value)


@torch.no_grad()
def evaluate(forward: Callable[..., Tensor], data: SweepData, batch_size: int,
             batch_dim: int) -> Tensor:
    """The validation outputs of ``forward``, batch by batch, concatenated along
    ``batch_dim`` (1 for a fused module's ``[N, B, ...]``, 0 alone)."""
    outs = []
    for idx in batches(torch.arange(len(data.y_val)), batch_size):
        outs.append(forward(*(x[idx] for x in data.x_val)))
    return torch.cat(outs, dim=batch_dim)


def train_alone(
    spec: SweepSpec,
    params: dict[str, Any],
    seed: int,
    orders: Sequence[int],
    data: SweepData | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train one trial alone, as the fused sweep trained it: a stock model and the
    spec's stock optimizer, one epoch per order key. Returns the model and its metric
    after every epoch (what the sweep reported)."""
    data = data or SweepData.from_spec(spec)
    model = build_model(spec, params, seed)
    optimizer = spec.optimizer(params, model)
    history = []
    for key in orders:
        model.train()
        for idx in batches(epoch_order(key, data.n_train), spec.batch_size):
            optimizer.zero_grad(set_to_none=True)
            spec.loss(model(*(x[idx] for x in data.x_train)), data.y_train[idx]).backward()
            optimizer.step()
        model.eval()
        out = evaluate(model, data, spec.eval_batch_size, batch_dim=0)
        history.append(metric_value(spec, out, data.y_val))
    return model, history


def is_finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value)
