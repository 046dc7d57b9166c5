"""The digits demo sweep with a width dimension: how full its arrays stay.

``python -m benchmarks.sweep_widths``

The demo's spec (:mod:`hftc.sweep.digits`: 48 trials, 16 per array, median pruner) with
``width = trial.suggest_int("width", 6, 10)`` added, run three ways on one thread:
widths apart (``pad_widths = False``), padded within the default ``max_padding = 1.25``,
and within ``max_padding = 1.6``.  Prints each run's arrays as formed, their mean size,
the wall clock and the summary's speedup estimate (one run each: the timings are
noisy on a shared machine; the arrays are not).
"""

from __future__ import annotations

import tempfile

import torch

import hftc.sweep as hs
from hftc.sweep import digits


def space(trial):
    params = digits.space(trial)
    params["width"] = trial.suggest_int("width", 6, 10)
    return params


def model(params):
    return digits.DigitsCNN(dropout=params["dropout"], width=params["width"])


def main() -> None:
    torch.set_num_threads(1)
    for pad_widths, max_padding in ((False, 1.25), (True, 1.25), (True, 1.6)):
        spec = hs.load_spec(digits).replace(space=space, model=model, pad_widths=pad_widths,
                                            max_padding=max_padding)
        with tempfile.TemporaryDirectory() as out:
            result = hs.Sweep(spec, out=out, progress=False).run()
        sizes = [n for formation in result.formations for n in formation]
        lines = result.summary.splitlines()
        print(f"pad_widths={pad_widths}, max_padding={max_padding}: mean array "
              f"{sum(sizes) / len(sizes):.1f} of {spec.per_array}, {result.wall_s:.1f} s wall "
              f"clock, best {result.study.best_value:.4f}")
        print("\n".join("  " + line for line in lines[1:3]))


if __name__ == "__main__":
    main()
