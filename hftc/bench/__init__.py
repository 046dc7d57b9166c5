"""hftc's benchmark suite: hftc against the baselines a user would pick (docs/BENCHMARKS.md).

``hftc bench [--quick]`` (or ``python -m hftc bench``); see :mod:`hftc.bench.suite`. The
workload and contender names the command line lists without importing torch are in
:mod:`hftc.bench.names`.
"""
