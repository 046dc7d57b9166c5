"""The sweep's cyclic garbage collection: off while a worker starts, the objects start-up
made frozen while it runs, and frozen again where the process is about to exit.

::

    Sweep.run:   with paused_collection():  open (the spec's data, torch._dynamo, storage)
                 with frozen_objects():     the rounds, the results, the replay
    hftc sweep:  freeze_at_exit()           interpreter shutdown walks no frozen object

A sweep's process holds hundreds of thousands of long-lived objects (torch, Optuna,
SQLAlchemy, scikit-learn, fx graphs): each full collection walks them all, and start-up,
fusing and the storage's queries trigger several, and interpreter shutdown one more.
Frozen objects (``gc.freeze``) are left out of every collection; garbage made before the
freeze waits until they are unfrozen (docs/BENCHMARKS.md has the measurements).
Nothing here changes what is computed.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collection", "frozen_objects", "freeze_at_exit"]


@contextlib.contextmanager
def paused_collection() -> Iterator[None]:
    """No cyclic collection inside (the caller's setting restored after): imports and
    data loading make objects that live as long as the process."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def frozen_objects() -> Iterator[None]:
    """Every object alive at entry left out of the collections inside, and given back
    to them at exit; where the caller froze objects itself, its freeze is left as it is
    (``gc.unfreeze`` would give back its objects too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_at_exit() -> None:
    """At interpreter shutdown, before its last collection, freeze every object: that
    collection then walks no object (the operating system takes the memory back anyway).
    An ``atexit`` hook, so a caller that goes on (a test calling the CLI's ``main``) keeps
    collecting as before."""
    atexit.unregister(gc.freeze)  # (once, however often the CLI's main is called)
    atexit.register(gc.freeze)
