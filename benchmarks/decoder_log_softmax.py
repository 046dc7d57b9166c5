"""The decoder + log-softmax + NLL of word_language_model (forward and backward) for N
models: the serial loop, the fused batched ops, and ``linear_log_softmax``'s per-model
schedule, interleaved rounds, one thread, freed memory kept (as ``hftc.fuse`` does).

    python benchmarks/decoder_log_softmax.py [--n 2,4,8] [--rounds 21] [--rows 700]
                                             [--vocabulary 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_pair import _summary, _time  # noqa: E402

import hftc  # noqa: E402
from hftc.lowering.runtime import linear as rt_linear  # noqa: E402
from hftc.lowering.runtime.reduction import softmax  # noqa: E402


def contenders(n: int, rows: int, hidden: int, vocabulary: int) -> dict:
    torch.manual_seed(0)
    w = (0.1 * torch.randn(n, vocabulary, hidden)).requires_grad_()
    b = torch.zeros(n, vocabulary, requires_grad=True)
    h = torch.randn(n, rows, hidden, requires_grad=True)
    y = torch.randint(0, vocabulary, (rows,))
    ws, bs, hs = ([t[i].detach().clone().requires_grad_() for i in range(n)]
                  for t in (w, b, h))
    nll = hftc.per_model(F.nll_loss)

    def serial():
        for i in range(n):
            F.nll_loss(F.log_softmax(F.linear(hs[i], ws[i], bs[i]), 1), y).backward()

    def batched():
        nll(softmax(rt_linear.linear(h, w, b, x_batched=True), 2, log=True), y).sum().backward()

    def per_model():
        nll(rt_linear.linear_log_softmax(h, w, b, None, 2, x_batched=True), y).sum().backward()

    assert rt_linear._one_by_one_log_softmax(h, w, b, None, 2, True, None) == rows
    return {"serial": serial, "batched": batched, "per model": per_model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--rows", type=int, default=700)
    parser.add_argument("--hidden", type=int, default=200)
    parser.add_argument("--vocabulary", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hftc.keep_freed_memory()
    for n in (int(v) for v in args.n.split(",")):
        fns = contenders(n, args.rows, args.hidden, args.vocabulary)
        for fn in fns.values():
            fn(), fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns.items())
        for r in range(args.rounds):
            for label, fn in (order if r % 2 == 0 else order[::-1]):
                times[label].append(_time(fn, args.seconds))
        for label, values in times.items():
            ratios = [s / t for s, t in zip(times["serial"], values)]
            to_batched = [s / t for s, t in zip(times["batched"], values)]
            median, p10, p90 = _summary(ratios)
            bm, b10, b90 = _summary(to_batched)
            print(f"N={n} {label:10s} {1e3 * statistics.median(values):7.2f} ms  "
                  f"serial/this {median:.2f}x [{p10:.2f}, {p90:.2f}]  "
                  f"batched/this {bm:.2f}x [{b10:.2f}, {b90:.2f}]", flush=True)


if __name__ == "__main__":
    main()
