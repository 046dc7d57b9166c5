"""Stage 1, the front-ends: N models -> N ``torch.fx`` graphs of their forward.

| file        | what                                                                  |
|-------------|-----------------------------------------------------------------------|
| symbolic.py | ``torch.fx`` symbolic tracing (``frontend="symbolic"``, the default),  |
|             | shape propagation on the traced graph, and the table of the modules   |
|             | whose forward is traced through (``TRACEABLE_FORWARDS``)               |
| export.py   | ``torch.export`` (``frontend="export"``), its ATen graph normalised   |
|             | to the functional spellings the rules know, and its input guards      |
| closures.py | functions a model keeps (``self.mlpf = lambda x: ...``), rebound per  |
|             | model                                                                 |

They import nothing above :mod:`hftc.match` (see tests/test_layers.py).
"""
