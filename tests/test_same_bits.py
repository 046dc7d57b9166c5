"""Same script, same seeds, same bits (issue 44 item 2): the default strategy decides
without timing, so a training run's bits do not depend on what the disk cache holds or
on the machine's load; strategy="timed" says in ``fused.plan`` that they may, and
``torch.use_deterministic_algorithms(True)`` turns its timing off.

Each run is a whole process, as a user's script is: an empty cache, the cache the first
left, and an empty cache while two other processes load both cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hftc

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    import hftc

    dropout = float(sys.argv[1])
    torch.manual_seed(0)

    def net():
        return nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                             nn.Dropout(dropout), nn.Linear(8 * 6 * 6, 10))

    models = [net() for _ in range(4)]
    fused = hftc.fuse(models)
    opt = hftc.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 3e-3, 4e-3])
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        loss = hftc.per_model(F.cross_entropy)(fused(x), y).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    fused.eval()
    fused(x)
    step = hftc.compile_step(fused.train(), F.cross_entropy,
                             hftc.optim.SGD(fused.parameters(), lr=[0.1] * 4))
    for _ in range(10):
        step(x, y)
    digest = hashlib.sha1()
    for t in list(fused.parameters()) + list(fused.buffers()):
        digest.update(t.detach().numpy().tobytes())
    print(json.dumps({"digest": digest.hexdigest(), "plan": str(fused.plan),
                      "order": str(step.order)}))
""")

LOAD = "import time\nend = time.time() + 600\nwhile time.time() < end: pass\n"


def _run(tmp_path, cache: str, dropout: float, loaded: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HFTC_STRATEGY"}  # the default
    env.update(HFTC_CACHE_DIR=str(tmp_path / cache), OMP_NUM_THREADS="1")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(2 if loaded else 0)]
    try:
        out = subprocess.run([sys.executable, str(script), str(dropout)], env=env,
                             capture_output=True, text=True, timeout=300, check=False)
    finally:
        for p in load:
            p.kill()
            p.wait()
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_empty_warm_and_loaded_runs_give_the_same_bits(tmp_path, dropout):
    empty = _run(tmp_path, "a", dropout)
    warm = _run(tmp_path, "a", dropout)
    loaded = _run(tmp_path, "b", dropout, loaded=True)
    assert empty["digest"] == warm["digest"] == loaded["digest"], (empty, warm, loaded)
    assert "not timed, the same program every run" in empty["plan"]
    assert "timing" not in empty["order"]


def _models(n=3):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(n)]


def test_the_default_times_nothing_and_says_so(monkeypatch):
    monkeypatch.delenv("HFTC_STRATEGY", raising=False)
    import hftc.compile.strategy as strategy

    timed = []
    monkeypatch.setattr(strategy, "choose_strategy", lambda *a, **k: timed.append(1))
    fused = hftc.fuse(_models())
    assert fused.strategy == "auto"
    fused(torch.randn(4, 8))
    assert not timed
    assert fused.plan.chosen == "fused" and fused.plan.reason == strategy.NOT_TIMED


def test_timed_says_the_bits_may_differ_and_deterministic_mode_turns_it_off(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    fused = hftc.fuse(_models(), strategy="timed")
    x = torch.randn(4, 8)
    for _ in range(40):
        fused(x).sum().backward()
    assert "the bits may differ between runs" in str(fused.plan)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for kwargs in ({"strategy": "timed"}, {"autotune": True}):
            fused = hftc.fuse(_models(), **kwargs)
            fused(x)
            assert fused.plan.chosen == "fused"
            assert fused.plan.reason == "not timed: torch.use_deterministic_algorithms(True)"
    finally:
        torch.use_deterministic_algorithms(saved)
