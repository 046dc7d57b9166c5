"""The tools people already train with, around a fused module; each imports its optional
dependency on first use, and ``import hftc`` imports none of them. Their public names are
the short ones (``hftc.hf``, ``hftc.lightning``, ``hftc.ray``).

| file         | what                                                                      |
|--------------|---------------------------------------------------------------------------|
| hf.py        | ``hftc.hf.FusedTrainer``: a ``transformers.Trainer`` of a fused module    |
| lightning.py | ``hftc.lightning``: a ``LightningModule`` base, per-model callbacks       |
| ray.py       | ``hftc.ray``: the sweep's workers as Ray actors, fused arrays in Ray Tune |
"""
