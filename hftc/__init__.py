"""hftc: fuse N unmodified PyTorch models into one module that trains all N at once.

    fused = hftc.fuse([m0, m1, m2])
    out = fused(x)                      # out[i] == m_i(x)

``import hftc`` costs nothing until torch is imported, so the command line (``hftc --help``,
``python -m hftc sweep --help``) answers without loading torch (about 3 s):

- torch already imported (``import torch`` above ``import hftc``): the core loads at once, as
  ``import hftc`` always did;
- else ``import hftc`` puts a finder on ``sys.meta_path`` that loads the core right after
  torch's own import, whoever imports torch (:class:`_LoadCoreAfterTorch`), and the public
  names resolve on first access (PEP 562 ``__getattr__``, which loads the core itself where
  torch is not imported yet).

Either way hftc's patches of torch (all installed by :func:`hftc.patches.install`, listed there
and in docs/API.md: ``torch.nn.utils.clip_grad_norm_`` per model, the refusals of LBFGS,
Adafactor, Muon, ``update_bn``, ``ReduceLROnPlateau`` given N metrics) are in place before
any code can bind a torch name, which a plain lazy ``__getattr__`` would not promise
(``import hftc; from torch.nn.utils import clip_grad_norm_`` would keep torch's).
A console script cannot skip this file (Python imports a package before its submodules), so
this is what lets the ``hftc`` command start fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

# name -> the submodule that defines it ("" : the name is the submodule itself).
_PUBLIC = {
    "FusedModule": "fused", "fuse": "fused", "fuse_groups": "group",
    "keep_freed_memory": "runtime.memory", "per_model": "utils",
    "compile_step": "step", "CompiledStep": "step", "keep_models": "shrink",
    "replace_models": "shrink",
    "FusionError": "errors", "FusionWarning": "errors", "MismatchError": "errors",
    "TraceError": "errors", "UnsupportedOperatorError": "errors",
    "amp": "", "errors": "", "optim": "", "utils": "",
}
__all__ = sorted(_PUBLIC)

# The core's modules, in the order the package imports them.
_CORE = ("amp", "errors", "optim", "utils", "fused", "group", "runtime.memory", "step",
         "shrink", "patches")


def _load_core() -> None:
    """Import hftc's core, install its torch patches (:mod:`hftc.patches`) and bind the
    public names."""
    _LoadCoreAfterTorch.uninstall()
    for name in _CORE:
        importlib.import_module(f"{__name__}.{name}")
    sys.modules[f"{__name__}.patches"].install()
    module = sys.modules[__name__]
    for name, where in _PUBLIC.items():
        source = sys.modules[f"{__name__}.{where or name}"]
        setattr(module, name, source if not where else getattr(source, name))


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_core()
    return globals()[name]


def __dir__() -> list[str]:
    return [*sorted(_PUBLIC), "__version__"]


class _LoadCoreAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loaders of torch and of hftc's submodules so that
    hftc's core loads as soon as torch is imported and no hftc module is part-way through its
    own import (``from hftc.fused import fuse`` above ``import torch``: once hftc.fused is
    done).  Gone once the core has loaded."""

    importing_hftc = 0  # hftc submodules part-way through their import

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(finder, cls) for finder in sys.meta_path):
            sys.meta_path.insert(0, cls())

    @classmethod
    def uninstall(cls) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]

    def find_spec(self, fullname, path, target=None):
        is_hftc = fullname.startswith(f"{__name__}.")
        if fullname != "torch" and not is_hftc:
            return None
        spec = next(filter(None, (finder.find_spec(fullname, path, target)
                                  for finder in sys.meta_path
                                  if finder is not self and hasattr(finder, "find_spec"))),
                    None)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module
        finder = type(self)

        def exec_then_load_core(module):
            finder.importing_hftc += is_hftc
            try:
                exec_module(module)
            finally:
                finder.importing_hftc -= is_hftc
            if finder.importing_hftc == 0 and "torch" in sys.modules and self in sys.meta_path:
                _load_core()

        spec.loader.exec_module = exec_then_load_core
        return spec


if "torch" in sys.modules:
    _load_core()
else:
    _LoadCoreAfterTorch.install()
