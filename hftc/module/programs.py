"""A fused module's programs: one per mode and input signature, compiled on the first
call by :mod:`hftc.lowering.pipeline`'s stages, and the export front-end's re-export for
inputs of other shapes.

::

    call (mode, signature)  --cache hit-->  Program (forward, graph, report, plan)
                            --miss-->       graphs for the call (retraced where inputs are None
                                            or other constants) -> compile_program -> Program

:class:`ProgramCache` is a part of :class:`~hftc.module.fused.FusedModule`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .. import ir
from ..errors import (
    FusionArgumentError,
    FusionError,
    FusionWarning,
    MismatchError,
    RaggedResultError,
    TraceError,
    UnsupportedOperatorError,
    plain_message,
    user_stacklevel,
)
from ..frontends.symbolic import (
    OutputSpec,
    is_python_constant,
    same_constant,
    source_line,
    trace_model,
)
from ..ir import EXPORTED_SHAPES
from ..lowering.autotune import ProgramChoice, run_program
from ..lowering.check import (
    CheckResult,
    compare_with_models,
    input_copies,
    locate_difference,
    preserved_state,
)
from ..lowering.compile_guard import run_eagerly
from ..lowering.pipeline import CompileOptions, ModeGraphs, Program, compile_program
from ..lowering.runtime.layout import model_slice
from ..lowering.runtime.one_by_one import OneByOne
from ..lowering.strategy import StrategyChoice
from ..match import GraphMatch, match_graphs
from ..passes import FusionReport
from ..passes.driver import SHARED_CONSTANT_PREFIX
from ..passes.registry import aten_spellings, per_model_table
from .padding_graph import compute_over_real_units


def guard_failure(graph: fx.Graph, values: Sequence[Any],
                   batched: Sequence[bool]) -> FusionArgumentError | None:
    """The error of the first input guard of an exported graph that the inputs fail (a
    size export fixed), or None."""
    from ..lowering.runtime.guards import check_input_shape

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


def input_shapes(values: Sequence[Any], batched: Sequence[bool]) -> tuple:
    """Each tensor input's per-model shape (what a graph exported from them may fix)."""
    return tuple(tuple(v.shape[int(b):]) if isinstance(v, torch.Tensor) else None
                 for v, b in zip(values, batched))


def _get_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


#: ``torch.compile``'s keyword options (what ``nn.Module.compile`` passes on).
_TORCH_COMPILE_OPTIONS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}



class ProgramCache:
    """(see the module docstring)"""

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

    @staticmethod
    def _fits_exported(placeholders: Sequence[fx.Node], args: tuple, kwargs: dict) -> bool:
        """Whether a call passes the inputs the exported graph takes: no more positional
        ones, only its keywords, each of its inputs given (or defaulted), and no ``None``
        where the example inputs had a tensor (the graph guards it)."""
        from ..lowering.runtime.guards import check_input_shape

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
        refused = None if found is None else guard_failure(found.graph, merged, batched)
        if refused is not None:
            key += (("shapes", input_shapes(merged, batched)),)
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
                             constants: dict[str, Any] | None = None) -> ModeGraphs:
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
        return ModeGraphs(graphs[0].graph, originals, match.method, attr_targets,
                           constants or {}, graphs[0].meta.get(EXPORTED_SHAPES))

    def _export_again(self, merged: Sequence[Any], batched: Sequence[bool],
                      keyword_names: Sequence[str] = ()) -> ModeGraphs:
        """The models (as ``unfuse()`` gives them) exported in the current mode with a
        call's inputs as the example (the last ``len(keyword_names)`` of them as those
        keywords), matched and their constants stacked as at fusing."""
        from ..frontends.export import export_models

        models = self.unfuse()
        graphs = export_models(
            models, lambda i: tuple(model_slice(v, i) if b else v for v, b in zip(merged, batched)),
            modes=(self.training,), aten_spellings=aten_spellings(),
            keyword_names=keyword_names,
            # (the sizes kept symbolic at fusing: a try that failed then is not waited for)
            start=self._mode_graphs[self.training].exported_shapes)[self.training]
        return self._matched_mode_graphs(graphs, models)

    def _rewriting_padded_ops(self, make: Callable[[], Any], values: Sequence[Any],
                              batched: Sequence[bool]) -> Any:
        """``make()`` (this call's program), for models padded to the widest after one
        pass over their forward on this first call's inputs: its ops over a padded dim
        computed on each model's real units (:meth:`_rewrite_padded_ops`), so that the
        first-call check sees the program as it will run.  An op that pass cannot
        compute is named in place of the check's refusal, where the check refuses; one
        whose exactness depends on the values (a sort, a topk, a median: topk(2) of
        model 0's four units and four padded zeros picks a zero once fewer than two
        units are positive) is refused even where this call's check passes."""
        if self.padding is None or self.__dict__.get("_padded_ops_rewritten"):
            return make()
        cannot: UnsupportedOperatorError | None = None
        try:
            self._rewrite_padded_ops(values, batched)
        except UnsupportedOperatorError as exc:
            if getattr(exc, "values_decide", False):
                raise
            cannot = exc  # an op over a padded dim: it matters only if the check refuses
        except Exception:  # noqa: BLE001 - forward not traceable alone: the check decides
            pass
        if cannot is None:
            return make()
        try:
            return make()
        except MismatchError:
            raise cannot from None

    def _rewrite_padded_ops(self, values: Sequence[Any], batched: Sequence[bool]) -> bool:
        """Rebuild this module from padded models whose forwards compute their ops over a
        padded dim on each model's real units
        (:func:`hftc.module.padding_graph.compute_over_real_units`, run on this call's
        inputs), keeping the parameter objects; False where no op needs it (the module
        stays as it is).  Once per module."""
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
        self._become(type(self)(originals, **options, _padded=(rewritten, self.padding)))
        self._padded_ops_rewritten = True
        return True

    @run_eagerly
    def _program_and_way(self, values: Sequence[Any], batched: Sequence[bool],
                         ) -> tuple[Program, ProgramChoice | None]:
        """This call's program and how it runs (None: the fused program).  Calls are
        numbered: strategy="timed" times a call up to the next one only if no other
        program ran between (lowering/strategy.py's CallTiming).  Eager under
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
            kept = self.__dict__.get("_kept_checks")
            program = self._compile_program(values, batched,
                                            None if kept is None else kept.pop(key, None))
            self._programs[key] = program
        return program

    def _graphs_for(self, values: Sequence[Any]) -> ModeGraphs:
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

    def _compile_program(self, values: Sequence[Any], batched: Sequence[bool],
                         kept_check: CheckResult | None = None) -> Program:
        """The program for this call's mode and input signature; ``kept_check``: the
        first-call check this program passed before a ``keep_models`` cut (not run again)."""
        program = compile_program(self, self._graphs_for(values), values, batched,
                                  CompileOptions(autotune=self.autotune,
                                                 strategy=getattr(self, "strategy", "fused"),
                                                 checkpoint=getattr(self, "checkpoint", False)),
                                  kept_check)
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
        or the first-call check (:mod:`hftc.lowering.check`) found its outputs not the models'."""
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
        if report.check is not None and report.check.before_cut:
            return None  # (passed before a cut: the kept models' program, unchanged)
        report.check = compare_with_models(
            self, lambda inputs: self._run_fused(forward, spec, inputs), values, batched)
        if isinstance(report.check.raised, RaggedResultError):
            # Shapes that depend on the data (x[mask] per model): the models' own
            # forwards run them, one by one.
            return str(report.check.raised)
        if report.check.passed:
            return None
        if report.check.copy_raised:  # (the copies cannot run: no program to locate)
            return report.check.difference
        index = report.check.failed_model
        padded = getattr(self, "padding", None) is not None
        where = locate_difference(self, graph, model_graph, report.records, values, batched,
                                  index, self.padded_model(index) if padded else None)
        if padded:
            where = f" ({where})" if where else ""
            return (f"{report.check.difference}{where}: padded to the widest model "
                    f"(pad_widths=True), the fused program does not compute what the "
                    f"original models compute. "
                    f"Their forward mixes across a padded width in its own code (a softmax, "
                    f"mean or sum over a hidden dim, a split or view of a padded Linear's "
                    f"output into parts, an output whose width differs per model), which "
                    f"zero padding changes. Fuse models of one width together instead "
                    f"(hftc.fuse_groups without pad_widths=True, which pads them as here), "
                    f"pass example_inputs=(...) to hftc.fuse, from "
                    f"which hftc computes such ops over each model's real units "
                    f"(hftc.module.padding_graph) or names the op it cannot, or leave such ops to "
                    f"modules that pad (nn.LayerNorm for a hand-written norm, "
                    f"nn.MultiheadAttention or three nn.Linear for a packed q, k, v "
                    f"projection)")
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

    def _one_by_one_program(self, program: Program, values: Sequence[Any],
                            batched: Sequence[bool], why: str) -> Program:
        """The program for models the fused program does not compute: the N models one by
        one, with a warning that says ``why``."""
        message = why
        if getattr(self, "padding", None) is not None:
            # the padded models one by one would run the same inexact padding
            raise MismatchError(f"pad_widths=True refused: {why}")
        try:  # a trial run, on shells of its own (forward may change their attributes)
            with preserved_state(self), torch.no_grad():
                run_program(self, program.forward, ProgramChoice(OneByOne(self)),
                            input_copies(values), batched)
            how = ProgramChoice(self._models_one_by_one())
        except Exception as exc:  # noqa: BLE001 - any failure means: no correct way to run
            if isinstance(exc, FusionError):
                # hftc's own refusal names the cause and the fix (a buffer forward assigns
                # anew at another shape: a cache grown in forward), which the fused
                # program's difference follows from: it goes first
                raise TraceError(f"The models can run neither fused nor one by one: "
                                 f"{plain_message(exc)} (the fused program's check: "
                                 f"{message})") from exc
            raise TraceError(f"{message} The models cannot run one by one either "
                             f"({plain_message(exc)})") from exc
        warnings.warn(f"hftc runs the {self.num_models} models one by one (not fused: no "
                      f"speed-up), because {message}", FusionWarning,
                      stacklevel=user_stacklevel())
        program.how = how
        return program

    def _models_one_by_one(self) -> OneByOne:
        """The one :class:`OneByOne` every program that runs the models one by one shares: one
        set of shells, so the Python attributes forward changes (``self.calls += 1``) are
        each model's own across modes and input signatures, and ``unfuse()`` gives them
        back (a loop per program counted each program's calls apart)."""
        loop = self.__dict__.get("_shared_one_by_one")
        if loop is None:
            loop = OneByOne(self)
            self.__dict__["_shared_one_by_one"] = loop
        return loop

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
        and ``plan.times`` what was measured (:mod:`hftc.lowering.strategy`)."""
        return self.last_program().plan

    @property
    def fusion_report(self) -> FusionReport:
        """The last compiled program's report: every node, the rule that fused it, the N
        originals it replaced, and what runs model by model (``.fallbacks``);
        ``print(report)`` shows one row per op as the user wrote it."""
        return self.last_program().report

    @property
    def fused_graph(self) -> fx.Graph:
        """The last compiled program's fused ``torch.fx.Graph``."""
        return self.last_program().graph
