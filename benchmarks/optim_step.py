"""One ``hftc.optim`` step over N stacked models against N stock ``torch.optim`` steps.

``python -m benchmarks.optim_step [--workloads resnet18,convnext,efficientnet]
[--sizes 2,4,8] [--optimizers sgd,adam] [--rounds 15] [--foreach none,true]``

Each workload is a list of parameter shapes (the optimizer step sees nothing else):

* ``resnet18``: ``hftc.bench.zoo.resnet18()`` (CIFAR ResNet-18, 11.2M parameters, 62 tensors);
* ``convnext``: a ConvNeXt-Tiny-like stack at half width (dims 48-96-192-384, depths
  3-3-9-3): depthwise 7x7 convs, LayerNorms, 4x MLPs, layer scales (7.0M, 182 tensors);
* ``efficientnet``: EfficientNet-B0's shapes (5.3M, 213 tensors): squeeze-and-excitation
  convs, depthwise 3x3 / 5x5 convs, batch norms.

The contenders, with the same gradients and ``foreach`` setting, the N models with their
own learning rates (a learning-rate sweep, the other values shared):

* ``stock``: N ``torch.optim.SGD(momentum=0.9)`` / ``Adam`` steps, one per model;
* ``hftc``: one ``hftc.optim.SGD`` / ``Adam`` step over the ``[N, *shape]`` parameters.

Rounds interleave the two (stock, hftc, stock, hftc, ...) on one thread; the report is
the median of the per-round ratios hftc / stock and its 10th-90th percentile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hftc


def resnet18_shapes() -> list[tuple[int, ...]]:
    from hftc.bench.zoo import resnet18

    return [tuple(p.shape) for p in resnet18().parameters()]


def convnext_shapes(dims=(48, 96, 192, 384), depths=(3, 3, 9, 3),
                    classes: int = 1000) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(dims[0], 3, 4, 4), (dims[0],), (dims[0],), (dims[0],)]
    for stage, (dim, depth) in enumerate(zip(dims, depths)):
        if stage:
            shapes += [(dims[stage - 1],), (dims[stage - 1],), (dim, dims[stage - 1], 2, 2),
                       (dim,)]
        for _ in range(depth):
            shapes += [(dim, 1, 7, 7), (dim,), (dim,), (dim,), (4 * dim, dim), (4 * dim,),
                       (dim, 4 * dim), (dim,), (dim,)]
    return shapes + [(dims[-1],), (dims[-1],), (classes, dims[-1]), (classes,)]


def efficientnet_shapes(classes: int = 1000) -> list[tuple[int, ...]]:
    def bn(c):
        return [(c,), (c,)]

    shapes: list[tuple[int, ...]] = [(32, 3, 3, 3), *bn(32)]
    blocks = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2),
              (6, 3, 2, 40, 80, 3), (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4),
              (6, 3, 1, 192, 320, 1)]
    for expand, k, _, cin, cout, layers in blocks:
        for layer in range(layers):
            inp = cin if layer == 0 else cout
            hidden = inp * expand
            if expand != 1:
                shapes += [(hidden, inp, 1, 1), *bn(hidden)]
            squeeze = max(1, inp // 4)
            shapes += [(hidden, 1, k, k), *bn(hidden),
                       (squeeze, hidden, 1, 1), (squeeze,), (hidden, squeeze, 1, 1), (hidden,),
                       (cout, hidden, 1, 1), *bn(cout)]
    return shapes + [(1280, 320, 1, 1), *bn(1280), (classes, 1280), (classes,)]


WORKLOADS = {"resnet18": resnet18_shapes, "convnext": convnext_shapes,
             "efficientnet": efficientnet_shapes}


def make_optimizers(kind: str, shapes, n: int, foreach: bool | None, seed: int = 0):
    """N stock optimizers over N models' tensors and one hftc optimizer over their stacks,
    with the same parameters, gradients and per-model learning rates."""
    g = torch.Generator().manual_seed(seed)
    stacked = [torch.randn((n, *s), generator=g) for s in shapes]
    grads = [torch.randn((n, *s), generator=g) * 1e-2 for s in shapes]
    lrs = [0.1 / (i + 1) if kind == "sgd" else 1e-3 / (i + 1) for i in range(n)]
    models = []
    for i in range(n):
        params = []
        for p, gr in zip(stacked, grads):
            q = p[i].clone().requires_grad_()
            q.grad = gr[i].clone()
            params.append(q)
        models.append(params)
    fused = []
    for p, gr in zip(stacked, grads):
        q = p.clone().requires_grad_()
        q.grad = gr.clone()
        fused.append(q)
    if kind == "sgd":
        stock = [torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=5e-4, foreach=foreach)
                 for ps, lr in zip(models, lrs)]
        ours = hftc.optim.SGD(fused, lr=lrs, momentum=0.9, weight_decay=5e-4, foreach=foreach)
    else:
        stock = [torch.optim.Adam(ps, lr=lr, foreach=foreach) for ps, lr in zip(models, lrs)]
        ours = hftc.optim.Adam(fused, lr=lrs, foreach=foreach)
    return stock, ours


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _without_row_chunks(kind: str, opt):
    """``opt.step`` as before the row-chunk updates: every parameter on its former path
    (Adam: whole tensors or column blocks; SGD: column blocks)."""
    import hftc.optim.adam as adam_module
    import hftc.optim.sgd as sgd_module

    module, name = ((adam_module, "_ROW_CHUNKS_MIN_WIDTH") if kind == "adam"
                    else (sgd_module, "_ROW_MIN_NUMEL"))

    def step():
        saved = getattr(module, name)
        setattr(module, name, 1 << 62)
        try:
            opt.step()
        finally:
            setattr(module, name, saved)

    return step


def _summary(times: list[float], stock_s: list[float], prefix: str) -> dict:
    ratios = sorted(o / s for o, s in zip(times, stock_s))
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
    return {f"{prefix}_ms": statistics.median(times) * 1e3,
            f"{prefix}_ratio": statistics.median(ratios), f"{prefix}_ratio_p10": q[0],
            f"{prefix}_ratio_p90": q[-1]}


def measure(kind: str, shapes, n: int, foreach: bool | None, rounds: int,
            before: bool = False) -> dict:
    """Interleaved rounds of the N stock steps and the hftc step (and, with ``before``,
    the hftc step without row chunks: the previous code, a third contender)."""
    stock, ours = make_optimizers(kind, shapes, n, foreach)
    steps = {"hftc": ours.step}
    if before:
        steps["before"] = _without_row_chunks(kind, make_optimizers(kind, shapes, n, foreach)[1])

    def stock_step():
        for opt in stock:
            opt.step()

    for _ in range(2):  # state allocation and warm-up
        stock_step()
        for step in steps.values():
            step()
    stock_s: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        stock_s.append(_time(stock_step))
        for name, step in steps.items():
            times[name].append(_time(step))
    out = {"stock_ms": statistics.median(stock_s) * 1e3}
    out.update(_summary(times["hftc"], stock_s, "hftc"))
    out["ratio"], out["ratio_p10"], out["ratio_p90"] = (
        out.pop("hftc_ratio"), out.pop("hftc_ratio_p10"), out.pop("hftc_ratio_p90"))
    if "before" in times:
        out.update(_summary(times["before"], stock_s, "before"))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--foreach", default="none", help="comma list of none,true,false")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--before", action="store_true",
                    help="also time hftc without row chunks (the previous code) in the "
                         "same rounds")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    print("| workload | optimizer | foreach | N | N stock steps (ms) | hftc step (ms) "
          "| hftc / stock, median [p10, p90] |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        shapes = WORKLOADS[workload]()
        for kind in args.optimizers.split(","):
            for fe in args.foreach.split(","):
                foreach = {"none": None, "true": True, "false": False}[fe]
                for n in (int(s) for s in args.sizes.split(",")):
                    r = measure(kind, shapes, n, foreach, args.rounds, args.before)
                    r.update(workload=workload, optimizer=kind, foreach=fe, n=n)
                    results.append(r)
                    before = (f" before: {r['before_ms']:.2f} ms, {r['before_ratio']:.2f} "
                              f"[{r['before_ratio_p10']:.2f}, {r['before_ratio_p90']:.2f}]"
                              if "before_ms" in r else "")
                    print(f"| {workload} | {kind} | {fe} | {n} | {r['stock_ms']:.2f} | "
                          f"{r['hftc_ms']:.2f} | {r['ratio']:.2f} [{r['ratio_p10']:.2f}, "
                          f"{r['ratio_p90']:.2f}] |{before}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
