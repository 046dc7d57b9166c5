"""What ``hftc.compile_step``'s eager step gains by running the models in order (each
model's forward, loss and backward in turn) where the fused step does not win.

    python -m benchmarks.step_order [--only gpt:2,pointnet:2] [--rounds 21] [--json out.json]

Per workload and N, four contenders with Adam (stock for serial, ``hftc.optim.Adam`` for
the rest), each stepped until it has chosen, then one training step each per round,
interleaved, one thread, from an empty strategy cache:

* ``serial``: N stock models, one after another (``f0 b0 f1 b1``);
* ``loop``: ``hftc.fuse(models)`` (the default) under a training loop of the user's own
  (every forward, then one backward: ``f0 f1 b1 b0``, whichever way the fused module ran);
* ``step``: ``hftc.compile_step(hftc.fuse(models), loss, opt)``, the defaults: the fused
  step or the models in order, as its first steps timed them (``step.order``);
* ``in order``: the same with ``strategy="model_loop"`` (always in order).

Reported: median step time and the median per-round ratio serial / contender with the
10th-90th percentiles, and what the default step chose.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import hftc
import hftc.lowering.timing as timing
from hftc.bench.contenders import learning_rates, make_models
from hftc.bench.workloads import WORKLOADS
from hftc.lowering.strategy import TIMING_CALLS

from .schedule_cost import against_serial, interleaved
from .zoo_pair import hftc_step

DEFAULT = "gpt:2,gpt:4,mlp:4,lenet5:2,transformer:2,style_transfer:2"


def contenders(name: str, n: int) -> tuple[dict, dict]:
    """The four steps of the module docstring over the same N models and batch, and the
    default step's choice (after its warm-up)."""
    w = WORKLOADS[name]
    x, y = w.inputs()
    lrs = learning_rates(n)
    example = {"example_inputs": (x,)} if w.example_inputs else {}

    models = make_models(w, n)
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]

    def serial():
        for model, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            w.loss(model(x), y).backward()
            opt.step()

    loop, loop_fused = hftc_step(name, n)

    # one model's loss of its output: the workload's criterion, of the first field where the
    # model returns several (PointNet's log-probabilities and transform)
    several = isinstance(models[0](x), tuple)
    loss_of = (lambda out, t: w.loss_fn(out[0], t)) if several else w.loss_fn

    def compiled(strategy: str | None):
        fused = hftc.fuse(make_models(w, n), strategy=strategy, **example)
        step = hftc.compile_step(fused, loss_of, hftc.optim.Adam(fused.parameters(), lr=lrs))
        return step

    step, in_order = compiled(None), compiled("model_loop")
    for _ in range(60):  # until the fused module and the step have chosen
        loop()
        step(x, y)
        if step.order is not None and loop_fused.plan.reason != TIMING_CALLS:
            break
    in_order(x, y)
    info = {"step": str(step.order), "fused module": str(loop_fused.plan)}
    return {"serial": serial, "loop": loop, "step": lambda: step(x, y),
            "in order": lambda: in_order(x, y)}, info


def measure(name: str, n: int, rounds: int) -> dict:
    steps, info = contenders(name, n)
    for fn in steps.values():
        fn()
    return {"workload": name, "n": n, "info": info,
            **against_serial(interleaved(steps, rounds, alternate=True))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=DEFAULT, help="workload:N,... (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.pop("HFTC_STRATEGY", None)
    results = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["HFTC_CACHE_DIR"] = cache  # an empty cache: the defaults time
        timing._MEMORY.clear()
        print("| workload | N | serial ms | serial / loop | serial / step | "
              "serial / in order | the step's choice |")
        print("|---|---|---|---|---|---|---|")
        for item in args.only.split(","):
            name, n = item.split(":")
            r = measure(name, int(n), args.rounds)
            results.append(r)
            cells = " | ".join(f"{r[k]['ratio']:.3f} [{r[k]['p10']:.3f}, {r[k]['p90']:.3f}]"
                               for k in ("loop", "step", "in order"))
            print(f"| {name} | {n} | {r['serial']['ms']:.2f} | {cells} | "
                  f"{r['info']['step']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m benchmarks.step_order " + " ".join(argv or []),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
