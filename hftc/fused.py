"""``hftc.fuse`` and the module it returns: the pipeline, end to end.

::

    models --frontends/--> N fx graphs (train and eval) --match.py--> node mapping
           --stacking.py--> stacked parameters under the original names (runtime/modules.py)
    first call, per input signature: compile/pipeline.py's stages
           shapes --passes/--> fused fx graph --chains, codegen--> forward(self, *inputs)
           --check--> run once beside models 0, N // 2, N-1 and each whose Python state
                      differs, alone (copies.py): the same outputs?
                      (if not: the N models one by one, with a FusionWarning)
           --strategy choice--> the fused program (strategy="auto", the default: the same
                      bits every run), or the faster as timed (strategy="timed";
                      compile/strategy.py)
           (autotune=True: --autotune, layout choice--> the fastest lowerings and layout)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from . import ir
from .compile.autotune import ProgramChoice, run_program
from .compile.check import (
    CheckResult,
    compare_with_models,
    input_copies,
    locate_difference,
    preserved_state,
)
from .compile.checkpoint import check_option as check_checkpoint_option
from .compile.pipeline import CompileOptions, Program, compile_program
from .compile.strategy import StrategyChoice, resolve_strategy
from .compile_guard import compiled_original, run_eagerly
from .copies import ModelCopies
from .errors import (
    FusionArgumentError,
    FusionError,
    FusionIndexError,
    FusionTypeError,
    FusionWarning,
    MismatchError,
    RaggedResultError,
    TraceError,
    UnsupportedOperatorError,
    plain_message,
)
from .frontends.closures import check_function_references, rebind_functions
from .frontends.symbolic import (
    OutputSpec,
    annotate_example_values,
    constant_inputs,
    is_python_constant,
    meta_copy,
    same_constant,
    source_line,
    trace_model,
    trace_models,
)
from .ir import CONSTANT_INPUTS, EXPORTED_SHAPES, PYTHON_STATE
from .match import GraphMatch, match_graphs
from .padding import WidthPadding, mask_padded_gradients, pad_models
from .padding import locate_difference as locate_padding_difference
from .padding_graph import compute_over_real_units
from .passes import FusionReport
from .passes.driver import SHARED_CONSTANT_PREFIX
from .passes.registry import aten_spellings, per_model_table
from .runtime.layout import expand_models, model_slice
from .runtime.model_loop import ModelLoop
from .runtime.modules import ContainerAccess, StackedModule, mark_stacked, register_fused
from .stacking import build_module_tree


@dataclass
class _ModeGraphs:
    """Model 0's graph for one mode, rooted at the meta template, and its matching."""

    graph: fx.Graph  # not owned by any module, so deepcopy and pickle keep it whole
    originals: list[dict[str, str]]  # per model: model 0's node name -> model i's node name
    match_method: str
    attr_targets: dict[str, str]
    #: the inputs traced as Python constants, and their values (ir.CONSTANT_INPUTS)
    constants: dict[str, Any] = field(default_factory=dict)
    #: how torch.export kept the example inputs' sizes (ir.EXPORTED_SHAPES: an
    #: ``ExportedShapes``); None for symbolic tracing
    exported_shapes: Any = None

    def graph_module(self, template: nn.Module) -> fx.GraphModule:
        """Model 0's graph rooted at the meta template, for shape propagation and fusion."""
        gm = fx.GraphModule(template, self.graph)
        self.graph.owning_module = None
        return gm


InDims = int | None | Sequence[int | None]

#: ``torch.compile``'s keyword options (what ``nn.Module.compile`` passes on).
_TORCH_COMPILE_OPTIONS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def _hook_hint(hooks: Sequence[Any]) -> str:
    """What to use instead of the hooks that torch's deprecated reparametrizations install."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for hook, name in ((WeightNorm, "weight_norm"), (SpectralNorm, "spectral_norm")):
        if any(isinstance(h, hook) for h in hooks):
            return (f", from torch.nn.utils.{name}: use torch.nn.utils.parametrizations."
                    f"{name} instead, whose module runs per model")
    return ""


def _check_initialized(models: Sequence[nn.Module]) -> None:
    """Lazy modules (``nn.LazyLinear`` ...) get their shapes on their first call, through a
    forward pre-hook: before it there are no parameters to stack."""
    from torch.nn.modules.lazy import LazyModuleMixin

    lazy = [f"model {i}, module `{path or '<root>'}` ({type(sub).__name__})"
            for i, model in enumerate(models) for path, sub in model.named_modules()
            if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params()]
    if lazy:
        raise FusionArgumentError(
            "lazy modules have no parameters yet (their shapes come from their first "
            "call): " + "; ".join(lazy) + ". Call each model once on an example input "
            "before fusing (with torch.no_grad(): model(x)), which initializes them")


def _check_hooks(models: Sequence[nn.Module]) -> None:
    """Refuse hooks: tracing would skip them, and a hook silently skipped is a wrong answer."""
    problems = []
    kinds = (("forward hook", "_forward_hooks"), ("forward pre-hook", "_forward_pre_hooks"),
             ("backward hook", "_backward_hooks"), ("backward pre-hook", "_backward_pre_hooks"))
    for i, model in enumerate(models):
        for path, sub in model.named_modules():
            for kind, attr in kinds:
                hooks = list((getattr(sub, attr, {}) or {}).values())
                if hooks:
                    problems.append(f"model {i}, module `{path or '<root>'}` "
                                    f"({type(sub).__name__}): {len(hooks)} {kind}(s)"
                                    + _hook_hint(hooks))
        # Tensor hooks on the models' parameters (gradient clamping, a per-parameter
        # gradient transform): the fused module's parameters are new stacked tensors
        # without them, so the gradients would go unchanged.
        for name, param in model.named_parameters():
            for kind, attr in (("gradient hook (Tensor.register_hook)", "_backward_hooks"),
                               ("post-accumulate-grad hook",
                                "_post_accumulate_grad_hooks")):
                hooks = list((getattr(param, attr, None) or {}).values())
                if hooks:
                    problems.append(f"model {i}, parameter `{name}`: {len(hooks)} {kind}(s)")
    module_globals = torch.nn.modules.module
    for kind, attr in (("global forward hook", "_global_forward_hooks"),
                       ("global forward pre-hook", "_global_forward_pre_hooks"),
                       ("global backward hook", "_global_backward_hooks")):
        if getattr(module_globals, attr, None):
            problems.append(f"a {kind} (torch.nn.modules.module.register_module_{attr[8:-1]})")
    if problems:
        raise UnsupportedOperatorError(
            "hooks cannot be fused: the fused module runs one fused op where each model ran "
            "its module, so a hook would be skipped or see all models at once:\n  "
            + "\n  ".join(problems)
            + "\nRemove the hooks before fusing (read activations from the fused outputs "
            "instead; register a parameter's gradient hook on the fused module's stacked "
            "parameter, fused.get_parameter(name), where it sees all N models' gradients).",
            problems,
        )


def _check_same_dtypes(models: Sequence[nn.Module]) -> None:
    """Every model's floating parameters of model 0's dtype, or a :class:`MismatchError`
    naming the first that is not."""
    def dtypes(model: nn.Module) -> dict[torch.dtype, str]:
        found: dict[torch.dtype, str] = {}
        for name, p in model.named_parameters():
            if p.is_floating_point():
                found.setdefault(p.dtype, name)
        return found

    reference = dtypes(models[0])
    for i, model in enumerate(models[1:], start=1):
        other = next(((dtype, name) for dtype, name in dtypes(model).items()
                      if dtype not in reference), None)
        if other is not None:
            theirs = ", ".join(str(d).removeprefix("torch.") for d in reference) or "none"
            raise MismatchError(
                f"model {i}'s parameter `{other[1]}` is {str(other[0]).removeprefix('torch.')}"
                f", where model 0's parameters are {theirs}. Convert "
                f"every model to one dtype with .to(dtype) before fusing (model.float(), "
                f"model.double()).")


def _check_shared_tensors(models: Sequence[nn.Module]) -> None:
    """Refuse a tensor that two models of the list hold as one (``m1.fc = m0.fc``): the
    models train it together, and the fused module, which stacks one copy per model,
    would train the copies apart, silently.  A frozen parameter (a shared pretrained
    backbone) is never trained, nor a buffer of modules in eval mode updated (batch norm
    writes its statistics in training mode only), so copies of it compute what the shared
    tensor does: those fuse.  So does one model object given
    twice (``hftc.fuse([m, m])``): N independent copies of one starting point."""
    holders: dict[int, tuple[int, str]] = {}  # id(tensor) -> (first model, its name there)
    for i, model in enumerate(models):
        tensors = [("parameter", name, t, t.requires_grad)
                   for name, t in model.named_parameters()]
        tensors += [("buffer", name, t, model.get_submodule(name.rpartition(".")[0]).training)
                    for name, t in model.named_buffers()]
        for kind, name, tensor, written in tensors:
            j, name_j = holders.setdefault(id(tensor), (i, name))
            if j == i or models[j] is model or not written:
                continue
            how = ("train it together (a step of either changes both)" if kind == "parameter"
                   else "update it together in training mode (a batch norm's statistics)")
            raise FusionArgumentError(
                f"model {i}'s {kind} `{name}` is model {j}'s `{name_j}` (the same tensor): "
                f"the models {how}, but the fused module stacks one "
                f"copy per model and would train the copies apart, silently. Give each "
                f"model its own {kind}s: build each model anew, or fuse copies "
                f"(hftc.fuse([copy.deepcopy(m) for m in models])). (To share a frozen "
                f"backbone, freeze it first: requires_grad_(False) and .eval(); copies of "
                f"it compute the same.)")


def _check_models(models: Any) -> list[nn.Module]:
    if isinstance(models, nn.Module):
        raise FusionTypeError(
            "hftc.fuse takes a list of models, got a single nn.Module; "
            "wrap it in a list: hftc.fuse([model])"
        )
    if not isinstance(models, Iterable) or isinstance(models, (str, bytes)):
        raise FusionTypeError(f"hftc.fuse takes a list of nn.Module, got {type(models).__name__}")
    models = list(models)
    if not models:
        raise FusionArgumentError("hftc.fuse needs at least one model, got an empty list")
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise FusionTypeError(
                f"model {i} is a {type(m).__name__}, not a torch.nn.Module; "
                f"hftc.fuse takes a list of nn.Module instances"
            )
    # torch.compile(model) wraps the model, which it shares (tensors included): fuse the
    # models themselves (symbolic tracing cannot read the wrapper), and compile the fused
    # module if wanted (fused.compile()).
    models = [compiled_original(m) for m in models]
    for i, m in enumerate(models):
        path = next((p for p, sub in m.named_modules() if isinstance(sub, FusedModule)), None)
        if path is not None:
            what = (f"model {i} is a FusedModule ({m.num_models} models fused)" if path == ""
                    else f"model {i}'s submodule `{path}` is a FusedModule")
            raise FusionTypeError(
                f"{what}: hftc fuses the original models, not fused modules. Fuse the "
                f"original models together (hftc.fuse(models_a + models_b)), or unfuse "
                f"first: hftc.fuse(fused_a.unfuse() + fused_b.unfuse()), which gives each "
                f"model its current weights")
    return models


#: ``x.float()`` for a float32 model: how a message says to cast an input.
_CAST_METHODS = {torch.float32: "float()", torch.float64: "double()", torch.float16: "half()",
                 torch.bfloat16: "bfloat16()"}


def _check_in_dims(in_dims: Any) -> InDims:
    """``in_dims`` as vmap takes it: ``None``, an int, or a tuple with one entry per input,
    an entry being an int, ``None`` or, for a container input, such a tuple (a dict) per
    element (a pytree prefix: ``(None, (0, 0))`` for ``forward(x, hc)``, or ``(None, 0)``
    to stack every tensor of ``hc``); NumPy integers become ints.  Anything else is
    refused, naming it."""
    def entry(d: Any, nested: bool) -> Any:
        if d is None:
            return None
        if nested and isinstance(d, (tuple, list)):
            return type(d)(entry(e, True) for e in d)
        if nested and isinstance(d, dict):
            return {k: entry(e, True) for k, e in d.items()}
        if not isinstance(d, (bool, torch.Tensor)):
            try:
                return operator.index(d)  # an int, or a NumPy integer
            except TypeError:
                pass
        raise ValueError

    try:
        if isinstance(in_dims, (tuple, list)):
            return tuple(entry(d, True) for d in in_dims)
        return entry(in_dims, False)
    except ValueError:
        raise FusionArgumentError(
            f"in_dims must be None (every input shared by the models), an int (the dim "
            f"along which every input holds one slice per model: in_dims=0) or a tuple with "
            f"one entry per input of forward (in_dims=(0, None)), an entry for a tuple input "
            f"being an int, None or a tuple per element (in_dims=(None, (0, 0)) for "
            f"forward(x, hc)), as torch.func.vmap's; "
            f"got {in_dims!r} ({type(in_dims).__name__})") from None


def _tensor_name_maps(match: GraphMatch, graphs: Sequence[fx.GraphModule]) -> list[dict]:
    """Model 0's parameter/buffer names -> model i's, from the matched graph nodes."""
    maps: list[dict[str, str]] = []
    for mapping, gm in zip(match.mapping, graphs):
        names: dict[str, str] = {}
        for n0, ni in mapping.items():
            if n0.op == "call_module":
                sub = gm.get_submodule(ni.target)
                for local, _ in list(sub.named_parameters(remove_duplicate=False)) + list(
                    sub.named_buffers(remove_duplicate=False)
                ):
                    names[f"{n0.target}.{local}"] = f"{ni.target}.{local}"
            elif n0.op == "get_attr":
                names[n0.target] = ni.target
        maps.append(names)
    return maps


def _module_path_maps(match: GraphMatch, graphs: Sequence[fx.GraphModule],
                      name_maps: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Model i's module paths -> model 0's (the fused module's), from the matched graph
    nodes and the tensors' owners: where model i's modes come from."""
    maps: list[dict[str, str]] = []
    for mapping, gm, names in zip(match.mapping, graphs, name_maps):
        paths = {"": ""}
        for fused, own in names.items():
            paths[own.rpartition(".")[0]] = fused.rpartition(".")[0]
        for n0, ni in mapping.items():
            if n0.op == "call_module":
                for local, _ in gm.get_submodule(ni.target).named_modules(
                        remove_duplicate=False):
                    paths[f"{ni.target}.{local}" if local else ni.target] = (
                        f"{n0.target}.{local}" if local else n0.target)
        maps.append(paths)
    return maps


def _get_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _example_constants(model: nn.Module, example_inputs: Any) -> dict[str, Any] | None:
    """The inputs symbolic tracing takes as Python constants, for fusing with
    ``example_inputs``: forward's constant defaults, updated with the Python constants the
    example passes (``example_inputs=(src, False)`` for ``forward(src, has_mask)``)."""
    if example_inputs is None:
        return None
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    try:
        given = inspect.signature(model.forward).bind_partial(*example_inputs).arguments
    except (TypeError, ValueError):
        return None
    return constant_inputs(model, dict(given))


def _drop_grad_accumulator(p: torch.Tensor) -> None:
    """Make autograd give ``p`` a new gradient accumulator before its rows are cut.

    A graph still alive from an earlier step (a loss the loop still holds) keeps ``p``'s
    accumulator, which remembers the old shape ``[N, ...]``: the next backward would
    refuse the ``[k, ...]`` gradient.  torch replaces the accumulator when ``.data``
    changes dtype, and not when it changes shape; hence the brief detour."""
    other = torch.float32 if p.dtype != torch.float32 else torch.float64
    p.data = torch.empty(0, dtype=other, device=p.device)


class FusedModule(ContainerAccess, nn.Module):
    """N models fused into one: ``fused(x)[i] == models[i](x)``.

    Every parameter and buffer is the stack of the N originals under the original
    name (``fused.state_dict()["fc.weight"]`` is ``[N, *fc.weight.shape]``).
    The fused forward is compiled on the first call (and again for a new mode or
    input rank/dtype), when shapes are known.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        *,
        in_dims: InDims = None,
        example_inputs: tuple | None = None,
        frontend: str = "auto",
        autotune: bool = False,
        check: bool = True,
        strategy: str | None = None,
        checkpoint: int | bool = False,
        pad_widths: bool = False,
        _padded: tuple[list[nn.Module], WidthPadding] | None = None,
    ):
        super().__init__()
        #: what ``hftc.fuse`` was given besides the models (hftc.replace_models fuses anew)
        self.fuse_options = {"in_dims": in_dims, "example_inputs": example_inputs,
                             "frontend": frontend, "autotune": autotune, "check": check,
                             "strategy": strategy, "checkpoint": checkpoint,
                             "pad_widths": pad_widths}
        models = _check_models(models)
        unpadded = models
        if not isinstance(pad_widths, bool):
            raise FusionArgumentError(f"pad_widths must be True or False, got {pad_widths!r}")
        #: pad_widths=True: how the models were padded to the widest (hftc.padding), or
        #: None (every model of one width, or padding off).
        self.padding: WidthPadding | None = None
        if pad_widths:
            if not check or strategy == "model_loop" or checkpoint:
                raise FusionArgumentError(
                    "pad_widths=True needs check=True (the first call compares the padded "
                    "program with every original model, and refuses an inexact padding) and "
                    "the fused strategy (no strategy='model_loop', no checkpoint=)")
            self._check_modes(models)
            _check_initialized(models)
            _check_hooks(models)
            _check_shared_tensors(models)
            # (_padded: models padded already, their forwards rewritten at the first call)
            models, self.padding = pad_models(models) if _padded is None else _padded
            if self.padding is not None:
                strategy = "fused"  # the padded models one by one would only be slower
        in_dims = _check_in_dims(in_dims)
        n = len(models)
        self.num_models = n
        self.in_dims = in_dims
        # A root container indexes as the models do (fused[0] for nn.Sequential models).
        self.source_type = type(models[0]).__name__
        self._container = ContainerAccess.container_kind(models[0])
        for name, flag in (("autotune", autotune), ("check", check)):
            if not isinstance(flag, bool):
                raise FusionArgumentError(f"{name} must be True or False, got {flag!r}")
        #: Time each fused op's lowerings (hftc.compile.autotune).
        self.autotune = autotune
        #: Activation checkpointing (hftc.compile.checkpoint): False, True or the number
        #: of segments of the fused forward recomputed in backward.
        self.checkpoint = check_checkpoint_option(checkpoint)
        #: Compare each new program's outputs with models 0, N // 2 and N-1's own, and
        #: every model's whose Python state differs from model 0's (hftc.compile.check).
        self.check = check
        #: "auto" (the fused program where the check finds it exact: the same bits every
        #: run), "timed" (time it against the models one by one on each new program's
        #: first calls, keep the faster), "fused" or "model_loop" (hftc.compile.strategy).
        self.strategy = resolve_strategy(strategy, autotune)
        if self.checkpoint and self.strategy == "model_loop":
            raise FusionArgumentError(
                "checkpoint= recomputes the fused program's activations in backward, but "
                "strategy='model_loop' runs the models one by one (nothing fused to "
                "checkpoint): drop one of the two")
        self._check_modes(models)
        _check_initialized(models)
        _check_hooks(models)
        check_function_references(models)
        _check_shared_tensors(models)
        graphs = self._trace(models, example_inputs, frontend)
        #: Which front-end traced the models: "symbolic" (torch.fx) or "export".
        self.frontend = "symbolic" if PYTHON_STATE in graphs[True][0].meta else "export"
        matches = {mode: match_graphs(graphs[mode], models, soft=per_model_table())
                   for mode in (True, False)}
        #: (model index, attributes) of the first model whose forward changed plain
        #: Python attributes while traced (hftc.ir.PYTHON_STATE), or None.
        self._python_state = next(
            ((i, sorted({n for mode in (True, False)
                         for n in graphs[mode][i].meta.get(PYTHON_STATE, [])}))
             for i in range(n)
             if any(graphs[mode][i].meta.get(PYTHON_STATE) for mode in (True, False))),
            None)
        # model 0 on meta: the root shape propagation runs the fused graph's nodes on
        template = meta_copy(models[0])
        name_maps = _tensor_name_maps(matches[True], graphs[True])
        object.__setattr__(self, "_template", template)
        #: Each model's own object (its Python state, no tensors): every per-model module
        #: hftc makes (the check's references, the models one by one, unfuse()) is one.
        self.model_copies = ModelCopies(models, name_maps,
                                        _module_path_maps(matches[True], graphs[True], name_maps))
        root, sources = build_module_tree(models, template, name_maps)
        self._adopt(root, models[0])
        fused_names = {id(p): name for name, p in self.named_parameters()}
        self.source_parameter_names: list[dict[int, str]] = [
            {id(p): fused_names[id(sources[id(p)])] for p in m.parameters() if id(p) in sources}
            for m in models
        ]
        if self.padding is not None:  # the original models' parameters (fuse_optimizers)
            for names, padded, original in zip(self.source_parameter_names, models, unpadded):
                by_name = {name: names[id(p)] for name, p in padded.named_parameters()
                           if id(p) in names}
                names.clear()
                names.update({id(p): by_name[name] for name, p in original.named_parameters()
                              if name in by_name})
        self._mode_graphs: dict[bool, _ModeGraphs] = {}
        for mode in (True, False):
            attr_targets = self._stack_constants(graphs[mode], matches[mode])
            graph0 = graphs[mode][0].graph
            graph0.owning_module = None
            originals = [{n0.name: ni.name for n0, ni in m.items()} for m in matches[mode].mapping]
            self._mode_graphs[mode] = _ModeGraphs(graph0, originals, matches[mode].method,
                                                  attr_targets,
                                                  graphs[mode][0].meta.get(CONSTANT_INPUTS, {}),
                                                  graphs[mode][0].meta.get(EXPORTED_SHAPES))
        for mode in (True, False):  # let the originals go: keep graphs, not their modules
            for g in graphs[mode][1:]:
                g.graph.owning_module = None
        #: Graphs traced again for a call with some inputs None or other Python constants
        #: than traced (:meth:`_graphs_for`), by (mode, None inputs, constants), and what
        #: they are traced from: each model's meta copy (no weights), kept where symbolic
        #: tracing was used and forward has an input that defaults to None or was traced
        #: as a constant.
        self._retraced_graphs: dict[tuple[bool, frozenset[str], tuple], _ModeGraphs] = {}
        optional = any(p.op == "placeholder" and p.args == (None,)
                       for p in self._mode_graphs[True].graph.nodes)
        retraceable = optional or self._mode_graphs[True].constants
        #: Traced again from the models' own copies (:meth:`_graphs_for`).
        self._retraceable = bool(retraceable) and PYTHON_STATE in graphs[True][0].meta
        self._programs: dict[Any, Program] = {}
        self.training = models[0].training
        if example_inputs is not None:
            if not isinstance(example_inputs, tuple):
                example_inputs = (example_inputs,)
            self.compile(*example_inputs)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _check_modes(models: Sequence[nn.Module]) -> None:
        modes = ["train" if m.training else "eval" for m in models]
        if len(set(modes)) > 1:
            listing = "; ".join(f"model {i}: {m}" for i, m in enumerate(modes))
            raise MismatchError(
                f"the models are in different modes ({listing}); a fused module has one mode. "
                f"Call .train() or .eval() on all of them before fusing "
                f"(fused.train() / fused.eval() switch all models later)."
            )

    def _trace(self, models: Sequence[nn.Module], example_inputs: Any,
               frontend: str) -> dict[bool, list[fx.GraphModule]]:
        """Each model's graph in both modes: ``torch.fx.symbolic_trace``, or ``torch.export``
        (:mod:`hftc.frontends.export`) when symbolic tracing fails and ``example_inputs`` are given
        (or ``frontend="export"``)."""
        if frontend not in ("auto", "symbolic", "export"):
            raise FusionArgumentError(
                f"frontend must be 'auto', 'symbolic' or 'export', got {frontend!r}")
        if frontend != "export":
            try:
                return trace_models(models, modes=(True, False), constants=[
                    _example_constants(m, example_inputs) for m in models])
            except TraceError:
                if example_inputs is None or frontend == "symbolic":
                    raise
        if example_inputs is None:
            raise FusionArgumentError("frontend='export' needs example_inputs=(...)")
        from .frontends.export import export_models

        if not isinstance(example_inputs, tuple):
            example_inputs = (example_inputs,)
        merged, batched = self._merge_inputs(example_inputs)
        # Export runs each model on the example inputs, where a model of another dtype
        # fails in torch ("Input type (float) and bias type (double) should be the same").
        _check_same_dtypes(models)
        return export_models(
            models, lambda i: tuple(model_slice(v, i) if b else v for v, b in zip(merged, batched)),
            modes=(True, False), aten_spellings=aten_spellings())

    def _adopt(self, root: nn.Module, model0: nn.Module) -> None:
        """Take over the root's children and tensors (the tree was built for model 0's root)."""
        for name, child in root.named_children():
            self.add_module(name, child)
        for name, p in root._parameters.items():
            self.register_parameter(name, p)
        for name, b in root._buffers.items():
            self.register_buffer(name, b, persistent=name not in model0._non_persistent_buffers_set)
        self._mark_stacked()

    def _mark_stacked(self) -> None:
        """Mark the stacked parameters, which torch's ``clip_grad_norm_`` then clips per
        model (:mod:`hftc.utils`); again after a copy (``Parameter.__deepcopy__`` makes
        a new tensor without the mark) and after ``load_state_dict(..., assign=True)``
        (new Parameter objects).  The module is registered too: a parameter put in later
        without a mark is still known as stacked."""
        register_fused(self)
        for p in self.parameters():
            mark_stacked(p, self.num_models)
        blocks = self.padding.blocks if getattr(self, "padding", None) is not None else {}
        for name, p in self.named_parameters():
            if name in blocks:  # (read where stock optimizer state is padded into it)
                p._hftc_width_blocks = blocks[name]

    def train(self, mode: bool = True, *more: Any) -> FusedModule:
        """``nn.Module.train``: every model in ``mode`` (``fused.eval()`` is ``train(False)``),
        each module of the tree's flag set as ``nn.Module.train`` sets it, without calling
        a ``train`` that a module copied from the models defines (its class's own).

        The models' own ``train`` is not fused: pytorch/examples' forward-forward
        ``Layer.train(x_pos, x_neg)`` is a training loop, which steps an optimizer the
        fused module does not have; it is refused here with what to do instead."""
        if more or not isinstance(mode, bool):
            own = getattr(type(self._template), "train", None)
            theirs = (f" {self.source_type}.train is the models' own method, which hftc does "
                      f"not fuse: call it on the models one by one (fused.unfuse()) or write "
                      f"its step with the fused module's outputs."
                      if own is not None and own is not nn.Module.train else "")
            raise FusionTypeError(
                f"fused.train(mode) takes one bool (train or eval mode), got "
                f"{', '.join(type(a).__name__ for a in (mode, *more))}.{theirs}")
        return ir.set_training(self, mode)

    def to(self, *args: Any, **kwargs: Any) -> FusedModule:
        """``nn.Module.to``; a ``memory_format`` is not applied to the stacked tensors.

        torch picks the tensors to lay out by rank (channels-last: the 4-d ones), and a
        stacked tensor has one dim more than the model's (a Conv2d weight is ``[N, O, I,
        kh, kw]``): ``fused.to(memory_format=torch.channels_last)`` raised on it.  The
        fused kernels choose their layouts per call (``autotune=True`` times the
        channels-last ones on the real shapes); the device and dtype still apply."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None:
            return super().to(*args, **kwargs)
        return super().to(device=device, dtype=dtype, non_blocking=non_blocking)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._mark_stacked()
        return result

    def _stack_constants(self, graphs: Sequence[fx.GraphModule], match: GraphMatch) -> dict:
        """Tensor attributes the graphs read that are not parameters or buffers (constants
        symbolic tracing lifted, plain tensor attributes): stacked as non-persistent buffers,
        or, where every model's is equal (a token id the models' code lifted, say), one
        buffer all models share (its name tells the fusion passes so)."""
        known = {name for name, _ in self.named_parameters(remove_duplicate=False)}
        known |= {name for name, _ in self.named_buffers(remove_duplicate=False)}
        targets: dict[str, str] = {}
        for node in graphs[0].graph.nodes:
            if node.op != "get_attr" or node.target in known:
                continue
            values = [_get_path(g, m[node].target) for g, m in zip(graphs, match.mapping)]
            if not isinstance(values[0], torch.Tensor):
                continue
            shared = all(v.shape == values[0].shape and v.dtype == values[0].dtype
                         and torch.equal(v, values[0]) for v in values[1:])
            prefix = SHARED_CONSTANT_PREFIX if shared else "_hftc_constant_"
            name = f"{prefix}{len(list(self.buffers()))}"
            value = values[0].detach().clone() if shared else torch.stack(
                [v.detach() for v in values])
            self.register_buffer(name, value, persistent=False)
            targets[node.target] = name
            # Shape propagation runs model 0's graph on the template: give it the constant too.
            owner_path, _, leaf = node.target.rpartition(".")
            owner = self._template.get_submodule(owner_path)
            if not hasattr(owner, leaf):
                owner.register_buffer(leaf, torch.empty_like(values[0], device="meta"),
                                      persistent=False)
        return targets

    # ------------------------------------------------------------------ calling

    def _in_dims_for(self, given: Sequence[bool],
                     names: Sequence[str] | None = None) -> list[int | None]:
        """Each input's in_dims entry: ``given[k]`` says whether the caller passed input k
        (positionally or by keyword); one left to its default is shared."""
        dims = self.in_dims
        if dims is None or isinstance(dims, int):
            return [dims if g else None for g in given]
        dims = tuple(dims)
        # Fewer entries than forward has inputs: a call may leave optional inputs out
        # (fused(x) and fused(x, mask) with in_dims=(0, None)); not more than forward has.
        graphs = self.__dict__.get("_mode_graphs")  # not yet while export traces
        inputs = len(dims) if graphs is None else sum(
            n.op == "placeholder" for n in graphs[self.training].graph.nodes)
        passed = [k for k, g in enumerate(given) if g]
        if len(dims) > inputs or (passed and passed[-1] >= len(dims)):
            extra = "" if not passed or passed[-1] < len(dims) or names is None else (
                f"; input `{names[passed[-1]]}` (input {passed[-1]}) has none")
            raise FusionArgumentError(
                f"in_dims has {len(dims)} entries but the fused module got "
                f"{len(passed)} inputs (the models' forward takes {inputs}){extra}; give "
                f"one entry (an int or None) per input, in forward's order, whether it is "
                f"passed by position or by keyword"
            )
        return [dims[k] if g else None for k, g in enumerate(given)]

    def _merge_inputs(self, values: Sequence[Any], given: Sequence[bool] | None = None,
                      names: Sequence[str] | None = None) -> tuple[list[Any], list[bool]]:
        """Inputs -> fused inputs: stacked ones get the model dim at 0, shared ones stay.
        ``given``: which were passed (default all), ``names``: forward's input names."""
        given = [True] * len(values) if given is None else given
        merged, batched = [], []
        for k, (a, d) in enumerate(zip(values, self._in_dims_for(given, names))):
            if d is None:
                merged.append(a)
                batched.append(False)
                continue
            what = f"input {k}" if names is None else f"input `{names[k]}` (input {k})"
            if isinstance(a, torch.Tensor) and isinstance(d, int):
                merged.append(self._stacked_input(a, d, what))
                batched.append(True)
                continue
            value, stacked = self._stacked_container(a, d, what)
            merged.append(value)
            batched.append(stacked)
        return merged, batched

    def _stacked_input(self, a: torch.Tensor, d: int, what: str) -> torch.Tensor:
        """A tensor stacked per model along dim ``d``, with the model dim moved to 0."""
        if a.dim() <= d or a.shape[d] != self.num_models:
            got = "no such dim" if a.dim() <= d else f"size {a.shape[d]}"
            raise FusionArgumentError(
                f"{what} is stacked per model along dim {d} (in_dims) but has {got} there "
                f"(shape {tuple(a.shape)}); it needs size {self.num_models}, one slice per "
                f"model. Pass in_dims=None for an input all models share."
            )
        return a.movedim(d, 0) if d != 0 else a

    def _stacked_container(self, a: Any, d: Any, what: str) -> tuple[Any, bool]:
        """A container input (an LSTM's ``(h, c)``) with its in_dims entry ``d``, a pytree
        prefix as vmap's: an int stacks every tensor in it, a tuple gives each element its
        own.  ``((h, c), (0, None))`` -> ``(h, c.expand(N, *c.shape))``: the fused program
        takes a container whose tensors all carry the model dim, so a shared one among
        stacked ones is passed expanded (a view); returns (value, whether it is stacked)."""
        leaves, spec = pytree.tree_flatten(a)
        if isinstance(d, int):
            dims = [d if isinstance(t, torch.Tensor) else None for t in leaves]
        else:
            dims = pytree._broadcast_to_and_flatten(d, spec)
            if dims is None:
                raise FusionArgumentError(
                    f"{what} is a {type(a).__name__} whose structure in_dims={d!r} does not "
                    f"match (it holds {pytree.tree_unflatten(['*'] * len(leaves), spec)!r}, "
                    f"* a value): give the container one entry (an int stacks every "
                    f"tensor in it, as torch.func.vmap's in_dims) or a tuple with one int or "
                    f"None per element (in_dims=(None, (0, 0)) for forward(x, (h, c)))")
        if not any(dim is not None for dim in dims):
            return a, False
        for dim, t in zip(dims, leaves):
            if dim is not None and not isinstance(t, torch.Tensor):
                raise FusionArgumentError(
                    f"{what} has in_dims={d!r} but holds a {type(t).__name__} ({t!r}) where "
                    f"in_dims says dim {dim}: in_dims stacks tensors only; give it None there")
        stacked = [self._stacked_input(t, dim, what) if dim is not None
                   else expand_models(t, self.num_models) if isinstance(t, torch.Tensor)
                   else t for t, dim in zip(leaves, dims)]
        return pytree.tree_unflatten(stacked, spec), True

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[list[Any], list[bool]]:
        """A call's positional and keyword inputs -> one fused value per input of the traced
        forward, and whether each carries the model dim.  ``in_dims`` applies to an input
        whichever way it is passed."""
        self.__dict__["_call_graph_key"] = None
        self.__dict__["_call_keywords"] = ()  # inputs forward's **kwargs takes: none
        placeholders = [
            n for n in self._mode_graphs[self.training].graph.nodes
            if n.op == "placeholder"
        ]
        if self.__dict__.get("frontend") == "export" \
                and not self._fits_exported(placeholders, args, kwargs):
            found = self._reexport_inputs(args, kwargs)
            if found is not None:
                return found
        if len(args) > len(placeholders):
            takes = (f"{len(placeholders)} input{'s' if len(placeholders) != 1 else ''} ("
                     + ", ".join(f"`{p.target}`" for p in placeholders) + ")")
            exported = ("" if self.__dict__.get("frontend") != "export" else
                        " As traced by torch.export, forward takes the inputs example_inputs "
                        "gave: give example_inputs every input the fused module will be "
                        "called with.")
            raise FusionArgumentError(
                f"the fused module got {len(args)} positional inputs, but the models' "
                f"forward takes {takes}: call it as you would call one model "
                f"(fused(x) for forward(self, x)).{exported}"
            )
        kwargs = dict(kwargs)
        values, given = list(args), [True] * len(args)
        for p in placeholders[len(args):]:
            if p.target in kwargs:
                values.append(kwargs.pop(p.target))
                given.append(True)
            elif p.args:
                values.append(p.args[0])
                given.append(False)
            else:
                raise FusionArgumentError(f"missing input `{p.target}` of the models' forward")
        if kwargs:
            raise FusionArgumentError(f"unexpected keyword inputs {sorted(kwargs)}")
        merged, batched = self._merge_inputs(values, given, [p.target for p in placeholders])
        if self.__dict__.get("frontend") == "export":
            refused = _guard_failure(self._mode_graphs[self.training].graph, merged, batched)
            if refused is not None:
                self._use_export(("shapes", _shapes(merged, batched)), merged, batched, refused)
        return merged, batched

    @staticmethod
    def _fits_exported(placeholders: Sequence[fx.Node], args: tuple, kwargs: dict) -> bool:
        """Whether a call passes the inputs the exported graph takes: no more positional
        ones, only its keywords, each of its inputs given (or defaulted), and no ``None``
        where the example inputs had a tensor (the graph guards it)."""
        from .runtime.guards import check_input_shape

        names = [p.target for p in placeholders]
        if len(args) > len(names) or not set(kwargs) <= set(names[len(args):]):
            return False
        for k, p in enumerate(placeholders):
            if k >= len(args) and p.target not in kwargs and not p.args:
                return False
            value = args[k] if k < len(args) else kwargs.get(p.target)
            if value is None and any(u.target is check_input_shape for u in p.users):
                return False
        return True

    def _reexport_inputs(self, args: tuple, kwargs: dict) -> tuple[list[Any], list[bool]] | None:
        """A call the exported graph does not take (``fused(input_ids, labels=labels)`` for
        models exported from ``example_inputs=(input_ids, attention_mask)``; an input
        ``None`` that was a tensor): the models are exported again with this call's own
        inputs as the example (once per mode and pattern of given / ``None`` inputs),
        and the call's inputs bound to forward's parameters in order, up to the last one
        given, then the keyword-only ones and those forward's ``**kwargs`` takes
        (``num_items_in_batch`` from the Hugging Face Trainer), exported as keywords.
        None where forward takes ``*args`` (the call is refused as before)."""
        signature = inspect.signature(type(self._template).forward)
        parameters = list(signature.parameters.values())[1:]
        if any(p.kind == p.VAR_POSITIONAL for p in parameters):
            return None
        try:
            bound = signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise FusionArgumentError(f"{self.source_type}.forward: {exc} (call the fused "
                                      f"module as you would call one model)") from None
        parameters = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY,
                                                          p.POSITIONAL_OR_KEYWORD)]
        named = {p.name for p in parameters}
        # Keyword-only, or taken by **kwargs (bind refused any other): export takes them as
        # keywords, after the positional inputs; sorted, so one pattern is one export.
        keywords = sorted(set(kwargs) - named)
        given = set(bound.arguments) & named
        bound.apply_defaults()
        last = max((k for k, p in enumerate(parameters) if p.name in given), default=-1)
        names = [p.name for p in parameters[:last + 1]]
        values = [bound.arguments[name] for name in names]
        given_flags = [n in given for n in names]
        names += keywords
        values += [kwargs[name] for name in keywords]
        given_flags += [True] * len(keywords)
        merged, batched = self._merge_inputs(values, given_flags, names)
        key = tuple((name, "tensor" if isinstance(v, torch.Tensor) else repr(v))
                    for name, v in zip(names, values))
        if keywords:
            key += (("keywords", tuple(keywords)),)
        found = self.__dict__.get("_reexported_graphs", {}).get((self.training, key))
        refused = None if found is None else _guard_failure(found.graph, merged, batched)
        if refused is not None:
            key += (("shapes", _shapes(merged, batched)),)
        self._use_export(key, merged, batched, refused, keywords=len(keywords))
        self.__dict__["_call_keywords"] = tuple(keywords)
        return merged, batched

    def _use_export(self, key: tuple, merged: Sequence[Any], batched: Sequence[bool],
                    refused: FusionArgumentError | None = None, keywords: int = 0) -> None:
        """This call runs the graphs exported for ``key`` (exported now if not yet).
        ``refused``: the guard that sent the call here (a size export fixed), raised when
        the models cannot be exported with these inputs either (a size their code fixes):
        that message says what the models take, and this one adds where their code fails
        at these sizes.  ``keywords``: how many of the last inputs are exported as keywords
        (names in ``key``)."""
        self.__dict__["_call_graph_key"] = key
        graphs = self.__dict__.setdefault("_reexported_graphs", {})
        if (self.training, key) not in graphs:
            try:
                names = [name for name, _ in key[len(merged) - keywords:len(merged)]]
                graphs[(self.training, key)] = self._export_again(merged, batched, names)
            except TraceError as again:
                if refused is None:
                    raise
                cause = again.__cause__ or again
                where = source_line(cause)
                raise type(refused)(
                    f"{refused} At this call's shapes the models' own code fails (exported "
                    f"again with these inputs){f' at {where}' if where else ''}: "
                    f"{plain_message(cause)}.") from None


    def _matched_mode_graphs(self, graphs: list, models: Sequence[nn.Module],
                             constants: dict[str, Any] | None = None) -> _ModeGraphs:
        """One mode's graphs of the models, traced or exported again after fusing, matched
        and their constants stacked; constants made now go where the module went
        (``.to("cuda")``) since fusing."""
        match = match_graphs(graphs, models, soft=per_model_table())
        attr_targets = self._stack_constants(graphs, match)
        device = next((t.device for t in self.parameters()), None)
        for name in attr_targets.values():
            if device is not None:
                self._buffers[name] = self.get_buffer(name).to(device)
        for g in graphs:
            g.graph.owning_module = None
        originals = [{n0.name: ni.name for n0, ni in m.items()} for m in match.mapping]
        return _ModeGraphs(graphs[0].graph, originals, match.method, attr_targets,
                           constants or {}, graphs[0].meta.get(EXPORTED_SHAPES))
    def _export_again(self, merged: Sequence[Any], batched: Sequence[bool],
                      keyword_names: Sequence[str] = ()) -> _ModeGraphs:
        """The models (as ``unfuse()`` gives them) exported in the current mode with a
        call's inputs as the example (the last ``len(keyword_names)`` of them as those
        keywords), matched and their constants stacked as at fusing."""
        from .frontends.export import export_models

        models = self.unfuse()
        graphs = export_models(
            models, lambda i: tuple(model_slice(v, i) if b else v for v, b in zip(merged, batched)),
            modes=(self.training,), aten_spellings=aten_spellings(),
            keyword_names=keyword_names,
            # (the sizes kept symbolic at fusing: a try that failed then is not waited for)
            start=self._mode_graphs[self.training].exported_shapes)[self.training]
        return self._matched_mode_graphs(graphs, models)

    @staticmethod
    def _signature(values: Sequence[Any], batched: Sequence[bool]) -> tuple:
        """The key of a call's compiled program: each input's structure (tuples, lists,
        dicts of values) and each leaf's rank, dtype and device (tensors) or value.

        Not a container's ``id()``: a fresh tuple per call may get the id of a freed one
        built around a tensor of another rank, whose program then ran on it (``x.t()``
        of a 1-d tensor compiled as a view: a 2-d one came back untransposed)."""
        def leaf(v: Any) -> tuple:
            if isinstance(v, torch.Tensor):
                return ("tensor", v.dim(), v.dtype, v.device.type)
            text = repr(v)
            return (type(v).__name__,
                    text if len(text) < 64 else hashlib.sha1(text.encode()).hexdigest())

        sig = []
        for v, b in zip(values, batched):
            if isinstance(v, torch.Tensor):  # (most inputs: no containers to open)
                sig.append(leaf(v) + (b,))
                continue
            leaves, spec = pytree.tree_flatten(v)
            sig.append((repr(spec), tuple(leaf(x) for x in leaves), b))
        return tuple(sig)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.padding is not None:
            mask_padded_gradients(self)
        values, batched = self._inputs(args, kwargs)
        program, how = self._rewriting_padded_ops(
            lambda: self._program_and_way(values, batched), values, batched)
        self.__dict__["_last_call_program"] = program  # (hftc.compile_step reads its plan)
        try:
            with ir.modes_restored_on_error():
                if how is not None:  # the whole-model loop and/or autotune's layout
                    return run_program(self, program.forward, how, values, batched)
                out = program.forward(self, *values)
            return out if program.output_spec is None else program.output_spec.rebuild(out)
        except RuntimeError as exc:
            if program.trial is not None:  # (a failed call's time counts for no way)
                program.trial.last = None
            self._explain_input_mismatch(values, batched, exc)
            raise

    def _rewriting_padded_ops(self, make: Callable[[], Any], values: Sequence[Any],
                              batched: Sequence[bool]) -> Any:
        """``make()`` (this call's program); where the first-call check refuses a padded
        program, again after :meth:`_rewrite_padded_ops` (the refusal stands where no
        rewrite helps; an op it cannot compute on the real units is named)."""
        try:
            return make()
        except MismatchError as refused:
            if self.padding is None:
                raise
            try:
                rewritten = self._rewrite_padded_ops(values, batched)
            except UnsupportedOperatorError:
                raise
            except Exception:  # noqa: BLE001 - the rewrite failed: the refusal stands
                raise refused from None
            if not rewritten:
                raise
            return make()

    def _rewrite_padded_ops(self, values: Sequence[Any], batched: Sequence[bool]) -> bool:
        """After the first-call check refused a padded program: rebuild this module from
        padded models whose forwards compute their ops over a padded dim on each model's
        real units (:func:`hftc.padding_graph.compute_over_real_units`, run on this
        call's inputs), keeping the parameter objects; False where no rewrite helps (the
        refusal stands).  Once per module."""
        if self.__dict__.get("_padded_ops_rewritten"):
            return False
        self._padded_ops_rewritten = True
        originals = self.unfuse()
        padded = [self.padded_model(i) for i in range(self.num_models)]
        classes = [type(m) for m in padded]
        args = [tuple(model_slice(v, i) if b else v
                      for v, b in zip(input_copies(values), batched))
                for i in range(self.num_models)]
        rewritten = compute_over_real_units(originals, padded, args)
        if all(type(m) is c for m, c in zip(rewritten, classes)):
            return False
        options = {**self.fuse_options, "pad_widths": True}
        self._become(FusedModule(originals, **options, _padded=(rewritten, self.padding)))
        self._padded_ops_rewritten = True
        return True

    def _become(self, other: FusedModule) -> None:
        """``other``'s tensors and records in this module, keeping this module's parameter
        objects (optimizers and the user's references hold them): hftc.replace_models and
        the padded-op rewrite fuse anew and take the result over."""
        old = dict(self.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, p in other.named_parameters(remove_duplicate=False):
                keep = old[name]
                if keep is not p:
                    keep.grad = None
                    _drop_grad_accumulator(keep)
                    keep.data = p.data
                    keep.requires_grad_(p.requires_grad)
                owner, _, leaf = name.rpartition(".")
                other.get_submodule(owner)._parameters[leaf] = keep
        # What this module made lazily from its old models (the shells the models run
        # one by one in, fused methods, the last call's program) goes with them: the old
        # shells ran a replaced model with its predecessor's Python attributes.
        for key in _MADE_FROM_MODELS:
            self.__dict__.pop(key, None)
        self.__dict__.update(other.__dict__)

    def with_in_dims(self, in_dims: InDims) -> InDimsCall:
        """The fused module with ``in_dims`` for the calls made through the result, as
        ``torch.func.vmap(model, in_dims)(x)`` reads: ``fused(real)`` shares real images
        among the models, ``fused.with_in_dims(0)(fake)`` gives model i its ``fake[i]``
        (a GAN discriminator on a fused generator's fakes; an RNN's carried hidden state:
        ``fused.with_in_dims((0, 0))(x, hidden)``).  Its methods take the same in_dims
        (``fused.with_in_dims(0).decode(z)``).  ``in_dims`` is checked as ``hftc.fuse``'s,
        and the module's own stays as it was."""
        return InDimsCall(self, _check_in_dims(in_dims))

    @contextlib.contextmanager
    def _in_dims_set(self, in_dims: InDims) -> Iterator[None]:
        before, per_call = self.in_dims, self.__dict__.get("_in_dims_per_call", False)
        self.in_dims, self.__dict__["_in_dims_per_call"] = in_dims, True
        try:
            yield
        finally:
            self.in_dims, self.__dict__["_in_dims_per_call"] = before, per_call

    def _method_in_dims(self) -> InDims:
        """A method's in_dims: the call's (``with_in_dims``), else the module's where it
        is an int or None; a tuple names forward's inputs, so a method shares its inputs."""
        if self.__dict__.get("_in_dims_per_call") or not isinstance(self.in_dims, tuple):
            return self.in_dims
        return None

    @run_eagerly
    def _program_and_way(self, values: Sequence[Any], batched: Sequence[bool],
                         ) -> tuple[Program, ProgramChoice | None]:
        """This call's program and how it runs (None: the fused program).  Calls are
        numbered: strategy="timed" times a call up to the next one only if no other
        program ran between (compile/strategy.py's CallTiming).  Eager under
        torch.compile: the timing's clock and counters are Python state."""
        call_number = self.__dict__["_call_number"] = self.__dict__.get("_call_number", 0) + 1
        program = self._program(values, batched)
        if program.trial is None:
            return program, program.how
        return program, program.trial.way(program, call_number)

    @run_eagerly
    def _program(self, values: Sequence[Any], batched: Sequence[bool]) -> Program:
        key = (self.training, self._signature(values, batched))
        exported_again = self.__dict__.get("_call_graph_key")
        if exported_again is not None:  # (the export front-end's graphs for this call)
            key += (exported_again,)
        program = self._programs.get(key)
        if program is None:
            program = self._compile_program(values, batched)
            self._programs[key] = program
        return program

    def _graphs_for(self, values: Sequence[Any]) -> _ModeGraphs:
        """The graphs for a call whose inputs are ``values``, in the current mode.

        Symbolic tracing gives every input a traced value, never ``None``, so forward's
        ``if mask is not None:`` is taken in the graphs traced at fusing; and inputs whose
        default is a Python constant (``has_mask=True``, ``is_causal: bool = False``) are
        traced as that constant, so forward's Python may branch on them.  A call that
        leaves such an input ``None`` (``fused(x)`` for ``forward(self, x, mask=None)``)
        or gives a traced constant another value (``fused(x, has_mask=False)``) gets
        graphs traced again (once per mode, set of ``None`` inputs and constants) from the
        models' meta copies, with those inputs ``None`` or those values."""
        exported_again = self.__dict__.get("_call_graph_key")
        if exported_again is not None:  # (export front-end: this call's own export)
            return self.__dict__["_reexported_graphs"][(self.training, exported_again)]
        default = self._mode_graphs[self.training]
        placeholders = [n.target for n in default.graph.nodes if n.op == "placeholder"]
        bound = dict(zip(placeholders, values))
        nones = frozenset(name for name, v in bound.items() if v is None)
        changed = {name: bound[name] for name, value in default.constants.items()
                   if bound.get(name) is not None and not same_constant(bound[name], value)}
        if not nones and not changed:
            return default
        if not self._retraceable:
            if changed:  # not reached: only symbolic tracing traces inputs as constants
                name, value = next(iter(changed.items()))
                raise FusionArgumentError(
                    f"input `{name}` is {value!r}, but the models were traced with "
                    f"{default.constants[name]!r}; fuse again with that value")
            return default
        # An input traced as a constant and given a tensor now is traced as a value.
        constants = {name: value for name, value in {**default.constants, **changed}.items()
                     if name not in nones and is_python_constant(value)}
        key = (self.training, nones,
               tuple(sorted((k, type(v).__name__, repr(v)) for k, v in constants.items())))
        if key not in self._retraced_graphs:
            models = self.model_copies.deepcopy_templates()
            graphs = [trace_model(m, i, training=self.training, none_inputs=sorted(nones),
                                  constants=constants)
                      for i, m in enumerate(models)]
            self._retraced_graphs[key] = self._matched_mode_graphs(graphs, models, constants)
        return self._retraced_graphs[key]

    def _compile_program(self, values: Sequence[Any], batched: Sequence[bool]) -> Program:
        program = compile_program(self, self._graphs_for(values), values, batched,
                                  CompileOptions(autotune=self.autotune,
                                                 strategy=getattr(self, "strategy", "fused"),
                                                 checkpoint=getattr(self, "checkpoint", False)))
        if getattr(self, "padding", None) is not None:
            program.report.padding = self.padding.summary()
        shapes = self._graphs_for(values).exported_shapes
        program.report.exported = None if shapes is None else shapes.describe() or None
        return program

    def _why_not_fused(self, report: FusionReport, forward: Any, spec: OutputSpec | None,
                       values: Sequence[Any], batched: Sequence[bool], graph: fx.Graph,
                       model_graph: fx.Graph) -> str | None:
        """Why the fused program (``forward``, compiled from ``graph``, which was fused from
        model 0's ``model_graph``) must not run on these inputs (``report.check`` says
        what was found), or ``None``: forward keeps Python state a traced program cannot,
        or the first-call check (:mod:`hftc.compile.check`) found its outputs not the models'."""
        if self._python_state:
            index, names = self._python_state
            report.check = CheckResult((index,), difference=(
                f"model {index}'s forward changes the Python attribute(s) "
                + ", ".join(f"`{n}`" for n in names) + " on every call"))
            return (f"{report.check.difference} (a counter, a flag set on the first call), "
                    f"which a traced program keeps at the value it had while tracing: the "
                    f"models' own forwards run instead, each with its own attributes. To "
                    f"fuse the models, keep such state in a buffer (self.register_buffer("
                    f"'calls', torch.zeros((), dtype=torch.long))), which the fused module "
                    f"updates per model.")
        if not self.check:
            return None
        report.check = compare_with_models(
            self, lambda inputs: self._run_fused(forward, spec, inputs), values, batched)
        if isinstance(report.check.raised, RaggedResultError):
            # Shapes that depend on the data (x[mask] per model): the models' own
            # forwards run them, one by one.
            return ("an op that runs per model gave the models results one fused program "
                    "cannot hold (of different shapes, a value whose shape depends on the "
                    "data, as x[mask] with a per-model mask; or different Python values, as "
                    ".item() of a per-model tensor)")
        if report.check.passed:
            return None
        if getattr(self, "padding", None) is not None:
            i = report.check.failed_model
            where = locate_padding_difference(
                self.unfuse_model(i), self.padded_model(i),
                [model_slice(v, i) if b else v for v, b in zip(input_copies(values), batched)])
            where = f" ({where})" if where else ""
            return (f"{report.check.difference}{where}: padded to the widest model "
                    f"(pad_widths=True), the fused program does not compute what the "
                    f"original models compute. "
                    f"Their forward mixes across a padded width in its own code (a softmax, "
                    f"mean or sum over a hidden dim, a split or view of a padded Linear's "
                    f"output into parts, an output whose width differs per model), which "
                    f"zero padding changes. Fuse models of one width together instead "
                    f"(hftc.fuse_groups), pass example_inputs=(...) to hftc.fuse, from "
                    f"which hftc computes such ops over each model's real units "
                    f"(hftc.padding_graph) or names the op it cannot, or leave such ops to "
                    f"modules that pad (nn.LayerNorm for a hand-written norm, "
                    f"nn.MultiheadAttention or three nn.Linear for a packed q, k, v "
                    f"projection)")
        where = locate_difference(self, graph, model_graph, report.records, values, batched,
                                  report.check.failed_model)
        if where:
            report.check.difference += f" ({where})"
        return (f"{report.check.difference}. The fused program, traced from the models' "
                f"forward, does not compute what that forward computes on these inputs. "
                f"The usual cause is Python in forward that inspects a value instead of "
                f"computing with it, which tracing cannot follow: isinstance(x, "
                f"torch.Tensor) or type(x) is ... on a tensor (while tracing, x is a "
                f"torch.fx Proxy), or a branch on a tracing flag (torch.fx."
                f"_symbolic_trace.is_fx_tracing(), torch.jit.is_tracing()). To fuse the "
                f"models, compute without such checks, or trace with torch.export, which "
                f"runs forward's Python on real values: hftc.fuse(models, "
                f"example_inputs=(x,), frontend='export'). (If forward has no such code, "
                f"the bug is hftc's: please report it with the model.)")

    def _run_fused(self, forward: Any, spec: OutputSpec | None, values: Sequence[Any]) -> Any:
        with ir.modes_restored_on_error():
            out = forward(self, *values)
        return out if spec is None else spec.rebuild(out)

    def _model_loop_program(self, program: Program, values: Sequence[Any],
                            batched: Sequence[bool], why: str) -> Program:
        """The program for models the fused program does not compute: the N models one by
        one, with a warning that says ``why``."""
        message = why
        if getattr(self, "padding", None) is not None:
            # the padded models one by one would run the same inexact padding
            raise MismatchError(f"pad_widths=True refused: {why}")
        try:  # a trial run, on shells of its own (forward may change their attributes)
            with preserved_state(self), torch.no_grad():
                run_program(self, program.forward, ProgramChoice(ModelLoop(self)),
                            input_copies(values), batched)
            how = ProgramChoice(self._models_one_by_one())
        except Exception as exc:  # noqa: BLE001 - any failure means: no correct way to run
            raise TraceError(f"{message} The models cannot run one by one either "
                             f"({plain_message(exc)})") from exc
        warnings.warn(f"hftc runs the {self.num_models} models one by one (not fused: no "
                      f"speed-up), because {message}", FusionWarning, stacklevel=2)
        program.how = how
        return program

    def _models_one_by_one(self) -> ModelLoop:
        """The whole-model loop every program that runs the models one by one shares: one
        set of shells, so the Python attributes forward changes (``self.calls += 1``) are
        each model's own across modes and input signatures, and ``unfuse()`` gives them
        back (a loop per program counted each program's calls apart)."""
        loop = self.__dict__.get("_shared_model_loop")
        if loop is None:
            loop = ModelLoop(self)
            self.__dict__["_shared_model_loop"] = loop
        return loop

    def _explain_input_mismatch(self, values: Sequence[Any], batched: Sequence[bool],
                                cause: Exception) -> None:
        """An input the models cannot take, said as such (which input, what the models
        expected, what to change), not as the error torch raised deep in the program:
        a floating input of another dtype or device than the parameters, an integer input
        where an op wanted the parameters' float dtype, or an input stacked per model
        (dim 0 of size N) given to a module that shares it among the models."""
        param = next((p for p in self.parameters() if p.is_floating_point()), None)
        if param is None:
            return
        names = [n.target for n in self._mode_graphs[self.training].graph.nodes
                 if n.op == "placeholder"]
        what = [f"input {k}" + (f" (`{names[k]}`)" if k < len(names) else "")
                for k in range(len(values))]
        root = cause  # torch's own error, under the TraceError that shape propagation raised
        while isinstance(root, FusionError) and isinstance(root.__cause__, Exception):
            root = root.__cause__
        said = (str(root.args[0]) if root.args else str(root)).strip()
        torch_said = f"{type(root).__name__}: {said.splitlines()[0] if said else ''}"
        for k, v in enumerate(values):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                if v.dtype != param.dtype or v.device != param.device:
                    to = (f"x.to({param.dtype})", f"fused.to({v.dtype})") \
                        if v.device == param.device else \
                        (f"x.to('{param.device}')", f"fused.to('{v.device}')")
                    raise FusionArgumentError(
                        f"{what[k]} is {v.dtype} on {v.device} but the models' parameters are "
                        f"{param.dtype} on {param.device}; move or cast the input ({to[0]}) "
                        f"or the fused module ({to[1]})"
                    ) from cause
        if re.search(r"dtype|scalar type|[Ll]ong|\bInt|Byte|Bool|same type", said):
            for k, v in enumerate(values):
                if isinstance(v, torch.Tensor) and not v.is_floating_point() \
                        and not v.is_complex():
                    kind = str(param.dtype).removeprefix("torch.")
                    method = _CAST_METHODS.get(param.dtype, f"to({param.dtype})")
                    raise FusionArgumentError(
                        f"{what[k]} is {str(v.dtype).removeprefix('torch.')}, but the models' "
                        f"parameters are {kind} and an op of their forward needs the input "
                        f"in {kind} ({torch_said}): pass x.{method} (x.to({param.dtype})); "
                        f"if it holds indices (token ids, class labels), the models' forward "
                        f"must embed or one-hot them before a layer uses them"
                    ) from cause
        stacked = [k for k, (v, b) in enumerate(zip(values, batched))
                   if not b and isinstance(v, torch.Tensor) and v.dim() > 0
                   and v.shape[0] == self.num_models > 1]
        if stacked and self._model_runs_on_slices(values, batched, stacked):
            dims = [0 if k in stacked or b else None for k, b in enumerate(batched)]
            in_dims = 0 if all(d == 0 for d in dims) else tuple(dims)
            n = self.num_models
            expand = ("" if in_dims != 0 else f"; an input all models share is then passed "
                      f"expanded, one slice per model (x.expand({n}, *x.shape))")
            raise FusionArgumentError(
                f"the models cannot run on {' and '.join(what[k] for k in stacked)} "
                f"({torch_said}), which the fused module shares among the {n} models "
                f"(in_dims=None gives every model the whole tensor), but model 0 runs on "
                f"its slice [0]: its dim 0 has size {n}, one slice per model (the outputs "
                f"of a fused module: a fused generator's fakes, a recurrent layer's hidden "
                f"state fed back). To give model i slice i, fuse with in_dims: "
                f"hftc.fuse(models, in_dims={in_dims!r}){expand}"
            ) from cause

    def _model_runs_on_slices(self, values: Sequence[Any], batched: Sequence[bool],
                              stacked: Sequence[int]) -> bool:
        """Whether model 0's graph runs on its slices of the inputs, taking slice 0 of the
        shared inputs ``stacked`` too (shape propagation on a copy of its graph)."""
        graph = self._mode_graphs[self.training].graph
        trial = fx.Graph()
        trial.output(trial.graph_copy(graph, {}))
        per_model = [model_slice(v, 0) if b or k in stacked else v
                     for k, (v, b) in enumerate(zip(values, batched))]
        try:
            annotate_example_values(trial, self._template, per_model, {}, self._model_tensors)
        except Exception:  # noqa: BLE001 - it does not: the inputs are wrong some other way
            return False
        return True
    def _model_tensors(self, index: int = 0) -> dict[str, torch.Tensor]:
        """Copies of model ``index``'s parameters and buffers, by name (constants included)."""
        with torch.no_grad():
            return {
                name: t[index].clone()
                for name, t in list(self.named_parameters(remove_duplicate=False))
                + list(self.named_buffers(remove_duplicate=False))
                if not name.rpartition(".")[2].startswith("_hftc_constant_")
            }

    def _sync_template(self) -> None:
        """Give the meta template the fused tensors' current dtypes (after ``.double()``)."""
        template = self._template
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            owner_path, _, leaf = name.rpartition(".")
            if leaf.startswith("_hftc_constant_"):
                continue
            owner = template.get_submodule(owner_path)
            current = getattr(owner, leaf, None)
            if current is None or current.dtype == t.dtype:
                continue
            meta = torch.empty(t.shape[1:], dtype=t.dtype, device="meta")
            if isinstance(current, nn.Parameter):
                owner._parameters[leaf] = nn.Parameter(meta, current.requires_grad)
            else:
                owner._buffers[leaf] = meta

    def compile(self, *args: Any, **kwargs: Any) -> Program | None:
        """Compile the fused forward for these inputs (in the current mode) without running it.

        Called with no inputs and only ``torch.compile``'s options (``fused.compile()``,
        ``fused.compile(mode="max-autotune")``), it is ``nn.Module.compile``, as PyTorch
        users know it: ``torch.compile`` of the module's calls, in place."""
        inputs = {n.target for n in self._mode_graphs[self.training].graph.nodes
                  if n.op == "placeholder"}
        if not args and set(kwargs) <= _TORCH_COMPILE_OPTIONS and not set(kwargs) & inputs:
            return super().compile(**kwargs)
        values, batched = self._inputs(args, kwargs)
        return self._rewriting_padded_ops(lambda: self._program(values, batched), values,
                                          batched)

    # ------------------------------------------------------------------ other methods

    def __getattr__(self, name: str) -> Any:
        """nn.Module's (parameters, buffers, submodules), then the models' own methods
        (``fused.decode(z)``, ``fused.init_hidden(b)``, nanoGPT's ``generate``): see
        :meth:`_call_method`."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            template = self.__dict__.get("_template")
            cls = type(template)
            function = getattr(cls, name, None) if template is not None else None
            if (not callable(function) or name.startswith("__") or isinstance(function, type)
                    or getattr(nn.Module, name, None) is function):
                raise
            if isinstance(inspect.getattr_static(cls, name), (staticmethod, classmethod)):
                return function  # no model's state: as the class gives it
            return functools.partial(self._call_method, name)

    def _call_method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The models' method ``name`` on the fused module, N results stacked as forward's.

        Fused where it traces: the method is traced as the forward of each model (a
        subclass of the model's class whose forward is that method), fused as forward is
        (in_dims, the first-call check, the strategy), and run on this module's own
        parameters and buffers.  Where it does not trace (Python on values: nanoGPT's
        ``generate`` loops on sizes and samples), the N models run it one by one on views
        of the stacked tensors (gradients reach them)."""
        methods = self.__dict__.setdefault("_method_modules", {})
        if name not in methods:
            methods[name] = self._fuse_method(name)
        fused_method = methods[name]
        if isinstance(fused_method, FusedModule):
            self._share_tensors(fused_method)
            with fused_method._in_dims_set(self._method_in_dims()):
                return fused_method(*args, **kwargs)
        with self._in_dims_set(self._method_in_dims()):
            return self._method_one_by_one(name, args, kwargs)

    def _fuse_method(self, name: str) -> FusedModule | None:
        """A fused module whose forward is the models' method ``name`` (None: it does not
        trace, or its graphs differ per model)."""
        models = self.unfuse()
        for model in models:
            model.__class__ = _method_as_forward(type(model), name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FusionWarning)
                return FusedModule(models, in_dims=self._method_in_dims(), frontend="symbolic",
                                   autotune=self.autotune, check=self.check,
                                   strategy=self.strategy)
        except (TraceError, UnsupportedOperatorError, MismatchError):
            return None

    def _share_tensors(self, other: FusedModule) -> None:
        """Give ``other`` (of the same module tree) this module's parameters and buffers,
        the very tensors (gradients and in-place updates reach them), and its modes; again
        on each call, as ``.to()`` and ``load_state_dict(assign=True)`` replace them."""
        for name, t in self.named_parameters(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            other.get_submodule(owner)._parameters[leaf] = t
        for name, t in self.named_buffers(remove_duplicate=False):
            owner, _, leaf = name.rpartition(".")
            if not leaf.startswith("_hftc_constant_"):
                other.get_submodule(owner)._buffers[leaf] = t
        modules = dict(self.named_modules(remove_duplicate=False))
        for path, sub in other.named_modules(remove_duplicate=False):
            if path in modules:
                sub.training = modules[path].training
        device = next((t.device for t in self.parameters()), None)
        for name, t in list(other.named_buffers()):
            if name.rpartition(".")[2].startswith("_hftc_constant_") and device is not None \
                    and t.device != device:
                owner, _, leaf = name.rpartition(".")
                other.get_submodule(owner)._buffers[leaf] = t.to(device)

    def _method_one_by_one(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Method ``name`` of each model in turn (views of the stacked tensors), its inputs
        split by ``in_dims`` as forward's; the N results stacked."""
        signature = inspect.signature(getattr(type(self._template), name))
        try:
            bound = signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise FusionArgumentError(f"{self.source_type}.{name}: {exc}") from None
        given = set(bound.arguments)
        bound.apply_defaults()
        parameters = list(signature.parameters.values())[1:]
        names = [p.name for p in parameters
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        values = list(bound.args[1:])
        if any(p.kind == p.VAR_POSITIONAL for p in parameters):
            names += [f"*{k}" for k in range(len(values) - len(names))]
        merged, batched = self._merge_inputs(
            values, [n in given or n.startswith("*") for n in names[:len(values)]],
            names[:len(values)])
        loop = self.__dict__.get("_method_loop")
        if loop is None:
            loop = self.__dict__["_method_loop"] = ModelLoop(self)
        return loop(self, merged, batched, method=name, kwargs=bound.kwargs)

    # ------------------------------------------------------------------ inspection

    def last_program(self) -> Program:
        """The most recently compiled program (fused graph, fusion report, source)."""
        if not self._programs:
            raise FusionError("the fused module has not been called yet; call it or .compile(x)")
        return next(reversed(self._programs.values()))

    @property
    def plan(self) -> StrategyChoice | None:
        """How the last compiled program runs, and why: ``plan.chosen`` is "fused" (the
        fused program) or "model_loop" (the N models one by one, on the fused module's
        own tensors); ``plan.reason`` says why ("timed", "cache", "forced", "check" ...)
        and ``plan.times`` what was measured (:mod:`hftc.compile.strategy`)."""
        return self.last_program().plan

    @property
    def fusion_report(self) -> FusionReport:
        """The last compiled program's report: every node, the rule that fused it, the N
        originals it replaced, and what runs as a per-model loop (``.fallbacks``)."""
        return self.last_program().report

    @property
    def fused_graph(self) -> fx.Graph:
        """The last compiled program's fused ``torch.fx.Graph``."""
        return self.last_program().graph

    # ------------------------------------------------------------------ unfusing

    def model_state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """Model ``index``'s ``state_dict`` with the original keys (copies), at its own
        widths (``pad_widths=True``)."""
        index = self._check_index(index)
        padding = getattr(self, "padding", None)
        if padding is not None:
            return {k: padding.unpad(index, k, v[index]).clone()
                    for k, v in self.state_dict().items()}
        return {k: v[index].clone() for k, v in self.state_dict().items()}

    def _check_index(self, index: int) -> int:
        """``index`` as an int, or an error that says what a model index is."""
        try:
            index = operator.index(index)
        except TypeError:
            raise FusionTypeError(
                f"a model index must be an int, got {index!r} ({type(index).__name__}): "
                f"pass an int in range({self.num_models}), e.g. model_state_dict(0)") from None
        if not -self.num_models <= index < self.num_models:
            raise FusionIndexError(
                f"model index {index} out of range for {self.num_models} models: pass an int "
                f"in range({self.num_models}) (or -{self.num_models} to -1 from the end)")
        return index

    def unfuse(self) -> list[nn.Module]:
        """N modules of the original class holding this module's current weights and buffers."""
        return [self.unfuse_model(i) for i in range(self.num_models)]

    def unfuse_model(self, index: int) -> nn.Module:
        """Model ``index`` alone: a module of the original class with its current weights,
        buffers and hyper-parameters (what ``unfuse()[index]`` is), at its own widths
        (``pad_widths=True``)."""
        index = self._check_index(index)
        padded = self.padded_model(index)
        padding = getattr(self, "padding", None)
        return padded if padding is None else padding.original_model(index, padded)

    def padded_model(self, index: int) -> nn.Module:
        """Model ``index`` as the fused program holds it: with ``pad_widths=True``, padded
        to the widest model (hftc.padding's modules); else :meth:`unfuse_model`'s model."""
        index = self._check_index(index)
        model = self.model_copies.build(index, self)
        loop = self.__dict__.get("_shared_model_loop")
        if loop is not None and self._python_state:
            # the attributes forward changed, as model ``index``'s forwards left them
            shell = loop.shells[index]
            for name in self._python_state[1]:
                path, _, key = name.rpartition(".")
                try:
                    value = getattr(shell.get_submodule(path), key)
                except AttributeError:  # (model ``index``'s tree names it otherwise)
                    continue
                setattr(model.get_submodule(path), key, copy.deepcopy(value))
        return model

    # ------------------------------------------------------------------ shrinking

    def _keep_models(self, keep: Sequence[int]) -> None:
        """Keep only models ``keep`` (checked, distinct indices), in that order, in place::

            P  [N, ...]  ->  P.data = P[keep]     (the same Parameter objects, their grads too)
            per-model records (graph meta, attribute overrides, shells) -> their rows `keep`

        What :func:`hftc.keep_models` calls; the optimizers are its business.  Compiled
        programs are dropped (they were made for N models): the next call compiles anew."""
        index = torch.tensor(list(keep), dtype=torch.long)
        n = len(keep)
        with torch.no_grad():
            for p in self.parameters():  # (each tied parameter once)
                grad = p.grad
                p.grad = None  # a grad of the old shape would refuse the new data
                kept = p.data.index_select(0, index.to(p.device))
                _drop_grad_accumulator(p)
                p.data = kept
                if grad is not None:
                    p.grad = grad.index_select(0, index.to(grad.device))
            sliced: dict[int, torch.Tensor] = {}
            for module in self.modules():
                for name, b in module._buffers.items():
                    if b is None or name.startswith(SHARED_CONSTANT_PREFIX):
                        continue  # one copy all models share
                    if id(b) not in sliced:
                        sliced[id(b)] = b.index_select(0, index.to(b.device))
                    module._buffers[name] = sliced[id(b)]
        for module in self.modules():
            if isinstance(module, StackedModule):
                module.num_models = n
        self.num_models = n
        self.model_copies.subset(list(keep))
        self.source_parameter_names = [self.source_parameter_names[i] for i in keep]
        if getattr(self, "padding", None) is not None:
            self.padding = self.padding.subset(keep)
        if self._python_state is not None:  # (which model a message names)
            first, names = self._python_state
            self._python_state = (list(keep).index(first) if first in keep else 0, names)
        for graphs in (*self._mode_graphs.values(), *self._retraced_graphs.values()):
            graphs.originals = [graphs.originals[i] for i in keep]
            for node in graphs.graph.nodes:
                per_model = node.meta.get(ir.PER_MODEL)
                if per_model:
                    node.meta[ir.PER_MODEL] = {key: [values[i] for i in keep]
                                               for key, values in per_model.items()}
                ops = node.meta.get(ir.PER_MODEL_OPS)
                if ops:
                    node.meta[ir.PER_MODEL_OPS] = [ops[i] for i in keep]
        loop = self.__dict__.get("_shared_model_loop")
        if loop is not None:  # the shells keep the Python attributes forward changed
            loop.subset(keep)
        self._programs = {}
        self._mark_stacked()

    # ------------------------------------------------------------------ pickling

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._mark_stacked()

    def __getstate__(self) -> dict:
        # nn.Module's drops a compiled forward (fused.compile()), which is bound to this
        # module: a copy that kept it ran the original's weights and sent it the gradients.
        state = dict(super().__getstate__())
        state["_programs"] = {}  # generated code is recompiled on the next call
        # The models' other methods are fused again on their next call (the shared loop's
        # shells are kept: they hold the Python attributes forward changed).
        for key in ("_method_modules", "_method_loop", "_last_call_program"):
            state.pop(key, None)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedModule:
        """``copy.deepcopy``'s own copy (through ``__getstate__``), then the functions of the
        model copies it keeps (the template, the shells of the models run one by one)
        rebound to the twin's modules: deepcopy keeps a function as it is, and the twin's
        ``unfuse()`` called the original template's (meta) modules otherwise."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        memo.setdefault(id(memo), []).append(self)  # deepcopy's keep-alive: ids stay unique
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        loop = twin.__dict__.get("_shared_model_loop")
        for module in (twin, twin._template, *twin.model_copies.templates,
                       *(loop.shells if loop is not None else ())):
            rebind_functions(module, memo)
        return twin

    def extra_repr(self) -> str:
        return f"num_models={self.num_models}"


#: ``FusedModule.__dict__`` entries made lazily from its models, dropped where it takes
#: another module's models over (:meth:`FusedModule._become`).
_MADE_FROM_MODELS = ("_shared_model_loop", "_method_loop", "_method_modules",
                     "_last_call_program")


def _guard_failure(graph: fx.Graph, values: Sequence[Any],
                   batched: Sequence[bool]) -> FusionArgumentError | None:
    """The error of the first input guard of an exported graph that the inputs fail (a
    size export fixed), or None."""
    from .runtime.guards import check_input_shape

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value, b in zip(placeholders, values, batched):
        for user in node.users:
            if user.target is check_input_shape and isinstance(value, torch.Tensor):
                try:
                    check_input_shape(model_slice(value, 0) if b else value, *user.args[1:],
                                      **user.kwargs)
                except FusionArgumentError as exc:
                    return exc
    return None


def _shapes(values: Sequence[Any], batched: Sequence[bool]) -> tuple:
    """Each tensor input's per-model shape (what a graph exported from them may fix)."""
    return tuple(tuple(v.shape[int(b):]) if isinstance(v, torch.Tensor) else None
                 for v, b in zip(values, batched))


_METHOD_CLASSES: dict[tuple[type, str], type] = {}


def _method_as_forward(cls: type, name: str) -> type:
    """``cls`` with ``forward`` = ``cls.<name>``: what tracing takes for the method."""
    key = (cls, name)
    if key not in _METHOD_CLASSES:
        _METHOD_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": getattr(cls, name), "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _METHOD_CLASSES[key]


class InDimsCall:
    """``fused.with_in_dims(in_dims)``: calls of the fused module (and of its methods)
    with ``in_dims`` in place of the one it was fused with."""

    def __init__(self, fused: FusedModule, in_dims: InDims) -> None:
        self.fused, self.in_dims = fused, in_dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.fused._in_dims_set(self.in_dims):
            return self.fused(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.fused, name)
        if not callable(method):
            raise AttributeError(f"fused.with_in_dims(...).{name}: `{name}` is not a method "
                                 f"of the fused module; read it on the module itself")

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.fused._in_dims_set(self.in_dims):
                return method(*args, **kwargs)
        return call

    def __repr__(self) -> str:
        return f"{type(self.fused).__name__}.with_in_dims({self.in_dims!r})"


def fuse(
    models: Iterable[nn.Module],
    *,
    in_dims: InDims = None,
    example_inputs: tuple | None = None,
    frontend: str = "auto",
    autotune: bool = False,
    check: bool = True,
    strategy: str | None = None,
    checkpoint: int | bool = False,
    pad_widths: bool = False,
) -> FusedModule:
    """Fuse N structurally identical models into one module: ``fused(x)[i] == models[i](x)``.

    Args:
        models: N ``nn.Module`` s of one architecture (the same code; hyper-parameters
            such as dropout ``p`` or a norm's ``eps`` may differ, each model keeps its own).
            They are not changed; the fused module holds stacked copies of their tensors.
        in_dims: as in ``torch.func.vmap``: ``None`` (default) shares every input among
            the N models, ``0`` takes each input stacked per model along dim 0, a tuple
            gives one entry per input of forward.
        example_inputs: compiles the fused forward right away (otherwise the first call
            does), and lets models that ``torch.fx.symbolic_trace`` rejects be traced by
            ``torch.export`` (``frontend="auto"``).
        frontend: ``"auto"``, ``"symbolic"`` or ``"export"``.
        autotune: time each fused op's lowerings (grouped conv in NCHW or channels-last,
            im2col, batched GEMM, a per-model loop ...) on the real shapes and keep the
            fastest, cached on disk per device and shape; otherwise a cost model picks.
        check: run each new program once against models 0, N // 2 and N-1's own forward,
            and every model's whose Python state differs from model 0's (a config dict,
            a dataclass read in forward); where their outputs differ (forward's Python
            took another branch while traced) the models run one by one, with a
            ``FusionWarning``.
        strategy: ``"auto"`` (default): the fused program where the check finds it
            exact, else the models one by one; nothing is timed, so the same script
            gives the same bits every run, whatever the cache holds or the machine's
            load. ``"timed"``: on each new program's first calls (per mode and input
            signature) time the fused forward (+ backward in training mode) against
            the N models run one by one and keep the faster, cached on disk per device,
            shapes and N (the two round differently: the bits may differ between runs;
            not under ``torch.use_deterministic_algorithms(True)``). ``"fused"`` or
            ``"model_loop"`` force one. Both compute the models' answers on the same
            parameters; ``fused.plan`` says which runs and why. ``None`` takes
            ``$HFTC_STRATEGY``, else ``"auto"`` (with ``autotune=True`` always
            ``"auto"``: its whole-forward choice times the loop too).
        checkpoint: activation checkpointing across the fused models, trading compute
            for memory: ``k`` cuts the fused forward into k segments of about equal op
            count, each run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
            (its activations recomputed in backward, dropout masks and BatchNorm
            statistics as in the forward); ``True``: about sqrt(#ops) segments.  The
            values are unchanged, forward and backward.
        pad_widths: fuse models that differ only in layer widths (Linear features, Conv
            channels, the norms and embeddings that follow, attention heads of one head
            dim): each is zero-padded to the widest and masked so that every output,
            gradient and optimizer update of its real units is its own and the padding
            stays exactly zero (:mod:`hftc.padding`); ``unfuse()`` gives each model back
            at its own widths. What padding would change is refused on the first call.

    Returns:
        The ``FusedModule``. Its parameters and buffers are the N models' stacked
        (``[N, *shape]``) under the original names.

    Raises:
        MismatchError: the models differ in structure (the message says where).
        TraceError: a model cannot be traced (the message names the line and what to do).
        FusionArgumentError: a bad argument (an empty list, lazy modules, shared weights).
        FusionTypeError: something other than a list of ``nn.Module`` s.
    """
    return FusedModule(models, in_dims=in_dims, example_inputs=example_inputs,
                       frontend=frontend, autotune=autotune, check=check, strategy=strategy,
                       checkpoint=checkpoint, pad_widths=pad_widths)


__all__ = ["FusedModule", "Program", "fuse", "StackedModule"]
