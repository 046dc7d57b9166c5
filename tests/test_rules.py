"""Equivalence grid per fusion rule: fused vs a Python loop over the original models.

Each case is a tiny model exercising one rule (module and functional spellings,
the interesting hyper-parameters), checked by ``check_equivalence`` for
N in {1, 2, 3, 8}, shared and stacked inputs, train and eval, float64 and
float32: forward, every parameter gradient, every input gradient and buffers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from equivalence import check_equivalence
from torch import nn

import hftc
from hftc.bench import torchvision_ops


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    input_shape: tuple
    stacked: bool = True  # also run with in_dims=0
    integer_input: int | None = None  # vocabulary size for index inputs


class Lambda(nn.Module):
    """A model whose forward is a function of (self, x); for functional spellings."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            if isinstance(value, nn.Module):
                self.add_module(name, value)
            else:
                self.register_parameter(name, nn.Parameter(value))

    def forward(self, x):
        return self.fn(self, x)


def seq(layers):
    return lambda: nn.Sequential(*layers())


CASES = [
    # ---- convolutions
    Case("conv1d_stride_pad", seq(lambda: [nn.Conv1d(3, 4, 3, stride=2, padding=1)]), (2, 3, 9)),
    Case("conv2d_same_dilation", seq(lambda: [nn.Conv2d(3, 4, 3, padding="same", dilation=2)]),
         (2, 3, 7, 7)),
    Case("conv2d_groups_stride", seq(lambda: [nn.Conv2d(4, 6, 3, groups=2, stride=2)]),
         (2, 4, 9, 9)),
    Case("conv2d_depthwise", seq(lambda: [nn.Conv2d(4, 4, 3, groups=4, padding=1)]), (2, 4, 6, 6)),
    Case("conv2d_valid_nobias", seq(lambda: [nn.Conv2d(3, 5, 2, padding="valid", bias=False)]),
         (2, 3, 6, 6)),
    Case("conv2d_reflect", seq(lambda: [nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")]),
         (2, 3, 6, 6)),
    Case("conv2d_circular", seq(lambda: [nn.Conv2d(3, 4, 3, padding=2, padding_mode="circular")]),
         (2, 3, 6, 6)),
    Case("conv2d_replicate_same",
         seq(lambda: [nn.Conv2d(3, 4, 4, padding="same", padding_mode="replicate")]), (2, 3, 6, 6)),
    Case("conv2d_unbatched", seq(lambda: [nn.Conv2d(3, 4, 3)]), (3, 6, 6)),
    Case("conv3d", seq(lambda: [nn.Conv3d(2, 3, (1, 3, 3), stride=(1, 2, 1))]), (2, 2, 3, 6, 6)),
    Case("conv2d_chain_relu", seq(lambda: [nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3,
                                           groups=2)]), (2, 3, 8, 8)),
    Case("f_conv2d", lambda: Lambda(lambda s, x: F.conv2d(x, s.w, s.b, stride=2, padding=1),
                                    w=torch.randn(4, 3, 3, 3), b=torch.randn(4)), (2, 3, 7, 7)),
    Case("f_conv1d_groups", lambda: Lambda(lambda s, x: F.conv1d(x, s.w, groups=2),
                                           w=torch.randn(4, 2, 3)), (2, 4, 8)),
    Case("f_conv2d_keywords_same", lambda: Lambda(
        lambda s, x: F.conv2d(input=x, weight=s.w, padding="same", dilation=[2, 1]),
        w=torch.randn(4, 3, 3, 3)), (2, 3, 7, 7)),
    Case("conv_transpose1d", seq(lambda: [nn.ConvTranspose1d(3, 4, 3, stride=2,
                                                             output_padding=1)]), (2, 3, 5)),
    Case("conv_transpose2d_groups",
         seq(lambda: [nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1, groups=2)]), (2, 4, 5, 5)),
    Case("conv_transpose2d_dilation",
         seq(lambda: [nn.ConvTranspose2d(3, 2, 3, dilation=2, bias=False)]), (2, 3, 4, 4)),
    Case("conv_transpose3d", seq(lambda: [nn.ConvTranspose3d(2, 2, 2, stride=2)]), (1, 2, 2, 3, 3)),
    Case("conv_transpose_output_size",
         lambda: Lambda(lambda s, x: s.up(x, output_size=[x.size(2) * 2, x.size(3) * 2]),
                        up=nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)), (2, 3, 4, 4)),
    Case("f_conv_transpose2d",
         lambda: Lambda(lambda s, x: F.conv_transpose2d(x, s.w, stride=2), w=torch.randn(3, 2, 2, 2)),
         (2, 3, 4, 4)),
    Case("f_conv_transpose2d_lists", lambda: Lambda(
        lambda s, x: F.conv_transpose2d(x, s.w, s.b, [2, 1], output_padding=(1, 0), dilation=1),
        w=torch.randn(3, 2, 3, 3), b=torch.randn(2)), (2, 3, 4, 4)),
    # ---- linear and matmul
    Case("linear", seq(lambda: [nn.Linear(5, 7)]), (4, 5)),
    Case("linear_3d_nobias", seq(lambda: [nn.Linear(5, 7, bias=False), nn.Tanh()]), (2, 3, 5)),
    Case("linear_vector", seq(lambda: [nn.Linear(5, 3)]), (5,)),
    Case("f_linear", lambda: Lambda(lambda s, x: F.linear(x, s.w, s.b), w=torch.randn(3, 5),
                                    b=torch.randn(3)), (4, 5)),
    Case("matmul_param", lambda: Lambda(lambda s, x: x @ s.w, w=torch.randn(5, 3)), (2, 4, 5)),
    Case("matmul_param_left", lambda: Lambda(lambda s, x: torch.matmul(s.w, x), w=torch.randn(3, 4)),
         (2, 4, 5)),
    Case("bmm_activations",
         lambda: Lambda(lambda s, x: torch.bmm(s.fc(x), s.fc(x).transpose(1, 2)).softmax(-1),
                        fc=nn.Linear(5, 6)), (2, 3, 5)),
    Case("softmax_spellings", lambda: Lambda(  # a dtype by position is kept (it was dropped)
        lambda s, x: (s.sm(s.fc(x)), s.lsm(x), s.smin(x), torch.softmax(x, -1, torch.float64),
                      x.log_softmax(1, torch.float64), F.softmax(x, 0, 3, torch.float64)),
        fc=nn.Linear(5, 5), sm=nn.Softmax(dim=1), lsm=nn.LogSoftmax(-1), smin=nn.Softmin(0)),
        (3, 5)),
    Case("glu_spellings", lambda: Lambda(  # the module called by keyword (an IndexError)
        lambda s, x: (s.glu(input=s.fc(x)), s.glu0(x), F.glu(x, dim=0), F.glu(x)),
        fc=nn.Linear(6, 6), glu=nn.GLU(), glu0=nn.GLU(0)), (4, 6)),
    Case("flatten_spellings", lambda: Lambda(  # modules and torch.* by keyword (IndexErrors)
        lambda s, x: (s.flat(input=s.fc(x)), s.flat0(x), torch.flatten(input=x, start_dim=1),
                      x.flatten(end_dim=1), s.unflat(input=x), torch.unflatten(x, -1, (2, 3)),
                      x.unflatten(dim=0, sizes=(2, -1)), torch.flatten(x[0, 0])),
        fc=nn.Linear(6, 6), flat=nn.Flatten(), flat0=nn.Flatten(0, 1),
        unflat=nn.Unflatten(1, (3, 2))), (4, 6)),
    Case("matmul_vectors", lambda: Lambda(lambda s, x: torch.matmul(s.fc(x), s.v), fc=nn.Linear(5, 4),
                                          v=torch.randn(4)), (3, 5)),
    Case("einsum_attention",  # lucidrains' spelling: spaces, both operands per model
         lambda: Lambda(lambda s, x: torch.einsum(
             "b i d, b j d -> b i j", s.fc(x), s.fc(x)).softmax(-1), fc=nn.Linear(5, 6)),
         (2, 3, 5)),
    Case("einsum_param_implicit",  # "...i,ij" means "...i,ij->...j"; input shared or not
         lambda: Lambda(lambda s, x: torch.einsum("...i,ij", x, s.w), w=torch.randn(5, 3)),
         (2, 4, 5)),
    Case("einsum_list_and_trace",
         lambda: Lambda(lambda s, x: torch.einsum("bij,jk->bik", [x, s.w]) + torch.einsum(
             "ii", s.w[:, :5]), w=torch.randn(5, 6)), (2, 4, 5)),
    # ---- im2col, spatial transformer
    Case("unfold_fold", lambda: Lambda(lambda s, x: F.fold(
        F.unfold(s.conv(x), 2, stride=2) * 2, output_size=(4, 4), kernel_size=2, stride=2),
        conv=nn.Conv2d(2, 3, 1)), (2, 2, 4, 4)),
    Case("nn_unfold", seq(lambda: [nn.Conv2d(2, 3, 1), nn.Unfold(2, padding=1)]), (2, 2, 4, 4)),
    Case("nn_unfold_unbatched", seq(lambda: [nn.Conv2d(2, 3, 1), nn.Unfold(2)]), (2, 4, 4)),
    Case("spatial_transformer", lambda: Lambda(lambda s, x: F.grid_sample(
        s.conv(x), F.affine_grid(s.theta.expand(x.shape[0], 2, 3), x.size(), align_corners=False),
        align_corners=False), conv=nn.Conv2d(2, 2, 1),
        theta=torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]) + 0.1 * torch.randn(2, 3)), (2, 2, 5, 5)),
    # ---- normalization
    Case("batchnorm1d_2d", seq(lambda: [nn.BatchNorm1d(5)]), (4, 5)),
    Case("batchnorm1d_3d", seq(lambda: [nn.BatchNorm1d(5, momentum=None)]), (4, 5, 6)),
    Case("batchnorm2d", seq(lambda: [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()]),
         (3, 3, 6, 6)),
    Case("batchnorm2d_no_stats", seq(lambda: [nn.BatchNorm2d(3, track_running_stats=False)]),
         (3, 3, 4, 4)),
    Case("batchnorm2d_no_affine", seq(lambda: [nn.BatchNorm2d(3, affine=False, momentum=0.3)]),
         (3, 3, 4, 4)),
    Case("batchnorm3d", seq(lambda: [nn.BatchNorm3d(2)]), (2, 2, 3, 3, 3)),
    Case("layernorm", seq(lambda: [nn.LayerNorm(6)]), (2, 3, 6)),
    Case("layernorm_2d_nobias", seq(lambda: [nn.LayerNorm([3, 6], bias=False)]), (2, 3, 6)),
    Case("layernorm_no_affine", seq(lambda: [nn.Linear(6, 6), nn.LayerNorm(6,
                                              elementwise_affine=False)]), (4, 6)),
    Case("f_layer_norm", lambda: Lambda(lambda s, x: F.layer_norm(x, (6,), s.w, s.b, 1e-3),
                                        w=torch.randn(6), b=torch.randn(6)), (4, 6)),
    Case("groupnorm", seq(lambda: [nn.GroupNorm(2, 4)]), (2, 4, 5, 5)),
    Case("groupnorm_1d", seq(lambda: [nn.GroupNorm(3, 6, affine=False)]), (2, 6, 5)),
    Case("instancenorm1d", seq(lambda: [nn.InstanceNorm1d(4, affine=True)]), (2, 4, 7)),
    Case("instancenorm2d_stats", seq(lambda: [nn.InstanceNorm2d(3, affine=True,
                                                                track_running_stats=True)]),
         (2, 3, 5, 5)),
    Case("instancenorm2d_unbatched", seq(lambda: [nn.InstanceNorm2d(3, affine=True)]), (3, 5, 5)),
    Case("instancenorm3d", seq(lambda: [nn.InstanceNorm3d(2)]), (2, 2, 3, 3, 3)),
    Case("rmsnorm", seq(lambda: [nn.RMSNorm(6)]), (2, 3, 6)),
    Case("rmsnorm_eps", seq(lambda: [nn.Linear(4, 6), nn.RMSNorm([6], eps=1e-3)]), (3, 4)),
    # ---- embedding, prelu
    Case("embedding", seq(lambda: [nn.Embedding(10, 4)]), (3, 5), integer_input=10),
    Case("embedding_padding", seq(lambda: [nn.Embedding(10, 4, padding_idx=0), nn.Flatten(),
                                           nn.Linear(20, 3)]), (3, 5), integer_input=10),
    Case("embedding_scale_grad", seq(lambda: [nn.Embedding(10, 4, scale_grad_by_freq=True,
                                                           padding_idx=-1)]),
         (3, 5), integer_input=10),
    Case("f_embedding", lambda: Lambda(lambda s, x: F.embedding(x, s.w, padding_idx=2),
                                       w=torch.randn(10, 3)), (4,), integer_input=10),
    Case("prelu_shared", seq(lambda: [nn.PReLU()]), (2, 4, 5)),
    Case("prelu_channels", seq(lambda: [nn.Linear(5, 4), nn.PReLU(4)]), (3, 5)),
    Case("prelu_conv", seq(lambda: [nn.Conv2d(2, 3, 1), nn.PReLU(3, init=0.1)]), (2, 2, 3, 3)),
]


class Activations(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6))
        self.shift = nn.Parameter(torch.randn(6))
        self.act = nn.Hardswish()
        self.elu = nn.ELU(alpha=0.7)

    def forward(self, x):
        h = self.fc(x)
        a = F.relu(h) + F.gelu(h, approximate="tanh") - F.silu(h) * torch.sigmoid(h)
        b = F.leaky_relu(h, 0.2) * h.tanh() + F.elu(h) / 3 + F.relu6(h) ** 2
        c = torch.clamp(h, -0.5, 0.5) + torch.where(h > 0, h, a) + torch.maximum(a, b)
        d = F.softplus(h, beta=2.0) + self.act(h) + self.elu(h) + (1 - h).abs().sqrt()
        e = h * self.scale + self.shift  # batched [N, 6] params against [N, B, 6]
        f = 2.0 / (1.0 + h.exp()) + h.neg() - F.hardtanh(h, -0.3, 0.3)
        return a + b + c + d + e + f + (h >= 0).to(h.dtype) + h.masked_fill(h < -0.5, 0.0)


class Shapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 6)
        self.token = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.conv(x)                                        # [B, 4, 5, 5]
        flat = h.view(h.size(0), -1)                            # [B, 100]
        t = torch.flatten(h, 2).transpose(1, 2)                 # [B, 25, 4]
        p = t.permute(0, 2, 1).reshape(x.shape[0], 4, 5, 5)     # back to [B, 4, 5, 5]
        q = torch.cat([p[:, :2], h[:, 2:]], dim=1)              # cat of two slices
        s = torch.stack([q, h], dim=-1).sum(-1)                 # stack + reduce
        a, b = torch.chunk(s, 2, dim=1)
        c, d = s.split([1, 3], dim=1)
        u = a.unsqueeze(1).squeeze(1) + b - c.expand(-1, 2, -1, -1) + d[:, :2]
        v = u.mean(dim=(2, 3)) + u.amax(-1).sum(-1) + u[..., 1:3, 0].max(dim=-1)[0]
        w = v.softmax(-1) * F.log_softmax(v, dim=1) + v.repeat(1, 2)[:, :2]
        z = self.fc(flat) + w.sum(1, keepdim=True) + t.std(1).mean(-1, keepdim=True)
        tok = self.token.expand(x.size(0), -1) + self.token[None, :]
        return z + tok.sum(-1, keepdim=True) + torch.cat([w, w], 1)[:, :6].logsumexp(1)[:, None]


class Reductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        h = self.fc(x)
        full = h.sum() + h.mean() + h.max() + h.amin() + h.var(unbiased=False) + h.std()
        idx = h.argmax(-1).to(h.dtype) + torch.argmin(h).to(h.dtype)
        return h.T @ h + full + idx.sum() + h.prod(1).sum() + h.norm(dim=-1).sum() + h.t().sum()


class Pooling(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)
        self.adapt = nn.AdaptiveAvgPool2d((1, 1))
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.shuffle = nn.PixelShuffle(2)
        self.pad = nn.ReflectionPad2d(1)
        self.lp = nn.LPPool2d(2, 2)

    def forward(self, x):
        h = self.conv(x)                                   # [B, 4, 6, 6]
        a = self.pool(h) + self.avg(h) + self.lp(h.abs() + 0.1)
        b = self.adapt(self.up(a)).flatten(1)              # [B, 4]
        c = self.shuffle(h).mean((1, 2, 3))[:, None]       # [B, 1]
        d = F.max_pool1d(h.flatten(2), 4).sum(-1) + F.adaptive_max_pool2d(h, 2).sum((2, 3))
        e = self.pad(h)[:, :, 0, :4].sum(-1) + F.pad(h.flatten(2), (1, 1), mode="replicate").mean(-1)
        f = F.avg_pool2d(h, 2, ceil_mode=True).sum((2, 3)) + F.pad(h, (0, 1, 2, 0)).sum((2, 3))
        vals, idx = F.max_pool2d(h, 2, return_indices=True)
        return b + c + d + e + f + vals.sum((2, 3)) + idx.sum((2, 3)).to(h.dtype) * 1e-3


class ChannelMixing(nn.Module):
    """Ops that mix a sample's channels (local response norm, channel shuffle): folded
    into N*C channels they would mix neighbouring models, so they take the models as more
    samples.  Four channels, windows of 2 and 3: every window crosses a model boundary
    of the folded layout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.lrn = nn.LocalResponseNorm(3, alpha=0.5, k=1.5)
        self.shuffle = nn.ChannelShuffle(2)

    def forward(self, x):
        h = self.conv(x)                                              # [B, 4, 5, 5]
        a = self.lrn(h) + F.local_response_norm(h.flatten(2), 2).unflatten(2, (5, 5))
        b = self.shuffle(h) * torch.arange(4.0, dtype=h.dtype)[:, None, None]
        c = F.channel_shuffle(h, 2) + F.channel_shuffle(h, 4)
        return a + b + c + self.lrn(h[0])[None]                        # and one unbatched


class PaddingAndResampling(nn.Module):
    """The per-channel ops Pooling leaves out: padding modes, the upsampling modules,
    pixel unshuffle, 1-d/3-d pooling, feature dropouts (their eval / p = 0 forms)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pads = nn.ModuleList([nn.ReplicationPad2d(1), nn.CircularPad2d((1, 0, 0, 1)),
                                   nn.ConstantPad2d(1, 0.5), nn.ZeroPad2d((0, 1, 1, 0))])
        self.nearest = nn.UpsamplingNearest2d(scale_factor=2)
        self.bilinear = nn.UpsamplingBilinear2d(scale_factor=2)
        self.unshuffle = nn.PixelUnshuffle(2)
        self.pool1d = nn.MaxPool1d(3, stride=2)
        self.pool3d = nn.AvgPool3d(2)
        self.adapt3d = nn.AdaptiveMaxPool3d(1)
        self.drop3d = nn.Dropout3d(0.0)
        self.alpha_drop = nn.FeatureAlphaDropout(0.0)

    def forward(self, x):
        h = self.conv(x)                                                # [B, 4, 6, 6]
        a = sum(pad(h).sum((2, 3)) for pad in self.pads)
        b = (self.nearest(h) - self.bilinear(h)).sum((2, 3)) \
            + F.interpolate(h, size=(4, 5), mode="nearest").sum((2, 3))
        c = self.unshuffle(h).sum((2, 3)).unflatten(1, (4, 4)).sum(2) \
            + F.pixel_unshuffle(h, 3).sum((2, 3)).unflatten(1, (4, 9)).sum(2)
        d = self.pool1d(h.flatten(2)).sum(-1) + F.lp_pool1d(h.flatten(2).abs() + 0.1, 2, 4).sum(-1)
        v = self.drop3d(self.alpha_drop(h.unflatten(3, (2, 3))))       # [B, 4, 6, 2, 3]
        e = self.pool3d(v).sum((2, 3, 4)) + self.adapt3d(v).flatten(1)
        return a + b + c + d + e


class InplaceActivations(nn.Module):
    """In-place activation modules: on a fused intermediate they run out of place (no
    other user sees the difference); where another op reads the mutated input, in place."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 4)
        self.relu6 = nn.ReLU6(inplace=True)
        self.hardtanh = nn.Hardtanh(-0.5, 0.5, inplace=True)
        self.leaky = nn.LeakyReLU(0.2, inplace=True)
        self.shared = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))        # BN output: a view of the fused layout
        h = self.fc(h.mean((2, 3)))
        a = self.leaky(self.hardtanh(self.relu6(h * 3)))
        b = self.fc2(a)
        c = self.shared(b)                              # b has another user below:
        return c + b                                    # it must see relu(b) -> 2 relu(b)


CASES += [
    Case("inplace_activations", InplaceActivations, (2, 2, 5, 5)),
    Case("activations", Activations, (4, 6)),
    Case("shapes", Shapes, (2, 3, 5, 5)),
    Case("reductions", Reductions, (3, 5)),
    Case("pooling", Pooling, (2, 2, 6, 6)),
    Case("channel_mixing", ChannelMixing, (2, 2, 5, 5)),
    Case("padding_and_resampling", PaddingAndResampling, (2, 2, 6, 6)),
    Case("dropout_eval_or_zero", seq(lambda: [nn.Linear(4, 4), nn.Dropout(0.0), nn.Dropout1d(0.0)]),
         (2, 4, 4)),
    Case("dropout_spellings", lambda: Lambda(  # the modules and F.* by keyword (IndexErrors)
        lambda s, x: (s.drop(input=s.fc(x)), s.alpha(input=x), F.dropout(input=x, p=0.0),
                      torch.dropout(x, 0.0, train=True), F.alpha_dropout(input=x, p=0.0),
                      torch.alpha_dropout(x, 0.0, True)),
        fc=nn.Linear(4, 4), drop=nn.Dropout(0.0), alpha=nn.AlphaDropout(0.0)), (2, 4, 4)),
    Case("channelwise_spellings", lambda: Lambda(  # modules, F.* by keyword (IndexErrors)
        lambda s, x: (s.pool(input=s.conv(x)), F.max_pool2d(input=x, kernel_size=2),
                      s.up(input=x), F.interpolate(input=x, scale_factor=2.0),
                      s.pad(input=x), s.zero_pad(input=x), F.pad(input=x, pad=(1, 1, 0, 1), mode="reflect"),
                      s.drop(input=x), F.dropout2d(input=x, p=0.0),
                      F.adaptive_avg_pool2d(input=x, output_size=1)),
        conv=nn.Conv2d(3, 3, 1), pool=nn.MaxPool2d(2), up=nn.Upsample(scale_factor=2),
        pad=nn.ReflectionPad2d(1), zero_pad=nn.ZeroPad2d(1), drop=nn.Dropout2d(0.0)),
        (2, 3, 4, 4)),
    Case("samplewise_spellings", lambda: Lambda(  # modules, F.* by keyword (IndexErrors)
        lambda s, x: (s.unfold(input=s.shuffle(input=s.lrn(input=s.conv(x)))),
                      F.local_response_norm(input=x, size=2), F.channel_shuffle(input=x, groups=1),
                      F.unfold(input=x, kernel_size=2)),
        conv=nn.Conv2d(3, 4, 1), lrn=nn.LocalResponseNorm(2), shuffle=nn.ChannelShuffle(2),
        unfold=nn.Unfold(2)), (2, 3, 4, 4)),
    Case("cosine_similarity", lambda: Lambda(lambda s, x: s.cos(x, s.w) * F.cosine_similarity(
        x, s.w[:, None], dim=1), cos=nn.CosineSimilarity(dim=-1), w=torch.randn(4)), (2, 4, 4)),
    # torchvision's fx-wrapped leaves (hftc.bench's stand-ins; tests/test_torchvision_ops.py
    # tests their training-mode draws)
    Case("stochastic_depth_zero", seq(lambda: [nn.Linear(4, 4), torchvision_ops.StochasticDepth(
        0.0, "row"), torchvision_ops.StochasticDepth(0.0, "batch")]), (3, 4)),
    Case("swin_shifted_window_attention",
         lambda: torchvision_ops.ShiftedWindowAttention(8, [2, 2], [1, 1], 2), (2, 3, 4, 8)),
]


def _inputs(case: Case, n: int, stacked: bool):
    shape = ((n,) if stacked else ()) + case.input_shape
    if case.integer_input is not None:
        x = torch.randint(0, case.integer_input, shape)
        x.view(-1)[0] = 0  # make sure padding indices occur
        return x
    return torch.randn(shape, dtype=torch.float64)


def _models(case: Case, n: int):
    return [case.make() for _ in range(n)]


#: (N, stacked inputs?) pairs: every N of the grid, both input kinds, without the full product.
GRID = [(1, False), (2, True), (3, False), (3, True), (8, False), (8, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(("n", "stacked"), GRID, ids=[f"N{n}-{'stacked' if s else 'shared'}"
                                                      for n, s in GRID])
def test_rule_float64_train(case, n, stacked):
    if stacked and not case.stacked:
        pytest.skip("case has no stacked form")
    check_equivalence(_models(case, n), _inputs(case, n, stacked), in_dims=0 if stacked else None,
                      train=True, dtype=torch.float64, steps=2 if n == 3 else 1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_float64_eval_n2(case):
    check_equivalence(_models(case, 2), _inputs(case, 2, False), train=False, dtype=torch.float64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_rule_float32(case, train):
    check_equivalence(_models(case, 3), _inputs(case, 3, True), in_dims=0, train=train,
                      dtype=torch.float32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_case_fuses_every_op(case):
    """Each case exercises rules: none of its ops may fall back to running model by model."""
    fused = hftc.fuse([m.double() for m in _models(case, 2)])
    fused(_inputs(case, 2, False))
    assert [(r.source, r.reason) for r in fused.fusion_report.fallbacks] == []


def test_inplace_activations_run_out_of_place_where_no_one_sees_it():
    import hftc

    torch.manual_seed(0)
    fused = hftc.fuse([InplaceActivations() for _ in range(2)])
    fused(torch.randn(3, 2, 5, 5))
    source = fused.last_program().source
    assert source.count("torch.nn.functional.relu(") == 1      # self.relu
    assert source.count("torch.nn.functional.hardtanh(") == 2  # relu6, hardtanh
    assert source.count("torch.nn.functional.leaky_relu(") == 1
    assert "self.shared(" in source  # its input has another user: stays in place


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "shared"])
@pytest.mark.parametrize("bad", [10, 13, -1])
def test_embedding_index_out_of_range_raises_as_alone(stacked, bad):
    """The N tables are one [N*V, D] table with model n's indices offset by n*V: model 0's
    index 12 (V = 10) silently read model 1's row 2. Out-of-range indices raise
    IndexError, as each model alone does."""
    import hftc

    models = [nn.Embedding(10, 3) for _ in range(3)]
    fused = hftc.fuse(models, in_dims=0 if stacked else None)
    ids = torch.tensor([[bad, 1], [3, 4], [5, 6]]) if stacked else torch.tensor([bad, 1])
    with pytest.raises(IndexError, match="index out of range"):
        models[0](ids[0] if stacked else ids)
    with pytest.raises(IndexError, match="index out of range"):
        fused(ids)
    good = ids.clamp(0, 9)
    torch.testing.assert_close(fused(good), torch.stack(
        [m(good[i] if stacked else good) for i, m in enumerate(models)]))


def test_sparse_embedding_is_refused_with_what_to_change():
    """sparse=True fused, then failed in backward with torch's 'reshape is not implemented
    for sparse tensors'; it is refused when fusing, naming the layer."""
    import hftc
    from hftc.errors import UnsupportedOperatorError

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.words = nn.Embedding(10, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            return self.head(self.words(ids))

    with pytest.raises(UnsupportedOperatorError, match=r"words.*sparse=True.*sparse=False"):
        hftc.fuse([Tagger() for _ in range(2)])(torch.tensor([[1, 2]]))


def test_einsum_is_one_einsum_with_a_model_index():
    """torch.einsum had no rule: it ran model by model. Attention code written with it
    (lucidrains' spelling) is now one einsum over the N models."""
    import hftc
    from hftc.passes.linear import batched_equation

    assert batched_equation("b i d, b j d -> b i j", [True, False]) == "Abid,bjd->Abij"
    assert batched_equation("...i,ij", [False, True]) == "...i,Aij->A...j"
    assert batched_equation("Abc,c", [True, True]) == "BAbc,Bc->BAb"
    models = [Lambda(lambda s, x: torch.einsum("b i d, b j d -> b i j", s.fc(x), x),
                     fc=nn.Linear(5, 5)) for _ in range(3)]
    fused = hftc.fuse(models)
    x = torch.randn(2, 3, 5)
    torch.testing.assert_close(fused(x), torch.stack([m(x) for m in models]))
    assert fused.fusion_report.fallbacks == []
    assert fused.fusion_report.rule_counts()["fuse_einsum"] == 1


@pytest.mark.parametrize("name", ["unfold_fold", "nn_unfold", "spatial_transformer"])
def test_im2col_and_spatial_transformer_ops_are_fused(name):
    """F.unfold / F.fold, nn.Unfold, F.affine_grid and F.grid_sample ran model by model;
    each is now one call over the N models' samples as one batch."""
    import hftc

    case = next(c for c in CASES if c.name == name)
    fused = hftc.fuse([m.double() for m in _models(case, 3)])
    fused(_inputs(case, 3, False))
    assert fused.fusion_report.fallbacks == []


class LossInForward(nn.Module):
    """A model that computes its own loss (``labels=``), in the spellings models use."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.ce = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.mse = nn.MSELoss(reduction="sum")
        self.l1 = nn.L1Loss()
        self.bce = nn.BCEWithLogitsLoss(reduction="none")
        self.huber = nn.HuberLoss(delta=0.5)
        self.nll = nn.NLLLoss(ignore_index=2, reduction="sum")
        self.smooth = nn.SmoothL1Loss(beta=0.25)

    def forward(self, x, labels, target):
        out = self.fc(x)
        a, b = torch.broadcast_tensors(out, target[:1])
        probability = target.sigmoid()
        return (F.cross_entropy(out, labels), F.cross_entropy(out, labels, None, None, 2, None,
                                                              "none"),
                self.ce(out, labels), self.mse(out, target), F.smooth_l1_loss(a, b, beta=0.5),
                F.nll_loss(out.log_softmax(-1), labels, reduction="sum"),
                self.l1(out, target), self.bce(out, probability), self.huber(out, target),
                F.binary_cross_entropy(out.sigmoid(), probability),
                F.soft_margin_loss(out, target.detach().sign()), F.l1_loss(out, target, reduction="sum"),
                self.nll(out.log_softmax(-1), target=labels), self.smooth(input=out, target=target))


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
def test_losses_inside_forward_are_one_loss_per_model(frontend, stacked):
    """A model's own loss (Hugging Face's labels=) ran model by model: now each is
    hftc.per_model's N losses, in both front-ends (ATen's loss ops spelled as F.*)."""
    import hftc

    n = 3
    x, labels, target = torch.randn(6, 4), torch.randint(0, 5, (6,)), torch.randn(6, 5)
    inputs = (x.expand(n, 6, 4).clone(), labels.expand(n, 6).clone(), target.expand(
        n, 6, 5).clone()) if stacked else (x, labels, target)
    example = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    fused = check_equivalence(
        [LossInForward() for _ in range(n)], inputs, in_dims=0 if stacked else None,
        fuser=lambda models, in_dims: hftc.fuse(models, in_dims=in_dims, frontend=frontend,
                                                example_inputs=example))
    assert fused.fusion_report.fallbacks == []


@pytest.mark.parametrize("module, functional", [
    (nn.CrossEntropyLoss, F.cross_entropy), (nn.NLLLoss, F.nll_loss), (nn.MSELoss, F.mse_loss),
    (nn.BCEWithLogitsLoss, F.binary_cross_entropy_with_logits)])
def test_one_rule_serves_a_loss_module_its_functional_and_its_aten_op(module, functional):
    from hftc.passes.registry import RULES

    entry = RULES[("call_module", module)]
    assert RULES[("call_function", functional)] is entry
    assert entry.name == f"fuse_loss[{functional.__name__}]" and entry.aten


@pytest.mark.parametrize("module, functional", [
    (nn.Softmax, F.softmax), (nn.LogSoftmax, F.log_softmax), (nn.Softmin, F.softmin)])
def test_one_rule_serves_a_softmax_module_and_its_functional(module, functional):
    from hftc.passes.registry import RULES

    entry = RULES[("call_module", module)]
    assert RULES[("call_function", functional)] is entry
    assert entry.name == f"fuse_softmax[{functional.__name__}]"


class _WeightedClassifier(nn.Module):
    """A classifier whose loss module holds its own class weights (a buffer per model)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.loss = nn.CrossEntropyLoss(weight=torch.rand(3) + 0.5, ignore_index=1)

    def forward(self, x, labels):
        return self.loss(self.fc(x), labels)


def test_a_loss_module_with_its_own_class_weights_runs_per_model():
    torch.manual_seed(0)
    models = [_WeightedClassifier() for _ in range(3)]
    fused = check_equivalence(models, (torch.randn(6, 4), torch.randint(0, 3, (6,))))
    (fallback,) = fused.fusion_report.fallbacks
    assert "per-model class weight" in str(fallback)


class DimsFromRank(nn.Module):
    """Dims that forward computes from the rank (``x.dim()``, ``x.ndim``) are graph nodes
    when tracing, positive and negative ones."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        h = self.fc(x)                                           # [B, 5, 5]
        t = h.transpose(h.ndim - 2, h.ndim - 1)                  # (1, 2)
        a = t.softmax(h.dim() - 1)                               # 2
        b = F.log_softmax(t, dim=1 - h.ndim)                     # -2
        c = torch.cat([a, b], h.ndim - 3)                        # 0
        d = torch.cat([a, b], dim=-h.ndim)                       # -3
        e = c.unsqueeze(h.dim()).sum(-h.dim() - 1)               # 3, then -4
        f = d.unsqueeze(1 - h.dim()).sum(h.ndim - 2, keepdim=True)  # -2, then 1
        return t.transpose(-h.ndim + 1, h.ndim - 1), e, f, h.sum(h.dim() - 3)


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
def test_dims_computed_from_the_rank_are_shifted_in_the_fused_graph(stacked):
    """``h.transpose(h.ndim - 2, h.ndim - 1)``, ``h.softmax(h.dim() - 1)``: a dim computed in
    forward was an fx node when fusing, and every dim rule (transpose, softmax, sum, cat,
    unsqueeze ...) failed with an internal error comparing it with 0. The fused graph now
    shifts it past the model dim when it runs."""
    n = 3
    x = torch.randn((n, 4, 5, 5) if stacked else (4, 5, 5))
    fused = check_equivalence([DimsFromRank() for _ in range(n)], x,
                              in_dims=0 if stacked else None, dtype=torch.float64, steps=2)
    assert fused.fusion_report.fallbacks == []


class DimInput(nn.Module):
    """A dim given as a forward input (an int)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x, dim):
        h = self.fc(x)
        return (h.transpose(dim, -1), h.softmax(dim), h.sum(dim), torch.cat([h, 2 * h], dim),
                h.unsqueeze(dim).cumsum(dim), h.amax(dim=dim))


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_a_dim_given_as_an_input_is_shifted_in_the_fused_graph(dim, stacked):
    n = 3
    x = torch.randn((n, 4, 5, 5) if stacked else (4, 5, 5))
    fused = check_equivalence([DimInput() for _ in range(n)], (x, dim),
                              in_dims=(0, None) if stacked else None, dtype=torch.float64)
    assert fused.fusion_report.fallbacks == []


def test_a_dim_computed_from_a_size_is_right_for_every_call():
    """A program is compiled once per input rank, not per size: a dim computed from a size
    (here ``x.size(0) % 3 - 1``: 0, 1 or -1) is shifted on every call, never baked in."""
    import hftc

    class SizeDim(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            return self.fc(x).softmax(x.size(0) % 3 - 1)

    models = [SizeDim() for _ in range(3)]
    fused = hftc.fuse(models)
    for batch in (4, 5, 6, 4):
        x = torch.randn(batch, 5, 5)
        torch.testing.assert_close(fused(x), torch.stack([m(x) for m in models]))
    assert len(fused._programs) == 1
    assert fused.fusion_report.fallbacks == []


def test_std_and_var_with_a_positional_unbiased_flag_keep_it():
    """``x.std(False)`` (the unbiased overload, no dim) dropped the flag: the fused program
    computed the unbiased std (the first-call check then ran the models one by one)."""
    import warnings

    import hftc

    models = [Lambda(lambda s, x: torch.stack([s.fc(x).std(False), torch.var(s.fc(x), False),
                                               s.fc(x).std(True)]), fc=nn.Linear(5, 5))
              for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", hftc.FusionWarning)
        fused = check_equivalence(models, torch.randn(4, 5), dtype=torch.float64)
    assert fused.fusion_report.fallbacks == []


class _ComplexLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5, dtype=torch.complex128)
        self.b = nn.Linear(5, 3, dtype=torch.complex128)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("stacked", [False, True], ids=["shared", "stacked"])
def test_complex_linears_get_autograds_gradients(stacked):
    # _BatchedLinear's backward has no conjugates: a complex layer's weight gradient was
    # off by O(1) while its output was right (so the first-call check could not see it).
    torch.manual_seed(0)
    models = [_ComplexLinears() for _ in range(3)]
    fused = hftc.fuse(copy.deepcopy(models), in_dims=0 if stacked else None)
    x = torch.randn(3, 4, 6, dtype=torch.complex128) if stacked \
        else torch.randn(4, 6, dtype=torch.complex128)
    out = fused(x)
    (out.abs() ** 2).sum().backward()
    for i, m in enumerate(models):
        want = m(x[i] if stacked else x)
        (want.abs() ** 2).sum().backward()
        torch.testing.assert_close(out[i], want)
        for name, p in m.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name).grad[i], p.grad)


def test_a_key_registered_twice_is_an_error_whatever_the_import_order():
    from hftc.passes.registry import RULES, DuplicateRuleError, rule

    key = ("call_module", nn.LeakyReLU)
    entry = RULES[key]
    assert entry.name == "fuse_slope[LeakyReLU]"  # the rule that takes a per-model slope
    with pytest.raises(DuplicateRuleError, match=r"LeakyReLU has two fusion rules, "
                                                 r"`fuse_slope\[LeakyReLU\]` and `other`"):
        rule(key, name="other")(lambda group, builder: None)
    assert RULES[key] is entry


def test_random_ops_are_declared_once_in_the_rule_table():
    from hftc.passes.registry import RULES

    for key in [("call_function", torch.randn), ("call_method", "exponential_"),
                ("call_module", nn.RReLU), ("call_function", F.dropout),
                ("call_module", nn.Dropout2d), ("call_function", F.scaled_dot_product_attention),
                ("call_function", "torchvision.ops.stochastic_depth.stochastic_depth"),
                ("call_function", "torchvision.models.swin_transformer.shifted_window_attention")]:
        assert RULES[key].random, key
    assert not RULES[("call_function", F.relu)].random


def test_the_rules_declare_the_aten_ops_torch_export_records_for_them():
    """The ATen spellings live on the rules (``@rule(aten=...)``), not in a front-end table:
    the export front-end converts exactly what the rules hand it."""
    from hftc.passes.registry import RULES, aten_spellings

    aten = torch.ops.aten
    declared = {op for entry in RULES.values() for op, _ in entry.aten}
    assert declared == set(aten_spellings())
    for key, op in [(("call_function", F.batch_norm), aten.batch_norm),
                    (("call_function", F.conv2d), aten.convolution),
                    (("call_function", F.linear), aten.linear),
                    (("call_function", torch.matmul), aten.addmm),
                    (("call_function", F.dropout), aten.dropout_)]:
        assert op in dict(RULES[key].aten), (key, op)
    import hftc.frontends.export as export_frontend

    assert not hasattr(export_frontend, "CONVERTERS")


def test_an_aten_op_declared_by_two_rules_is_an_error():
    from hftc.passes.registry import RULES, DuplicateRuleError, aten_spellings, rule

    before = aten_spellings()
    with pytest.raises(DuplicateRuleError, match=r"linear has two spellings, one of them in "
                                                 r"rule `other`: declare it on one rule"):
        rule(("call_function", torch.special.expit), name="other",
             aten={torch.ops.aten.linear: torch.special.expit})(lambda group, builder: None)
    assert aten_spellings() == before and ("call_function", torch.special.expit) not in RULES
    with pytest.raises(TypeError, match=r"aten= takes ATen ops such as torch.ops.aten.linear"):
        rule(("call_function", torch.special.expit), name="other",
             aten={"linear": torch.special.expit})(lambda group, builder: None)


def test_the_export_front_end_spells_aten_ops_as_the_rules_hand_it():
    from hftc.frontends.export import export_model
    from hftc.passes.registry import aten_spellings

    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), torch.randn(2, 3, 8, 8)
    spelled = export_model(model, 0, training=False, args=(x,), aten_spellings=aten_spellings())
    targets = {n.target for n in spelled.graph.nodes if n.op == "call_function"}
    assert {F.conv2d, F.batch_norm} <= targets
    bare = export_model(model, 0, training=False, args=(x,), aten_spellings={})
    targets = {n.target for n in bare.graph.nodes if n.op == "call_function"}
    # aten.batch_norm is torch.batch_norm (weight first) unless the norm rule spells it F.*
    assert torch.batch_norm in targets and F.batch_norm not in targets
    torch.testing.assert_close(spelled(x), model.eval()(x))


@pytest.mark.parametrize("module, functional, op", [
    (nn.BatchNorm2d, F.batch_norm, torch.ops.aten.batch_norm),
    (nn.InstanceNorm2d, F.instance_norm, torch.ops.aten.instance_norm),
    (nn.GroupNorm, F.group_norm, torch.ops.aten.group_norm),
    (nn.LayerNorm, F.layer_norm, torch.ops.aten.layer_norm),
    (nn.RMSNorm, F.rms_norm, torch.ops.aten.rms_norm),
])
def test_one_rule_serves_a_norm_module_its_functional_and_its_aten_op(module, functional, op):
    from hftc.passes.registry import RULES

    entry = RULES[("call_module", module)]
    assert RULES[("call_function", functional)] is entry
    assert op in dict(entry.aten)


@pytest.mark.parametrize("module, functional", [
    (nn.Conv2d, F.conv2d), (nn.Conv1d, F.conv1d), (nn.ConvTranspose2d, F.conv_transpose2d)])
def test_one_rule_serves_a_conv_module_and_its_functional(module, functional):
    from hftc.passes.registry import RULES

    assert RULES[("call_function", functional)] is RULES[("call_module", module)]


class _DCGANStem(nn.Module):
    """A pytorch/examples DCGAN-style strided conv, as a module or as ``F.conv2d`` on the
    module's own parameters (the stride an int, as a functional call passes it)."""

    def __init__(self, functional):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 4, stride=2, padding=1, bias=False)
        self.functional = functional

    def forward(self, x):
        if self.functional:
            return F.leaky_relu(F.conv2d(x, self.conv.weight, None, 2, 1), 0.2)
        return F.leaky_relu(self.conv(x), 0.2)


def test_conv_spellings_reach_the_runtime_with_one_value_per_spatial_dim():
    """``nn.Conv2d(stride=2)`` holds ``(2, 2)``, ``F.conv2d(..., 2)`` passes ``2``: the rule
    hands ``conv_lowerings`` one form for both, a tuple per spatial dim."""
    from hftc.lowering.runtime import conv as rt_conv

    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    seen = []
    for functional in (False, True):
        torch.manual_seed(0)
        models = [_DCGANStem(functional) for _ in range(3)]
        fused = check_equivalence(models, x, dtype=torch.float64)
        assert fused.fusion_report.rule_counts()["fuse_conv"] == 1
        (node,) = [n for n in fused.fused_graph.nodes if n.target is rt_conv.conv]
        seen.append(node.args[3:7])
    assert seen[0] == seen[1] == ((2, 2), (1, 1), (1, 1), 1)


def test_per_model_positions_and_defaults_come_from_the_functions_signature():
    """``@rule(per_model=("momentum", "eps"))`` names the hyper-parameters; F.batch_norm's
    positions (6, 7) and defaults are read from its signature, not written down again."""
    from hftc.passes.registry import per_model_table, rule

    table = per_model_table()
    assert table.arguments[F.batch_norm] == {6: "momentum", 7: "eps"}
    assert table.defaults[F.batch_norm] == (None, None, False, 0.1, 1e-5)
    assert table.arguments[F.scaled_dot_product_attention] == {4: "dropout_p"}
    assert table.defaults[F.scaled_dot_product_attention] == (None, 0.0)
    assert table.arguments[F.leaky_relu] == {1: "negative_slope"}
    with pytest.raises(TypeError, match=r"rule `other`: call_function .*batch_norm has no "
                                        r"parameter 'momentun' \(per_model=\('momentun',\)\)"):
        rule(("call_function", F.batch_norm), name="other",
             per_model=("momentun",))(lambda group, builder: None)


class _FunctionalGroupNorm(nn.Module):
    """A group norm in the style of a diffusion UNet block, eps left at its default or given."""

    def __init__(self, eps=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.weight, self.bias = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))
        self.eps = eps

    def forward(self, x):
        y = self.conv(x)
        if self.eps is None:
            return F.group_norm(y, 4, self.weight, self.bias)
        return F.group_norm(y, 4, self.weight, self.bias, self.eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_functional_group_norm_with_eps_given_in_one_model_and_left_out_in_another(dtype):
    """The folded group-norm rule on the functional spelling: ``(y, 4, w, b)`` and
    ``(y, 4, w, b, 1e-2)`` are one program with a per-model eps."""
    torch.manual_seed(0)
    models = [_FunctionalGroupNorm(), _FunctionalGroupNorm(1e-2), _FunctionalGroupNorm(0.5)]
    fused = check_equivalence(models, torch.randn(2, 3, 6, 6), dtype=dtype)
    assert fused.fusion_report.rule_counts()["fuse_group_norm"] == 1


class _ShapeBranchingInstanceNorm(nn.Module):
    """Instance norm with running statistics after a conv, in a forward that branches on the
    input's rank (so only torch.export traces it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)

    def forward(self, x):
        if x.dim() == 4:
            x = self.conv(x)
        return self.norm(x)


def test_exported_instance_norm_in_eval_mode_uses_each_models_running_statistics():
    """torch.export spells the module ``F.instance_norm(..., use_input_stats=False)`` in eval
    mode; the fused norm normalised with the batch's statistics instead (off by ~1.4)."""
    torch.manual_seed(0)
    models = [_ShapeBranchingInstanceNorm() for _ in range(3)]
    for m in models:
        for _ in range(3):
            m(torch.randn(2, 3, 8, 8))
        m.eval()
    x = torch.randn(2, 3, 8, 8)
    fused = hftc.fuse(models, example_inputs=(x,), check=False).eval()
    out = fused(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(out[i], m(x))
    assert fused.fusion_report.rule_counts()["fuse_instance_norm"] == 1


def test_torch_random_draws_are_listed_once_for_the_tracer_and_the_rule_table():
    """hftc.ir.TORCH_RANDOM_DRAWS is what the symbolic front-end records as nodes and what
    the rule table declares random; a rule that forgets ``random=True`` is refused."""
    import hftc.frontends.symbolic as symbolic
    from hftc.ir import TORCH_RANDOM_DRAWS
    from hftc.passes.registry import RULES, rule

    assert not hasattr(symbolic, "_TORCH_RANDOM")
    for name in TORCH_RANDOM_DRAWS:
        assert RULES[("call_function", getattr(torch, name))].random, name
    with pytest.raises(TypeError, match=r"rule `other`: torch.poisson draws random numbers "
                                        r"\(hftc.ir.TORCH_RANDOM_DRAWS\): declare it random=True"):
        rule(("call_function", torch.poisson), name="other")(lambda group, builder: None)


def test_channel_dropout_functional_takes_per_model_rates():
    """F.dropout2d(x, self.p) with a rate per model: one rule serves it and nn.Dropout2d,
    per-model rates included (model 0 keeps every channel, model 1 drops every one)."""

    class ChannelDrop(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            return F.dropout2d(x, self.p, self.training)

    x = torch.randn(2, 3, 4, 4)
    fused = hftc.fuse([ChannelDrop(0.0), ChannelDrop(1.0)]).train()
    out = fused(x)
    assert fused.fusion_report.fallbacks == []
    assert torch.equal(out[0], x) and torch.equal(out[1], torch.zeros_like(x))
    assert torch.equal(fused.eval()(x), torch.stack([x, x]))
