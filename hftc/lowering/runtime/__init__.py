"""The runtime: everything a fused graph's generated code calls, and nothing that builds it.

A kernel is the exact equivalent of the per-model op applied to each slice:
``kernel(x)[i] == op(x[i])``.  Parameters arrive stacked, ``[N, *shape]``; each kernel
takes free views of them (``[N, Cout, Cin/g, k, k]`` -> ``[N*Cout, Cin/g, k, k]``).
``x_batched=False`` means ``x`` is shared by all models (no model dim): the fast path
of a hyper-parameter sweep, where the first layer of N models reads one batch.

Before this package, ``hftc/lowering/kernels.py`` held every kernel; now, by topic::

    layout.py      the model dim folded into channels and back; memory-format questions
    conv.py        convolutions and their lowerings      linear.py   linears, matmul, chains
    norms.py       batch / instance / group / layer / RMS norm (shared or per-model scalars)
    embedding.py   embedding lookups                     random.py   dropout, Bernoulli masks
    spatial.py     channel-wise / per-sample ops, pooling, shapes
    reduction.py   reductions, softmax                   losses.py   per-model losses
    fallback.py    an op with no fused kernel, one by one
    per_model.py   per-model scalars (the bottom of the hyper-parameter kernels)
    differing_ops.py an elementwise op that differs per model (a differing op), on each slice
    tuning.py      ``@tunable(lowerings)``: a kernel's lowerings, which autotune times
    attention.py, recurrent.py, one_by_one.py (the N models one by one), memory.py (malloc
    settings), modules.py (the stacked-module tree)

Compiling a fused module (tracing, matching, the passes, the compile stages) writes an
``fx.Graph`` whose calls land here; this package imports only :mod:`hftc.ir`,
:mod:`hftc.errors` and its own modules (``tests/test_layers.py`` checks it).
"""
