"""The reference backend: the contract of :mod:`.base` in plain torch, op for op what the others must match.

Every op is exact (bit manipulation, multiplication by the scale, IEEE division by the scale), which
is what lets torch.compile and the Triton kernel agree with it bit for bit. These functions run under torch.compile
on every supported torch (2.11 to 2.13): a result is built with ``FakeQuantResult(...)``, never ``_replace`` (which
torch 2.11's dynamo fails on). A compiler whose division is not
IEEE's (inductor's Triton code on CUDA divides approximately) compiles :func:`quantize_to_grid` and
:func:`decode_grid`, which hold no division, and divides with :func:`divide_by_scale` in plain torch.
"""

from __future__ import annotations

import math

import torch

from ..formats import get_format
from .base import FakeQuantResult


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, max_val: float, clip_threshold: float, fmt_name: str,
                  want_codes: bool, noise: torch.Tensor | None, grid: bool = False,
                  whatif_scales: torch.Tensor | None = None) -> FakeQuantResult:
    result = quantize_to_grid(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, whatif_scales)
    if grid:  # built with the constructor, not ``_replace``: torch 2.11's dynamo cannot compile ``_replace``
        return FakeQuantResult(None, result.amax, result.clipped, result.codes, result.grid.to(x.dtype), result.whatif)
    return divide_by_scale(result, scale, x.dtype)


def quantize_to_grid(x: torch.Tensor, scale: torch.Tensor, max_val: float, clip_threshold: float, fmt_name: str,
                     want_codes: bool, noise: torch.Tensor | None,
                     whatif_scales: torch.Tensor | None = None) -> FakeQuantResult:
    """The contract up to the grid values, kept in float32 (``grid``): everything but the division by the scale."""
    fmt = get_format(fmt_name)
    xf = x.float()
    magnitude = xf.abs()
    amax = magnitude.amax()
    scaled = xf * scale
    clipped = (scaled.abs() >= clip_threshold).sum()
    q = fmt.round_f32(scaled.clamp(-max_val, max_val), noise)
    codes = fmt.encode_rounded(q) if want_codes else None
    whatif = None if whatif_scales is None else clipped_under(magnitude, whatif_scales, clip_threshold)
    return FakeQuantResult(None, amax, clipped, codes, q, whatif)


def divide_by_scale(result: FakeQuantResult, scale: torch.Tensor, dtype: torch.dtype) -> FakeQuantResult:
    """:func:`quantize_to_grid`'s result with ``(q / scale).to(dtype)`` as its output, the float32 grid dropped."""
    return FakeQuantResult(dequantized(result.grid, scale, dtype), result.amax, result.clipped, result.codes, None,
                           result.whatif)


def dequantized(grid: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q / scale).to(dtype)`` of grid values ``q``: the contract's one division, in float32."""
    # a CPU scale with a CUDA grid would be divided as a Python number (times its reciprocal): the same device
    return (grid.float() / scale.to(grid.device)).to(dtype)


def whatif_counts(x: torch.Tensor, scales: torch.Tensor, clip_threshold: float) -> torch.Tensor:
    """:func:`clipped_under` of ``x`` (the what-if counts of ``fake_quantize``, for a backend that counts them apart)."""
    return clipped_under(x.float().abs(), scales, clip_threshold)


def clipped_under(magnitude: torch.Tensor, scales: torch.Tensor, clip_threshold: float) -> torch.Tensor:
    """int64 [len(scales)]: the elements of ``magnitude`` (|x| in float32) that each scale would clip (the one
    clipping definition: ``|x| * s >= clip_threshold``; scales are > 0, so ``|x * s| == |x| * s`` exactly)."""
    return torch.stack([(magnitude * scales[k] >= clip_threshold).sum() for k in range(scales.numel())])


def raw_current_scale(amax: torch.Tensor, max_val: float, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_val / amax / 2^margin, whether it is usable: amax > 0 and finite, the scale finite).

    Written as the ops torch runs for it on every device: ``max_val / amax`` is ``amax.reciprocal() * max_val``
    (``Tensor.__rtruediv__``), and the margin a multiplication by ``2^-margin`` (what CUDA makes of a division by a
    Python number; the CPU would divide, an ulp apart for a margin that is not an integer). Each op is correctly
    rounded in plain torch on the CPU and on CUDA, so the scale is the same bits on both; compiled code on CUDA
    (approximate reciprocals) never computes it."""
    scale = amax.reciprocal() * max_val * (2.0**-margin)
    # isfinite's comparisons, written for values known >= 0 (or NaN, which fails every comparison): three small
    # kernels on a GPU, not eleven
    return scale, (amax > 0) & (amax < math.inf) & (scale < math.inf)


def current_scale(amax: torch.Tensor, max_val: float, margin: float, fallback: torch.Tensor,
                  power_2: bool = False) -> torch.Tensor:
    """max_val / amax / 2^margin, rounded down to a power of two with ``power_2`` (exactly: frexp); a zero, NaN or
    inf amax keeps ``fallback`` (never an inf/NaN scale)."""
    scale, ok = raw_current_scale(amax, max_val, margin)
    if power_2:  # scale = m 2^e, m in [0.5, 1): its power-of-two floor is 2^(e - 1)
        scale = torch.ldexp(torch.full_like(scale, 0.5), torch.frexp(torch.where(ok, scale, 1.0)).exponent)
    return torch.where(ok, scale, fallback)


def fake_quantize_current(x: torch.Tensor, fallback_scale: torch.Tensor, max_val: float, clip_threshold: float,
                          margin: float, fmt_name: str, want_codes: bool,
                          noise: torch.Tensor | None, power_2: bool = False,
                          grid: bool = False) -> tuple[FakeQuantResult, torch.Tensor]:
    """Current tensor scaling (CTS): the scale comes from this tensor's own amax (two passes)."""
    amax = amax_of(x)
    scale = current_scale(amax, max_val, margin, fallback_scale, power_2)
    return fake_quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, grid), scale


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| in float32 (NaN propagates): exact however it is reduced."""
    return x.float().abs().amax()


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor | None, fmt_name: str, dtype: torch.dtype) -> torch.Tensor:
    """``decode(codes) / scale`` in ``dtype``; with ``scale=None`` the grid values themselves (exact in any float)."""
    values = decode_grid(codes, fmt_name)
    return values.to(dtype) if scale is None else dequantized(values, scale, dtype)


def decode_grid(codes: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """uint8 codes -> their grid values in float32 (no division)."""
    return get_format(fmt_name).decode(codes, torch.float32)


class ReferenceBackend:
    name = "reference"

    def quantize(self, *args) -> FakeQuantResult:
        return fake_quantize(*args)

    def quantize_current(self, *args) -> tuple[FakeQuantResult, torch.Tensor]:
        return fake_quantize_current(*args)

    def dequantize(self, *args) -> torch.Tensor:
        return dequantize_codes(*args)
