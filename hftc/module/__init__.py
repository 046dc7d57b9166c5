"""The module the user holds: ``hftc.fuse`` and the :class:`~hftc.module.fused.FusedModule`
it returns, built from the compiler's stages.

| file             | what                                                                  |
|------------------|-----------------------------------------------------------------------|
| fused.py         | ``hftc.fuse`` and ``FusedModule``: forward, methods, state, pickling  |
| copies.py        | each model's own copy (no tensors), what every per-model module is    |
|                  | built from: the check's references, the models one by one, unfuse()   |
| stacking.py      | the fused module's tree: every parameter and buffer stacked over N    |
| group.py         | ``hftc.fuse_groups``: a mixed list split into groups that fuse        |
| padding.py       | ``pad_widths=True``: each model rebuilt at the widest widths          |
| padding_graph.py | forward's ops over a padded dim computed on each model's real units   |
"""
