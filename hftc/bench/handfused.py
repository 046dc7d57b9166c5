"""Hand-fused references: what a careful engineer gets by fusing N models by hand.

This is HFTA's recipe (MLSys 2021), written out for every workload of the
suite: each layer class takes the N original layers and holds their parameters
stacked ``[N, *shape]``; convolutions run as one grouped convolution on a
``[B, N*C, *S]`` activation (channels of model n at ``[n*C, (n+1)*C)``, groups
``N*g``), linears as one ``baddbmm`` on ``[N, M, in]``, batch norms as one batch
norm over ``N*C`` channels, layer norms normalise once and apply each model's
affine.  The shared input is repeated per model, as HFTA's users had to do, and
the code moves between the conv layout and the linear layout by hand
(``view``/``transpose``), which is the part HFTA made its users write.

``HandFusedAdam`` is HFTA's fused Adam: one update per stacked parameter with
each model's learning rate as an ``[N, 1, ..., 1]`` coefficient.

``hand_fuse(workload, models)`` builds the fused module for a workload from its
N stock models (their current weights), so every contender starts from the same
N models; ``tests/test_bench.py`` checks the result against the stock models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import zoo
from .workloads import Workload

# --------------------------------------------------------------------------- fused layers


def _stack(tensors: Sequence[Tensor | None]) -> nn.Parameter | None:
    if tensors[0] is None:
        return None
    return nn.Parameter(torch.stack([t.detach().clone() for t in tensors]))


class FLinear(nn.Module):
    """N linears: ``[N, *, in] -> [N, *, out]`` as one ``baddbmm``."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        self.weight = _stack([m.weight for m in linears])      # [N, out, in]
        self.bias = _stack([m.bias for m in linears])          # [N, out]

    def forward(self, x: Tensor) -> Tensor:
        n, out_features, in_features = self.weight.shape
        lead = x.shape[:-1]
        x3 = x.reshape(n, -1, in_features)
        wt = self.weight.transpose(1, 2)
        y = torch.bmm(x3, wt) if self.bias is None else torch.baddbmm(
            self.bias.unsqueeze(1), x3, wt)
        return y.view(*lead, out_features)


class FConv(nn.Module):
    """N convolutions on ``[B, N*Cin, *S]`` as one grouped convolution (groups ``N*g``)."""

    def __init__(self, convs: Sequence[nn.Conv1d | nn.Conv2d]):
        super().__init__()
        c = convs[0]
        self.n = len(convs)
        self.fn = F.conv1d if isinstance(c, nn.Conv1d) else F.conv2d
        self.stride, self.padding, self.dilation, self.groups = (
            c.stride, c.padding, c.dilation, c.groups)
        self.weight = _stack([m.weight for m in convs])        # [N, Cout, Cin/g, *k]
        self.bias = _stack([m.bias for m in convs])            # [N, Cout]

    def forward(self, x: Tensor) -> Tensor:
        b = self.bias.flatten() if self.bias is not None else None
        return self.fn(x, self.weight.flatten(0, 1), b, self.stride, self.padding,
                       self.dilation, self.groups * self.n)


class FBatchNorm(nn.Module):
    """N batch norms on ``[B, N*C, *S]`` as one over ``N*C`` channels (HFTA's)."""

    def __init__(self, norms: Sequence[nn.modules.batchnorm._BatchNorm]):
        super().__init__()
        bn = norms[0]
        self.momentum, self.eps = bn.momentum, bn.eps
        self.weight = _stack([m.weight for m in norms])        # [N, C]
        self.bias = _stack([m.bias for m in norms])
        self.register_buffer("running_mean", torch.cat([m.running_mean for m in norms]))
        self.register_buffer("running_var", torch.cat([m.running_var for m in norms]))

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight.flatten(),
                            self.bias.flatten(), self.training, self.momentum, self.eps)


class FBatchNormLinear(FBatchNorm):
    """A BatchNorm1d after a linear: ``[N, B, F]`` -> ``[B, N*F]``, normalise, and back."""

    def forward(self, x: Tensor) -> Tensor:
        n, b, f = x.shape
        y = super().forward(x.transpose(0, 1).reshape(b, n * f))
        return y.view(b, n, f).transpose(0, 1)


class FLayerNorm(nn.Module):
    """N layer norms on ``[N, *, D]``: normalise once, then each model's affine."""

    def __init__(self, norms: Sequence[nn.LayerNorm]):
        super().__init__()
        self.shape, self.eps = norms[0].normalized_shape, norms[0].eps
        self.weight = _stack([m.weight for m in norms])        # [N, D]
        self.bias = _stack([m.bias for m in norms])

    def forward(self, x: Tensor) -> Tensor:
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
        y = F.layer_norm(x, self.shape, None, None, self.eps)
        return torch.addcmul(self.bias.view(view), y, self.weight.view(view))


def _conv_to_linear(x: Tensor, n: int) -> Tensor:
    """``[B, N*C, 1...]`` (the conv layout) -> ``[N, B, C]`` (the linear layout)."""
    return x.reshape(x.shape[0], n, -1).transpose(0, 1)


# --------------------------------------------------------------------------- workloads


class FusedMLP(nn.Module):
    def __init__(self, models: Sequence[zoo.MLP]):
        super().__init__()
        self.n = len(models)
        self.fc1 = FLinear([m.fc1 for m in models])
        self.fc2 = FLinear([m.fc2 for m in models])
        self.fc3 = FLinear([m.fc3 for m in models])

    def forward(self, x: Tensor) -> Tensor:                  # [B, 64] -> [N, B, 10]
        x = x.unsqueeze(0).expand(self.n, *x.shape)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class FusedLeNet5(nn.Module):
    def __init__(self, models: Sequence[zoo.LeNet5]):
        super().__init__()
        self.n = len(models)
        self.conv1 = FConv([m.conv1 for m in models])
        self.conv2 = FConv([m.conv2 for m in models])
        self.fc1 = FLinear([m.fc1 for m in models])
        self.fc2 = FLinear([m.fc2 for m in models])
        self.fc3 = FLinear([m.fc3 for m in models])

    def forward(self, x: Tensor) -> Tensor:                  # [B, 1, 28, 28] -> [N, B, 10]
        x = x.repeat(1, self.n, 1, 1)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = _conv_to_linear(x, self.n)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class FusedSTN3d(nn.Module):
    def __init__(self, models: Sequence[zoo.STN3d]):
        super().__init__()
        self.n = len(models)
        for name in ("conv1", "conv2", "conv3"):
            setattr(self, name, FConv([getattr(m, name) for m in models]))
        for name in ("fc1", "fc2", "fc3"):
            setattr(self, name, FLinear([getattr(m, name) for m in models]))
        for name in ("bn1", "bn2", "bn3"):
            setattr(self, name, FBatchNorm([getattr(m, name) for m in models]))
        for name in ("bn4", "bn5"):
            setattr(self, name, FBatchNormLinear([getattr(m, name) for m in models]))

    def forward(self, x: Tensor) -> Tensor:                  # [B, N*3, P] -> [N, B, 3, 3]
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = _conv_to_linear(torch.amax(x, 2), self.n)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x) + torch.eye(3, dtype=x.dtype, device=x.device).view(9)
        return x.view(self.n, -1, 3, 3)


class FusedPointNetCls(nn.Module):
    def __init__(self, models: Sequence[zoo.PointNetCls]):
        super().__init__()
        self.n = len(models)
        self.p = models[0].dropout.p
        self.stn = FusedSTN3d([m.stn for m in models])
        for name in ("conv1", "conv2", "conv3"):
            setattr(self, name, FConv([getattr(m, name) for m in models]))
        for name in ("fc1", "fc2", "fc3"):
            setattr(self, name, FLinear([getattr(m, name) for m in models]))
        for name in ("bn1", "bn2", "bn3"):
            setattr(self, name, FBatchNorm([getattr(m, name) for m in models]))
        for name in ("bn4", "bn5"):
            setattr(self, name, FBatchNormLinear([getattr(m, name) for m in models]))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # [B, 3, P] -> [N, B, k], [N, B, 3, 3]
        n, (b, _, p) = self.n, x.shape
        x = x.repeat(1, n, 1)                                 # [B, N*3, P]
        trans = self.stn(x)
        pts = x.view(b, n, 3, p).permute(1, 0, 3, 2).reshape(n * b, p, 3)
        pts = torch.bmm(pts, trans.reshape(n * b, 3, 3))      # [N*B, P, 3]
        x = pts.view(n, b, p, 3).permute(1, 0, 3, 2).reshape(b, n * 3, p)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = _conv_to_linear(torch.amax(x, 2), n)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(F.dropout(self.fc2(x), self.p, self.training)))
        return F.log_softmax(self.fc3(x), dim=-1), trans


class FusedBasicBlock(nn.Module):
    def __init__(self, blocks: Sequence[zoo.BasicBlock]):
        super().__init__()
        self.conv1 = FConv([b.conv1 for b in blocks])
        self.bn1 = FBatchNorm([b.bn1 for b in blocks])
        self.conv2 = FConv([b.conv2 for b in blocks])
        self.bn2 = FBatchNorm([b.bn2 for b in blocks])
        self.shortcut = None
        if len(blocks[0].shortcut):
            self.shortcut = nn.Sequential(FConv([b.shortcut[0] for b in blocks]),
                                          FBatchNorm([b.shortcut[1] for b in blocks]))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.shortcut(x) if self.shortcut is not None else x))


def _blocks(model: zoo.ResNet) -> list[zoo.BasicBlock]:
    """The residual blocks of all stages, in order."""
    return [block for stage in range(1, model.num_stages + 1)
            for block in getattr(model, f"layer{stage}")]


class FusedResNet18(nn.Module):
    def __init__(self, models: Sequence[zoo.ResNet]):
        super().__init__()
        self.n = len(models)
        self.conv1 = FConv([m.conv1 for m in models])
        self.bn1 = FBatchNorm([m.bn1 for m in models])
        self.layers = nn.Sequential(*[FusedBasicBlock(blocks)
                                      for blocks in zip(*[_blocks(m) for m in models])])
        self.fc = FLinear([m.fc for m in models])

    def forward(self, x: Tensor) -> Tensor:                  # [B, 3, 32, 32] -> [N, B, 10]
        x = F.relu(self.bn1(self.conv1(x.repeat(1, self.n, 1, 1))))
        x = self.layers(x)
        return self.fc(_conv_to_linear(F.adaptive_avg_pool2d(x, 1), self.n))


def _fuse_sequential(seqs: Sequence[nn.Sequential]) -> nn.Sequential:
    """Conv, BatchNorm2d and ReLU6 layers of N identical Sequentials, fused layer by layer."""
    out = []
    for layers in zip(*seqs):
        if isinstance(layers[0], nn.Conv2d):
            out.append(FConv(layers))
        elif isinstance(layers[0], nn.BatchNorm2d):
            out.append(FBatchNorm(layers))
        elif isinstance(layers[0], nn.ReLU6):
            out.append(nn.ReLU6(inplace=True))
        elif isinstance(layers[0], zoo.InvertedResidual):
            out.append(FusedInvertedResidual(layers))
        else:
            raise TypeError(f"no hand-fused layer for {type(layers[0]).__name__}")
    return nn.Sequential(*out)


class FusedInvertedResidual(nn.Module):
    def __init__(self, blocks: Sequence[zoo.InvertedResidual]):
        super().__init__()
        self.use_res = blocks[0].use_res
        self.conv = _fuse_sequential([b.conv for b in blocks])

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class FusedMobileNetV2(nn.Module):
    def __init__(self, models: Sequence[zoo.MobileNetV2]):
        super().__init__()
        self.n = len(models)
        self.features = _fuse_sequential([m.features for m in models])
        self.p = models[0].classifier[0].p
        self.fc = FLinear([m.classifier[1] for m in models])

    def forward(self, x: Tensor) -> Tensor:                  # [B, 3, 32, 32] -> [N, B, 10]
        x = self.features(x.repeat(1, self.n, 1, 1))
        x = _conv_to_linear(F.adaptive_avg_pool2d(x, 1), self.n)
        return self.fc(F.dropout(x, self.p, self.training))


class FusedEncoderLayer(nn.Module):
    def __init__(self, layers: Sequence[zoo.EncoderLayer]):
        super().__init__()
        self.heads = layers[0].attn.heads
        self.p = layers[0].drop.p
        self.qkv = FLinear([m.attn.qkv for m in layers])
        self.proj = FLinear([m.attn.proj for m in layers])
        self.ln1 = FLayerNorm([m.ln1 for m in layers])
        self.ff1 = FLinear([m.ff1 for m in layers])
        self.ff2 = FLinear([m.ff2 for m in layers])
        self.ln2 = FLayerNorm([m.ln2 for m in layers])

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)

    def forward(self, x: Tensor) -> Tensor:                  # [N, B, T, D]
        n, b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        qkv = self.qkv(x).view(n, b, t, 3, h, dh).permute(3, 0, 1, 4, 2, 5)
        q, k, v = (qkv[i].reshape(n * b * h, t, dh) for i in range(3))
        att = F.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(dh), dim=-1)
        y = torch.bmm(att, v).view(n, b, h, t, dh).transpose(2, 3).reshape(n, b, t, d)
        x = self.ln1(x + self._drop(self.proj(y)))
        return self.ln2(x + self._drop(self.ff2(self._drop(F.relu(self.ff1(x))))))


class FusedTransformerClassifier(nn.Module):
    def __init__(self, models: Sequence[zoo.TransformerClassifier]):
        super().__init__()
        self.n = len(models)
        self.embed = _stack([m.embed.weight for m in models])  # [N, V, D]
        self.pos = _stack([m.pos for m in models])             # [N, T, D]
        self.layers = nn.Sequential(*[FusedEncoderLayer(ls)
                                      for ls in zip(*[m.layers for m in models])])
        self.head = FLinear([m.head for m in models])

    def forward(self, tokens: Tensor) -> Tensor:             # [B, T] -> [N, B, 10]
        n, vocab, d = self.embed.shape
        offsets = torch.arange(n, device=tokens.device).view(n, 1, 1) * vocab
        x = F.embedding(tokens.unsqueeze(0) + offsets, self.embed.view(n * vocab, d))
        x = self.layers(x + self.pos.unsqueeze(1))
        return self.head(x.mean(dim=2))


HAND_FUSED = {
    "mlp": FusedMLP,
    "lenet5": FusedLeNet5,
    "pointnet": FusedPointNetCls,
    "resnet18": FusedResNet18,
    "mobilenet_v2": FusedMobileNetV2,
    "transformer": FusedTransformerClassifier,
}


def hand_fuse(workload: str, models: Sequence[nn.Module]) -> nn.Module:
    """The hand-fused module of ``workload`` holding the N models' current weights."""
    if workload not in HAND_FUSED:
        raise KeyError(f"no hand-fused version of {workload!r}")
    fused = HAND_FUSED[workload](models)
    return fused.train(models[0].training)


def hand_fused_loss(workload: Workload, out, y: Tensor) -> Tensor:
    """HFTA's loss: the mean loss over the N*B predictions times N (each model its own mean)."""
    out = out[0] if isinstance(out, tuple) else out
    n, b = out.shape[:2]
    flat = out.reshape(n * b, *out.shape[2:])
    return workload.loss_fn(flat, y.repeat(n)) * n


class HandFusedAdam:
    """HFTA's fused Adam: stock Adam's update on stacked ``[N, ...]`` parameters,
    each model's learning rate an ``[N, 1, ..., 1]`` coefficient (all models step together)."""

    def __init__(self, params, lr: Sequence[float], betas=(0.9, 0.999), eps=1e-8):
        self.params = [p for p in params if p.requires_grad]
        # On the parameters' device: a copy per step from the host would stall a GPU.
        self.lr = torch.tensor([float(v) for v in lr], dtype=torch.float64,
                               device=self.params[0].device)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.t = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        bc1 = 1 - self.beta1 ** self.t
        bc2_sqrt = math.sqrt(1 - self.beta2 ** self.t)
        neg_step = (-self.lr / bc1).to(self.params[0].dtype)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            g = p.grad
            if g is None:
                continue
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            p.addcdiv_(m * neg_step.view(-1, *([1] * (p.dim() - 1))), denom)
