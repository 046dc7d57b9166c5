"""Activation checkpointing on the CPU: how much memory a training step takes, with and
without ``hftc.fuse(..., checkpoint=True)`` (docs/BENCHMARKS.md cites its output).

    PYTHONPATH=$PWD .venv/bin/python scripts/checkpoint_memory.py

Each configuration in a fresh process (no autotune, one thread, glibc returning freed
blocks of >= 64 KiB at once, so the resident set follows the live tensors): the peak
resident set of three training steps (forward, per-model loss, backward, hftc.optim.Adam;
the first allocates the optimizer state) above the fused model as built, and the bytes
autograd saved for backward in one step (``saved_tensors_hooks``).
"""
import os
import subprocess
import sys

CODE = r'''
import sys, torch, hftc
from hftc.bench.contenders import make_models, _first
from hftc.bench.workloads import WORKLOADS
from hftc.bench.runner import _status_mib, _reset_peak
torch.set_num_threads(1)
name, n, ck = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
w = WORKLOADS[name]
x, y = w.inputs()
fused = hftc.fuse(make_models(w, n), checkpoint=ck)
opt = hftc.optim.Adam(fused.parameters(), lr=1e-3)
loss = hftc.per_model(w.loss_fn)
def step():
    opt.zero_grad(set_to_none=False)
    loss(_first(fused(x)), y).sum().backward()
    opt.step()
fused(x)  # compile the program (no grad kept: output dropped)
saved = 0
def pack(t):
    global saved
    saved += t.numel() * t.element_size()
    return t
assert _reset_peak()
rest = _status_mib()["VmRSS"]
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    step()
step(); step()
print(round(_status_mib()["VmHWM"] - rest), round(saved / 2**20))
'''
print("workload N: [step peak MiB above the built model, MiB saved for backward]")
for name, n in [("pointnet", 8), ("pointnet", 32), ("resnet18", 4), ("transformer", 16)]:
    res = {}
    for ck in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", CODE, name, str(n), ck],
                             capture_output=True, text=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        res[ck] = out.stdout.split() or out.stderr[-300:]
    print(name, n, "hftc", res["0"], "hftc checkpoint=True", res["1"], flush=True)
