"""Single-pass Triton kernel for delayed-scaling HiF8 fake quantization.

Same contract and the same numbers, bit for bit, as the plain-torch reference
``qat_app.fake_quant._fake_quantize`` for ``fmt="hif8"``: one read of ``x``, one write of the
dequantized tensor (and one uint8 write of the codes when asked), with the amax and the clipped count
reduced per program and combined across programs with one atomic each. Two launches in all: the
memset of the 16-byte accumulator and the kernel.

Per element, on float32: ``scaled = x * scale`` -> clamp to +-max_val (NaN stays NaN) -> HiF8
round on the int32 bit pattern (the same arithmetic as ``formats.hif8_round_f32``, including the
stochastic variant when ``noise`` is given) -> ``q / scale`` as an IEEE round-to-nearest division
(``tl.math.div_rn``: Triton's ``/`` and ``tl.fdiv(..., ieee_rounding=True)`` both lower to the
approximate ``div.full.f32`` on NVIDIA) -> cast to the input dtype (round to nearest even).

amax: ``max |x|`` is taken on the int32 patterns with the sign bit cleared. For non-negative floats
the integer order is the float order, and every NaN pattern (> 0x7F800000) is above +inf, so one
NaN anywhere gives a NaN amax, like ``torch.amax``.

Triton is imported lazily (importing this module never imports it), and the kernel is built on
first use, so ``TRITON_INTERPRET=1`` set before the first call runs it on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from .fake_quant import FakeQuantResult

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = int(os.environ.get("QAT_APP_TRITON_BLOCK", "4096"))
NUM_WARPS = int(os.environ.get("QAT_APP_TRITON_WARPS", "8"))


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
    """The jitted kernel, built on first use: ``_triton_hif8_kernel.py`` loaded as its own module per
    mode, since triton reads TRITON_INTERPRET when it decorates (an interpreted and a compiled kernel
    can then live in one process, e.g. the CPU and CUDA tests in one pytest run)."""
    name = f"qat_app._triton_hif8_kernel_{'interpreted' if interpret else 'compiled'}"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton_hif8_kernel.py")
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
) -> FakeQuantResult:
    """HiF8 delayed-scaling fake quantization in one Triton kernel; same result as ``_fake_quantize``.

    ``scale``: one-element tensor (cast to float32 on x's device, as the reference multiplies in
    float32). ``max_val`` is rounded to float32 like torch's clamp/compare with a Python scalar.
    ``noise``: optional int32 random bits of x's shape for stochastic rounding (as hif8_round_f32).
    Callers should check ``supports("hif8", x, scale, noise)`` first.
    """
    if not supports("hif8", x, scale, noise):
        raise ValueError(
            f"fake_quantize_triton does not handle this input (dtype {x.dtype}, numel {x.numel()}, device {x.device}, "
            f"triton available: {triton_available(x)}); use qat_app.fake_quant.fake_quantize"
        )
    xc = x.contiguous()
    n = xc.numel()
    scale32 = scale.reshape(()).to(device=x.device, dtype=torch.float32)
    out = torch.empty_like(xc)
    codes = torch.empty(xc.shape, dtype=torch.uint8, device=x.device) if want_codes else None
    noise_c = noise.contiguous() if noise is not None else None
    acc = torch.zeros(2, dtype=torch.int64, device=x.device)  # [amax bits (int32 in the low word), clipped]
    amax_bits = acc.view(torch.int32)[:1]
    clipped = acc[1:]
    grid = (triton_cdiv(n, BLOCK),)
    _kernel(_interpret())[grid](
        xc, out, codes if codes is not None else out, noise_c if noise_c is not None else xc,
        scale32, amax_bits, clipped,
        n, _as_f32(float(max_val)),
        BLOCK=BLOCK, WANT_CODES=want_codes, HAS_NOISE=noise is not None, INT64=n + BLOCK >= 2**31,
        num_warps=NUM_WARPS,
    )
    amax = acc.view(torch.int32)[0].view(torch.float32)
    return FakeQuantResult(out.view(x.shape), amax, acc[1], codes)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.lru_cache(maxsize=64)
def _as_f32(value: float) -> float:
    """The float32 value torch's clamp/compare use for a Python scalar bound (inf if out of range)."""
    return float(torch.tensor(value, dtype=torch.float32))
