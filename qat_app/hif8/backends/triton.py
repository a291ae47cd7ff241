"""Single-pass Triton kernel for delayed-scaling HiF8 fake quantization (:class:`TritonBackend`).

Contract: the same numbers, bit for bit, as the plain-torch reference ``backends.reference.fake_quantize`` for
``fmt="hif8"`` (one NaN anywhere gives a NaN amax, like ``torch.amax``), in one read of ``x`` and one write of the
dequantized tensor (plus one uint8 write of the codes when asked). How each step is made cheap and still exact
is described in ``_triton_kernel.py``. Triton is imported lazily and the kernel built on first use, so
``TRITON_INTERPRET=1`` set before the first call runs it on CPU tensors.

See ``docs/gpu-validation.md`` ("Exact on CUDA") for exactness and ``docs/performance.md`` for its speed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from ..formats import HIF8_OVERFLOW, saturation_threshold
from . import reference
from ..kernel_count import counted_call
from .base import FakeQuantResult

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = int(os.environ.get("QAT_APP_TRITON_BLOCK", "4096"))
NUM_WARPS = int(os.environ.get("QAT_APP_TRITON_WARPS", "4"))
# Markstein correction steps in q / scale. One is exact: checked on an H200 against div_rn for every
# HiF8 value times every float32 scale mantissa, scale exponents -60..59 (0 mismatches; the result
# only depends on the mantissas while nothing under/overflows). 2 is the conservative choice.
CORRECTIONS = int(os.environ.get("QAT_APP_TRITON_CORRECTIONS", "1"))


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing libs)
        return False
    return True


def triton_available(x: torch.Tensor | None = None) -> bool:
    """True when triton imports and can run here: on CUDA tensors, or on any tensor under TRITON_INTERPRET=1.

    Without ``x``: triton imports and (CUDA is available or the interpreter is on).
    """
    if not _triton_importable():
        return False
    if _interpret():
        return True
    return x.is_cuda if x is not None else torch.cuda.is_available()


def supports(fmt: str, x: torch.Tensor, scale: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> bool:
    """Whether ``fake_quantize_triton`` handles this call; False means use the torch path.

    Only HiF8 (E4M3/E5M2 go through torch's float8 casts), float32/bfloat16/float16 inputs, a
    non-empty ``x``, a one-element scale, and an int32 noise tensor of x's shape if any.
    """
    if fmt != "hif8" or x.dtype not in SUPPORTED_DTYPES or x.numel() == 0 or not triton_available(x):
        return False
    if scale is not None and (scale.numel() != 1 or not scale.is_floating_point()):
        return False
    if noise is not None and (noise.dtype != torch.int32 or noise.shape != x.shape or noise.device != x.device):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    """The jitted kernel, built on first use: ``_triton_kernel.py`` loaded as its own module per
    mode, since triton reads TRITON_INTERPRET when it decorates (an interpreted and a compiled kernel
    can then live in one process, e.g. the CPU and CUDA tests in one pytest run)."""
    name = f"qat_app.hif8.backends._triton_kernel_{'interpreted' if interpret else 'compiled'}"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_kernel.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.hif8_fake_quant_kernel


def fake_quantize_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    max_val: float,
    want_codes: bool = False,
    noise: torch.Tensor | None = None,
    *,
    check: bool = True,
    grid: bool = False,
    whatif_scales: torch.Tensor | None = None,
) -> FakeQuantResult:
    """HiF8 delayed-scaling fake quantization in one Triton kernel, the reference's result (the contract,
    :mod:`.base`): ``scale`` a one-element tensor used as float32, ``max_val`` rounded to float32, ``noise`` int32
    bits for stochastic rounding, ``grid`` the grid values instead of ``q / scale``, ``whatif_scales`` the what-if
    counts from the same read; ``check=False``: the caller made the ``supports`` test. No autograd graph."""
    if check and not supports("hif8", x, scale, noise):
        raise ValueError(
            f"fake_quantize_triton does not handle this input (dtype {x.dtype}, numel {x.numel()}, device {x.device}, "
            f"triton available: {triton_available(x)}); use qat_app.fake_quant.fake_quantize"
        )
    # Host overhead matters as much as the kernel for small tensors: no more tensor ops than needed.
    device = x.device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # triton launches on the current device
            return fake_quantize_triton(x, scale, max_val, want_codes, noise, check=False, grid=grid,
                                        whatif_scales=whatif_scales)
    xc = x.contiguous()
    n = xc.numel()
    if scale.dtype != torch.float32 or scale.device != device:
        scale = scale.to(device=device, dtype=torch.float32)
    out = torch.empty_like(xc)
    codes = torch.empty(xc.shape, dtype=torch.uint8, device=device) if want_codes else None
    n_whatif = 0 if whatif_scales is None else whatif_scales.numel()
    if n_whatif and (whatif_scales.dtype != torch.float32 or whatif_scales.device != device):
        whatif_scales = whatif_scales.to(device=device, dtype=torch.float32)
    # the one memset: [amax bits, clipped count, what-if counts]
    acc = torch.zeros(2 + n_whatif, dtype=torch.int64, device=device)
    table = _TABLES.get(device)
    if table is None:
        table = _table(device)
    max_val32 = _as_f32(max_val)
    interpret = _interpret()
    noise = None if noise is None else noise.contiguous()

    def launch():
        _kernel(interpret)[(triton_cdiv(n, BLOCK),)](
            xc, out, codes, noise, scale, table, acc,
            whatif_scales.contiguous() if n_whatif else None, n, max_val32, saturation_threshold("hif8", max_val32),
            BLOCK=BLOCK, WANT_CODES=want_codes, HAS_NOISE=noise is not None, INT64=n + BLOCK >= 2**31,
            OVERFLOW=not max_val32 < HIF8_OVERFLOW, CORRECTIONS=CORRECTIONS, INTERPRET=interpret, GRID=grid,
            N_WHATIF=n_whatif, num_warps=NUM_WARPS,
        )
        return out, codes, acc

    counted_call("hif8_fake_quant_kernel", launch, reads=(xc, noise, scale, whatif_scales))
    # amax: the float32 in the low word of acc[0]; clipped: acc[1] (0-d views of acc); what-if: acc[2:]
    amax, clipped, whatif = acc.view(torch.float32)[0], acc[1], acc[2:] if n_whatif else None
    if grid:
        return FakeQuantResult(None, amax, clipped, codes, out, whatif)
    return FakeQuantResult(out, amax, clipped, codes, None, whatif)


def _round_table_rows() -> list[int]:
    """(half, mask) per float32 sign+exponent row so that HiF8 rounding is ``(bits + half) & mask``.

    The same rule as ``formats.hif8_round_f32`` without noise: within a binade the quantum is fixed
    (3, 2, 1 or 0 mantissa bits), so adding half a quantum and clearing the bits below it rounds to
    nearest with ties away from zero. Special rows: below 2^-23 -> +0 (mask 0, also drops the sign:
    one zero); [2^-23, 2^-22) -> 2^-22 (adding 2^23 bumps the exponent, the mask clears the mantissa);
    inf/NaN kept as they are. Rows >= 2^16 round to inf, which no mask can produce: the kernel selects
    inf for |x| >= 40960 when max_val allows such values (``OVERFLOW``); below 2^15 * 1.25 the table
    alone is exact. Packed as int64: half in the low word, mask in the high word.
    """
    rows = []
    for row in range(512):
        field = row & 0xFF
        exp = field - 127
        if field == 0xFF:  # inf, NaN
            half, mask = 0, -1
        elif exp < -23:
            half, mask = 0, 0
        elif exp == -23:
            half, mask = 1 << 23, -(1 << 23)
        else:
            mbits = 0 if exp < -15 else 3 - (abs(exp) > 3) - (abs(exp) > 7)
            shift = 23 - mbits
            half, mask = 1 << (shift - 1), -(1 << shift)
        packed = (half & 0xFFFFFFFF) | ((mask & 0xFFFFFFFF) << 32)
        rows.append(packed - (1 << 64) if packed >= 1 << 63 else packed)
    return rows


def _code_table() -> torch.Tensor:
    """uint8 HiF8 code of every on-grid float32 by its top 12 bits (sign, exponent, 3 mantissa bits)."""
    from ..formats import hif8_encode

    values = (torch.arange(4096, dtype=torch.int64) << 20).to(torch.int32).view(torch.float32)
    return hif8_encode(values)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """The kernel's int64[1024] table on ``device``: 512 rounding rows, then the 4096 uint8 codes
    (one tensor argument instead of two); built and copied once per device."""
    if device not in _TABLES:
        round_tab = torch.tensor(_round_table_rows(), dtype=torch.int64)
        _TABLES[device] = torch.cat([round_tab, _code_table().view(torch.int64)]).to(device)
    return _TABLES[device]


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.lru_cache(maxsize=64)
def _as_f32(value) -> float:
    """The float32 value torch's clamp/compare use for a Python scalar bound (inf if out of range)."""
    return float(torch.tensor(float(value), dtype=torch.float32))


class TritonBackend:
    """HiF8 on CUDA (or under TRITON_INTERPRET=1) in the Triton kernel: delayed scaling, and current scaling with
    the scale computed in plain torch; everything the kernel does not cover (stochastic rounding, decoding,
    unsupported dtypes) and a kernel that fails to build ("auto") go to ``fallback`` (the compiled backend, which
    divides outside its compiled code on CUDA). Same numbers."""

    name = "triton"

    def __init__(self, fallback, required: bool = False) -> None:
        self.fallback = fallback
        self.required = required
        self.broken = False

    def quantize(self, x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, grid=False,
                 whatif_scales=None) -> FakeQuantResult:
        if not self.broken and noise is None and supports(fmt_name, x, scale):
            try:
                return fake_quantize_triton(x, scale, float(max_val), want_codes, check=False, grid=grid,
                                            whatif_scales=whatif_scales)
            except Exception as err:  # e.g. no compiler for this GPU: fall back, same numbers
                if self.required:
                    raise
                self.broken = True
                import logging

                logging.getLogger(__name__).warning(
                    "the Triton fake-quant kernel failed (%s); using torch.compile / plain torch", err)
        return self.fallback.quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, grid,
                                      whatif_scales)

    def quantize_current(self, x, fallback_scale, max_val, clip_threshold, margin, fmt_name, want_codes, noise,
                         power_2=False, grid=False):
        """The kernel with the scale of ``x``'s own amax, computed in plain torch (exact on CUDA, unlike a compiled
        division): one reduction, a few 0-d ops, the kernel; no host sync."""
        if not self.broken and noise is None and supports(fmt_name, x, fallback_scale):
            amax = self.fallback.amax(x)
            scale = reference.current_scale(amax, max_val, margin, fallback_scale.to(amax.device), power_2)
            return self.quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, None, grid), scale
        return self.fallback.quantize_current(x, fallback_scale, max_val, clip_threshold, margin, fmt_name,
                                              want_codes, noise, power_2, grid)

    def dequantize(self, *args):
        return self.fallback.dequantize(*args)
