"""Train a fused array of Hugging Face transformers models with ``transformers.Trainer``.

::

    models = [BertForSequenceClassification(config) for _ in range(4)]
    fused = hftc.fuse(models, example_inputs=(input_ids,))
    trainer = hftc.hf.FusedTrainer(model=fused, args=TrainingArguments(...),
                                   train_dataset=train, eval_dataset=val)
    trainer.train()        # logs loss/model_0 ... loss/model_3 (and grad_norm/model_k)
    trainer.save_model()   # output_dir/model_0 ... model_3, each from_pretrained-loadable

:class:`FusedTrainer` is ``transformers.Trainer`` with what N models in one module change:

- the loss: each batch gives the N models' losses ``out.loss`` (shape ``[N]``); their sum is
  backpropagated (model ``k``'s gradient is its own loss's: the models share no weights).
  The logs hold each model's, not the sum: ``loss/model_k`` (``eval_loss/model_k`` in
  evaluation), the gradient norms ``grad_norm/model_k`` (clipping with ``max_grad_norm``
  is per model: hftc's ``clip_grad_norm_``), and with an ``hftc.optim`` optimizer of
  per-model learning rates, ``learning_rate/model_k``;
- ``compute_metrics`` gets one model's predictions at a time (``[samples, ...]``, as for
  one model) and its metrics are logged per model: ``eval_accuracy/model_k``;
- the best model: ``metric_for_best_model`` is read per model (``eval_loss/model_k``),
  ``load_best_model_at_end`` loads each model from its own best checkpoint, and a
  ``transformers.EarlyStoppingCallback`` given to the Trainer decides per model, with its
  patience and threshold: a model that stops keeps the best checkpoint it had (it trains
  on in the array, but its best is no longer updated: what it would be alone), and
  training stops when every model has (``stopped_models``: model -> step);
- the forward's inputs: the Trainer calls ``model(input_ids=..., labels=...)`` with its own
  keywords; the export front-end exports the models again for each new pattern of inputs;
  columns are kept or dropped by the models' own ``forward`` signature;
- predictions (``trainer.predict``): ``[samples, N, ...]`` (the model axis second, so the
  Trainer's concatenation of batches along the first axis stays right);
- ``save_model`` / checkpoints: ``output_dir/model_k`` for each model, written by the
  model class's ``save_pretrained`` (and read back by ``from_pretrained``); resuming
  (``train(resume_from_checkpoint=...)``) reads those folders back into the array.

``import hftc`` never imports this module (nor transformers); importing it without
transformers and accelerate raises :class:`hftc.errors.MissingExtraError`, which says to
``pip install 'hftc[hf]'``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import FusionArgumentError, FusionTypeError, MissingExtraError
from ..module.fused import FusedModule
from ..optim.lr_scheduler import ReduceLROnPlateau as PerModelReduceLROnPlateau
from ..optim.optimizer import FusedOptimizer
from ..utils import clip_grad_norm_ as hftc_clip_grad_norm_

try:
    import accelerate  # noqa: F401  (transformers.Trainer runs on it)
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.trainer_pt_utils import find_batch_size, nested_gather
    from transformers.utils.generic import can_return_loss, find_labels
except ImportError as exc:  # pragma: no cover - the test environment has them
    _missing = (exc.name or "transformers").split(".")[0]
    raise MissingExtraError(f"hftc.hf needs transformers and accelerate ({_missing} is not "
                            f"installed): pip install 'hftc[hf]'", extra="hf") from exc

__all__ = ["FusedTrainer", "PerModelEarlyStopping", "model_dir"]

_logger = transformers.utils.logging.get_logger(__name__)

#: in each checkpoint folder: the models' bests (what trainer_state.json's best_metric and
#: best_model_checkpoint are for one model), read back by train(resume_from_checkpoint=...)
PER_MODEL_STATE_NAME = "hftc_per_model_state.json"


def model_dir(output_dir: str | os.PathLike, index: int) -> str:
    """Where :class:`FusedTrainer` saves model ``index``: ``output_dir/model_{index}``."""
    return os.path.join(os.fspath(output_dir), f"model_{index}")


class FusedTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a fused module of N ``PreTrainedModel``\\ s: trains all N
    on the same batches, as N Trainers with the same arguments and data order would.

    Args:
        model: ``hftc.fuse(models, example_inputs=...)`` of N transformers models (of one
            class and config). Everything else is ``transformers.Trainer``'s. Per-model
            hyper-parameters: pass ``optimizers=(hftc.optim.AdamW(model.parameters(),
            lr=[...]), None)``; the Trainer's scheduler then scales each model's rate.

    Raises ``FusionTypeError`` for a model that is not a fused module of ``PreTrainedModel``\\ s
    and ``FusionArgumentError`` for what would treat the N models as one:
    ``label_smoothing_factor`` (the Trainer smooths the logits as one model's),
    ``neftune_noise_alpha`` (a hook on one model's input embeddings), ``batch_eval_metrics`` and
    ``DataParallel`` over several GPUs of one process (use DDP: ``torchrun`` /
    ``accelerate launch``, each process the fused module on its own GPU).
    """

    #: (a fused module refuses any other Trainer: hftc.module.fused._refuse_stock_trainer)
    trains_fused_modules = True

    def __init__(self, model: FusedModule | None = None,
                 args: transformers.TrainingArguments | None = None, *rest: Any,
                 **kwargs: Any) -> None:
        if not isinstance(model, FusedModule):
            raise FusionTypeError(
                f"FusedTrainer trains a fused module (hftc.fuse([m0, m1, ...], "
                f"example_inputs=...)), got {type(model).__name__}; for one model use "
                f"transformers.Trainer")
        template = model._template
        if not isinstance(template, transformers.PreTrainedModel):
            raise FusionTypeError(
                f"FusedTrainer: the fused models are {type(template).__name__}, not "
                f"transformers PreTrainedModels (save_model writes each with save_pretrained); "
                f"for other models write the loop (or use hftc.lightning)")
        self._template_model = template
        self._train_losses: torch.Tensor | None = None  # per model, since the last log
        self._grad_norms: torch.Tensor | None = None  # per model, of the last step
        self._pending_model_logs: dict[str, float] = {}
        self._eval_sums: torch.Tensor | None = None  # per model, loss x batch size
        self._eval_count = 0
        self._last_losses: torch.Tensor | None = None
        self._train_loss_totals: torch.Tensor | None = None  # per model, this train() call
        self._model_lrs: list[float] = []  # with an hftc.optim optimizer
        if args is not None and args.label_smoothing_factor:
            raise FusionArgumentError(
                "FusedTrainer: label_smoothing_factor is applied by the Trainer to the logits "
                "as one model's, but the fused logits are [N, batch, ...]; set it to 0 and use "
                "the models' own loss (or a compute_loss_func giving N losses)")
        if args is not None and getattr(args, "neftune_noise_alpha", None):
            # (the Trainer hooks model.get_input_embeddings(): one module of one model)
            raise FusionArgumentError(
                "FusedTrainer: neftune_noise_alpha adds noise through a hook on "
                "model.get_input_embeddings(), one model's embedding module, which a fused "
                "module of N models has not (its call failed in hftc's tracing); set it to "
                "None (each model's noise would not be its own run's draws either)")
        if args is not None and args.batch_eval_metrics:
            raise FusionArgumentError(
                "FusedTrainer: batch_eval_metrics calls compute_metrics on the batches of all "
                "N models at once; set it to False (compute_metrics then gets one model's "
                "predictions at a time)")
        #: per model: its best metric_for_best_model value and the step it was at
        self.best_metrics: list[float | None] = []
        self.best_steps: list[int | None] = []
        #: per model: the folder of its best checkpoint (``.../checkpoint-S``)
        self.best_checkpoints: list[str | None] = []
        #: model -> the step its early stopping stopped it at
        self.stopped_models: dict[int, int] = {}
        super().__init__(model, args, *rest, **kwargs)
        self.best_metrics = [None] * model.num_models
        self.best_steps = [None] * model.num_models
        self.best_checkpoints = [None] * model.num_models
        for callback in list(self.callback_handler.callbacks):
            if type(callback) is transformers.EarlyStoppingCallback:  # per model instead
                self.callback_handler.remove_callback(callback)
                self.add_callback(PerModelEarlyStopping(
                    self, callback.early_stopping_patience, callback.early_stopping_threshold))
        self._attach_early_stopping()
        if self.args.n_gpu > 1:
            raise FusionArgumentError(
                f"FusedTrainer: {self.args.n_gpu} GPUs in one process would run the fused "
                f"module under torch DataParallel, which splits the model axis of its outputs "
                f"as a batch; run one process per GPU (torchrun / accelerate launch: DDP) or "
                f"set CUDA_VISIBLE_DEVICES to one GPU")
        # The Trainer reads these off the model's class and attributes; the fused module's
        # forward takes *args, **kwargs and it has no config: read the models' own.
        cls = type(template)
        if self.args.label_names is None:
            self.label_names = find_labels(cls)
        self.can_return_loss = can_return_loss(cls)
        # (causal LMs count num_items_in_batch over the shifted labels)
        self._loss_shifts_labels = (
            LOSS_MAPPING.get(getattr(template, "loss_type", None)) is ForCausalLMLoss
            and not getattr(template.config, "is_encoder_decoder", False))
        if hasattr(template, "accepts_loss_kwargs"):
            self.model_accepts_loss_kwargs = template.accepts_loss_kwargs
        else:
            parameters = inspect.signature(type(template).forward).parameters.values()
            self.model_accepts_loss_kwargs = any(
                p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)

    @property
    def num_models(self) -> int:
        return self.model.num_models

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # accelerate's clip_grad_norm_ takes one norm over all parameters (newer versions
        # compute it themselves, past torch's clip_grad_norm_): clip each model by its own.
        accelerator = self.accelerator

        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            accelerator.unscale_gradients()
            return hftc_clip_grad_norm_(list(parameters), max_norm, norm_type)

        accelerator.clip_grad_norm_ = clip_grad_norm_

    # ------------------------------------------------------------------ the schedule

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None) -> Any:
        """``lr_scheduler_type="reduce_lr_on_plateau"``: each model's rate reduced on its own
        ``eval_<metric>/model_k`` (``hftc.optim.ReduceLROnPlateau``), not on one metric."""
        if (self.lr_scheduler is not None
                or self.args.lr_scheduler_type != transformers.SchedulerType.REDUCE_ON_PLATEAU):
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = optimizer if optimizer is not None else self.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper)
        if not isinstance(optimizer, FusedOptimizer):
            raise FusionArgumentError(
                f"FusedTrainer: lr_scheduler_type='reduce_lr_on_plateau' reduces each model's "
                f"learning rate on its own eval metric, which needs one param group per model; "
                f"the optimizer is a {type(optimizer).__name__} over the stacked parameters: pass "
                f"optimizers=(hftc.optim.AdamW(fused.parameters(), lr=...), None)")
        self.lr_scheduler = _PerModelPlateau(optimizer, **(self.args.lr_scheduler_kwargs or {}))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None,
                  skip_scheduler: bool = False) -> dict[str, float]:
        """``Trainer._evaluate``, a plateau schedule stepped with each model's metric (the
        Trainer would step it with ``eval_<metric>``, which the N models do not have)."""
        scheduler = self.lr_scheduler
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        metrics = super()._evaluate(trial, ignore_keys_for_eval,
                                    skip_scheduler=skip_scheduler or plateau)
        if plateau and not skip_scheduler:
            if not isinstance(scheduler, _PerModelPlateau):
                raise FusionArgumentError(
                    "FusedTrainer: a torch ReduceLROnPlateau steps every model's learning "
                    "rate on one metric; set lr_scheduler_type='reduce_lr_on_plateau' with "
                    "optimizers=(hftc.optim.AdamW(...), None) (each model on its own metric)")
            keys = [self._metric_key(k) for k in range(self.num_models)]
            if any(key not in metrics for key in keys):
                raise FusionArgumentError(
                    f"FusedTrainer: the plateau schedule reads each model's "
                    f"metric_for_best_model ({keys[0]!r}, ...), which the evaluation did not "
                    f"give (it gave {sorted(metrics)}); name a metric of compute_metrics, or "
                    f"'loss'")
            scheduler.step([metrics[key] for key in keys])
        return metrics

    # ------------------------------------------------------------------ the models' inputs

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            signature = inspect.signature(type(self._template_model).forward)
            self._signature_columns = [name for name in signature.parameters if name != "self"]
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """N times one model's estimate (the fused module would fuse ``num_parameters``)."""
        main_input = getattr(self._template_model, "main_input_name", "input_ids")
        if main_input not in inputs:
            return 0
        per_model = self._template_model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * per_model * self.num_models

    # ------------------------------------------------------------------ the loss

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The N models' losses ``[N]`` (each as its own Trainer computes it), summed: the
        sum's gradient is each model's own loss's gradient in its slice."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if loss.dim() != 1 or loss.shape[0] != self.num_models:
            raise FusionArgumentError(
                f"FusedTrainer: the fused model's loss has shape {tuple(loss.shape)}, not one "
                f"loss per model ({self.num_models},): pass labels in the batches (the "
                f"models compute their loss), or a compute_loss_func that returns N losses")
        self._last_losses = loss.detach()
        total = loss.sum()
        return (total, outputs) if return_outputs else total

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        per_model = self._last_losses
        # Scaled for gradient accumulation as Trainer.training_step scales the sum.
        scaled_for_ga = self.loss_is_scaled_for_ga
        if scaled_for_ga is None:
            scaled_for_ga = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                             or self.compute_loss_func is not None)
        if not scaled_for_ga:
            per_model = per_model / self.current_gradient_accumulation_steps
        self._train_losses = (per_model if self._train_losses is None
                              else self._train_losses + per_model)
        self._train_loss_totals = (per_model if self._train_loss_totals is None
                                   else self._train_loss_totals + per_model)
        return loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; its final ``train_loss`` (the mean loss over the steps run) is
        logged per model, ``train_loss/model_k``; ``TrainOutput.training_loss`` stays the
        models' summed one (what was backpropagated)."""
        self._train_loss_totals = None
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ logging

    def _per_model_mean(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[N]`` averaged over the processes (as the Trainer averages its loss)."""
        gathered = nested_gather(values, self.args.parallel_mode)
        return gathered.reshape(-1, self.num_models).double().mean(0)

    def _per_model_sum(self, values: torch.Tensor) -> torch.Tensor:
        gathered = nested_gather(values, self.args.parallel_mode)
        return gathered.reshape(-1, self.num_models).double().sum(0)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> None:
        if isinstance(grad_norm, torch.Tensor) and grad_norm.numel() == self.num_models > 1:
            self._grad_norms = grad_norm.detach()
            grad_norm = grad_norm.detach().double().pow(2).sum().sqrt()  # all models' norm
        steps = self.state.global_step - self._globalstep_last_logged
        if self.control.should_log and steps > 0 and self._train_losses is not None:
            losses = self._per_model_mean(self._train_losses) / steps
            logs = {f"loss/model_{k}": v.item() for k, v in enumerate(losses)}
            if self._grad_norms is not None:
                logs.update((f"grad_norm/model_{k}", v.item())
                            for k, v in enumerate(self._grad_norms.double()))
            if kwargs.get("learning_rate") is None:  # (else read before the scheduler's step)
                self._get_learning_rate()
            logs.update((f"learning_rate/model_{k}", lr) for k, lr in enumerate(self._model_lrs))
            self._pending_model_logs = logs
            self._train_losses = None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _get_learning_rate(self) -> float:
        """The Trainer's (model 0's) learning rate; each model's kept for the next log."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # (accelerate's)
        if isinstance(optimizer, FusedOptimizer) and self.lr_scheduler is not None:
            self._model_lrs = [float(lr) for lr in self.lr_scheduler.get_last_lr()]
        return super()._get_learning_rate()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's logs with each model's loss in place of the models' summed one
        (``loss/model_k``; ``grad_norm/model_k`` and ``learning_rate/model_k`` in place of
        the norm of all N models' gradients and model 0's rate; at the end of training
        ``train_loss/model_k``)."""
        if "loss" in logs and self._pending_model_logs:
            del logs["loss"]
            # (and the one gradient norm of all N models, model 0's learning rate under the
            # Trainer's name: each model's own is logged in their place)
            for name in ("grad_norm", "learning_rate"):
                if f"{name}/model_0" in self._pending_model_logs:
                    logs.pop(name, None)
            logs.update(self._pending_model_logs)
            self._pending_model_logs = {}
        if "train_loss" in logs and self._train_loss_totals is not None:
            # (as the Trainer's: the steps of this call, the losses of all its processes)
            steps = max(self.state.global_step - self._initial_global_step, 0.001)
            del logs["train_loss"]
            logs.update((f"train_loss/model_{k}", v.item() / steps)
                        for k, v in enumerate(self._per_model_mean(self._train_loss_totals)))
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                        prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        self._last_losses = None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only,
                                                       ignore_keys)
        if self._last_losses is not None:
            batch = find_batch_size(inputs)
            weighted = self._last_losses.double() * batch
            self._eval_sums = weighted if self._eval_sums is None else self._eval_sums + weighted
            self._eval_count += batch
        if logits is not None:  # [N, B, ...] -> [B, N, ...]: batches concatenate on dim 0
            logits = _model_axis_second(logits)
        return loss, logits, labels

    def _model_eval_metrics(self, prefix: str) -> dict[str, float]:
        if self._eval_sums is None:
            return {}
        sums = self._per_model_sum(self._eval_sums)
        count = self._per_model_sum(torch.full((self.num_models,), float(self._eval_count),
                                               device=self._eval_sums.device))
        self._eval_sums = None
        return {f"{prefix}_loss/model_{k}": (s / c).item()
                for k, (s, c) in enumerate(zip(sums, count))}

    def evaluation_loop(self, dataloader: Any, description: str,
                        prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> Any:
        """``Trainer.evaluation_loop`` (under ``evaluate`` and ``predict``), with
        ``{prefix}_loss/model_k`` for each model, its mean loss over the samples, in place
        of the summed ``{prefix}_loss``, and ``compute_metrics`` called for each model on
        its own predictions: ``{prefix}_{name}/model_k``."""
        self._eval_sums, self._eval_count = None, 0
        compute_metrics, self.compute_metrics = self.compute_metrics, None
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only,
                                             ignore_keys, metric_key_prefix)
        finally:
            self.compute_metrics = compute_metrics
        output.metrics.pop(f"{metric_key_prefix}_loss", None)
        output.metrics.update(self._model_eval_metrics(metric_key_prefix))
        if (compute_metrics is not None and output.predictions is not None
                and output.label_ids is not None):
            for k in range(self.num_models):
                metrics = compute_metrics(transformers.EvalPrediction(
                    predictions=_model_slice(output.predictions, k),
                    label_ids=output.label_ids))
                output.metrics.update(
                    (f"{metric_key_prefix}_{name.removeprefix(f'{metric_key_prefix}_')}"
                     f"/model_{k}", value) for name, value in metrics.items())
        return output

    # ------------------------------------------------------------------ the best models

    def _metric_key(self, k: int) -> str:
        name = self.args.metric_for_best_model
        return f"{name if name.startswith('eval_') else f'eval_{name}'}/model_{k}"

    def _improves(self, value: float, best: float | None, threshold: float = 0.0) -> bool:
        if best is None:
            return True
        better = value > best if self.args.greater_is_better else value < best
        return bool(better and abs(value - best) > threshold)

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """``Trainer._determine_best_metric`` per model: model ``k``'s best
        ``metric_for_best_model`` (``eval_loss/model_k``) and its step; a model stopped
        early at an earlier evaluation keeps its best.  True if any model's improved."""
        if self.args.metric_for_best_model is None:
            return False
        improved = False
        for k in range(self.num_models):
            if self.stopped_models.get(k, self.state.global_step) < self.state.global_step:
                continue
            key = self._metric_key(k)
            if key not in metrics:
                raise FusionArgumentError(
                    f"FusedTrainer: metric_for_best_model={self.args.metric_for_best_model!r} "
                    f"is read per model as {key!r}, which the evaluation did not give (it "
                    f"gave {sorted(metrics)}); name a metric of compute_metrics, or 'loss'")
            if self._improves(metrics[key], self.best_metrics[k]):
                self.best_metrics[k], self.best_steps[k] = metrics[key], self.state.global_step
                improved = True
        if improved and self.args.save_strategy != "no":
            self.state.best_global_step = self.state.global_step  # (a best checkpoint: now)
        self.state.best_metric = None  # (no one value for N models)
        return improved

    def _load_best_model(self) -> None:
        """Each model from its own best step's checkpoint (``checkpoint-S/model_k``; that of
        the run resumed from where the best came before the resume, as the Trainer's
        ``best_model_checkpoint``)."""
        for k, folder in enumerate(self.best_checkpoints):
            if folder is not None:
                self._load_models(folder, [k])

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Each model with its class's ``save_pretrained`` in ``output_dir/model_k`` (the
        stacked state_dict of the fused module is no ``from_pretrained`` checkpoint), with
        the tokenizer (``processing_class``) beside it, as one model's Trainer saves it:
        ``pipeline(model="out/model_k")`` would load a default one, without its vocabulary,
        from a folder that has none."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        fused = self.accelerator.unwrap_model(self.model)
        folders = [model_dir(output_dir, k) for k in range(fused.num_models)]
        for k, folder in enumerate(folders):
            fused.unfuse_model(k).save_pretrained(folder)
        if self.processing_class is not None:
            for folder in [output_dir, *folders]:
                self.processing_class.save_pretrained(folder)
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint, and the models' bests in it (``PER_MODEL_STATE_NAME``):
        its trainer_state.json keeps one best, for one model.  ``save_total_limit`` keeps
        every model's best checkpoint (the Trainer's rotation would keep one)."""
        with self._own_checkpoint_rotation() as save_total_limit:
            super()._save_checkpoint(model, trial)
        run_dir = self._get_output_dir(trial=trial)
        prefix = transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
        for k, step in enumerate(self.best_steps):
            # (as the Trainer's best_model_checkpoint: a best step's folder once it exists;
            # an evaluation between saves has none, and the earlier best's stays)
            best = os.path.join(run_dir, f"{prefix}-{step}")
            if step is not None and os.path.isdir(best):
                self.best_checkpoints[k] = best
        if self.args.should_save:
            folder = os.path.join(run_dir, f"{prefix}-{self.state.global_step}")
            state = {"best_metrics": self.best_metrics, "best_steps": self.best_steps,
                     "best_checkpoints": self.best_checkpoints,
                     "stopped_models": {str(k): v for k, v in self.stopped_models.items()}}
            with open(os.path.join(folder, PER_MODEL_STATE_NAME), "w") as file:
                json.dump(state, file, indent=1)
            self._rotate_checkpoints_keeping_bests(run_dir, save_total_limit)

    @contextlib.contextmanager
    def _own_checkpoint_rotation(self) -> Any:
        """The Trainer's ``save_total_limit`` off inside (its rotation and end-of-training
        clean-up protect one best checkpoint); yields it, for
        :meth:`_rotate_checkpoints_keeping_bests`."""
        save_total_limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            yield save_total_limit
        finally:
            self.args.save_total_limit = save_total_limit

    def _rotate_checkpoints_keeping_bests(self, run_dir: str, save_total_limit: int | None,
                                          keep_last: bool = True) -> None:
        """``transformers.trainer_utils.rotate_checkpoints`` protecting every model's best
        checkpoint (and the last, to resume from, unless ``keep_last`` is False: the
        Trainer's clean-up at the end of training with ``save_total_limit=1``)."""
        if not save_total_limit or save_total_limit <= 0 or not self.args.should_save:
            return
        checkpoints = transformers.trainer_utils.sort_checkpoints(run_dir, use_mtime=True)
        protected = {str(Path(best)) for best in self.best_checkpoints if best is not None}
        if keep_last or not protected:
            protected |= set(checkpoints[-1:])
        keep = save_total_limit if keep_last else 0
        extra = len(checkpoints) - max(keep, len(protected))
        for checkpoint in checkpoints:
            if extra <= 0:
                break
            if checkpoint not in protected:
                shutil.rmtree(checkpoint, ignore_errors=True)
                extra -= 1

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        """``Trainer._finalize_training``; with ``save_total_limit=1`` and a best per model,
        only the models' best checkpoints are kept (the Trainer keeps its one best)."""
        with self._own_checkpoint_rotation() as save_total_limit:
            output = super()._finalize_training(trial, *args, **kwargs)
        if save_total_limit == 1 and any(best is not None for best in self.best_checkpoints):
            self._rotate_checkpoints_keeping_bests(self._get_output_dir(trial=trial), 1,
                                                   keep_last=False)
        return output

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        """Model ``k`` of the array from ``resume_from_checkpoint/model_k``, and the models'
        bests and early stops as they were at that checkpoint (as the Trainer reads its one
        ``best_metric`` back from trainer_state.json)."""
        self._load_models(resume_from_checkpoint, range(self.num_models), model)
        path = os.path.join(resume_from_checkpoint, PER_MODEL_STATE_NAME)
        if os.path.isfile(path):
            with open(path) as file:
                state = json.load(file)
            if len(state["best_steps"]) == self.num_models:
                self.best_metrics, self.best_steps = state["best_metrics"], state["best_steps"]
                self.best_checkpoints = [self._existing_best(k, folder) for k, folder
                                         in enumerate(state["best_checkpoints"])]
                self.stopped_models = {int(k): v for k, v in state["stopped_models"].items()}

    @staticmethod
    def _existing_best(k: int, folder: str | None) -> str | None:
        """A resumed model's best checkpoint, None if its folder is gone (as the Trainer
        ignores a best_model_checkpoint that no longer exists, warning)."""
        if folder is None or os.path.isdir(folder):
            return folder
        _logger.warning(f"The best checkpoint {folder} of model {k} recorded in the resumed "
                        f"state does not exist anymore. Ignoring it for this run.")
        return None

    def _load_callback_state(self) -> None:
        """``restore_callback_states_from_checkpoint``: the Trainer makes each stateful
        callback anew from its saved arguments, a :class:`PerModelEarlyStopping` without its
        trainer: give it this one."""
        super()._load_callback_state()
        self._attach_early_stopping()

    def _attach_early_stopping(self) -> None:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PerModelEarlyStopping) and callback.trainer is None:
                callback.attach(self)

    def _load_models(self, checkpoint: str, indices: Any,
                     model: torch.nn.Module | None = None) -> None:
        fused = self.accelerator.unwrap_model(model if model is not None else self.model)
        missing = [model_dir(checkpoint, k) for k in indices
                   if not os.path.isdir(model_dir(checkpoint, k))]
        if missing:
            raise FusionArgumentError(
                f"FusedTrainer: cannot load from {checkpoint}: no folder "
                f"{missing[0]} (a FusedTrainer checkpoint holds model_0 ... "
                f"model_{fused.num_models - 1}, one per model of the array)")
        cls = type(self._template_model)
        with torch.no_grad():
            for k in indices:
                saved = cls.from_pretrained(model_dir(checkpoint, k))
                own = dict(saved.named_parameters(remove_duplicate=False))
                own.update(saved.named_buffers(remove_duplicate=False))
                for name, stacked in [*fused.named_parameters(remove_duplicate=False),
                                      *fused.named_buffers(remove_duplicate=False)]:
                    if name in own:
                        stacked[k].copy_(own[name].to(stacked.dtype))


class PerModelEarlyStopping(transformers.EarlyStoppingCallback):
    """``transformers.EarlyStoppingCallback`` for each model of a :class:`FusedTrainer`
    (which puts one in place of a stock one it is given): model ``k``'s counter runs on
    ``eval_<metric>/model_k`` against its own best, as the stock callback's against the
    best of one model; a model whose patience runs out stops (its best checkpoint stays
    its best), and training stops when every model has."""

    def __init__(self, trainer: FusedTrainer | None = None, early_stopping_patience: int = 1,
                 early_stopping_threshold: float = 0.0) -> None:
        super().__init__(early_stopping_patience, early_stopping_threshold)
        self.trainer: FusedTrainer | None = None
        self.counters: list[int] = []
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer: FusedTrainer) -> None:
        """Count for ``trainer``'s models (a :class:`FusedTrainer` attaches one given
        without it; restored counters of as many models are kept)."""
        self.trainer = trainer
        if len(self.counters) != trainer.num_models:
            self.counters = [0] * trainer.num_models

    def state(self) -> dict:
        """What ``restore_callback_states_from_checkpoint`` restores: each model's counter."""
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"counters": list(self.counters)}}

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float],
                    **kwargs: Any) -> None:
        trainer = self.trainer
        for k in range(trainer.num_models):
            if k in trainer.stopped_models or trainer._metric_key(k) not in metrics:
                continue
            value = metrics[trainer._metric_key(k)]
            if trainer._improves(value, trainer.best_metrics[k], self.early_stopping_threshold):
                self.counters[k] = 0
            else:
                self.counters[k] += 1
            if self.counters[k] >= self.early_stopping_patience:
                trainer.stopped_models[k] = state.global_step
        if len(trainer.stopped_models) == trainer.num_models:
            control.should_training_stop = True


class _PerModelPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """``hftc.optim.ReduceLROnPlateau`` as the Trainer knows a plateau schedule (a torch
    ``ReduceLROnPlateau``: stepped after evaluation, not after each optimizer step);
    ``step`` takes the N models' metrics (``FusedTrainer._evaluate`` gives them)."""

    def __init__(self, optimizer: FusedOptimizer, **kwargs: Any) -> None:
        # (no super().__init__: the N torch schedulers inside do the work)
        self.optimizer = optimizer
        self.per_model = PerModelReduceLROnPlateau(optimizer, **kwargs)

    def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
        self.per_model.step(metrics)

    def get_last_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return self.per_model.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.per_model.load_state_dict(state_dict)


def _model_slice(value: Any, k: int) -> Any:
    """Model ``k``'s predictions of ``[samples, N, ...]`` (each part of a tuple)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_model_slice(v, k) for v in value)
    return value[:, k] if getattr(value, "ndim", 0) >= 2 else value


def _model_axis_second(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.movedim(0, 1) if value.dim() >= 2 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_model_axis_second(v) for v in value)
    return value
