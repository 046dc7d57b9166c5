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
import os
import sys
import time
from typing import Any

__version__ = "0.1.0"

# name -> the submodule that defines it ("" : the name is the submodule itself).
_PUBLIC = {
    "FusedModule": "module.fused", "fuse": "module.fused", "fuse_groups": "module.group",
    "keep_freed_memory": "lowering.runtime.memory", "per_model": "utils",
    "compile_step": "training.step", "CompiledStep": "training.step",
    "keep_models": "training.shrink", "replace_models": "training.shrink",
    "BestCheckpoint": "training.bookkeeping", "EarlyStopping": "training.bookkeeping",
    "per_model_accuracy": "training.bookkeeping",
    "FusionError": "errors", "FusionWarning": "errors", "MismatchError": "errors",
    "TraceError": "errors", "UnsupportedOperatorError": "errors", "UsageWarning": "errors",
    "amp": "", "errors": "", "optim": "", "utils": "",
}
__all__ = sorted(_PUBLIC)

# The core's modules, in the order the package imports them.
_CORE = ("amp", "errors", "optim", "utils", "module.fused", "module.group",
         "lowering.runtime.memory", "training.step", "training.shrink",
         "training.bookkeeping", "patches")

#: Module names of an earlier layout -> where the module is now: ``import hftc.amp``,
#: ``hftc.hf.FusedTrainer`` and pickles of fused modules (``hftc.runtime.modules``) keep
#: working (:class:`_OldNames`).
OLD_NAMES = {
    "hftc.amp": "hftc.training.amp", "hftc.step": "hftc.training.step",
    "hftc.hf": "hftc.integrations.hf", "hftc.lightning": "hftc.integrations.lightning",
    "hftc.ray": "hftc.integrations.ray",
    "hftc.fused": "hftc.module.fused", "hftc.group": "hftc.module.group",
    "hftc.shrink": "hftc.training.shrink", "hftc.stacking": "hftc.module.stacking",
    "hftc.padding": "hftc.module.padding", "hftc.padding_graph": "hftc.module.padding_graph",
    "hftc.compile": "hftc.lowering", "hftc.runtime": "hftc.lowering.runtime",
    "hftc.compile_guard": "hftc.lowering.compile_guard",
    "hftc.speed": "hftc.cli.speed", "hftc.cli_args": "hftc.cli.args",
    "hftc.cli_graph": "hftc.cli.graph",
    "hftc.lowering.runtime.model_loop": "hftc.lowering.runtime.one_by_one",
    "hftc.lowering.runtime.per_model_ops": "hftc.lowering.runtime.differing_ops",
    "hftc.passes.per_model_ops": "hftc.passes.differing_ops",
}


#: ``HFTC_STOCK_TORCH=1`` in the environment: the core loads without its torch patches
#: (:mod:`hftc.patches`), for a process that measures stock torch with hftc's code around
#: it (``hftc bench --sweep``'s one-at-a-time side); no fused module works right there.
STOCK_TORCH = "HFTC_STOCK_TORCH"

#: Seconds the core's import took (a script without hftc does not pay them: the sweep's
#: summary leaves them out of the one-at-a-time side's start-up, hftc/sweep/clock.py).
_CORE_LOAD_S = 0.0


def _load_core() -> None:
    """Import hftc's core, install its torch patches (:mod:`hftc.patches`) and bind the
    public names."""
    global _CORE_LOAD_S
    start = time.perf_counter()
    _LoadCoreAfterTorch.uninstall()
    for name in _CORE:
        importlib.import_module(f"{__name__}.{name}")
    if os.environ.get(STOCK_TORCH) != "1":
        sys.modules[f"{__name__}.patches"].install()
    module = sys.modules[__name__]
    for name, where in _PUBLIC.items():
        source = sys.modules[f"{__name__}.{where or name}"]
        setattr(module, name, source if not where else getattr(source, name))
    # (the outermost call's: a core module that reads a public name loads it nested)
    _CORE_LOAD_S = max(_CORE_LOAD_S, time.perf_counter() - start)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_core()
    return globals()[name]


def __dir__() -> list[str]:
    return [*sorted(_PUBLIC), "__version__"]


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import hftc.amp`` (an :data:`OLD_NAMES` name, or a module under one) gives the
    module at its new name, the one module object (no second copy of its classes)."""

    @staticmethod
    def target(fullname: str) -> str | None:
        old = fullname
        while old not in OLD_NAMES and "." in old:
            old = old.rpartition(".")[0]
        return OLD_NAMES[old] + fullname[len(old):] if old in OLD_NAMES else None

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(f"{__name__}.") or self.target(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(self.target(spec.name))
        spec.loader_state = module.__spec__  # (the import system sets __spec__ to ours)
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # imported already, at its own name


if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
    sys.meta_path.insert(0, _OldNames())


class _LoadCoreAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loaders of torch and of hftc's submodules so that
    hftc's core loads as soon as torch is imported and no hftc module is part-way through its
    own import (``from hftc.module.fused import fuse`` above ``import torch``: once
    hftc.module.fused is done).  Gone once the core has loaded."""

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
