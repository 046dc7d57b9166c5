"""The runtime: everything a fused graph's generated code calls, and nothing that builds it.

Compiling a fused module (tracing, matching, the passes, the compile stages) writes an
``fx.Graph`` whose calls land here; this package imports only :mod:`hftc.ir`,
:mod:`hftc.errors` and its own modules (``tests/test_layers.py`` checks it).
"""
