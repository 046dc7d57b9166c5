"""hftc's graph vocabulary: what the stages of the pipeline agree on about a graph.

- the ``node.meta`` / ``GraphModule.meta`` keys that tracing, matching, the passes and
  the runtime read and write (one owner for each key's name and meaning);
- the functions a traced graph calls beyond torch's own: the autocast regions and
  custom ``autograd.Function`` applications the tracer records, and :func:`bind`,
  which names a kernel bound to the op it wraps;
- where a node comes from in the user's code (:func:`user_line`), and a module tree's
  train/eval flags set as ``nn.Module.train`` sets them (:func:`set_training`).

It imports nothing of hftc's, so every stage may import it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import operator
import os
import re
import sys
import sysconfig
import textwrap
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import typing_extensions

# --------------------------------------------------------------------------- meta keys

#: ``node.meta`` key of the value model 0 computes at a node, on the meta device.
EXAMPLE_VALUE = "example_value"

#: ``GraphModule.meta`` key: the plain attributes of the model's modules that its forward
#: changed while traced (``["encoder.calls"]``), which the tracer put back.
PYTHON_STATE = "hftc_python_state"

#: ``GraphModule.meta`` key: forward's inputs traced as Python constants, ``{name: value}``.
CONSTANT_INPUTS = "hftc_constant_inputs"

#: ``GraphModule.meta`` key of an exported graph: how torch.export kept the example inputs'
#: sizes (:class:`hftc.frontends.export.ExportedShapes`: every dim symbolic, the leading
#: dim only, or static shapes, and why).
EXPORTED_SHAPES = "hftc_exported_shapes"

#: ``node.meta`` key of a ``copy_`` the tracer wrote for ``module.buf = value`` in forward:
#: the buffer's path (``"stats.avg"``).
BUFFER_ASSIGNMENT = "hftc_buffer_assignment"

#: ``node.meta`` key: ``{key: [value of model 0, ..., model N-1]}`` for hyper-parameters
#: that differ between the models (absent when they all agree).  A key is a module
#: attribute's name (``"p"``, ``"eps"``) or an :class:`ArgKey`.
PER_MODEL = "hftc_per_model"

#: ``node.meta`` key: ``[op of model 0, ..., op of model N-1]`` for an elementwise op
#: (an activation, dropout or identity) that differs between the models, each a
#: :data:`hftc.lowering.runtime.differing_ops.Op` (absent when they all agree).
DIFFERING_OPS = "hftc_per_model_ops"  # (the key as stored: pickled graphs keep it)


@dataclass(frozen=True)
class ArgKey:
    """A call's argument whose value may differ per model: given by ``position``
    (``F.dropout(x, 0.1)``: ``ArgKey(position=1)``) or by ``keyword`` (``p=0.1``:
    ``ArgKey(keyword="p")``)."""

    position: int | None = None
    keyword: str | None = None

    def __str__(self) -> str:
        return f"argument {self.position}" if self.keyword is None else f"argument `{self.keyword}`"

#: The memory layout a program may run its 4-d activations in (autotune's candidates).
CHANNELS_LAST = "channels_last"

#: ``node.meta`` keys a fusion rule leaves on each node it builds: the rule's name, the
#: matched nodes of the N models it came from, and where in the user's code they are.
RULE = "hftc_rule"
ORIGIN = "hftc_origin"
SOURCE = "hftc_source"


# --------------------------------------------------------------------------- provenance

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                      for path in (torch.__file__, __file__))
_PACKAGE_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                       for k in ("purelib", "platlib")})
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
#: The decorators torch wraps its own functions in (``typing_extensions.deprecated`` on
#: ``torch.ao.quantization.quantize_dynamic``): their frames are torch's, not the user's.
_WRAPPER_FILES = (os.path.abspath(typing_extensions.__file__),)


@functools.cache
def is_user_file(filename: str) -> bool:
    """Not torch's, hftc's, Python's own or generated code (``<eval_with_key>``)."""
    if filename.startswith("<") or os.path.abspath(filename) in _WRAPPER_FILES:
        return False
    path = os.path.dirname(os.path.abspath(filename)) + os.sep
    if path.startswith(_LIBRARY_DIRS):
        return False
    return not path.startswith(_STDLIB_DIR) or path.startswith(_PACKAGE_DIRS)


def user_frame_trace(below: types.FrameType | None = None) -> str | None:
    """The innermost frame of the user's code on the caller's stack (up to the frame
    ``below``, not included: a tracer's own, so that a node torch's code makes for a bare
    ``nn.Conv2d`` is not put on the line that called ``hftc.fuse``), as fx writes a node's
    ``stack_trace``::

        File "vit.py", line 83, in forward
            x = x.mean(dim = 1) if self.pool == 'mean' else x[:, 0]

    The symbolic tracer stores it on each node it makes (a walk up a few frames: fx's own
    ``record_stack_traces`` formats the whole stack for every node)."""
    frame = sys._getframe(1)
    while frame is not None and frame is not below \
            and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or frame is below:
        return None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, line).strip()
    return f'File "{filename}", line {line}, in {frame.f_code.co_name}\n    {code}'


def return_statement_trace(forward: Callable[..., Any]) -> str | None:
    """Where ``forward`` returns, as :func:`user_frame_trace` writes it: the line of its
    only ``return`` (nested functions' aside), else of its ``def``; ``None`` outside the
    user's code.  The tracers make the output node after forward returned, with no frame
    of the user's on the stack: a mismatch at the output (an op one model's config adds
    at the end) named no line."""
    forward = inspect.unwrap(forward)
    try:
        lines, start = inspect.getsourcelines(forward)
        filename = inspect.getsourcefile(forward)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    if filename is None or not is_user_file(filename) or not tree.body \
            or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    definition = tree.body[0]
    returns, pending = [], list(definition.body)
    while pending:
        statement = pending.pop()
        if isinstance(statement, ast.Return):
            returns.append(statement)
        elif not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                        ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(statement))
    at = returns[0] if len(returns) == 1 else definition
    line = start + at.lineno - 1
    code = linecache.getline(filename, line).strip()
    return f'File "{filename}", line {line}, in {forward.__name__}\n    {code}'


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def user_line(node: Any) -> str:
    """Where in the user's code a graph node comes from, ``"vit.py:83 in forward: `x =
    x.mean(dim = 1) if ...`"``: the innermost frame of its ``stack_trace`` (the symbolic
    tracer's and torch.export's) outside torch and hftc; ``""`` where none is known."""
    trace = node.meta.get("stack_trace") or ""
    for filename, line, function, code in reversed(_FRAME.findall(trace)):
        if is_user_file(filename):
            try:
                relative = os.path.relpath(filename)
                filename = relative if not relative.startswith("..") else filename
            except ValueError:  # (another drive)
                pass
            return f"{filename}:{line} in {function}: `{code.strip()}`"
    return ""


# --------------------------------------------------------------------------- random draws

#: torch's functions that draw random numbers from any arguments, constants included.  The
#: symbolic front-end records every call of one as a graph node (a draw made while tracing
#: would be a constant); the rule table declares each ``random`` (``passes/elementwise.py``
#: registers them from here, and ``@rule`` refuses a non-random rule for one).
TORCH_RANDOM_DRAWS = (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "normal", "bernoulli", "multinomial", "poisson",
    # torch.distributions' Gamma / Beta / Dirichlet samplers and Binomial
    "_standard_gamma", "_sample_dirichlet", "binomial",
)


# --------------------------------------------------------------------------- arguments


@functools.cache
def call_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s parameters: a Python function's own signature, or a torch builtin's
    (``F.scaled_dot_product_attention``) from its one ATen schema.  The one owner of an
    op's argument names, positions and defaults (``F.batch_norm``'s ``eps`` is its 8th)."""
    if isinstance(fn, torch._ops.OpOverload):  # an ATen op: its schema
        from torch.fx.operator_schemas import _torchscript_schema_to_signature

        return _torchscript_schema_to_signature(fn._schema)
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        from torch.fx.operator_schemas import get_signature_for_torch_op

        # one schema, its out= variant aside (F.linear has both)
        signatures = [s for s in get_signature_for_torch_op(fn) or []
                      if "out" not in s.parameters]
        if len(signatures) != 1:
            raise TypeError(f"{getattr(fn, '__qualname__', fn)} has {len(signatures)} "
                            f"signatures: bind its arguments by a Python function") from None
        return signatures[0]


def bind_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, defaults filled in (the one binder)::

        bind_arguments(F.batch_norm, (x, rm, rv), {"eps": 1e-3})
        == {"input": x, "running_mean": rm, "running_var": rv, "weight": None,
            "bias": None, "training": False, "momentum": 0.1, "eps": 1e-3}
    """
    bound = call_signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def parameter_position(fn: Callable[..., Any], name: str) -> int | None:
    """The position of ``fn``'s parameter ``name`` (None if keyword-only); KeyError if none."""
    parameter = call_signature(fn).parameters[name]
    if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
        return None
    return list(call_signature(fn).parameters).index(name)


def positional_defaults(fn: Callable[..., Any], last: int) -> tuple:
    """``fn``'s defaults from its first defaulted positional parameter up to position
    ``last`` (what a call may leave out before a per-model argument)."""
    parameters = list(call_signature(fn).parameters.values())[:last + 1]
    first = next((k for k, p in enumerate(parameters) if p.default is not p.empty), last + 1)
    return tuple(p.default for p in parameters[first:])


# --------------------------------------------------------------------------- graph ops

_BOUND: dict[tuple[Any, Any], Callable[..., Any]] = {}


# --------------------------------------------------------------------------- autocast regions

#: The autocast regions of a model's forward that the running program has entered and
#: not yet left (:func:`enter_autocast`), innermost last, per thread.
_AUTOCAST_REGIONS = threading.local()


def _open_regions() -> list[Any]:
    if not hasattr(_AUTOCAST_REGIONS, "modes"):
        _AUTOCAST_REGIONS.modes = []
    return _AUTOCAST_REGIONS.modes


def enter_autocast(device_type: str, dtype: torch.dtype | None, enabled: bool,
                   cache_enabled: bool | None) -> Any:
    """``with torch.autocast(device_type, dtype, enabled, cache_enabled):`` in a model's
    forward, entered (the tracer records it: :mod:`hftc.frontends.symbolic`); returns the region for
    :func:`exit_autocast`."""
    mode = torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache_enabled)
    _open_regions().append(mode)
    return mode


def exit_autocast(mode: Any) -> None:
    """The end of the autocast region :func:`enter_autocast` entered."""
    _open_regions().remove(mode)
    torch.amp.autocast_mode._exit_autocast(mode)


class modes_restored_on_error:  # noqa: N801 - used as a context manager, like a function
    """Around a run of a generated program: if it raises, grad mode is the caller's again
    and the autocast regions it entered are left (the generated code switches grad mode
    and enters regions where the models' forward did, with no ``with`` block that would
    undo them).  A class, not a generator: it wraps every fused forward."""

    __slots__ = ("grad_mode", "depth")

    def __enter__(self) -> None:
        self.grad_mode, self.depth = torch.is_grad_enabled(), len(_open_regions())

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            return
        torch.set_grad_enabled(self.grad_mode)
        regions = _open_regions()
        while len(regions) > self.depth:
            torch.amp.autocast_mode._exit_autocast(regions.pop())


def set_training(module: torch.nn.Module, mode: bool) -> torch.nn.Module:
    """``module.train(mode)`` as ``nn.Module.train`` does it, every submodule's ``training``
    flag set, without calling a ``train`` the models' classes define: pytorch/examples'
    forward-forward ``Layer(nn.Linear)`` has ``train(self, x_pos, x_neg)``, its training
    loop, which ``model.train(True)`` (and a parent's ``nn.Module.train``) ran into."""
    for sub in module.modules():
        sub.training = mode
    return module


def apply_function(function: type, *args: Any, **kwargs: Any) -> Any:
    """``function.apply(*args)``: a custom ``torch.autograd.Function`` of the models' code
    as one node of a graph (:func:`bind` names it per class); it runs per model."""
    return function.apply(*args, **kwargs)


def reentrant_checkpoint_output(output: Any, *inputs: Any) -> Any:
    """``torch.utils.checkpoint(fn, *inputs, use_reentrant=True)``'s output, given
    ``fn(*inputs)``: where no tensor input requires grad, torch's CheckpointFunction gives
    an output without gradient (fn's parameters get none, with torch's warning), so the
    output is detached as torch's is::

        fn(x) with x.requires_grad   -> fn(x)
        fn(x), x without grad        -> fn(x).detach()   (warns as torch does)
    """
    leaves = torch.utils._pytree.tree_leaves(inputs)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return output
    if torch.is_grad_enabled():  # torch's own message (torch/utils/checkpoint.py)
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=2)
    return output.detach() if isinstance(output, torch.Tensor) else output


def bind(kernel: Callable[..., Any], fn: Any) -> Callable[..., Any]:
    """``kernel`` with ``fn`` as its first argument, as a named function a graph can call.

    torch.fx cannot print a function as an argument of a node, so a kernel that
    wraps another op (``channelwise(F.max_pool2d, ...)``, the one-by-one fallback) is
    emitted as ``channelwise__max_pool2d(x, ...)``.  Cached: one function per pair.
    """
    key = (kernel, fn)
    if key not in _BOUND:

        def bound(*args: Any, **kwargs: Any) -> Any:
            return kernel(fn, *args, **kwargs)

        name = getattr(fn, "__name__", type(fn).__name__)
        bound.__name__ = bound.__qualname__ = f"{kernel.__name__}__{name}".replace(".", "_")
        _BOUND[key] = bound
    return _BOUND[key]


#: Python's in-place operators, as fx records them (``y[i] = v``, ``y += v``).
INPLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
}
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in INPLACE_OPERATORS}


def node_writes_in_place(node: torch.fx.Node) -> bool:
    """Does ``node`` write into its first argument?  ``y.add_(v)``, ``torch.index_put_(y,
    ...)``, ``y[i] = v``, ``y += v``; not ``y & m`` (``__and__``) nor ``y.__iand__``'s kin
    read as a dunder: only the ``__i*__`` ones and ``__setitem__`` write."""
    if node.op == "call_method":
        name = str(node.target)
        return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS:
            return True
        if getattr(node.target, "__module__", None) in ("operator", "_operator"):
            return False  # operator.and_, or_: named for the keyword, not in place
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False
