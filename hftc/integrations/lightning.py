"""Train a fused array of models with PyTorch Lightning: per-model metrics, early stopping
that shrinks the array, and a checkpoint file per model.

::

    class Classifiers(hftc.lightning.FusedLightningModule):
        def training_step(self, batch, _):
            x, y = batch
            out = self(x)                                          # [N, B, classes]
            losses = torch.stack([F.cross_entropy(o, y) for o in out])
            self.log_per_model("train_loss", losses)               # train_loss/model_<id>
            return losses.sum()                                    # each model's own gradient

        def validation_step(self, batch, _):
            x, y = batch
            out = self(x)
            self.log_per_model("val_loss", torch.stack([F.cross_entropy(o, y) for o in out]))

        def configure_optimizers(self):
            return hftc.optim.SGD(self.fused.parameters(), lr=[0.1, 0.03, 0.01])

    module = Classifiers([MLP() for _ in range(3)])
    trainer = lightning.Trainer(max_epochs=20, callbacks=[
        hftc.lightning.PerModelEarlyStopping("val_loss", patience=2),
        hftc.lightning.PerModelCheckpoint(dirpath="ckpt")])        # ckpt/model_<id>.pt
    trainer.fit(module, train_loader, val_loader)

Models keep the *id* they were fused with (their index in the list given) when others
leave the array: metrics are ``{name}/model_{id}`` and files ``model_{id}.pt`` throughout,
``module.model_ids`` lists the ids in the array, in order.

:class:`PerModelEarlyStopping` is Lightning's ``EarlyStopping`` per model (one of them per
id, with its arguments, deciding on that model's metric at the same point of the loop): a
model that stops leaves the array (``hftc.keep_models``, its optimizer state and
scheduler entries too) before the next training step, after that epoch's checkpoints
(or, stopped at a validation within an epoch, where its own run would stop); the
run stops when every model has.  :class:`PerModelCheckpoint` writes each model's
``state_dict`` (as the original class has it: ``MLP().load_state_dict(torch.load(path))``)
at every epoch's end, or, with ``monitor``, when the model's metric improves.

``import hftc`` never imports this module (nor Lightning); importing it without Lightning
raises :class:`hftc.errors.MissingExtraError`, which says to ``pip install 'hftc[lightning]'``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import FusionArgumentError, FusionTypeError, MissingExtraError
from ..module.fused import FusedModule, fuse
from ..optim.lr_scheduler import ReduceLROnPlateau as PerModelReduceLROnPlateau
from ..training.shrink import keep_models

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
except ImportError as exc:  # pragma: no cover - the test environment has them
    _missing = (exc.name or "lightning").split(".")[0]
    raise MissingExtraError(f"hftc.lightning needs Lightning ({_missing} is not installed): "
                            f"pip install 'hftc[lightning]'", extra="lightning") from exc

__all__ = ["FusedLightningModule", "PerModelCheckpoint", "PerModelEarlyStopping"]


def model_metric(name: str, model_id: int) -> str:
    """The name model ``model_id``'s value of metric ``name`` is logged under:
    ``loss``, 3 -> ``loss/model_3`` (TensorBoard and the other loggers group by the part
    before the slash: one chart of ``loss`` with a line per model)."""
    return f"{name}/model_{model_id}"


#: The attribute of a Lightning scheduler config holding the metric name its
#: hftc.optim.ReduceLROnPlateau monitors (its ``monitor`` then names one model's).
_PLATEAU_MONITOR = "_hftc_plateau_monitor"


class FusedLightningModule(pl.LightningModule):
    """A ``LightningModule`` around ``hftc.fuse(models)``: ``self.fused``, called by
    ``self(...)``; write ``training_step`` / ``validation_step`` / ``configure_optimizers``
    as for one model, with N results (``out[j]`` is model ``self.model_ids[j]``'s).

    Args:
        models: the N models (or ``fused``: a fused module already made).
        **fuse_kwargs: for ``hftc.fuse`` (``in_dims``, ``example_inputs`` ...).
    """

    def __init__(self, models: Sequence[nn.Module] | None = None, *,
                 fused: FusedModule | None = None, **fuse_kwargs: Any) -> None:
        super().__init__()
        if (models is None) == (fused is None):
            raise FusionArgumentError(
                "FusedLightningModule takes the models (FusedLightningModule([m0, m1, ...])) "
                "or a fused module (fused=hftc.fuse(...)), one of the two")
        if fused is not None and not isinstance(fused, FusedModule):
            raise FusionTypeError(f"FusedLightningModule: fused= takes hftc.fuse(models), got "
                                  f"a {type(fused).__name__}")
        self.fused = fused if fused is not None else fuse(list(models), **fuse_kwargs)
        #: the id (index in the models first given) of each model in the array, in order
        self.model_ids: list[int] = list(range(self.fused.num_models))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fused(*args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``backward`` (automatic, and under ``manual_backward``), refusing the
        N models' losses unsummed (torch's "grad can be implicitly created only for scalar
        outputs" from deep in Lightning) with what to return."""
        if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() > 1:
            step = ("the loss given to manual_backward" if not self.automatic_optimization
                    else "the loss training_step returned")
            try:
                step_fn = type(self).training_step
                line = inspect.getsourcelines(step_fn)[1]
                where = f"training_step at {inspect.getsourcefile(step_fn)}:{line}"
            except (OSError, TypeError):
                where = "training_step"
            raise FusionArgumentError(
                f"{type(self).__name__}: {step} has shape {list(loss.shape)}, not one number "
                f"({where}); with {len(self.model_ids)} models return their losses' sum, "
                f"losses.sum() (each model gets its own loss's gradient; a mean would divide "
                f"each model's gradient by {len(self.model_ids)})")
        super().backward(loss, *args, **kwargs)

    def log_per_model(self, name: str, values: torch.Tensor | Sequence[Any],
                      **log_kwargs: Any) -> None:
        """``self.log(f"{name}/model_{id}", values[j], ...)`` for each model ``j`` in the
        array (``values``: one per model, e.g. the ``[N]`` losses)."""
        if len(values) != len(self.model_ids):
            raise FusionArgumentError(
                f"log_per_model({name!r}): got {len(values)} values for the "
                f"{len(self.model_ids)} models in the array (ids {self.model_ids}); give one "
                f"value per model, in the array's order")
        for model_id, value in zip(self.model_ids, values):
            self.log(model_metric(name, model_id), value, **log_kwargs)

    def keep_models(self, keep_ids: Sequence[int]) -> None:
        """Keep only the models whose ids are ``keep_ids`` (in the array's order), with their
        optimizer state and schedulers' entries (:func:`hftc.keep_models`)."""
        unknown = sorted(set(keep_ids) - set(self.model_ids))
        if unknown:
            raise FusionArgumentError(
                f"keep_models: model id(s) {unknown} are not in the array (ids "
                f"{self.model_ids}); give ids of models still training")
        trainer = self._trainer
        leaving = [model_id for model_id in self.model_ids if model_id not in set(keep_ids)]
        for callback in getattr(trainer, "callbacks", None) or []:
            if isinstance(callback, PerModelCheckpoint):  # (the last state, as it leaves)
                callback.on_models_leaving(trainer, self, leaving)
        self._cut_to(keep_ids)

    def _cut_to(self, keep_ids: Sequence[int]) -> None:
        """The array cut to the models ``keep_ids``, with the trainer's optimizers' state
        and schedulers' entries (no checkpoint written: see :meth:`keep_models`)."""
        keep = [j for j, model_id in enumerate(self.model_ids) if model_id in set(keep_ids)]
        trainer = self._trainer
        optimizers = list(trainer.optimizers) if trainer is not None else []
        schedulers = ([config.scheduler for config in trainer.lr_scheduler_configs]
                      if trainer is not None else [])
        keep_models(self.fused, keep, optimizers=optimizers, schedulers=schedulers)
        self.model_ids = [self.model_ids[j] for j in keep]
        self._point_plateaus_at_models()

    def on_fit_start(self) -> None:
        """Each ``hftc.optim.ReduceLROnPlateau`` of ``configure_optimizers`` stepped as
        Lightning steps a plateau schedule (after validation), on each model's own
        ``{monitor}/model_{id}`` (:meth:`lr_scheduler_step`); Lightning's
        ``StochasticWeightAveraging`` refused over batch norms (:func:`_refuse_swa_over_bn`)."""
        _refuse_swa_over_bn(self)
        _refuse_one_loss_scale(self)
        _name_per_model_callbacks(self)
        resumed = self.__dict__.pop("_resumed_ids", None)
        if resumed is not None:  # (the optimizers now made for all N: cut before loading)
            self._cut_to(resumed)
        self._point_plateaus_at_models()

    def _point_plateaus_at_models(self) -> None:
        """Lightning steps a plateau schedule only where ``callback_metrics[monitor]``
        exists, and there is no ``val_loss`` beside ``val_loss/model_k``: its config is
        marked a plateau one and pointed at the first model's metric (re-pointed as models
        leave); :meth:`lr_scheduler_step` reads every model's."""
        trainer = self._trainer
        if trainer is None or not self.model_ids:
            return
        for config in trainer.lr_scheduler_configs:
            if not isinstance(config.scheduler, PerModelReduceLROnPlateau):
                continue
            if getattr(config, _PLATEAU_MONITOR, None) is None:
                if config.monitor is None:
                    raise FusionArgumentError(
                        f"{type(self).__name__}.configure_optimizers: "
                        f"hftc.optim.ReduceLROnPlateau needs the metric each model's rate "
                        f"follows: return {{'optimizer': opt, 'lr_scheduler': {{'scheduler': "
                        f"sched, 'monitor': 'val_loss'}}}} with the name given to "
                        f"self.log_per_model")
                setattr(config, _PLATEAU_MONITOR, config.monitor)
            config.reduce_on_plateau = True
            config.monitor = model_metric(getattr(config, _PLATEAU_MONITOR), self.model_ids[0])

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Lightning's, and an ``hftc.optim.ReduceLROnPlateau`` stepped with each model's
        own ``{monitor}/model_{id}`` (not the one value Lightning read)."""
        if not isinstance(scheduler, PerModelReduceLROnPlateau):
            super().lr_scheduler_step(scheduler, metric)
            return
        config = next(c for c in self.trainer.lr_scheduler_configs if c.scheduler is scheduler)
        monitor = getattr(config, _PLATEAU_MONITOR, None)
        if monitor is None:
            raise FusionArgumentError(
                f"{type(self).__name__}.on_fit_start does not call super().on_fit_start(): "
                f"hftc.optim.ReduceLROnPlateau is then stepped before validation, with no "
                f"metric per model; call it")
        names = [model_metric(monitor, model_id) for model_id in self.model_ids]
        metrics = self.trainer.callback_metrics
        missing = [name for name in names if name not in metrics]
        if missing:
            raise FusionArgumentError(
                f"hftc.optim.ReduceLROnPlateau monitors {monitor!r}: {missing} were not "
                f"logged (logged: {sorted(metrics)}); log one value per model with "
                f"self.log_per_model({monitor!r}, values)")
        scheduler.step([float(metrics[name]) for name in names])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["hftc_model_ids"] = list(self.model_ids)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A Lightning checkpoint saved after models left the array (``fit(ckpt_path=
        "last")`` after per-model early stopping) holds fewer models than the module made
        anew: the array is cut to the saved models, each resuming its own state, the
        stopped ones staying out.  In ``fit``, before the optimizers are made (Lightning
        loads the module's weights first), the checkpoint's stacked tensors are widened to
        the N models (a stopped model's rows: this module's), ``configure_optimizers``
        builds for all N as at the start, and :meth:`on_fit_start` cuts the array and
        optimizers before their saved state loads."""
        saved = checkpoint.get("hftc_model_ids")
        if saved is not None and list(saved) != self.model_ids:
            saved = list(saved)
            if [i for i in self.model_ids if i in saved] != saved:
                raise FusionArgumentError(
                    f"this checkpoint holds models {saved} of the array, the module models "
                    f"{self.model_ids}: make the module from the models of the run it was "
                    f"saved from, the same list in the same order (the stopped ones too), "
                    f"and resume; each model's own file (PerModelCheckpoint) holds it alone")
            trainer = self._trainer
            if trainer is not None and trainer.state.fn == "fit" and not trainer.optimizers:
                self._widen_to_array(checkpoint, saved)
                self.__dict__["_resumed_ids"] = saved
            else:
                self._cut_to(saved)
        super().on_load_checkpoint(checkpoint)

    def _widen_to_array(self, checkpoint: dict[str, Any], saved: Sequence[int]) -> None:
        """The checkpoint's ``fused.`` entries of the ``saved`` models as this module's N:
        each stacked tensor (and extra states' list) with the saved rows at their models'
        positions, this module's own at the others'."""
        rows = [self.model_ids.index(i) for i in saved]
        state = checkpoint.get("state_dict", {})
        own = self.state_dict()
        for key, value in list(state.items()):
            mine = own.get(key)
            if not key.startswith("fused.") or mine is None:
                continue
            if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) \
                    and value.dim() and mine.shape[1:] == value.shape[1:] \
                    and (len(value), len(mine)) == (len(rows), len(self.model_ids)):
                widened = mine.detach().clone()
                widened[rows] = value.to(widened.device, widened.dtype)
                state[key] = widened
            elif isinstance(value, list) and isinstance(mine, list) \
                    and (len(value), len(mine)) == (len(rows), len(self.model_ids)):
                widened = list(mine)
                for row, entry in zip(rows, value):
                    widened[row] = entry
                state[key] = widened

    def model_state_dict(self, model_id: int) -> dict[str, torch.Tensor]:
        """Model ``model_id``'s ``state_dict`` with its class's keys (copies)."""
        return self.fused.unfuse_model(self._position(model_id)).state_dict()

    def unfuse_model(self, model_id: int) -> nn.Module:
        """Model ``model_id`` alone, a module of its original class."""
        return self.fused.unfuse_model(self._position(model_id))

    def _position(self, model_id: int) -> int:
        if model_id not in self.model_ids:
            raise FusionArgumentError(
                f"model id {model_id} is not in the array (ids {self.model_ids}): it stopped "
                f"(its checkpoint file holds it) or never was")
        return self.model_ids.index(model_id)


def _refuse_swa_over_bn(module: FusedLightningModule) -> None:
    """Lightning's ``StochasticWeightAveraging`` recomputes the batch norms' statistics for
    the averaged weights, finding them by class (``_BatchNorm``); a fused module's are
    stacked tensors of another class, so the run would end with the statistics of the
    last weights trained, not of the averages, silently.  Refused before training."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    trainer = module._trainer
    callbacks = getattr(trainer, "callbacks", None) or []
    if not any(isinstance(c, StochasticWeightAveraging) for c in callbacks):
        return
    norms = sorted({name.rsplit(".", 1)[0] for name, _ in module.fused.named_buffers()
                    if name.endswith("running_mean")})
    if norms:
        raise FusionArgumentError(
            f"{type(module).__name__}: Lightning's StochasticWeightAveraging finds batch norms "
            f"by their class, and the fused module holds them ({', '.join(norms[:3])}) as "
            f"stacked tensors, so it would not recompute their statistics for the averaged "
            f"weights. Average each model with torch.optim.swa_utils.AveragedModel(self.fused) "
            f"in training_step/on_train_epoch_end, then recompute each model's statistics "
            f"with torch.optim.swa_utils.update_bn(loader, averaged)")


#: Where Lightning's callbacks read their monitor from the logged metrics (and raise on
#: a missing one): the method, the per-model callback that takes its place, what it does.
_MONITOR_READS = {
    EarlyStopping: ("_validate_condition_metric", "PerModelEarlyStopping({monitor!r}, ...)",
                    "with the same arguments, each model stopping on its own metric and "
                    "leaving the array"),
    ModelCheckpoint: ("_save_topk_checkpoint", "PerModelCheckpoint(dirpath, monitor={monitor!r})",
                      "a file per model, written when its own metric improves (a "
                      "ModelCheckpoint without a monitor keeps the whole run for resuming)"),
}


def _name_per_model_callbacks(module: FusedLightningModule) -> None:
    """Lightning's own ``EarlyStopping("val_loss")`` / ``ModelCheckpoint(monitor=
    "val_loss")`` over a module that logs ``val_loss/model_k`` failed with Lightning's
    "not available" / "could not find the monitored key": where the monitor is missing
    and the models' own metrics are there, the error names the per-model callback."""
    for callback in getattr(module._trainer, "callbacks", None) or []:
        kind = next((k for k in _MONITOR_READS if isinstance(callback, k)), None)
        if kind is None or callback.monitor is None:
            continue
        method = _MONITOR_READS[kind][0]
        read = getattr(callback, method)
        if getattr(read, "func", None) is not _naming_per_model_callback:  # (once a fit)
            setattr(callback, method, functools.partial(
                _naming_per_model_callback, module, callback, kind, read))


def _naming_per_model_callback(module: FusedLightningModule, callback: Any, kind: type,
                               read: Any, *args: Any) -> Any:
    metrics, monitor = args[-1], callback.monitor
    per_model = [model_metric(monitor, model_id) for model_id in module.model_ids]
    if monitor not in metrics and any(name in metrics for name in per_model):
        _, instead, what = _MONITOR_READS[kind]
        raise FusionArgumentError(
            f"{kind.__name__}(monitor={monitor!r}) on {type(module).__name__}: no metric "
            f"{monitor!r} was logged, each model's is ({', '.join(per_model[:3])}"
            f"{', ...' if len(per_model) > 3 else ''}: log_per_model). Use "
            f"hftc.lightning.{instead.format(monitor=monitor)}: {what}; or log one number "
            f"for the whole array (self.log({monitor!r}, values.mean())) to have "
            f"{kind.__name__} act on all models at once")
    return read(*args)


def _refuse_one_loss_scale(module: FusedLightningModule) -> None:
    """``precision="16-mixed"`` scales the one loss ``training_step`` returns, the N
    models' sum: torch's GradScaler (one scale, refused by hftc's optimizers at the first
    step) or hftc's, which needs the N losses, cannot be right there.  Refused before
    training, saying what works."""
    trainer = module._trainer
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is None:  # (manual_backward scales with it too)
        return
    raise FusionArgumentError(
        f"{type(module).__name__}: Lightning's 16-bit mixed precision scales the one loss "
        f"training_step returns (the {len(module.model_ids)} models' sum) with one "
        f"{type(scaler).__name__}; each model needs its own loss scale. Train with "
        f"precision='bf16-mixed' (no loss scaling), or keep precision='32-true' and scale "
        f"each model's loss yourself in a manual-optimization training_step "
        f"(self.automatic_optimization = False; torch.autocast, hftc.amp.GradScaler: "
        f"self.manual_backward(scaler.scale(losses).sum()); scaler.step(opt); "
        f"scaler.update())")


def _fused_module(pl_module: Any, who: str) -> FusedLightningModule:
    if not isinstance(pl_module, FusedLightningModule):
        raise FusionTypeError(
            f"{who} works on a hftc.lightning.FusedLightningModule (it needs the array's "
            f"model ids), got a {type(pl_module).__name__}: subclass FusedLightningModule")
    return pl_module


class PerModelEarlyStopping(Callback):
    """Lightning's ``EarlyStopping`` for each model of the array, on its own metric
    ``{monitor}/model_{id}`` (log it with :meth:`FusedLightningModule.log_per_model`).

    Takes ``EarlyStopping``'s arguments (``patience``, ``min_delta``, ``mode``,
    ``stopping_threshold``, ``check_on_train_epoch_end`` ...) and decides for each model
    as that callback would for the model trained alone.  A model that stops leaves the
    array before the next training step (where its own run would stop: after the epoch's
    checkpoints, or at a validation within the epoch, its PerModelCheckpoint file
    written as it leaves); the run
    stops when all have.  ``stopped_epochs``: model id -> the epoch it stopped at.
    """

    def __init__(self, monitor: str, **early_stopping_kwargs: Any) -> None:
        super().__init__()
        self.monitor = monitor
        self._template = EarlyStopping(monitor=monitor, **early_stopping_kwargs)
        self._per_model: dict[int, EarlyStopping] = {}
        self.stopped_epochs: dict[int, int] = {}
        self._leaving: list[int] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self._template.mode)

    def _stopper(self, model_id: int) -> EarlyStopping:
        if model_id not in self._per_model:
            stopper = copy.deepcopy(self._template)
            stopper.monitor = model_metric(self.monitor, model_id)
            self._per_model[model_id] = stopper
        return self._per_model[model_id]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _fused_module(pl_module, "PerModelEarlyStopping")
        self._template.setup(trainer, pl_module, stage)  # when to check, as EarlyStopping

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._leave(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._leave(pl_module)

    def _leave(self, pl_module: pl.LightningModule) -> None:
        """The models that stopped leave before the next step: where ``EarlyStopping``
        stops its run, at an epoch's end or at a validation within the epoch
        (``val_check_interval``), not at the next epoch's start."""
        if self._leaving:
            module = _fused_module(pl_module, "PerModelEarlyStopping")
            module.keep_models([i for i in module.model_ids if i not in self._leaving])
            self._leaving = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._template._check_on_train_epoch_end and not self._skip(trainer):
            self._check(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._template._check_on_train_epoch_end and not self._skip(trainer):
            self._check(trainer, pl_module)

    @staticmethod
    def _skip(trainer: pl.Trainer) -> bool:
        return trainer.state.fn != "fit" or trainer.sanity_checking or bool(trainer.fast_dev_run)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        module = _fused_module(pl_module, "PerModelEarlyStopping")
        metrics = trainer.callback_metrics
        for model_id in module.model_ids:
            if model_id in self._leaving:
                continue
            stopper = self._stopper(model_id)
            if not stopper._validate_condition_metric(metrics):  # (strict: raises, naming it)
                continue
            # EarlyStopping's own decision (patience, min_delta, thresholds, non-finite)
            should_stop, _ = stopper._evaluate_stopping_criteria(
                metrics[stopper.monitor].squeeze())
            if should_stop:
                self.stopped_epochs[model_id] = trainer.current_epoch
                self._leaving.append(model_id)
        if set(module.model_ids) <= set(self._leaving):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"per_model": {i: s.state_dict() for i, s in self._per_model.items()},
                "stopped_epochs": dict(self.stopped_epochs), "leaving": list(self._leaving)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model_id, state in state_dict["per_model"].items():
            self._stopper(int(model_id)).load_state_dict(state)
        self.stopped_epochs = {int(k): v for k, v in state_dict["stopped_epochs"].items()}
        self._leaving = list(state_dict["leaving"])


class PerModelCheckpoint(Callback):
    """A ``state_dict`` file per model, ``dirpath/model_{id}.pt``, loadable into the model's
    original class (``MLP().load_state_dict(torch.load(path))``).

    Args:
        dirpath: the folder (made if missing).
        monitor: None (default): each model's file is written at every epoch's end while
            it is in the array, so it holds the model as training left it (a model that
            stopped early: as it stopped).  A metric name: written when the model's
            ``{monitor}/model_{id}`` improves (``mode`` "min" or "max"), checked after each
            validation (as ``ModelCheckpoint`` with a monitor).
    """

    def __init__(self, dirpath: str | os.PathLike, monitor: str | None = None,
                 mode: str = "min") -> None:
        super().__init__()
        if mode not in ("min", "max"):
            raise FusionArgumentError(f"PerModelCheckpoint: mode is 'min' or 'max', got {mode!r}")
        self.dirpath = os.fspath(dirpath)
        self.monitor, self.mode = monitor, mode
        self.best: dict[int, float] = {}

    @property
    def state_key(self) -> str:
        # (unique per folder and metric, as ModelCheckpoint's: a Trainer may hold a
        # monitored one for the bests beside one for the last states)
        return self._generate_state_key(dirpath=self.dirpath, monitor=self.monitor,
                                        mode=self.mode)

    def path(self, model_id: int) -> str:
        """Model ``model_id``'s file."""
        return os.path.join(self.dirpath, f"model_{model_id}.pt")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None:
            self._save(trainer, pl_module)

    def on_models_leaving(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                          model_ids: Sequence[int]) -> None:
        """Without a monitor, the files of the models leaving the array: their last states
        (a model stopped at a validation within an epoch leaves before its end)."""
        if self.monitor is None:
            self._save(trainer, pl_module, model_ids)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (as ModelCheckpoint with a monitor: after each validation, which need not be at
        # an epoch's end (val_check_interval) nor at every epoch (check_val_every_n_epoch))
        if self.monitor is not None:
            self._save(trainer, pl_module)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
              model_ids: Sequence[int] | None = None) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or trainer.state.fn != "fit":
            return
        module = _fused_module(pl_module, "PerModelCheckpoint")
        os.makedirs(self.dirpath, exist_ok=True)
        for model_id in module.model_ids if model_ids is None else model_ids:
            if self.monitor is not None:
                name = model_metric(self.monitor, model_id)
                if name not in trainer.callback_metrics:
                    raise FusionArgumentError(
                        f"PerModelCheckpoint: no metric {name!r} (monitor={self.monitor!r}); "
                        f"log it with self.log_per_model({self.monitor!r}, values)")
                value = float(trainer.callback_metrics[name])
                if math.isnan(value):  # (as ModelCheckpoint: the worst value, not a best
                    value = math.inf if self.mode == "min" else -math.inf  # none can beat)
                best = self.best.get(model_id)
                if best is not None and not (value < best if self.mode == "min" else value > best):
                    continue
                self.best[model_id] = value
            torch.save(module.model_state_dict(model_id), self.path(model_id))

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = {int(k): v for k, v in state_dict["best"].items()}
