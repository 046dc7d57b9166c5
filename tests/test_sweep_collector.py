"""hftc.sweep.collector: the sweep's garbage collection paused while it starts and the
objects start-up made frozen while it runs, each given back as the caller had it."""

from __future__ import annotations

import gc

from hftc.sweep.collector import frozen_objects, paused_collection


def test_paused_collection_restores_the_callers_setting():
    assert gc.isenabled()
    with paused_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's "off" stays off
    finally:
        gc.enable()


def test_frozen_objects_freezes_then_gives_the_objects_back():
    assert gc.get_freeze_count() == 0
    with frozen_objects():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_frozen_objects_leaves_a_callers_freeze_as_it_is(monkeypatch):
    # (counted as calls: the freeze count itself also drops when a frozen object is freed,
    # which another test's thread ending at that moment does)
    calls = []
    for name in ("freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda real=real, name=name: (calls.append(name), real()))
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        with frozen_objects():
            assert calls == ["freeze"]  # the caller's, nothing more
        assert calls == ["freeze"]  # not unfrozen by the sweep
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_sweep_unfreezes_and_collects_its_garbage_after(tmp_path):
    """The spec's data loads with collection paused, the rounds run frozen; after the
    sweep the caller's process collects as before: nothing stays frozen, a cycle made
    during the rounds is garbage for the next collection."""
    import weakref

    from test_sweep_bench import _spec_file

    import hftc.sweep as hs

    class Node:
        pass

    refs = []

    def on_round(sweep):
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        refs.append(weakref.ref(a))
        assert gc.get_freeze_count() > 0 and gc.isenabled()

    spec = hs.load_spec(_spec_file(tmp_path))
    collecting = []
    data = spec.data
    spec = spec.replace(data=lambda: (collecting.append(gc.isenabled()), data())[1])
    hs.Sweep(spec, out=tmp_path / "out", progress=False, on_round=on_round).run()
    assert collecting == [False]  # the spec's data loaded with collection paused
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert refs
    gc.collect()
    assert all(r() is None for r in refs)


def test_freeze_at_exit_freezes_at_shutdown_not_before():
    """The CLI's hook: nothing frozen while the process goes on (a test calling the
    CLI's main keeps collecting), every object frozen before shutdown's last collection."""
    import subprocess
    import sys

    code = ("import atexit, gc\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
            "from hftc.sweep.collector import freeze_at_exit\n"
            "freeze_at_exit(); freeze_at_exit()\n"
            "print('frozen before:', gc.get_freeze_count() > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:2] == ["frozen before: False", "frozen at exit: True"], out
