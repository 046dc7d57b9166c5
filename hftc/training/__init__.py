"""Training around a fused module (with :mod:`hftc.optim`, the fused optimizers).

| file      | what                                                                         |
|-----------|------------------------------------------------------------------------------|
| step.py   | ``hftc.compile_step``: forward, per-model loss, backward and the optimizer   |
|           | step as one callable (eager, ``torch.compile`` or a CUDA graph)              |
| amp.py    | ``hftc.amp``: a per-model ``GradScaler``                                     |
| shrink.py | ``hftc.keep_models`` / ``hftc.replace_models``: the fused module and its     |
|           | optimizers and schedulers cut to some models, or some models replaced        |
"""
