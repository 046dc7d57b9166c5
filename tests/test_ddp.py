"""DistributedDataParallel over a fused module: 2 gloo processes, half the batch each.

DDP averages the stacked gradients over ranks element by element, so each
model's slice gets exactly its own data-parallel gradient. After 5 fused-SGD
steps both ranks must hold the weights one process reaches with the whole batch.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from optim_helpers import (
    StackedModels,
    make_batches,
    make_models,
    rel_diff,
    single_thread,  # noqa: F401  (autouse fixture)
)

import hftc
import hftc.optim as ho

WORLD, STEPS, BATCH = 2, 5, 8
LRS, MOMENTA = [0.1, 0.05, 0.2], [0.9, 0.0, 0.5]
FUSERS = {"stacked": StackedModels, "hftc.fuse": hftc.fuse}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(fused, batches, rank: int | None):
    """5 SGD steps; with ``rank`` set, on that rank's half of every batch."""
    opt = ho.SGD(fused.parameters(), lr=LRS, momentum=MOMENTA)
    for x, y in batches:
        if rank is not None:
            half = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            x, y = x[half], y[half]
        opt.zero_grad()
        out = fused(x)
        sum(F.cross_entropy(out[i], y) for i in range(len(LRS))).backward()
        opt.step()


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a 2-core machine
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # A timeout, so a lost peer fails the test instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for name, fuser in FUSERS.items():
            fused = fuser(make_models(len(LRS), torch.float64))
            ddp = torch.nn.parallel.DistributedDataParallel(fused)
            _train(ddp, make_batches(STEPS, torch.float64, batch=BATCH), rank)
            weights = {k: v.detach().clone() for k, v in fused.named_parameters()}
            torch.save(weights, os.path.join(out_dir, f"{name}-{rank}.pt"))
            # DDP's reducer must die before its process group: destroyed after it, at
            # interpreter exit, gloo's worker thread waits for the GIL the main thread
            # holds while it waits for that thread (a deadlock seen on torch 2.13).
            del ddp
            gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_equal_one_process_with_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for name, fuser in FUSERS.items():
        fused = fuser(make_models(len(LRS), torch.float64))
        _train(fused, make_batches(STEPS, torch.float64, batch=BATCH), rank=None)
        for rank in range(WORLD):
            weights = torch.load(tmp_path / f"{name}-{rank}.pt", weights_only=True)
            for param_name, p in fused.named_parameters():
                d = rel_diff(weights[param_name], p)
                assert d <= 1e-9, (name, rank, param_name, d)
