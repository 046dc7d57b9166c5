"""Fusing time against N: ``python -m benchmarks.fusing_time [--sizes 1,8] [--rounds 3]``.

``hftc.fuse(models, example_inputs=...)`` wall time (tracing, matching, the first
compile and its check) for models symbolic tracing rejects, so the export front-end
traces them, and for small MLPs through the symbolic front-end at large N:

- ``t5``: a 2+2-layer T5-like encoder-decoder (relative position buckets, RMS layer
  norm, no-bias projections), whose forward decides on the decoder's length in Python;
- ``lstm_cell``: pytorch/examples' time-sequence prediction, two ``nn.LSTMCell`` over a
  50-step ``input.split(1, dim=1)`` loop;
- ``dcgan``: pytorch/examples' DCGAN generator (``if input.is_cuda and self.ngpu > 1``);
- ``mlp``: 64-128-128-10 MLPs, symbolic front-end (N = 256 by default).

Each (workload, N) is fused ``--rounds`` times with fresh models; the median wall time
and the median CPU time of the process (steadier on a shared machine) are printed, with
the number of ``torch.export`` calls and the seconds they took.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import hftc


class T5LayerNorm(nn.Module):
    """T5's scale-only RMS norm."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class T5Attention(nn.Module):
    def __init__(self, dim, heads, has_relative_bias, bidirectional, buckets=32, distance=128):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.bidirectional, self.buckets, self.distance = bidirectional, buckets, distance
        self.relative_attention_bias = nn.Embedding(buckets, heads) if has_relative_bias else None

    def _bucket(self, relative):
        buckets, result = self.buckets, 0
        if self.bidirectional:
            buckets //= 2
            result = (relative > 0).to(torch.long) * buckets
            relative = relative.abs()
        else:
            relative = -torch.min(relative, torch.zeros_like(relative))
        exact = buckets // 2
        large = exact + (torch.log(relative.float() / exact) / math.log(self.distance / exact)
                         * (buckets - exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, buckets - 1))
        return result + torch.where(relative < exact, relative, large)

    def position_bias(self, q_len, k_len, device):
        context = torch.arange(q_len, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(k_len, dtype=torch.long, device=device)[None, :]
        values = self.relative_attention_bias(self._bucket(memory - context))
        return values.permute(2, 0, 1).unsqueeze(0)

    def forward(self, x, kv=None, bias=None, mask=None):
        batch, q_len = x.shape[:2]
        kv = x if kv is None else kv
        k_len = kv.shape[1]

        def heads(t, n):
            return t.view(batch, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x), q_len), heads(self.k(kv), k_len), heads(self.v(kv), k_len)
        scores = q @ k.transpose(-1, -2)
        if bias is None:
            bias = (self.position_bias(q_len, k_len, x.device)
                    if self.relative_attention_bias is not None
                    else torch.zeros(1, self.heads, q_len, k_len, device=x.device))
            if mask is not None:
                bias = bias + mask
        weights = F.dropout(F.softmax((scores + bias).float(), dim=-1).type_as(scores),
                            0.1, self.training)
        out = (weights @ v).transpose(1, 2).reshape(batch, q_len, -1)
        return self.o(out), bias


class T5Block(nn.Module):
    def __init__(self, dim, heads, ffn, is_decoder, has_relative_bias):
        super().__init__()
        self.is_decoder = is_decoder
        self.norm1 = T5LayerNorm(dim)
        self.attn = T5Attention(dim, heads, has_relative_bias, bidirectional=not is_decoder)
        if is_decoder:
            self.norm_cross = T5LayerNorm(dim)
            self.cross = T5Attention(dim, heads, False, bidirectional=True)
        self.norm2 = T5LayerNorm(dim)
        self.wi = nn.Linear(dim, ffn, bias=False)
        self.wo = nn.Linear(ffn, dim, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, bias=None, mask=None, memory=None, cross_bias=None):
        h, bias = self.attn(self.norm1(x), bias=bias, mask=mask)
        x = x + self.dropout(h)
        if self.is_decoder:
            h, cross_bias = self.cross(self.norm_cross(x), kv=memory, bias=cross_bias)
            x = x + self.dropout(h)
        x = x + self.dropout(self.wo(self.dropout(F.relu(self.wi(self.norm2(x))))))
        return x, bias, cross_bias


class T5Like(nn.Module):
    """A small T5 (transformers' T5ForConditionalGeneration, written out): shared token
    embedding, encoder and decoder stacks with relative position bias in their first
    block, a causal mask built from the decoder's length, tied LM head scaled by d**-0.5."""

    def __init__(self, vocab=256, dim=64, heads=4, ffn=128, layers=2):
        super().__init__()
        self.dim = dim
        self.shared = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(T5Block(dim, heads, ffn, False, i == 0)
                                     for i in range(layers))
        self.decoder = nn.ModuleList(T5Block(dim, heads, ffn, True, i == 0)
                                     for i in range(layers))
        self.encoder_norm, self.decoder_norm = T5LayerNorm(dim), T5LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight

    def forward(self, input_ids, decoder_input_ids):
        tgt_len = decoder_input_ids.shape[1]
        x = F.dropout(self.shared(input_ids), 0.1, self.training)
        bias = None
        for block in self.encoder:
            x, bias, _ = block(x, bias=bias)
        memory = F.dropout(self.encoder_norm(x), 0.1, self.training)
        causal = None  # transformers builds the mask only where there is something to mask
        if tgt_len > 1:
            causal = torch.full((tgt_len, tgt_len), float("-inf"), device=x.device).triu(1)
        y = F.dropout(self.shared(decoder_input_ids), 0.1, self.training)
        bias = cross_bias = None
        for block in self.decoder:
            y, bias, cross_bias = block(y, bias=bias, mask=causal, memory=memory,
                                        cross_bias=cross_bias)
        y = F.dropout(self.decoder_norm(y), 0.1, self.training) * self.dim ** -0.5
        return self.lm_head(y)


class Sequence(nn.Module):
    """pytorch/examples time_sequence_prediction: two LSTMCells stepped over the input."""

    def __init__(self, hidden=51):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input):
        outputs = []
        h_t = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        c_t = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        h_t2 = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        c_t2 = torch.zeros(input.size(0), self.hidden, dtype=input.dtype)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


class Generator(nn.Module):
    """pytorch/examples DCGAN generator (nz -> 64x64 images), at ngf = 16."""

    def __init__(self, ngpu=1, nz=32, ngf=16, nc=3):
        super().__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input):
        if input.is_cuda and self.ngpu > 1:
            return nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        return self.main(input)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _t5(n):
    ids = torch.randint(0, 256, (4, 16))
    return [T5Like() for _ in range(n)], (ids, ids[:, :12])


def _lstm_cell(n):
    return [Sequence() for _ in range(n)], (torch.randn(3, 50),)


def _dcgan(n):
    return [Generator() for _ in range(n)], (torch.randn(4, 32, 1, 1),)


def _mlp(n):
    return [MLP() for _ in range(n)], None


WORKLOADS = {"t5": _t5, "lstm_cell": _lstm_cell, "dcgan": _dcgan, "mlp": _mlp}


def fusing_seconds(workload: str, n: int) -> tuple[float, float, int, float]:
    """Wall and CPU seconds of one ``hftc.fuse``, the exports it ran and their wall seconds."""
    models, example = WORKLOADS[workload](n)
    exports: list[float] = []
    export = torch.export.export

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return export(*args, **kwargs)
        finally:
            exports.append(time.perf_counter() - start)

    torch.export.export = timed
    try:
        start, cpu = time.perf_counter(), time.process_time()
        fused = hftc.fuse(models, example_inputs=example)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        torch.export.export = export
    expected = "symbolic" if workload == "mlp" else "export"
    assert fused.frontend == expected, (workload, fused.frontend)
    return seconds, cpu, len(exports), sum(exports)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="t5,lstm_cell,dcgan,mlp")
    parser.add_argument("--sizes", default="1,8", help="N for the export workloads")
    parser.add_argument("--mlp-sizes", default="1,256", help="N for the symbolic MLP")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, median of {args.rounds} rounds")
    for workload in args.workloads.split(","):
        sizes = args.mlp_sizes if workload == "mlp" else args.sizes
        fusing_seconds(workload, 1)  # not timed: the first torch.export imports torch._dynamo
        times = {}
        for n in [int(s) for s in sizes.split(",")]:
            rounds = [fusing_seconds(workload, n) for _ in range(args.rounds)]
            wall, cpu = (statistics.median(r[k] for r in rounds) for k in (0, 1))
            export_seconds = statistics.median(r[3] for r in rounds)
            times[n] = (wall, cpu)
            print(f"{workload:10s} N={n:4d}  wall {wall:7.2f} s  cpu {cpu:7.2f} s  "
                  f"exports {rounds[0][2]:3d} ({export_seconds:.2f} s wall)", flush=True)
        first = min(times)
        for n, (wall, cpu) in times.items():
            if n != first:
                print(f"{workload:10s} N={n} / N={first}: wall {wall / times[first][0]:.2f}x  "
                      f"cpu {cpu / times[first][1]:.2f}x")


if __name__ == "__main__":
    main()
