"""lstm_lm (word_language_model's RNNModel) training step: hftc against the serial loop,
side by side in one process, one thread, interleaved rounds.

    python benchmarks/lstm_lm_pair.py [--n 2,4,8] [--rounds 11] [--seconds 0.3]

Contenders, each a whole step (zero_grad, forward, NLL loss, backward, Adam) as
``hftc bench`` times it: ``serial`` (N stock models, N stock Adams), ``default``
(``hftc.fuse(models)``, no options: the strategy choice runs), ``fused``
(``strategy="fused"``) and ``fused, batched tail`` (the same fused program with the decoder
and log-softmax as one batched product and one log-softmax over all N models, the code
before ``runtime.linear.linear_log_softmax``'s per-model schedule).  Report: each one's
median step time, and the median over rounds of serial's time / its time with the
10th-90th percentile.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_pair import _summary, _time, hftc_step  # noqa: E402

from hftc.bench.contenders import build_step  # noqa: E402
from hftc.lowering.runtime import linear as rt_linear  # noqa: E402


@contextlib.contextmanager
def batched_tail():
    """``linear_log_softmax`` never model by model while inside."""
    saved = rt_linear._PER_MODEL_TOTAL_BYTES
    rt_linear._PER_MODEL_TOTAL_BYTES = float("inf")
    try:
        yield
    finally:
        rt_linear._PER_MODEL_TOTAL_BYTES = saved


def compare(n: int, rounds: int, seconds: float) -> dict:
    contenders = {"serial": build_step("serial", "lstm_lm", n).fn}
    contenders["default"], default = hftc_step("lstm_lm", n)
    contenders["fused"], _ = hftc_step("lstm_lm", n, strategy="fused")
    fused_step, _ = hftc_step("lstm_lm", n, strategy="fused")

    def batched():
        with batched_tail():
            fused_step()

    contenders["fused, batched tail"] = batched
    for _ in range(3):  # build, choose, warm up
        for fn in contenders.values():
            fn()
    times: dict[str, list[float]] = {label: [] for label in contenders}
    order = list(contenders.items())
    for r in range(rounds):
        for label, fn in (order if r % 2 == 0 else order[::-1]):
            times[label].append(_time(fn, seconds))
    row = {"n": n, "plan": str(getattr(default, "plan", None))}
    for label, values in times.items():
        ratios = [s / t for s, t in zip(times["serial"], values)]
        row[label] = (1e3 * statistics.median(values), *_summary(ratios))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for n in (int(v) for v in args.n.split(",")):
        row = compare(n, args.rounds, args.seconds)
        print(f"N={n}  default: {row['plan']}", flush=True)
        for label in ("serial", "default", "fused", "fused, batched tail"):
            ms, median, p10, p90 = row[label]
            print(f"  {label:20s} {ms:8.1f} ms  serial/this {median:.2f}x [{p10:.2f}, {p90:.2f}]",
                  flush=True)


if __name__ == "__main__":
    main()
