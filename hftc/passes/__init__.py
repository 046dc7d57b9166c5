"""Fusion rules, one per operator family, and the driver that applies them.

| file            | operators                                                        |
|-----------------|------------------------------------------------------------------|
| conv.py         | Conv1d/2d/3d, ConvTranspose1d/2d/3d, F.conv*, F.conv_transpose*  |
| linear.py       | Linear, F.linear, matmul / @ / bmm / mm                          |
| norm.py         | BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm           |
| embedding.py    | Embedding, PReLU                                                 |
| elementwise.py  | activations, arithmetic, comparisons, dropout (all spellings)    |
| shape.py        | view/reshape/flatten/permute/transpose/getitem/cat/stack/...     |
| reduction.py    | sum/mean/max/min/softmax/... (dims shifted past the model dim)   |
| pooling.py      | max/avg/adaptive/lp pooling, channel dropout, interpolation      |
| attention.py    | MultiheadAttention, F.scaled_dot_product_attention, Transformer* |
| recurrent.py    | LSTM/GRU/RNN (+ cells, torch.lstm & co.): one bmm per time step  |
| loss.py         | losses inside forward (F.cross_entropy, nn.MSELoss ...): N losses |
| driver.py       | walks the graph, applies the rules, runs the rest one by one      |
| registry.py     | ``@rule``: an op's keys and facts (ATen spellings, per-model      |
|                 | arguments, padding, channels-last, chaining, differing ops)       |
| padded.py       | the padded modules ``pad_widths=True`` builds (``widens=``)       |
| report_text.py  | the fusion report as text (``print(report)``, ``hftc inspect``)   |
"""

from . import (  # noqa: F401  (each module registers its rules)
    attention,
    conv,
    elementwise,
    embedding,
    linear,
    loss,
    norm,
    pooling,
    recurrent,
    reduction,
    shape,
)
from .driver import FusionRecord, FusionReport, fuse_graph
from .registry import RULES, FusionGroup, GraphBuilder, NotFusable, rule

__all__ = [
    "RULES", "FusionGroup", "FusionRecord", "FusionReport", "GraphBuilder", "NotFusable",
    "fuse_graph", "rule",
]
