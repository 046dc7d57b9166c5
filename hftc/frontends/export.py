"""Stage 1, second front-end: ``torch.export`` for models symbolic tracing cannot follow.

``torch.fx.symbolic_trace`` needs no inputs but stops at data-dependent Python
(``if x.dim() == 3:``, ``len(x)``) and at most third-party models (Hugging Face
transformers 5.x does not trace symbolically at all).  ``torch.export`` runs the
model on fake tensors made from ``example_inputs`` and records ATen ops.  This
module turns its graph into the graph language the rest of hftc speaks, so every
fusion rule is written once, against the symbolic front-end's vocabulary:

::

    exported (training IR, ATen)                      normalised (what the rules read)
    ----------------------------------------------    -----------------------------------------
    p_fc_weight = placeholder  (PARAMETER fc.weight)  fc_weight = get_attr fc.weight
    c_scale     = placeholder  (CONSTANT_TENSOR)      scale = get_attr scale / _hftc_lifted_0
    x           = placeholder  (USER_INPUT)           x = placeholder; check_input_shape(x, ...)
    aten.conv2d.default(x, w, b)                      torch.conv2d(x, w, b)         (== F.conv2d)
    aten.linear.default(x, w, b)                      F.linear(x, w, b)
    aten.batch_norm.default(x, w, b, rm, rv, t, m, e) F.batch_norm(x, rm, rv, w, b, t, m, e)
    aten.embedding.default(w, idx, pad)               F.embedding(idx, w, pad)
    aten.relu.default(x) / aten.add.Tensor(a, b)      torch.relu(x) / torch.add(a, b)
    aten.view.default(x, [s0, 144])                   x.view([s0, 144])
    aten.sym_size.int(x, 0)                           x.size(0)
    aten.slice.Tensor(x, 1, 0, 5)                     x[:, 0:5]
    aten.addmm.default(b, x, w)                       torch.add(b, torch.matmul(x, w))
    aten.arange(..., device=cpu)                      torch.arange(..., device=x.device)
    aten._assert_tensor_metadata(...)                 (dropped)
    output (flat user outputs, out_spec)              output, rebuilt into the model's structure

Resolution of an ATen op ``aten.NAME.overload``, in order: the converter the fusion
rules declare for it (``@rule(..., aten=...)`` in :mod:`hftc.passes`, handed down by
the caller as ``aten_spellings``: ops whose canonical spelling is ``F.*`` with other
argument orders, slicing, ``addmm``), then ``torch.NAME`` when it is the native binding of
the same ATen function (same arguments), then ``F.NAME`` when that is the
native binding, then the Tensor method ``NAME``; an op none of these spell stays
an ATen call, which the driver runs one by one (exact, reported).

Train/eval: export bakes the mode into the graph (``aten.dropout(x, p, True)``,
``batch_norm(..., training=True)``, the ``num_batches_tracked.add_(1)`` of a
batch norm), so each model is exported once per mode, exactly as the symbolic
front-end traces once per mode; the fused module picks the graph of its mode.
Models that run the same program (:mod:`.same_program`) share one export per mode
(:func:`export_models`): fusing N alike models costs about what fusing one does.

Shapes: every dim of every tensor input is exported ``Dim.AUTO``, so the batch
size (and a sequence length, where the model allows) stays symbolic: sizes
the graph needs are read at run time (``x.size(0)``).  Dims the model's code
fixes (a positional table of 32 entries, a batch of 1 in the example: export
specialises sizes 0 and 1) are checked on every call by ``check_input_shape``
nodes, with an error that says which input and dim, never a silent wrong answer.
Python inputs (``k=2``, ``None``) are baked in and checked the same way.
Where torch.export cannot keep every dim symbolic (a CNN whose flatten size pins H and
W through stride-2 stages: kuangliu's ShuffleNetV2 fails inside sympy, or with a
constraint violation), it is tried again with the leading (batch) dim only symbolic,
then with static shapes (:data:`SHAPE_TRIES`); the graph records which
(``GraphModule.meta[ir.EXPORTED_SHAPES]``), and its guards say so when a call has
other sizes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import operator
import unittest.mock
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from .. import ir
from ..errors import TraceError, plain_message
from ..ir import EXPORTED_SHAPES, PYTHON_STATE, bind_arguments, call_signature
from ..lowering.runtime.guards import check_input_shape, check_input_structure, check_input_value
from .same_program import alike_models, reads_tensor_values
from .symbolic import (
    OutputSpec,
    clone_reads_before_assignment,
    generator_refusal,
    python_state_watched,
    source_line,
    trace_hint,
    traceable_forward,
    uniform_mode,
)

aten = torch.ops.aten

#: ``node.meta`` keys carried from the exported graph (module path, source line).
_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


# --------------------------------------------------------------------------- exporting


#: The ways of exporting the example inputs' sizes, tried in order until one exports:
#: every dim ``Dim.AUTO`` (symbolic where the code allows), the leading dim only (a
#: batch of any size), then static shapes (the example's sizes, other sizes exported
#: again when a call brings them).
SHAPE_TRIES = ("every dim", "leading dim", "static")


@dataclass(frozen=True)
class ExportedShapes:
    """How the example inputs' sizes were exported (``dims``: one of :data:`SHAPE_TRIES`),
    and why not more of them symbolic (the failure of the wider try)."""

    dims: str = "every dim"
    why: str = ""

    def describe(self) -> str:
        """``"with the leading (batch) dim only symbolic: torch.export could not keep every
        dim symbolic (NotImplementedError: The inequality ...)"``; "" for every dim."""
        kept = {"every dim": "", "leading dim": "with the leading (batch) dim only symbolic",
                "static": "with static shapes (the example inputs' sizes)"}[self.dims]
        return kept + (f": {self.why}" if kept and self.why else "")


def _dynamic_shapes(args: tuple, kwargs: dict, model: nn.Module | None = None,
                    dims: str = "every dim") -> Any:
    """``Dim.AUTO`` on every dim of every tensor input (export keeps what it can symbolic),
    on the leading dim only (``dims="leading dim"``), or ``None`` (``"static"``).

    By forward's parameter names where they bind: torch matches the spec to forward's
    signature, so the inputs of ``forward(self, *xs)`` are one entry, a tuple (one entry
    per input failed as "inputs has 1 elements, but dynamic_shapes has 2")."""
    if dims == "static":
        return None
    auto = torch.export.Dim.AUTO

    def spec(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return None
        return {d: auto for d in range(v.dim() if dims == "every dim" else min(v.dim(), 1))}

    if model is not None:
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs)
        except (TypeError, ValueError):
            pass
        else:
            parameters = inspect.signature(model.forward).parameters
            if any(parameters[name].kind == inspect.Parameter.VAR_KEYWORD
                   for name in bound.arguments):
                # torch refuses dynamic_shapes for an input taken by **kwargs (docs/
                # DESIGN_NOTES.md, "torch behaviour"): static shapes, one export per size.
                return None
            return {name: pytree.tree_map(spec, value)
                    for name, value in bound.arguments.items()}
    return tuple(pytree.tree_map(spec, a) for a in (*args, *kwargs.values()))


def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every repeat of a tensor object a copy of it.

    torch.export gives a tensor passed twice (``example_inputs=(z, z)``, ``(t,) * 2``)
    one value in its graph: both placeholders exist, but every op reads the last one,
    so the program computed ``forward(b, b)`` for every later call ``forward(a, b)``
    (nanoGPT's ``forward(idx, targets)`` trained on the token ids as targets).  A
    copy is a distinct input, with the same values, dtype and strides.
    """
    seen: set[int] = set()

    def distinct(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in seen:
            return leaf.detach().clone().requires_grad_(leaf.requires_grad)
        seen.add(id(leaf))
        return leaf

    return pytree.tree_map(distinct, (args, kwargs))


@contextlib.contextmanager
def _quiet() -> Any:
    """Export warns about specialised dims and assigned attributes; the guards say it better.
    On an error it prints the partial graph to stderr (pages of it), and logs the traceback
    of an op whose shapes do not fit ("failed while attempting to run meta for aten.mm"):
    the error says where."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch._export", "torch.export",
                                               "torch.fx", "torch._dynamo", "torch.__trace",
                                               "torch.fx.experimental",
                                               "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _traceable_forwards(model: nn.Module) -> Iterator[None]:
    """While exporting, the modules the symbolic front-end traces through with a forward of
    the same math (:data:`hftc.frontends.symbolic.TRACEABLE_FORWARDS`) run that forward here too.

    ``nn.TransformerEncoder.forward`` asks whether a mask is causal by comparing its
    values (``_detect_is_causal_mask``), which torch.export cannot follow: the word
    language model's ``self.encoder(src, mask=self.src_mask)`` failed to export."""
    replaced = []
    for module in model.modules():
        replacement = traceable_forward(module)
        if replacement is not None and "forward" not in module.__dict__:
            module.__dict__["forward"] = functools.partial(replacement, module)
            replaced.append(module)
    try:
        yield
    finally:
        for module in replaced:
            del module.__dict__["forward"]


@contextlib.contextmanager
def _inference_mode_refused(index: int, model: nn.Module) -> Iterator[None]:
    """While exporting, an ``inference_mode`` block in forward raises: non-strict export
    leaves no trace of it in the graph (a ``no_grad`` block at least leaves a
    higher-order op, refused below), so the block's layers got gradients and trained."""
    mode = torch.autograd.grad_mode.inference_mode
    enter = mode.__enter__

    def refusing(context: Any) -> Any:
        if context.mode:
            raise TraceError(
                f"model {index} ({type(model).__name__}): forward has a "
                f"`torch.inference_mode()` block, which torch.export drops from the "
                f"graph (its layers would get gradients). Detach what the block computes "
                f"instead (`y = self.teacher(x).detach()`), or fuse without example_inputs "
                f"where symbolic tracing can follow forward (it records the block)")
        return enter(context)

    mode.__enter__ = refusing
    try:
        yield
    finally:
        mode.__enter__ = enter


def export_models(
    models: Sequence[nn.Module], inputs: Callable[[int], tuple], *, modes: Sequence[bool],
    aten_spellings: Mapping[Any, Converter], keyword_names: Sequence[str] = (),
    start: ExportedShapes | None = None,
) -> dict[bool, list[fx.GraphModule]]:
    """Each model's normalised graph in each mode, with one ``torch.export`` per mode for
    each group of models that run the same program (:mod:`.same_program`), not one per model.

    ``inputs(i)`` is model ``i``'s example inputs, its last ``len(keyword_names)`` passed
    as those keywords (``**kwargs`` inputs; placeholders after the positional ones, in
    that order); ``aten_spellings`` as for :func:`export_model`; ``start``: the first of
    :data:`SHAPE_TRIES` to try (how an earlier export of these models went).
    Model ``i`` reuses the program of the
    first model found alike, normalised at its own parameters and buffers::

        models    T5 T5 T5 T5 (p=0.2) T5       program_difference against the first alike
        exported  0  .  .  3          .        2 exports per mode, not 5
        graph of  0  0  0  3          0        read at each model's own tensors

    A program that read tensor values on the host (``.item()`` of a parameter: export
    gives it no value to specialise on, but an unbacked symbol whose uses the graph may
    have refined) is not reused: each model of the group is exported itself.
    The groups are found once, before exporting (forward may change Python state).

    Where one export needed sizes fixed (:data:`SHAPE_TRIES`), the next ones start there:
    the same failure is not waited for again, and the graphs get the same guards, which
    must match; the models exported before it are exported again so.
    """
    alike = alike_models(models)  # the first model each model runs the program of
    graphs: dict[bool, list[fx.GraphModule]] = {}
    shapes = start or ExportedShapes()
    used: set[str] = set()  # (the tries the graphs were exported with)
    for mode in modes:
        programs: dict[int, tuple[torch.export.ExportedProgram, ExportedShapes]] = {}
        graphs[mode] = []
        for i, model in enumerate(models):
            values = tuple(inputs(i))
            positional = len(values) - len(keyword_names)
            args, kwargs = _unaliased(values[:positional],
                                      dict(zip(keyword_names, values[positional:])))
            reused = programs.get(alike[i])
            if reused is not None:
                graphs[mode].append(normalize_exported(reused[0], model, i, args, kwargs,
                                                       aten_spellings, shapes=reused[1],
                                                       exported=models[alike[i]]))
                # (the attributes its forward changes: the alike model's, by name)
                graphs[mode][-1].meta[PYTHON_STATE] = list(
                    graphs[mode][alike[i]].meta[PYTHON_STATE])
                continue
            changes: list[str] = []
            program, shapes = _export_program(model, i, training=mode, args=args,
                                              kwargs=kwargs, start=shapes, changes=changes)
            used.add(shapes.dims)
            if alike[i] == i and not reads_tensor_values(program):
                programs[i] = program, shapes
            graphs[mode].append(normalize_exported(program, model, i, args, kwargs,
                                                   aten_spellings, shapes=shapes))
            graphs[mode][-1].meta[PYTHON_STATE] = changes
    if len(used) > 1:
        return export_models(models, inputs, modes=modes, aten_spellings=aten_spellings,
                             keyword_names=keyword_names, start=shapes)
    return graphs


def export_model(
    model: nn.Module, index: int, *, training: bool, args: tuple, kwargs: dict | None = None,
    aten_spellings: Mapping[Any, Converter],
) -> fx.GraphModule:
    """Export ``model`` (the ``index``-th of the N) in one mode and normalise its graph.

    ``args``/``kwargs`` are this model's own example inputs; ``aten_spellings`` the
    rules' converters (:func:`hftc.passes.registry.aten_spellings`).  Raises
    :class:`TraceError` naming the model when ``torch.export`` fails.
    """
    args, kwargs = _unaliased(tuple(args), dict(kwargs or {}))
    program, shapes = _export_program(model, index, training=training, args=args,
                                      kwargs=kwargs)
    return normalize_exported(program, model, index, args, kwargs, aten_spellings,
                              shapes=shapes)


def _export_program(
    model: nn.Module, index: int, *, training: bool, args: tuple, kwargs: dict,
    start: ExportedShapes = ExportedShapes(), changes: list[str] | None = None,
) -> tuple[torch.export.ExportedProgram, ExportedShapes]:
    """``torch.export`` of ``model`` in one mode, and how its inputs' sizes were exported:
    the tries of :data:`SHAPE_TRIES` from ``start.dims`` on, until one exports.  A failure
    no fixed size mends (Python on tensor values, ours) is raised at once; the last one as
    a :class:`TraceError` naming the model.  ``changes`` gets the plain attributes the
    exported forward changed (:func:`~.symbolic.python_state_watched`)."""
    why = start.why
    for dims in SHAPE_TRIES[SHAPE_TRIES.index(start.dims):]:
        # (a failed export leaves its symbolic sizes cached on the inputs it was given)
        args, kwargs = _fresh_copies(args, kwargs)
        found: list[str] = []
        assigned: list[str] = []
        try:
            with uniform_mode(model, training), _quiet(), \
                    _inference_mode_refused(index, model), _traceable_forwards(model), \
                    python_state_watched(model, found), _buffer_assignments(model, assigned):
                program = torch.export.export(
                    model, tuple(args), kwargs,
                    dynamic_shapes=_dynamic_shapes(tuple(args), kwargs, model, dims),
                    strict=False,
                )
            _refuse_lost_assignments(program, model, index, assigned)
            if changes is not None:
                changes.extend(found)
            return program, ExportedShapes(dims, why)
        except TraceError:  # ours, already naming the model and the fix
            raise
        except Exception as exc:  # export raises many types: the last one is told
            failure = exc
            if dims == "static" or _reads_values(exc):
                break
            if not why:
                why = (f"torch.export could not keep {dims} symbolic "
                       f"({_shortened(plain_message(exc))})")
    raise _export_failure(model, index, training, failure) from failure


@contextlib.contextmanager
def _buffer_assignments(model: nn.Module, assigned: list[str]) -> Iterator[None]:
    """Record the buffers forward assigns anew (``self.inner.s = self.inner.s + 1``), by
    their names in ``model``, while it is exported."""
    paths = {id(m): path for path, m in model.named_modules()}
    setattr_ = nn.Module.__setattr__

    def recording(module: nn.Module, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and id(module) in paths and \
                module.__dict__.get("_buffers", {}).get(name) is not None:
            path = paths[id(module)]
            assigned.append(f"{path}.{name}" if path else name)
        setattr_(module, name, value)

    with unittest.mock.patch.object(nn.Module, "__setattr__", recording):
        yield


def _refuse_lost_assignments(program: Any, model: nn.Module, index: int,
                             assigned: Sequence[str]) -> None:
    """torch.export drops some buffer assignments from its graph (a buffer of a submodule
    whose forward is not called: ``self.inner.s = ...``); the fused program would then
    leave the buffer as it was, where the model's own forward changes it: refused."""
    kinds = torch.export.graph_signature.OutputKind
    mutated = {spec.target for spec in program.graph_signature.output_specs
               if spec.kind == kinds.BUFFER_MUTATION}
    buffers = program.graph_signature.inputs_to_buffers
    mutated |= {buffers[node.args[0].name] for node in program.graph.nodes
                if node.op == "call_function" and node.target is aten.copy_.default
                and isinstance(node.args[0], fx.Node) and node.args[0].name in buffers}
    lost = sorted({name for name in assigned if name not in mutated})
    if any(isinstance(node.target, torch._ops.HigherOrderOperator)
           for node in program.graph.nodes):
        return  # (a write inside a graph of its own: _emit_ops refuses those, saying so)
    if lost:
        raise TraceError(
            f"model {index} ({type(model).__name__}): forward assigns the buffer "
            f"`{lost[0]}` (module path `{lost[0].rpartition('.')[0] or '<root>'}`) a new "
            f"tensor, and torch.export leaves that assignment out of its graph, so the fused "
            f"models would not update it. Update the buffer in place "
            f"(`{lost[0].rpartition('.')[2]}.copy_(new_value)`), or fuse without "
            f"example_inputs (the symbolic front-end traces the assignment)")


def _fresh_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs as new tensors of the same values, dtypes, strides and
    ``requires_grad``, for each export: torch.export keeps state on an input it failed to
    export with symbolic sizes, and failed again with static shapes on that tensor (the
    same sympy error, also in the next mode's export), where it exports a copy."""
    def fresh(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        copy = (leaf.detach().clone(memory_format=torch.preserve_format)
                if leaf.layout is torch.strided else leaf.detach().clone())  # (sparse)
        return copy.requires_grad_(leaf.requires_grad)

    return pytree.tree_map(fresh, (args, kwargs))


def _reads_values(exc: BaseException) -> bool:
    """An export failure on Python that reads tensor values: no fixed size mends it."""
    return "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__


def _shortened(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit].rstrip() + " ..."


def _export_failure(model: nn.Module, index: int, training: bool,
                    exc: BaseException) -> TraceError:
    """The :class:`TraceError` for a model torch.export cannot export: the model, the mode,
    the user's line and what to change."""
    where = source_line(exc)
    if trace_hint(exc):
        advice = trace_hint(exc).strip()
    elif _reads_values(exc):
        advice = ("This line decides on tensor values in Python, which torch.export "
                  "cannot follow: compute both sides and pick with torch.where(condition, "
                  "a, b), or move the check out of forward.")
    else:
        advice = ("Check that example_inputs are valid inputs of the model "
                  "(model(*example_inputs) runs); Python that decides on tensor values "
                  "must be rewritten with tensor ops (torch.where).")
    return TraceError(
        f"model {index} ({type(model).__name__}) cannot be traced by torch.export with the "
        f"given example_inputs ({'train' if training else 'eval'} mode)"
        f"{f' at {where}' if where else ''}: {plain_message(exc)}. {advice}"
    )


# --------------------------------------------------------------------------- normalising


@dataclass
class Emitter:
    """Emits the normalised graph, copying provenance from the exported node at hand."""

    graph: fx.Graph
    source: fx.Node | None = None

    def _made(self, node: fx.Node) -> fx.Node:
        if self.source is not None:
            for key in _KEPT_META:
                if key in self.source.meta:
                    node.meta[key] = self.source.meta[key]
        return node

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        return self._made(self.graph.call_function(fn, args, kwargs))

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        return self._made(self.graph.call_method(name, args, kwargs))


Converter = Callable[["Emitter", tuple, dict], Any]

#: ATen ops that only assert or annotate; they compute nothing the model returns.
DROPPED = {
    "_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
    "sym_constrain_range_for_size", "_assert_async", "_functional_assert_async",
    "_functional_sym_constrain_range", "_functional_sym_constrain_range_for_size",
}


def fill_defaults(args: tuple, defaults: tuple) -> tuple:
    """``args`` padded with the schema's defaults of the positions not given."""
    return (*args, *defaults[len(args):])


def same_arguments(fn: Callable[..., Any]) -> Converter:
    """Same arguments, another spelling (``aten.linear`` -> ``F.linear``)."""
    def convert(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
        return e.call(fn, *args, **kwargs)

    convert.__name__ = f"same_arguments[{getattr(fn, '__name__', fn)}]"
    return convert


def same_names(fn: Callable[..., Any]) -> Converter:
    """The ATen op's arguments bound by name (its schema, :func:`hftc.ir.bind_arguments`)
    and passed to ``fn`` in ``fn``'s order; ATen-only ones (``cudnn_enabled``) dropped::

        aten.batch_norm(x, w, b, rm, rv, t, m, e, cudnn)  ->  F.batch_norm(x, rm, rv, w, b, t, m, e)
    """
    names = list(call_signature(fn).parameters)

    def convert(e: Emitter, args: tuple, kwargs: dict) -> fx.Node:
        bound = bind_arguments(e.source.target, args, kwargs)
        return e.call(fn, *(bound[name] for name in names))

    convert.__name__ = f"same_names[{getattr(fn, '__name__', fn)}]"
    return convert


def aten_name(e: Emitter) -> str:
    """The ATen op name of the exported node being converted (``"dropout_"``)."""
    return e.source.target.name().split("::")[1].split(".")[0]


def _native_spelling(name: str) -> tuple[str, Any] | None:
    """``torch.NAME`` / ``F.NAME`` / ``Tensor.NAME`` binding the same ATen function."""
    variable_functions = torch._C._VariableFunctions
    fn = getattr(torch, name, None)
    if fn is not None and getattr(variable_functions, name, None) is fn:
        return "call_function", fn
    fn = getattr(F, name, None)
    if fn is not None and getattr(torch._C._nn, name, None) is fn:
        return "call_function", fn
    if hasattr(torch.Tensor, name):
        return "call_method", name
    return None


def _convert(e: Emitter, node: fx.Node, args: tuple, kwargs: dict,
             aten_spellings: Mapping[Any, Converter]) -> Any:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return e.call(target, *args, **kwargs)  # operator.getitem, SymInt arithmetic, ...
    converter = aten_spellings.get(target.overloadpacket)
    if converter is not None:
        return converter(e, args, kwargs)
    name = target.name().split("::")[1].split(".")[0]
    spelling = _native_spelling(name)
    if spelling is None:
        return e.call(target, *args, **kwargs)
    op, fn = spelling
    if op == "call_method":
        return e.method(fn, *args, **kwargs)
    return e.call(fn, *args, **kwargs)


def _emit_path(e: Emitter, value: fx.Node, path: Sequence[Any]) -> fx.Node:
    """``value[0]["h"].field`` for a pytree key path (tuples, dicts, dataclass fields)."""
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            value = e.call(operator.getitem, value, key.idx)
        elif isinstance(key, pytree.MappingKey):
            value = e.call(operator.getitem, value, key.key)
        elif isinstance(key, pytree.GetAttrKey):
            value = e.call(getattr, value, key.name)
        else:
            raise TraceError(f"cannot read input part {key!r} of an exported model")
    return value


def _input_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The forward's parameter name of each positional input (``x``, ``input_ids``)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for k in range(len(args)):
        p = params[k] if k < len(params) else None
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            names.append(f"input_{k}")
        else:
            names.append(p.name)
    return names


def normalize_exported(
    program: torch.export.ExportedProgram, model: nn.Module, index: int, args: tuple,
    kwargs: dict, aten_spellings: Mapping[Any, Converter], *,
    exported: nn.Module | None = None, shapes: ExportedShapes = ExportedShapes(),
) -> fx.GraphModule:
    """An exported program as a graph in the symbolic front-end's language (module docstring).

    Placeholders are the forward's inputs as the user passes them (one per
    positional input, then one per keyword input); parameters, buffers and tensor
    constants are ``get_attr`` nodes of their original names; every ATen op is
    spelled as the symbolic front-end would have seen it.  The returned
    ``GraphModule`` is rooted at the model's own tensors (no copies), also when the
    program was ``exported`` from another model that runs the same program
    (:func:`export_models`); ``shapes``, how its inputs' sizes were exported, is in its
    ``meta[ir.EXPORTED_SHAPES]`` and in the guards' messages.  In four steps::

        exported placeholders (USER_INPUT) -> user inputs + their guards   (_emit_inputs)
        exported placeholders (the rest)   -> get_attr of the model's names (_emit_attributes)
        ATen ops                           -> torch / F / Tensor calls      (_emit_ops)
        exported output                    -> the model's output structure  (_emit_outputs)
    """
    n = _Normalizing(program, model, index, aten_spellings,
                     model if exported is None else exported)
    _emit_inputs(n, args, kwargs, shapes)
    _emit_attributes(n)
    _emit_ops(n)
    _emit_outputs(n)
    clone_reads_before_assignment(n.graph, _buffer_copy)
    n.graph.lint()
    gm = fx.GraphModule(n.attrs, n.graph, class_name=type(model).__name__)
    gm.meta[EXPORTED_SHAPES] = shapes
    return gm


class _Normalizing:
    """What :func:`normalize_exported`'s steps share: the graph being built, the exported
    node -> new value map, the module's attributes, the device of the first tensor input."""

    def __init__(self, program: torch.export.ExportedProgram, model: nn.Module,
                 index: int, aten_spellings: Mapping[Any, Converter],
                 exported: nn.Module) -> None:
        self.program, self.model, self.index = program, model, index
        self.aten_spellings = aten_spellings
        self.exported = exported  # the model export ran (``model`` or one alike)
        self.kinds = torch.export.graph_signature.InputKind
        self.specs = {s.arg.name: s for s in program.graph_signature.input_specs
                      if hasattr(s.arg, "name")}
        self.graph = fx.Graph()
        self.e = Emitter(self.graph)
        self.env: dict[fx.Node, Any] = {}
        self.attrs: dict[str, Any] = {}
        self.device_ref: fx.Node | None = None
        self.example_device: torch.device | None = None
        self._device: fx.Node | None = None

    def is_user_input(self, node: fx.Node) -> bool:
        return node.op == "placeholder" and self.specs[node.name].kind == self.kinds.USER_INPUT

    def device_node(self) -> fx.Node:
        """``x.device`` of the first tensor input, made once, where first needed."""
        if self._device is None:
            self._device = self.e.call(getattr, self.device_ref, "device")
        return self._device


def _emit_inputs(n: _Normalizing, args: tuple, kwargs: dict, shapes: ExportedShapes) -> None:
    """The user's inputs, one placeholder per top-level input, parts read off by key path,
    each checked against what export fixed (runtime/guards.py; where sizes were fixed for
    export to succeed, the guard's message says so: ``shapes``)."""
    program, graph, e = n.program, n.graph, n.e
    names = _input_names(n.model, args, kwargs)
    tops: dict[tuple, fx.Node] = {}
    for k, name in enumerate(names):
        tops[(0, k)] = graph.placeholder(name)
    for key in kwargs:
        tops[(1, key)] = graph.placeholder(key)
    in_spec = program.call_spec.in_spec
    leaf_paths = [p for p, _ in pytree.tree_flatten_with_path(
        pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec))[0]]
    example_leaves = pytree.tree_leaves((args, kwargs))
    for (k, top_value), (top_key, top_node) in zip(
        [*enumerate(args), *kwargs.items()], tops.items()
    ):
        label = names[k] if top_key[0] == 0 else str(k)
        if not isinstance(top_value, torch.Tensor):
            e.call(check_input_structure, top_node, str(pytree.tree_structure(top_value)), label)
    user_inputs = [node for node in program.graph.nodes if n.is_user_input(node)]
    for node, path, example in zip(user_inputs, leaf_paths, example_leaves):
        top = (path[0].idx, path[1].idx if isinstance(path[1], pytree.SequenceKey)
               else path[1].key)
        label = (names[top[1]] if top[0] == 0 else str(top[1])) + pytree.keystr(tuple(path[2:]))
        value = _emit_path(e, tops[top], path[2:]) if len(path) > 2 else tops[top]
        if isinstance(example, torch.Tensor):
            shape = _exported_shape(node.meta["val"], program.range_constraints)
            note = shapes.describe()
            e.call(check_input_shape, value, shape, label, **({"exported": note} if note else {}))
            if n.device_ref is None:
                n.device_ref, n.example_device = value, example.device
        else:
            e.call(check_input_value, value, example, label)
        n.env[node] = value


def _emit_attributes(n: _Normalizing) -> None:
    """Parameters, buffers and constants: get_attr of the names the user knows."""
    lifted = 0
    for node in n.program.graph.nodes:
        if node.op != "placeholder" or n.is_user_input(node):
            continue
        spec = n.specs[node.name]
        target = spec.target
        if spec.kind in (n.kinds.CONSTANT_TENSOR, n.kinds.CUSTOM_OBJ):
            value = n.program.constants[target]
            if isinstance(value, torch.Generator):
                user = next(iter(node.users), None)
                where = f" at {ir.user_line(user) or _where(user)}" if user is not None else ""
                raise TraceError(f"model {n.index} ({type(n.model).__name__}){where}: "
                                 f"{generator_refusal(n.model, value)}")
            try:
                owned = _get_path(n.exported, target)
            except AttributeError:
                owned = None
            if owned is not value:  # created in forward: not an attribute of the model
                target = f"_hftc_lifted_{lifted}"
                lifted += 1
            elif n.exported is not n.model:  # equal to this model's (program_difference)
                value = _get_path(n.model, target)
            n.attrs[target] = value
        else:
            n.attrs[target] = _get_path(n.model, target)
        n.e.source = node
        n.env[node] = n.e._made(n.graph.get_attr(target))


def _emit_ops(n: _Normalizing) -> None:
    """The ATen ops, each in the spelling the symbolic front-end would have seen."""
    e, env, index, model = n.e, n.env, n.index, n.model
    for node in n.program.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and \
                target.name().split("::")[1].split(".")[0] in DROPPED:
            continue
        if _copy_onto_itself(node):
            env[node] = env[node.args[0]]  # (copy_ returns its destination)
            continue
        e.source = node
        if isinstance(target, torch._ops.HigherOrderOperator):
            # e.g. wrap_with_set_grad_enabled around a graph of its own, from a
            # `torch.no_grad()` block in forward (spectral_norm's power iteration)
            raise TraceError(
                f"model {index} ({type(model).__name__}): the exported forward has "
                f"`{node.name}` ({target.name()}) at {_where(node)}, a higher-order op with "
                f"a graph of its own (a `torch.no_grad()` / `torch.enable_grad()` block, "
                f"`torch.cond`, ... inside forward), which hftc cannot fuse. Make the "
                f"forward traceable by torch.fx (hftc's first front-end, which runs such "
                f"a module per model), or move that block out of forward"
            )
        call_args = fx.node.map_arg(node.args, lambda a: env[a])
        call_kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
        if n.device_ref is not None:
            call_args, call_kwargs = _swap_device((call_args, call_kwargs), n.example_device,
                                                  n.device_node)
        try:
            env[node] = _convert(e, node, tuple(call_args), dict(call_kwargs),
                                 n.aten_spellings)
        except Exception as exc:
            raise TraceError(
                f"model {index} ({type(model).__name__}): cannot normalise exported node "
                f"`{node.name}` ({node.target}) at {_where(node)}: {plain_message(exc)}"
            ) from exc


def _emit_outputs(n: _Normalizing) -> None:
    """The outputs, in the model's own structure; buffer mutations as ``copy_``."""
    program, graph, e, model = n.program, n.graph, n.e, n.model
    output = next(node for node in program.graph.nodes if node.op == "output")
    out_kinds = torch.export.graph_signature.OutputKind
    flat = []
    for spec, value in zip(program.graph_signature.output_specs, output.args[0]):
        mapped = n.env[value] if isinstance(value, fx.Node) else value
        if spec.kind == out_kinds.USER_OUTPUT:
            flat.append(mapped)
        elif spec.kind == out_kinds.BUFFER_MUTATION:
            e.source = None
            e.method("copy_", graph.get_attr(spec.target), mapped)
            n.attrs.setdefault(spec.target, _get_path(model, spec.target))
        else:
            raise TraceError(
                f"model {n.index} ({type(model).__name__}): the exported graph has an output "
                f"of kind {spec.kind.name} ({spec.target}), which hftc cannot fuse"
            )
    out_spec = program.call_spec.out_spec
    e.source = None
    if _plain_structure(out_spec):
        graph.output(pytree.tree_unflatten(flat, out_spec))
    else:
        out = graph.output(tuple(flat))
        out.meta[OutputSpec.META_KEY] = OutputSpec(treespec=out_spec)


def _buffer_copy(node: fx.Node) -> bool:
    """``buffer.copy_(value)``: how the exported graph spells ``self.buf = value``."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name == "copy_" and node.op in ("call_method", "call_function") and \
        bool(node.args) and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"


def _copy_onto_itself(node: fx.Node) -> bool:
    """Whether ``node`` is ``aten.copy_(dst, src)`` with ``src`` being ``dst`` itself, written
    by in-place ops: ``self.steps += 1`` on a buffer exports ``add_(b_steps, 1)``, then the
    assignment as ``copy_(b_steps, add_)``.  Nothing to copy; kept, it would change the
    version of a tensor that later ops (``y * self.steps``) saved for backward, which then
    fails where the model's own backward does not."""
    if node.target is not aten.copy_.default or len(node.args) < 2:
        return False
    dst, value = node.args[0], node.args[1]
    while isinstance(value, fx.Node) and value is not dst and value.op == "call_function":
        schema = getattr(value.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or not first.alias_info.is_write \
                or not value.args:
            return False
        value = value.args[0]
    return value is dst


def _exported_shape(val: torch.Tensor, ranges: dict) -> tuple:
    """Per dim: the int export fixed, ``None`` (any size), or ``(low, high)`` bounds the
    model's code imposes (``if x.shape[0] > 100: raise``)."""
    shape: list[Any] = []
    for size in val.shape:
        fixed = size if isinstance(size, int) else size.node.maybe_as_int()
        if fixed is not None:
            shape.append(int(fixed))
            continue
        bounds = ranges.get(size.node.expr)
        low, high = _finite(getattr(bounds, "lower", None)), _finite(getattr(bounds, "upper", None))
        low = low if low is not None and low > 2 else None
        shape.append(None if low is None and high is None else (low, high))
    return tuple(shape)


def _finite(bound: Any) -> int | None:
    try:
        return int(bound) if bound is not None and bool(bound.is_finite) else None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _swap_device(value: Any, device: torch.device, make: Callable[[], fx.Node]) -> Any:
    """The example's device baked into factory ops -> the input's device read at run time,
    so a fused module moved with ``.to()`` makes its masks and ranges where it runs."""
    return fx.node.map_aggregate(
        value, lambda v: make() if isinstance(v, torch.device) and v == device else v)


def _plain_structure(spec: pytree.TreeSpec) -> bool:
    """Only tuples, lists, dicts and leaves: an fx output node holds them as they are."""
    if spec.is_leaf():
        return True
    if spec.type not in (tuple, list, dict):
        return False
    return all(_plain_structure(c) for c in spec.children())


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    path = str(next(reversed(stack.values()))[0]) if stack else ""
    return f"module path `{path or '<root>'}`"


def _get_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root
