"""Measure a fused training step against the serial loop it replaces (``make demo``).

A *step* is what a sweep does per batch: forward, per-model loss, backward,
optimizer step.  Serial: N stock models and N ``torch.optim.SGD`` one after the
other.  Fused: one :class:`~hftc.FusedModule` and one :class:`hftc.optim.SGD`
with a learning rate per model.  The two contenders alternate round by round so
machine noise hits both alike; the medians are reported with their min-max.

The full comparison (concurrent processes, torch.func, hand-fused, torch.compile,
memory, FLOP/s efficiency) is the benchmark suite in ``hftc/bench/``
(``python -m hftc bench``, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hftc.bench.zoo import MLP, LeNet5

WORKLOADS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (64,)),
    "lenet5": (LeNet5, (1, 28, 28)),
}


@dataclass
class StepTiming:
    workload: str
    num_models: int
    batch: int
    serial_s: list[float]
    fused_s: list[float]

    @property
    def speedup(self) -> float:
        return statistics.median(self.serial_s) / statistics.median(self.fused_s)

    def throughput(self, times: list[float]) -> float:
        """Samples per second summed over the N models."""
        return self.num_models * self.batch / statistics.median(times)

    def row(self) -> str:
        return (
            f"{self.workload:<8} N={self.num_models:<3} batch={self.batch:<4} "
            f"serial {statistics.median(self.serial_s) * 1e3:8.2f} ms "
            f"[{min(self.serial_s) * 1e3:.2f}-{max(self.serial_s) * 1e3:.2f}]  "
            f"fused {statistics.median(self.fused_s) * 1e3:8.2f} ms "
            f"[{min(self.fused_s) * 1e3:.2f}-{max(self.fused_s) * 1e3:.2f}]  "
            f"speedup {self.speedup:5.2f}x"
        )


def time_training_step(
    workload: str, num_models: int, *, batch: int = 64, rounds: int = 15, warmup: int = 3
) -> StepTiming:
    """Time one training step of N models, serial loop vs fused, interleaved round by round."""
    import hftc
    from hftc.lowering import timing
    from hftc.lowering.strategy import TIMING_CALLS

    factory, shape = WORKLOADS[workload]
    torch.manual_seed(0)
    models = [factory() for _ in range(num_models)]
    lrs = [0.01 * (1 + i % 4) for i in range(num_models)]
    serial_models = copy.deepcopy(models)
    serial_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
                   for m, lr in zip(serial_models, lrs)]
    fused = hftc.fuse(copy.deepcopy(models))
    fused_opt = hftc.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
    x = torch.randn(batch, *shape)
    y = torch.randint(0, 10, (batch,))

    def serial_step():
        for m, opt in zip(serial_models, serial_opts):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            opt.step()

    def fused_step():
        fused_opt.zero_grad(set_to_none=True)
        out = fused(x)  # [N, batch, 10]
        loss = F.cross_entropy(out.reshape(-1, 10), y.repeat(num_models), reduction="sum") / batch
        loss.backward()
        fused_opt.step()

    # strategy="timed" alternates its two ways on its first calls: time the
    # way it keeps, not the mixture.
    for _ in range(40):
        fused_step()
        if fused.plan.reason != TIMING_CALLS:
            break
    device = torch.device("cpu")
    timing.measure({"serial": serial_step, "fused": fused_step}, device, rounds=warmup)
    times = timing.measure({"serial": serial_step, "fused": fused_step}, device, rounds=rounds)
    serial_s, fused_s = times["serial"], times["fused"]
    return StepTiming(workload, num_models, batch, serial_s, fused_s)


def run_demo(num_models: int = 16) -> list[StepTiming]:
    """``make demo``: fuse N models of two workloads and print the measured speedups."""
    print(f"hftc demo: one training step of N={num_models} models "
          f"(forward, per-model cross-entropy, backward, SGD with a learning rate per model)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU\n")
    results = []
    for workload in WORKLOADS:
        timing = time_training_step(workload, num_models)
        print(timing.row())
        results.append(timing)
    print("\nserial = N stock models + N torch.optim.SGD run one after another; fused = "
          "hftc.fuse + hftc.optim.SGD. Medians of interleaved rounds, [min-max].")
    return results
