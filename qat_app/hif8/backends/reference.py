"""The reference backend: the contract of :mod:`.base` in plain torch, op for op what the others must match.

Every op is exact (bit manipulation, multiplication by the scale, IEEE division by the scale), which
is what lets torch.compile and the Triton kernel agree with it bit for bit.
"""

from __future__ import annotations

import torch

from ..formats import get_format
from .base import FakeQuantResult


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, max_val: float, clip_threshold: float, fmt_name: str,
                  want_codes: bool, noise: torch.Tensor | None) -> FakeQuantResult:
    fmt = get_format(fmt_name)
    xf = x.float()
    amax = xf.abs().amax()
    scaled = xf * scale
    clipped = (scaled.abs() >= clip_threshold).sum()
    q = fmt.round_f32(scaled.clamp(-max_val, max_val), noise)
    dequantized = (q / scale).to(x.dtype)
    codes = fmt.encode_rounded(q) if want_codes else None
    return FakeQuantResult(dequantized, amax, clipped, codes)


def current_scale(amax: torch.Tensor, max_val: float, margin: float, fallback: torch.Tensor,
                  power_2: bool = False) -> torch.Tensor:
    """max_val / amax / 2^margin, rounded down to a power of two with ``power_2`` (exactly: frexp); a zero, NaN or
    inf amax keeps ``fallback`` (never an inf/NaN scale)."""
    scale = max_val / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    if power_2:  # scale = m 2^e, m in [0.5, 1): its power-of-two floor is 2^(e - 1)
        scale = torch.ldexp(torch.full_like(scale, 0.5), torch.frexp(torch.where(ok, scale, 1.0)).exponent)
    return torch.where(ok, scale, fallback)


def fake_quantize_current(x: torch.Tensor, fallback_scale: torch.Tensor, max_val: float, clip_threshold: float,
                          margin: float, fmt_name: str, want_codes: bool,
                          noise: torch.Tensor | None, power_2: bool = False) -> tuple[FakeQuantResult, torch.Tensor]:
    """Current tensor scaling (CTS): the scale comes from this tensor's own amax (two passes)."""
    amax = x.float().abs().amax()
    scale = current_scale(amax, max_val, margin, fallback_scale, power_2)
    return fake_quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise), scale


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, dtype: torch.dtype) -> torch.Tensor:
    return (get_format(fmt_name).decode(codes, torch.float32) / scale).to(dtype)


class ReferenceBackend:
    name = "reference"

    def quantize(self, *args) -> FakeQuantResult:
        return fake_quantize(*args)

    def quantize_current(self, *args) -> tuple[FakeQuantResult, torch.Tensor]:
        return fake_quantize_current(*args)

    def dequantize(self, *args) -> torch.Tensor:
        return dequantize_codes(*args)
