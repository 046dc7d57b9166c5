"""The mistakes a user makes first when training a fused module with stock code, caught
with a message that names the fix and the user's line (installed by :mod:`hftc.patches`)::

    torch.optim.SGD(fused.parameters(),   a stock optimizer given one value per model:
                    lr=[0.1, 0.2])        FusionTypeError -> hftc.optim.SGD(..., lr=[...])
    F.cross_entropy(fused(x), y)          a stock class loss on a fused output, as for one
    nn.CrossEntropyLoss()(fused(x), y)    model's: FusionArgumentError -> hftc.per_model
    F.mse_loss(fused(x), y)               a mean over all N models (one model's target
                                          broadcast): UsageWarning -> hftc.per_model
    hftc.per_model(loss)(out, y).mean()   each model's gradient / N: UsageWarning -> .sum()
    model.load_state_dict(                a fused module's state dict into one model:
      fused.state_dict())                   FusionArgumentError -> fused.model_state_dict(i)
    hftc.per_model(loss)(out, y)          torch's "grad can be implicitly created only for
      .backward()                           scalar outputs": FusionArgumentError -> .sum()
    opt.step() after training the         the copies do not follow: UsageWarning -> train
      models fused.unfuse() gave          the fused module, unfuse() after
    torch.optim.SGD(models[0].parameters  the originals hftc.fuse copied: UsageWarning
      ()) stepped after fused(x)'s loss     -> hftc.optim.SGD(fused.parameters(), ...)
    opt.step(skip_models=...)             its batch norm still learned: UsageWarning ->
      to freeze a model                   hftc.keep_models / hftc.EarlyStopping
    F.nll_loss(F.log_softmax(out, -1), y) a tensor of a fused output's shape (a live
    F.cross_entropy(out.view(-1, C), y)   fused module's N), where torch would refuse
                                          it: FusionArgumentError -> hftc.per_model

A stock optimizer is only refused where torch's own check failed on a list or tuple of
values: what torch accepts runs as torch runs it.  The losses of ``torch.nn.functional``
keep their identity (``F.cross_entropy is F.cross_entropy`` for every table keyed by it,
torch.fx's targets, dynamo's rules): :func:`guard_losses` gives each function object a
new ``__code__`` that checks its first argument and calls a copy of the original; a
tensor that is not a fused output (:mod:`hftc.module.usage`) costs one attribute lookup.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import (
    FusionArgumentError,
    FusionTypeError,
    UsageWarning,
    user_line,
    user_stacklevel,
)
from ..lowering.runtime.modules import FUSED_MODULES
from ..module.usage import OUTPUT_MARK, UNFUSED_COPIES, stale_source


def refusing_per_model_values(init: Callable[..., None]) -> Callable[..., None]:
    """A stock optimizer's ``__init__`` that, where torch's own check fails on a list or
    tuple of hyper-parameter values (``lr=[0.1, 0.2]``), says to use hftc.optim's."""

    @functools.wraps(init)
    def checked(self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, params, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            given = [*(("lr", a) for a in args[:1]), *kwargs.items()]
            lists = [k for k, v in given if isinstance(v, (list, tuple)) and v
                     and all(isinstance(e, (int, float, tuple, list)) for e in v)]
            if not lists:
                raise
            cls = type(self).__name__
            raise FusionTypeError(
                f"torch.optim.{cls} takes one {lists[0]} for all its parameters, got "
                f"{dict(given)[lists[0]]!r}; for one value per model of a fused module, "
                f"use hftc.optim.{cls}(fused.parameters(), {lists[0]}=[...]) (the same "
                f"arguments, each hyper-parameter a value or a list of N)") from exc
        if type(self).__init__ is checked and len(self.param_groups) > 1:
            _check_grouping(self)

    checked.__hftc_original__ = init
    return checked


def _check_grouping(optimizer: torch.optim.Optimizer) -> None:
    """nanoGPT's ``configure_optimizers`` grouping by ``p.dim()`` on a fused module's
    stacked parameters, given to a stock optimizer: the warning hftc.optim's give."""
    from ..lowering.runtime.modules import stacked_counts
    from ..optim.hyperparameters import warn_of_grouping_by_stacked_dims

    params = [list(g["params"]) for g in optimizer.param_groups]
    flat = [p for ps in params for p in ps]
    if not flat or any(n is None for n in stacked_counts(flat)):
        return
    values = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    warn_of_grouping_by_stacked_dims(f"torch.optim.{type(optimizer).__name__}", params,
                                     values)


def stock_optimizer_classes() -> list[type]:
    """torch.optim's optimizer classes, each with its own ``__init__``."""
    found, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("torch.optim") and "__init__" in vars(sub):
                found.append(sub)
    return found


# --------------------------------------------------------------------------- stock losses

#: torch.nn.functional's losses whose target is a class index (or probabilities) per row.
CLASS_LOSSES = ("cross_entropy", "nll_loss")
#: ... and those over elements, which broadcast a target of another shape ...
ELEMENTWISE_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
                      "soft_margin_loss", "poisson_nll_loss")
#: ... or refuse it (torch's ValueError: ours names the fix).
SAME_SHAPE_LOSSES = ("binary_cross_entropy", "binary_cross_entropy_with_logits")
#: the losses whose code :func:`guard_losses` gave the check, by name
GUARDED_LOSSES: dict[str, Callable[..., Tensor]] = {}


def guard_losses() -> None:
    """Give each loss of :data:`CLASS_LOSSES`, :data:`ELEMENTWISE_LOSSES` and
    :data:`SAME_SHAPE_LOSSES` a first statement, on its docstring's closing line::

        def mse_loss(input, target, ..., reduction="mean", ...):
            \"\"\"...\"\"\"; _hftc_check_loss("mse_loss", input, target, reduction, ...)
            ... torch's body, unchanged ...

    compiled from torch's own source at its own lines, as the same function object's
    ``__code__``: its identity (every table keyed by it, torch.fx's targets, dynamo's
    rules), signature, source (``inspect.getsource``, TorchScript) and line numbers are
    torch's, and a warning torch's body gives still names the caller's line."""
    for name in (*CLASS_LOSSES, *ELEMENTWISE_LOSSES, *SAME_SHAPE_LOSSES):
        function = getattr(F, name, None)
        if function is None or name in GUARDED_LOSSES or function.__closure__:
            continue
        code = _guarded_code(function)
        if code is not None:
            function.__globals__["_hftc_check_loss"] = check_loss_call
            function.__code__ = code
            GUARDED_LOSSES[name] = function


def _guarded_code(function: Callable[..., Tensor]) -> types.CodeType | None:
    """``function``'s code with the check after its docstring (None: no source, or no
    docstring to put it after)."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None
    source = "".join(lines)
    tree = ast.parse(source)
    node = tree.body[0]
    params = [a.arg for a in node.args.args]
    doc = node.body[0] if node.body else None
    if not isinstance(node, ast.FunctionDef) or node.decorator_list or len(params) < 2 \
            or not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
        return None
    given = ", ".join(k if k in params else "None" for k in ("reduction", "size_average",
                                                              "reduce"))
    check = f"; _hftc_check_loss({node.name!r}, {params[0]}, {params[1]}, {given})"
    lines = source.splitlines(keepends=True)
    row, end = doc.end_lineno - 1, doc.end_col_offset  # (a byte offset, as ast gives)
    raw = lines[row].encode()
    lines[row] = (raw[:end] + check.encode() + raw[end:]).decode()
    namespace = dict(function.__globals__)
    try:  # (another torch's source that does not compile so: the loss stays as it is)
        exec(compile("\n" * (first - 1) + "".join(lines), function.__code__.co_filename,
                     "exec"), namespace)
    except Exception:  # noqa: BLE001
        return None
    code = namespace[node.name].__code__
    return code if code.co_freevars == function.__code__.co_freevars else None


def check_loss_call(name: str, input: Any, target: Any, reduction: Any, size_average: Any,
                    reduce: Any) -> None:
    """The first statement of torch's loss ``name``: nothing unless ``input`` is a fused
    output (a marked tensor, :mod:`hftc.module.usage`) taken as one model's output, or a
    tensor of that shape made from one (``F.log_softmax(out, -1)``) where torch itself
    would refuse or broadcast the call (:func:`_check_fused_loss`)."""
    if not isinstance(input, Tensor) or not isinstance(target, Tensor) \
            or torch.compiler.is_compiling():
        return
    n = getattr(input, OUTPUT_MARK, None)
    if n is None:
        n = _fused_models_behind(name, input, target)
        if n is None:
            return
    if size_average is not None or reduce is not None:  # torch's legacy spelling
        reduction = "sum" if size_average is False and reduce is not False else "other"
    _check_fused_loss(name, input, target, n, reduction,
                      marked=getattr(input, OUTPUT_MARK, None) is not None)


def _fused_models_behind(name: str, input: Tensor, target: Tensor) -> int | None:
    """N where ``input``, not marked, has the shape of a live fused module's output taken
    as one model's (``[N, B, ...]``, one model's target): only where torch refuses the
    call (a class loss, a loss of one shape) or broadcasts it.  A class loss on the N
    outputs flattened (``[N*B, C]`` and one model's ``[B]``, which torch refuses too) is
    refused here."""
    if input.dim() < 2:
        return None
    live = {m.num_models for m in list(FUSED_MODULES)}
    if name in CLASS_LOSSES:
        if input.dim() >= 3 and target.shape in (input.shape[1:2] + input.shape[3:],
                                                 input.shape[1:]):
            return input.shape[0] if input.shape[0] in live else None
        rows, batch = input.shape[0], target.shape[0] if target.dim() else 0
        if target.dim() == input.dim() - 1 and batch and rows != batch \
                and rows % batch == 0 and rows // batch in live \
                and target.shape[1:] == input.shape[2:]:
            n = rows // batch
            raise FusionArgumentError(
                f"F.{name} got {list(input.shape)} and a target {list(target.shape)}: "
                f"{rows} rows = {n} models x {batch}, a fused module's outputs flattened "
                f"(out.view(-1, C)) with one model's target{user_line()}; torch refuses "
                f"it (and with the target repeated N times the mean would divide each "
                f"model's gradient by {n}). Take each model's loss on the fused output "
                f"[N, B, C]: losses = hftc.per_model(F.{name})(out, y) ([{n}]), then "
                f"losses.sum().backward()")
        return None
    if target.shape in (input.shape[1:], (1, *input.shape[1:])) and input.shape[0] in live:
        return input.shape[0]
    return None


def _loss_called_as() -> tuple[str, str]:
    """``(how the user called the loss, what to pass hftc.per_model)``: a loss module
    (``nn.CrossEntropyLoss()``) where the frame that called the functional loss is one's
    ``forward``, else the function; found above this module and the guarded loss."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_globals.get("__name__") == __name__
                                 or frame.f_code.co_name in GUARDED_LOSSES):
        frame = frame.f_back
    owner = frame.f_locals.get("self") if frame is not None else None
    if frame is not None and frame.f_code.co_name == "forward" \
            and isinstance(owner, nn.modules.loss._Loss):
        return f"nn.{type(owner).__name__}()", f"nn.{type(owner).__name__}()"
    return "", ""


def _check_fused_loss(name: str, input: Tensor, target: Tensor, n: int,
                      reduction: str, marked: bool = True) -> None:
    """A stock loss taken on a fused output ``[N, B, ...]`` as if it were one model's:

    - a class loss (``cross_entropy``, ``nll_loss``) given one model's target (or the N
      models' stacked): FusionArgumentError (torch would read the N models as the batch);
    - a loss that needs the input's shape (``binary_cross_entropy``) given one model's
      target: FusionArgumentError (torch refuses it, not saying why);
    - an elementwise loss with ``reduction="mean"`` given one model's target (broadcast,
      ``[B, ...]`` or ``[1, B, ...]``) or the N models' (stacked): the mean over all N
      models, each model's gradient divided by N; ``kl_div``'s ``"batchmean"``, which
      divides by N, not B: UsageWarning.

    Each names the user's line and ``hftc.per_model``."""
    one_row = input.shape[1:2] + input.shape[3:]  # one model's class-index target
    classes = name in CLASS_LOSSES
    shared = target.shape in ((one_row, input.shape[1:]) if classes else
                              (input.shape[1:], (1, *input.shape[1:])))
    stacked = target.shape in (((n, *one_row), input.shape) if classes else (input.shape,))
    if input.dim() < 2 or not (shared or stacked):
        return
    module, module_arg = _loss_called_as()
    called = module or f"F.{name}"
    models = f"{n} model{'s' if n != 1 else ''}"
    what = ("a fused module's output" if marked else
            "a tensor of a fused module's output's shape")
    dims = "" if shared else ", in_dims=(0, 0)"
    target_text = (f"one model's target {list(target.shape)}" if shared
                   else f"a target stacked per model {list(target.shape)}")
    use = (f"Take each model's loss with hftc.per_model: losses = hftc.per_model("
           f"{module_arg or f'F.{name}'}{dims})(out, y) ([{n}], one per model), then "
           f"losses.sum().backward() (the sum: each model gets its own gradient)")
    if classes or (shared and name in SAME_SHAPE_LOSSES):
        why = (f"torch would take the {n} models for the batch" if classes else
               "torch refuses a target of another shape than the input")
        raise FusionArgumentError(
            f"{called} got {what} {list(input.shape)} ({models}) and "
            f"{target_text}, as for one model's output{user_line()}; {why}. {use}")
    if reduction in ("mean", "batchmean") and n > 1:
        scale = (f"the mean is over all {n} models, so each model's gradient is divided by "
                 f"{n} (with SGD: a learning rate {n} times smaller)" if reduction == "mean"
                 else f"'batchmean' divides by the input's first dimension, the {n} models, "
                 f"not the batch of {input.shape[1]}: each model's gradient is "
                 f"{input.shape[1]}/{n} times its own")
        warnings.warn(
            f"{called} on {what} {list(input.shape)} ({models}) and "
            f"{target_text}{user_line()}: "
            + ("the target is broadcast over the models and " if shared else "")
            + f"{scale}. {use}", UsageWarning, stacklevel=user_stacklevel())


# --------------------------------------------------------------------------- .mean() of N losses

#: The user's lines whose per-model losses' gradient was checked once (file, line).
_CHECKED_LOSS_LINES: set[tuple[str, int]] = set()


def check_fused_output_not_shared(name: str, signature: inspect.Signature | None,
                                  args: Sequence[Any], dims: Sequence[int | None],
                                  kwargs: dict[str, Any], n: int) -> None:
    """``hftc.per_model(loss)(out, x, mu, logvar)`` where an argument ``in_dims`` shares
    (past its end, marked None, or a keyword) is a fused output of the N models (a VAE's
    ``mu``): each model's loss would read all N models' values (broadcast, or summed
    over), silently.  Refused, naming the ``in_dims`` that stacks it; a copy
    (``t.clone()``) is shared on purpose."""
    if torch.compiler.is_compiling():  # (no marks there: mark_outputs skips compiled code)
        return
    shared = [(k, a) for k, (a, d) in enumerate(zip(args, dims)) if d is None]
    shared += [(key, a) for key, a in kwargs.items()]
    marked = [(k, a) for k, a in shared
              if isinstance(a, Tensor) and getattr(a, OUTPUT_MARK, None) == n]
    if not marked:
        return
    names = ([p.name for p in signature.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
             if signature is not None else [])
    positions = {k for k, _ in marked if isinstance(k, int)}
    positions |= {names.index(k) for k, _ in marked if k in names}
    wanted = tuple(0 if k in positions else d
                   for k, d in enumerate(list(dims) + [None] * (max(positions, default=-1)
                                                               + 1 - len(dims))))
    said = ", ".join(
        f"{'argument ' + str(k) if isinstance(k, int) else k}"
        f"{' (' + names[k] + ')' if isinstance(k, int) and k < len(names) else ''}"
        f" {list(a.shape)}" for k, a in marked)
    fix = (f"pass in_dims={wanted}: hftc.per_model({name}, in_dims={wanted})"
           if len(positions) == len(marked) else "pass it by position and mark it 0 in in_dims")
    one = len(marked) == 1
    raise FusionArgumentError(
        f"hftc.per_model({name}): {said} {'is a fused output' if one else 'are fused outputs'}"
        f" of the {n} models, but in_dims {tuple(dims)} shares {'it' if one else 'them'} "
        f"with every model (an argument past in_dims' end or passed by keyword is shared), "
        f"so each model's loss would read all {n} models' values{user_line()}; {fix}. "
        f"A target shared on purpose is passed as a "
        f"copy (t.clone())")


def check_loss_reduction(losses: Tensor) -> None:
    """On the first backward through ``hftc.per_model``'s ``[N]`` losses made at a user's
    line: a gradient of exactly ``1/N`` for each is ``losses.mean()``, which divides
    each model's gradient by N; warned (once per line) saying to take ``.sum()``."""
    if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] < 2 \
            or not losses.requires_grad or torch.compiler.is_compiling() \
            or torch._C._functorch.peek_interpreter_stack() is not None:
        return
    frame = sys._getframe(user_stacklevel() - 1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site in _CHECKED_LOSS_LINES:
        return
    if losses.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    n = losses.shape[0]
    module = frame.f_globals.get("__name__", "")

    def hook(grad: Tensor) -> None:
        if site in _CHECKED_LOSS_LINES:
            return
        _CHECKED_LOSS_LINES.add(site)
        if grad.dim() == 1 and torch.allclose(grad * n, torch.ones_like(grad), rtol=1e-5,
                                              atol=0.0):
            code = linecache.getline(site[0], site[1]).strip()
            warnings.warn_explicit(
                f"the gradient reaching the {n} per-model losses of hftc.per_model"
                f"{f' (`{code}`)' if code else ''} is 1/{n} for each model: their .mean() "
                f"divides each model's gradient by {n} (with SGD: a learning rate {n} times "
                f"smaller, with Adam a different epsilon). Take losses.sum().backward(): "
                f"each model's loss is its own, the sum gives each model exactly the "
                f"gradient it gets alone.", UsageWarning, site[0], site[1], module)

    losses.register_hook(hook)


#: A mark on ``hftc.per_model``'s results (a plain attribute, as fused outputs carry
#: theirs: :data:`~hftc.module.usage.OUTPUT_MARK`): their number of models.
LOSSES_MARK = "_hftc_per_model_losses"


def mark_per_model_losses(losses: Tensor) -> None:
    """Mark ``hftc.per_model``'s result, so that a ``.backward()`` on it unreduced is
    explained (:func:`backward_naming_the_sum`)."""
    if isinstance(losses, Tensor) and losses.dim() >= 1 \
            and not torch.compiler.is_compiling():  # (a traced value: no attribute to keep)
        setattr(losses, LOSSES_MARK, losses.shape[0])
        if losses.grad_fn is not None:  # (found behind `(losses / k).backward()`)
            losses.grad_fn.metadata[LOSSES_MARK] = losses.shape[0]


def _losses_behind(tensor: Tensor, limit: int = 64) -> int | None:
    """N where ``tensor`` was made from ``hftc.per_model``'s N losses by a few ops
    (``losses / accumulation_steps``, ``scaler.scale(losses)``, ``w * losses``): the
    mark on their autograd node, looked for among the ``limit`` nodes nearest."""
    todo, seen = [tensor.grad_fn], 0
    while todo and seen < limit:
        node = todo.pop(0)
        if node is None:
            continue
        seen += 1
        n = node.metadata.get(LOSSES_MARK)
        if n is not None:
            return n
        todo.extend(next_node for next_node, _ in node.next_functions)
    return None


def _fused_output_behind(node: Any, limit: int = 1024) -> int | None:
    """N where the autograd node ``node`` leads back, within ``limit`` nodes, to a fused
    output of N models before any ``hftc.per_model`` result (None there, or where none)."""
    todo, seen = [node], 0
    while todo and seen < limit:
        current = todo.pop(0)
        if current is None:
            continue
        seen += 1
        if LOSSES_MARK in current.metadata:
            return None
        if current.metadata.get(OUTPUT_MARK) is not None:
            return current.metadata[OUTPUT_MARK]
        todo.extend(next_node for next_node, _ in current.next_functions)
    return None


def _explain_own_losses(first: Tensor, exc: RuntimeError) -> None:
    """The models' losses taken by the user from a fused output (``[loss_fn(o, y) for o in
    out]``) where torch refuses their backward: stacked and not reduced, or one by one
    (the second backward through the one fused forward): a FusionArgumentError naming
    the sum.  Nothing for other tensors (torch's error stands)."""
    n = _fused_output_behind(first.grad_fn) if first.grad_fn is not None else None
    if n is None:
        return
    if "implicitly created only for scalar outputs" in str(exc) and first.dim() == 1 \
            and first.shape[0] == n:
        done = (f"backward() from {n} values [{n}] made from a fused output of {n} models"
                f"{user_line()}, not one number")
    elif "backward through the graph a second time" in str(exc):
        done = (f"a second backward() through the forward of a fused module of {n} models"
                f"{user_line()} (one loss per model, each its own backward?): the {n} "
                f"models ran as one fused forward, whose graph the first backward freed")
    else:
        return
    raise FusionArgumentError(
        f"{done}. Take the sum of the models' losses and one backward: "
        f"torch.stack(losses).sum().backward(), or hftc.per_model(F.cross_entropy)(out, "
        f"y).sum().backward() (the sum gives each model exactly the gradient it gets "
        f"alone)") from exc


#: The user's lines whose backward from a mean of N values was looked at (once a line).
_WARNED_MEAN_LINES: set[tuple[str, int]] = set()


def _check_mean_of_model_losses(loss: Tensor, limit: int = 1024) -> None:
    """A backward from ``torch.stack([loss_fn(o, y) for o in out]).mean()`` (each model's
    loss made by the user, from a fused output of N models): the mean divides each
    model's gradient by N, as ``hftc.per_model(...)(out, y).mean()`` does (which
    :func:`check_loss_reduction` finds by its gradient); warned once per line."""
    node = loss.grad_fn
    if loss.dim() != 0 or node is None or not FUSED_MODULES or node.name() != "MeanBackward0" \
            or torch.compiler.is_compiling():
        return
    sizes = getattr(node, "_saved_self_sym_sizes", ())
    if len(sizes) != 1 or int(sizes[0]) < 2:
        return
    frame = sys._getframe(user_stacklevel() - 1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site in _WARNED_MEAN_LINES:  # (a line is looked at once: the walk costs)
        return
    _WARNED_MEAN_LINES.add(site)
    n = int(sizes[0])
    if _fused_output_behind(node, limit) != n:  # (None too: hftc.per_model's warns itself)
        return
    warnings.warn(
        f"backward() from the mean of {n} values made from a fused output of {n} models"
        f"{user_line()}: if they are the models' losses, the mean divides each model's "
        f"gradient by {n} (with SGD: a learning rate {n} times smaller, with Adam a "
        f"different epsilon). Take their .sum(): each model's loss is its own, the sum "
        f"gives each model exactly the gradient it gets alone.", UsageWarning,
        stacklevel=user_stacklevel())


def backward_naming_the_sum(backward: Callable[..., None]) -> Callable[..., None]:
    """``torch.autograd.backward`` (which ``Tensor.backward`` calls) that, where torch
    refuses a backward from a tensor of more than one element without a gradient, says
    what the tensor is when it is hftc's: the N per-model losses (take ``.sum()``) or a
    fused module's output (take each model's loss first)."""

    @functools.wraps(backward)
    def checked(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> None:
        if grad_tensors is None and isinstance(tensors, Tensor):
            _check_mean_of_model_losses(tensors)
        try:
            return backward(tensors, grad_tensors, *args, **kwargs)
        except RuntimeError as exc:
            first = tensors if isinstance(tensors, Tensor) else (
                tensors[0] if isinstance(tensors, (tuple, list)) and tensors else None)
            if grad_tensors is not None or not isinstance(first, Tensor) or not FUSED_MODULES:
                raise
            if "implicitly created only for scalar outputs" not in str(exc):
                _explain_own_losses(first, exc)
                raise
            losses, outputs = getattr(first, LOSSES_MARK, None), getattr(first, OUTPUT_MARK, None)
            made = losses is None and outputs is None and first.dim() == 1
            if made:
                losses = _losses_behind(first)
            shape = list(first.shape)
            if losses is not None:
                what = (f"a tensor {shape} made from hftc.per_model's {losses} per-model "
                        f"losses (divided, weighted or scaled)" if made else
                        f"hftc.per_model's {losses} per-model losses {shape}")
                raise FusionArgumentError(
                    f"backward() from {what}"
                    f"{user_line()}, not one number: take "
                    f"{'its sum: (...).sum()' if made else 'losses.sum()'}.backward() (the "
                    f"sum gives each model exactly the gradient it gets alone; .mean() "
                    f"would divide each model's gradient by {losses})") from exc
            if outputs is not None:
                raise FusionArgumentError(
                    f"backward() from a fused module's output {shape} ({outputs} models' "
                    f"outputs stacked){user_line()}, not a loss: take each model's loss with "
                    f"hftc.per_model, then their sum: hftc.per_model(F.cross_entropy)"
                    f"(out, y).sum().backward()") from exc
            _explain_own_losses(first, exc)
            raise

    checked.__hftc_original__ = backward
    return checked


def state_dict_noting_stale_models(state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.state_dict`` that, called on a model given to hftc.fuse whose weights
    are still the ones the fused module copied while the fused module trained its own
    (:func:`hftc.module.usage.stale_source`), warns (UsageWarning) that it saves the
    weights of the fusing: take ``fused.model_state_dict(i)``. Checked at the root call
    only (torch's recursion passes a prefix), where a fused module lives."""

    @functools.wraps(state_dict)
    def checked(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = state_dict(self, *args, **kwargs)
        if not args and not kwargs.get("prefix") and FUSED_MODULES \
                and not torch.compiler.is_compiling():
            stale = stale_source(self)
            if stale is not None:
                _, position, name = stale
                warnings.warn(
                    f"{type(self).__name__}.state_dict(){user_line()}: this model was "
                    f"given to hftc.fuse, which copied its weights; the fused module has "
                    f"trained its copy since (`{name}` differs) and this model still holds "
                    f"the weights of the fusing. Save the trained ones: "
                    f"fused.model_state_dict({position}) (fused.unfuse() gives every model)",
                    UsageWarning, stacklevel=user_stacklevel())
        return out

    checked.__hftc_original__ = state_dict
    return checked


def load_state_dict_naming_model_state_dict(load: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.load_state_dict`` that, where torch refuses a state dict whose every
    mismatched tensor is this module's shape with one leading dim more (the same N for
    all: a fused module's, N models stacked), says to take one model's:
    ``fused.model_state_dict(i)``.  Torch's own error otherwise; a fused module's own
    ``load_state_dict`` says the converse (one model's into the fused module)."""

    @functools.wraps(load)
    def checked(self: nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        # torch.load of a torch.save(fused) gives the module itself, not a state dict
        if isinstance(state_dict, nn.Module) and state_dict in FUSED_MODULES:
            n = state_dict.num_models
            fix = ("fused.load_state_dict(loaded.state_dict())" if self in FUSED_MODULES
                   else "model.load_state_dict(loaded.model_state_dict(i)) for model i "
                        "(loaded.unfuse() gives every model)")
            raise FusionTypeError(
                f"{type(self).__name__}.load_state_dict{user_line()} got a fused module of "
                f"{n} models (what torch.load gives of a torch.save(fused)), not a state "
                f"dict. Load from it: {fix}; or save fused.state_dict() (or "
                f"fused.model_state_dict(i) for one model) instead")
        try:
            return load(self, state_dict, *args, **kwargs)
        except RuntimeError as exc:
            if self in FUSED_MODULES or "size mismatch" not in str(exc):
                raise
            own = self.state_dict()
            given = {k: v for k, v in dict(state_dict).items()
                     if k in own and isinstance(v, Tensor) and v.shape != own[k].shape}
            counts = {v.shape[0] if v.dim() == own[k].dim() + 1
                      and v.shape[1:] == own[k].shape else None for k, v in given.items()}
            if not given or len(counts) != 1 or None in counts:
                raise
            key = next(iter(given))
            n = counts.pop()
            raise FusionArgumentError(
                f"{type(self).__name__}.load_state_dict{user_line()} got a fused module's "
                f"state dict (`{key}` is {list(given[key].shape)}, this module's "
                f"{list(own[key].shape)}: {n} models' tensors stacked). Load one model's: "
                f"model.load_state_dict(fused.model_state_dict(i)) for model i, or from a "
                f"saved fused state dict sd: {{k: v[i] for k, v in sd.items()}}; "
                f"fused.unfuse() gives every model at once") from exc

    checked.__hftc_original__ = load
    return checked


def optimizer_load_naming_unfuse_optimizers(load: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.optim.Optimizer.load_state_dict`` that, given a fused optimizer's state
    dict (its ``"hftc"`` entry: N models' param groups and stacked state) on a stock
    optimizer of one model, where torch said only "loaded state dict has a different
    number of parameter groups" (or loaded the stacked state into one model's), names
    ``hftc.optim.unfuse_optimizers``, which gives model i's."""

    @functools.wraps(load)
    def checked(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        fused = isinstance(state_dict, dict) and isinstance(state_dict.get("hftc"), dict)
        # (hftc's optimizers and a user's subclass of one load it: a class of hftc's above)
        if fused and not any(c.__module__.startswith("hftc.") for c in type(self).__mro__):
            n = len(state_dict.get("param_groups", ()))
            raise FusionArgumentError(
                f"{type(self).__name__}.load_state_dict{user_line()} got a fused optimizer's "
                f"state dict ({n} models' param groups, each state tensor [N, ...] "
                f"stacked): load one model's. Save model i's from the fused run with "
                f"hftc.optim.unfuse_optimizers(fused, opt, models)[i].state_dict() (stock "
                f"optimizers over `models`, default fused.unfuse()), or load this one into "
                f"a fused optimizer of the same N models")
        return load(self, state_dict, *args, **kwargs)

    checked.__hftc_original__ = load
    return checked


# --------------------------------------------------------------------------- fused optimizer steps

#: optimizers that warned about skip_models and batch norm already
_WARNED_SKIPS: weakref.WeakSet[Any] = weakref.WeakSet()


def check_fused_step(optimizer: Any, params: Sequence[Tensor], skip_models: Any) -> None:
    """Before a fused optimizer's step over ``params``: the copies ``unfuse()`` gave that
    got gradients (trained on their own: the fused module does not follow), and
    ``skip_models`` by the user's code on models whose batch norm learned in this step's
    forward (it is not frozen by the skip); each warned once, saying what to do.  Flags
    given as a tensor are not read (a capturable step never reads them on the host):
    the list the user's code spells (``skip_models=[False, True]``) is."""
    if UNFUSED_COPIES:
        _check_trained_copies(params)
    if optimizer in _FUSED_FROM:
        _check_stock_changes(optimizer)
    if skip_models is None or isinstance(skip_models, Tensor) \
            or optimizer in _WARNED_SKIPS or not _called_by_user():
        return
    try:
        skipped = torch.as_tensor(skip_models).reshape(-1).to(torch.bool).nonzero()
    except (TypeError, ValueError, RuntimeError):
        return  # (the step's own check says what is wrong)
    if skipped.numel():
        _check_skipped_norms(optimizer, params, skipped.flatten().tolist())


#: fused optimizer -> the stock optimizers ``fuse_optimizers`` built it from, each with
#: its param groups' hyper-parameters then (model i's at [i])
_FUSED_FROM: weakref.WeakKeyDictionary[Any, list[tuple[Any, list[dict[str, Any]]]]] = \
    weakref.WeakKeyDictionary()


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    return [{k: v.detach().clone() if isinstance(v, Tensor) else v
             for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def note_fused_optimizers(fused_optimizer: Any, optimizers: Sequence[Any]) -> None:
    """``hftc.optim.fuse_optimizers(fused, optimizers)`` gave ``fused_optimizer``: keep
    (weakly) each stock optimizer's hyper-parameters, so that a step after a change made
    to the stock one is refused (:func:`_check_stock_changes`)."""
    _FUSED_FROM[fused_optimizer] = [(weakref.ref(opt), _hyperparameters(opt), _plain_values(opt))
                                    for opt in optimizers]


def _plain_values(optimizer: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """The first group's keys whose values are plain (numbers, flags, tuples of them) and
    those values: what :func:`_check_stock_changes` compares at C speed every step."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    keys = tuple(k for k, v in group.items() if k != "params" and (
        type(v) in _PLAIN or type(v) is tuple and all(type(x) in _PLAIN for x in v)))
    return keys, tuple(group[k] for k in keys)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    return bool(a == b)


#: hyper-parameter values :func:`_plain_values` compares with ``==`` (not tensors)
_PLAIN = (float, int, bool, str, type(None))




def _check_stock_changes(optimizer: Any) -> None:
    """A fused optimizer of ``fuse_optimizers`` about to step, where a stock optimizer it
    was built from had a hyper-parameter changed since (``StepLR(opt_i)`` built before
    fusing and stepped, ``for g in opt_i.param_groups: g['lr'] /= 4``): the fused
    optimizer copied the values once and never reads them again, so the schedule would
    silently not happen. Refused, naming model i, the value and what to step instead."""
    noted = _FUSED_FROM[optimizer]
    if len(noted) != optimizer.num_models:  # (hftc.keep_models cut it: rows moved)
        del _FUSED_FROM[optimizer]
        return
    for i, (ref, then, (keys, values)) in enumerate(noted):
        stock = ref()
        if stock is None or not stock.param_groups:
            continue
        group = stock.param_groups[0]
        if len(keys) == len(group) - 1 and tuple(map(group.get, keys)) == values:
            continue  # (the common case, every step: nothing changed, no tensor values)
        # (changed since, and not followed by the fused group: code that copies a stock
        # schedule into the fused optimizer, as the sweep engine does, is right)
        now, own = stock.param_groups[0], optimizer.param_groups[i]
        changed = [(k, v, now[k]) for k, v in then[0].items()
                   if k in now and k in own and not _same(v, now[k])
                   and not _same(own[k], now[k])]
        if changed:
            del _FUSED_FROM[optimizer]  # (once: a new scheduler on the fused one is right)
            key, old, new = changed[0]
            raise FusionArgumentError(
                f"{type(optimizer).__name__}.step{user_line()}: optimizers[{i}] given to "
                f"hftc.optim.fuse_optimizers (model {i}'s {type(stock).__name__}) had its "
                f"{key!r} changed from {old} to {new} after fusing (a scheduler built on it, "
                f"or param_groups set by hand), but the fused optimizer copied its values "
                f"once and steps with its own: model {i} would not get that schedule. Build "
                f"schedulers on the fused optimizer (torch.optim.lr_scheduler.StepLR(opt, "
                f"...), param_groups[i] is model i's) and set opt.param_groups[{i}][{key!r}]")


#: optimizers whose first step was checked by :func:`check_any_step`
_CHECKED_OPTIMIZERS: weakref.WeakSet[Any] = weakref.WeakSet()


def check_any_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch global optimizer step pre-hook: on an optimizer's first step, where its
    parameters are a live fused module's models' originals and none has a gradient
    (the fused module was trained, not the models it copied), warn (UsageWarning) that
    it steps nothing the fused module computes with."""
    # (not while dynamo traces torch.compile(opt.step): its optimizer handling would
    # rewrite the param groups this reads, and read first, the live fused modules' count
    # became a guard that recompiled the step whenever one was collected; not hftc's own
    # optimizers, which step fused modules)
    if torch.compiler.is_compiling() or not FUSED_MODULES \
            or type(optimizer).__module__.startswith("hftc.") or optimizer in _CHECKED_OPTIMIZERS:
        return
    _CHECKED_OPTIMIZERS.add(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or any(p.grad is not None for p in params):
        return
    ids = {id(p) for p in params}
    for fused in list(FUSED_MODULES):
        sources = getattr(fused, "source_parameter_names", None) or []
        if any(ids & set(names) for names in sources):
            warnings.warn(
                f"{type(optimizer).__name__} steps the parameters of the models given to "
                f"hftc.fuse, which the fused module copied: they get no gradient and the "
                f"fused module's own parameters are never stepped. Build the optimizer on "
                f"the fused module: hftc.optim.{type(optimizer).__name__}(fused."
                f"parameters(), ...) (each hyper-parameter a value or a list of N)",
                UsageWarning, stacklevel=user_stacklevel())
            return


def _check_trained_copies(params: Sequence[Tensor]) -> None:
    ids = {id(p) for p in params}
    for copy in list(UNFUSED_COPIES):
        fused, model = copy.fused(), copy.model()
        if fused is None or model is None:
            UNFUSED_COPIES.remove(copy)
            continue
        if not copy.trained_alone() or not any(id(p) in ids for p in fused.parameters()):
            continue
        UNFUSED_COPIES.remove(copy)
        warnings.warn(
            f"model {copy.model_id}'s copy that fused.unfuse() gave (at {copy.line}) has "
            f"gradients and was not stepped, but this fused optimizer steps the fused "
            f"module's own stacked parameters: a copy is a snapshot, it neither follows "
            f"the fused module nor is it followed. Train the fused module (out = "
            f"fused(x); hftc.per_model(loss)(out, y).sum().backward(); opt.step()) and "
            f"call fused.unfuse() again when you need the models; or step the copies "
            f"with optimizers of their own (hftc.optim.unfuse_optimizers gives them with "
            f"the fused one's state).", UsageWarning, stacklevel=user_stacklevel())


def _called_by_user() -> bool:
    """The step's caller is the user's code (not hftc.amp.GradScaler's skip of the models
    whose gradients overflowed, which stock's skip matches)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if not name.startswith(("torch", "hftc.optim", "hftc.lowering", __name__)):
            return not name.startswith("hftc")
        frame = frame.f_back
    return True


def _check_skipped_norms(optimizer: Any, params: Sequence[Tensor],
                         skipped: Sequence[int]) -> None:
    ids = {id(p) for p in params}
    for fused in list(FUSED_MODULES):
        if not fused.training or not any(id(p) in ids for p in fused.parameters()):
            continue
        norms = sorted({name.rpartition(".")[0] for name, _ in fused.named_buffers()
                        if name.endswith(("running_mean", "running_var"))})
        if not norms:
            continue
        _WARNED_SKIPS.add(optimizer)
        model_ids = getattr(fused, "model_ids", list(range(fused.num_models)))
        which = [model_ids[i] for i in skipped]
        warnings.warn(
            f"opt.step(skip_models=...) leaves model(s) {which}'s parameters and optimizer "
            f"state as they were, but the forward in training mode has updated their batch "
            f"norms' running statistics ({', '.join(f'`{m}`' for m in norms[:3])}"
            f"{' ...' if len(norms) > 3 else ''}): skipping a step does not freeze a model. "
            f"To stop training a model, drop it: "
            f"hftc.keep_models(fused, [positions to keep]) (its optimizers and schedulers are "
            f"cut too; hftc.EarlyStopping does it per model id), and save it first "
            f"(fused.unfuse_model(j), hftc.BestCheckpoint).", UsageWarning,
            stacklevel=user_stacklevel())
        return


__all__ = ["check_any_step", "check_fused_step", "check_loss_call", "check_loss_reduction",
           "guard_losses", "note_fused_optimizers", "optimizer_load_naming_unfuse_optimizers",
           "refusing_per_model_values", "stock_optimizer_classes", "user_line"]
