"""hftc: fuse N unmodified PyTorch models into one module that trains all N at once.

    fused = hftc.fuse([m0, m1, m2])
    out = fused(x)                      # out[i] == m_i(x)
"""

from . import errors
from .errors import (
    FusionError,
    MismatchError,
    TraceError,
    UnsupportedOperatorError,
)
from .fused import FusedModule, fuse

__all__ = [
    "FusedModule", "FusionError", "MismatchError", "TraceError", "UnsupportedOperatorError",
    "errors", "fuse",
]
__version__ = "0.1.0"
