"""The command's helpers (``python -m hftc``, :mod:`hftc.__main__`).

| file     | what                                                                          |
|----------|-------------------------------------------------------------------------------|
| args.py  | argument types shared by the subcommands                                      |
| graph.py | ``hftc inspect --format dot|svg|png``: the fused graph as a Graphviz picture   |
| report.py| ``hftc inspect``'s text: each op as the user wrote it, shapes ``[N, ...]``     |
| speed.py | a fused training step timed against the serial loop it replaces               |
"""
