"""``hftc inspect``'s text: what became of each op of the user's model, for a person::

    hftc inspect tests/zoo.py:lenet5_mnist: 3 models (N = 3), matched by trace order
    13 ops fused, 0 computed once (shared), 0 run model by model

      node          op          module path  kind   output
      conv1         Conv2d      conv1        fused  [N, 2, 6, 28, 28]
      max_pool2d    max_pool2d  -            fused  [N, 2, 6, 14, 14]
      size          size        -            fused  -
      ...
    strategy: runs the fused program (checked; not timed, the same program every run)

It is ``print(fused.fusion_report)``'s text (:mod:`hftc.passes.report_text`, one
implementation for both) without hftc's rule names: each row is one op of model 0 as the
user wrote it (``Conv2d``, ``max_pool2d``, ``view``; not hftc's kernel
``channelwise__max_pool2d``), the fused output's shape with the model axis written ``N``.
The generated forward follows only with ``--code``.
"""

from __future__ import annotations

from typing import Any

from ..passes.report_text import report_lines


def inspect_text(fused: Any, title: str, code: bool = False) -> str:
    """The text ``hftc inspect`` prints for ``fused``'s last compiled program."""
    program = fused.last_program()
    lines = report_lines(program.report, f"hftc inspect {title}", rules=False)
    if code:
        lines += ["", "the generated forward:", program.source.strip("\n")]
    else:
        lines += ["", "(--code: the generated forward; --format dot|svg|png: the graph)"]
    return "\n".join(lines)
