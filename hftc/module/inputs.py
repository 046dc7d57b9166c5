"""A fused module's inputs: ``in_dims`` (which inputs carry the model dim), the inputs
of a call merged into the values the program takes, and an input the models cannot take
said as such.

::

    fused(x, mask)  --in_dims-->  values [x, mask], batched [False, True]
                                  (batched: dim 0 holds the N models' slices)

:class:`InputHandling` is a part of :class:`~hftc.module.fused.FusedModule`.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import linecache
import operator
import re
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import ir
from ..errors import (
    FusionArgumentError,
    FusionError,
    ModelInputError,
    UsageWarning,
    user_line,
    user_stacklevel,
)
from ..frontends.symbolic import (
    annotate_example_values,
)
from ..lowering.compile_guard import run_eagerly
from ..lowering.runtime.layout import expand_models, model_slice
from .programs import guard_failure, input_shapes
from .usage import fused_output_models

#: What ``in_dims`` takes: as ``torch.func.vmap``'s.
InDims = int | None | Sequence[int | None]

#: the models' forward -> (its signature, None where inspect cannot read it; the call
#: shapes it took: inputs by position, names by keyword), for ``_bind_as_models_do``
_FORWARD_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_in_dims(in_dims: Any) -> InDims:
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


#: ``x.float()`` for a float32 model: how a message says to cast an input.
_CAST_METHODS = {torch.float32: "float()", torch.float64: "double()", torch.float16: "half()",
                 torch.bfloat16: "bfloat16()"}


#: The user's lines warned by :func:`_warn_shared_fused_output` (file, line).
_WARNED_SHARED: set[tuple[str, int]] = set()


def _warn_shared_fused_output(what: str, value: torch.Tensor, n: int) -> None:
    """A fused module's output ``[N, ...]`` (a fused generator's fakes, a recurrent
    state) passed as an input this fused module shares: every model gets all N slices.
    Where model 0 cannot run on them the call is refused (``_explain_input_mismatch``);
    where it can (a Linear discriminator: ``D(fakes)`` gave ``[N, N*B]``) it ran
    silently, each discriminator scoring every generator's fakes. Warned once a line."""
    frame = sys._getframe(user_stacklevel() - 1)
    site = (frame.f_code.co_filename, frame.f_lineno)
    if site in _WARNED_SHARED or torch.compiler.is_compiling():
        return
    _WARNED_SHARED.add(site)
    code = linecache.getline(*site).strip()
    warnings.warn(
        f"{what} at {site[0]}:{site[1]}{f': `{code}`' if code else ''} is a fused "
        f"module's output {list(value.shape)} ({n} models' outputs stacked), and this "
        f"fused module shares it among its {n} models: each model gets all {n} slices, "
        f"not its own. To give model i slice i (a GAN's "
        f"discriminator on its generator's fakes, a hidden state fed back), fuse with "
        f"in_dims (hftc.fuse(models, in_dims=0)) or call fused.with_in_dims(0)(x); to "
        f"share it on purpose, pass a copy (x.detach(), x.clone())", UsageWarning,
        stacklevel=user_stacklevel())


class InDimsCall:
    """``fused.with_in_dims(in_dims)``: calls of the fused module (and of its methods)
    with ``in_dims`` in place of the one it was fused with."""

    def __init__(self, fused: InputHandling, in_dims: InDims) -> None:
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



class InputHandling:
    """(see the module docstring)"""

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
            what = f"input {k}" if names is None else f"input `{names[k]}` (input {k})"
            if d is None:
                if isinstance(a, torch.Tensor) and self.num_models > 1 \
                        and fused_output_models(a) == self.num_models:
                    _warn_shared_fused_output(what, a, self.num_models)
                merged.append(a)
                batched.append(False)
                continue
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
            per_model = ("" if len(args) != self.num_models or len(placeholders) != 1 else
                         f" For one input per model (x_i for model i): "
                         f"fused.with_in_dims(0)(torch.stack([x_0, ..., x_{len(args) - 1}])).")
            raise FusionArgumentError(
                f"the fused module got {len(args)} positional inputs, but the models' "
                f"forward takes {takes}{user_line()}: call it as you would call one model "
                f"(fused(x) for forward(self, x)).{per_model}{exported}"
            )
        given_kwargs, kwargs = kwargs, dict(kwargs)
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
        self._bind_as_models_do(args, given_kwargs)
        merged, batched = self._merge_inputs(values, given, [p.target for p in placeholders])
        if self.__dict__.get("frontend") == "export":
            refused = guard_failure(self._mode_graphs[self.training].graph, merged, batched)
            if refused is not None:
                self._use_export(("shapes", input_shapes(merged, batched)), merged, batched,
                                 refused)
        return merged, batched

    @run_eagerly
    def _bind_as_models_do(self, args: tuple, kwargs: dict) -> None:
        """Refuse a call the models' own forward refuses (its signature: positional-only,
        keyword-only, defaults, ``*args``, ``**kwargs``): ``fused(x)`` for
        ``forward(self, *, x)`` raises TypeError on each model, and must not run fused,
        where a wrong script would work only fused.  Eager under torch.compile: traced,
        the weak cache of signatures became a guarded dict of every forward seen, whose
        keys dynamo could fail to hash."""
        forward = type(self._template).forward
        try:
            known = _FORWARD_SIGNATURES.get(forward)
        except TypeError:  # (a forward that is no function: not kept)
            known = None
        if known is None:  # (read once per forward: inspect costs tens of us a call)
            try:  # (a decorator's wrapper, not the function it wraps: what the models run)
                known = (inspect.signature(forward, follow_wrapped=False), set())
            except (TypeError, ValueError):  # (a signature inspect cannot read: as traced)
                known = (None, set())
            with contextlib.suppress(TypeError):
                _FORWARD_SIGNATURES[forward] = known
        signature, accepted = known
        # Whether it binds depends on how many inputs by position and which by name only.
        shape = (len(args), frozenset(kwargs))
        if signature is None or shape in accepted:
            return
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise FusionArgumentError(
                f"{type(self._template).__name__}.forward{signature} refuses this call "
                f"({exc}){user_line()}: call the fused module as you would call one "
                f"model") from None
        accepted.add(shape)

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

    def with_in_dims(self, in_dims: InDims) -> InDimsCall:
        """The fused module with ``in_dims`` for the calls made through the result, as
        ``torch.func.vmap(model, in_dims)(x)`` reads: ``fused(real)`` shares real images
        among the models, ``fused.with_in_dims(0)(fake)`` gives model i its ``fake[i]``
        (a GAN discriminator on a fused generator's fakes; an RNN's carried hidden state:
        ``fused.with_in_dims((0, 0))(x, hidden)``).  Its methods take the same in_dims
        (``fused.with_in_dims(0).decode(z)``).  ``in_dims`` is checked as ``hftc.fuse``'s,
        and the module's own stays as it was."""
        return InDimsCall(self, check_in_dims(in_dims))

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

    def _explain_tensor_mismatch(self, cause: Exception) -> None:
        """A parameter or buffer of another shape than the stacked one the program was built
        for, said as such: ``torch.func.functional_call(fused, params, x)`` with one model's
        ``[8, 6]`` weight, or a stack of another N, failed deep in a kernel ("Dimension out
        of range", "The expanded size of the tensor")."""
        template, n = self.__dict__.get("_template"), self.num_models
        if template is None:
            return
        own = dict(template.named_parameters(remove_duplicate=False))
        own.update(template.named_buffers(remove_duplicate=False))
        for name, t in [*self.named_parameters(remove_duplicate=False),
                        *self.named_buffers(remove_duplicate=False)]:
            if name not in own or t is None or tuple(t.shape) == (n, *own[name].shape):
                continue
            stacked = [n, *own[name].shape]
            raise FusionArgumentError(
                f"the fused module's `{name}` is {list(t.shape)} on this call, but the fused "
                f"program was built for {stacked}: each of the {n} models' own "
                f"{list(own[name].shape)} stacked along dim 0. A tensor given in its place "
                f"(torch.func.functional_call(fused, params, ...), an assignment) must hold "
                f"one per model, stacked, as fused.named_parameters() and "
                f"torch.func.stack_module_state(models) give them{user_line()}"
            ) from cause

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
        if not isinstance(cause, FusionError):
            # Raised inside the fused program on inputs of sizes it had not seen: where
            # model 0 cannot take its share either, say so in its own op's words.
            own = self._model_error(values, batched)
            if isinstance(own, FusionError):
                raise ModelInputError(str(own)) from cause

    def _model_runs_on_slices(self, values: Sequence[Any], batched: Sequence[bool],
                              stacked: Sequence[int]) -> bool:
        """Whether model 0's graph runs on its slices of the inputs, taking slice 0 of the
        shared inputs ``stacked`` too."""
        return self._model_error(values, batched, stacked) is None

    def _model_error(self, values: Sequence[Any], batched: Sequence[bool],
                     stacked: Sequence[int] = ()) -> Exception | None:
        """What model 0's own graph raises on its slices of the inputs (and slice 0 of the
        shared inputs ``stacked``), shape propagation on a copy of its graph on meta
        tensors: a ``TraceError`` naming its op, module path and torch's words; ``None``
        where it runs."""
        graph = self._mode_graphs[self.training].graph
        trial = fx.Graph()
        trial.output(trial.graph_copy(graph, {}))
        per_model = [model_slice(v, 0) if b or k in stacked else v
                     for k, (v, b) in enumerate(zip(values, batched))]
        try:
            # (a graph that fails inside an autocast or no-grad region it entered leaves it)
            with ir.modes_restored_on_error():
                annotate_example_values(trial, self._template, per_model, {},
                                        self._model_tensors)
        except Exception as exc:  # noqa: BLE001 - it does not: the caller says how
            return exc
        return None
