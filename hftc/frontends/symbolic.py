"""Stage 1 of the pipeline: N ``nn.Module`` instances -> N ``torch.fx`` graphs.

Each model is traced twice with ``torch.fx.symbolic_trace``, once with every
submodule in train mode and once in eval mode: symbolic tracing bakes Python
values such as ``self.training`` into the graph (``F.dropout(x, p,
self.training)``, ``if self.training:``), so the fused module keeps one graph
per mode and picks the one that matches ``fused.training`` at run time.

Shapes are not needed to trace.  They are propagated later, once per input
signature, by running model 0's graph on ``meta`` tensors, or for real on a copy of
its tensors where one model's forward is small (:func:`annotate_example_values`):
every node then carries
``node.meta["example_value"]``, the value model 0 computes there (a meta tensor,
an int, a tuple ...), which is what the fusion rules read to know ranks,
dtypes and Python types.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import dataclasses
import functools
import inspect
import operator
import os
import random
import sys
import traceback
import types
import unittest.mock
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from .. import errors
from ..errors import (
    FusionError,
    TraceError,
    UnsupportedOperatorError,
    plain_message,
)
from ..ir import (
    BUFFER_ASSIGNMENT,
    CONSTANT_INPUTS,
    EXAMPLE_VALUE,
    PYTHON_STATE,
    TORCH_RANDOM_DRAWS,
    apply_function,
    bind,
    enter_autocast,
    exit_autocast,
    is_user_file,
    reentrant_checkpoint_output,
    return_statement_trace,
    set_training,
    user_frame_trace,
    user_line,
)
from ..lowering.runtime import attention as rt_attention
from .closures import rebind_functions


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """How to rebuild a model's output from the flat tuple a graph returns.

    Output types an fx output node cannot hold (a dataclass, a transformers
    ``ModelOutput``) leave the graph as a flat tuple of their leaves; the fused
    module rebuilds the model's own type, each tensor stacked.  Kept in the output
    node's ``meta[OutputSpec.META_KEY]``.
    """

    META_KEY = "hftc_output_spec"

    treespec: Any = None  # a pytree TreeSpec (torch.export's out_spec)
    dataclass: type | None = None  # a dataclass built by the traced forward
    fields: tuple[str, ...] = ()

    def rebuild(self, flat: Sequence[Any]) -> Any:
        if self.treespec is not None:
            return torch.utils._pytree.tree_unflatten(list(flat), self.treespec)
        return build_dataclass(self.dataclass, **dict(zip(self.fields, flat)))


def build_dataclass(cls: type, **fields: Any) -> Any:
    """``cls(**fields)``; for a dataclass with fields its ``__init__`` does not take
    (``field(init=False)``, set in ``__post_init__``), made without ``__init__`` and every
    field set as forward left it: ``__post_init__`` again on stacked fields would compute
    over the wrong dims (``argmax(1)`` of ``[N, B, C]`` logits)."""
    if all(f.init for f in dataclasses.fields(cls)):
        return cls(**fields)
    built = cls.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(built, name, value)
    return built


def output_spec(graph: fx.Graph) -> OutputSpec | None:
    """The :class:`OutputSpec` of a traced graph, or None when it returns plain structures."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    return output.meta.get(OutputSpec.META_KEY)


def _flatten_dataclass_output(graph: fx.Graph) -> None:
    """``return Out(logits=y, extra=x)`` -> ``return (y, x)`` + an :class:`OutputSpec`.

    Symbolic tracing records a dataclass built in ``forward`` as a call of its class;
    fused, every field must carry the model dim, so the fields leave the graph one
    by one and the fused module builds the dataclass around the stacked values.
    """
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    built = output.args[0]
    if not isinstance(built, fx.Node) or built.op != "call_function":
        return
    if built.target is build_dataclass:  # every field given (Tracer.create_arg)
        cls, fields = built.args[0], tuple(built.kwargs)
        values = tuple(built.kwargs.values())
    elif isinstance(built.target, type) and dataclasses.is_dataclass(built.target):
        cls = built.target
        try:
            bound = inspect.signature(cls).bind(*built.args, **built.kwargs)
        except TypeError:
            return
        bound.apply_defaults()
        fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        values = tuple(bound.arguments.get(f) for f in fields)
    else:
        return
    output.args = (values,)
    output.meta[OutputSpec.META_KEY] = OutputSpec(dataclass=cls, fields=fields)
    if not built.users:
        graph.erase_node(built)


def traceable_forward(module: nn.Module) -> Callable[..., Any] | None:
    forward = type(module).forward
    for cls in type(module).__mro__:
        if cls in TRACEABLE_FORWARDS and getattr(cls, "forward", None) is forward:
            return TRACEABLE_FORWARDS[cls]
    return None


class _Tracer(fx.Tracer):
    """``symbolic_trace``'s tracer, tracing through :data:`TRACEABLE_FORWARDS` modules.

    Buffers are proxies too (``get_attr`` nodes), as parameters are: with fx's default a
    buffer read in forward is the real tensor, so an in-place update of it that involves
    no traced value (``self.ema.mul_(0.9)``, ``self.count += 1``) ran once, on the
    original model, while tracing, and was missing from the graph.  Grad-mode changes,
    buffer assignments and custom autograd Functions are recorded too, and Python's
    random draws refused; torch's random draws are nodes even from constant arguments, and
    so are autocast regions (the context managers below, entered by :meth:`trace`).

    ``leaf``: modules it keeps as ``call_module`` nodes besides torch.nn's (the padded
    modules of ``pad_widths=True``, whose analysis compares two models node by node).
    """

    proxy_buffer_attributes = True

    def __init__(self, leaf: Callable[[nn.Module], bool] | None = None) -> None:
        # ``from torch.nn.utils.rnn import pack_padded_sequence`` in a model's module: fx
        # wraps such global names; attribute calls are wrapped by _sequence_packing_recorded.
        super().__init__(autowrap_functions=tuple(
            getattr(torch.nn.utils.rnn, name) for name in _SEQUENCE_PACKING))
        #: names of the root's buffers (set by trace), and the graph's nodes that are a
        #: buffer or an in-place update of one
        self._buffer_names: set[str] = set()
        self._buffer_aliases: set[fx.Node] = set()
        #: id(buffer) -> the value forward assigned to it (its later reads in forward)
        self._assigned_buffers: dict[int, fx.Proxy] = {}
        #: the autograd Functions (given a callable) whose forward is being traced through
        self._functions_traced_through: list[type] = []
        #: forward's inputs traced as these Python values, not as traced values (set by
        #: trace_model: :func:`constant_inputs`)
        self.constant_inputs: dict[str, Any] = {}
        #: the traced value Python's control flow asked the truth of (the failure's node)
        self.undecidable: fx.Node | None = None
        #: the frame of :meth:`trace`: a node's line of the user's code is one inside it
        self._trace_frame: types.FrameType | None = None
        self._leaf = leaf

    def _proxy_placeholder(self, name: str, concrete_args: Any, sig: inspect.Signature,
                           fn_for_analysis: Callable[..., Any]) -> Any:
        # Every input keeps its placeholder (its name and default: calls bind to them);
        # forward sees a constant input's value, so `if has_mask:` is Python again.
        placeholder = super()._proxy_placeholder(name, concrete_args, sig, fn_for_analysis)
        if name in self.constant_inputs and not (concrete_args and name in concrete_args):
            return self.constant_inputs[name]
        return placeholder

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # Each node's line of the user's code, which a mismatch between the models names.
        node = super().create_node(*args, **kwargs)
        if node.stack_trace is None:
            trace = user_frame_trace(below=self._trace_frame)
            if trace is not None:
                node.stack_trace = trace
        return node

    def to_bool(self, obj: fx.Proxy) -> bool:
        self.undecidable = obj.node
        return super().to_bool(obj)

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        self.undecidable = obj.node
        return super().iter(obj)

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, *rest: Any,
                     **options: Any) -> fx.Proxy:
        """Record an in-place method on a buffer with its other tensor arguments detached.

        Eager code updates a buffer (running statistics, an EMA, a step counter) under
        ``torch.no_grad()``, or assigns it a new tensor, which replaces the old one.  In
        the graph both are in-place updates of the stacked buffer: one that carried
        gradient would tie the buffer to the step's autograd graph, and each step's to
        the last.  A buffer carries no gradient from one forward to the next.
        """
        inplace = (kind == "call_method" and isinstance(target, str) and target.endswith("_")
                   and not target.startswith("_") and args and isinstance(args[0], fx.Proxy)
                   and args[0].node in self._buffer_aliases)
        if inplace:
            def detached(a: Any) -> Any:
                return (super(_Tracer, self).create_proxy("call_method", "detach", (a,), {})
                        if isinstance(a, fx.Proxy) else a)

            args = (args[0], *(detached(a) for a in args[1:]))
            kwargs = {k: detached(v) for k, v in kwargs.items()}
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **options)
        if inplace or (kind == "get_attr" and target in self._buffer_names):
            self._buffer_aliases.add(proxy.node)
        return proxy

    def create_arg(self, a: Any) -> Any:
        # A dataclass that is also a dict (transformers' ModelOutput, an OrderedDict): fx
        # takes the dict branch first and records a plain dict, so the fused module
        # returned a dict (``out.logits`` failed).  Recorded as a build of its class, as
        # fx records other dataclasses (``_flatten_dataclass_output`` then splits it).
        # A dataclass with fields its __init__ does not take (set in __post_init__): fx
        # records a call of the class with every field, which __init__ refuses; built
        # field by field instead (:func:`build_dataclass`).
        if dataclasses.is_dataclass(a) and not isinstance(a, type):
            every = all(f.init for f in dataclasses.fields(a))
            if isinstance(a, dict) or not every:
                kwargs = {f.name: self.create_arg(getattr(a, f.name))
                          for f in dataclasses.fields(a) if f.init or not every}
                return self.create_node("call_function", build_dataclass, (type(a),), kwargs)
        if isinstance(a, torch.Generator):
            raise TraceError(generator_refusal(self.root, a))
        return super().create_arg(a)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if id(attr_val) in self._assigned_buffers:  # assigned by this forward: its new value
            return self._assigned_buffers[id(attr_val)]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._leaf is not None and self._leaf(m):
            return True
        if traceable_forward(m) is not None:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self._trace_frame = sys._getframe()
        with self._buffer_assignments_recorded(root), self._grad_mode_recorded(), \
                self._autograd_functions_recorded(), self._torch_random_recorded(), \
                self._autocast_recorded(), self._sequence_packing_recorded(), \
                _size_varargs_packed(), _python_random_refused():
            replacement = traceable_forward(root) if isinstance(root, nn.Module) else None
            if replacement is None:
                return self._output_line(super().trace(root, concrete_args), root)
            # The root itself is such a module: trace the replacement as its forward.
            original = type(root)
            root.__class__ = type(original.__name__, (original,), {"forward": replacement})
            try:
                return self._output_line(super().trace(root, concrete_args), root)
            finally:
                root.__class__ = original

    @staticmethod
    def _output_line(graph: fx.Graph, root: Any) -> fx.Graph:
        """``graph`` (its wrapped calls unmarked), its output node on forward's
        ``return`` line (:func:`~hftc.ir.return_statement_trace`)."""
        graph = _unmark_wrapped(graph)
        output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
        if output is not None and output.stack_trace is None:
            forward = type(root).forward if isinstance(root, nn.Module) else root
            output.stack_trace = return_statement_trace(forward)
        return graph

    @contextlib.contextmanager
    def _autograd_functions_recorded(self) -> Iterator[None]:
        """While tracing, ``MyFunction.apply(traced values)`` is one node of the graph (which
        the fused module runs per model), where fx alone would trace through its forward
        and drop its backward (a gradient reversal would reverse nothing)."""
        function = torch.autograd.Function
        apply = function.__dict__["apply"]
        tracer = self

        def recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            traced = any(isinstance(leaf, fx.Proxy) for leaf in leaves)
            if traced and cls is CheckpointFunction and not kwargs:
                # torch.utils.checkpoint(fn, *args, use_reentrant=True): its value and
                # gradient are fn's.  Traced as fn, in the caller's grad mode: its apply
                # runs forward under no_grad, and a trace through it recorded fn's ops
                # without gradient (and the end of fn's own no_grad as no_grad again,
                # which left the caller's grad mode off).  The fused program keeps fn's
                # activations (no recompute in backward: the memory it saves is not).
                # Without an input that requires grad, torch's output has no gradient
                # (each traced output goes through ir.reentrant_checkpoint_output).
                function, _preserve_rng_state, *inputs = args
                return torch.utils._pytree.tree_map(
                    lambda out: tracer.create_proxy(
                        "call_function", reentrant_checkpoint_output, (out, *inputs), {})
                    if isinstance(out, fx.Proxy) else out, function(*inputs))
            # Another Function given a callable is traced through, as before: its
            # callable is the model's own code, and what it computes is recorded op by
            # op (a change of grad mode inside it is refused: :meth:`_grad_mode_recorded`).
            if traced and not any(callable(leaf) and not isinstance(leaf, fx.Proxy)
                                  for leaf in leaves):
                return tracer.create_proxy("call_function", bind(apply_function, cls), args,
                                           kwargs)
            if not traced:
                return apply.__func__(cls, *args, **kwargs)
            tracer._functions_traced_through.append(cls)
            try:
                return apply.__func__(cls, *args, **kwargs)
            finally:
                tracer._functions_traced_through.pop()

        function.apply = classmethod(recording_apply)
        try:
            yield
        finally:
            function.apply = apply

    @contextlib.contextmanager
    def _autocast_recorded(self) -> Iterator[None]:
        """While tracing, entering and leaving an autocast region in forward (``with
        torch.autocast("cpu", dtype=torch.bfloat16):``, also ``enabled=False`` inside the
        caller's autocast) are nodes of the graph, ``ir.enter_autocast`` and
        ``ir.exit_autocast``, where fx alone would drop them: the fused program ran
        the region in the caller's precision."""
        region = torch.amp.autocast_mode.autocast
        enter, exit_ = region.__enter__, region.__exit__
        tracer = self
        entered: list[fx.Proxy] = []

        def recording_enter(context: Any) -> Any:
            result = enter(context)
            if getattr(tracer, "graph", None) is not None:
                entered.append(tracer.create_proxy(
                    "call_function", enter_autocast,
                    (context.device, context.fast_dtype, context._enabled,
                     context._cache_enabled), {}))
            return result

        def recording_exit(context: Any, *exc: Any) -> Any:
            result = exit_(context, *exc)
            if entered and getattr(tracer, "graph", None) is not None:
                tracer.create_proxy("call_function", exit_autocast, (entered.pop(),), {})
            return result

        region.__enter__, region.__exit__ = recording_enter, recording_exit
        try:
            yield
        finally:
            region.__enter__, region.__exit__ = enter, exit_

    @contextlib.contextmanager
    def _torch_random_recorded(self) -> Iterator[None]:
        """While tracing, a call of one of torch's random functions (``torch.randn(4)``,
        ``torch.rand(())``, ``torch.bernoulli(p)`` ...) is a node of the graph, drawn anew
        at every call and per model, also when no traced value goes in.

        fx records a call only when a traced value goes in: with constant arguments it
        ran the draw once, while tracing, and kept the drawn tensor as a constant: the
        same noise at every call and for every model, and ``if torch.rand(()) < p`` (a
        layer dropped at random) taken always or never.  As a node, such a branch is
        refused (a traced value cannot decide Python's control flow), and said so."""
        with self._calls_recorded(torch, TORCH_RANDOM_DRAWS, only_traced=False):
            yield

    @contextlib.contextmanager
    def _sequence_packing_recorded(self) -> Iterator[None]:
        """While tracing, ``nn.utils.rnn.pack_padded_sequence(x, lengths)`` and its kin are
        one node each (as fx's ``wrap`` makes them), where fx would trace into their
        Python and fail (``lengths`` made a list, sorted).  The recurrent layer given the
        PackedSequence then runs one by one (reported), the packing once if shared."""
        with self._calls_recorded(torch.nn.utils.rnn, _SEQUENCE_PACKING, only_traced=True):
            yield

    @contextlib.contextmanager
    def _calls_recorded(self, namespace: Any, names: Sequence[str], *,
                        only_traced: bool) -> Iterator[None]:
        """While tracing, a call of ``namespace.<name>`` is a ``call_function`` node (with
        ``only_traced``, only where a traced value goes in; else it runs as it is)."""
        tracer = self
        saved = {name: getattr(namespace, name) for name in names}

        def recording(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def recorded(*args: Any, **kwargs: Any) -> Any:
                traced = not only_traced or any(
                    isinstance(leaf, fx.Proxy)
                    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)))
                if getattr(tracer, "graph", None) is None or not traced:
                    return fn(*args, **kwargs)
                return tracer.create_proxy("call_function", fn, args, kwargs)
            return recorded

        for name, fn in saved.items():
            setattr(namespace, name, recording(fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(namespace, name, fn)

    @contextlib.contextmanager
    def _grad_mode_recorded(self) -> Iterator[None]:
        """While tracing, a change of grad mode in forward (``with torch.no_grad():``,
        ``torch.enable_grad()``, ``torch.set_grad_enabled(...)``) is also a node of the graph,
        ``torch._C._set_grad_enabled(mode)``, where fx alone would drop it (and a teacher
        network run under ``no_grad`` would get gradients).  Traced with grad enabled, so
        that a caller's own ``no_grad`` around ``hftc.fuse`` is not taken for the model's."""
        real = torch._C._set_grad_enabled
        caller_mode: list[fx.Proxy] = []

        def record(mode: bool) -> None:
            if getattr(self, "graph", None) is None:
                return
            if self._functions_traced_through:
                # Function.apply runs forward under no_grad, which the trace does not
                # see: a no_grad block in it would restore "no grad", not the caller's.
                name = self._functions_traced_through[-1].__qualname__
                raise UnsupportedOperatorError(
                    f"the autograd Function {name}, given a callable, changes grad mode "
                    f"inside its forward, which hftc cannot trace. For a checkpoint, use "
                    f"torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True) "
                    f"or use_reentrant=False, which hftc traces as fn; else call the "
                    f"callable's code in forward directly")
            if not caller_mode:  # the caller's mode, read where forward first changes it
                caller_mode.append(self.create_proxy("call_function", torch.is_grad_enabled,
                                                     (), {}))
            # Traced with grad enabled, so enabling it is a return to the caller's mode
            # (the end of a no_grad block): under a caller's no_grad it stays disabled.
            self.create_proxy("call_function", real, (caller_mode[0] if mode else False,), {})

        inside: list[bool] = []

        def recording(mode: bool) -> None:
            if inside:  # a torch function mode handed the call back by this name: once
                real(mode)
                return
            inside.append(True)
            try:
                real(mode)
            finally:
                inside.pop()
            record(mode)

        # An inference_mode block computes without gradient too: recorded as no_grad.
        inference = torch.autograd.grad_mode.inference_mode
        enter, exit_ = inference.__enter__, inference.__exit__

        def recording_enter(context: Any) -> None:
            enter(context)
            if context.mode:
                record(False)

        def recording_exit(context: Any, *exc: Any) -> None:
            exit_(context, *exc)
            if context.mode:
                record(True)

        with torch.enable_grad():  # entered and left while nothing is recorded
            torch._C._set_grad_enabled = recording
            inference.__enter__, inference.__exit__ = recording_enter, recording_exit
            try:
                yield
            finally:
                torch._C._set_grad_enabled = real
                inference.__enter__, inference.__exit__ = enter, exit_

    @contextlib.contextmanager
    def _buffer_assignments_recorded(self, root: Any) -> Iterator[None]:
        """While tracing, ``module.buf = <traced value>`` becomes ``buf.copy_(value)`` in the
        graph, and the buffer stays the model's own tensor.

        ``self.count += 1`` is such an assignment: on a traced value ``+=`` is ``+``, then
        the assignment.  Left to ``nn.Module.__setattr__``, the model's buffer became the
        tracer's proxy and the update was lost from the graph."""
        paths = ({id(m): path for path, m in root.named_modules()}
                 if isinstance(root, nn.Module) else {})
        if isinstance(root, nn.Module):
            self._buffer_names = {name for name, _ in root.named_buffers()}
        setattr_ = nn.Module.__setattr__

        def recording_setattr(module: nn.Module, name: str, value: Any) -> None:
            buffers = module.__dict__.get("_buffers", {})
            if isinstance(value, fx.Proxy) and buffers.get(name) is not None \
                    and id(module) in paths:
                path = paths[id(module)]
                target = f"{path}.{name}" if path else name
                buffer = self.create_proxy("get_attr", target, (), {})
                copy = self.create_proxy("call_method", "copy_", (buffer, value), {})  # detached
                copy.node.meta[BUFFER_ASSIGNMENT] = target  # (checked: _Recorder)
                # Later reads in this forward see the value itself, as in eager code
                # (where the attribute *is* the new tensor, gradient history included).
                self._assigned_buffers[id(buffers[name])] = value
                return
            setattr_(module, name, value)

        with unittest.mock.patch.object(nn.Module, "__setattr__", recording_setattr):
            yield

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        replacement = traceable_forward(m)
        if replacement is not None:
            forward = functools.partial(replacement, m)
        return super().call_module(m, forward, args, kwargs)


def _unmark_wrapped(graph: fx.Graph) -> fx.Graph:
    """Drop fx's mark on the calls it auto-wrapped: for a marked node codegen emits
    ``wrap("torch.nn.utils.rnn.pack_padded_sequence")`` into the generated module, which
    registers that dotted name as a global to patch in every later trace (a KeyError)."""
    for node in graph.nodes:
        node.meta.pop("is_wrapped", None)
    return graph


#: ``torch.nn.utils.rnn``'s packing helpers: one graph node each (_sequence_packing_recorded).
_SEQUENCE_PACKING = ("pack_padded_sequence", "pad_packed_sequence", "pack_sequence",
                     "pad_sequence", "unpack_sequence", "unpad_sequence")

#: Python's and numpy's random draws: a traced forward would keep the one drawn while
#: tracing for every call (a layer dropped at random would be dropped always, or never).
_PYTHON_RANDOM = [(random, name) for name in (
    "random", "uniform", "randint", "randrange", "choice", "choices", "gauss",
    "normalvariate", "shuffle", "sample", "betavariate", "expovariate")]


_TENSOR_DRAWS = ("normal_", "uniform_", "exponential_", "cauchy_", "geometric_",
                 "log_normal_", "random_", "bernoulli_")


def _refused_tensor_draw(name: str) -> Callable[..., Any]:
    def draw(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise TraceError(
            f"forward draws with Tensor.{name}() on a tensor made from constants "
            f"(torch.empty(3).{name}()): a symbolically traced forward would keep the "
            f"value drawn while tracing for every call. Make the tensor from an input "
            f"(torch.empty_like(x).{name}(), x.new_empty(3).{name}()), or trace with "
            f"torch.export: hftc.fuse(models, example_inputs=(x,), frontend='export')")
    draw.__name__ = name
    return draw


#: torch's factories that take sizes as separate arguments (``torch.zeros(b, 51)``).
_SIZE_VARARGS_FACTORIES = ("zeros", "ones", "empty")


@contextlib.contextmanager
def _size_varargs_packed() -> Iterator[None]:
    """While tracing, ``torch.zeros(x.size(0), 51)`` is ``torch.zeros((x.size(0), 51))``.

    torch's argument parser reads sizes given one by one as ints and fails on a traced
    one (``zeros() takes 1 positional argument but 2 were given``); given as one tuple,
    fx records the call with the size read at run time."""
    saved = {name: getattr(torch, name) for name in _SIZE_VARARGS_FACTORIES}

    def packing(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def packed(*args: Any, **kwargs: Any) -> Any:
            if len(args) > 1 and any(isinstance(a, fx.Proxy) for a in args):
                return fn(tuple(args), **kwargs)
            return fn(*args, **kwargs)
        return packed

    for name, fn in saved.items():
        setattr(torch, name, packing(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


@contextlib.contextmanager
def _python_random_refused() -> Iterator[None]:
    """While tracing, a draw from Python's ``random`` or ``numpy.random`` raises, naming it."""
    import numpy

    targets = _PYTHON_RANDOM + [(numpy.random, name) for name in (
        "rand", "randn", "random", "random_sample", "uniform", "normal", "randint",
        "choice", "permutation", "shuffle", "binomial")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in targets
             if hasattr(owner, name)]

    def refuse(owner: Any, name: str) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            raise TraceError(
                f"forward calls {owner.__name__}.{name}(): a traced forward would keep "
                f"the value drawn while tracing for every call. Draw with torch instead "
                f"(torch.rand, torch.bernoulli ...), which hftc draws anew on every call "
                f"and per model")
        return draw

    for owner, name, _ in saved:
        setattr(owner, name, refuse(owner, name))
    # torch's in-place draws on a tensor made while tracing from constants
    # (``torch.empty(3).cauchy_()``): run then, their values were constants of the graph.
    # (On a traced value they are nodes: a Proxy never reaches these methods.)
    for name in _TENSOR_DRAWS:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, _refused_tensor_draw(name))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def uniform_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Put every submodule in one mode for the duration; restore each one's own flag after."""
    saved = [(m, m.training) for m in model.modules()]
    set_training(model, training)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


#: What every module's ``__dict__`` holds for ``nn.Module`` itself (mode, registries).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _unchanged(new: Any, old: Any) -> bool:
    if new is old:
        return True
    if type(new) is not type(old):
        return False
    if isinstance(new, tuple):  # (an equal tuple made anew: torch.export's normalized_shape)
        return len(new) == len(old) and all(map(_unchanged, new, old))
    plain = (bool, int, float, complex, str, bytes, type(None))
    return isinstance(new, plain) and new == old


_PLAIN = (bool, int, float, complex, str, bytes, type(None))

#: What a snapshot does not look into: objects with no Python contents of the model's
#: (modules and tensors are the model's registered state; functions, classes and C
#: objects are kept as they are).
_OPAQUE = (nn.Module, torch.Tensor, fx.Proxy, type, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, types.ModuleType, functools.partial)

_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


class _Contents:
    """The contents of every mutable Python object reachable from a model's plain
    attributes (dicts, lists, sets, and objects of Python classes: a config dict, a
    dataclass, an options object, a list forward appends to), recorded before tracing,
    so that what forward changed in place (``self.cfg["step"] += 1``,
    ``self.maps.append(h)``) is found and put back in the same objects afterwards.

    ``record(value)`` returns the ids of the objects reachable from ``value``."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[Any, tuple[str, Any]]] = {}  # id -> (object, contents)
        self._reached: dict[int, list[int]] = {}  # (a config every submodule holds: once)

    def record(self, value: Any) -> list[int]:
        if id(value) in self._reached:
            return self._reached[id(value)]
        reached = self._reached[id(value)] = []
        seen: set[int] = set()
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, (*_PLAIN, *_OPAQUE)) or id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, tuple):  # immutable, its items perhaps not
                stack.extend(v)
                continue
            contents = _contents(v)
            if contents is None:
                continue
            reached.append(id(v))
            self.saved.setdefault(id(v), (v, contents))
            stack.extend(_children(contents))
        return reached

    def changed(self, restore: bool, traced: tuple[type, ...]) -> dict[int, bool]:
        """The recorded objects forward changed, each with whether its new contents hold
        a traced value (a ``traced`` instance); ``restore``: each is put back as it was."""
        changed = {}
        for key, (v, before) in self.saved.items():
            now = _contents(v)
            if _same_contents(now, before):
                continue
            changed[key] = any(isinstance(leaf, traced)
                               for leaf in torch.utils._pytree.tree_leaves(_children(now)))
            if restore:
                _restore(v, before)
        return changed


def _contents(v: Any) -> tuple[str, Any] | None:
    """``v``'s contents as a (kind, shallow copy), or None for what has none to record (a
    C object: a Generator, a lock, a numpy array)."""
    if isinstance(v, dict):
        return "dict", list(v.items())
    if isinstance(v, list):
        return "list", list(v)
    if isinstance(v, set):
        return "set", set(v)
    if not type(v).__flags__ & _HEAP_TYPE:
        return None
    slots = {s: getattr(v, s, _NOT_SET) for c in type(v).__mro__
             for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")}
    return "object", (dict(vars(v)) if hasattr(v, "__dict__") else {}, slots)


_NOT_SET = object()


def _children(contents: tuple[str, Any]) -> list[Any]:
    kind, items = contents
    if kind == "dict":
        return [x for pair in items for x in pair]
    if kind == "object":
        return [*items[0].values(), *items[1].values()]
    return list(items)


def _same_contents(now: tuple[str, Any] | None, before: tuple[str, Any]) -> bool:
    if now is None or now[0] != before[0]:
        return False
    kind, old = before
    new = now[1]
    if kind == "set":
        return new == old
    if kind == "object":
        return all(a.keys() == b.keys() and all(_unchanged(a[k], b[k]) for k in b)
                   for a, b in zip(new, old))
    return len(new) == len(old) and all(
        _unchanged(a, b) if kind == "list" else _unchanged(a[0], b[0]) and _unchanged(a[1], b[1])
        for a, b in zip(new, old))


def _restore(v: Any, before: tuple[str, Any]) -> None:
    kind, old = before
    if kind == "dict":
        v.clear()
        v.update(old)
    elif kind == "list":
        v[:] = old
    elif kind == "set":
        v.clear()
        v.update(old)
    else:
        state, slots = old
        if hasattr(v, "__dict__"):
            vars(v).clear()
            vars(v).update(state)
        for name, value in slots.items():
            if value is _NOT_SET:
                if hasattr(v, name):
                    object.__delattr__(v, name)
            else:
                object.__setattr__(v, name, value)


class _PythonState:
    """A model's plain attributes and what they hold, as they were when made: what
    forward changed since (:meth:`changes`), and putting them back."""

    def __init__(self, model: nn.Module, traced: tuple[type, ...] = (fx.Proxy,),
                 own_classes_only: bool = False):
        # own_classes_only: torch's own modules left out (under torch.export, nn.RNN's
        # forward rebuilds its _flat_weights lists for the parameters export swapped in)
        self.saved = [(path, m, dict(m.__dict__)) for path, m in model.named_modules()
                      if not own_classes_only or not type(m).__module__.startswith("torch.")]
        self.traced = traced  # what a traced value is (torch.export's: a fake tensor)
        self.contents = _Contents()
        self.reaches = [(f"{path}.{key}" if path else key, self.contents.record(value))
                        for path, m, before in self.saved for key, value in before.items()
                        if key not in _MODULE_INTERNALS]

    def changes(self, restore: bool) -> list[str]:
        """The attributes forward changed to values it did not trace (see
        :func:`_python_state_kept`); ``restore``: and put everything back."""
        inside = self.contents.changed(restore, self.traced)
        changes = []
        for path, module, before in self.saved:
            for key, value in module.__dict__.items():
                if key in _MODULE_INTERNALS or key in before and _unchanged(value, before[key]):
                    continue
                if any(isinstance(leaf, self.traced)
                       for leaf in torch.utils._pytree.tree_leaves(value)):
                    continue
                changes.append(f"{path}.{key}" if path else key)
            if restore:
                module.__dict__.clear()
                module.__dict__.update(before)
        for name, ids in self.reaches:
            if name not in changes and any(key in inside and not inside[key] for key in ids):
                changes.append(name)
        return changes


@contextlib.contextmanager
def _python_state_kept(model: nn.Module, changes: list[str]) -> Iterator[None]:
    """Put the modules' plain attributes back as they were before tracing, and list in
    ``changes`` those that forward changed to values it did not trace (a counter
    ``self.calls += 1``, a flag set on the first call): fusing must not change the
    user's models, and a traced program keeps such a value as it was while tracing
    (``FusedModule`` then runs the models' own forwards).  Traced values assigned to an
    attribute (``self.last = h``, for inspection) are not listed.

    The same holds inside the objects an attribute holds: a config dict, a dataclass or
    a list forward changes in place (``self.sched["step"] += 1``) is put back in place
    (the same objects, so what two modules share stays shared) and the attribute is
    listed; one that only took traced values (``self.maps.append(h)``) is put back and
    not listed."""
    state = _PythonState(model)
    try:
        yield
    finally:
        changes.extend(state.changes(restore=True))


@contextlib.contextmanager
def python_state_watched(model: nn.Module, changes: list[str]) -> Iterator[None]:
    """``changes`` as :func:`_python_state_kept` lists them, around ``torch.export``, which
    swaps the module's parameters in before forward runs and puts its attributes back
    itself before it returns: the attributes are read as forward starts and as it returns
    (forward hooks on the root, for the duration), then everything is put back."""
    states: list[_PythonState] = []

    def started(module: nn.Module, args: Any) -> None:
        states.append(_PythonState(model, traced=(fx.Proxy, torch.Tensor),
                                   own_classes_only=True))

    def returned(module: nn.Module, args: Any, output: Any) -> None:
        if states:
            found = states.pop().changes(restore=False)
            changes.extend(n for n in found if n not in changes)

    before = _PythonState(model)
    handles = [model.register_forward_pre_hook(started),
               model.register_forward_hook(returned)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        before.changes(restore=True)


def trace_hint(exc: BaseException) -> str:
    """A sentence for a tracing error raised inside code whose fix is known, else ``""``.

    ``torch.distributions`` checks its arguments with Python branches on tensor values
    (``if not valid.all(): raise``), which neither front-end can trace."""
    frames = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    where = " ".join(frames) + " " + str(exc)
    if "torch/distributions/" in where.replace("\\", "/"):
        return (" The failing code is in torch.distributions, whose argument checks are "
                "Python branches on tensor values: construct the distributions with "
                "validate_args=False (or call torch.distributions.Distribution."
                "set_default_validate_args(False)) and pass example_inputs=(...), which "
                "traces them with torch.export.")
    if "nn/modules/batchnorm.py" in where.replace("\\", "/") and "data-dependent" in str(exc):
        return (" The failing code is a batch norm with momentum=None (a cumulative "
                "average), which reads num_batches_tracked as a Python number: torch.export "
                "cannot trace that. Fuse without example_inputs (the symbolic front-end "
                "traces it), or give the batch norm a momentum.")
    if "finfo" in str(exc) or "iinfo" in str(exc):  # torch.finfo(h.dtype): a traced dtype
        return (" The line reads a tensor's dtype (torch.finfo(x.dtype)), which symbolic "
                "tracing leaves unknown: pass example_inputs=(...) to hftc.fuse, which "
                "traces forward with torch.export, or take the parameters' dtype "
                "(next(self.parameters()).dtype, transformers' self.dtype).")
    if "is not installed as a submodule" in str(exc):  # fx: a module outside the model
        return (" Forward calls a module that is not a submodule of the model (one kept in "
                "a closure, a plain object or a global): make it one (self.name = module). "
                "A model made with copy.deepcopy of another keeps the original's functions, "
                "which call the original's modules: build each model with its constructor.")
    if "Cache" in str(exc) and "pytree" in str(exc):
        return (" The models return a key/value cache object (Hugging Face's DynamicCache, "
                "returned while use_cache is on), which is not a tensor structure: build them "
                "with use_cache=False (config.use_cache = False) for training, or pass "
                "use_cache=False to forward.")
    if "which is not a known type" in str(exc) and "register a pytree" in str(exc):
        return (" Forward returns an object torch.export cannot take apart (a dataclass of "
                "outputs, a ModelOutput-like class): register it with torch's pytree "
                "(torch.utils._pytree.register_dataclass(TheClass), as transformers does for "
                "its ModelOutput classes), or return a dict or a tuple.")
    return ""



def is_python_constant(value: Any) -> bool:
    """A flag, a number or a string: what forward's Python may branch on (``if has_mask:``)."""
    return type(value) in (bool, int, float, str)


def same_constant(a: Any, b: Any) -> bool:
    """``a`` is the constant ``b`` (``True`` is not ``1``, nor ``1.0``)."""
    return type(a) is type(b) and a == b


def constant_inputs(model: nn.Module, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The inputs of ``model``'s forward to trace as constants: those whose default is a
    Python constant (``has_mask=True``, ``is_causal: bool = False``), at that default,
    updated with ``given`` (the Python constants a call passes, by name; a name given
    another kind of value, a tensor, is traced as a value)."""
    forward = traceable_forward(model) or type(model).forward
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    constants = {name: p.default for name, p in parameters.items()
                 if p.kind in kinds and is_python_constant(p.default)}
    for name, value in (given or {}).items():
        if name in parameters and is_python_constant(value):
            constants[name] = value
        else:
            constants.pop(name, None)
    return constants


def generator_refusal(root: nn.Module, generator: torch.Generator) -> str:
    """Why a draw from a ``torch.Generator`` the model holds (``generator=self.gen``) is
    refused: fx kept the object as a constant of the graph (``_opaque_obj0``), which the
    fused module's copies of the models do not hold, and one program would draw every
    model's numbers from model 0's generator."""
    held = [(f"self.{path + '.' if path else ''}{key}", value)
            for path, module in root.named_modules()
            for key, value in vars(module).items() if isinstance(value, torch.Generator)]
    # (torch.export draws from a copy of the model's: the one generator it holds, then)
    name = next((n for n, value in held if value is generator),
                held[0][0] if len(held) == 1 else None)
    return (f"forward draws random numbers from "
            f"{f'{name} (a torch.Generator ' if name else 'a torch.Generator ('}passed as "
            f"generator=), which a traced program would keep as one object: every model "
            f"would draw from model 0's generator, not its own. Draw from the default "
            f"generator (no generator=; torch.manual_seed seeds it), from which the fused "
            f"module draws each model's own numbers, or run the models one by one yourself")


def source_line(exc: BaseException) -> str:
    """Where in the user's code ``exc`` was raised: ``file.py:110 in forward: `code```
    (the innermost frame outside torch, hftc and Python's library), with torch's own
    module code it was raised in when that is deeper (``torch/nn/modules/transformer.py:535
    in _detect_is_causal_mask, called from ...``); ``""`` when none is known."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = next((f for f in reversed(frames) if is_user_file(f.filename)), None)
    if user is None:
        return ""
    path = user.filename
    try:
        relative = os.path.relpath(path)
        path = relative if not relative.startswith("..") else path
    except ValueError:
        pass
    where = f"{path}:{user.lineno} in {user.name}: `{(user.line or '').strip()}`"
    deeper = frames[frames.index(user) + 1:]
    torch_module = next((f for f in reversed(deeper)
                         if "torch" + os.sep + "nn" + os.sep in f.filename), None)
    if torch_module is not None:
        short = torch_module.filename[torch_module.filename.rfind("torch" + os.sep):]
        where = (f"{short}:{torch_module.lineno} in {torch_module.name} "
                 f"(`{(torch_module.line or '').strip()}`), called from {where}")
    return where


_SIZE_READS = frozenset({"size", "dim", "numel", "ndimension", "nelement", "shape", "ndim"})

#: A tensor's properties that forward may branch on (``if x.dtype == torch.float16``):
#: torch.export knows them, symbolic tracing makes them traced values.
_PROPERTY_READS = ("dtype", "device", "layout", "is_cuda", "is_sparse", "is_quantized",
                   "requires_grad", "is_meta")
_PROPERTY_METHODS = ("is_floating_point", "is_complex", "get_device", "is_contiguous")


def _decided_by(node: fx.Node) -> tuple[str, list[str], list[str]]:
    """What a traced value that Python's control flow asked about is made from, and the
    inputs involved: ``"size"`` (sizes and ranks of inputs: ``t <= block_size`` where
    ``b, t = idx.size()``), ``"input"`` (an input itself: ``if has_mask:``), ``"property"``
    (a dtype or device: ``if self.weight.dtype == torch.float16``, which export knows) or
    ``"value"`` (tensor values: ``x.sum() > 0``, a parameter, a random draw); and the
    properties read (``dtype``, ``requires_grad``)."""
    inputs: list[str] = []
    properties: list[str] = []
    kinds: set[str] = set()
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        size_read = (n.op == "call_method" and n.target in _SIZE_READS) or (
            n.op == "call_function" and n.target is getattr and n.args[1:2] in (("shape",),
                                                                                  ("ndim",)))
        property_read = n.op == "call_function" and n.target is getattr and (
            n.args[1:2] in [(name,) for name in _PROPERTY_READS]) or (
            n.op == "call_method" and n.target in _PROPERTY_METHODS)
        if size_read:
            kinds.add("size")
            inputs += [a.target for a in n.all_input_nodes if a.op == "placeholder"]
        elif property_read:  # T5LayerNorm: `if self.weight.dtype in [torch.float16, ...]`
            kinds.add("property")
            properties.append(str(n.target if n.op == "call_method" else n.args[1]))
            inputs += [a.target for a in n.all_input_nodes if a.op == "placeholder"]
        elif n.op == "placeholder":
            kinds.add("input")
            inputs.append(n.target)
        elif n.op == "call_function" and getattr(n.target, "__module__", None) in (
                operator.__name__, "_operator", "builtins"):
            stack.extend(n.all_input_nodes)
        else:
            kinds.add("value")
    kind = next(k for k in ("value", "input", "property", "size") if k in kinds | {"size"})
    return kind, list(dict.fromkeys(inputs)), list(dict.fromkeys(properties))



def _traced_value_in(exc: BaseException) -> fx.Node | None:
    """The traced value whose ``len()`` / truth / iteration fx refused (``self`` of the
    innermost ``fx.Proxy`` method in the traceback)."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        value = frame.f_locals.get("self")
        if isinstance(value, fx.Proxy):
            found = value.node
    return found


def _trace_advice(exc: BaseException, node: fx.Node | None) -> str:
    """What to change, for a forward symbolic tracing stopped in, by what stopped it."""
    if "'len' is not supported" in str(exc):
        kind = "size"
        inputs = [node.target] if node is not None and node.op == "placeholder" else []
        properties = []
    elif node is not None:
        kind, inputs, properties = _decided_by(node)
    else:
        kind, inputs, properties = "other", [], []
    names = ", ".join(f"`{name}`" for name in inputs)
    if kind == "size":
        whose = f" of input {names}" if names else " of an input"
        return (f"This line reads the size{whose} in Python, which symbolic tracing leaves "
                f"unknown. Pass one call's inputs as example_inputs=(...) to hftc.fuse: "
                f"torch.export then traces forward with real sizes (kept symbolic where the "
                f"code allows).")
    if kind == "property":
        read = " or ".join(f"`{name}`" for name in properties)
        return (f"This line decides on a tensor's {read} in Python, which symbolic "
                f"tracing leaves unknown. Pass one call's inputs as example_inputs=(...) to "
                f"hftc.fuse: torch.export then traces forward with the real tensors"
                + (" (or read the property outside forward, in __init__)."
                   if "requires_grad" not in properties else "."))
    if kind == "input":
        return (f"This line asks Python the truth of input {names}, which symbolic tracing "
                f"makes a traced value. If it is a Python value (a flag, a number), give it a "
                f"default in forward, or give its value in example_inputs=(...) to "
                f"hftc.fuse: hftc traces an input given a Python constant as that constant "
                f"(and traces again for another value). If it is a tensor, the branch depends "
                f"on its values: compute both sides and pick with torch.where.")
    if kind == "value":
        return ("This line decides on tensor values in Python, which neither symbolic tracing "
                "nor torch.export (example_inputs) can follow: compute both sides and pick "
                "with torch.where(condition, a, b), or move the check out of forward.")
    return ("If this line computes with the sizes or the Python values of the inputs, pass "
            "one call's inputs as example_inputs=(...) to hftc.fuse, which traces forward "
            "with torch.export; if it reads tensor values in Python, rewrite it with tensor "
            "ops.")


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (``x.add_(1)``, ``x[i] = v``)."""
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        return node.target is operator.setitem or getattr(node.target, "__name__", "").endswith("_")
    return False


def _reads_buffer(node: fx.Node, target: str) -> bool:
    """Whether ``node`` may read the buffer ``target``: a ``get_attr`` of it, or a call of
    the module that holds it (or of one above: ``self.bn(x)`` reads ``bn.running_mean``)."""
    if node.op == "get_attr":
        return node.target == target
    owner = target.rpartition(".")[0]
    return node.op == "call_module" and (owner == node.target or
                                         owner.startswith(f"{node.target}."))


def _assignments_last(graph: fx.Graph) -> None:
    """Each ``buf.copy_(value)`` traced from ``module.buf = value`` moved down to just
    before the next node that reads the buffer (or the output): code in between reads
    ``value`` itself (as eager code reads the new attribute), and writes into it in place
    (``self.b = self.b * 2; self.b.add_(1)``) reach the buffer only if the copy comes
    after them (it was copied before, and the buffer missed the ``add_``)."""
    nodes = list(graph.nodes)
    for k, write in enumerate(nodes):
        if BUFFER_ASSIGNMENT not in write.meta or write.users:
            continue
        target = write.args[0].target
        reader = next((n for n in nodes[k + 1:] if n.op == "output" or
                       (n is not write and _reads_buffer(n, target))), None)
        if reader is not None and reader is not write.next:
            reader.prepend(write)


def clone_reads_before_assignment(graph: fx.Graph,
                                  is_assignment: Callable[[fx.Node], bool]) -> None:
    """Reads of a buffer before forward assigns it anew (``y = fc(x) * self.scale;
    self.scale = self.scale * 1.5``, traced as ``scale.copy_(...)``) read a clone.

    In eager code the assignment rebinds the attribute and the tensor ``y``'s backward
    saved is left as it was; the graph writes into the buffer instead, and backward then
    failed (the saved tensor "modified by an inplace operation").  Where an earlier read
    writes into the buffer itself (``self.scale.mul_(2)``) nothing is changed."""
    order = {node: k for k, node in enumerate(graph.nodes)}
    for write in [n for n in graph.nodes if is_assignment(n)]:
        target = write.args[0].target
        uses = [(read, use) for read in graph.nodes
                if read.op == "get_attr" and read.target == target and order[read] < order[write]
                for use in read.users if use is not write and order[use] < order[write]]
        if not uses or any(_mutates(use) for _, use in uses):
            continue
        for read in {read for read, _ in uses}:
            with graph.inserting_after(read):
                clone = graph.call_method("clone", (read,))
            clone.meta.update({k: v for k, v in read.meta.items() if k != "val"})
            for _, use in [u for u in uses if u[0] is read]:
                use.replace_input_with(read, clone)


def trace_model(model: nn.Module, index: int, *, training: bool,
                none_inputs: Iterable[str] = (),
                constants: dict[str, Any] | None = None,
                values_read: list[str] | None = None) -> fx.GraphModule:
    """Trace ``model`` (the ``index``-th of the N) with every submodule in ``training`` mode,
    the inputs named in ``none_inputs`` ``None`` (fx's ``concrete_args``; the others are
    traced values, which are never ``None``: ``if mask is not None`` is taken) and those
    in ``constants`` (default :func:`constant_inputs`: the Python constants forward's
    defaults give) the Python values there, which forward's code may branch on.  The
    graph keeps a placeholder for every input; ``meta[CONSTANT_INPUTS]`` lists those.

    The model's plain Python attributes are as they were before (``PYTHON_STATE`` in
    the graph module's ``meta`` lists those forward changed).

    Given a list ``values_read``, the trace also watches for forward reading the values
    of the model's own parameters or buffers as real tensors (``next(self.parameters())
    .sum()``, which fx does not trace) and appends what it read there
    (:class:`_ModelValuesWatched`).

    Raises :class:`TraceError` naming the model, the line of its code that symbolic
    tracing cannot follow, and what to change there.
    """
    changes: list[str] = []
    watched = (_ModelValuesWatched(model, values_read) if values_read is not None
               else contextlib.nullcontext())
    tracer = _Tracer()
    nones = sorted(none_inputs)
    constants = constant_inputs(model) if constants is None else dict(constants)
    tracer.constant_inputs = {k: v for k, v in constants.items() if k not in nones}
    try:
        with uniform_mode(model, training), _python_state_kept(model, changes):
            with watched:
                graph = tracer.trace(model, {name: None for name in nones} or None)
            _flatten_dataclass_output(graph)
            _assignments_last(graph)
            clone_reads_before_assignment(graph, lambda n: BUFFER_ASSIGNMENT in n.meta)
            gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        # Constants fx lifted onto the model while tracing (``_tensor_constant0``) are the
        # graph's own attributes (the GraphModule holds them), not the model's state.
        lifted = {node.target for node in graph.nodes if node.op == "get_attr"}
        gm.meta[PYTHON_STATE] = [name for name in changes if name not in lifted]
        gm.meta[CONSTANT_INPUTS] = dict(tracer.constant_inputs)
        return gm
    except UnsupportedOperatorError as exc:  # what the model does, not how it is traced
        raise UnsupportedOperatorError(f"model {index} ({type(model).__name__}): {exc}") \
            from exc
    except TraceError as exc:  # the tracer's own refusals say what to change
        where = source_line(exc)
        raise TraceError(f"model {index} ({type(model).__name__})"
                         f"{f' at {where}' if where else ''}: {exc}") from exc
    except Exception as exc:  # symbolic tracing raises anything: TraceError, TypeError, ...
        where = source_line(exc)
        hint = trace_hint(exc)
        advice = hint.strip() if hint else _trace_advice(
            exc, tracer.undecidable or _traced_value_in(exc))
        if type(model).__module__.startswith("torch.nn."):
            # torch's own forward, which the user cannot rewrite: what to do instead
            advice = _bare_module_advice(model)
        raise TraceError(
            f"model {index} ({type(model).__name__}) cannot be traced by "
            f"torch.fx.symbolic_trace{f' at {where}' if where else ''}: "
            f"{plain_message(exc)}. {advice}"
        ) from exc


def _bare_module_advice(model: nn.Module) -> str:
    """For a model that is a torch.nn module itself (``hftc.fuse([nn.LSTM(8, 4), ...])``),
    whose forward, torch's, symbolic tracing cannot follow."""
    cls = type(model).__name__
    return (f"The model is torch.nn's own {cls}, whose forward (torch's code, not yours) "
            f"checks its inputs in Python. Pass one call's inputs as example_inputs=(...) to "
            f"hftc.fuse (torch.export traces that forward with real inputs), or fuse models "
            f"of your own that hold the {cls} as a submodule (self.layer = nn.{cls}(...); "
            f"forward returns self.layer(x)): hftc fuses it there as one op.")


class _ModelValuesWatched(torch.overrides.TorchFunctionMode):
    """While tracing, notes any torch call on one of the model's own parameters or buffers
    (or a tensor sharing its memory) other than a read of its metadata.

    fx traces ``self.weight`` as a value, but ``next(self.parameters())``,
    ``self._buffers["n"]`` and ``p.data`` are the real tensors: what forward computes from
    them in Python (``if w.sum() > 0:``, ``w.tolist()``, a constant ``w * 2``) is model
    0's, and a graph traced on model 0 is not the program of a model with other weights.
    """

    #: Calls that read a tensor's metadata, which models proven alike share.
    _METADATA = frozenset((
        "size", "dim", "ndimension", "stride", "numel", "nelement", "element_size",
        "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device",
        "__len__", "storage_offset", "has_names"))

    def __init__(self, model: nn.Module, found: list[str]):
        super().__init__()
        self._found = found
        self._names: dict[int, str] = {}
        self._storages: dict[int, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            self._names.setdefault(id(t), name)
            pointer = t.untyped_storage().data_ptr() if t.layout == torch.strided else 0
            if pointer:  # (a meta or empty tensor has none)
                self._storages.setdefault(pointer, name)

    def _model_tensor(self, value: torch.Tensor) -> str | None:
        if id(value) in self._names:
            return self._names[id(value)]
        try:  # a view or ``.data`` of one: the same memory
            return self._storages.get(value.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # sparse, a subclass without storage
            return None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self._found or name in self._METADATA or (
                name == "__get__" and not isinstance(result, torch.Tensor)):
            return result
        for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
            tensor = self._model_tensor(leaf) if isinstance(leaf, torch.Tensor) else None
            if tensor is not None:
                self._found.append(f"`{name}` of `{tensor}`")
                break
        return result


def trace_models(models: Sequence[nn.Module], *, modes: Sequence[bool],
                 constants: Sequence[dict[str, Any] | None], share_numbers: bool = True
                 ) -> dict[bool, list[fx.GraphModule]]:
    """Each model's graph in each mode (:func:`trace_model`, ``constants[i]`` model i's),
    tracing one model of each group :func:`~.same_program.alike_models` proves alike and
    giving the others a copy of its graph, whose targets are read on their own modules::

        models   MLP MLP MLP(p=0.2) MLP     alike: 0 0 2 0
        traced   0   .   2          .       2 traces per mode, not 4
        graph    0   0'  2          0'      0': model 0's graph, GraphModule of model i

    A group's graph is shared only if tracing it read nothing of model 0's own: no lifted
    constant (``_tensor_constant0``, made from values forward computed in Python) and no
    value of its parameters or buffers read as a real tensor (:class:`_ModelValuesWatched`);
    otherwise, and where the models' constant inputs differ, each model is traced itself.
    Shapes are not part of a symbolic graph (:func:`annotate_example_values` adds model
    0's later), and models proven alike have the same parameter and buffer shapes.
    """
    from .same_program import alike_models  # (same_program imports nothing of this module)

    constants = [constant_inputs(m) if c is None else c for m, c in zip(models, constants)]
    alike = alike_models(models) if len(models) > 1 else [0]
    groups: dict[int, list[int]] = {}
    for i, first in enumerate(alike):
        groups.setdefault(first, []).append(i)
    # Models that differ only in floats: one token trace (numbers.py), where the first-call
    # check then runs each such model's own forward (a float read in C, math.exp(self.p),
    # is no use a token can note).
    numbers = number_groups(models, list(groups), constants) if share_numbers else {}
    graphs: dict[bool, list[fx.GraphModule]] = {}
    for mode in modes:
        traced = trace_number_variants(models, numbers, mode, constants) if numbers else {}
        for first, members in groups.items():
            shared = first in traced
            if not shared:
                read: list[str] = []
                traced[first] = trace_model(models[first], first, training=mode,
                                            constants=constants[first],
                                            values_read=read if len(members) > 1 else None)
                shared = not read and _reads_only_the_model(traced[first], models[first])
            for i in members[1:]:
                traced[i] = (_shared_trace(traced[first], models[i])
                             if shared and _same_constants(constants[i], constants[first])
                             else trace_model(models[i], i, training=mode,
                                              constants=constants[i]))
        graphs[mode] = [traced[i] for i in range(len(models))]
    return graphs


def number_groups(models: Sequence[nn.Module], firsts: list[int],
                  constants: Sequence[dict[str, Any]] | dict[int, dict[str, Any]]
                  ) -> dict[int, list[tuple[str, str]]]:
    """The first model of each group that differs from the first group's only in float
    attributes (:func:`~.same_program.number_differences`), with those attributes; the
    first group's model maps to ``[]``. Empty where no group does."""
    from .same_program import number_differences

    base = firsts[0]
    found = {}
    for first in firsts[1:]:
        differences = (number_differences(models[base], models[first])
                       if _same_constants(constants[first], constants[base]) else None)
        if differences:
            found[first] = differences
    return {base: [], **found} if found else {}


def trace_number_variants(models: Sequence[nn.Module],
                          numbers: dict[int, list[tuple[str, str]]], mode: bool,
                          constants: Sequence[dict[str, Any]] | dict[int, dict[str, Any]]
                          ) -> dict[int, fx.GraphModule]:
    """One trace of the first of ``numbers``' models with the differing floats as tokens
    (hftc/frontends/numbers.py), and each of those models' graph with its own values;
    empty where forward used a token in Python or read a model's values (each is then
    traced itself).

    A float read in C (``math.sqrt(self.d_model)``) calls no method a token notes and
    bakes the base model's value into the graph; so the base is traced a second time
    with its tokens holding another model's values, and the two must give every model
    the same graph::

        x * math.sqrt(self.d)   d = 4.0 | 9.0:   mul(x, 2.0)  vs  mul(x, 3.0)  -> {}
    """
    from .numbers import graph_with_numbers

    base = next(iter(numbers))
    attributes = sorted({a for found in numbers.values() for a in found})
    others = {a: next((float(vars(models[i].get_submodule(a[0]))[a[1]]) for i in numbers
                       if a in numbers[i]), None) for a in attributes}
    first = _token_trace(models, numbers, base, attributes, mode, constants, None)
    if first is None:
        return {}
    gm, tokens = first
    graphs = {i: _shared_trace(gm, models[i]) for i in numbers}
    if not all(graph_with_numbers(graphs[i], models[i], tokens) for i in numbers):
        return {}
    second = _token_trace(models, numbers, base, attributes, mode, constants, others)
    # (the second trace's graphs are only compared: each model's signature is read off
    # the one trace with its own values in place of the tokens, no graph copied per model)
    if second is None or any(
            _graph_signature(graphs[i]) != _numbers_signature(*second, models[i])
            for i in numbers):
        return {}
    return graphs


def _token_trace(models: Sequence[nn.Module], numbers: dict[int, list[tuple[str, str]]],
                 base: int, attributes: list[tuple[str, str]], mode: bool,
                 constants: Sequence[dict[str, Any]] | dict[int, dict[str, Any]],
                 values: dict[tuple[str, str], float] | None
                 ) -> tuple[fx.GraphModule, dict[int, tuple[str, str]]] | None:
    """:func:`trace_number_variants`' one token trace of ``models[base]`` (its tokens
    holding ``values`` where given) and its tokens (id -> attribute), for ``numbers``'
    models to share; None where it cannot be shared: forward used a token in Python, read
    the model's values, or holds a token in a top-level attribute of a model's graph."""
    from .numbers import watched_numbers

    uses: list[str] = []
    read: list[str] = []
    try:
        with watched_numbers(models[base], attributes, uses, values) as tokens:
            gm = trace_model(models[base], base, training=mode, constants=constants[base],
                             values_read=read)
    except Exception:  # traced again the plain way, which says what went wrong
        return None
    if uses or read or not _reads_only_the_model(gm, models[base]):
        return None
    return gm, tokens


def _numbers_signature(gm: fx.GraphModule, tokens: dict[int, tuple[str, str]],
                       model: nn.Module) -> list[tuple[Any, ...]] | None:
    """:func:`_graph_signature` of ``_shared_trace(gm, model)`` after
    :func:`~.numbers.graph_with_numbers` put ``model``'s own values in place of the
    tokens, without the copy; None where that would have refused (a token in an
    attribute the copy takes from ``model``: an undotted ``get_attr`` target)."""
    from .numbers import WatchedNumber

    def own(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return value.name
        if type(value) is WatchedNumber:
            path, name = tokens[id(value)]
            return float(vars(model.get_submodule(path))[name])
        return value

    signature = []
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module") and "." not in n.target and \
                type(getattr(model, n.target, None)) is WatchedNumber:
            return None
        signature.append((n.op, n.target, fx.node.map_aggregate(n.args, own),
                          fx.node.map_aggregate(n.kwargs, own)))
    return signature


def _graph_signature(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each node's op, target and arguments (other nodes by name): equal for graphs of
    one program with the same constants."""
    def name(n: fx.Node) -> str:
        return n.name

    return [(n.op, n.target, fx.node.map_arg(n.args, name), fx.node.map_arg(n.kwargs, name))
            for n in gm.graph.nodes]


def _reads_only_the_model(gm: fx.GraphModule, model: nn.Module) -> bool:
    """Every ``get_attr`` of the graph is an attribute of ``model`` (a parameter, a buffer,
    a tensor attribute), none a constant fx lifted onto the graph while tracing."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                at = operator.attrgetter(node.target)
                if at(gm) is not at(model):
                    return False
            except AttributeError:
                return False
    return True



try:  # a GraphModule that writes its Python code when first called, not when made
    from torch.fx._lazy_graph_module import _LazyGraphModule as _UncompiledGraphModule
except ImportError:  # (torch before 2.3)
    _UncompiledGraphModule = fx.GraphModule


def _same_constants(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(same_constant(a[k], b[k]) for k in a)


def _shared_trace(traced: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A copy of the graph ``traced`` for another model proven to run its program, whose
    ``call_module``/``get_attr`` targets resolve on ``model``."""
    gm = _UncompiledGraphModule(model, copy.deepcopy(traced.graph), type(model).__name__)
    gm.meta[PYTHON_STATE] = list(traced.meta[PYTHON_STATE])
    gm.meta[CONSTANT_INPUTS] = dict(traced.meta[CONSTANT_INPUTS])
    return gm


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers live on the meta device.

    No tensor data is copied (each tensor is mapped to a fresh meta tensor through
    ``deepcopy``'s memo), so this is cheap even for large models.  Used as the
    shape-propagation root and as the template :meth:`FusedModule.unfuse` rebuilds
    models from.
    """
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return deepcopy_module(module, memo)


def deepcopy_module(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(module)``, with what a class's ``__setstate__`` put in front of a
    submodule taken away again.

    ``nn.TransformerDecoderLayer.__setstate__`` sets ``self.activation = F.relu`` in the
    instance dict when it has no such entry, which it lacks when the activation is a
    module (``activation=nn.GELU()``, in ``_modules``): a deep copy then ran ReLU.

    The functions its modules hold are rebound to the copy's modules
    (:func:`hftc.frontends.closures.rebind_functions`): deepcopy keeps a function as it is, and a
    copy of minGPT's block called the original's MLP through ``self.mlpf``."""
    memo = {} if memo is None else memo
    # (one walk of the tree for both loops: the walks cost a small model's copy a fifth)
    originals = [sub for _, sub in module.named_modules(remove_duplicate=False)]
    # Each module's empty hook OrderedDicts (a dozen a module) copied up front: deepcopy's
    # generic path for them costs more than the rest of a small model's copy.
    for sub in originals:
        for value in sub.__dict__.values():
            if type(value) is OrderedDict and not value and not vars(value):
                memo.setdefault(id(value), OrderedDict())
    copied = _module_copy(module, memo)
    rebind_functions(copied, memo)
    for original, (_, twin) in zip(originals, copied.named_modules(remove_duplicate=False)):
        for name in [k for k in twin.__dict__ if k in twin._modules
                     and k not in original.__dict__]:
            del twin.__dict__[name]
    return copied



#: What ``copy.deepcopy`` gives back as it is (its own table of atomic types).
_ATOMIC = frozenset(t for t, f in copy._deepcopy_dispatch.items()  # type: ignore[attr-defined]
                    if f is copy._deepcopy_atomic)  # type: ignore[attr-defined]
_NIL = object()


def _module_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, step for step as deepcopy takes it for a module of
    nn.Module's own copy protocol (``__reduce_ex__`` -> ``__newobj__``, its state dict
    copied key by key, ``__setstate__``), less a deepcopy call per plain attribute (an
    int, a str: deepcopy gives them back as they are, memo untouched) and with its
    submodules copied so too; any other module is left to ``copy.deepcopy``::

        copy.deepcopy(conv):  ~60 deepcopy calls (30 keys, 30 values, most of them ints)
        _module_copy(conv):    one per attribute that holds something new (a tuple)
    """
    found = memo.get(id(module), _NIL)
    if found is not _NIL:
        return found
    cls = type(module)
    if cls in copy._deepcopy_dispatch or copyreg.dispatch_table.get(cls) is not None \
            or getattr(module, "__deepcopy__", None) is not None:  # (as deepcopy asks)
        return copy.deepcopy(module, memo)
    reduced = module.__reduce_ex__(4)
    if not (type(reduced) is tuple and len(reduced) == 5 and reduced[0] is copyreg.__newobj__
            and reduced[1] == (cls,) and type(reduced[2]) is dict
            and reduced[3] is None and reduced[4] is None):
        return copy.deepcopy(module, memo)
    state = reduced[2]
    twin = cls.__new__(cls)
    memo[id(module)] = twin
    copied: dict[Any, Any] = {}
    memo[id(state)] = copied
    for key, value in state.items():
        key = key if type(key) in _ATOMIC else copy.deepcopy(key, memo)
        if type(value) in _ATOMIC:
            copied[key] = value
        elif (found := memo.get(id(value), _NIL)) is not _NIL:
            copied[key] = found  # (deepcopy's first step: an empty hook dict seeded)
        elif key == "_modules" and type(value) is dict:
            copied[key] = _modules_copy(value, memo)
        else:
            copied[key] = copy.deepcopy(value, memo)
    copy._keep_alive(state, memo)  # type: ignore[attr-defined]
    if hasattr(twin, "__setstate__"):
        twin.__setstate__(copied)
    else:  # (not reached for an nn.Module, which has one)
        twin.__dict__.update(copied)
    copy._keep_alive(module, memo)  # type: ignore[attr-defined]
    return twin


def _modules_copy(modules: dict[str, Any], memo: dict[int, Any]) -> dict[str, Any]:
    """A module's ``_modules`` as ``copy.deepcopy`` copies a dict, each submodule by
    :func:`_module_copy`."""
    found = memo.get(id(modules), _NIL)
    if found is not _NIL:
        return found
    copied: dict[str, Any] = {}
    memo[id(modules)] = copied
    for key, value in modules.items():
        key = key if type(key) in _ATOMIC else copy.deepcopy(key, memo)
        copied[key] = (_module_copy(value, memo) if isinstance(value, nn.Module)
                       else value if type(value) in _ATOMIC else copy.deepcopy(value, memo))
    copy._keep_alive(modules, memo)  # type: ignore[attr-defined]
    return copied


def trace_with_leaves(model: nn.Module, leaf: Callable[[nn.Module], bool],
                      concrete_args: dict[str, Any] | None = None) -> fx.GraphModule:
    """``model``'s forward as a GraphModule, traced as for fusing (the one tracer) with
    the modules ``leaf`` picks as leaves too: a model's own forward op for op, so that two
    models of one structure (a model and its padded model, ``pad_widths=True``) give
    graphs that match node by node."""
    tracer = _Tracer(leaf)
    graph = tracer.trace(model, concrete_args=concrete_args or None)
    return fx.GraphModule(tracer.root, graph)


def record_values(gm: fx.GraphModule, *args: Any) -> dict[fx.Node, Any]:
    """Run ``gm`` once on ``args``; every node's value."""
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n] = out = super().run_node(n)
            return out

    Recorder(gm).run(*args)
    return values

class _Recorder(fx.Interpreter):
    """Runs a graph and stores every node's value in ``node.meta[EXAMPLE_VALUE]``."""

    def __init__(self, module: fx.GraphModule, targets: Sequence[fx.Node]):
        # Without the debugging text fx's Interpreter writes into any error ("While
        # executing ... Original traceback ... tlparse"): ours (a guard of an exported
        # graph rejecting the inputs) says what to do as it is.
        super().__init__(module)
        self.extra_traceback = False
        self._targets = dict(zip(module.graph.nodes, targets))
        #: the node that raised, for the error
        self.failed: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        buffer = self._targets[n].meta.get(BUFFER_ASSIGNMENT)
        if buffer is not None:
            self._check_assignment(n, buffer)
        try:
            value = super().run_node(n)
        except Exception:
            self.failed = self._targets[n]
            raise
        self._targets[n].meta[EXAMPLE_VALUE] = value
        return value

    def _check_assignment(self, n: fx.Node, buffer: str) -> None:
        """``module.buf = value`` in forward, traced as ``buf.copy_(value)``: a value of
        another shape or dtype would be cast into the buffer (a long count assigned
        ``count + 0.5`` stayed 0), where the model's buffer becomes the new tensor."""
        old, new = (self.env.get(a) for a in n.args[:2])
        if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor) or (
                old.shape == new.shape and old.dtype == new.dtype):
            return
        raise TraceError(
            f"the models' forward assigns their buffer `{buffer}` a new tensor of "
            f"{list(new.shape)} {new.dtype}, where the buffer is {list(old.shape)} "
            f"{old.dtype}; hftc stacks each buffer per model and keeps its shape and dtype. "
            f"Update it in place (`{buffer.rpartition('.')[2]}.copy_(...)`, `.add_(...)`), "
            f"or give the new value the buffer's shape and dtype")


def _call_site() -> str:
    """`` at file:line: `code` ``: the user's line that called the fused module (the
    innermost frame outside hftc and torch)."""
    return errors.user_line()  # (ir.user_line is a node's)


def _list_of_inputs_hint(names: Sequence[Any], args: Sequence[Any]) -> str:
    """Where an input the model failed on is a list or tuple of tensors of one shape (one
    input per model, as a loop over the models would pass them), how to pass them."""
    for name, value in zip(names, args):
        if isinstance(value, (list, tuple)) and len(value) > 1 and all(
                isinstance(t, torch.Tensor) and t.shape == value[0].shape for t in value):
            return (f". `{name}` is a {type(value).__name__} of {len(value)} tensors "
                    f"{list(value[0].shape)}: for one input per model, stack them along a "
                    f"model dim and say so, fused.with_in_dims(0)(torch.stack({name})) (or "
                    f"hftc.fuse(models, in_dims=0)); for one input all models share, pass "
                    f"the tensor itself")
        if isinstance(value, dict) and set(value) & set(map(str, names)):
            # (a batch dict, a tokenizer's output, keyed by the forward's inputs' names)
            return (f". `{name}` is a dict (keys {', '.join(map(repr, list(value)[:4]))}"
                    f"{', ...' if len(value) > 4 else ''}): to pass its entries as the "
                    f"forward's inputs, unpack it, fused(**batch), as for one model")
    return ""


def _copies(value: Any) -> Any:
    """``value`` with each tensor cloned (a PackedSequence's parts too)."""
    def copied(v: Any) -> Any:
        if isinstance(v, torch.nn.utils.rnn.PackedSequence):
            return tuple.__new__(type(v), tuple(copied(part) for part in v))
        return v.clone() if isinstance(v, torch.Tensor) else v

    return torch.utils._pytree.tree_map(
        copied, value, is_leaf=lambda v: isinstance(v, torch.nn.utils.rnn.PackedSequence))


def _to_meta(value: Any, strides: bool = False) -> Any:
    """``value`` with each tensor on meta (with its strides where ``strides``: a value
    computed for real stands for what the meta kernel gives, an expanded view's zero
    strides included; else ``empty_like``'s)."""
    def meta(v: Any) -> Any:
        if isinstance(v, torch.nn.utils.rnn.PackedSequence):
            # Its constructor demands batch_sizes on the CPU: rebuilt without it, the lengths
            # kept (a small CPU tensor).
            data, batch_sizes, *indices = v
            return tuple.__new__(type(v), (meta(data), batch_sizes, *map(meta, indices)))
        if not isinstance(v, torch.Tensor):
            return v
        if strides and v.layout == torch.strided:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return torch.empty_like(v, device="meta")

    return torch.utils._pytree.tree_map(
        meta, value, is_leaf=lambda v: isinstance(v, torch.nn.utils.rnn.PackedSequence))


def _bind_placeholders(graph: fx.Graph, inputs: Sequence[Any], kwargs: dict[str, Any]) -> list:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    args = list(inputs)
    # Keyword inputs fill the placeholders after the positional ones, by name.
    for p in placeholders[len(args) :]:
        if p.target in kwargs:
            args.append(kwargs[p.target])
        elif p.args:  # the forward's default value
            args.append(p.args[0])
        else:
            raise TraceError(f"input `{p.target}` of the models' forward is missing")
    return args


#: Model 0's parameter and buffer elements times its inputs' elements up to which its
#: values are propagated on the CPU for real first: a bound (without upsampling) on the
#: multiply-adds of one model's forward (a fused call computes N of them),
#: where meta's first use in a process imports sympy (~0.25 s) and its Python kernels
#: take 10-100x a small CPU kernel (F.batch_norm on [64, 96]: 1.3 ms on meta, 18 us on
#: the CPU). The MLP sweep's evaluation (26K parameters, [360, 64]): 0.6 Gi.
REAL_FIRST_MAX_WORK = 1 << 30


def annotate_example_values(
    graph: fx.Graph,
    template: nn.Module,
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
    real_tensors: Callable[[], dict[str, torch.Tensor]],
) -> None:
    """Propagate model 0's values through ``graph``, storing them in ``node.meta``.

    On the meta device, where no data is touched: ``template`` is model 0 on meta
    (:func:`meta_copy`), ``inputs`` one model's inputs.  Or for real, on a copy of
    model 0's tensors (``real_tensors()``) with the random number generator state
    restored afterwards, so that nothing the user sees changes: first where that is
    cheap (a small model on small inputs on the CPU, :data:`REAL_FIRST_MAX_WORK`),
    and where meta cannot run the model (it reads a tensor's value in Python:
    ``float(self.num_batches_tracked)`` in a batch norm with ``momentum=None``).
    Either way each node's value is then a meta tensor of the shape and dtype model 0
    computes there (with the strides of the kernels that ran: the CPU's conv of a
    channels-last input is channels-last, meta's is not).
    """
    args = _bind_placeholders(graph, inputs, kwargs)
    copied = fx.Graph()
    # With its output node: a graph of placeholders alone (``return x``) compiled to a
    # function with no body.
    copied.output(copied.graph_copy(graph, {}))
    if _cheap_on_the_cpu(template, args):
        real = _real_copy(template, real_tensors)
        if real is not None:
            try:
                _record_real(graph, copied, real, args)
                return
            except FusionError:  # an export guard (lowering/runtime/guards.py) refused
                raise
            except Exception:  # noqa: BLE001 - meta next, then real again to explain
                pass
    recorder = None  # (the GraphModule itself may fail: an attribute the template lacks)
    try:
        recorder = _Recorder(fx.GraphModule(template, copied), list(graph.nodes))
        with torch.no_grad():
            recorder.run(*_to_meta(args))
        return
    except FusionError:  # an export guard (lowering/runtime/guards.py) refused the inputs
        raise
    except Exception as exc:
        meta_error = exc
    failed_on_meta = recorder.failed if recorder is not None else None
    real = _real_copy(template, real_tensors, any_device=True)
    try:
        _record_real(graph, copied, real, args)
    except _RealRunFailed as failed:
        from ..match import describe_node  # (match reads graphs this module makes)

        exc = failed.__cause__
        node = failed.node or failed_on_meta
        where = f", at {describe_node(node, template)}" if node is not None else ""
        source = user_line(node) if node is not None else ""
        where += f" ({source})" if source else ""
        names = [n.target for n in graph.nodes if n.op == "placeholder"]
        given = ", ".join(
            f"`{name}` {list(v.shape)} {str(v.dtype).replace('torch.', '')}"
            if isinstance(v, torch.Tensor) else f"`{name}` {type(v).__name__}"
            for name, v in zip(names, args))
        raise TraceError(
            f"model 0 ({type(template).__name__}) fails on this call's inputs ({given}; "
            f"one model's share){_call_site()}{where}: {plain_message(exc)} (on meta tensors: "
            f"{plain_message(meta_error)}). Call the fused module with inputs each model "
            f"takes (a model dim at in_dims for stacked inputs)"
            f"{_list_of_inputs_hint(names, args)}"
        ) from exc


class _RealRunFailed(Exception):
    """:func:`_record_real`'s run raised (its ``__cause__``) at ``node``."""

    def __init__(self, node: fx.Node | None):
        super().__init__()
        self.node = node


def _cheap_on_the_cpu(template: nn.Module, args: Sequence[Any]) -> bool:
    """Is one forward of model 0 on ``args`` cheap enough to run for real
    (:data:`REAL_FIRST_MAX_WORK`), its inputs all on the CPU?"""
    leaves = [v for v in torch.utils._pytree.tree_leaves(args) if isinstance(v, torch.Tensor)]
    if any(v.device.type != "cpu" for v in leaves):
        return False
    model = sum(t.numel() for t in (*template.parameters(), *template.buffers()))
    return model * max(1, sum(v.numel() for v in leaves)) <= REAL_FIRST_MAX_WORK


def _real_copy(template: nn.Module, real_tensors: Callable[[], dict[str, torch.Tensor]],
               any_device: bool = False) -> nn.Module | None:
    """``template`` holding copies of model 0's tensors (None where one is off the CPU,
    unless ``any_device``: the random generator restored is the CPU's)."""
    tensors = real_tensors()
    if not any_device and any(t.device.type != "cpu" for t in tensors.values()):
        return None
    real = deepcopy_module(template)
    for name, tensor in tensors.items():
        owner_path, _, leaf = name.rpartition(".")
        owner = real.get_submodule(owner_path)
        if leaf in owner._parameters:
            owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[leaf] = tensor
    return real


def _record_real(graph: fx.Graph, copied: fx.Graph, real: nn.Module, args: Sequence[Any]
                 ) -> None:
    """Run ``copied`` on ``real`` for real, on copies of ``args`` (forward may write into
    its inputs: ``x.mul_(2)``), each value into its ``graph`` node as a meta tensor of
    its shape, strides and dtype; :class:`_RealRunFailed` where it raises."""
    recorder = _Recorder(fx.GraphModule(real, copied), list(graph.nodes))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            recorder.run(*_copies(args))
    except FusionError:
        raise
    except Exception as exc:
        raise _RealRunFailed(recorder.failed) from exc
    for node in graph.nodes:
        node.meta[EXAMPLE_VALUE] = _to_meta(node.meta.get(EXAMPLE_VALUE), strides=True)


# --------------------------------------------------------------------------- traced through:
# torch's transformer modules, whose forward takes a fast path symbolic tracing cannot follow


def encoder_nested_padding(output: torch.Tensor, src: torch.Tensor,
                           key_padding_mask: torch.Tensor | None, mask: torch.Tensor | None,
                           training: bool, *params: torch.Tensor, use_nested_tensor: bool,
                           mask_check: bool, batch_first: bool) -> torch.Tensor:
    """One model's ``nn.TransformerEncoder`` nested-tensor fast path, as a graph op:
    zeros at padded positions when PyTorch would have taken it (see the kernel)."""
    if output.device.type == "meta":  # shape propagation: the values do not matter
        return output
    return rt_attention.encoder_nested_padding(
        output.unsqueeze(0), src, key_padding_mask, mask, training, *params,
        use_nested_tensor=use_nested_tensor, mask_check=mask_check, batch_first=batch_first,
        flags=(True, False, False), n=1).squeeze(0)


torch.fx.wrap("encoder_nested_padding")


def causal_hint(is_causal: bool | None) -> bool:
    """``is_causal=None`` asks PyTorch to detect a causal mask by comparing values; the hint
    only picks a kernel, so computing with the mask itself gives the same numbers."""
    return bool(is_causal) if is_causal is not None else False


torch.fx.wrap("causal_hint")  # a graph op: the flag may be an input of a traced root


def _encoder_layer_forward(self: nn.TransformerEncoderLayer, src, src_mask=None,
                           src_key_padding_mask=None, is_causal=False):
    """``TransformerEncoderLayer.forward``'s slow path (masks are canonicalised by attention)."""
    x = src
    if self.norm_first:
        x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        x = x + self._ff_block(self.norm2(x))
    else:
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        x = self.norm2(x + self._ff_block(x))
    return x


def _encoder_forward(self: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None,
                     is_causal=None):
    """``TransformerEncoder.forward`` with its fast path's zeros made explicit."""
    output = src
    first = self.layers[0]
    for mod in self.layers:
        output = mod(output, src_mask=mask, is_causal=causal_hint(is_causal),
                     src_key_padding_mask=src_key_padding_mask)
    if getattr(self, "use_nested_tensor", False):
        params = [p for p in (
            first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
            first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
            first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
            first.linear1.weight, first.linear1.bias, first.linear2.weight,
            first.linear2.bias) if p is not None]
        output = encoder_nested_padding(
            output, src, src_key_padding_mask, mask, first.training, *params,
            use_nested_tensor=True, mask_check=getattr(self, "mask_check", True),
            batch_first=first.self_attn.batch_first)
    # The final norm after the padding, as torch's: a padded row is norm(0) (the norm's
    # bias), not 0.
    if self.norm is not None:
        output = self.norm(output)
    return output


def _decoder_forward(self: nn.TransformerDecoder, tgt, memory, tgt_mask=None, memory_mask=None,
                     tgt_key_padding_mask=None, memory_key_padding_mask=None,
                     tgt_is_causal=None, memory_is_causal=False):
    """``TransformerDecoder.forward`` without its data-dependent causal-mask detection."""
    output = tgt
    for mod in self.layers:
        output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask,
                     memory_key_padding_mask=memory_key_padding_mask,
                     tgt_is_causal=causal_hint(tgt_is_causal), memory_is_causal=memory_is_causal)
    if self.norm is not None:
        output = self.norm(output)
    return output


def _transformer_forward(self: nn.Transformer, src, tgt, src_mask=None, tgt_mask=None,
                         memory_mask=None, src_key_padding_mask=None, tgt_key_padding_mask=None,
                         memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None,
                         memory_is_causal=False):
    """``Transformer.forward`` without its shape checks (the modules check their inputs)."""
    memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                          is_causal=src_is_causal)
    return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask,
                        memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


#: Modules symbolic tracing would keep as opaque leaves but that hftc traces *through*,
#: with a traceable forward of the same math (``torch.nn.TransformerEncoderLayer`` ->
#: its self-attention, linears and norms): ``{module class: forward(module, *args, **kwargs)}``.
TRACEABLE_FORWARDS: dict[type, Callable[..., Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer_forward,
    nn.TransformerDecoderLayer: nn.TransformerDecoderLayer.forward,
    nn.TransformerEncoder: _encoder_forward,
    nn.TransformerDecoder: _decoder_forward,
    nn.Transformer: _transformer_forward,
}
