"""Keep hftc's own Python out of ``torch.compile`` without importing torch._dynamo.

``@torch.compiler.disable`` imports torch._dynamo (about 1.5 s) when the decorated
function is defined, i.e. on ``import hftc``. Nothing can be compiling before
torch._dynamo is imported, so until then the function is called as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
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
