"""hftc's benchmark suite lives in :mod:`hftc.bench` (installed with hftc); this folder keeps
the source checkout's results (``results/``) and the ``python -m benchmarks`` shortcut.

``hftc bench [--quick]`` is the suite; docs/BENCHMARKS.md describes it.
"""
