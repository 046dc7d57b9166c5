"""Random draws of the fused graph: dropout and its Bernoulli masks.

::

    before:  dropout(x_n, p_n)                     for n in 0..N-1
    after:   x * bernoulli_mask(shape, 1 - p) / (1 - p)     one draw for all N models

A fused op that draws random numbers draws them here, so where the draws come from
is one module (each model's stream differs from its solo run's: see docs/API.md).
``per_model_dropout`` takes one rate per model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .per_model import scalars, values_on


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout`` on N models' stacked activations: every element its own draw, so each
    model its own mask; the same values, scale and gradient as ``F.dropout``.

    On the CPU the keep mask is drawn by :func:`bernoulli_mask` instead of ATen's
    sampler; elsewhere (CUDA's fused dropout kernel is fast) it is ``F.dropout``::

        ATen:  noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise
        here:  noise = bernoulli_mask(x.shape, 1 - p, x);  noise.div_(1 - p); x * noise

    It takes about half ``F.dropout``'s time, and the float mask's ``div_`` beats a
    ``torch.where`` of a bool mask (docs/DESIGN_NOTES.md).  The masks are random either
    way: the fused models' masks never were the loop's draws.
    """
    if not training or p == 0 or x.numel() == 0:
        if not 0 <= p <= 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        return x
    if x.device.type != "cpu" or not x.is_floating_point() or not 0 < p <= 1:
        return F.dropout(x, p, training, inplace)
    if p == 1:  # ATen: x times a zero (NaN stays NaN)
        zero = x.new_zeros(())
        return x.mul_(zero) if inplace else x * zero
    noise = bernoulli_mask(x.shape, 1 - p, x).div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


#: :func:`bernoulli_mask`'s resolution: each element keeps with probability ``t / 2**31``.
_MASK_BITS = 31
#: Each element's 31 bits as a leading byte, then (only where that byte ties the
#: threshold's) 23 more (:func:`_kept`).
_REST_BITS = _MASK_BITS - 8


def bernoulli_mask(shape: Sequence[int], keep: float | Tensor, like: Tensor,
                   scale: Tensor | None = None) -> Tensor:
    """A ``{0, 1}`` tensor of ``like``'s dtype and device, each element 1 with probability
    ``keep`` (a float, or a tensor that broadcasts to ``shape``: one per model); with
    ``scale`` (a tensor broadcasting to ``shape``), ``scale`` where 1: ``mask * scale``'s
    values in one pass.

    On the CPU: each element is kept where a uniform 31-bit integer is below
    ``round(keep * 2**31)`` (:func:`_keep_mask`; the default generator, so
    ``torch.manual_seed`` reproduces the draws): ``keep`` exact to 2**-31, the
    resolution of ATen's own MKL sampler (MCG31).  ATen's ``bernoulli_`` costs ~7 ns an
    element on one core of the Xeon, a ``random_`` draw ~2.5 ns, and :func:`_keep_mask`
    makes a quarter of a draw an element: a Transformer's dropout masks were a quarter
    of its training step.  Elsewhere: ``torch.bernoulli``.
    """
    if like.device.type != "cpu":
        if isinstance(keep, Tensor):
            mask = torch.bernoulli(keep.to(like.dtype).expand(shape))
        else:
            mask = torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep)
        return mask if scale is None else mask.mul_(scale)
    if not isinstance(keep, Tensor) and round(keep * 2**_MASK_BITS) >= 2**_MASK_BITS \
            and scale is None:
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    return _keep_mask(shape, _Threshold.of(keep, shape, scale), like)


class _Threshold(NamedTuple):
    """``keep`` as :func:`_keep_mask` compares with it, made once per rate (a per-model
    dropout's rates are its program's constants)::

        t     = round(keep * 2**31)                    in [0, 2**31]
        lead  = min(t >> 23, 255)                      (uint8, broadcasting to the mask)
        rest  = t - lead * 2**23                       (for the ties: 1 element in 256)

    ``per_model``: ``keep`` holds one rate per model, ``[N, 1, ..., 1]`` of a mask
    ``[N, ...]``, and ``rest`` / ``tie_scale`` are flat ``[N]``, read at a tie's model
    ``tie // (numel / N)`` (else a tie's broadcast position, torch.unravel_index).
    ``scale``: the mask's value where kept (None: 1)."""

    lead: int | Tensor
    rest: int | Tensor
    scale: Tensor | None
    tie_scale: Tensor | None
    per_model: bool

    @staticmethod
    def of(keep: float | Tensor, shape: Sequence[int], scale: Tensor | None) -> _Threshold:
        if not isinstance(keep, Tensor):
            t = round(keep * 2**_MASK_BITS)
            lead = min(t >> _REST_BITS, 255)
            return _Threshold(lead, t - lead * 2**_REST_BITS, scale, scale, False)
        t = (keep.double() * 2**_MASK_BITS).round().long()
        lead = (t >> _REST_BITS).clamp_(max=255)
        rest = t - lead * 2**_REST_BITS
        if _one_per_model(keep, shape) and (scale is None or _one_per_model(scale, shape)):
            return _Threshold(lead.to(torch.uint8), rest.reshape(-1), scale,
                              None if scale is None else scale.reshape(-1), True)
        return _Threshold(lead.to(torch.uint8), rest, scale, scale, False)


def _one_per_model(values: Tensor, shape: Sequence[int]) -> bool:
    """Is ``values`` ``[N, 1, ..., 1]`` for a mask ``[N, ...]`` (one value per model)?"""
    return (len(shape) > 0 and values.dim() == len(shape) and values.shape[0] == shape[0]
            and values.numel() == shape[0])


def _keep_mask(shape: Sequence[int], threshold: _Threshold, like: Tensor) -> Tensor:
    """``[*shape]`` of ``like``'s dtype: 1 (or ``threshold.scale``) where each element's
    uniform 31-bit integer ``v`` is below its threshold ``t`` (:class:`_Threshold`), else 0.

    ``v`` is drawn a byte first: ``v = lead * 2**23 + rest``, so ``v < t`` is ``lead <
    t_lead``, or ``lead == t_lead`` and ``rest < t_rest``::

        lead  = the bytes of full-range int64 random_ draws, 8 a draw
        mask  = lead < t_lead                        (written as floats: vectorized)
        ties  = lead == t_lead                       (1 element in 256)
        mask[ties] = rest < t_rest,  rest: the low 23 bits of an int32 random_() each

    (``t_lead = min(t >> 23, 255)``, ``t_rest = t - t_lead * 2**23``: ``t = 2**31`` is
    ``255, 2**23``.)  Exactly the distribution of one 31-bit draw an element, each
    element its own draws, for a quarter of the generator's work: a CPU ``random_``
    makes a generator call an element (two for 64 bits) whatever its dtype.  The demo
    CNN's [16, 32, 256] mask: 470 -> ~130 us (one core, docs/DESIGN_NOTES.md).
    """
    numel, device = math.prod(shape), like.device
    words = torch.empty(-(-numel // 8), dtype=torch.int64, device=device)
    words.random_(-2**63, None)  # every bit uniform (random_() leaves the top bit 0)
    lead = words.view(torch.uint8)[:numel].view(shape)
    # comparisons written into float / uint8 outputs run vectorized, into bool not (5x)
    mask = torch.lt(lead, threshold.lead, out=torch.empty(shape, dtype=like.dtype,
                                                          device=device))
    if threshold.scale is not None:
        mask.mul_(threshold.scale)
    flags = torch.empty(words.numel() * 8, dtype=torch.uint8, device=device)
    if numel % 8:  # (the last word's unused bytes: read by _flagged as whole words)
        flags[numel:].zero_()
    torch.eq(lead, threshold.lead, out=flags[:numel].view(shape))
    ties = _flagged(flags)
    if not ties.numel():
        return mask
    rest = torch.empty(ties.numel(), dtype=torch.int32, device=device).random_()
    rest = rest.bitwise_and_(2**_REST_BITS - 1)
    t_rest, tie_scale = threshold.rest, threshold.tie_scale
    if threshold.per_model:  # a tie's model
        at = torch.div(ties, numel // shape[0], rounding_mode="floor")
    elif isinstance(t_rest, Tensor) or tie_scale is not None:  # its broadcast position
        at = torch.unravel_index(ties, tuple(shape))
        t_rest = t_rest.expand(shape) if isinstance(t_rest, Tensor) else t_rest
        tie_scale = None if tie_scale is None else tie_scale.expand(shape)
    below = rest < (t_rest[at] if isinstance(t_rest, Tensor) else t_rest)
    kept = below.to(like.dtype) if tie_scale is None else torch.where(
        below, tie_scale[at], 0).to(like.dtype)
    mask.view(-1)[ties] = kept
    return mask


def _flagged(flags: Tensor) -> Tensor:
    """The positions of the nonzero bytes of ``flags`` (uint8, a multiple of 8 long), in
    order: the nonzero int64 words first, then their bytes (``nonzero`` of a whole bool
    mask costs ~10x a vectorized pass; the flags are rare)."""
    hit = flags.view(torch.int64).nonzero().view(-1)
    if not hit.numel():
        return hit
    at = flags.view(-1, 8)[hit].nonzero()
    return hit[at[:, 0]] * 8 + at[:, 1]


def per_model_dropout(x: Tensor, p: Sequence[float], training: bool, *,
                      feature_dims: int = 0) -> Tensor:
    """Per-model dropout rates; ``feature_dims`` > 0 drops whole channels (Dropout1d/2d/3d)::

        keep  = 1 - p                 [N, 1, ..., 1], x's dtype (x * p's promotion)
        scale = 1 / keep, 0 where keep is 0
        x * (mask * scale)            one pass over x forward and backward: mask is 0 or
                                      1, so the values are x * mask * scale's bit for bit

    The rates are the program's constants: on the CPU their thresholds and scales are
    made once (:func:`_rates`), not at every call (a dozen small ops, half the kernel's
    time on an MLP's [16, 32, 128] activations)."""
    if not training:
        return x
    mask_shape = list(x.shape)
    for d in range(feature_dims):
        mask_shape[-1 - d] = 1
    if x.device.type != "cpu":
        keep, scale = _keep_and_scale(p, x)
        return x * bernoulli_mask(mask_shape, keep, x, scale)
    return x * _keep_mask(mask_shape, _rates(p, x, mask_shape), x)


def _keep_and_scale(p: Sequence[float], x: Tensor) -> tuple[Tensor, Tensor]:
    keep = 1 - scalars(p, x, x.dim() - 1)
    return keep, torch.where(keep > 0, 1 / keep.clamp_min(torch.finfo(keep.dtype).tiny), 0)


#: :func:`_rates`' thresholds, cleared when full (a rate scheduled to change every
#: call must not grow it without bound).
_RATES: dict[tuple, _Threshold] = {}
_RATES_MAX = 256


def _rates(p: Sequence[float], x: Tensor, mask_shape: Sequence[int]) -> _Threshold:
    """Per-model dropout's :class:`_Threshold` for rates ``p`` on ``x``, made once per
    (rates, dtype, device, mask shape's rank and N).  Callers never write into it."""
    key = (tuple(p), x.dtype, x.device, len(mask_shape), mask_shape[0])
    threshold = _RATES.get(key)
    if threshold is None:
        if len(_RATES) >= _RATES_MAX:
            _RATES.clear()
        keep, scale = _keep_and_scale(p, x)
        threshold = _RATES[key] = _Threshold.of(keep, mask_shape, scale)
    return threshold


def per_model_bernoulli_(x: Tensor, p: Sequence[float]) -> Tensor:
    """``x_n.bernoulli_(p_n)`` for each model n's slice of the stacked ``[N, ...]`` x, in
    place (timm's ``drop_path`` draws its mask so, at each model's own rate)."""
    keep = values_on(list(p), torch.float64, x.device).reshape(len(p), *[1] * (x.dim() - 1))
    return x.copy_(bernoulli_mask(x.shape, keep, x))


def stochastic_depth(x: Tensor, p: Sequence[float], mode: str) -> Tensor:
    """torchvision's ``stochastic_depth(x_n, p_n, mode, training=True)`` on N models'
    stacked ``[N, B, ...]`` values, model n at rate ``p[n]``::

        torchvision, per model:  noise = empty([B, 1, ...] or [1, ...]).bernoulli_(1 - p)
                                 noise.div_(1 - p); x * noise
        here, all models:        noise = bernoulli_mask([N, B, 1, ...] or [N, 1, ...], 1 - p)
                                 noise * (each model's 1 / (1 - p)); x * noise

    ``mode="row"``: each sample of each model its own draw; ``"batch"``: one per model.
    A kept element is ``x`` times torchvision's scale bit for bit (the scale is made by
    the same ``div_``), and the gradient goes through the same noise.
    """
    n, rank = x.shape[0], x.dim() - 1
    size = [n, x.shape[1]] + [1] * (rank - 1) if mode == "row" else [n] + [1] * rank
    survival = [1.0 - q for q in p]
    keep = torch.tensor(survival, dtype=torch.float64).reshape(n, *[1] * rank)
    noise = bernoulli_mask(size, keep, x)
    # torchvision divides the {0, 1} noise by the Python float 1 - p in x's dtype; p = 1
    # leaves it all zeros.
    scales = {s: x.new_ones(1).div_(s) if s > 0 else x.new_zeros(1) for s in set(survival)}
    scale = torch.cat([scales[s] for s in survival]).reshape(n, *[1] * rank)
    return x * noise.mul_(scale)
