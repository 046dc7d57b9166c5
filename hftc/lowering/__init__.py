"""Stage 4, compiling: the fused graph -> the program a FusedModule runs.

| file        | what                                                                      |
|-------------|---------------------------------------------------------------------------|
| pipeline.py | the stages in order, run by one loop (:func:`pipeline.compile_program`)   |
| chains.py   | the graph pass: consecutive fused linears -> one ``linear_chain`` call    |
| codegen.py  | fx graph -> Python ``forward(self, *inputs)``                             |
| check.py    | the first-call check against the models' own forward; every comparison   |
|             | tolerance; running a program on copies with the module's state kept      |
| autotune.py | timing each fused op's lowerings and the whole forward's candidates       |
| layout.py   | the layout choice: where channels-last inputs are safe                    |

What the generated code calls is in :mod:`hftc.lowering.runtime`.
"""
