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

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .spec import SpecError, SweepSpec, defined_at, hook_name

__all__ = ["SweepData", "LoaderData", "load_data", "epoch_order", "batches", "build_model",
           "metric_value", "train_alone", "epochs_alone", "evaluate", "evaluate_all", "round_seed",
           "make_optimizers", "check_fusable", "make_schedulers", "step_scheduler", "step_losses",
           "not_a_loss", "loss_failed",
           "model_output"]


def round_seed(order_key: int) -> int:
    """The seed of an epoch's random draws (dropout, a DataLoader's shuffle and
    augmentation): a function of the epoch's data order key alone, so a resumed sweep
    draws what the uninterrupted one drew, and a trial replayed alone what it drew fused."""
    return (int(order_key) * 2654435761 + 97) % (2**63)


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

    def n_batches(self, batch_size: int) -> int | None:
        return -(-self.n_train // batch_size)

    def example(self, batch_size: int) -> tuple[Tensor, ...]:
        """A training batch's inputs (for tracing)."""
        return tuple(x[:batch_size] for x in self.x_train)

    def epoch_batches(self, key: int, batch_size: int, index_batches=None,
                      ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        """The epoch's training batches ``(inputs, targets)`` in the order of ``key``."""
        for idx in (index_batches or batches)(epoch_order(key, self.n_train), batch_size):
            yield tuple(x[idx] for x in self.x_train), self.y_train[idx]

    def val_batches(self, batch_size: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        for idx in batches(torch.arange(len(self.y_val)), batch_size):
            yield tuple(x[idx] for x in self.x_val), self.y_val[idx]

    @classmethod
    def from_spec(cls, spec: SweepSpec) -> SweepData:
        return cls.from_raw(spec, spec.data())

    @classmethod
    def from_raw(cls, spec: SweepSpec, raw: Any) -> SweepData:
        if not (isinstance(raw, (tuple, list)) and len(raw) == 2):
            raise SpecError(
                f"spec.data() must return ((x_train, y_train), (x_val, y_val)), got a "
                f"{type(raw).__name__} of length {len(raw) if hasattr(raw, '__len__') else '?'}"
            )
        (xt, yt), (xv, yv) = (_split(spec, raw[0], "train"), _split(spec, raw[1], "val"))
        _check_splits_agree(xt, yt, xv, yv)
        return cls(xt, yt, xv, yv)


class LoaderData:
    """The spec's data as iterables of batches, read anew every epoch: DataLoaders (of
    map-style or streaming IterableDatasets, with their own shuffling and
    augmentation) or an ``IterableDataset`` of samples (batched by ``batch_size``).

    Every batch ``(x, y)`` is moved to the sweep's device (and floating tensors to its
    dtype). The epoch's random draws are seeded by :func:`round_seed`, so shuffling and
    augmentation repeat across a resume and in a trial replayed alone."""

    def __init__(self, spec: SweepSpec, train: Any, val: Any):
        self.spec, self.train, self.val = spec, train, val

    def n_batches(self, batch_size: int) -> int | None:
        try:
            return len(self.train)
        except TypeError:  # a stream: unknown
            return None

    def example(self, batch_size: int) -> tuple[Tensor, ...]:
        with torch.random.fork_rng(devices=[]):  # the sweep's draws stay its own
            for xs, _ in self._batches(self.train, "train"):
                return xs
        raise SpecError("spec.data(): the train loader gave no batch")

    def epoch_batches(self, key: int, batch_size: int, index_batches=None,
                      ) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        return self._batches(self.train, "train")

    def val_batches(self, batch_size: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        return self._batches(self.val, "val")

    def _batches(self, loader: Any, name: str) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
        count = 0
        for batch in loader:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise SpecError(f"spec.data(): the {name} loader must give (x, y) batches, "
                                f"got a {type(batch).__name__}"
                                + (f" of length {len(batch)}" if hasattr(batch, "__len__")
                                   else ""))
            x, y = batch
            xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
            count += 1
            yield tuple(self._move(t) for t in xs), self._move(torch.as_tensor(y))
        if count == 0:
            raise SpecError(f"spec.data(): the {name} loader gave no batch")

    def _move(self, t: Tensor) -> Tensor:
        if t.is_floating_point():
            t = t.to(self.spec.dtype)
        return t.to(self.spec.device)


def _is_loader(split: Any) -> bool:
    from torch.utils.data import DataLoader, IterableDataset

    return isinstance(split, (DataLoader, IterableDataset))


def check_device(spec: SweepSpec) -> None:
    """``spec.device`` is one this process can use: checked where the data is loaded (on
    the worker: a Ray driver may well lack the workers' GPUs), before anything is written,
    not found by torch inside the first tensor's move."""
    try:
        torch.empty(0, device=spec.device)
    except (RuntimeError, AssertionError, TypeError) as exc:
        said = (str(exc).strip().splitlines() or [""])[0]
        raise SpecError(
            f"spec.device is {spec.device!r}, which this process cannot use ({said}); give a "
            f"device torch has here (torch.cuda.is_available() is "
            f"{torch.cuda.is_available()}), e.g. device = \"cpu\"") from None


def load_data(spec: SweepSpec) -> SweepData | LoaderData:
    """The spec's data: tensors (or map-style Datasets, read into memory) as
    :class:`SweepData`, DataLoaders / IterableDatasets as :class:`LoaderData`."""
    from torch.utils.data import DataLoader, IterableDataset

    check_device(spec)
    raw = spec.data()
    try:
        if isinstance(raw, (tuple, list)) and len(raw) == 2 and any(map(_is_loader, raw)):
            if not all(map(_is_loader, raw)):
                raise SpecError("spec.data(): give both splits as DataLoaders (or "
                                "IterableDatasets), or neither")
            train, val = (DataLoader(s, batch_size=b) if isinstance(s, IterableDataset) else s
                          for s, b in zip(raw, (spec.batch_size, spec.eval_batch_size)))
            return LoaderData(spec, train, val)
        return SweepData.from_raw(spec, raw)
    except SpecError as exc:
        raise SpecError(f"{exc} ({defined_at('data', spec.data)})") from None


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
        raise SpecError(f"{hook_name('model', spec.model)} returned a {type(model).__name__}, "
                        f"not an nn.Module: return the trial's model (did it forget `return`?)")
    return model.to(device=spec.device, dtype=spec.dtype)


def model_output(out: Any, j: int) -> Any:
    """Model ``j``'s part of a fused output ``[N, B, ...]``, field by field where the
    models return a tuple or dict of tensors (``(logits, aux)``)."""
    return tree_map(lambda t: t[j] if isinstance(t, Tensor) else t, out)


def shape_text(out: Any) -> str:
    """An output's shape, or its fields' shapes (``((32, 3), ())``) for a tuple or dict."""
    if isinstance(out, Tensor):
        return str(tuple(out.shape))
    return str(tree_map(lambda t: tuple(t.shape) if isinstance(t, Tensor) else t, out))


def metric_value(spec: SweepSpec, output: Any, target: Tensor) -> float:
    """One model's metric from its validation output (all samples)."""
    if spec.metric == "accuracy":
        if not isinstance(output, Tensor):
            raise SpecError(
                f"spec.metric is 'accuracy' (the argmax of the model's output), but "
                f"{hook_name('model', spec.model)}'s models return a "
                f"{type(output).__name__} of {shape_text(output)}; give a function "
                f"metric(output, target) that reads it, e.g. "
                f"(output[0].argmax(-1) == target).double().mean().item()")
        if target.is_floating_point() or output.shape[:-1] != target.shape:
            # (a regression's float targets, or one output per sample: argmax(-1) would
            # score every trial 0 or compare along the batch, a sweep of noise)
            raise SpecError(
                f"spec.metric is 'accuracy' (the argmax of the model's output over its last "
                f"dimension against class labels), but {hook_name('model', spec.model)}'s "
                f"models output {shape_text(output)} for validation targets "
                f"{shape_text(target)} ({target.dtype}); for a regression set metric = "
                f"'loss' (spec.loss on the validation set, minimized), else give a function "
                f"metric(output, target) -> float")
        return (output.argmax(-1) == target).double().mean().item()
    if spec.metric == "loss":
        return float(spec.loss(output, target))
    value = spec.metric(output, target)
    try:
        if isinstance(value, Tensor) and value.numel() != 1:
            raise TypeError
        return float(value.item() if isinstance(value, Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor)
                else f"a {type(value).__name__}: {value!r}"[:200])
        raise SpecError(
            f"{hook_name('metric', spec.metric)} returned {what}; return one number for "
            f"the model's whole validation output (e.g. a mean: "
            f"(output.argmax(-1) == target).float().mean())") from None


@torch.no_grad()
def evaluate(forward: Callable[..., Tensor], data: SweepData | LoaderData, batch_size: int,
             batch_dim: int) -> Tensor:
    """The validation outputs of ``forward``, batch by batch, concatenated along
    ``batch_dim`` (1 for a fused module's ``[N, B, ...]``, 0 alone)."""
    return evaluate_all([forward], data, batch_size, batch_dim)[0][0]


@torch.no_grad()
def evaluate_all(forwards: Sequence[Callable[..., Tensor]], data: SweepData | LoaderData,
                 batch_size: int, batch_dim: int) -> tuple[list[Tensor], Tensor]:
    """The validation outputs of every forward and the targets, from one pass over the
    validation batches (a loader's batches, whatever their order, reach every forward)."""
    outs: list[list[Tensor]] = [[] for _ in forwards]
    targets = []
    for xs, y in data.val_batches(batch_size):
        for k, forward in enumerate(forwards):
            outs[k].append(forward(*xs))
        targets.append(y)
    return [_join(o, batch_dim) for o in outs], torch.cat(targets)


def _join(outputs: list[Any], batch_dim: int) -> Any:
    """The batches' outputs as one, field by field for tuple or dict outputs: tensors with
    a batch dim concatenated along it, the others (a scalar per batch, per model) stacked
    there, one entry per batch."""
    def join(*parts: Any) -> Any:
        if not isinstance(parts[0], Tensor):
            return parts[0]
        if parts[0].dim() > batch_dim:
            return torch.cat(parts, dim=batch_dim)
        return torch.stack(parts, dim=batch_dim)

    return tree_map(join, *outputs)


def make_optimizers(spec: SweepSpec, params: dict[str, Any], model: nn.Module,
                    ) -> list[torch.optim.Optimizer]:
    """``spec.optimizer(params, model)`` as a list (one optimizer or several), checked."""
    made = spec.optimizer(params, model)
    optimizers = list(made) if isinstance(made, (tuple, list)) else [made]
    bad = [o for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad or not optimizers:
        got = type(bad[0]).__name__ if bad else "an empty list"
        raise SpecError(f"{hook_name('optimizer', spec.optimizer)} returned {got}; return a "
                        f"torch.optim optimizer on the module's parameters, or a list of them")
    _check_own_parameters(spec, optimizers, model)
    return optimizers


def _check_own_parameters(spec: SweepSpec, optimizers: Sequence[torch.optim.Optimizer],
                          model: nn.Module) -> None:
    """Every tensor an optimizer steps is a parameter of the trial's module: one on another
    module's (``model(params).parameters()``, a module of the spec's top level) would train
    weights the trial never uses, alone as fused (where hftc.fuse_optimizers' own error
    named no spec function)."""
    own = {id(p) for p in model.parameters()}
    for k, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) in own:
                    continue
                which = f"optimizer {k}" if len(optimizers) > 1 else "the optimizer"
                raise SpecError(
                    f"{hook_name('optimizer', spec.optimizer)} returned {which} on a tensor "
                    f"(#{i} of its param group, shape {list(p.shape)}) that is not a "
                    f"parameter of the module it was given: the trial would not train its "
                    f"own weights; build it on module.parameters() (or a part of them), "
                    f"not on another module's")


def check_fusable(spec: SweepSpec, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Each of a trial's optimizers is one fuse_optimizers can fuse, said of spec.optimizer
    before any trial trains, not from inside the fusing: a class it has (not LBFGS, not a
    subclass of one), and one lr for all its param groups (a fused optimizer holds one lr
    per model, its param_groups[j] being model j: a backbone / head at two rates is two
    optimizers)."""
    from ..optim.convert import fusable_classes

    for k, optimizer in enumerate(optimizers):
        which = f"a {type(optimizer).__module__}.{type(optimizer).__qualname__}"
        if len(optimizers) > 1:
            which = f"optimizer {k} ({which})"
        if type(optimizer) not in fusable_classes():
            raise SpecError(
                f"{hook_name('optimizer', spec.optimizer)} returned {which}, which hftc "
                f"cannot fuse; return one of "
                f"{', '.join(f'torch.optim.{c.__name__}' for c in fusable_classes())}")
        lrs = [g["lr"] for g in optimizer.param_groups]
        if len(set(lrs)) > 1:
            raise SpecError(
                f"{hook_name('optimizer', spec.optimizer)} returned {which} whose param "
                f"groups have different learning rates {lrs}; a fused optimizer has one lr "
                f"per trial: return one optimizer per learning rate instead, e.g. "
                f"[SGD(module.backbone.parameters(), lr=a), SGD(module.head.parameters(), "
                f"lr=b)] (param groups may still differ in weight decay and the rest)")


def make_schedulers(spec: SweepSpec, params: dict[str, Any],
                    optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
    """``spec.scheduler(optimizer, params)`` for each of a trial's stock optimizers
    (``None`` where it gives none, or without the hook), checked."""
    if spec.scheduler is None:
        return [None] * len(optimizers)
    made = []
    for optimizer in optimizers:
        scheduler = spec.scheduler(optimizer, params)
        if scheduler is not None and not (callable(getattr(scheduler, "step", None))
                                          and callable(getattr(scheduler, "state_dict", None))
                                          and getattr(scheduler, "optimizer", None)
                                          is optimizer):
            raise SpecError(
                f"{hook_name('scheduler', spec.scheduler)} returned "
                f"{type(scheduler).__name__}; return a torch.optim.lr_scheduler scheduler "
                f"built on the optimizer it was given (or None for no schedule)")
        made.append(scheduler)
    return made


def step_scheduler(scheduler: Any, metric: float) -> None:
    """One epoch's step: ``ReduceLROnPlateau`` with the trial's metric, others plainly."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(metric)
    else:
        scheduler.step()


def not_a_loss(spec: SweepSpec, one: Any, output: Any, target: Tensor) -> SpecError | None:
    """The error for a training loss that did not give one model one scalar (``one``: its
    value on one model's ``output``), or None. A per-sample loss
    (``reduction="none"``) would train on the batch's sum, not its mean, and then fail."""
    if isinstance(one, Tensor) and one.dim() == 0:
        return None
    what = (f"a tensor of shape {tuple(one.shape)}" if isinstance(one, Tensor)
            else f"a {type(one).__name__}")
    return SpecError(
        f"{hook_name('loss', spec.loss)} returned {what} on one model's output "
        f"{shape_text(output)} and the targets {tuple(target.shape)}; the training loss "
        f"must return a scalar tensor that backward() goes through (no .item() or float(); "
        f"a mean over the batch, not reduction='none')")


def loss_failed(spec: SweepSpec, exc: Exception, output: Any, target: Tensor) -> Exception:
    """What to raise for ``hftc.per_model(spec.loss)``'s error ``exc``: the spec's loss
    tried on one model's ``output``, a SpecError naming it with its own error (a target
    of the wrong shape or kind) or with what it returned instead of a scalar; else
    ``exc`` itself (hftc's own failure)."""
    try:
        one = spec.loss(output, target)
    except Exception as own:  # noqa: BLE001 - the user's loss: its error is the message
        said = (str(own).strip().splitlines() or [""])[0]
        error = SpecError(
            f"{hook_name('loss', spec.loss)}, on one model's output {shape_text(output)} "
            f"({getattr(output, 'dtype', type(output).__name__)}) and the targets "
            f"{tuple(target.shape)} ({target.dtype}), "
            f"raised {type(own).__name__}: {said} -- give a loss(output, target) that takes "
            f"one model's output and the batch's targets as data() gives them")
        error.__cause__ = own
        return error
    return not_a_loss(spec, one, output, target) or exc


def batch_failed(spec: SweepSpec, exc: BaseException, xs: tuple[Tensor, ...],
                 n_train: int | None) -> SpecError | None:
    """torch's ``Expected more than 1 value per channel when training`` (a BatchNorm on a
    batch of one sample: the epoch's last, where the training set leaves one after the
    full batches) as a SpecError saying which batch and what to change, fused or alone;
    None for any other error (raised as it is)."""
    if not (isinstance(exc, ValueError) and "more than 1 value per channel" in str(exc)):
        return None
    size = int(xs[0].shape[0]) if xs and isinstance(xs[0], Tensor) and xs[0].dim() else None
    if n_train is not None and spec.batch_size > 1 and n_train % spec.batch_size == 1:
        other = next(b for b in (spec.batch_size - 1, spec.batch_size + 1, spec.batch_size + 2)
                     if b > 1 and n_train % b != 1)
        which = (f"the epoch's last batch holds {n_train % spec.batch_size} sample "
                 f"({n_train} training samples, batch_size={spec.batch_size}); give a "
                 f"batch_size that leaves none or more than one (batch_size = {other}), or "
                 f"one training sample more or less in spec.data")
    else:
        which = (f"a training batch of {size if size is not None else 'one'} sample(s) (a "
                 f"DataLoader's last batch: drop_last=True, or another batch_size)")
    return SpecError(
        f"the model of {hook_name('model', spec.model)} has a batch norm, which in training needs "
        f"more than one sample per batch (torch: {exc}), but {which}")


def step_losses(spec: SweepSpec, returned: Any, n: int) -> Tensor | None:
    """What ``train_step`` returned, as ``n`` detached per-model losses (None for None)."""
    if returned is None:
        return None
    try:
        losses = torch.as_tensor(returned.detach() if isinstance(returned, Tensor) else
                                 [float(v) for v in returned], dtype=torch.float64)
    except (TypeError, ValueError):
        losses = None
    if losses is None or losses.shape != (n,):
        what = (f"a tensor of shape {tuple(returned.shape)}" if isinstance(returned, Tensor)
                else f"a {type(returned).__name__}")
        raise SpecError(f"{hook_name('train_step', spec.train_step)} returned {what}; return "
                        f"the {n} models' training losses (a tensor of shape ({n},), e.g. "
                        f"hftc.per_model(loss)(out, y) before .sum()) or None")
    return losses.cpu()


class _AloneArray(nn.Module):
    """A stock model as a fused array of one: its outputs get a leading model dimension,
    so a ``train_step`` written for the fused array runs unchanged on it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_models = 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils._pytree.tree_map(
            lambda t: t.unsqueeze(0) if isinstance(t, Tensor) else t,
            self.model(*args, **kwargs))


def batch_for_hook(xs: tuple[Tensor, ...], y: Tensor) -> tuple[Any, Tensor]:
    """The batch as ``train_step`` receives it: ``(x, y)``, ``x`` a tuple for several inputs."""
    return (xs[0] if len(xs) == 1 else xs), y


def train_alone(
    spec: SweepSpec,
    params: dict[str, Any],
    seed: int,
    orders: Sequence[int],
    data: SweepData | LoaderData | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train one trial alone, as the fused sweep trained it: a stock model, the spec's
    stock optimizer(s) and scheduler(s) and its ``train_step`` (or the default step), one
    epoch per order key, its random draws seeded as the sweep seeds them. Returns the
    model and its metric after every epoch (what the sweep reported)."""
    data = data or load_data(spec)
    model = build_model(spec, params, seed)
    history = list(epochs_alone(spec, params, model, orders, data))
    return model, history


def epochs_alone(spec: SweepSpec, params: dict[str, Any], model: nn.Module,
                 orders: Sequence[int], data: SweepData | LoaderData) -> Iterator[float]:
    """:func:`train_alone`'s loop on ``model`` (built by :func:`build_model`), one epoch
    per order key: yields the metric after each epoch (a one-at-a-time study reports it
    and asks its pruner between two epochs)."""
    optimizers = make_optimizers(spec, params, model)
    schedulers = make_schedulers(spec, params, optimizers)
    for key in orders:
        torch.manual_seed(round_seed(key))
        model.train()
        for xs, y in data.epoch_batches(key, spec.batch_size):
            try:
                _step_alone(spec, params, model, optimizers, xs, y)
            except ValueError as exc:
                said = batch_failed(spec, exc, xs, getattr(data, "n_train", None))
                if said is None:
                    raise
                raise said from exc
        model.eval()
        (out,), targets = evaluate_all([model], data, spec.eval_batch_size, batch_dim=0)
        value = metric_value(spec, out, targets)
        for scheduler in schedulers:
            if scheduler is not None:
                step_scheduler(scheduler, value)
        yield value


def _step_alone(spec: SweepSpec, params: dict[str, Any], model: nn.Module,
                optimizers: Sequence[torch.optim.Optimizer], xs: tuple[Tensor, ...],
                y: Tensor) -> None:
    """One batch of :func:`epochs_alone`: the spec's train_step, or the default step."""
    if spec.train_step is not None:
        with _one_model_clipping():
            step_losses(spec, spec.train_step(_AloneArray(model), batch_for_hook(xs, y),
                                              optimizers, [params]), 1)
        return
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    out = model(*xs)
    try:
        loss = spec.loss(out, y)
    except Exception as exc:  # said as the fused sweep says it
        raise loss_failed(spec, exc, tree_map(_detached, out), y) from exc
    if not (isinstance(loss, Tensor) and loss.dim() == 0):
        raise not_a_loss(spec, loss, out, y)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()


@contextlib.contextmanager
def _one_model_clipping() -> Iterator[None]:
    """A train_step written for the fused array clips with one value per model
    (``clip_grad_norm_(model.parameters(), [p["clip"] for p in params])``); alone it gets
    ``[params]``, a list of one, which ``import hftc``'s clip_grad_norm_ / clip_grad_value_
    take as that value. Where torch runs unpatched (``HFTC_STOCK_TORCH=1``: the stock side of
    ``hftc bench --sweep``) torch's own failed on the list (``float() argument must be ...
    not 'list'``): during the step, torch.nn.utils' two names are hftc's (which run torch's
    on a stock model's parameters)."""
    patches = sys.modules.get("hftc.patches")
    if patches is None or patches._installed:
        yield
        return
    from .. import utils

    names = {"clip_grad_norm_": utils._clip_grad_norm_per_model,
             "clip_grad_value_": utils._clip_grad_value_per_model}
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    saved = [(m, n, getattr(m, n)) for m in modules for n in names]
    for module, name, _ in saved:
        setattr(module, name, names[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _detached(t: Any) -> Any:
    return t.detach() if isinstance(t, Tensor) else t


def is_finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value)
