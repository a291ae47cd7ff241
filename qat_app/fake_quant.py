"""Per-tensor fake quantization: scale, clip (saturation), round to the 8-bit grid, dequantize.

One function computes everything the quantized linear needs from one read of the tensor: the
dequantized tensor, its true amax (for the history) and the number of saturated elements. The
plain-torch version is the reference; ``fused`` wraps the same code in ``torch.compile`` so the
whole thing becomes one or two loops (C++/OpenMP on CPU, Triton on GPU). All ops are exact
(bit manipulation, multiplication by the scale, division by the scale), so both agree bit for bit.

Saturation, one definition everywhere: an element is *clipped* when clamping ``x * s`` to
``+-max_val`` changes its quantized value, i.e. ``|x * s| >= formats.saturation_threshold(fmt,
max_val)`` (HiF8, max_val 15: 15.5, the rounding midpoint above 15). The element equal to a_hat lands
at ``15 * (1 / a_hat) * a_hat``, one float32 ulp off 15, and is *not* clipped: rounding noise is not
saturation. The counters, the ``ste="clipped"`` mask and the Triton kernel all use this threshold.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, NamedTuple

import torch

from .formats import Float8Format, get_format, saturation_threshold

log = logging.getLogger(__name__)


class FakeQuantResult(NamedTuple):
    dequantized: torch.Tensor  # same dtype as the input
    amax: torch.Tensor  # float32 0-d: max |x| of the input (NaN/inf propagate)
    clipped: torch.Tensor  # int64 0-d: elements whose quantized value the clamp changed (see below)
    codes: torch.Tensor | None  # uint8 codes of x * scale when asked for


def _fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    max_val: float,
    clip_threshold: float,
    fmt_name: str,
    want_codes: bool,
    noise: torch.Tensor | None,
) -> FakeQuantResult:
    fmt = get_format(fmt_name)
    xf = x.float()
    amax = xf.abs().amax()
    scaled = xf * scale
    clipped = (scaled.abs() >= clip_threshold).sum()
    q = fmt.round_f32(scaled.clamp(-max_val, max_val), noise)
    dequantized = (q / scale).to(x.dtype)
    codes = fmt.encode_rounded(q) if want_codes else None
    return FakeQuantResult(dequantized, amax, clipped, codes)


def _current_scale(amax: torch.Tensor, max_val: float, margin: float, fallback: torch.Tensor) -> torch.Tensor:
    """max_val / amax / 2^margin; a zero, NaN or inf amax keeps ``fallback`` (never an inf/NaN scale)."""
    scale = max_val / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(ok, scale, fallback)


def _fake_quantize_current(
    x: torch.Tensor,
    fallback_scale: torch.Tensor,
    max_val: float,
    clip_threshold: float,
    margin: float,
    fmt_name: str,
    want_codes: bool,
    noise: torch.Tensor | None,
) -> tuple[FakeQuantResult, torch.Tensor]:
    """Current tensor scaling (CTS): the scale comes from this tensor's own amax (two passes)."""
    amax = x.float().abs().amax()
    scale = _current_scale(amax, max_val, margin, fallback_scale)
    return _fake_quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise), scale


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    # dynamic: one kernel serves every layer's shape (inputs are flattened to 1-D, see _dispatch)
    return torch.compile(fn, dynamic=True)


_COMPILE_BROKEN = False


def _use_compiled(mode: str) -> bool:
    if mode == "off" or _COMPILE_BROKEN or os.environ.get("QAT_APP_NO_COMPILE") == "1":
        if mode == "on" and _COMPILE_BROKEN:
            raise RuntimeError("quant.fused=on but torch.compile failed on this machine (see the log)")
        return False
    return True


def _restore_shape(out, shape: torch.Size):
    if isinstance(out, FakeQuantResult):
        codes = out.codes.view(shape) if out.codes is not None else None
        return out._replace(dequantized=out.dequantized.view(shape), codes=codes)
    if isinstance(out, tuple):  # (FakeQuantResult, scale) from current scaling
        return (_restore_shape(out[0], shape), *out[1:])
    return out.view(shape)


def _dispatch(fn: Callable, mode: str, *args):
    global _COMPILE_BROKEN
    if _use_compiled(mode):
        try:
            # Elementwise work: flatten so every shape and rank shares one compiled kernel.
            shape = args[0].shape
            flat = [a.reshape(-1) if isinstance(a, torch.Tensor) and a.shape == shape else a for a in args]
            return _restore_shape(_compiled(fn)(*flat), shape)
        except Exception as err:  # a missing compiler must not stop training: fall back, same numbers
            if mode == "on":
                raise
            _COMPILE_BROKEN = True
            log.warning("torch.compile of the fake-quant kernel failed (%s); using plain torch", err)
    return fn(*args)


_TRITON_BROKEN = False


def _triton_kernel_for(x, scale, fmt_name: str, noise, mode: str) -> Callable | None:
    """The hand-written Triton kernel (``triton_fake_quant``) when it applies, else None.

    Only for ``fused != "off"``, CUDA tensors, HiF8, deterministic rounding (noise None), triton
    importable, and not disabled with QAT_APP_NO_TRITON=1. Everything else -- CPU included -- keeps
    the torch.compile / plain-torch path. Same numbers bit for bit either way.
    """
    if mode == "off" or _TRITON_BROKEN or not x.is_cuda or fmt_name != "hif8" or noise is not None:
        return None
    if os.environ.get("QAT_APP_NO_TRITON") == "1":
        return None
    from . import triton_fake_quant  # imports triton lazily, only here

    return triton_fake_quant.fake_quantize_triton if triton_fake_quant.supports(fmt_name, x, scale) else None


def fake_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    max_val: float,
    fmt: str | Float8Format = "hif8",
    *,
    want_codes: bool = False,
    noise: torch.Tensor | None = None,
    fused: str = "off",
) -> FakeQuantResult:
    """Delayed-scaling fake quantization of ``x`` with a known per-tensor ``scale`` (0-d tensor).

    ``fused`` "on"/"auto" on CUDA HiF8 tensors runs the single-pass Triton kernel (see
    ``_triton_kernel_for``); otherwise torch.compile of the reference. "auto" falls back on errors.
    """
    global _TRITON_BROKEN
    name = fmt if isinstance(fmt, str) else fmt.name
    kernel = _triton_kernel_for(x, scale, name, noise, fused)
    if kernel is not None:
        try:
            return kernel(x, scale, float(max_val), want_codes, check=False)  # supports() was checked
        except Exception as err:  # e.g. no compiler for this GPU: fall back, same numbers
            if fused == "on":
                raise
            _TRITON_BROKEN = True
            log.warning("the Triton fake-quant kernel failed (%s); using torch.compile / plain torch", err)
    threshold = saturation_threshold(name, float(max_val))
    return _dispatch(_fake_quantize, fused, x, scale, float(max_val), threshold, name, want_codes, noise)


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
) -> tuple[FakeQuantResult, torch.Tensor]:
    """Current-scaling fake quantization; returns the result and the scale that was used."""
    name = fmt if isinstance(fmt, str) else fmt.name
    threshold = saturation_threshold(name, float(max_val))
    return _dispatch(
        _fake_quantize_current, fused, x, fallback_scale, float(max_val), threshold, float(margin), name, want_codes,
        noise,
    )


def saturated_mask(x: torch.Tensor, scale: torch.Tensor, max_val: float, fmt: str | Float8Format) -> torch.Tensor:
    """True where ``x`` is clipped (the clamp changes its quantized value): the ``ste="clipped"`` mask's complement."""
    name = fmt if isinstance(fmt, str) else fmt.name
    return (x.float() * scale).abs() >= saturation_threshold(name, float(max_val))


compute_scale = _current_scale


def _dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, fmt_name: str, dtype: torch.dtype) -> torch.Tensor:
    return (get_format(fmt_name).decode(codes, torch.float32) / scale).to(dtype)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, fmt: str | Float8Format, dtype: torch.dtype, *, fused: str = "off"
) -> torch.Tensor:
    """uint8 codes of ``x * scale`` -> the dequantized tensor, bit-identical to ``fake_quantize``'s output."""
    name = fmt if isinstance(fmt, str) else fmt.name
    return _dispatch(_dequantize_codes, fused, codes, scale, name, dtype)
