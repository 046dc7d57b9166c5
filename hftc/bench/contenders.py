"""The contenders: ways to train N models on one batch, each as a ``step()`` callable.

One *step* is what a sweep does per batch for all N models: forward, loss,
backward, optimizer step.  Every contender trains the same N models (same seed,
same initial weights, model i with learning rate ``lrs[i]``) on the same batch:

==============  ==========================================================================
serial          N stock models + N stock ``torch.optim.Adam``, one after another
concurrent      N processes at once, each one stock model + Adam (built by ``runner.py``
                from ``build_step("serial", ..., model_index=i)``)
torch.func      ``stack_module_state`` + ``functional_call`` + ``vmap(grad(loss))``, one stock
                Adam over the stacked parameters (one learning rate for all: stock
                optimizers cannot take one per model, so it gets ``lrs[0]``)
hand-fused      HFTA-style hand-written fused model and fused Adam (``handfused.py``)
hftc            ``hftc.fuse(models, autotune=True)`` + ``hftc.optim.Adam`` +
                ``hftc.per_model(loss)``
hftc+compile    the same with the forward and loss under ``torch.compile`` (inductor);
                backward through AOTAutograd's compiled graph; optimizer eager
hftc+step       the same through ``hftc.compile_step`` (its default mode: the whole step,
                optimizer included where it can be, as one CUDA graph on a GPU; the eager
                step on the CPU, with the models in order where autotune chose to run
                them one by one); bf16 via its ``autocast_dtype``
hftc+defaults   ``hftc.fuse(models)`` with no options (what a new user runs: the default
                strategy's first-call choice, no autotune) + ``hftc.optim.Adam`` +
                ``hftc.per_model(loss)``; opt-in
hftc+ckpt       hftc with activation checkpointing (``hftc.fuse(..., checkpoint=True)``:
                about sqrt(#ops) segments recomputed in backward): less memory, so a
                larger N fits (the largest-N search), at the cost of a second forward
concurrent-mps  concurrent, on a GPU, with CUDA's MPS daemon sharing the device (the
                suite starts it where it can; ``suite.py``)
==============  ==========================================================================

Every contender runs on ``device`` ("cpu" or "cuda") and in ``precision``: "fp32",
or "bf16" (AMP: fp32 weights and optimizer, forward and loss under
``torch.autocast(device, torch.bfloat16)``, as a user would turn it on).
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .workloads import WORKLOADS, Workload

CONTENDERS = ("serial", "concurrent", "concurrent-mps", "torch.func", "hand-fused", "hftc",
              "hftc+compile", "hftc+step", "hftc+ckpt", "hftc+defaults")
#: Contenders the suite runs only where asked (``--contenders``, ``--max-n``).
OPT_IN = ("hftc+ckpt", "hftc+defaults")
#: Contenders that run the N models in N processes (runner.py builds each from "serial").
MULTI_PROCESS = ("concurrent", "concurrent-mps")
PRECISIONS = ("fp32", "bf16")
#: Contenders that fuse the N models into one step (their FLOP/s efficiency is reported).
FUSED = ("torch.func", "hand-fused", "hftc", "hftc+compile", "hftc+step", "hftc+ckpt",
         "hftc+defaults")


def learning_rates(n: int, base: float = 1e-3) -> list[float]:
    """A sweep's per-model learning rates: base x 0.5, 1, 2, 4, 0.5, ..."""
    return [base * (0.5, 1.0, 2.0, 4.0)[i % 4] for i in range(n)]


def make_models(workload: Workload, n: int, seed: int = 0) -> list[nn.Module]:
    """The N models every contender starts from (model i depends only on seed and i)."""
    models = []
    for i in range(n):
        torch.manual_seed(seed * 1000 + i)
        models.append(workload.factory())
    return models


@dataclass(frozen=True)
class Setting:
    """Where and in what precision a contender trains: ``device`` and ``precision``."""

    device: str = "cpu"
    precision: str = "fp32"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward and loss run in (AMP for "bf16")."""
        if self.precision == "bf16":
            return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync(self) -> None:
        """Wait for the device (CUDA runs asynchronously: a step is timed to its end)."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@dataclass
class Step:
    """A contender ready to run: ``fn()`` performs one training step of all its models.

    ``parameters()`` returns the N models' current parameters, stacked ``[N, ...]``
    under the stock model's names (the tests compare contenders with it).
    """

    fn: Callable[[], Any]
    num_models: int
    parameters: Callable[[], dict[str, torch.Tensor]]
    info: dict[str, Any] = field(default_factory=dict)
    #: Where a step's time goes (:func:`step_phases`), for the contenders that offer it.
    phases: Callable[[], dict[str, float]] | None = None
    #: True while the step is still choosing how to run (hftc's default strategy alternates
    #: the fused program and the models one by one on its first calls): the runner warms
    #: up until it is False, so the timed rounds measure the choice, not the trial.
    choosing: Callable[[], bool] | None = None
    #: What to add to ``info`` once warm (the strategy chosen).
    settled_info: Callable[[], dict[str, Any]] | None = None


def _stacked(models: list[nn.Module]) -> Callable[[], dict[str, torch.Tensor]]:
    def parameters():
        named = [dict(m.named_parameters()) for m in models]
        return {k: torch.stack([p[k].detach() for p in named]) for k in named[0]}

    return parameters


def _named(module: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {k: p.detach() for k, p in module.named_parameters()}


def build_step(contender: str, workload: str | Workload, n: int, *, seed: int = 0,
               model_index: int | None = None, adam: str = "default",
               setting: Setting | None = None) -> Step:
    """Build contender ``contender`` for N models of ``workload``.

    ``model_index``: for one process of the concurrent contender, build only model
    ``model_index`` of the N (with its learning rate), as the serial contender would.
    ``adam``: ``"default"`` (every optimizer as constructed with its defaults: on the
    CPU stock Adam is the op-by-op loop, hftc's repeats it bit for bit) or ``"fused"``
    (``fused=True`` for stock and hftc Adam; the hand-fused reference keeps HFTA's).
    ``setting``: device and precision (default: the CPU, fp32); the workload's sizes for
    that device (``Workload.on``).
    """
    if adam not in ("default", "fused"):
        raise ValueError(f"adam must be 'default' or 'fused', got {adam!r}")
    setting = setting or Setting()
    w = WORKLOADS[workload] if isinstance(workload, str) else workload
    w = w.on(setting.device)
    lrs = learning_rates(n)
    x, y = (t.to(setting.device) for t in w.inputs())
    models = [m.to(setting.device) for m in make_models(w, n, seed)]
    if model_index is not None:
        models, lrs = [models[model_index]], [lrs[model_index]]
    builder = _BUILDERS[contender]
    return builder(w, models, lrs, x, y, {"fused": True} if adam == "fused" else {}, setting)


def _serial(w: Workload, models, lrs, x, y, adam_kwargs, setting: Setting) -> Step:
    opts = [torch.optim.Adam(m.parameters(), lr=lr, **adam_kwargs) for m, lr in zip(models, lrs)]

    def step():
        for m, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            with setting.autocast():
                loss = w.loss(m(x), y)
            loss.backward()
            opt.step()

    return Step(step, len(models), _stacked(models))


def _torch_func(w: Workload, models, lrs, x, y, adam_kwargs, setting: Setting) -> Step:
    from torch.func import functional_call, grad, stack_module_state, vmap

    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def loss_of(p, b, xi, yi):
        return w.loss(functional_call(base, (p, b), (xi,)), yi)

    grads_of = vmap(grad(loss_of), in_dims=(0, 0, None, None), randomness="different")
    opt = torch.optim.Adam(params.values(), lr=lrs[0], **adam_kwargs)

    def step():
        opt.zero_grad(set_to_none=True)
        with setting.autocast():
            grads = grads_of(params, buffers, x, y)
        for name, p in params.items():
            p.grad = grads[name]
        opt.step()

    return Step(step, len(models), lambda: {k: p.detach() for k, p in params.items()},
                {"note": "one learning rate for all models"})


def _hand_fused(w: Workload, models, lrs, x, y, adam_kwargs, setting: Setting) -> Step:
    from .handfused import HandFusedAdam, hand_fuse, hand_fused_loss

    fused = hand_fuse(w.name, models)
    opt = HandFusedAdam(fused.parameters(), lrs)

    def step():
        opt.zero_grad()
        with setting.autocast():
            loss = hand_fused_loss(w, fused(x), y)
        loss.backward()
        opt.step()

    return Step(step, len(models), _named(fused))


def _fuse(w: Workload, models, x, **options):
    """``hftc.fuse(models, **options)``, as every hftc contender calls it: a model that reads
    its input's sizes in Python is fused from the batch (``example_inputs``)."""
    import hftc

    example = {"example_inputs": (x,)} if w.example_inputs else {}
    return hftc.fuse(models, **options, **example)


def _hftc(w: Workload, models, lrs, x, y, adam_kwargs, setting: Setting, *,
          compile: bool = False, checkpoint: bool = False, defaults: bool = False) -> Step:
    import hftc

    # ``defaults``: no options, the call a new user writes.
    fused = _fuse(w, models, x, **({} if defaults else {"autotune": True,
                                                        "checkpoint": checkpoint}))
    opt = hftc.optim.Adam(fused.parameters(), lr=lrs, **adam_kwargs)
    per_model_loss = hftc.per_model(w.loss_fn)

    def forward_loss(x, y):
        with setting.autocast():
            return per_model_loss(_first(fused(x)), y).sum()

    fn = torch.compile(forward_loss) if compile else forward_loss

    def step():
        opt.zero_grad(set_to_none=True)
        fn(x, y).backward()
        opt.step()

    with setting.autocast():  # lowerings are timed as the step runs them
        fused.compile(x)
    report = fused.fusion_report
    info = {"fallbacks": [f"{r.node} ({r.reason})" for r in report.fallbacks],
            "lowerings": {c.node: c.chosen for c in report.lowerings}}
    from ..lowering.strategy import TIMING_CALLS

    return Step(step, len(models), _named(fused), info,
                phases=lambda: step_phases(lambda: fn(x, y), opt, setting),
                choosing=lambda: fused.plan is not None and fused.plan.reason == TIMING_CALLS,
                settled_info=lambda: {"strategy": str(fused.plan)})


def _hftc_step(w: Workload, models, lrs, x, y, adam_kwargs, setting: Setting) -> Step:
    import hftc

    # autotune: each fused op's lowering timed on these shapes (cached on disk)
    fused = _fuse(w, models, x, autotune=True)
    opt = hftc.optim.Adam(fused.parameters(), lr=lrs, **adam_kwargs)
    bf16 = torch.bfloat16 if setting.precision == "bf16" else None
    per_model_loss = hftc.per_model(w.loss_fn)
    step = hftc.compile_step(fused, lambda out, y: per_model_loss(_first(out), y), opt,
                             per_model_loss=False, autocast_dtype=bf16)
    with setting.autocast():  # lowerings are timed as the step runs them
        fused.compile(x)
    report = fused.fusion_report
    info = {"mode": step.mode, "captures_optimizer": step.captures_optimizer,
            "fallbacks": [f"{r.node} ({r.reason})" for r in report.fallbacks]}
    return Step(lambda: step(x, y), len(models), _named(fused), info)


#: Ops whose self time counts as matrix products / convolutions in :func:`step_phases`.
_GEMM_OPS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "conv", "linear")


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 to /dev/null: torch.profiler's kineto writes ``USDT:`` / ``STAGE:``
    lines there from C++ whatever its log level, between the suite's progress lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_phases(forward_loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
                setting: Setting | None = None, steps: int = 10) -> dict[str, float]:
    """Where one training step's time goes: median seconds of forward + loss, backward and
    optimizer step (zero_grad included), and (on the CPU, from ``torch.profiler``) the
    fractions of the step's self time spent in GEMMs/convolutions, in the optimizer
    step and in everything else (elementwise ops, layout copies, Python)."""
    setting = setting or Setting()
    sync = setting.sync
    times: dict[str, list[float]] = {"forward_loss_s": [], "backward_s": [], "optimizer_s": []}
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        loss = forward_loss()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(value)
    phases = {k: statistics.median(v) for k, v in times.items()}
    if torch.device(setting.device).type != "cpu":
        return phases  # the profiler's CPU self times say nothing of a GPU step
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            forward_loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    with _native_stderr_silenced():
        events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    gemm = sum(e.self_cpu_time_total for e in events
               if e.key.startswith("aten::") and any(op in e.key[6:] for op in _GEMM_OPS))
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step"))
    phases.update(gemm_fraction=gemm / total, optimizer_fraction=optimizer / total,
                  other_fraction=max(0.0, 1 - (gemm + optimizer) / total))
    return phases


_BUILDERS: dict[str, Callable[..., Step]] = {
    "serial": _serial,
    "torch.func": _torch_func,
    "hand-fused": _hand_fused,
    "hftc": _hftc,
    "hftc+compile": lambda *a: _hftc(*a, compile=True),
    "hftc+step": _hftc_step,
    "hftc+ckpt": lambda *a: _hftc(*a, checkpoint=True),
    "hftc+defaults": lambda *a: _hftc(*a, defaults=True),
}
