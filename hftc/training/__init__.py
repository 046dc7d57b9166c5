"""Training around a fused module (with :mod:`hftc.optim`, the fused optimizers).

| file           | what                                                                    |
|----------------|-------------------------------------------------------------------------|
| step.py        | ``hftc.compile_step``: forward, per-model loss, backward and the        |
|                | optimizer step as one callable (eager, ``torch.compile``, a CUDA graph) |
| amp.py         | ``hftc.amp``: a per-model ``GradScaler``                                |
| shrink.py      | ``hftc.keep_models`` / ``hftc.replace_models``: the fused module and    |
|                | its optimizers and schedulers cut to some models, or some replaced      |
| weight_init.py | ``torch.nn.init`` on a stacked parameter: each model's row in turn,     |
|                | with that model's fans and the draws a loop over the models makes       |
"""
