"""Keep Python out of ``torch.compile`` without importing torch._dynamo.

``@torch.compiler.disable`` imports torch._dynamo (about 1 s) when the decorated
function is defined, i.e. on ``import hftc``; torch's own ``@torch._disable_dynamo``
(``Optimizer.zero_grad``, ``add_param_group``, ...) on the first call, i.e. in every
script's first optimizer. Nothing can be compiling before torch._dynamo is imported,
so until then such a function is called as it is (:func:`run_eagerly` for hftc's,
:func:`defer_dynamo_import` for torch's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FunctionType
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, with torch._dynamo imported only once in use."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            import torch._dynamo
            disabled = torch._dynamo.disable(fn)
        return disabled(*args, **kwargs)

    return call  # type: ignore[return-value]


def compiled_original(module: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper holds, else ``module`` itself."""
    if "torch._dynamo" not in sys.modules:
        return module  # no OptimizedModule can exist yet
    from torch._dynamo.eval_frame import OptimizedModule
    return module._orig_mod if isinstance(module, OptimizedModule) else module


#: where torch's ``@torch._disable_dynamo`` wrapper keeps ``torch._dynamo.disable(fn)``
#: (a string: a class body would mangle the name)
_TORCHS_DISABLED = "__dynamo_disable"
#: torch functions under ``@torch._disable_dynamo`` that :func:`defer_dynamo_import` made
#: call themselves until torch._dynamo's import
_DEFERRED: list[Callable[..., Any]] = []


def defer_dynamo_import(*roots: Callable[..., Any]) -> None:
    """Let torch's ``@torch._disable_dynamo`` functions run without importing torch._dynamo.

    torch's wrapper calls ``fn.__dynamo_disable``, made (importing torch._dynamo) on its
    first call: for each such wrapper among ``roots`` and the functions they wrap (their
    ``__wrapped__`` and closures), it is ``fn`` itself until torch._dynamo is imported,
    then deleted (:class:`_AfterDynamoImport`), so that torch makes its own on the next
    call::

        optimizer.zero_grad()    # before:  import torch._dynamo; torch._dynamo.disable(fn)(...)
                                 # now:     fn(...), torch's own once torch._dynamo is imported

    A wrapper of another shape than this torch's is left as it is."""
    if "torch._dynamo" in sys.modules:
        return
    import torch

    torch_wrapper = torch._disable_dynamo(lambda: None).__code__
    fn_cell = torch_wrapper.co_freevars.index("fn")
    for wrapper in _wrapped_functions(roots):
        if wrapper.__code__ is not torch_wrapper:
            continue
        fn = wrapper.__closure__[fn_cell].cell_contents
        if getattr(fn, _TORCHS_DISABLED, None) is None:
            setattr(fn, _TORCHS_DISABLED, fn)
            _DEFERRED.append(fn)
    if _DEFERRED and not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


def _wrapped_functions(roots: Iterable[Any], depth: int = 6) -> Iterator[FunctionType]:
    """``roots`` and the Python functions they reach through ``__wrapped__``, their
    closures and ``functools.partial``, each once, ``depth`` calls deep."""
    seen: set[int] = set()
    todo = [(root, 0) for root in roots]
    while todo:
        fn, level = todo.pop()
        fn = getattr(fn, "__func__", fn)  # (a bound method)
        fn = fn.func if isinstance(fn, functools.partial) else fn
        if not isinstance(fn, FunctionType) or id(fn) in seen or level > depth:
            continue
        seen.add(id(fn))
        yield fn
        inner = [getattr(fn, "__wrapped__", None)]
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # (an empty cell)
                inner.append(cell.cell_contents)
        todo.extend((f, level + 1) for f in inner if callable(f))


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps torch._dynamo's loader so that, once it has run, the
    functions :func:`defer_dynamo_import` deferred are torch's own again (before anything
    can compile). Gone after that import."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        spec = next(filter(None, (finder.find_spec(fullname, path, target)
                                  for finder in sys.meta_path
                                  if finder is not self and hasattr(finder, "find_spec"))),
                    None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_restore(module):
            try:
                exec_module(module)
            finally:
                sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
                for fn in _DEFERRED:
                    if getattr(fn, _TORCHS_DISABLED, None) is fn:
                        delattr(fn, _TORCHS_DISABLED)
                _DEFERRED.clear()

        spec.loader.exec_module = exec_then_restore
        return spec
