"""Small models written in the style of timm / transformers / torchvision, for the hunt tests.

Each takes its per-model hyper-parameters where real code keeps them: a config dataclass
on the module, constructor arguments, attributes read in forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree
import torch.utils.checkpoint

# --------------------------------------------------------------------------- timm helpers


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(nn.Module):
    def __init__(self, drop_prob: float = 0.0, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = drop_prob
        self.scale_by_keep = scale_by_keep

    def forward(self, x):
        return drop_path(x, self.drop_prob, self.training, self.scale_by_keep)


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm: permute, layer_norm, permute back."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


# --------------------------------------------------------------------------- ConvNeXt


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim, drop_path=0.0, ls_init_value=1e-6, mlp_ratio=4):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim))
        self.gamma = nn.Parameter(ls_init_value * torch.ones(dim)) if ls_init_value > 0 else None
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.mlp(x)
        if self.gamma is not None:
            x = x.mul(self.gamma.reshape(1, 1, 1, -1))
        x = x.permute(0, 3, 1, 2)
        return self.drop_path(x) + shortcut


class ConvNeXt(nn.Module):
    def __init__(self, dim=8, depth=2, num_classes=5, drop_path_rate=0.0, ls_init_value=0.5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dim, kernel_size=2, stride=2), LayerNorm2d(dim))
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.stages = nn.Sequential(*[ConvNeXtBlock(dim, dpr[i], ls_init_value)
                                      for i in range(depth)])
        self.head_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        x = x.mean([-2, -1])
        return self.head(self.head_norm(x))


# --------------------------------------------------------------------------- Swin


def window_partition(x, window_size: int):
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size: int, H: int, W: int):
    C = windows.shape[-1]
    x = windows.view(-1, H // window_size, W // window_size, window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, H, W, C)


def get_relative_position_index(win_h: int, win_w: int):
    coords = torch.stack(torch.meshgrid(torch.arange(win_h), torch.arange(win_w), indexing="ij"))
    coords_flatten = torch.flatten(coords, 1)
    relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
    relative_coords = relative_coords.permute(1, 2, 0).contiguous()
    relative_coords[:, :, 0] += win_h - 1
    relative_coords[:, :, 1] += win_w - 1
    relative_coords[:, :, 0] *= 2 * win_w - 1
    return relative_coords.sum(-1)


class WindowAttention(nn.Module):
    def __init__(self, dim, num_heads, window_size=2, attn_drop=0.0):
        super().__init__()
        self.dim = dim
        self.window_size = (window_size, window_size)
        win_h, win_w = self.window_size
        self.window_area = win_h * win_w
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.relative_position_bias_table = nn.Parameter(
            torch.randn((2 * win_h - 1) * (2 * win_w - 1), num_heads) * 0.02)
        self.register_buffer("relative_position_index",
                             get_relative_position_index(win_h, win_w), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)

    def _get_rel_pos_bias(self):
        relative_position_bias = self.relative_position_bias_table[
            self.relative_position_index.view(-1)].view(self.window_area, self.window_area, -1)
        return relative_position_bias.permute(2, 0, 1).contiguous().unsqueeze(0)

    def forward(self, x, mask=None):
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        attn = attn + self._get_rel_pos_bias()
        if mask is not None:
            num_win = mask.shape[0]
            attn = attn.view(-1, num_win, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, -1)
        return self.proj(x)


class SwinBlock(nn.Module):
    def __init__(self, dim=8, input_resolution=(4, 4), num_heads=2, window_size=2,
                 shift_size=0, attn_drop=0.0):
        super().__init__()
        self.input_resolution = input_resolution
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window_size, attn_drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if self.shift_size > 0:
            H, W = self.input_resolution
            img_mask = torch.zeros((1, H, W, 1))
            cnt = 0
            for h in (slice(0, -window_size), slice(-window_size, -shift_size),
                      slice(-shift_size, None)):
                for w in (slice(0, -window_size), slice(-window_size, -shift_size),
                          slice(-shift_size, None)):
                    img_mask[:, h, w, :] = cnt
                    cnt += 1
            mask_windows = window_partition(img_mask, window_size).view(-1, window_size ** 2)
            attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
            attn_mask = attn_mask.masked_fill(attn_mask != 0, (-100.0))
            attn_mask = attn_mask.masked_fill(attn_mask == 0, 0.0)
        else:
            attn_mask = None
        self.register_buffer("attn_mask", attn_mask, persistent=False)

    def forward(self, x):
        B, H, W, C = x.shape
        shortcut = x
        x = self.norm1(x)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        x_windows = window_partition(x, self.window_size).view(-1, self.window_size ** 2, C)
        attn_windows = self.attn(x_windows, mask=self.attn_mask)
        attn_windows = attn_windows.view(-1, self.window_size, self.window_size, C)
        x = window_reverse(attn_windows, self.window_size, H, W)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        x = shortcut + x
        x = x.reshape(B, -1, C)
        x = x + self.mlp(self.norm2(x))
        return x.reshape(B, H, W, C)


class Swin(nn.Module):
    def __init__(self, dim=8, num_classes=5, attn_drop=0.0):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 2, 2)
        self.blocks = nn.Sequential(SwinBlock(dim, shift_size=0, attn_drop=attn_drop),
                                    SwinBlock(dim, shift_size=1, attn_drop=attn_drop))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).permute(0, 2, 3, 1)
        x = self.blocks(x)
        return self.head(self.norm(x).mean(dim=(1, 2)))


# --------------------------------------------------------------------------- EfficientNet


class SqueezeExcite(nn.Module):
    def __init__(self, in_chs, rd_ratio=0.25):
        super().__init__()
        rd = max(1, int(in_chs * rd_ratio))
        self.conv_reduce = nn.Conv2d(in_chs, rd, 1)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_expand = nn.Conv2d(rd, in_chs, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.conv_reduce(x_se)
        x_se = self.act1(x_se)
        x_se = self.conv_expand(x_se)
        return x * self.gate(x_se)


class InvertedResidual(nn.Module):
    def __init__(self, in_chs, out_chs, exp_ratio=4, stride=1, drop_path_rate=0.0,
                 bn_momentum=0.1, bn_eps=1e-5):
        super().__init__()
        mid = in_chs * exp_ratio
        self.has_skip = in_chs == out_chs and stride == 1
        self.conv_pw = nn.Conv2d(in_chs, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid, momentum=bn_momentum, eps=bn_eps)
        self.act1 = nn.SiLU(inplace=True)
        self.conv_dw = nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False)
        self.bn2 = nn.BatchNorm2d(mid, momentum=bn_momentum, eps=bn_eps)
        self.act2 = nn.SiLU(inplace=True)
        self.se = SqueezeExcite(mid)
        self.conv_pwl = nn.Conv2d(mid, out_chs, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_chs, momentum=bn_momentum, eps=bn_eps)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate else nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.act1(self.bn1(self.conv_pw(x)))
        x = self.act2(self.bn2(self.conv_dw(x)))
        x = self.se(x)
        x = self.bn3(self.conv_pwl(x))
        if self.has_skip:
            x = self.drop_path(x) + shortcut
        return x


class EfficientNet(nn.Module):
    def __init__(self, num_classes=5, drop_path_rate=0.0, bn_momentum=0.1, drop_rate=0.0):
        super().__init__()
        self.conv_stem = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, momentum=bn_momentum)
        self.act1 = nn.SiLU(inplace=True)
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, drop_path_rate=drop_path_rate, bn_momentum=bn_momentum),
            InvertedResidual(8, 12, stride=2, bn_momentum=bn_momentum))
        self.drop_rate = drop_rate
        self.classifier = nn.Linear(12, num_classes)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv_stem(x)))
        x = self.blocks(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        if self.drop_rate > 0.0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return self.classifier(x)


# --------------------------------------------------------------------------- ResNeXt


class Bottleneck(nn.Module):
    expansion = 2

    def __init__(self, inplanes, planes, stride=1, groups=2, base_width=4, downsample=None):
        super().__init__()
        width = int(planes * (base_width / 4.0)) * groups
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNeXt(nn.Module):
    def __init__(self, num_classes=5, groups=2, zero_init_residual=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        down = nn.Sequential(nn.Conv2d(8, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
        self.layer1 = nn.Sequential(Bottleneck(8, 4, groups=groups),
                                    Bottleneck(8, 4, 2, groups=groups, downsample=down))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, num_classes)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.constant_(m.bn3.weight, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# --------------------------------------------------------------------------- MLP-Mixer


class MixerBlock(nn.Module):
    def __init__(self, dim, seq_len, mlp_ratio=(0.5, 4.0), drop_path=0.0):
        super().__init__()
        tokens_dim, channels_dim = [int(x * dim) for x in mlp_ratio]
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = nn.Sequential(nn.Linear(seq_len, tokens_dim), nn.GELU(),
                                        nn.Linear(tokens_dim, seq_len))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = nn.Sequential(nn.Linear(dim, channels_dim), nn.GELU(),
                                          nn.Linear(channels_dim, dim))

    def forward(self, x):
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        return x + self.drop_path(self.mlp_channels(self.norm2(x)))


class MlpMixer(nn.Module):
    def __init__(self, num_classes=5, dim=8, patch=2, img=8, depth=2, drop_path_rate=0.0,
                 global_pool="avg"):
        super().__init__()
        self.global_pool = global_pool
        self.stem = nn.Conv2d(3, dim, patch, patch)
        seq = (img // patch) ** 2
        self.blocks = nn.Sequential(*[MixerBlock(dim, seq, drop_path=drop_path_rate)
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x))
        if self.global_pool == "avg":
            x = x.mean(dim=1)
        return self.head(x)


# --------------------------------------------------------------------------- BERT


@dataclass
class BertConfig:
    vocab_size: int = 23
    hidden_size: int = 8
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 16
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 16
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


@dataclass
class BaseModelOutputWithPooling:
    last_hidden_state: torch.Tensor = None
    pooler_output: torch.Tensor = None


# transformers registers its ModelOutput classes with torch's pytree (torch.export needs it)
torch.utils._pytree.register_dataclass(BaseModelOutputWithPooling)


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids",
                             torch.arange(config.max_position_embeddings).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids",
                             torch.zeros(self.position_ids.size(), dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            buffered = self.token_type_ids[:, :seq_length]
            token_type_ids = buffered.expand(input_ids.size(0), seq_length)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        q = self.transpose_for_scores(self.query(hidden_states))
        k = self.transpose_for_scores(self.key(hidden_states))
        v = self.transpose_for_scores(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, h, attention_mask=None):
        a = self.ln1(h + self.dropout(self.attn_out(self.attention(h, attention_mask))))
        return self.ln2(a + self.dropout(self.output(F.gelu(self.intermediate(a)))))


class BertModel(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.config = config or BertConfig()
        self.embeddings = BertEmbeddings(self.config)
        self.layer = nn.ModuleList([BertLayer(self.config)
                                    for _ in range(self.config.num_hidden_layers)])
        self.pooler = nn.Linear(self.config.hidden_size, self.config.hidden_size)

    @property
    def dtype(self):  # transformers' ModuleUtilsMixin.dtype: the parameters' dtype
        return next(self.parameters()).dtype

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended = attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - extended) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, return_dict=True):
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape, device=input_ids.device)
        h = self.embeddings(input_ids, token_type_ids)
        ext = self.get_extended_attention_mask(attention_mask, self.dtype)
        for layer in self.layer:
            h = layer(h, ext)
        pooled = torch.tanh(self.pooler(h[:, 0]))
        if not return_dict:
            return (h, pooled)
        return BaseModelOutputWithPooling(last_hidden_state=h, pooler_output=pooled)


# --------------------------------------------------------------------------- T5


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class T5Attention(nn.Module):
    def __init__(self, d_model=8, n_heads=2, num_buckets=8, max_distance=16,
                 has_relative_attention_bias=True):
        super().__init__()
        self.n_heads = n_heads
        self.d_kv = d_model // n_heads
        self.inner_dim = n_heads * self.d_kv
        self.relative_attention_num_buckets = num_buckets
        self.relative_attention_max_distance = max_distance
        self.has_relative_attention_bias = has_relative_attention_bias
        self.q = nn.Linear(d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, d_model, bias=False)
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32,
                                  max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        rel_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact)).to(torch.long)
        rel_if_large = torch.min(rel_if_large, torch.full_like(rel_if_large, num_buckets - 1))
        relative_buckets += torch.where(is_small, relative_position, rel_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length, device=None):
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        bucket = self._relative_position_bucket(
            relative_position, bidirectional=True,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance)
        values = self.relative_attention_bias(bucket)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, hidden_states, position_bias=None):
        batch_size, seq_length = hidden_states.shape[:2]

        def shape(states):
            return states.view(batch_size, -1, self.n_heads, self.d_kv).transpose(1, 2)

        q, k, v = shape(self.q(hidden_states)), shape(self.k(hidden_states)), \
            shape(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(3, 2))
        if position_bias is None:
            position_bias = self.compute_bias(seq_length, seq_length, scores.device)
        scores += position_bias
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        out = self.o(out.view(batch_size, -1, self.inner_dim))
        return out, position_bias


class T5Encoder(nn.Module):
    def __init__(self, vocab=19, d_model=8, num_layers=2, eps=1e-6, num_buckets=8):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            self.layers.append(nn.ModuleDict({
                "ln": T5LayerNorm(d_model, eps),
                "attn": T5Attention(d_model, num_buckets=num_buckets,
                                    has_relative_attention_bias=(i == 0)),
                "ln_ff": T5LayerNorm(d_model, eps),
                "wi": nn.Linear(d_model, 2 * d_model, bias=False),
                "wo": nn.Linear(2 * d_model, d_model, bias=False),
            }))
        self.final_layer_norm = T5LayerNorm(d_model, eps)

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        position_bias = None
        for layer in self.layers:
            out, position_bias = layer["attn"](layer["ln"](h), position_bias)
            h = h + out
            h = h + layer["wo"](F.relu(layer["wi"](layer["ln_ff"](h))))
        return self.final_layer_norm(h)


# --------------------------------------------------------------------------- LLaMA


@dataclass
class LlamaConfig:
    vocab_size: int = 29
    hidden_size: int = 8
    intermediate_size: int = 12
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=16, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len):
        return (self.cos_cached[:seq_len].to(dtype=x.dtype),
                self.sin_cached[:seq_len].to(dtype=x.dtype))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep: int):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config, use_repeat_interleave=False):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.use_repeat_interleave = use_repeat_interleave
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim,
                                bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim,
                                bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                               config.rope_theta)

    def forward(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary_emb(v, seq_len=q_len)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        if self.use_repeat_interleave:
            k = k.repeat_interleave(self.num_key_value_groups, dim=1)
            v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        else:
            k = repeat_kv(k, self.num_key_value_groups)
            v = repeat_kv(v, self.num_key_value_groups)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, use_repeat_interleave=False):
        super().__init__()
        self.self_attn = LlamaAttention(config, use_repeat_interleave)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config=None, use_repeat_interleave=False):
        super().__init__()
        self.config = config or LlamaConfig()
        c = self.config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(c, use_repeat_interleave)
                                     for _ in range(c.num_hidden_layers)])
        self.norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(seq_length, dtype=torch.long,
                                    device=input_ids.device).unsqueeze(0)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, position_ids)
        logits = self.lm_head(self.norm(h)).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, self.config.vocab_size),
                                   shift_labels.view(-1))
        return {"logits": logits, "loss": loss}


# --------------------------------------------------------------------------- U-Net


class DoubleConv(nn.Module):
    def __init__(self, in_channels, out_channels, mid_channels=None):
        super().__init__()
        mid_channels = mid_channels or out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels), nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.double_conv(x)


class Up(nn.Module):
    def __init__(self, in_channels, out_channels, bilinear=True):
        super().__init__()
        if bilinear:
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        diffY = x2.size()[2] - x1.size()[2]
        diffX = x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diffX // 2, diffX - diffX // 2, diffY // 2, diffY - diffY // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class UNet(nn.Module):
    def __init__(self, n_channels=3, n_classes=2, bilinear=False):
        super().__init__()
        self.bilinear = bilinear
        self.inc = DoubleConv(n_channels, 4)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(4, 8))
        factor = 2 if bilinear else 1
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(8, 16 // factor))
        self.up1 = Up(16, 8 // factor, bilinear)
        self.up2 = Up(8, 4, bilinear)
        self.outc = nn.Conv2d(4, n_classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.outc(x)


class UNetInterp(nn.Module):
    """A decoder that upsamples with F.interpolate to the skip's size (segmentation heads)."""

    def __init__(self, mode="bilinear", align_corners=False):
        super().__init__()
        self.mode = mode
        self.align_corners = align_corners
        self.enc1 = nn.Conv2d(3, 4, 3, padding=1)
        self.enc2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.dec = nn.Conv2d(12, 4, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        s = F.relu(self.enc1(x))
        y = F.relu(self.enc2(s))
        y = F.interpolate(y, size=s.shape[-2:], mode=self.mode,
                          align_corners=self.align_corners if self.mode != "nearest" else None)
        return self.out(F.relu(self.dec(torch.cat([y, s], dim=1))))


# --------------------------------------------------------------------------- Conv-TasNet / wav2vec


class TemporalBlock(nn.Module):
    def __init__(self, channels, hidden, kernel_size, dilation, num_groups=1):
        super().__init__()
        self.conv1x1 = nn.Conv1d(channels, hidden, 1)
        self.prelu1 = nn.PReLU()
        self.norm1 = nn.GroupNorm(num_groups, hidden, eps=1e-8)
        self.dconv = nn.Conv1d(hidden, hidden, kernel_size, dilation=dilation,
                               padding=dilation * (kernel_size - 1) // 2, groups=hidden)
        self.prelu2 = nn.PReLU()
        self.norm2 = nn.GroupNorm(num_groups, hidden, eps=1e-8)
        self.res_out = nn.Conv1d(hidden, channels, 1)

    def forward(self, x):
        y = self.norm1(self.prelu1(self.conv1x1(x)))
        y = self.norm2(self.prelu2(self.dconv(y)))
        return x + self.res_out(y)


class ConvTasNet(nn.Module):
    def __init__(self, enc_dim=8, hidden=12, num_blocks=3, kernel_size=3, num_spk=2):
        super().__init__()
        self.num_spk = num_spk
        self.enc_dim = enc_dim
        self.encoder = nn.Conv1d(1, enc_dim, 4, stride=2, bias=False)
        self.ln = nn.GroupNorm(1, enc_dim, eps=1e-8)
        self.tcn = nn.ModuleList([TemporalBlock(enc_dim, hidden, kernel_size, 2 ** i)
                                  for i in range(num_blocks)])
        self.mask = nn.Conv1d(enc_dim, enc_dim * num_spk, 1)
        self.decoder = nn.ConvTranspose1d(enc_dim, 1, 4, stride=2, bias=False)

    def forward(self, input):
        batch = input.size(0)
        enc = self.encoder(input.unsqueeze(1))
        x = self.ln(enc)
        for block in self.tcn:
            x = block(x)
        masks = torch.sigmoid(self.mask(x)).view(batch, self.num_spk, self.enc_dim, -1)
        masked = enc.unsqueeze(1) * masks
        out = self.decoder(masked.view(batch * self.num_spk, self.enc_dim, -1))
        return out.view(batch, self.num_spk, -1)


class Wav2Vec2FeatureEncoder(nn.Module):
    def __init__(self, conv_dim=(8, 8, 8), conv_kernel=(5, 3, 3), conv_stride=(3, 2, 2),
                 feat_proj_dropout=0.0, gradient_checkpointing=False):
        super().__init__()
        layers = []
        in_ch = 1
        for i, (d, k, s) in enumerate(zip(conv_dim, conv_kernel, conv_stride)):
            layer = nn.ModuleDict({"conv": nn.Conv1d(in_ch, d, k, s, bias=False)})
            if i == 0:
                layer["layer_norm"] = nn.GroupNorm(d, d, affine=True)
            layers.append(layer)
            in_ch = d
        self.conv_layers = nn.ModuleList(layers)
        self.layer_norm = nn.LayerNorm(conv_dim[-1])
        self.projection = nn.Linear(conv_dim[-1], 8)
        self.dropout = nn.Dropout(feat_proj_dropout)
        self.gradient_checkpointing = gradient_checkpointing

    def _conv(self, layer, h):
        h = layer["conv"](h)
        if "layer_norm" in layer:
            h = layer["layer_norm"](h)
        return F.gelu(h)

    def forward(self, input_values):
        h = input_values[:, None]
        for layer in self.conv_layers:
            if self.gradient_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(self._conv, layer, h, use_reentrant=False)
            else:
                h = self._conv(layer, h)
        h = h.transpose(1, 2)
        return self.dropout(self.projection(self.layer_norm(h)))


# --------------------------------------------------------------------------- state in forward


class RunningNormalizer(nn.Module):
    """RL-style observation normalizer: running mean/var buffers updated in forward."""

    def __init__(self, dim=6, momentum=0.01, clip=5.0):
        super().__init__()
        self.momentum = momentum
        self.clip = clip
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(0, dtype=torch.long))
        self.net = nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                mean = x.mean(0)
                var = x.var(0, unbiased=False)
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
                self.count += 1
        x = (x - self.running_mean) / torch.sqrt(self.running_var + 1e-8)
        return self.net(x.clamp(-self.clip, self.clip))


class ParamListHeads(nn.Module):
    """Multi-head output with nn.ParameterList / ParameterDict (per-task heads)."""

    def __init__(self, dim=6, tasks=("a", "b"), temperature=1.0):
        super().__init__()
        self.temperature = temperature
        self.body = nn.Linear(dim, 8)
        self.head_w = nn.ParameterList([nn.Parameter(torch.randn(3, 8) * 0.1) for _ in tasks])
        self.head_b = nn.ParameterDict({t: nn.Parameter(torch.zeros(3)) for t in tasks})
        self.tasks = list(tasks)

    def forward(self, x):
        h = F.relu(self.body(x))
        return {t: F.linear(h, w, self.head_b[t]) / self.temperature
                for t, w in zip(self.tasks, self.head_w)}


class WeightNormNet(nn.Module):
    def __init__(self, dim=6, spectral=False, new_api=True):
        super().__init__()
        if new_api:
            from torch.nn.utils import parametrizations as P
            self.fc1 = P.weight_norm(nn.Linear(dim, 8))
            self.fc2 = P.spectral_norm(nn.Linear(8, 3)) if spectral else nn.Linear(8, 3)
        else:
            self.fc1 = nn.utils.weight_norm(nn.Linear(dim, 8))
            self.fc2 = nn.utils.spectral_norm(nn.Linear(8, 3)) if spectral else nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class CheckpointedMLP(nn.Module):
    def __init__(self, dim=6, depth=3, use_reentrant=False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.GELU())
                                     for _ in range(depth)])
        self.use_reentrant = use_reentrant
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=self.use_reentrant)
        return self.head(x)
