"""The first-call check: each compiled program against the models' own forward.

Tracing runs a model's forward on proxies, not tensors.  Python that inspects a value
instead of computing with it can then take another branch than it takes on tensors,
and fx records only what the proxies compute, so the branch leaves no trace::

    def forward(self, x, mask=None):
        y = self.fc(x)
        if isinstance(mask, torch.Tensor):   # a Proxy is no Tensor: False while tracing
            y = y * mask                      # never in the graph: no model masks
        return y

The fused program would compute something else than the models, and say nothing.
So when a program is compiled (the first call per mode and input signature),
:func:`compare_with_models` runs it once and models 0, N // 2 and N-1 on their own (unfused
copies with their current weights and buffers), on the same inputs, and compares the
outputs::

    fused program(x)[0]   vs   model 0's forward(x)       relative difference in norm
    fused program(x)[N//2] vs  model N//2's forward(x)    <= 1e-3 (fp32), 1e-6 (fp64)
    fused program(x)[N-1] vs   model N-1's forward(x)

Random numbers are made equal for both (:class:`ConstantRandomness`): dropout keeps
every element, ``rand`` is 0, ``randn`` 0 ..., so a training-mode program with
dropout is compared by value too.  Nothing the check runs is kept: buffers and the
RNG are restored (``preserved_state``) and the copies are dropped.  Where the outputs
differ, the fused module runs the N models one by one instead
(:mod:`.runtime.one_by_one`) and warns (:class:`~hftc.errors.FusionWarning`), saying
where the outputs part (:func:`locate_difference`: the first leaf module whose output
differs, or forward's own code between modules).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .. import ir
from ..errors import plain_message
from ..frontends.symbolic import record_values, source_line, trace_with_leaves
from ..passes.padded import PaddedModule
from .runtime.one_by_one import call_model

aten = torch.ops.aten


# --------------------------------------------------------------------------- randomness


def _probability_fill(out: Tensor, p: Any) -> Tensor:
    """A Bernoulli draw made constant: ``u < p`` for a uniform ``u`` of 0, so 1 wherever
    the probability is not 0."""
    if isinstance(p, Tensor):
        return out.copy_(torch.broadcast_to(p > 0, out.shape))
    return out.fill_(1.0 if p > 0 else 0.0)


def _mean_fill(out: Tensor, mean: Any) -> Tensor:
    if isinstance(mean, Tensor):
        return out.copy_(torch.broadcast_to(mean, out.shape))
    return out.fill_(mean)


def _dropout(args: tuple, kwargs: dict, out: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    x, p = args[0], args[1]
    result, mask = out
    mask.fill_(True)
    return result.copy_(x * (1.0 / (1.0 - p)) if p < 1 else torch.zeros_like(x)), mask


#: ATen's alpha dropout constant (``_dropout_impl``).
_ALPHA = 1.7580993408473766


def _whole_dropout(alpha: bool) -> Callable[[tuple, dict, Any], Any]:
    """``aten.dropout`` and its kin, which reach the mode whole (not as ``bernoulli_`` and
    a product) under ``inference_mode``: every element kept, as ATen computes it then."""
    def constant(args: tuple, kwargs: dict, out: Tensor) -> Tensor:
        x, p, train = args[0], args[1], _arg(args, kwargs, 2, "train", True)
        if not train or p == 0:
            return out
        if p >= 1:
            return out.copy_(x * 0)
        if not alpha:
            return out.copy_(x * (1.0 / (1.0 - p)))
        a = 1.0 / ((_ALPHA * _ALPHA * p + 1) * (1 - p)) ** 0.5
        return out.copy_(x * a + _ALPHA * a * p)
    return constant


def _range_constant(args: tuple) -> int:
    """``random_``'s constant draw: 0 where its range ``[from, to)`` holds 0 (``random_()``,
    ``random_(to)``, the full-range ``random_(-2**63, None)``), else ``from``."""
    if len(args) < 3:
        return 0
    low, high = args[1], args[2]
    return 0 if low <= 0 and (high is None or high > 0) else low


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


#: For each random op: its result made a constant that does not depend on the shape of
#: the draw (the fused program draws for N models at once, each model for itself):
#: ``(args, kwargs, result) -> result``.  Every uniform draw is its lowest value (0 for
#: ``rand``, ``from`` for ``uniform_``, ``low`` for ``randint`` and ``random_``; 0 for a
#: ``random_`` whose range holds it, as the full-range int64 draws of random bits do:
#: their lowest value as bits), so the ways of drawing a keep mask agree:
#: ``bernoulli_(keep)`` (ATen's dropout), ``31-bit draw < keep * 2**31`` (hftc's,
#: :func:`~hftc.lowering.runtime.random.bernoulli_mask`) and ``rand() < keep`` all keep
#: every element.
_CONSTANT_DRAWS: dict[Any, Callable[[tuple, dict, Any], Any]] = {
    aten.native_dropout: _dropout,
    aten.dropout: _whole_dropout(alpha=False),
    aten.feature_dropout: _whole_dropout(alpha=False),
    aten.alpha_dropout: _whole_dropout(alpha=True),
    aten.feature_alpha_dropout: _whole_dropout(alpha=True),
    aten.bernoulli: lambda a, k, out: _probability_fill(out, _arg(a, k, 1, "p", a[0])),
    aten.bernoulli_: lambda a, k, out: _probability_fill(out, _arg(a, k, 1, "p", 0.5)),
    aten.rand: lambda a, k, out: out.fill_(0.0),
    aten.rand_like: lambda a, k, out: out.fill_(0.0),
    aten.uniform: lambda a, k, out: out.fill_(_arg(a, k, 1, "from", 0.0)),
    aten.uniform_: lambda a, k, out: out.fill_(_arg(a, k, 1, "from", 0.0)),
    aten.randn: lambda a, k, out: out.fill_(0.0),
    aten.randn_like: lambda a, k, out: out.fill_(0.0),
    aten.normal_: lambda a, k, out: out.fill_(_arg(a, k, 1, "mean", 0.0)),
    aten.normal: lambda a, k, out: _mean_fill(out, _arg(a, k, 0, "mean", 0.0)),
    aten.randint: lambda a, k, out: out.fill_(a[0] if len(a) > 2 else 0),
    aten.randint_like: lambda a, k, out: out.fill_(a[1] if len(a) > 2 else 0),
    aten.random_: lambda a, k, out: out.fill_(_range_constant(a)),
    aten.randperm: lambda a, k, out: out.copy_(torch.arange(out.numel(), dtype=out.dtype,
                                                            device=out.device)),
    aten.exponential_: lambda a, k, out: out.fill_(1.0 / _arg(a, k, 1, "lambd", 1.0)),
}


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class ConstantRandomness(TorchDispatchMode):
    """Replaces the draws of the common random ops (dropout, ``bernoulli``, ``rand``,
    ``randn``, ``normal_``, ``uniform_``, ``randint``, ``randperm`` ...) by constants
    that do not depend on how many numbers are drawn at once (``_CONSTANT_DRAWS``)::

        model i alone:   F.dropout(x_i, 0.1)        -> x_i / 0.9   (every element kept)
        fused program:   dropout of [N, B, ...]     -> x / 0.9     (the same, per model)

    The generator does not advance; an op that draws otherwise (``rrelu`` in training,
    a recurrent layer's dropout) does, and :func:`compare_with_models` then compares
    shapes only."""

    #: Whether an op computed in bfloat16 or float16 (an autocast region in forward): the
    #: outputs are then compared at that precision's tolerance.
    low_precision = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        constant = _CONSTANT_DRAWS.get(func.overloadpacket)
        if constant is None:
            out = func(*args, **kwargs)
            if not self.low_precision:
                self.low_precision = any(
                    isinstance(t, Tensor) and t.dtype in _LOW_PRECISION
                    for t in (out if isinstance(out, (tuple, list)) else (out,)))
            return out
        if func.overloadpacket is aten.native_dropout and _arg(args, kwargs, 2, "train",
                                                                 None) is False:
            return func(*args, **kwargs)  # train=None is training, as in ATen
        with _rng_kept():
            out = func(*args, **kwargs)
        return constant(args, kwargs, out)


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _rng_states() -> list[Tensor]:
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


# ------------------------------------------------------------------ runs the caller does not see


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Leave ``module``'s buffers and the RNG as they were: tuning runs the model's ops
    (batch norm updates its running statistics, dropout draws numbers), and what a
    user's model computes must not depend on whether it was tuned."""
    saved = [(b, b.clone()) for b in module.buffers()]
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            # Through .data: a running statistic an earlier call's batch norm saved for
            # backward keeps its version (ATen's own update does not bump it either).
            for buffer, value in saved:
                buffer.data.copy_(value)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def input_copies(values: Sequence[Any]) -> list[Any]:
    """The inputs' tensors copied (one copy per tensor, however often it is passed), for
    runs the caller does not see (tuning, the first-call check): a forward that writes
    into its input (``x.mul_(2)``) must write into the caller's once, in the call."""
    memo: dict[int, Tensor] = {}

    def copy(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
        return memo[id(t)]

    return [pytree.tree_map(copy, v) for v in values]


# --------------------------------------------------------------------------- comparing

# The comparison tolerances, all three here: the fused program's outputs against the
# models' (:func:`tolerance`), and autotune's candidates against the default lowering
# (:func:`lowering_tolerance`) and the fused program's gradients (:func:`gradient_tolerance`).


def _tf32(t: Tensor) -> bool:
    """TF32 (cuDNN's default for float32 convolutions on a GPU) rounds products' inputs to
    10 mantissa bits: a grouped conv and N separate ones then differ at ~1e-3."""
    return t.is_cuda and (torch.backends.cuda.matmul.allow_tf32
                          or torch.backends.cudnn.allow_tf32)


def _autocast() -> bool:
    """Under ``torch.autocast``: float32 tensors (a parameter's gradient, an output cast
    back) were computed in bfloat16 or float16 on the way."""
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


def tolerance(t: Tensor, low_precision: bool = False) -> float:
    """How far (relative, in norm) a fused program's output may be from a model's own;
    ``low_precision``: some op on the way computed in bfloat16 or float16."""
    if low_precision or t.dtype in _LOW_PRECISION or _autocast():
        return 5e-2
    if t.dtype == torch.float64 or t.dtype == torch.complex128:
        return 1e-6
    if _tf32(t):
        return 1e-2
    return 1e-3


def lowering_tolerance(t: Tensor) -> float:
    """How far (element by element, relative to the largest) two lowerings of one op may
    differ on ``t``'s dtype and device (autotune rejects a candidate further off)."""
    if t.dtype == torch.float64:
        return 1e-9
    if t.dtype == torch.float32 and not _autocast():
        return 1e-2 if _tf32(t) else 1e-4
    return 2e-2


def gradient_tolerance(t: Tensor) -> float:
    """How far (relative, in norm) a whole forward's parameter gradients may be from the
    fused program's on ``t``'s dtype and device (autotune's whole-program candidates)."""
    if t.dtype == torch.float64:
        return 1e-7
    if t.dtype == torch.float32 and not _tf32(t) and not _autocast():
        return 1e-2
    return 5e-2


def _non_finite_difference(got: Tensor, want: Tensor, finite: Tensor, got_finite: Tensor,
                           where: str) -> str | None:
    """How ``got`` and ``want`` (one model's output) differ in their NaN and infinite
    elements (``finite``, ``got_finite``: their masks), in words; None: they agree."""
    if (~got_finite & finite).any():
        return f"{where} has NaN or infinite elements where the model's own forward does not"
    if (got_finite & ~finite).any():
        return (f"{where} is finite where the model's own forward has NaN or infinite "
                f"elements")
    if not torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()):
        return f"{where} has other NaN or infinite values than the model's own forward"
    return None


def _tensor_difference(got: Tensor, want: Tensor, where: str, shapes_only: bool,
                       errors: list[float], low_precision: bool) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{where} is {got.dtype} of shape {list(got.shape)} where the model's own "
                f"forward gives {want.dtype} of shape {list(want.shape)}")
    if shapes_only or want.numel() == 0:
        return None
    got, want = got.detach(), want.detach()
    if not (want.is_floating_point() or want.is_complex()):
        # Integers (an argmax, a count): a rounding may flip a near tie, no more.
        differ = (got != want).sum().item()
        if differ <= 0.01 * want.numel():
            return None
        return f"{where} differs in {differ} of its {want.numel()} elements"
    limit = tolerance(want, low_precision)
    finite = torch.isfinite(want)
    got_finite = torch.isfinite(got)
    if finite.all() and got_finite.all():
        # (the common case: nothing NaN or infinite on either side, where the checks below
        # find nothing and the masks keep every element, in order)
        got, want = got.reshape(-1), want.reshape(-1)
    else:
        problem = _non_finite_difference(got, want, finite, got_finite, where)
        if problem:
            return problem
        got, want = got[finite], want[finite]
    wide = torch.complex128 if want.is_complex() else torch.float64
    got, want = got.to(wide), want.to(wide)
    diff = (got - want).norm().item()
    scale = max(got.norm().item(), want.norm().item())
    # An absolute floor, for outputs that are zero but for rounding (``h - h.mean(0)``
    # summed), where each side's noise is all of its norm; far below any wrong program's.
    floor = limit * 1e-3 * math.sqrt(want.numel())
    errors.append(diff / scale if scale else 0.0)
    if diff <= limit * scale or diff <= floor:
        return None
    return (f"{where} differs from the model's own forward by {diff / scale:.3g} "
            f"(relative, in norm; {limit:g} allowed)")


def output_difference(got: Any, want: Any, where: str = "output", shapes_only: bool = False,
                      errors: list[float] | None = None,
                      low_precision: bool = False) -> str | None:
    """What differs between one model's slice of the fused output and its own output
    (``None``: nothing beyond rounding).  Tuples, lists, dicts (a ``ModelOutput``),
    dataclasses and tensors are compared leaf by leaf; other values with ``==``.
    ``errors``: gets each floating leaf's relative difference in norm; ``low_precision``:
    compare at bfloat16's tolerance (:func:`tolerance`)."""
    errors = [] if errors is None else errors
    if isinstance(want, Tensor):
        if not isinstance(got, Tensor):
            return f"{where} is a {type(got).__name__} where the model gives a tensor"
        return _tensor_difference(got, want, where, shapes_only, errors, low_precision)
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            keys = list(got) if isinstance(got, dict) else type(got).__name__
            return f"{where} has keys {keys} where the model's has {list(want)}"
        for key in want:
            problem = output_difference(got[key], want[key], f"{where}[{key!r}]", shapes_only,
                                        errors, low_precision)
            if problem:
                return problem
        return None
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"{where} is {type(got).__name__} where the model's is a " \
                   f"{type(want).__name__} of {len(want)}"
        for k, (a, b) in enumerate(zip(got, want)):
            problem = output_difference(a, b, f"{where}[{k}]", shapes_only, errors, low_precision)
            if problem:
                return problem
        return None
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        if type(got) is not type(want):
            return f"{where} is a {type(got).__name__} where the model's is a " \
                   f"{type(want).__name__}"
        for f in dataclasses.fields(want):
            problem = output_difference(getattr(got, f.name), getattr(want, f.name),
                                        f"{where}.{f.name}", shapes_only, errors, low_precision)
            if problem:
                return problem
        return None
    try:
        same = bool(got == want)
    except Exception:  # noqa: BLE001 - a value without a plain == (compare types then)
        same = type(got) is type(want)
    return None if same else f"{where} is {got!r} where the model's own forward gives {want!r}"


def model_slice(out: Any, index: int) -> Any:
    """Model ``index``'s part of a fused output: each tensor leaf's row ``index`` (dicts,
    ``ModelOutput`` included, as plain dicts: :func:`output_difference` compares keys)."""
    if isinstance(out, Tensor):
        return out[index]
    if isinstance(out, dict):
        return {k: model_slice(v, index) for k, v in out.items()}
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple
        return type(out)(*(model_slice(v, index) for v in out))
    if isinstance(out, (tuple, list)):
        return type(out)(model_slice(v, index) for v in out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: model_slice(getattr(out, f.name), index)
                                           for f in dataclasses.fields(out) if f.init})
    return out


# --------------------------------------------------------------------------- the check


@dataclasses.dataclass
class CheckResult:
    """What the first-call check compared and found (``FusionReport.check``)."""

    #: The models compared (0, N // 2, N-1 and each whose Python state differs from 0's).
    models: tuple[int, ...]
    #: ``None``: the outputs agree; else what differs, for the warning and the report.
    difference: str | None = None
    #: The check could not run (the model's own forward raised on these inputs ...).
    skipped: str | None = None
    #: What the fused program raised where it did (``skipped`` says so)
    raised: BaseException | None = None
    #: A random op the constants do not cover ran: only shapes and dtypes were compared.
    shapes_only: bool = False
    #: Model ``failed_model``'s copy raised inside its own forward (``difference`` says).
    copy_raised: bool = False
    #: The largest relative difference (in norm) of a floating output compared.
    largest: float = 0.0
    #: The model whose outputs differed (with ``difference``).
    failed_model: int = 0
    #: In bfloat16/float16, an output beyond the tolerance was found no farther from a
    #: float64 run than the model's own forward is (:func:`_within_own_rounding`).
    within_rounding: bool = False
    #: Found before :func:`hftc.keep_models` cut the fused module to these models (the
    #: same program at fewer models), and kept: not run again.
    before_cut: bool = False

    @property
    def passed(self) -> bool:
        return self.difference is None

    def kept(self, keep: Sequence[int]) -> CheckResult | None:
        """This result for the models ``keep`` (old positions, in their new order) once a
        cut leaves only them, or None where it is not to be kept: only a check that ran
        and passed carries over (the kept models ran this program on its word already)."""
        if not self.passed or self.skipped or self.raised is not None:
            return None
        position = {old: new for new, old in enumerate(keep)}
        return dataclasses.replace(
            self, models=tuple(sorted(position[i] for i in self.models if i in position)),
            before_cut=True)

    def __str__(self) -> str:
        numbers = [str(i) for i in self.models]
        models = ("model " if len(numbers) == 1 else "models ") + (
            numbers[0] if len(numbers) == 1 else ", ".join(numbers[:-1]) + " and " + numbers[-1])
        if self.before_cut and not numbers:
            models = "models the cut took out"
        # (a kept check names the models by their positions after the cut)
        cut = " (before hftc.keep_models cut the module)" if self.before_cut else ""
        if self.skipped:
            return f"not checked against the models' own forward: {self.skipped}"
        if self.difference:
            return f"FAILED: {self.difference}; the models run one by one"
        if self.shapes_only:
            return (f"checked against {models}'s own forward{cut}: shapes and dtypes agree "
                    f"(the program draws random numbers)")
        rounding = (", as close to a float64 run as the models' own low-precision forward"
                    if self.within_rounding else "")
        return (f"checked against {models}'s own forward{cut}: values agree (largest "
                f"difference {self.largest:.2g}, relative{rounding})")


class _ParametersKept(TorchDispatchMode):
    """Puts back, when it ends, the parameters an op wrote into while it was on.

    ``nn.Embedding(max_norm=...)`` renormalizes its weight's rows in place in forward:
    the check's extra run of the fused program would leave the user's first call
    another weight than the models' own first call reads (where forward reads the weight
    before the lookup), and the models' copies the check compares with would start from
    the weights the run left.  Only what is written is kept (a copy at its first
    write): a copy of every weight could be what does not fit."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr(): p for p in module.parameters()}
        self.saved: dict[int, Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for k, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(argument.name)
            if isinstance(value, Tensor):
                key = value.untyped_storage().data_ptr()
                if key in self.params and key not in self.saved:
                    self.saved[key] = self.params[key].detach().clone()
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        with torch.no_grad():
            for key, value in self.saved.items():
                self.params[key].copy_(value)
        return result


def compare_with_models(fused: nn.Module, run: Callable[[Sequence[Any]], Any],
                        values: Sequence[Any], batched: Sequence[bool]) -> CheckResult:
    """Run the fused program (``run(values)``) and models 0, N // 2, N-1 (and each whose
    Python state differs from model 0's) on their own on
    copies of ``values`` (placeholder values; ``batched``: stacked per model), compare
    (see the module docstring), and leave the fused module's buffers and the RNG as
    they were."""
    n = fused.num_models
    # The first, the last and one between: a per-model value shared by the first and the
    # last model (a sweep's grid often starts and ends alike) hides nothing then; and
    # every model whose Python state differs from model 0's (hftc.module.copies).
    picks = fused.model_copies.checked((0, n // 2, n - 1))
    if getattr(fused, "padding", None) is not None:
        picks = tuple(range(n))  # pad_widths=True: each model its own widths, each checked
    result = CheckResult(picks)
    with _rng_kept(), torch.no_grad():
        before = _rng_states()
        try:
            with preserved_state(fused):  # buffers (and the RNG) back after the run
                with ConstantRandomness() as fused_mode, _ParametersKept(fused):
                    out = _unaliased_from_buffers(run(input_copies(values)), fused)
                result.shapes_only = any(not torch.equal(a, b)
                                         for a, b in zip(before, _rng_states()))
                # What forward wrote into the buffers (running statistics, counts),
                # compared with each model's own below; padded buffers are wider than a
                # model's own.
                buffers = {} if getattr(fused, "padding", None) is not None else {
                    name: b.detach().clone() for name, b in fused.named_buffers()}
        except Exception as exc:  # noqa: BLE001 - the call itself raises it again, explained
            result.skipped, result.raised = f"the fused program raised {type(exc).__name__}", exc
            return result
        for i in picks:
            # A copy of model i with the weights and buffers the program read, one at a
            # time (two copies of a large model could be what does not fit).
            shell = fused.unfuse_model(i)
            args = [model_slice(v, i) if b else v for v, b in zip(input_copies(values), batched)]
            try:
                drawn = _rng_states()
                with ConstantRandomness() as model_mode:
                    want = call_model(shell, args, fused)
                # A draw without a constant in the model's own forward: shapes only too.
                result.shapes_only |= any(not torch.equal(a, b)
                                          for a, b in zip(drawn, _rng_states()))
            except Exception as exc:  # noqa: BLE001 - a model we cannot call like this
                if _raised_in_forward(exc, shell):
                    # the copy (what unfuse() and the models one by one run) is not the
                    # model the program was traced from: not a pass
                    where = source_line(exc)
                    where = f" at {where}" if where else ""
                    result.copy_raised = True
                    result.difference = (
                        f"model {i}'s own forward, run on its copy, raised "
                        f"{plain_message(exc)}{where}: hftc's copy of a model (the first-call "
                        f"check's, unfuse()'s, the models one by one's) holds its "
                        f"attributes, parameters and buffers, not state kept outside it "
                        f"(a dict keyed by id(self), a registry of modules); keep each "
                        f"model's values on the model (an attribute or a buffer)")
                    result.failed_model = i
                    return result
                result.skipped = f"model {i}'s own forward raised {plain_message(exc)}"
                return result
            own_buffers = dict(shell.named_buffers()) if buffers else {}
            del shell
            errors: list[float] = []
            low_precision = fused_mode.low_precision or model_mode.low_precision
            result.difference = output_difference(model_slice(out, i), want,
                                                  shapes_only=result.shapes_only,
                                                  errors=errors, low_precision=low_precision)
            if not result.difference and own_buffers:
                result.difference = output_difference(
                    {name: buffers[name][i] for name in own_buffers if name in buffers},
                    {name: b for name, b in own_buffers.items() if name in buffers},
                    "buffers after forward", shapes_only=result.shapes_only,
                    low_precision=low_precision)
            result.largest = max([result.largest, *errors])
            if result.difference and not result.shapes_only and (
                    fused_mode.low_precision or model_mode.low_precision) and \
                    _within_own_rounding(fused, i, args, model_slice(out, i), want):
                result.difference = None
                result.within_rounding = True
            if result.difference:
                result.difference = f"model {i}'s {result.difference}"
                result.failed_model = i
                break
    return result


def _unaliased_from_buffers(out: Any, module: nn.Module) -> Any:
    """``out`` with each tensor that shares storage with one of ``module``'s buffers
    copied: a forward that returns a buffer it updates (a step counter, an EMA) returns
    a view of it, which :func:`preserved_state` then sets back to the value before the
    run, and the comparison would read that instead of what the call returned."""
    storages = {b.untyped_storage().data_ptr() for b in module.buffers()}

    def kept(t: Any) -> Any:
        if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in storages:
            return t.detach().clone()
        return t

    return pytree.tree_map(kept, out)


def _raised_in_forward(exc: BaseException, model: nn.Module) -> bool:
    """Whether ``exc`` came from inside ``model``'s own forward (a lookup its copy fails),
    not from the call itself (inputs forward's signature does not take)."""
    code = getattr(type(model).forward, "__code__", None)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _within_own_rounding(fused: nn.Module, i: int, args: Sequence[Any], got: Any,
                         want: Any) -> bool:
    """Whether the fused program's outputs ``got`` for model ``i`` are, leaf by leaf, no
    farther from model i run in float64 (autocast off) than twice the model's own
    low-precision forward ``want`` is.

    An output that cancels (a few units summed into one small value) is off by percents
    in bfloat16 whichever order the sums run in: the fused program and the model's own
    forward then differ by more than :func:`tolerance` while both are rounding.  A wrong
    program is off by its whole scale.  Models whose own rounding is that large (25%)
    are not judged here.
    """
    try:
        shell = fused.unfuse_model(i).double()
        args64 = pytree.tree_map(
            lambda a: a.double() if isinstance(a, Tensor) and a.is_floating_point() else a,
            list(args))
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device, enabled=False))
            stack.enter_context(ConstantRandomness())
            exact = call_model(shell, args64, fused)
    except Exception:  # noqa: BLE001 - no float64 run: the difference stands
        return False
    got, want, exact = (pytree.tree_leaves(t) for t in (got, want, exact))
    if not len(got) == len(want) == len(exact):
        return False
    for g, w, e in zip(got, want, exact):
        if not (isinstance(w, Tensor) and w.is_floating_point()):
            if output_difference(g, w) is not None:
                return False
            continue
        if not (isinstance(g, Tensor) and isinstance(e, Tensor) and g.shape == w.shape == e.shape
                and g.dtype == w.dtype):
            return False
        g, w, e = (t.detach().double() for t in (g, w, e))
        if not (torch.isfinite(e).all() and torch.isfinite(g).all() and torch.isfinite(w).all()):
            return False
        scale = e.norm().item()
        if not scale:
            return False
        own, ours = (w - e).norm().item() / scale, (g - e).norm().item() / scale
        if own >= 0.25 or ours > max(2 * own, tolerance(w, low_precision=True)):
            return False
    return True


def locate_difference(fused: nn.Module, fused_graph: fx.Graph, model_graph: fx.Graph,
                      records: Sequence[Any], values: Sequence[Any], batched: Sequence[bool],
                      index: int, padded: nn.Module | None = None) -> str:
    """Where model ``index``'s outputs part: the first of its leaf modules (in model 0's
    traced graph, in order) whose output in the fused program differs from its output in
    the model's own forward (read with forward hooks on an unfused copy), or that its own
    forward did not run as often.  Both run on copies of ``values`` with constant
    randomness; ``records``: the fusion report's, which name each node's fused value.
    ``padded`` (model ``index`` padded to the widest, ``pad_widths=True``): each fused
    value is compared on the model's own units, the leading ones of each dim, and then
    the first op of forward's own code that parts is named (:func:`first_differing_op`).
    Best effort: a diagnosis that cannot be made is ``""``."""
    try:
        where = _locate(fused, fused_graph, model_graph, records, values, batched, index,
                        padded is not None)
    except Exception:  # noqa: BLE001 - a diagnosis must never make the error worse
        where = ""
    if padded is None:
        return where
    args = [model_slice(v, index) if b else v for v, b in zip(input_copies(values), batched)]
    op = first_differing_op(fused.unfuse_model(index), padded, args)
    return "; ".join(w for w in (where, op and f"the first op of forward's own code that "
                                 f"differs on the model's own units is {op}") if w)


def first_differing_op(original: nn.Module, padded: nn.Module, args: Sequence) -> str:
    """The first op of forward's own code whose inputs agree on ``original``'s units and
    whose output does not, in ``padded`` (the model padded to the widest): both traced
    by the one tracer with the padded modules as leaves, so that the graphs match node by
    node, and run on ``args``; named with the user's line.  ``""`` where the models do
    not trace alike, or nothing differs."""
    try:
        graph, wants = _node_values(original, args)
        padded_graph, gots = _node_values(padded, args)
    except Exception:  # noqa: BLE001 - an untraceable forward: the module-level answer
        return ""
    nodes, padded_nodes = list(graph.nodes), list(padded_graph.nodes)
    if [n.op for n in nodes] != [n.op for n in padded_nodes]:
        return ""
    to_padded = dict(zip(nodes, padded_nodes))
    for node in nodes:
        if node.op not in ("call_function", "call_method") or node.name not in wants:
            continue
        inputs_agree = all(_agree(wants[a.name], gots.get(to_padded[a].name))
                           for a in node.all_input_nodes if a.name in wants)
        if inputs_agree and not _agree(wants[node.name], gots.get(to_padded[node].name)):
            name = node.target if isinstance(node.target, str) else getattr(
                node.target, "__name__", str(node.target))
            where = ir.user_line(node)
            return f"the op `{name}` ({where})" if where else f"the op `{name}`"
    return ""


def _node_values(model: nn.Module, args: Sequence) -> tuple[fx.Graph, dict[str, object]]:
    gm = trace_with_leaves(model, lambda m: isinstance(m, PaddedModule))
    with torch.no_grad(), ConstantRandomness():
        values = record_values(gm, *args)
    return gm.graph, {n.name: v for n, v in values.items()}


def _agree(want: object, got: object) -> bool:
    """``got`` (the padded model's) equals ``want`` on the original's units."""
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)):
        return len(want) == len(got) and all(_agree(w, g) for w, g in zip(want, got))
    if not isinstance(want, Tensor) or not isinstance(got, Tensor):
        return True  # sizes and Python values: the widths differ on purpose
    if got.dim() != want.dim() or any(g < w for g, w in zip(got.shape, want.shape)):
        return False
    got = got[tuple(slice(0, w) for w in want.shape)]
    if not want.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def _real_units(got: Any, want: Any) -> Any:
    """``got`` (a padded model's value) cut to ``want``'s shape, leaf by leaf: a padded
    tensor holds the model's own units first in every dim."""
    if isinstance(got, Tensor) and isinstance(want, Tensor) and got.dim() == want.dim() \
            and all(g >= w for g, w in zip(got.shape, want.shape)):
        return got[tuple(slice(0, w) for w in want.shape)]
    if isinstance(got, (tuple, list)) and isinstance(want, (tuple, list)) \
            and len(got) == len(want):
        return type(got)(_real_units(g, w) for g, w in zip(got, want))
    return got


def _locate(fused: nn.Module, fused_graph: fx.Graph, model_graph: fx.Graph,
            records: Sequence[Any], values: Sequence[Any], batched: Sequence[bool],
            index: int, real_units: bool) -> str:
    by_node = {r.node: r for r in records if r.value}
    calls = [(n.name, str(n.target)) for n in model_graph.nodes
             if n.op == "call_module" and n.name in by_node]
    wanted = {by_node[name].value for name, _ in calls}
    fused_values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            value = super().run_node(node)
            if node.name in wanted:
                fused_values[node.name] = value
            return value

    program = fx.GraphModule(fused, fused_graph)
    fused_graph.owning_module = None
    shell = fused.unfuse_model(index)
    seen: dict[str, list[Any]] = {}
    for path, module in shell.named_modules():
        if path:
            module.register_forward_hook(
                lambda _m, _i, out, path=path: seen.setdefault(path, []).append(out))
    args = [model_slice(v, index) if b else v
            for v, b in zip(input_copies(values), batched)]
    with _rng_kept(), preserved_state(fused), torch.no_grad():
        with ConstantRandomness(), ir.modes_restored_on_error():
            Recorder(program).run(*input_copies(values))
        with ConstantRandomness():
            call_model(shell, args, fused)
    calls_so_far: dict[str, int] = {}
    for name, path in calls:
        k = calls_so_far.get(path, 0)
        calls_so_far[path] = k + 1
        record = by_node[name]
        if record.value not in fused_values:
            continue
        what = f"module `{path}` ({type(shell.get_submodule(path)).__name__})"
        outs = seen.get(path, [])
        if k >= len(outs):
            return (f"{what} ran {len(outs)} time(s) in model {index}'s own forward and more "
                    f"in the traced program")
        got = fused_values[record.value]
        got = got if record.kind == "shared" else model_slice(got, index)
        if real_units:
            got = _real_units(got, outs[k])
        problem = output_difference(got, outs[k], where=f"its output (call {k + 1})")
        if problem:
            return f"the first module whose output differs is {what}: {problem}"
    return (f"every module's output agrees with model {index}'s own forward: the "
            f"difference arises in forward's own code between modules")


__all__ = ["CheckResult", "ConstantRandomness", "compare_with_models", "first_differing_op",
           "locate_difference",
           "model_slice", "output_difference", "tolerance"]
