"""Stage 4, the compile pipeline: model 0's traced graph -> the program a FusedModule runs.

:data:`STAGES`, in the order :func:`compile_program` runs them, each a function of the
program being built (:class:`ProgramState`)::

    shape propagation  model 0's example values on its graph      frontends/symbolic.py
    fusion             model 0's graph + the matching -> fused    passes/
    chains             consecutive fused linears -> one call      chains.py
    codegen            fused fx graph -> forward(self, *inputs)   codegen.py
    check              run once beside models 0, N // 2, N - 1:   check.py
                       not the same outputs -> the N models one by one (pipeline ends);
                       after a keep_models cut, the check the program passed before it
    strategy choice    (autotune=False) strategy="auto": time     strategy.py
                       the fused program against the models one by
                       one (on the first calls, or extra steps if
                       random), keep the faster; "fused" /
                       "model_loop": as forced
    autotune           (autotune=True) time each fused op's       autotune.py
                       lowerings, then chains + codegen again with the chosen ones
    layout choice      (autotune=True) the whole forward as it    layout.py, autotune.py
                       runs fastest: fused, channels-last inputs, the models one by one,
                       or the cost model's lowerings
    checkpointing      (checkpoint=k) the fused forward cut into  checkpoint.py
                       k segments, each recomputed in backward

The check comes before the timing stages (only a program that computes the models'
outputs is worth timing), and so needs the code first.  An error from inside a stage
that is not one of hftc's own (which say what and where) carries a note naming the stage
(``hftc: raised in the compile stage 'fusion'``); its class and message are unchanged.

This layer sits below :mod:`hftc.module.fused`: the FusedModule the program is for is passed in
(``state.fused``), typed as the :class:`ProgramHost` it is to the pipeline: only those
methods are called.
"""

from __future__ import annotations

import copy
import importlib
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import Tensor, nn

from ..errors import FusionError, TraceError
from ..frontends.symbolic import OutputSpec, annotate_example_values, output_spec
from ..passes import FusionReport, fuse_graph
from . import layout
from .autotune import ProgramChoice, autotune_graph, choose_program, cost_model_graph
from .chains import chain_linears
from .check import CheckResult, input_copies, preserved_state
from .checkpoint import checkpointed_forward
from .codegen import compile_graph
from .runtime.layout import model_slice
from .runtime.memory import keep_freed_memory_for_tuning
from .runtime.one_by_one import OneByOne
from .strategy import (
    DETERMINISTIC,
    NOT_TIMED,
    NOT_TIMED_UNCHECKED,
    CallTiming,
    StrategyChoice,
    choose_strategy,
    timing_allowed,
)


@dataclass
class Program:
    """One compiled fused forward: for one mode and one input signature."""

    forward: Any
    graph: fx.Graph
    report: FusionReport
    source: str
    #: Rebuilds an output type the graph returns flat (a dataclass, a ModelOutput).
    output_spec: OutputSpec | None = None
    #: How the forward runs, when autotune measured something faster than the fused
    #: program on the inputs as given: the N models one by one
    #: (hftc.lowering.runtime.one_by_one), channels-last inputs (hftc.lowering.layout), or both.
    how: ProgramChoice | None = None
    #: Whether the forward runs fused or the models one by one, and why (``fused.plan``).
    plan: StrategyChoice | None = None
    #: While strategy="auto" times the first calls: how each call runs (.strategy).
    trial: CallTiming | None = None

    @property
    def one_by_one(self) -> OneByOne | None:
        """The N models one by one (:mod:`hftc.lowering.runtime.one_by_one`) where that is
        how this program runs, else ``None``."""
        return None if self.how is None else self.how.one_by_one

    @property
    def model_loop(self) -> OneByOne | None:
        """:attr:`one_by_one` by its earlier name (kept: ``last_program()`` is public)."""
        return self.one_by_one


@dataclass(frozen=True)
class CompileOptions:
    """What the FusedModule asked for: ``autotune=True`` runs the two timing stages;
    ``strategy`` (:mod:`.strategy`): "auto" times the fused program against the models one
    by one, "fused" / "model_loop" force one; ``checkpoint`` (False, True or a number of
    segments) the checkpointing stage (the fused program is then what runs)."""

    autotune: bool = False
    strategy: str = "fused"
    checkpoint: int | bool = False


@dataclass
class ModeGraphs:
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

    # pickle stores a call_function target by module and __qualname__; torch's
    # boolean_dispatch functions (F.max_pool2d, F.adaptive_max_pool2d ...) have the
    # qualname 'boolean_dispatch.<locals>.fn', so torch.save(fused) failed on them: a
    # pickled graph names such a target by the module attribute bound to it instead.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if any(_ModuleAttribute.needed(n.target) for n in self.graph.nodes):
            state["graph"] = _graph_with_targets(self.graph, _ModuleAttribute.of)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if any(isinstance(n.target, _ModuleAttribute) for n in state["graph"].nodes):
            state["graph"] = _graph_with_targets(state["graph"], _ModuleAttribute.resolve)
        self.__dict__.update(state)


def _graph_with_targets(graph: fx.Graph, change: Callable[[Any], Any]) -> fx.Graph:
    """A copy of ``graph`` with ``change(target)`` for each target ``change`` takes (a
    ``_ModuleAttribute`` or a function needing one); node by node, as fx's own lookup
    table of nodes by target must see the new targets."""
    copied = fx.Graph(tracer_cls=graph._tracer_cls)
    copied._codegen = copy.deepcopy(graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        target = node.target
        if isinstance(target, _ModuleAttribute) or _ModuleAttribute.needed(target):
            target = change(target)
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        env[node] = copied.create_node(node.op, target, args, kwargs, node.name, node.type)
        env[node].meta = copy.copy(node.meta)
    return copied


@dataclass(frozen=True)
class _ModuleAttribute:
    """A function named by ``module.name`` where its ``__qualname__`` does not find it."""

    module: str
    name: str

    @staticmethod
    def needed(target: Any) -> bool:
        """A Python function pickle cannot find by its qualified name, that its module
        binds (builtins pickle by their own ``__reduce__``)."""
        if not isinstance(target, types.FunctionType):
            return False
        module = sys.modules.get(target.__module__ or "")
        if module is None:
            return False
        found: Any = module
        for part in target.__qualname__.split("."):
            found = getattr(found, part, None)
        return found is not target and any(v is target for v in vars(module).values())

    @classmethod
    def of(cls, target: Any) -> _ModuleAttribute:
        module = sys.modules[target.__module__]
        return cls(target.__module__, next(k for k, v in vars(module).items() if v is target))

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # (fx takes callable targets only)
        return self.resolve()(*args, **kwargs)


class ProgramHost(Protocol):
    """What the pipeline asks of the module a program is for: a ``FusedModule``, whose
    program cache (:mod:`hftc.module.programs`) implements these.  Declared here, so that
    this layer names what it calls without importing the module layer above it."""

    num_models: int
    training: bool
    #: model 0's module on meta (its tensors synced by :meth:`_sync_template`)
    _template: nn.Module

    def parameters(self, recurse: bool = True) -> Iterator[Tensor]: ...

    def _sync_template(self) -> None: ...

    def _model_tensors(self, index: int = 0) -> dict[str, Tensor]: ...

    def _explain_input_mismatch(self, values: Sequence[Any], batched: Sequence[bool],
                                cause: Exception) -> None: ...

    def _why_not_fused(self, report: FusionReport, forward: Any, spec: OutputSpec | None,
                       values: Sequence[Any], batched: Sequence[bool], graph: fx.Graph,
                       model_graph: fx.Graph) -> str | None: ...

    def _one_by_one_program(self, program: Program, values: Sequence[Any],
                            batched: Sequence[bool], why: str) -> Program: ...

    def _models_one_by_one(self) -> OneByOne: ...


@dataclass
class ProgramState:
    """The program as the stages build it; each stage fills in its fields."""

    fused: ProgramHost  # the FusedModule the program is for
    mode_graphs: ModeGraphs  # model 0's graph, its matching, its constants
    values: Sequence[Any]
    batched: Sequence[bool]
    graph: fx.Graph | None = None  # the fused graph (fusion)
    report: FusionReport | None = None
    spec: OutputSpec | None = None
    code_graph: fx.Graph | None = None  # the fused graph with its chains (chains)
    forward: Any = None  # codegen
    source: str = ""
    tuning_values: list[Any] = field(default_factory=list)  # autotune's input copies
    backward: bool = False  # autotune times forward + backward
    how: ProgramChoice | None = None  # layout choice
    plan: StrategyChoice | None = None  # strategy choice (or layout choice)
    trial: CallTiming | None = None  # strategy choice, timed on the user's calls
    checkpointed: bool = False  # state.forward is the checkpointed one (checkpointing)
    #: The first-call check this program passed before a ``keep_models`` cut (the check
    #: stage takes it instead of running the check again).
    kept_check: CheckResult | None = None
    #: Set by a stage that decides the program on its own (the check's fallback to the N
    #: models one by one): the stages after it do not run.
    final: Program | None = None

    def program(self) -> Program:
        if self.final is not None:
            return self.final
        return Program(self.forward, self.graph, self.report, self.source, self.spec, self.how,
                       self.plan, self.trial)


def propagate_shapes(state: ProgramState, options: CompileOptions) -> None:
    """Model 0's example values (shapes, dtypes) in ``node.meta`` of its graph."""
    fused, values, batched = state.fused, state.values, state.batched
    fused._sync_template()
    per_model = [model_slice(v, 0) if b else v for v, b in zip(values, batched)]
    try:
        annotate_example_values(state.mode_graphs.graph, fused._template, per_model, {},
                                fused._model_tensors)
    except TraceError as exc:
        fused._explain_input_mismatch(values, batched, exc)
        raise


def fuse(state: ProgramState, options: CompileOptions) -> None:
    """Model 0's graph and the N models' matching -> one fused graph (the rules)."""
    fused, graphs = state.fused, state.mode_graphs
    state.graph, state.report = fuse_graph(
        graphs.graph_module(fused._template), graphs.originals, graphs.match_method,
        fused.num_models, state.batched, graphs.attr_targets)
    state.spec = output_spec(graphs.graph)


def chain(state: ProgramState, options: CompileOptions) -> None:
    """Consecutive fused linears (and ReLUs) -> one ``linear_chain`` call, on a copy."""
    state.code_graph = chain_linears(state.graph, state.fused)


def codegen(state: ProgramState, options: CompileOptions) -> None:
    """The graph with its chains -> Python ``forward(self, *inputs)``."""
    state.forward, state.source = compile_graph(state.code_graph)


def check(state: ProgramState, options: CompileOptions) -> None:
    """Run the program once beside some of the models (``check=True``); where it must not
    run (outputs not the models', Python state forward changes), the N models one by one
    with a warning, and the pipeline ends there."""
    fused = state.fused
    if state.kept_check is not None:
        state.report.check = state.kept_check
    why = fused._why_not_fused(state.report, state.forward, state.spec, state.values,
                               state.batched, state.graph, state.mode_graphs.graph)
    if why is not None:
        state.final = fused._one_by_one_program(state.program(), state.values, state.batched,
                                                why)
        state.final.plan = state.final.report.strategy = StrategyChoice("model_loop", "check")


def choose_strategy_stage(state: ProgramState, options: CompileOptions) -> None:
    """The fused program or the N models one by one (:mod:`.strategy`): as forced by
    ``strategy``; for "auto" (the default) the fused program, which the check found
    exact; for "timed", the faster as timed (forward + backward in training mode)."""
    fused, report = state.fused, state.report
    if options.strategy == "model_loop":
        state.how = ProgramChoice(fused._models_one_by_one())
        state.plan = StrategyChoice("model_loop", "forced")
        report.strategy = state.plan
        return
    if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in state.values):
        # As autotune does (below): the fused step's N-model buffers outgrow glibc's
        # adaptive thresholds and were faulted in again every step (lowering/runtime/memory.py);
        # before the timing, so the fused program is timed as its steps will run.
        keep_freed_memory_for_tuning()
    if options.strategy != "timed" or not timing_allowed() or state.spec is not None \
            or options.checkpoint:
        # (an output rebuilt from a flat tuple, a dataclass: the loop returns the models'
        # own, which the timing cannot take a backward through; checkpoint=: the fused
        # program is what is checkpointed, for the memory)
        timed = options.strategy == "timed" or options.autotune
        state.plan = StrategyChoice("fused", "forced" if options.strategy == "fused" else
                                    DETERMINISTIC if timed and not timing_allowed() else
                                    _not_timed(report) if options.strategy == "auto" else
                                    "checkpointed: not timed" if options.checkpoint else
                                    "outputs rebuilt: not timed")
    else:
        backward = _times_backward(fused)
        state.how, state.plan, state.trial = choose_strategy(
            fused, state.forward, fused._models_one_by_one, state.values, state.batched,
            backward=backward, key_source=state.source)
    report.strategy = state.plan


def _not_timed(report: Any) -> str:
    """The default's reason: "checked" only where the check compared the program with the
    models' own forward (not with ``check=False``, nor where it was skipped)."""
    compared = report.check is not None and not report.check.skipped
    return NOT_TIMED if compared else NOT_TIMED_UNCHECKED


def _times_backward(fused: Any) -> bool:
    """Training programs are timed forward + backward, as a training step runs them (not
    under inference_mode, where no tensor may require grad)."""
    return fused.training and not torch.is_inference_mode_enabled() \
        and any(p.requires_grad for p in fused.parameters())


def autotune(state: ProgramState, options: CompileOptions) -> None:
    """Time each fused op's lowerings on these inputs, then chains and codegen again with
    the lowerings chosen."""
    fused, values, batched = state.fused, state.values, state.batched
    state.backward = _times_backward(fused)
    # Tuning runs the program: on copies of the inputs, which it may write into.
    state.tuning_values = input_copies(values)
    with preserved_state(fused):
        try:
            state.report.lowerings = autotune_graph(state.graph, fused, state.tuning_values,
                                                    backward=state.backward)
        except RuntimeError as exc:  # an input of another dtype / device: say so
            fused._explain_input_mismatch(values, batched, exc)
            raise
    if any(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in values):
        # A fused step's activations outgrow glibc's adaptive thresholds
        # (lowering/runtime/memory.py).
        # After the ops' tuning, whose candidates' buffers of every size would stay in the
        # heap; before the whole forward's, so its candidates run as the steps will.
        keep_freed_memory_for_tuning()
    chain(state, options)
    codegen(state, options)


def choose_layout(state: ProgramState, options: CompileOptions) -> None:
    """The whole forward as it runs fastest on these inputs: the fused program, with
    channels-last inputs where that is safe, the models one by one (not with
    ``checkpoint=``, which checkpoints the fused program), or the cost model's
    lowerings (:func:`~hftc.lowering.autotune.choose_program`).  Not for outputs rebuilt
    from a flat tuple (``state.spec``), which the candidates do not compare."""
    if state.spec is not None:
        return
    fused, report = state.fused, state.report
    device = next((v.device for v in state.values if isinstance(v, torch.Tensor)),
                  torch.device("cpu"))
    cost_graph = cost_model_graph(state.graph, report.lowerings)
    cost_forward, cost_source = (compile_graph(chain_linears(cost_graph, fused))
                                 if cost_graph is not None else (None, ""))
    if options.checkpoint:  # the candidates are timed (and their memory taken) as they run
        checkpoint_segments(state, options)
        if cost_graph is not None:
            cost_forward, _ = checkpointed_forward(chain_linears(cost_graph, fused),
                                                   options.checkpoint, fused)
    how, choice = choose_program(
        fused, state.forward, state.tuning_values, state.batched, backward=state.backward,
        key_source=state.source,
        channels_last=layout.safe(fused._template, state.mode_graphs.graph, device),
        cost_model=cost_forward,
        one_by_one=options.strategy != "fused" and not options.checkpoint)
    if how.forward is not None:  # the cost model's lowerings ran faster together
        state.forward, state.graph, state.source = how.forward, cost_graph, cost_source
        state.code_graph = chain_linears(cost_graph, fused)
        if options.checkpoint:
            state.source += f"\n# checkpointed (checkpoint={options.checkpoint!r})"
        how = replace(how, forward=None)
        for op in report.lowerings:
            if op.chosen != op.default:
                op.overruled, op.chosen = op.chosen, op.default
    state.how = how if how.name != "fused" else None
    report.lowerings.append(choice)
    state.plan = report.strategy = StrategyChoice(
        "model_loop" if how.one_by_one is not None else "fused",
        "autotune" + ("" if how.layout is None else f", {how.layout} inputs"),
        {name: t for name, t in choice.times.items() if name in ("fused", "model_loop")},
        backward=state.backward)


def checkpoint_segments(state: ProgramState, options: CompileOptions) -> None:
    """(``checkpoint=``) The forward that runs cut into segments, each recomputed in
    backward (:mod:`.checkpoint`); not where the N models run one by one.  With autotune
    the layout choice does it first, so that its candidates run checkpointed."""
    if not options.checkpoint or state.checkpointed or (
            state.how is not None and state.how.one_by_one is not None):
        return
    state.checkpointed = True
    state.forward, source = checkpointed_forward(state.code_graph, options.checkpoint,
                                                  state.fused)
    state.source = f"{state.source}\n# checkpointed (checkpoint={options.checkpoint!r}):\n{source}"


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[ProgramState, CompileOptions], None]
    autotune_only: bool = False
    #: Runs only without autotune (whose layout choice decides the same, among more ways).
    not_autotune: bool = False


#: The pipeline, in order (see the module's docstring).
STAGES = (
    Stage("shape propagation", propagate_shapes),
    Stage("fusion", fuse),
    Stage("chains", chain),
    Stage("codegen", codegen),
    Stage("check", check),
    Stage("strategy choice", choose_strategy_stage, not_autotune=True),
    Stage("autotune", autotune, autotune_only=True),
    Stage("layout choice", choose_layout, autotune_only=True),
    Stage("checkpointing", checkpoint_segments),
)


def compile_program(fused: Any, mode_graphs: Any, values: Sequence[Any],
                    batched: Sequence[bool], options: CompileOptions,
                    kept_check: CheckResult | None = None) -> Program:
    """Run :data:`STAGES` on model 0's graph (``mode_graphs``) for ``values``
    (``kept_check``: :attr:`ProgramState.kept_check`)."""
    state = ProgramState(fused, mode_graphs, values, batched, kept_check=kept_check)
    for stage in STAGES:
        if state.final is not None:
            break
        # (autotune times numerically different lowerings: not under deterministic mode)
        tuned = options.autotune and timing_allowed()
        if (stage.autotune_only and not tuned) or (stage.not_autotune and tuned):
            continue
        try:
            stage.run(state, options)
        except FusionError:
            raise  # hftc's own errors say what and where already
        except Exception as exc:  # from inside hftc or torch: say which stage it came from
            exc.add_note(f"hftc: raised in the compile stage {stage.name!r}")
            raise
    return state.program()


__all__ = ["STAGES", "CompileOptions", "Program", "ProgramState", "Stage", "compile_program"]
