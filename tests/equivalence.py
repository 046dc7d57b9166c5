"""The equivalence harness: a fused module against a plain Python loop over its models.

Every equivalence test goes through :func:`check_equivalence`::

    check_equivalence([m0, m1, m2], x)                  # shared input, float64, train mode
    check_equivalence(models, xs, in_dims=0, train=False, dtype=torch.float32)

It deep-copies the models twice (the caller's are never touched), casts both
copies to ``dtype``, fuses one set with ``hftc.fuse(copies, in_dims=in_dims)``
and runs the other in a loop, then compares, for ``steps`` rounds:

1. the stacked parameters and buffers before the forward pass
   (``fused[name][i]`` against model i's ``name``, shape ``[N, *shape]``),
   and the ``state_dict`` keys;
2. every tensor leaf of the output pytree (``out_leaf[i]`` against model i's
   leaf; the tree structure must match);
3. every buffer after the forward pass (batch-norm running stats,
   ``num_batches_tracked``), in train and eval mode alike;
4. after ``backward()`` of ``sum_i loss_i``: every parameter's gradient
   (``fused[name].grad[i]`` against model i's) and every floating-point input's
   gradient;
5. with ``steps > 1``: an SGD update on both sides, then round 1 again, which
   catches a fused module that caches stale weights.

The default per-model loss is ``sum_k (leaf_k * W_ik).sum()`` with fixed random
weights ``W_ik`` drawn separately for each model i and output leaf k, so a fuser
that swaps or mixes models' gradients cannot hide behind symmetric losses.

Tolerances: a compared tensor passes when
``max|fused - reference| <= tol * max(1, max|reference|)``, with
``tol = 1e-10`` for float64, ``1e-5`` for float32 and ``1e-2`` for half types
(:data:`DEFAULT_TOL`); pass ``tol=`` to override.  Integer and bool tensors
must match exactly, and non-finite values must sit in the same places.

On failure it raises one ``AssertionError`` that lists every difference it
found: which step, which model, which output leaf / parameter / buffer, the max
abs difference, the tolerance and the reference's scale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.func import functional_call

InDims = int | None | Sequence[int | None]

DEFAULT_TOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
}

_MAX_REPORTED = 25


# --------------------------------------------------------------------------- inputs


def _as_args(inputs: Any) -> tuple:
    """A single input becomes a one-element tuple of positional arguments."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _normalize_in_dims(in_dims: InDims, nargs: int) -> tuple[int | None, ...]:
    if in_dims is None or isinstance(in_dims, int):
        return (in_dims,) * nargs
    in_dims = tuple(in_dims)
    if len(in_dims) < nargs:  # more: entries for optional inputs this call leaves out
        raise ValueError(f"in_dims has {len(in_dims)} entries but there are {nargs} inputs")
    return in_dims[:nargs]


def model_inputs(inputs: Any, in_dims: InDims, i: int) -> tuple:
    """Model i's positional arguments: shared ones as they are, stacked ones sliced at i."""
    args = _as_args(inputs)
    dims = _normalize_in_dims(in_dims, len(args))
    out = []
    for arg, dim in zip(args, dims):
        if dim is None:
            out.append(arg)
        else:
            out.append(
                pytree.tree_map(lambda t, d=dim: t.select(d, i) if torch.is_tensor(t) else t, arg)
            )
    return tuple(out)


def stack_inputs(list_of_inputs: Sequence[Any]) -> Any:
    """Stack N per-model inputs along a new leading dim, keeping their structure.

    ``stack_inputs([x0, x1])`` is ``torch.stack([x0, x1])``;
    ``stack_inputs([(a0, b0), (a1, b1)])`` is ``(stack([a0, a1]), stack([b0, b1]))``.
    """
    flats = [pytree.tree_flatten(inp) for inp in list_of_inputs]
    spec = flats[0][1]
    for k, (_, other) in enumerate(flats[1:], start=1):
        if other != spec:
            raise ValueError(f"input {k} has structure {other}, input 0 has {spec}")
    leaves = [
        torch.stack(column) if torch.is_tensor(column[0]) else column[0]
        for column in zip(*(leaves for leaves, _ in flats))
    ]
    return pytree.tree_unflatten(leaves, spec)


def reference_outputs(models: Sequence[nn.Module], inputs: Any, in_dims: InDims = None) -> list:
    """Each model's output on its own inputs: the loop that a fused module must match."""
    return [m(*model_inputs(inputs, in_dims, i)) for i, m in enumerate(models)]


def _stack_outputs(outputs: Sequence[Any]) -> Any:
    return stack_inputs(outputs)


def set_mode(model: nn.Module, train: bool) -> None:
    """Every module's ``training`` flag, as ``nn.Module.train`` sets them, without calling a
    ``train`` the model's class defines (pytorch/examples' forward-forward ``Layer`` has
    ``train(self, x_pos, x_neg)``, its training loop)."""
    for sub in model.modules():
        sub.training = train


# --------------------------------------------------------------------------- the loop fuser


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, attr = name.split(".")
    mod = root
    for part in path:
        mod = getattr(mod, part)
    return mod, attr


class LoopFused(nn.Module):
    """A reference "fused" module that honours the contract by looping over the models.

    Its parameters and buffers are the stacks of the N originals under the
    original names; ``forward`` runs a template copy of model 0 N times with
    ``torch.func.functional_call`` on slices of them, so gradients flow into the
    stacks and batch-norm running stats update in place through the slices.
    It validates the harness independently of hftc and is the fuser that the
    harness's self-tests perturb.
    """

    def __init__(self, models: Sequence[nn.Module], in_dims: InDims = None):
        super().__init__()
        template = copy.deepcopy(models[0])
        params = [dict(m.named_parameters()) for m in models]
        buffers = [dict(m.named_buffers()) for m in models]
        for name in params[0]:
            mod, attr = _owner(template, name)
            stacked = torch.stack([p[name].detach() for p in params]).clone()
            setattr(mod, attr, nn.Parameter(stacked, requires_grad=params[0][name].requires_grad))
        for name in buffers[0]:
            mod, attr = _owner(template, name)
            mod._buffers[attr] = torch.stack([b[name] for b in buffers]).clone()
        # Share the template's registries so names are the user's, without a prefix.
        self._modules = template._modules
        self._parameters = template._parameters
        self._buffers = template._buffers
        self._non_persistent_buffers_set = template._non_persistent_buffers_set
        object.__setattr__(self, "_template", template)
        self.num_models = len(models)
        self.in_dims = in_dims
        self.train(models[0].training)

    def train(self, mode: bool = True) -> LoopFused:
        super().train(mode)
        self._template.training = mode
        return self

    def forward(self, *args: Any) -> Any:
        state = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        outs = []
        for i in range(self.num_models):
            sliced = {name: t[i] for name, t in state.items()}
            outs.append(
                functional_call(self._template, sliced, model_inputs(args, self.in_dims, i))
            )
        return _stack_outputs(outs)


def loop_fuse(models: Sequence[nn.Module], in_dims: InDims = None) -> LoopFused:
    """``hftc.fuse``'s signature, implemented by :class:`LoopFused`."""
    return LoopFused(models, in_dims)


# --------------------------------------------------------------------------- comparison


def _fmt_path(path: tuple) -> str:
    return pytree.keystr(path) or "<root>"


class _Report:
    """Collects every difference, then fails once with all of them."""

    def __init__(self, tol: float, header: str):
        self.tol = tol
        self.header = header
        self.lines: list[str] = []

    def fail(self, line: str) -> None:
        self.lines.append(line)

    def compare(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """``actual`` (model i's slice of the fused tensor) against ``expected``."""
        if actual.shape != expected.shape:
            self.fail(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            return
        if actual.dtype != expected.dtype:
            self.fail(f"{what}: dtype {actual.dtype}, expected {expected.dtype}")
            return
        a = actual.detach()
        e = expected.detach()
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(a, e):
                diff = (a.double() - e.double()).abs().max().item() if a.numel() else 0.0
                self.fail(f"{what}: integer values differ, max abs diff {diff:g}")
            return
        nan = torch.isnan(e)
        inf = torch.isinf(e)
        if not torch.equal(nan, torch.isnan(a)) or not torch.equal(inf, torch.isinf(a)):
            self.fail(f"{what}: nan/inf in different places")
            return
        if not torch.equal(a[inf], e[inf]):
            self.fail(f"{what}: infinities of different sign")
            return
        finite = ~(nan | inf)
        if not finite.any():
            return
        a, e = a[finite], e[finite]
        diff = (a - e).abs().max().item()
        scale = e.abs().max().item()
        bound = self.tol * max(1.0, scale)
        if not diff <= bound:
            self.fail(
                f"{what}: max abs diff {diff:.3e} > tol {bound:.1e} (reference scale {scale:.3e})"
            )

    def raise_if_failed(self) -> None:
        if not self.lines:
            return
        shown = self.lines[:_MAX_REPORTED]
        more = len(self.lines) - len(shown)
        text = "\n  ".join(shown)
        if more:
            text += f"\n  ... and {more} more"
        raise AssertionError(f"{self.header}: {len(self.lines)} difference(s)\n  {text}")


def _default_loss_weights(outputs: Sequence[Any], seed: int) -> list[list[torch.Tensor | None]]:
    """Fixed random weights W[i][k] for model i's output leaf k (None for non-float leaves)."""
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for out in outputs:
        row = []
        for leaf in pytree.tree_leaves(out):
            if torch.is_tensor(leaf) and leaf.is_floating_point() and leaf.requires_grad:
                row.append(torch.randn(leaf.shape, generator=gen, dtype=torch.float64).to(leaf))
            else:
                row.append(None)
        weights.append(row)
    return weights


def _weighted_sum(out: Any, weights: Sequence[torch.Tensor | None]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for leaf, w in zip(pytree.tree_leaves(out), weights):
        if w is not None:
            total = total + (leaf * w).sum().double()
    return total


def _select_model(out: Any, i: int) -> Any:
    return pytree.tree_map(lambda t: t[i] if torch.is_tensor(t) else t, out)


def _prepare_inputs(inputs: Any, dtype: torch.dtype | None, requires_grad: bool) -> tuple:
    """Fresh copies of the inputs: floating ones cast to ``dtype`` and made leaves."""

    def prep(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        t = t.detach().clone()
        if t.is_floating_point():
            if dtype is not None:
                t = t.to(dtype)
            if requires_grad:
                t.requires_grad_(True)
        return t

    return pytree.tree_map(prep, _as_args(inputs))


def _copy_models(models: Sequence[nn.Module], dtype: torch.dtype | None) -> list[nn.Module]:
    copies = [copy.deepcopy(m) for m in models]
    for m in copies:
        if dtype is not None:
            m.to(dtype)
        for p in m.parameters():
            p.grad = None
    return copies


def _compare_state(
    report: _Report, step: str, fused: nn.Module, refs: Sequence[nn.Module], *, kind: str
) -> None:
    """Compare fused parameters (``kind='param'``) or buffers to each model's."""
    n = len(refs)
    if kind == "param":
        fused_state = dict(fused.named_parameters())
        ref_states = [dict(m.named_parameters()) for m in refs]
    else:
        fused_state = dict(fused.named_buffers())
        ref_states = [dict(m.named_buffers()) for m in refs]
    for name, ref0 in ref_states[0].items():
        if name not in fused_state:
            report.fail(f"{step}: {kind} {name!r} missing from the fused module")
            continue
        stacked = fused_state[name]
        if tuple(stacked.shape) != (n, *ref0.shape):
            report.fail(
                f"{step}: {kind} {name!r} has shape {tuple(stacked.shape)}, "
                f"expected {(n, *ref0.shape)}"
            )
            continue
        for i in range(n):
            report.compare(f"{step}: model {i}: {kind} {name!r}", stacked[i], ref_states[i][name])
    if kind == "param":
        extra = sorted(set(fused_state) - set(ref_states[0]))
        if extra:
            report.fail(f"{step}: fused module has parameters the models lack: {extra}")


def _compare_grads(report: _Report, step: str, fused: nn.Module, refs: Sequence[nn.Module]) -> None:
    n = len(refs)
    fused_params = dict(fused.named_parameters())
    ref_params = [dict(m.named_parameters()) for m in refs]
    for name, ref0 in ref_params[0].items():
        stacked = fused_params.get(name)
        if stacked is None or tuple(stacked.shape) != (n, *ref0.shape):
            continue  # already reported by _compare_state
        ref_grads = [ref_params[i][name].grad for i in range(n)]
        if stacked.grad is None:
            if any(g is not None for g in ref_grads):
                report.fail(f"{step}: param {name!r}: fused gradient is None, models have one")
            continue
        for i, g in enumerate(ref_grads):
            if g is None:
                g = torch.zeros_like(ref_params[i][name])
            report.compare(f"{step}: model {i}: grad of {name!r}", stacked.grad[i], g)


def _sgd_step(modules: Sequence[nn.Module], lr: float) -> None:
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
                    p.grad = None


def check_equivalence(
    models: Sequence[nn.Module],
    inputs: Any,
    *,
    in_dims: InDims = None,
    train: bool = True,
    dtype: torch.dtype | None = torch.float64,
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    check_buffers: bool = True,
    check_input_grads: bool = True,
    fused: nn.Module | None = None,
    fuser: Callable[..., nn.Module] | None = None,
    tol: float | None = None,
    steps: int = 1,
    lr: float = 1e-2,
    optimizers: tuple[Callable[[nn.Module], Any], Callable[[int, nn.Module], Any]] | None = None,
    cast_after_fuse: bool = False,
    fuse_train: bool | None = None,
    loss_seed: int = 1234,
) -> nn.Module:
    """Assert that a fused module computes exactly what a loop over ``models`` does.

    Args:
        models: the N original models (left untouched: the harness deep-copies them).
        inputs: one tensor or a tuple of positional inputs; with ``in_dims`` 0 (or a
            tuple) the stacked ones carry the model dim.
        in_dims: as in ``hftc.fuse`` / ``torch.func.vmap``.
        train: the mode both sides run in.
        dtype: models and floating inputs are cast to it (``None`` keeps them).
        loss_fn: ``loss_fn(model_i_output, i) -> scalar``; default a fixed random
            weighting of every floating output leaf, different per model.
        check_buffers: compare buffers after every forward pass.
        check_input_grads: make floating inputs require grad and compare their grads.
        fused: an already fused module to check instead of fusing (hftc is then not
            imported); it is cast to ``dtype`` and put in the mode ``train``.
        fuser: ``fuser(models, in_dims=...)``, default ``hftc.fuse``.
        tol: relative tolerance, default :data:`DEFAULT_TOL` for ``dtype``.
        steps: forward/backward rounds; between rounds an SGD step of ``lr`` on both,
            or the steps of ``optimizers``.
        optimizers: ``(fused_optimizer(fused), model_optimizer(i, model_i))``: the
            fused module's optimizer (an ``hftc.optim`` one) and model i's stock one,
            which step both sides between rounds instead of plain SGD.
        cast_after_fuse: fuse the models in their own dtype, then cast the fused
            module (``.double()`` for float64), which tests the module's ``.to``.
        fuse_train: the mode the copies are in when fused (default ``train``), to
            check that the fused module honours a later ``.train()`` / ``.eval()``.
        loss_seed: seed of the default loss weights.

    Returns:
        The fused module, after the checks.
    """
    models = list(models)
    n = len(models)
    if n == 0:
        raise ValueError("check_equivalence needs at least one model")
    refs = _copy_models(models, dtype)
    for m in refs:
        set_mode(m, train)

    if fused is None:
        to_fuse = _copy_models(models, None if cast_after_fuse else dtype)
        for m in to_fuse:
            set_mode(m, train if fuse_train is None else fuse_train)
        if fuser is None:
            import hftc

            fuser = hftc.fuse
        fused = fuser(to_fuse, in_dims=in_dims)
        if dtype is not None and cast_after_fuse:
            fused = fused.double() if dtype == torch.float64 else fused.to(dtype)
    elif dtype is not None:
        fused = fused.to(dtype)
    fused.train(train)
    for p in fused.parameters():
        p.grad = None
    if optimizers is not None:
        fused_opt = optimizers[0](fused)
        ref_opts = [optimizers[1](i, m) for i, m in enumerate(refs)]

    if tol is None:
        tol = DEFAULT_TOL.get(dtype or torch.get_default_dtype(), 1e-5)
    mode = "train" if train else "eval"
    report = _Report(tol, f"fused module != loop over {n} model(s) ({dtype}, {mode} mode)")

    if getattr(fused, "num_models", n) != n:
        report.fail(f"fused.num_models is {fused.num_models}, expected {n}")
    ref_keys = list(refs[0].state_dict().keys())
    fused_keys = list(fused.state_dict().keys())
    if sorted(ref_keys) != sorted(fused_keys):
        missing = sorted(set(ref_keys) - set(fused_keys))
        extra = sorted(set(fused_keys) - set(ref_keys))
        report.fail(f"state_dict keys differ: missing {missing}, extra {extra}")

    for step_index in range(steps):
        step = f"step {step_index}"
        _compare_state(report, f"{step} (before forward)", fused, refs, kind="param")
        if check_buffers:
            _compare_state(report, f"{step} (before forward)", fused, refs, kind="buffer")
        # Wrongly stacked state makes the forward pass meaningless (or crash); stop here.
        report.raise_if_failed()

        ref_args = _prepare_inputs(inputs, dtype, check_input_grads)
        fused_args = _prepare_inputs(inputs, dtype, check_input_grads)

        ref_outs = reference_outputs(refs, ref_args, in_dims)
        fused_out = fused(*fused_args)

        # forward
        ref_flat, ref_spec = pytree.tree_flatten_with_path(ref_outs[0])
        fused_flat, fused_spec = pytree.tree_flatten_with_path(fused_out)
        if ref_spec != fused_spec:
            report.fail(f"{step}: output structure differs: fused {fused_spec}, models {ref_spec}")
            report.raise_if_failed()
        per_model_leaves = [pytree.tree_leaves(o) for o in ref_outs]
        for k, ((path, leaf), (_, fleaf)) in enumerate(zip(ref_flat, fused_flat)):
            where = f"output {_fmt_path(path)}"
            if not torch.is_tensor(leaf):
                if fleaf != leaf:
                    report.fail(f"{step}: {where}: non-tensor value {fleaf!r}, expected {leaf!r}")
                continue
            if not torch.is_tensor(fleaf) or tuple(fleaf.shape) != (n, *leaf.shape):
                shape = tuple(fleaf.shape) if torch.is_tensor(fleaf) else type(fleaf).__name__
                report.fail(f"{step}: {where}: fused shape {shape}, expected {(n, *leaf.shape)}")
                continue
            for i in range(n):
                report.compare(f"{step}: model {i}: {where}", fleaf[i], per_model_leaves[i][k])

        if check_buffers:
            _compare_state(report, f"{step} (after forward)", fused, refs, kind="buffer")
        if report.lines:
            # Gradients of a wrong forward pass say nothing more; stop here.
            report.raise_if_failed()

        # backward
        if loss_fn is None:
            weights = _default_loss_weights(ref_outs, loss_seed + step_index)
            ref_losses = [_weighted_sum(o, w) for o, w in zip(ref_outs, weights)]
            fused_losses = [
                _weighted_sum(_select_model(fused_out, i), weights[i]) for i in range(n)
            ]
        else:
            ref_losses = [loss_fn(o, i) for i, o in enumerate(ref_outs)]
            fused_losses = [loss_fn(_select_model(fused_out, i), i) for i in range(n)]
        ref_total = sum(ref_losses)
        fused_total = sum(fused_losses)
        if not (torch.is_tensor(ref_total) and ref_total.requires_grad):
            report.raise_if_failed()
            break  # nothing to differentiate (e.g. every output is an integer tensor)
        ref_total.backward()
        fused_total.backward()

        _compare_grads(report, step, fused, refs)
        if check_input_grads:
            for k, (ra, fa) in enumerate(
                zip(pytree.tree_leaves(ref_args), pytree.tree_leaves(fused_args))
            ):
                if torch.is_tensor(ra) and ra.requires_grad:
                    if fa.grad is None and ra.grad is not None:
                        report.fail(f"{step}: input leaf {k}: fused input gradient is None")
                    elif ra.grad is not None:
                        report.compare(f"{step}: grad of input leaf {k}", fa.grad, ra.grad)
        report.raise_if_failed()

        if step_index + 1 < steps and optimizers is None:
            _sgd_step(refs, lr)
            _sgd_step([fused], lr)
        elif step_index + 1 < steps:
            for opt in [fused_opt, *ref_opts]:
                opt.step()
                opt.zero_grad()

    report.raise_if_failed()
    return fused


# --------------------------------------------------------------------------- rounding


def _loop_results(models: Sequence[nn.Module], inputs: Any, in_dims: InDims, train: bool,
                  dtype: torch.dtype, loss_seed: int) -> list[torch.Tensor]:
    """What :func:`check_equivalence` compares after one step of the loop in ``dtype``:
    output leaves, buffers, parameter gradients and input gradients, in a fixed order."""
    refs = _copy_models(models, dtype)
    for m in refs:
        set_mode(m, train)
    args = _prepare_inputs(inputs, dtype, True)
    outs = reference_outputs(refs, args, in_dims)
    weights = _default_loss_weights(outs, loss_seed)
    sum(_weighted_sum(o, w) for o, w in zip(outs, weights)).backward()
    results = [leaf for o in outs for leaf in pytree.tree_leaves(o) if torch.is_tensor(leaf)]
    for m in refs:
        results += list(m.buffers())
        results += [p.grad if p.grad is not None else torch.zeros_like(p)
                    for p in m.parameters()]
    results += [a.grad for a in pytree.tree_leaves(args) if torch.is_tensor(a) and
                a.grad is not None]
    return [r.detach() for r in results]


def loop_rounding_error(models: Sequence[nn.Module], inputs: Any, *, in_dims: InDims = None,
                        train: bool = True, dtype: torch.dtype = torch.float32,
                        loss_seed: int = 1234) -> float:
    """How far the plain loop in ``dtype`` is from the same loop in float64: the largest
    ``max|loop_dtype - loop_float64| / max(1, max|loop_float64|)`` over everything
    :func:`check_equivalence` compares (its first step, same loss), in its metric.

    A fused module computes the same values with sums in another order, so its own
    distance from float64 is of this size; a tolerance some times this one tells
    rounding from wrong results on ill-conditioned models (a layer norm over two
    features, a softmax of large scores), where the fixed float32 tolerance cannot::

        tol = max(DEFAULT_TOL[torch.float32], 30 * loop_rounding_error(models, x))
        check_equivalence(models, x, dtype=torch.float32, tol=tol)
    """
    low = _loop_results(models, inputs, in_dims, train, dtype, loss_seed)
    high = _loop_results(models, inputs, in_dims, train, torch.float64, loss_seed)
    worst = 0.0
    for a, e in zip(low, high):
        if not e.is_floating_point() or not e.numel():
            continue
        finite = torch.isfinite(e) & torch.isfinite(a)
        if not finite.any():
            continue
        diff = (a.double()[finite] - e[finite]).abs().max().item()
        worst = max(worst, diff / max(1.0, e[finite].abs().max().item()))
    return worst


class _ReluInputs(torch.overrides.TorchFunctionMode):
    """Records the smallest ``|input|`` of every ReLU called (module or functional)."""

    RELUS = (torch.relu, torch.relu_, torch.nn.functional.relu, torch.nn.functional.relu_)

    def __init__(self) -> None:
        super().__init__()
        self.smallest = float("inf")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.RELUS and args[0].numel():
            self.smallest = min(self.smallest, args[0].detach().abs().min().item())
        return func(*args, **(kwargs or {}))


def relu_margin(models: Sequence[nn.Module], inputs: Any, *, in_dims: InDims = None,
                train: bool = True) -> float:
    """The smallest distance from zero of any ReLU's input, over the models' forwards on
    ``inputs`` in float64 (``inf`` without ReLUs).

    A float32 program puts an input within its rounding of zero on either side, so a
    fused module and the loop can disagree on that ReLU's gradient, each as right as the
    other: one such element moved the zoo ResNet's stem gradients 1e-3 of their scale
    at batch 8 (an input 5e-8 from zero).  A float32 check of ReLU networks wants inputs
    whose margin is well above that rounding (about 1e-6 for O(1) activations)."""
    refs = _copy_models(models, torch.float64)
    for m in refs:
        set_mode(m, train)
    args = _prepare_inputs(inputs, torch.float64, False)
    mode = _ReluInputs()
    with torch.no_grad(), mode:
        reference_outputs(refs, args, in_dims)
    return mode.smallest


def autograd_nodes(t: torch.Tensor) -> set[str]:
    """The class names of every node of ``t``'s backward graph (which kernels ran)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {type(node).__name__ for node in seen}
