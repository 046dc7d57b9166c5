"""``hftc.fuse`` and the module it returns: the pipeline, end to end.

::

    models --frontends/--> N fx graphs (train and eval) --match.py--> node mapping
           --stacking.py--> stacked parameters under the original names
                            (lowering/runtime/modules.py)
    first call, per input signature: lowering/pipeline.py's stages
           shapes --passes/--> fused fx graph --chains, codegen--> forward(self, *inputs)
           --check--> run once beside models 0, N // 2, N-1 and each whose Python state
                      differs, alone (module/copies.py): the same outputs?
                      (if not: the N models one by one, with a FusionWarning)
           --strategy choice--> the fused program (strategy="auto", the default: the same
                      bits every run), or the faster as timed (strategy="timed";
                      lowering/strategy.py)
           (autotune=True: --autotune, layout choice--> the fastest lowerings and layout)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import linecache
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import ir
from ..errors import (
    FusionArgumentError,
    FusionNotImplementedError,
    FusionTypeError,
    FusionWarning,
    MismatchError,
    TraceError,
    UnsupportedOperatorError,
    user_line,
)
from ..frontends.closures import check_function_references, rebind_functions
from ..frontends.symbolic import (
    constant_inputs,
    meta_copy,
    trace_models,
)
from ..ir import CONSTANT_INPUTS, EXPORTED_SHAPES, PYTHON_STATE
from ..lowering.autotune import run_program
from ..lowering.checkpoint import check_option as check_checkpoint_option
from ..lowering.compile_guard import compiled_original
from ..lowering.pipeline import ModeGraphs, Program
from ..lowering.runtime.layout import model_slice
from ..lowering.runtime.modules import (
    ContainerAccess,
    RefusedQConfig,
    StackedModule,
    mark_stacked,
    refuse_model_attribute,
    register_fused,
)
from ..lowering.runtime.one_by_one import OneByOne
from ..lowering.strategy import resolve_strategy
from ..match import GraphMatch, match_graphs
from ..passes.registry import aten_spellings, per_model_table
from .copies import EXTRA_STATE_KEY, ModelCopies
from .inputs import InDims, InputHandling, check_in_dims
from .padding import WidthPadding, into_padded, mask_padded_gradients, pad_models
from .programs import ProgramCache
from .stacking import build_module_tree
from .unfuse import COPY_RECORDS, Unfusing
from .usage import (
    NOT_PICKLED,
    check_class_attributes,
    check_copied_modules,
    check_source_attributes,
    check_source_modes,
    check_source_weights,
    mark_outputs,
    note_class_attributes,
    note_copied_modules,
    note_source_weights,
    note_sources,
)


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


def _check_container(models: Any) -> None:
    """Refuse what is not a list of models: a single model, or the models held in a
    dict or ``nn.ModuleDict`` / ``nn.Sequential`` (iterating a dict gives its keys)."""
    if isinstance(models, (dict, nn.ModuleDict)):
        raise FusionTypeError(
            f"hftc.fuse takes a list of models, got a {type(models).__name__} (its keys "
            f"{list(models)[:3]}...); pass its values: hftc.fuse(list(models.values()))")
    if isinstance(models, nn.Module) and not isinstance(models, nn.ModuleList):
        held = (f"; if this {type(models).__name__} holds the N models, pass them as a list: "
                f"hftc.fuse(list(models))" if isinstance(models, nn.Sequential) else "")
        raise FusionTypeError(
            f"hftc.fuse takes a list of models, got a single nn.Module "
            f"({type(models).__name__}); wrap it in a list: hftc.fuse([model]){held}")
    if not isinstance(models, Iterable) or isinstance(models, (str, bytes)):
        raise FusionTypeError(f"hftc.fuse takes a list of nn.Module, got {type(models).__name__}")


def _check_not_scripted(i: int, model: nn.Module) -> None:
    """Refuse a TorchScript module (``torch.jit.script`` / ``torch.jit.trace``), or a model
    holding one: its forward is TorchScript's compiled code, which hftc cannot trace."""
    path, scripted = next(((p, sub) for p, sub in model.named_modules()
                           if isinstance(sub, torch.jit.ScriptModule)), (None, None))
    if scripted is None:
        return
    what = f"model {i}" if path == "" else f"model {i}'s submodule `{path}`"
    original = getattr(scripted, "original_name", type(scripted).__name__)
    raise FusionTypeError(
        f"{what} is a TorchScript module ({original}, made by torch.jit.script or "
        f"torch.jit.trace): hftc traces a model's Python forward, which TorchScript "
        f"replaced by its own compiled code. Fuse the Python modules before scripting "
        f"(hftc.fuse([Net() for _ in range(n)])); to keep a scripted model's weights, load "
        f"them into one: net = Net(); net.load_state_dict(scripted.state_dict())")


def check_models(models: Any) -> list[nn.Module]:
    _check_container(models)
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
        _check_not_scripted(i, m)
        if isinstance(m, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            wrapper = type(m).__name__
            raise FusionTypeError(
                f"model {i} is wrapped in nn.{wrapper} ({type(m.module).__name__} inside): "
                f"hftc fuses the models themselves, and the wrapper's forward (scatter to "
                f"devices, gather) does not trace. Fuse the models inside, "
                f"hftc.fuse([m.module for m in models]) (or fuse before wrapping), then wrap "
                f"the fused module for several devices: DistributedDataParallel(fused) "
                f"(docs/guides/several-gpus-and-machines.md)")
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




def example_constants(model: nn.Module, example_inputs: Any) -> dict[str, Any] | None:
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




def _extra_state_key(prefix: str, path: str) -> str:
    return f"{prefix}{path + '.' if path else ''}{EXTRA_STATE_KEY}"


def _set_loaded_extra_states(module: FusedModule, incompatible_keys: Any) -> None:
    """The load-state-dict post hook of a fused module (called once its tensors and its
    submodules' are loaded): the extra states its ``_load_from_state_dict`` took out."""
    states = module.__dict__.pop("_loaded_extra_states", None)
    if states:
        module._set_extra_states(states)


#: What ``transformers.Trainer.__init__`` reads off its model first, and how its class
#: says it trains a fused module (``hftc.integrations.hf.FusedTrainer`` sets it).
_TRAINER_PROBE = "hf_device_map"
TRAINS_FUSED_MODULES = "trains_fused_modules"


def _refuse_stock_trainer(name: str) -> None:
    """Refuse ``transformers.Trainer(model=fused)`` (or a subclass of it other than
    hftc's) when its ``__init__`` first reads the model (``getattr(model, "hf_device_map",
    None)``, a name no fused module has).  It keeps the dataset columns that forward's
    signature names, and the fused forward's is ``(*args, **kwargs)``: every column was
    dropped ("The batch received was empty"), and one loss, one log and one model's
    checkpoints would follow."""
    if name != _TRAINER_PROBE:
        return
    frame = sys._getframe(2)
    if not frame.f_code.co_filename.replace("\\", "/").endswith("transformers/trainer.py"):
        return
    trainer = frame.f_locals.get("self")
    if getattr(type(trainer), TRAINS_FUSED_MODULES, False):
        return
    caller = frame.f_back
    while caller is not None and (caller.f_globals.get("__name__") or "").startswith(
            "transformers"):
        caller = caller.f_back
    where = "" if caller is None else (
        f" at {caller.f_code.co_filename}:{caller.f_lineno}: "
        f"`{linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()}`")
    raise FusionTypeError(
        f"{type(trainer).__name__}(model=fused){where}: transformers.Trainer trains one "
        f"model: it keeps the dataset columns its forward's signature names (a fused "
        f"module's forward takes *args, **kwargs, so it dropped them all: 'The batch "
        f"received was empty'), and backpropagates, logs, saves and early-stops one model. "
        f"Use hftc.integrations.hf.FusedTrainer(model=fused, args=args, ...) (the same "
        f"arguments; subclass it rather than transformers.Trainer): each model's own loss, "
        f"logs, checkpoints and early stopping (docs/guides/hugging-face-trainer.md)")


def _refuse_fx_tracing() -> None:
    """``torch.fx.symbolic_trace(fused)`` (and what builds on it: ``prepare_fx``,
    ``torch.fx.experimental.optimization.fuse``) reached hftc's own Python with proxies
    (torch's "'len' is not supported in symbolic tracing"): refused, saying what works."""
    raise FusionNotImplementedError(
        f"torch.fx.symbolic_trace of a fused module{user_line()}: its forward picks, "
        f"checks and runs hftc's generated programs in Python on the real inputs, which "
        f"symbolic tracing cannot follow. Trace each model (torch.fx.symbolic_trace(m) for "
        f"m in fused.unfuse()), take the fused graph hftc built (fused.last_program()), or "
        f"capture the fused module with torch.export.export(fused, (x,)) / torch.compile")


class FusedModule(ContainerAccess, InputHandling, ProgramCache, Unfusing, nn.Module):
    """N models fused into one: ``fused(x)[i] == models[i](x)``.

    Every parameter and buffer is the stack of the N originals under the original
    name (``fused.state_dict()["fc.weight"]`` is ``[N, *fc.weight.shape]``).
    The fused forward is compiled on the first call (and again for a new mode or
    input rank/dtype), when shapes are known.
    """

    def _not_a_container_hint(self) -> str:
        # (fused[i], len(fused), torch.optim.SGD(fused): a reach for the N models)
        return ("fused[i] is not model i: model i's output is fused(x)[i], model i itself "
                "fused.unfuse_model(i) (all N: fused.unfuse()), an optimizer's parameters "
                "fused.parameters()")

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
        models = check_models(models)
        unpadded = models
        note_sources(self, models)
        note_source_weights(self, models)
        models, strategy = self._padded_models(models, pad_widths, check, strategy, checkpoint,
                                               _padded)
        self._set_options(models, in_dims, autotune, check, strategy, checkpoint)
        self._check_modes(models)
        _check_initialized(models)
        _check_hooks(models)
        check_function_references(models)
        _check_shared_tensors(models)
        graphs = self._trace(models, example_inputs, frontend)
        #: Which front-end traced the models: "symbolic" (torch.fx) or "export".
        self.frontend = "export" if EXPORTED_SHAPES in graphs[True][0].meta else "symbolic"
        matches = {mode: match_graphs(graphs[mode], models, soft=per_model_table())
                   for mode in (True, False)}
        #: (model index, attributes) of the first model whose forward changed plain
        #: Python attributes while traced (hftc.ir.PYTHON_STATE), or None.
        self._python_state = next(
            ((i, sorted({n for mode in (True, False)
                         for n in graphs[mode][i].meta.get(PYTHON_STATE, [])}))
             for i in range(self.num_models)
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
        note_copied_modules(self)
        note_class_attributes(self, models)
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
        self._keep_mode_graphs(graphs, matches)
        self._programs: dict[Any, Program] = {}
        self.training = models[0].training
        if example_inputs is not None:
            if not isinstance(example_inputs, tuple):
                example_inputs = (example_inputs,)
            self.compile(*example_inputs)

    def _padded_models(self, models: list[nn.Module], pad_widths: bool, check: bool,
                       strategy: str | None, checkpoint: int | bool,
                       padded: tuple[list[nn.Module], WidthPadding] | None,
                       ) -> tuple[list[nn.Module], str | None]:
        """``pad_widths=True``: the models padded to the widest (``padded``: padded already,
        their forwards rewritten at the first call) and the strategy the padding runs."""
        if not isinstance(pad_widths, bool):
            raise FusionArgumentError(f"pad_widths must be True or False, got {pad_widths!r}")
        #: pad_widths=True: how the models were padded to the widest (hftc.module.padding), or
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
            models, self.padding = pad_models(models) if padded is None else padded
            if self.padding is not None:
                strategy = "fused"  # the padded models one by one would only be slower
        return models, strategy

    def _set_options(self, models: list[nn.Module], in_dims: InDims, autotune: bool,
                     check: bool, strategy: str | None, checkpoint: int | bool) -> None:
        """The options ``hftc.fuse`` takes, checked, as this module's attributes."""
        in_dims = check_in_dims(in_dims)
        n = len(models)
        self.num_models = n
        self.in_dims = in_dims
        # A root container indexes as the models do (fused[0] for nn.Sequential models).
        self.source_type = type(models[0]).__name__
        self._container = ContainerAccess.container_kind(models[0])
        for name, flag in (("autotune", autotune), ("check", check)):
            if not isinstance(flag, bool):
                raise FusionArgumentError(f"{name} must be True or False, got {flag!r}")
        #: Time each fused op's lowerings (hftc.lowering.autotune).
        self.autotune = autotune
        #: Activation checkpointing (hftc.lowering.checkpoint): False, True or the number
        #: of segments of the fused forward recomputed in backward.
        self.checkpoint = check_checkpoint_option(checkpoint)
        #: Compare each new program's outputs with models 0, N // 2 and N-1's own, and
        #: every model's whose Python state differs from model 0's (hftc.lowering.check).
        self.check = check
        #: "auto" (the fused program where the check finds it exact: the same bits every
        #: run), "timed" (time it against the models one by one on each new program's
        #: first calls, keep the faster), "fused" or "model_loop" (hftc.lowering.strategy).
        self.strategy = resolve_strategy(strategy, autotune)
        if self.checkpoint and self.strategy == "model_loop":
            raise FusionArgumentError(
                "checkpoint= recomputes the fused program's activations in backward, but "
                "strategy='model_loop' runs the models one by one (nothing fused to "
                "checkpoint): drop one of the two")

    def _keep_mode_graphs(self, graphs: dict[bool, list[fx.GraphModule]],
                          matches: dict[bool, GraphMatch]) -> None:
        """Model 0's graph of each mode and its matching: what every program is compiled
        from (the other models' graphs let go of their modules)."""
        self._mode_graphs: dict[bool, ModeGraphs] = {}
        for mode in (True, False):
            attr_targets = self._stack_constants(graphs[mode], matches[mode])
            graph0 = graphs[mode][0].graph
            graph0.owning_module = None
            originals = [{n0.name: ni.name for n0, ni in m.items()} for m in matches[mode].mapping]
            self._mode_graphs[mode] = ModeGraphs(graph0, originals, matches[mode].method,
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
        self._retraced_graphs: dict[tuple[bool, frozenset[str], tuple], ModeGraphs] = {}
        optional = any(p.op == "placeholder" and p.args == (None,)
                       for p in self._mode_graphs[True].graph.nodes)
        retraceable = optional or self._mode_graphs[True].constants
        #: Traced again from the models' own copies (:meth:`_graphs_for`).
        self._retraceable = bool(retraceable) and self.frontend == "symbolic"

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
                    example_constants(m, example_inputs) for m in models],
                    share_numbers=self.check is not False)
            except TraceError:
                if example_inputs is None or frontend == "symbolic":
                    raise
        if example_inputs is None:
            raise FusionArgumentError("frontend='export' needs example_inputs=(...)")
        from ..frontends.export import export_models

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
        ir.set_training(self, mode)
        self._follow_models_own_train(mode)
        return self

    def _follow_models_own_train(self, mode: bool) -> None:
        """Where the models' classes override ``train(mode)`` to keep some modules in
        another mode (a distiller's ``self.teacher.eval()``, a frozen backbone's batch
        norms), each fused submodule takes the flag the models' own ``train(mode)`` gives
        it, run on their tensor-less copies; the batch norms and dropouts read it at run
        time.  A ``train`` that is not a mode switch (forward-forward's ``train(x_pos,
        x_neg)``, reached from a parent's) leaves every flag ``mode``."""
        copies = self.model_copies
        if not any(type(m).train is not nn.Module.train for m in copies.templates[0].modules()):
            return
        flags = []
        for template, paths in zip(copies.templates, copies.paths):
            try:
                template.train(mode)
            except Exception:  # noqa: BLE001 - not a mode switch: nn.Module.train's flags hold
                ir.set_training(template, mode)
                return
            flags.append({(paths or {}).get(path, path): sub.training
                          for path, sub in template.named_modules()})
        for path, flag in flags[0].items():
            differ = [i for i, own in enumerate(flags) if own.get(path, flag) != flag]
            if differ:
                raise FusionArgumentError(
                    f"fused.train({mode}): the models' own {self.source_type}.train sets "
                    f"`{path}` to {'train' if flag else 'eval'} mode in model 0 and not in "
                    f"model(s) {differ}; a fused module runs one mode per layer for all "
                    f"models: set the same mode in each, or fuse them in separate groups")
            with contextlib.suppress(AttributeError):
                self.get_submodule(path).training = flag

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

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        """The stacked tensors, and each module's extra state (``get_extra_state``) as a
        list of the N models' own under torch's key::

            model i:  {"norm._extra_state": state_i, ...}
            fused:    {"norm._extra_state": [state_0, ..., state_{N-1}], ...}
        """
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # (a forward that changes Python state runs in the loop's shells, which hold it)
        live = self._python_state is not None and "_shared_one_by_one" in self.__dict__
        own_model = functools.cache(self._own_model)  # (each model built once, if at all)
        originals = self.padding.originals if self.padding is not None else None
        for path in self.model_copies.extra_state_paths():
            destination[_extra_state_key(prefix, path)] = self.model_copies.extra_states(
                path, own_model, live, originals)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # The extra states are taken out (no stacked module of ours would claim them) and
        # set once every tensor below is loaded, as torch sets a module's after its tensors
        # (:func:`_set_loaded_extra_states`: a set_extra_state may read or write them).
        strict, missing = args[1], args[2]
        states = {}
        for path in self.model_copies.extra_state_paths():
            key = _extra_state_key(prefix, path)
            if key in state_dict:
                self.model_copies.check_extra_states(key, state_dict[key])
                states[path] = state_dict.pop(key)
            elif strict:
                missing.append(key)
        self.__dict__["_loaded_extra_states"] = states
        hooks = self._load_state_dict_post_hooks
        if _set_loaded_extra_states not in hooks.values():  # (a module pickled before)
            self.register_load_state_dict_post_hook(_set_loaded_extra_states)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _set_extra_states(self, states: dict[str, Sequence[Any]]) -> None:
        """Each model's ``set_extra_state`` with its own state, on its own module holding
        the tensors just loaded; the rows it wrote taken back, and the models fused anew
        where the state changes what the program was built from."""
        undo: list[Callable[[], None]] = []
        # (pad_widths=True: into each model at its own widths, as it was saved; the models
        # are then padded anew if that changed them)
        padding = self.padding
        try:
            changed, loaded = self.model_copies.load_extra_states(
                states, self.padded_model if padding is None else self._own_model, undo,
                None if padding is None else padding.originals)
            self._give_shells_python_state(loaded, undo)
            if changed is not None:
                self._fuse_own_models_anew(
                    f"load_state_dict: the extra state loaded changes {changed}")
        except Exception:
            # refused: the models keep the state the program they run was built from
            # (else unfuse()[i] had the loaded state and fused(x)[i] the old one)
            for put_back in reversed(undo):
                put_back()
            raise
        for i, model in loaded.items():
            self._take_own_tensors(i, model)

    def _give_shells_python_state(self, models: dict[int, nn.Module],
                                  undo: list[Callable[[], None]]) -> None:
        """The attributes forward changes (``self.steps``), as ``models[i]`` holds them, in
        the shell model i runs in one by one: ``unfuse()`` and the next call read the
        shell's (:meth:`padded_model`), which would otherwise override a loaded value."""
        loop = self.__dict__.get("_shared_one_by_one")
        if loop is None or not self._python_state:
            return
        for i, model in models.items():
            for name in self._python_state[1]:
                path, _, key = name.rpartition(".")
                try:
                    shell, value = loop.shells[i].get_submodule(path), getattr(
                        model.get_submodule(path), key)
                    old = getattr(shell, key)
                except AttributeError:  # (model i's tree names it otherwise)
                    continue
                setattr(shell, key, copy.deepcopy(value))
                undo.append(functools.partial(setattr, shell, key, old))

    def _take_own_tensors(self, index: int, model: nn.Module) -> None:
        """Row ``index`` of each stacked tensor from ``model`` (model ``index``'s own, at
        the fused widths) where they differ: what its ``set_extra_state`` wrote."""
        names, padding = self.model_copies.names[index], self.padding
        own = dict(model.named_parameters(remove_duplicate=False))
        own.update(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, t in [*self.named_parameters(remove_duplicate=False),
                            *self.named_buffers(remove_duplicate=False)]:
                mine = own.get(name if names is None else names.get(name, name))
                if mine is None or name.rpartition(".")[2].startswith("_hftc_constant_"):
                    continue
                row = t[index] if padding is None else padding.unpad(index, name, t[index])
                if mine.shape != row.shape or torch.equal(mine.to(t.device, t.dtype), row):
                    continue
                if mine.shape == t.shape[1:]:
                    t[index].copy_(mine)
                else:  # (a narrower model's, pad_widths=True)
                    into_padded(t[index], mine.to(t.device, t.dtype),
                                padding.blocks.get(name, 1))

    def _fuse_own_models_anew(self, why: str, models: Sequence[nn.Module] | None = None,
                              instead: str = "") -> None:
        """Fuse the models again as their own objects now are (an extra state loaded into
        them, or ``fused.apply(fn)``, changed what the program was built from), keeping
        this module's parameter objects: the program runs each model's new Python state,
        never its old one.  ``models``: those objects (else each model's own, as built)."""
        if models is None:
            models = [self._own_model(i) for i in range(self.num_models)]
        instead = instead or ("load each model's state into a model of its own and fuse "
                              "those: m.load_state_dict(state_i); hftc.fuse(models)")
        try:
            refused = type(self)(list(models), **self.fuse_options)
        except Exception as exc:
            raise FusionArgumentError(
                f"{why}, and the models with it do not fuse again ({type(exc).__name__}: "
                f"{exc}); {instead}") from exc
        ids, sources = self.model_ids, self.source_parameter_names
        grads = [(p, p.grad) for p in self.parameters()]
        self._become(refused)
        self._set_model_ids(ids)
        for p, grad in grads:  # (as torch's load leaves them; _become's are for new shapes)
            p.grad = grad
        # the user's models are still the ones fused (not the copies fused anew):
        # hftc.optim.fuse_optimizers on their optimizers finds their parameters
        self.source_parameter_names = sources

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        except (RuntimeError, FusionArgumentError) as exc:
            # (one model's: say what to do; its `_extra_state` is refused before its tensors)
            self._refuse_one_models_state(state_dict, exc)
            if not isinstance(exc, FusionArgumentError):  # (extra state's own says it)
                self._refuse_other_n_state(state_dict, exc)
            raise
        self._mark_stacked()
        return result


    # ------------------------------------------------------------------ calling












    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            _refuse_fx_tracing()
        check_source_modes(self)
        check_copied_modules(self)
        check_class_attributes(self)
        check_source_attributes(self)
        check_source_weights(self)
        if self.padding is not None:
            mask_padded_gradients(self)
        values, batched = self._inputs(args, kwargs)
        try:
            program, how = self._rewriting_padded_ops(
                lambda: self._program_and_way(values, batched), values, batched)
        except (RuntimeError, IndexError, ValueError) as exc:
            self._explain_tensor_mismatch(exc)
            raise
        self.__dict__["_last_call_program"] = program  # (hftc.compile_step reads its plan)
        try:
            with ir.modes_restored_on_error():
                if how is not None:  # the models one by one and/or autotune's layout
                    out = run_program(self, program.forward, how, values, batched)
                    return mark_outputs(out, self.num_models)
                out = program.forward(self, *values)
            out = out if program.output_spec is None else program.output_spec.rebuild(out)
            return mark_outputs(out, self.num_models)  # (a stock loss on it is checked)
        except (RuntimeError, IndexError, ValueError) as exc:
            if program.trial is not None:  # (a failed call's time counts for no way)
                program.trial.last = None
            self._explain_tensor_mismatch(exc)
            if isinstance(exc, RuntimeError):
                self._explain_input_mismatch(values, batched, exc)
            raise



















    # ------------------------------------------------------------------ other methods

    def __setattr__(self, name: str, value: Any) -> None:
        # (fused.temperature = 0.5: the program holds each model's own, not this one)
        refuse_model_attribute(self, "fused", name, value, self.__dict__.get("_template"))
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's (parameters, buffers, submodules), then the models' own methods
        (``fused.decode(z)``, ``fused.init_hidden(b)``, nanoGPT's ``generate``): see
        :meth:`_call_method`."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            _refuse_stock_trainer(name)
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
        loop = self.__dict__.get("_methods_one_by_one")
        if loop is None:
            loop = self.__dict__["_methods_one_by_one"] = OneByOne(self)
        return loop(self, merged, batched, method=name, kwargs=bound.kwargs)

    # ------------------------------------------------------------------ inspection





    # ------------------------------------------------------------------ unfusing






    # ------------------------------------------------------------------ shrinking


    # ------------------------------------------------------------------ pickling

    def __setstate__(self, state: dict) -> None:
        if "_shared_model_loop" in state:  # pickled before the loop's name was one_by_one
            state["_shared_one_by_one"] = state.pop("_shared_model_loop")
        super().__setstate__(state)
        self._mark_stacked()
        if "model_copies" in state:  # (the values as loaded are the ones compared)
            note_class_attributes(self, self.model_copies.templates)

    def __getstate__(self) -> dict:
        # nn.Module's drops a compiled forward (fused.compile()), which is bound to this
        # module: a copy that kept it ran the original's weights and sent it the gradients.
        state = dict(super().__getstate__())
        state["_programs"] = {}  # generated code is recompiled on the next call
        # The models' other methods are fused again on their next call (the shared loop's
        # shells are kept: they hold the Python attributes forward changed).
        for key in ("_method_modules", "_methods_one_by_one", "_last_call_program", "_kept_checks",
                    *NOT_PICKLED, *COPY_RECORDS):
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
        loop = twin.__dict__.get("_shared_one_by_one")
        for module in (twin, twin._template, *twin.model_copies.templates,
                       *(loop.shells if loop is not None else ())):
            rebind_functions(module, memo)
        twin._note_copied_from(self)
        return twin

    def extra_repr(self) -> str:
        return f"num_models={self.num_models}"

    def _get_name(self) -> str:
        # (torch.fx's Tracer.trace asks it first, before it unpacks forward's *args, a
        # Proxy: "Proxy object cannot be iterated")
        caller = sys._getframe(1).f_code
        if caller.co_name == "trace" and caller.co_filename.replace("\\", "/").endswith(
                "torch/fx/_symbolic_trace.py"):
            _refuse_fx_tracing()
        return super()._get_name()

    qconfig = RefusedQConfig()

    def __prepare_scriptable__(self) -> nn.Module:
        """What ``torch.jit.script`` asks a module for first: refused.  The fused forward is
        ``(*args, **kwargs)`` running hftc's generated programs (one per mode and input
        signature, guarded and checked on each call) over Python state, which TorchScript
        cannot compile (its own error: "Unknown type annotation")."""
        raise FusionNotImplementedError(
            f"torch.jit.script of a fused module{user_line()}: its forward runs hftc's "
            f"generated programs (one per mode and input signature, chosen and checked on "
            f"each call), which TorchScript cannot compile. For speed, compile it with "
            f"torch.compile(fused) (or fused.compile()); to deploy with TorchScript, script "
            f"each model: [torch.jit.script(m) for m in fused.unfuse()] (or "
            f"torch.jit.trace(fused, (x,), check_trace=False) after a first call, for "
            f"inputs of that shape)")








_METHOD_CLASSES: dict[tuple[type, str], type] = {}


def _method_as_forward(cls: type, name: str) -> type:
    """``cls`` with ``forward`` = ``cls.<name>``: what tracing takes for the method."""
    key = (cls, name)
    if key not in _METHOD_CLASSES:
        _METHOD_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": getattr(cls, name), "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _METHOD_CLASSES[key]



def takes_one_list_of_models(function: Any) -> Any:
    """``function(models, **options)`` refusing the models given one by one
    (``hftc.fuse(m0, m1, m2)``, where Python's own "takes 1 positional argument but 3
    were given" says nothing of the list)."""
    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 1:
            kinds = ", ".join(type(a).__name__ for a in args[:3])
            raise FusionTypeError(
                f"hftc.{function.__name__} got {len(args)} positional arguments ({kinds}"
                f"{', ...' if len(args) > 3 else ''}){user_line()}: it takes the models as "
                f"one list, hftc.{function.__name__}([m0, m1, ...]), and its options by "
                f"keyword")
        return function(*args, **kwargs)
    return checked


@takes_one_list_of_models
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
            im2col, batched GEMM, one call per model ...) on the real shapes and keep the
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
            stays exactly zero (:mod:`hftc.module.padding`); ``unfuse()`` gives each model back
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


__all__ = ["FusedModule", "Program", "fuse", "StackedModule", "takes_one_list_of_models"]
