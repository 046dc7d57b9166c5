"""hftc's benchmark suite: hftc against the baselines a user would pick (docs/BENCHMARKS.md).

``python -m hftc bench [--quick]``; see :mod:`benchmarks.suite`.
"""
