"""Per-tensor fake quantization: scale, clip (saturation), round to the 8-bit grid, dequantize.

One call computes everything the quantized linear needs from one read of the tensor: the
dequantized tensor, its true amax (for the history) and the number of saturated elements. The work
is done by a backend (:mod:`.backends`: plain torch, torch.compile, or the Triton kernel), chosen
by ``fused`` ("off", "auto", "on") and the tensor's device; all give the same bits.

Saturation, one definition everywhere: an element is *clipped* when clamping ``x * s`` to
``+-max_val`` changes its quantized value, i.e. ``|x * s| >= formats.saturation_threshold(fmt,
max_val)`` (HiF8, max_val 15: 15.5, the rounding midpoint above 15). The element equal to a_hat lands
at ``15 * (1 / a_hat) * a_hat``, one float32 ulp off 15, and is *not* clipped: rounding noise is not
saturation. The counters, the ``ste="clipped"`` mask and the Triton kernel all use this threshold.
"""

from __future__ import annotations

import torch

from .backends import resolve
from .backends.base import FakeQuantResult
from .backends.reference import current_scale as compute_scale
from .formats import Float8Format, saturation_threshold

__all__ = ["FakeQuantResult", "compute_scale", "dequantize_codes", "fake_quantize", "fake_quantize_current",
           "saturated_mask"]


def _name(fmt: str | Float8Format) -> str:
    return fmt if isinstance(fmt, str) else fmt.name


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    max_val: float,
    fmt: str | Float8Format = "hif8",
    *,
    want_codes: bool = False,
    noise: torch.Tensor | None = None,
    fused: str = "off",
    grid: bool = False,
    whatif_scales: torch.Tensor | None = None,
) -> FakeQuantResult:
    """Delayed-scaling fake quantization of ``x`` with a known per-tensor ``scale`` (0-d tensor). ``grid``: the
    result holds the grid values ``q`` instead of ``q / scale``; ``whatif_scales``: also the elements each of
    those scales would clip, from the same read (:class:`FakeQuantResult`)."""
    name = _name(fmt)
    threshold = saturation_threshold(name, float(max_val))
    return resolve(fused, x.device.type, name).quantize(x, scale, float(max_val), threshold, name, want_codes, noise,
                                                        grid, whatif_scales)


def fake_quantize_current(
    x: torch.Tensor,
    fallback_scale: torch.Tensor,
    max_val: float,
    margin: float = 0.0,
    fmt: str | Float8Format = "hif8",
    *,
    want_codes: bool = False,
    noise: torch.Tensor | None = None,
    fused: str = "off",
    power_2: bool = False,
    grid: bool = False,
) -> tuple[FakeQuantResult, torch.Tensor]:
    """Current-scaling fake quantization; returns the result and the scale that was used (rounded down to a power
    of two with ``power_2``). ``grid``: as :func:`fake_quantize`."""
    name = _name(fmt)
    threshold = saturation_threshold(name, float(max_val))
    return resolve(fused, x.device.type, name).quantize_current(
        x, fallback_scale, float(max_val), threshold, float(margin), name, want_codes, noise, bool(power_2), grid)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor | None, fmt: str | Float8Format, dtype: torch.dtype, *,
    fused: str = "off"
) -> torch.Tensor:
    """uint8 codes of ``x * scale`` -> the dequantized tensor, bit-identical to ``fake_quantize``'s output;
    ``scale=None``: the grid values (``fake_quantize(..., grid=True)``'s)."""
    name = _name(fmt)
    return resolve(fused, codes.device.type, name).dequantize(codes, scale, name, dtype)


def saturated_mask(x: torch.Tensor, scale: torch.Tensor, max_val: float, fmt: str | Float8Format) -> torch.Tensor:
    """True where ``x`` is clipped (the clamp changes its quantized value): the ``ste="clipped"`` mask's complement."""
    return (x.float() * scale).abs() >= saturation_threshold(_name(fmt), float(max_val))
