"""The best SQNR a format gives a Gaussian tensor at any scale: the reference a low-SQNR floor is checked against.

A delayed or current scale only moves a tensor along the format's grid; it cannot buy precision the format does not
have. For a standard Gaussian the SQNR ``E[x^2] / E[(x - Q(x s) / s)^2]`` (clamped at ``max_val``) is computed by
quadrature on a fine grid of ``|x|`` (float64 weights, the format's own float32 rounding), over scales that put
the Gaussian's a_hat at 0.5 to 64 standard deviations (4 a binade), then refined around the best. HiF8 at max_val 15: 31.56 dB at
a_hat = 5 sigma (the 3-bit-mantissa tier's relative precision; a uniform spread over one binade of that tier
gives 32.5 dB); E4M3 31.56 dB, E5M2 25.58 dB. Real activations are heavier-tailed than a Gaussian and measure
below it (27-36 dB on the quickstart, 36 for the few near-uniform ones); a floor above it would send most
tensors out of the format, and no scale can lift a tensor to it.
"""

from __future__ import annotations

import functools
import math

import torch

from .formats import get_format

_POINTS = 60_000  # |x| in (0, 9 sigma]: past 9 sigma the Gaussian's weight is below 1e-17
_COARSE = torch.logspace(-1, 6, 29, base=2.0, dtype=torch.float64)  # a_hat / sigma: 0.5 .. 64, 4 a binade


def _sqnr_db(fmt, max_val: float, a_hat: float, x: torch.Tensor, weight: torch.Tensor, power: float) -> float:
    scale = max_val / a_hat
    quantized = fmt.round_f32(torch.clamp((x * scale).float(), max=max_val)).double() / scale
    return 10.0 * math.log10(power / float((weight * (x - quantized) ** 2).sum()))


@functools.lru_cache(maxsize=None)
def gaussian_sqnr_bound(format_name: str, max_val: float) -> tuple[float, float]:
    """``(SQNR in dB, a_hat / sigma)`` at the best scale of ``format_name`` (clamped at ``max_val``) on a standard
    Gaussian tensor."""
    fmt = get_format(format_name)
    x = torch.linspace(0.0, 9.0, _POINTS + 1, dtype=torch.float64)[1:]
    weight = torch.exp(-x * x / 2)
    weight = weight / weight.sum()
    power = float((weight * x * x).sum())
    best = max((_sqnr_db(fmt, max_val, float(c), x, weight, power), float(c)) for c in _COARSE)
    fine = torch.logspace(math.log2(best[1]) - 0.25, math.log2(best[1]) + 0.25, 17, base=2.0, dtype=torch.float64)
    return max(best, *((_sqnr_db(fmt, max_val, float(c), x, weight, power), float(c)) for c in fine))
