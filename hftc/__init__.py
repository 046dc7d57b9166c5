"""hftc: fuse N unmodified PyTorch models into one module that trains all N at once.

    fused = hftc.fuse([m0, m1, m2])
    out = fused(x)                      # out[i] == m_i(x)
"""

from . import amp, errors, optim, utils  # noqa: E402  (they import the names above)
from .errors import (
    FusionError,
    FusionWarning,
    MismatchError,
    TraceError,
    UnsupportedOperatorError,
)
from .fused import FusedModule, fuse
from .group import fuse_groups
from .lowering.heap import keep_freed_memory
from .utils import per_model

__all__ = [
    "FusedModule", "FusionError", "FusionWarning", "MismatchError", "TraceError",
    "UnsupportedOperatorError", "amp", "errors", "fuse", "fuse_groups", "keep_freed_memory",
    "optim", "per_model", "utils",
]
__version__ = "0.1.0"
