"""What ``import hftc`` changes in torch: every patch, installed by one function.

:func:`install` runs when hftc's core loads (``hftc/__init__.py``: at ``import hftc`` when
torch is already imported, else right after torch's own import), so the patches are in
place before any code can bind one of these torch names.  The replacements are defined
beside the code they serve; this module only installs them (docs/API.md describes each)::

    torch.nn.utils.clip_grad_norm_            a fused module's parameters: each model
      (and torch.nn.utils.clip_grad's; torch's  clipped by its own norm (hftc/utils.py)
      function objects too, for a name bound before import hftc)
    torch.nn.utils.get_total_norm             the gradients of stacked parameters: the
    torch.nn.utils.clip_grads_with_norm_      N norms, applied per model (hftc/utils.py)
    torch.nn.utils.clip_grad_value_           one value per model on a fused module's
                                              parameters: model i's by value i (utils.py)
    torch.optim.swa_utils.update_bn           per model on a fused module (hftc/utils.py)
    torch.nn.utils.convert_conv{2,3}d_weight_   a fused module's stacked convolutions left
      memory_format                           as they are, as fused.to(memory_format=)
                                              leaves them (hftc/utils.py)
    torch.optim.swa_utils.AveragedModel       from a fused module holding other models than
      .update_parameters                      the average (after keep_models): refused,
                                              naming keep_models(ema.module, ...)
    torch.optim.{LBFGS, Adafactor, Muon}      refused on stacked parameters: their update
      .add_param_group                        couples the models (hftc/optim/coupled.py)
    torch.optim.lr_scheduler                  N metrics for a fused optimizer: refused,
      .ReduceLROnPlateau.step                 pointing to hftc.optim.ReduceLROnPlateau
                                              (hftc/optim/lr_scheduler.py)
    torch.optim.lr_scheduler.*.__init__       a scheduler on an hftc.optim optimizer is
                                              registered (weakly), for hftc.keep_models
                                              to cut (hftc/optim/lr_scheduler.py)
    a global optimizer step pre-hook          stock optimizers that stepped are noted
                                              (weakly): keep_models refuses to cut a
                                              fused module under one (optim/optimizer.py)
    torch.optim.*.__init__                    where torch refuses a list of values (one
                                              per model): pointing to hftc.optim's
                                              (hftc/training/mistakes.py)
    torch.nn.functional's losses              the same function objects, a new __code__:
      (cross_entropy, nll_loss, mse_loss ...)   on a fused output taken as one model's,
                                              an error or a UsageWarning pointing to
                                              hftc.per_model (hftc/training/mistakes.py)
    hftc.per_model's results                  a .mean() over the N losses: a UsageWarning
                                              on the first backward (training/mistakes.py)
    torch.autograd.backward                   (Tensor.backward calls it) from the N
                                              per-model losses or a fused output without
                                              a gradient, which torch refuses: an error
                                              naming .sum() (training/mistakes.py)
    torch.nn.Module.load_state_dict           a fused module's state dict (N models
                                              stacked) into one model, which torch
                                              refuses: an error naming
                                              fused.model_state_dict(i) (mistakes.py)
    torch.optim.Optimizer.load_state_dict     a fused optimizer's state dict into a stock
                                              one: an error naming
                                              hftc.optim.unfuse_optimizers (mistakes.py)
    torch.nn.Module.state_dict                of a model given to hftc.fuse, still at the
                                              weights of the fusing while the fused module
                                              trained: a UsageWarning naming
                                              fused.model_state_dict(i) (mistakes.py)
    a global optimizer step pre-hook          an optimizer's first step over the models
                                              hftc.fuse copied, none with a gradient:
                                              a UsageWarning (training/mistakes.py)
    torch.optim.Optimizer.{zero_grad,          run as they are until torch._dynamo is
      add_param_group, state_dict,              imported, torch's own from then on: a
      load_state_dict}, the meta kernels'      process that never compiles skips its
      and dispatch modes' (hftc's among        import (about 1 s; lowering/compile_guard.py)
      them) dynamo guards
    torch.nn.init's initialisers (kaiming_,   on a fused module's stacked parameter: run
      xavier_, orthogonal_ ...) and fan        on each model's row in turn, with that
      helpers (the same function objects,      model's fans and the draws a loop over the
      a new __code__)                          models makes (training/weight_init.py)

Everything else is torch's own: on tensors that are not a fused module's, each
replacement calls torch's original.
"""

from __future__ import annotations

import torch
import torch._decomp
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from . import utils
from .lowering import compile_guard
from .lowering.runtime import losses
from .optim import coupled, lr_scheduler, optimizer
from .training import mistakes, weight_init

_installed = False


def install() -> None:
    """Install every patch above (once; later calls do nothing)."""
    global _installed
    if _installed:
        return
    utils.route_bound_names()  # (before the names below: it reads torch's own objects)
    optimizer_class = torch.optim.Optimizer
    compile_guard.defer_dynamo_import(
        optimizer_class.zero_grad, optimizer_class.add_param_group, optimizer_class.state_dict,
        optimizer_class.load_state_dict,
        *(fn for table in torch._decomp.global_decomposition_table.values()
          for fn in table.values()),
        *(vars(mode).get("__torch_dispatch__") for mode in _subclasses(TorchDispatchMode)))
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        module.clip_grad_norm_ = utils._clip_grad_norm_per_model
        module.get_total_norm = utils._get_total_norm_per_model
        module.clip_grads_with_norm_ = utils._clip_grads_with_norm_per_model
        module.clip_grad_value_ = utils._clip_grad_value_per_model
    torch.optim.swa_utils.update_bn = utils._update_bn_per_model
    for name in ("convert_conv2d_weight_memory_format", "convert_conv3d_weight_memory_format"):
        convert = utils.skipping_stacked_weights(getattr(torch.nn.utils.memory_format, name))
        setattr(torch.nn.utils.memory_format, name, convert)  # (torch's recursion reads it)
        setattr(torch.nn.utils, name, convert)
    torch.optim.swa_utils.AveragedModel.update_parameters = \
        utils._update_parameters_checking_models
    for base in coupled._COUPLING:
        base.add_param_group = coupled.refusing_add_param_group(base)
    torch.optim.lr_scheduler.ReduceLROnPlateau.step = lr_scheduler._plateau_step_on_fused
    for cls in lr_scheduler.torch_scheduler_classes():
        cls.__init__ = lr_scheduler.registering_init(cls.__init__)
    register_optimizer_step_pre_hook(optimizer._note_stock_optimizer_step)
    register_optimizer_step_pre_hook(mistakes.check_any_step)
    for cls in mistakes.stock_optimizer_classes():
        cls.__init__ = mistakes.refusing_per_model_values(cls.__init__)
    mistakes.guard_losses()
    losses.ARGUMENT_CHECKS.append(mistakes.check_fused_output_not_shared)
    losses.RESULT_CHECKS.append(mistakes.check_loss_reduction)
    losses.RESULT_CHECKS.append(mistakes.mark_per_model_losses)
    torch.autograd.backward = mistakes.backward_naming_the_sum(torch.autograd.backward)
    torch.nn.Module.load_state_dict = mistakes.load_state_dict_naming_model_state_dict(
        torch.nn.Module.load_state_dict)
    torch.optim.Optimizer.load_state_dict = mistakes.optimizer_load_naming_unfuse_optimizers(
        torch.optim.Optimizer.load_state_dict)
    torch.nn.Module.state_dict = mistakes.state_dict_noting_stale_models(
        torch.nn.Module.state_dict)
    weight_init.install_per_model_init()
    _installed = True


def _subclasses(cls: type) -> list[type]:
    """Every subclass of ``cls`` defined so far, at any depth."""
    found, todo = [], [cls]
    while todo:
        children = todo.pop().__subclasses__()
        found.extend(children)
        todo.extend(children)
    return found


__all__ = ["install"]
