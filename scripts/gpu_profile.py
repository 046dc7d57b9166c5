"""Where a contender's training step spends the GPU's time: the kernels of a few steps.

    python scripts/gpu_profile.py OUT_DIR [workload:N:contender ...]

For each ``workload:N:contender`` (default: PointNet at N = 8, hftc against serial,
the H200 run's slowest point against MPS), build the bench contender
(:func:`hftc.bench.contenders.build_step`), warm it up (hftc's default strategy
until it has chosen), profile ``--steps`` steps with ``torch.profiler`` (CPU and
CUDA) and append to ``OUT_DIR/profile.txt`` the step's wall time and
the 30 ops with the most CUDA time, so the next lease can see which kernels hold a
fused step back.  ``--device cpu`` tries the script on a CPU (CPU time only).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from hftc.bench.contenders import Setting, build_step

DEFAULT = ["pointnet:8:hftc", "pointnet:8:serial", "transformer:8:hftc",
           "transformer:8:serial"]


def profile_one(spec: str, device: str, steps: int, out: Path) -> None:
    workload, n, contender = spec.split(":")
    setting = Setting(device=device)
    step = build_step(contender, workload, int(n), setting=setting)
    for _ in range(40):  # warm-up, and hftc's first-call choice
        step.fn()
        if step.choosing is None or not step.choosing():
            break
    for _ in range(3):
        step.fn()
    setting.sync()
    start = time.perf_counter()
    for _ in range(steps):
        step.fn()
    setting.sync()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step.fn()
        setting.sync()
    key = "cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
    info = {**step.info, **(step.settled_info() if step.settled_info else {})}
    text = (f"{spec} on {torch.cuda.get_device_name() if cuda else 'cpu'}: "
            f"{wall_ms:.2f} ms a step (mean of {steps}, unprofiled); info {info}\n\n{table}\n")
    with open(out / "profile.txt", "a") as f:  # one file: a lease brings back 8 at most
        f.write(text)
    print(text[:4000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("specs", nargs="*", default=DEFAULT)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.specs:
        profile_one(spec, args.device, args.steps, args.out)


if __name__ == "__main__":
    main()
