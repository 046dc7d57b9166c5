"""Fused attention kernels: N models' heads are one batch of ``N*B*H`` attention problems.

Logical layout as everywhere: ``[N, *per_model_shape]``.  Projections go through
:func:`~hftc.lowering.runtime.linear.linear` (one ``baddbmm``; a shared input is broadcast
over the models, or is one GEMM with ``N*3E`` outputs); the attention core folds the
model dim into the batch of heads, so one ``bmm``/softmax/``bmm`` (or one
``scaled_dot_product_attention``) serves every model::

    per model:  q, k, v = in_proj(x)            [L, B, E]
                q -> [B*H, L, hd]; softmax(q k^T + mask) v; out_proj
    fused:      q, k, v = baddbmm(x, W_in^T)    [N, L, B, E]
                q -> [N*B*H, L, hd]; one bmm/softmax/bmm over N*B*H; baddbmm out_proj

Each kernel mirrors the slow path of its PyTorch original step by step
(``F.multi_head_attention_forward``, the nested-tensor fast path of
``nn.TransformerEncoder``), so float64 results agree to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import expand_models, pad_model_dims
from .linear import linear
from .random import dropout as dropout_kernel


def _models(x: Tensor, n: int, batched: bool) -> Tensor:
    return x if batched else expand_models(x, n)


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
    enable_gqa: bool = False, *, n: int, flags: tuple[bool, bool, bool, bool],
) -> Tensor:
    """Per-model ``F.scaled_dot_product_attention`` as one call over ``N*B`` batches.

    ``flags`` marks query, key, value and mask.  Per-model operands ``[*lead, L, E]``
    become ``[N*lead0, *lead[1:], L, E]``; the mask is broadcast per model first
    (a shared ``[B, 1, L, S]`` mask must repeat for each model, not tile the batch).
    """
    q, k, v = (_models(t, n, b) for t, b in zip((query, key, value), flags))
    # The operands' leading dims broadcast, as in torch ([B, H, L, E] queries with a
    # [1, H, S, E] or [S, E] key): each gets the same per-model rank, its missing dims
    # after the model dim, and the same first lead dim before it is folded into the
    # model dim (a [N, S, E] key folded as [N*S, E] attended over every model's keys).
    rank = max(t.dim() for t in (q, k, v)) - 1
    q, k, v = (pad_model_dims(t, rank) for t in (q, k, v))
    mask = attn_mask
    if mask is not None:
        mask = mask if flags[3] else mask.unsqueeze(0)
        mask = pad_model_dims(mask, rank)
    if rank >= 3:
        # (With enable_gqa and 3-d operands the first lead dim is the heads, which may
        # differ: key heads divide query heads.)
        lead = q.shape[1] if enable_gqa and rank == 3 else max(t.shape[1] for t in (q, k, v))
        q, k, v = (t if t.shape[1] == lead or (enable_gqa and rank == 3)
                   else t.expand(n, lead, *t.shape[2:]) for t in (q, k, v))
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        if mask is not None:
            mask = mask.expand(n, lead, *mask.shape[2:]).flatten(0, 1)
    elif mask is not None:
        mask = mask.expand(n, *mask.shape[1:])
    y = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                       enable_gqa=enable_gqa)
    return y.unflatten(0, (n, -1)) if rank >= 3 else y


def _seq_first(x: Tensor, batched: bool, batch_first: bool, unbatched: bool) -> Tensor:
    """A per-model ``[B, L, E]`` (batch_first) or ``[L, E]`` (unbatched) input as ``[L, B, E]``."""
    if unbatched:
        return x.unsqueeze(1 + int(batched))
    if batch_first:
        return x.transpose(int(batched), int(batched) + 1)
    return x


def multi_head_attention(
    query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
    attn_mask: Tensor | None, in_proj_weight: Tensor | None, in_proj_bias: Tensor | None,
    q_proj_weight: Tensor | None, k_proj_weight: Tensor | None, v_proj_weight: Tensor | None,
    bias_k: Tensor | None, bias_v: Tensor | None, out_proj_weight: Tensor,
    out_proj_bias: Tensor | None, training: bool, *, num_heads: int, dropout: float,
    batch_first: bool, add_zero_attn: bool, need_weights: bool, average_attn_weights: bool,
    is_causal: bool, flags: tuple[bool, bool, bool, bool, bool], self_attention: bool,
) -> tuple[Tensor, Tensor | None]:
    """N ``nn.MultiheadAttention`` modules as one (``F.multi_head_attention_forward``'s math).

    ``flags`` marks query, key, value, key_padding_mask and attn_mask (a shared
    operand has no model dim); ``self_attention`` says query, key and value are
    one tensor, whose projection is then one GEMM for q, k and v together.
    Parameters are stacked ``[N, ...]``.  Returns ``(out [N, ...], weights or None)``.

    The steps, as torch's: inputs as ``[L, B, E]`` per model, in-projection to
    ``[N, L, B, E]``, masks per model, ``bias_k``/``bias_v`` appended, heads split to
    ``[N*B*H, L, hd]``, zero attention appended, one merged mask, the attention core over
    all ``N*B*H`` heads, out-projection, the caller's layout.
    """
    qb, kb, vb, kpm_b, mask_b = flags
    n, embed_dim = out_proj_weight.shape[0], out_proj_weight.shape[1]
    unbatched = query.dim() - qb == 2
    key_padding_mask, attn_mask = _canonical_masks(key_padding_mask, attn_mask, query.dtype)
    query = _seq_first(query, qb, batch_first, unbatched)
    key = _seq_first(key, kb, batch_first, unbatched)
    value = _seq_first(value, vb, batch_first, unbatched)
    if unbatched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(int(kpm_b))
    tgt_len, bsz = query.shape[qb], query.shape[qb + 1]
    attn_mask, is_causal = _causal_hint(attn_mask, key_padding_mask, is_causal, need_weights)

    q, k, v = _in_projection(query, key, value, in_proj_weight, in_proj_bias, q_proj_weight,
                             k_proj_weight, v_proj_weight, batched=(qb, kb, vb),
                             self_attention=self_attention)
    attn_mask, key_padding_mask = _masks_per_model(attn_mask, key_padding_mask, mask_b, kpm_b)
    if bias_k is not None and bias_v is not None:
        k, v, attn_mask, key_padding_mask = _append_bias_kv(
            k, v, bias_k, bias_v, attn_mask, key_padding_mask, n=n, bsz=bsz, embed_dim=embed_dim)
    head_dim = embed_dim // num_heads
    q, k, v = (_split_heads(t, n=n, bsz=bsz, num_heads=num_heads, head_dim=head_dim)
               for t in (q, k, v))
    if add_zero_attn:
        k, v, attn_mask, key_padding_mask = _append_zero_attention(k, v, attn_mask,
                                                                   key_padding_mask)
    src_len = k.shape[1]
    mask = _merged_mask(attn_mask, key_padding_mask, n=n, bsz=bsz, num_heads=num_heads,
                        src_len=src_len)
    dropout_p = dropout if training else 0.0

    shape = dict(n=n, bsz=bsz, num_heads=num_heads, tgt_len=tgt_len, src_len=src_len,
                 head_dim=head_dim, embed_dim=embed_dim)
    if need_weights:
        out, weights = _attention_with_weights(q, k, v, mask, dropout_p,
                                               average=average_attn_weights, **shape)
    else:
        out, weights = _attention_core(q, k, v, mask, dropout_p, is_causal, **shape), None
    out = linear(out, out_proj_weight, out_proj_bias, x_batched=True)
    return _callers_layout(out, weights, unbatched=unbatched, batch_first=batch_first)


def _canonical_masks(key_padding_mask: Tensor | None, attn_mask: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """Boolean masks as additive float masks of the query's dtype (torch's
    ``F._canonical_mask``, with its checks)."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                  other_name="", target_type=dtype, check_other=False)
    return key_padding_mask, attn_mask


def _causal_hint(attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool,
                 need_weights: bool) -> tuple[Tensor | None, bool]:
    """``is_causal`` as ``F.multi_head_attention_forward`` reads it: the mask is still
    required; it is dropped for SDPA's own causal path where nothing else needs it, and
    the hint is dropped where a key padding mask is merged in."""
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    elif key_padding_mask is not None:
        is_causal = False
    return attn_mask, is_causal


def _in_projection(query: Tensor, key: Tensor, value: Tensor, in_proj_weight: Tensor | None,
                   in_proj_bias: Tensor | None, q_proj_weight: Tensor | None,
                   k_proj_weight: Tensor | None, v_proj_weight: Tensor | None, *,
                   batched: tuple[bool, bool, bool],
                   self_attention: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v, ``[N, L, B, E]`` each: one GEMM for all three where query, key and
    value are one tensor, else one per projection (packed or separate weights)."""
    qb, kb, vb = batched
    if in_proj_weight is not None and self_attention:
        qkv = linear(query, in_proj_weight, in_proj_bias, x_batched=qb)
        q, k, v = qkv.chunk(3, dim=-1)
        return q, k, v
    if in_proj_weight is not None:
        wq, wk, wv = in_proj_weight.chunk(3, dim=1)
    else:
        wq, wk, wv = q_proj_weight, k_proj_weight, v_proj_weight
    bq = bk = bv = None
    if in_proj_bias is not None:
        bq, bk, bv = in_proj_bias.chunk(3, dim=1)
    return (linear(query, wq, bq, x_batched=qb), linear(key, wk, bk, x_batched=kb),
            linear(value, wv, bv, x_batched=vb))


def _masks_per_model(attn_mask: Tensor | None, key_padding_mask: Tensor | None,
                     mask_batched: bool,
                     kpm_batched: bool) -> tuple[Tensor | None, Tensor | None]:
    """Both masks with a model dim (1 where shared): attn ``[N|1, 1|B*H, L, S]``, key
    padding ``[N|1, B, S]``."""
    if attn_mask is not None:
        attn_mask = attn_mask if mask_batched else attn_mask.unsqueeze(0)
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
    if key_padding_mask is not None and not kpm_batched:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    return attn_mask, key_padding_mask


def _pad_masks(attn_mask: Tensor | None,
               key_padding_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Both masks with one more key position, not masked (for an appended key)."""
    if attn_mask is not None:
        attn_mask = F.pad(attn_mask, (0, 1))
    if key_padding_mask is not None:
        key_padding_mask = F.pad(key_padding_mask, (0, 1))
    return attn_mask, key_padding_mask


def _append_bias_kv(k: Tensor, v: Tensor, bias_k: Tensor, bias_v: Tensor,
                    attn_mask: Tensor | None, key_padding_mask: Tensor | None, *, n: int,
                    bsz: int, embed_dim: int) -> tuple:
    """Each model's ``bias_k`` / ``bias_v`` as one more key and value position."""
    k = torch.cat([k, bias_k.reshape(n, 1, 1, embed_dim).expand(n, 1, bsz, embed_dim)], 1)
    v = torch.cat([v, bias_v.reshape(n, 1, 1, embed_dim).expand(n, 1, bsz, embed_dim)], 1)
    return (k, v, *_pad_masks(attn_mask, key_padding_mask))


def _split_heads(t: Tensor, *, n: int, bsz: int, num_heads: int, head_dim: int) -> Tensor:
    """``[N, L, B, E]`` -> ``[N*B*H, L, hd]``: every model's heads one batch."""
    length = t.shape[1]
    return t.reshape(n, length, bsz * num_heads, head_dim).transpose(1, 2).reshape(
        n * bsz * num_heads, length, head_dim)


def _append_zero_attention(k: Tensor, v: Tensor, attn_mask: Tensor | None,
                           key_padding_mask: Tensor | None) -> tuple:
    """``add_zero_attn``: a zero key and value appended to every head."""
    zeros = torch.zeros((k.shape[0], 1, k.shape[2]), dtype=k.dtype, device=k.device)
    k = torch.cat([k, zeros], dim=1)
    v = torch.cat([v, zeros], dim=1)
    return (k, v, *_pad_masks(attn_mask, key_padding_mask))


def _merged_mask(attn_mask: Tensor | None, key_padding_mask: Tensor | None, *, n: int,
                 bsz: int, num_heads: int, src_len: int) -> Tensor | None:
    """The attention and key padding masks as one additive ``[N*B*H, L|1, S]`` mask."""
    mask = attn_mask
    if key_padding_mask is not None:
        kpm = key_padding_mask.reshape(key_padding_mask.shape[0], bsz, 1, 1, src_len).expand(
            -1, -1, num_heads, -1, -1).reshape(key_padding_mask.shape[0], bsz * num_heads, 1,
                                               src_len)
        mask = kpm if mask is None else mask + kpm
    if mask is not None:
        mask = mask.expand(n, bsz * num_heads, *mask.shape[2:]).reshape(
            n * bsz * num_heads, mask.shape[2], src_len)
    return mask


def _attention_with_weights(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                            dropout_p: float, *, average: bool, n: int, bsz: int,
                            num_heads: int, tgt_len: int, src_len: int, head_dim: int,
                            embed_dim: int) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(hd) + mask) v written out, for the weights the caller wants:
    ``(out [N, L, B, E], weights [N, B, (H,) L, S])``."""
    q_scaled = q * math.sqrt(1.0 / float(head_dim))
    if mask is not None:
        weights = torch.baddbmm(mask, q_scaled, k.transpose(-2, -1))
    else:
        weights = torch.bmm(q_scaled, k.transpose(-2, -1))
    weights = F.softmax(weights, dim=-1)
    if dropout_p > 0.0:
        weights = dropout_kernel(weights, dropout_p)
    out = torch.bmm(weights, v)  # [N*B*H, L, hd]
    out = out.reshape(n, bsz * num_heads, tgt_len, head_dim).transpose(1, 2).reshape(
        n, tgt_len, bsz, embed_dim)
    weights = weights.reshape(n, bsz, num_heads, tgt_len, src_len)
    if average:
        weights = weights.mean(dim=2)
    return out, weights


def _attention_core(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float,
                    is_causal: bool, *, n: int, bsz: int, num_heads: int, tgt_len: int,
                    src_len: int, head_dim: int, embed_dim: int) -> Tensor:
    """One ``F.scaled_dot_product_attention`` over every model's heads: ``[N, L, B, E]``."""
    if mask is not None:
        mask = mask.reshape(n * bsz, num_heads, mask.shape[1], src_len)
    out = F.scaled_dot_product_attention(
        q.reshape(n * bsz, num_heads, tgt_len, head_dim),
        k.reshape(n * bsz, num_heads, src_len, head_dim),
        v.reshape(n * bsz, num_heads, src_len, head_dim), mask, dropout_p, is_causal)
    return out.reshape(n, bsz, num_heads, tgt_len, head_dim).permute(0, 3, 1, 2, 4).reshape(
        n, tgt_len, bsz, embed_dim)


def _callers_layout(out: Tensor, weights: Tensor | None, *, unbatched: bool,
                    batch_first: bool) -> tuple[Tensor, Tensor | None]:
    """``[N, L, B, E]`` back to the caller's layout (``[N, L, E]`` unbatched, ``[N, B, L,
    E]`` batch-first)."""
    if unbatched:
        out = out.squeeze(2)
        if weights is not None:
            weights = weights.squeeze(1)
    elif batch_first:
        out = out.transpose(1, 2)
    return out, weights


def encoder_nested_padding(
    output: Tensor, src: Tensor, key_padding_mask: Tensor | None, mask: Tensor | None,
    training: bool, *params: Tensor, use_nested_tensor: bool, mask_check: bool,
    batch_first: bool, flags: tuple[bool, bool, bool], n: int,
) -> Tensor:
    """``nn.TransformerEncoder``'s nested-tensor fast path, made explicit.

    In eval mode without autograd and with a ``src_key_padding_mask``, the encoder
    runs its layers on a nested tensor and pads the result back with zeros: the
    output at padded positions is 0, not what the layers compute there.  The fused
    encoder computes the layers densely (equal at every real position) and zeroes
    the padded positions of each model whose original would have taken that path,
    checking the same conditions at run time.  ``params`` are the first layer's
    tensors (any requiring grad under autograd blocks the path, as in PyTorch).
    """
    out_b, src_b, kpm_b = flags
    if not out_b:
        output = expand_models(output, n)
    if (key_padding_mask is None or mask is not None or training or not use_nested_tensor
            or not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled()
            or src.dim() - src_b != 3 or src.is_nested):
        return output
    if torch.is_grad_enabled() and any(t.requires_grad for t in (src, *params)):
        return output
    supported = ["cpu", "cuda", "xpu", "mps",
                 torch.utils.backend_registration._privateuse1_backend_name]
    if src.device.type not in supported:
        return output
    if key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask.bool() if not key_padding_mask.is_floating_point() \
            else key_padding_mask != 0
    keep = torch.ones(n, dtype=torch.bool, device=output.device)
    for i in range(n):
        kpm_i = key_padding_mask[i] if kpm_b else key_padding_mask
        src_i = src[i] if src_b else src
        if mask_check and not torch._nested_tensor_from_mask_left_aligned(
                src_i, kpm_i.logical_not()):
            keep[i] = False
    padded = key_padding_mask if kpm_b else key_padding_mask.unsqueeze(0)  # [N|1, B, S]
    if not batch_first:
        padded = padded.transpose(1, 2)
    zero = padded.unsqueeze(-1) & keep.view(n, 1, 1, 1)
    return output.masked_fill(zero, 0.0)


# --------------------------------------------------------------------------- Swin


def relative_position_bias(table: Tensor, index: Tensor, window_size: Sequence[int], *,
                           index_batched: bool) -> Tensor:
    """torchvision's ``_get_relative_position_bias`` for N models: ``table`` ``[N, R, heads]``,
    ``index`` ``[N, T*T]`` (or shared ``[T*T]``) -> ``[N, 1, heads, T, T]``, one gather."""
    n, tokens = table.shape[0], window_size[0] * window_size[1]
    if index_batched:
        gathered = table[torch.arange(n, device=table.device).unsqueeze(1), index]
    else:
        gathered = table[:, index]
    return gathered.view(n, tokens, tokens, -1).permute(0, 3, 1, 2).contiguous().unsqueeze(1)


def _window_shift_mask(like: Tensor, pad_h: int, pad_w: int, window_size: Sequence[int],
                       shift_size: Sequence[int]) -> Tensor:
    """``[windows, T, T]``: -100 between tokens that came from different regions of the
    rolled map (torchvision's mask, built the same way)."""
    mask = like.new_zeros((pad_h, pad_w))
    h_slices = ((0, -window_size[0]), (-window_size[0], -shift_size[0]), (-shift_size[0], None))
    w_slices = ((0, -window_size[1]), (-window_size[1], -shift_size[1]), (-shift_size[1], None))
    for count, (h, w) in enumerate((h, w) for h in h_slices for w in w_slices):
        mask[h[0]: h[1], w[0]: w[1]] = count
    mask = mask.view(pad_h // window_size[0], window_size[0], pad_w // window_size[1],
                     window_size[1])
    mask = mask.permute(0, 2, 1, 3).reshape(-1, window_size[0] * window_size[1])
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


def shifted_window_attention(
    x: Tensor, qkv_weight: Tensor, proj_weight: Tensor, bias: Tensor,
    window_size: Sequence[int], num_heads: int, shift_size: Sequence[int],
    attention_dropout: float, dropout: float, qkv_bias: Tensor | None,
    proj_bias: Tensor | None, logit_scale: Tensor | None, training: bool, *, x_batched: bool,
) -> Tensor:
    """torchvision's ``shifted_window_attention`` for N models: the windows of every
    model's ``[B, H, W, C]`` map cut at once, the projections as batched products, the
    attention one batched matmul over ``N*B*windows*heads``::

        per model:  pad, roll, windows [B*nW, T, C]; qkv = linear(., W_qkv_i)
                    softmax(q k^T * s + bias_i + shift mask) v; linear(., W_proj_i); back
        fused:      pad, roll, windows [N, B*nW, T, C] (a shared x: [B*nW, T, C], once)
                    qkv = linear(., W_qkv) (baddbmm); one matmul/softmax/matmul over
                    [N, B*nW, heads]; bias [N, 1, heads, T, T]; baddbmm out; back

    ``bias``, the weights and ``logit_scale`` (V2's cosine attention) are ``[N, ...]``;
    dropout draws over the stacked tensors, each model its own mask.
    """
    n = qkv_weight.shape[0]
    height, width, channels = x.shape[-3:]
    wh, ww = window_size
    pad_r, pad_b = (ww - width % ww) % ww, (wh - height % wh) % wh
    x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    pad_h, pad_w = x.shape[-3:-1]
    shift = [0 if wh >= pad_h else shift_size[0], 0 if ww >= pad_w else shift_size[1]]
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(-3, -2))
    lead = x.shape[:-3]  # [N, B] or a shared input's [B]
    windows = (pad_h // wh) * (pad_w // ww)
    x = x.view(*lead, pad_h // wh, wh, pad_w // ww, ww, channels).transpose(-4, -3)
    x = x.reshape(*lead[:-1], lead[-1] * windows, wh * ww, channels)
    if logit_scale is not None and qkv_bias is not None:
        qkv_bias = qkv_bias.clone()
        length = qkv_bias.shape[-1] // 3
        qkv_bias[:, length: 2 * length].zero_()
    qkv = linear(x, qkv_weight, qkv_bias, x_batched=x_batched)  # [N, B*nW, T, 3C]
    rows, tokens = qkv.shape[1:3]
    qkv = qkv.reshape(n, rows, tokens, 3, num_heads, channels // num_heads)
    q, k, v = qkv.permute(3, 0, 1, 4, 2, 5)  # each [N, B*nW, heads, T, hd]
    if logit_scale is not None:
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        scale = torch.clamp(logit_scale, max=math.log(100.0)).exp()
        attn = attn * scale.reshape(n, 1, num_heads, 1, 1)
    else:
        q = q * (channels // num_heads) ** -0.5
        attn = q.matmul(k.transpose(-2, -1))
    attn = attn + bias  # [N, 1, heads, T, T]
    if sum(shift) > 0:
        mask = _window_shift_mask(x, pad_h, pad_w, window_size, shift)
        attn = attn.view(n, rows // windows, windows, num_heads, tokens, tokens)
        attn = (attn + mask.unsqueeze(1)).view(n, rows, num_heads, tokens, tokens)
    attn = dropout_kernel(F.softmax(attn, dim=-1), attention_dropout, training)
    y = attn.matmul(v).transpose(-3, -2).reshape(n, rows, tokens, channels)
    y = dropout_kernel(linear(y, proj_weight, proj_bias, x_batched=True), dropout, training)
    y = y.view(n, rows // windows, pad_h // wh, pad_w // ww, wh, ww, channels)
    y = y.transpose(-4, -3).reshape(n, rows // windows, pad_h, pad_w, channels)
    if sum(shift) > 0:
        y = torch.roll(y, shifts=(shift[0], shift[1]), dims=(-3, -2))
    return y[:, :, :height, :width, :].contiguous()
