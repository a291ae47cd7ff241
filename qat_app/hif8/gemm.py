"""How the product of a quantized matmul is computed: like the hardware, over the 8-bit grid.

A W8A8 engine (an HiF8 NPU's quantized matmul, an FP8 tensor core through ``torch._scaled_mm``) multiplies the
8-bit values themselves, accumulates in fp32 and applies the two per-tensor decode scales ``1 / s`` to the
accumulator, then rounds once to the output dtype. Dequantizing each operand first (``q / s`` in the compute
dtype, then a matmul) adds a rounding the hardware does not make: under bf16, ``q / s`` with an arbitrary fp32
scale keeps only 8 significant bits, which doubles the GEMM's error against the hardware's arithmetic.

An :class:`Operand` is what one side of a GEMM holds: the grid values ``q`` (the format's values of ``x * s``:
at most 4 significant bits, so exact in bf16, fp16 and fp32) with their scale ``s``, or a tensor that is not
quantized (scale None). :func:`scaled_mm` computes ``a @ b`` from two of them:

* ``emulated`` (the default): the grid values multiplied with an fp32 accumulator (fp32 operands: an fp32
  GEMM, whose products of 4-bit significands are exact; bf16/fp16 on CUDA: ``torch.mm(..., out_dtype=float32)``;
  elsewhere the operands are widened to fp32, exactly), the decode factor ``1 / (s_a s_b)`` (one float32
  number) and the bias applied to the fp32 accumulator, one rounding to the output dtype;
* ``fp8``: the same product on FP8 tensor cores (:mod:`.fp8_gemm`: the grid values cast to E4M3 exactly,
  ``torch._scaled_mm``), when both operands are quantized; with ``fp8_tail`` for the few values E4M3 cannot hold;
* ``dequantize_first``: the former path, kept to compare: ``(q_a / s_a) @ (q_b / s_b)`` in the compute dtype
  (the plan hands over dequantized operands, which this module multiplies as they are);
* ``auto``: ``fp8`` where FP8 tensor cores are (CUDA sm89 and later), ``emulated`` elsewhere (:func:`resolve_gemm`).

Two unquantized operands are multiplied as they are (the BF16 warmup computes what BF16 does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import FieldError
from .fp8_gemm import FP8_TAILS, TAIL_DROP, fp8_available, fp8_mm

log = logging.getLogger(__name__)

GEMM_AUTO, GEMM_EMULATED, GEMM_FP8, GEMM_DEQUANTIZE_FIRST = "auto", "emulated", "fp8", "dequantize_first"
GEMM_MODES = (GEMM_AUTO, GEMM_EMULATED, GEMM_FP8, GEMM_DEQUANTIZE_FIRST)
__all__ = ["FP8_TAILS", "GEMM_MODES", "Operand", "TAIL_DROP", "column_sums", "resolve_gemm", "scaled_linear", "scaled_mm"]
_resolved: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Operand:
    """One side of a GEMM: ``values`` (grid values, or the tensor itself) and its scale ``s`` (a 0-d float32
    tensor: the grid values are those of ``x * s``; None when ``values`` are not quantized)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    max_val: float = 15.0  # the clamp of the grid values (for the FP8 path's shift)

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def t(self) -> "Operand":
        return Operand(self.values.t(), self.scale, self.max_val)

    def flat(self) -> "Operand":
        """As 2-D (``[-1, last]``)."""
        return Operand(self.values.reshape(-1, self.values.shape[-1]), self.scale, self.max_val)


def resolve_gemm(mode: str, device: torch.device | str) -> str:
    """The GEMM a quantized matmul on ``device`` runs: ``auto`` becomes ``fp8`` where FP8 tensor cores are (CUDA
    sm89+), else ``emulated`` (logged once per device); ``fp8`` where ``torch._scaled_mm`` cannot run raises
    :class:`~qat_app.hif8.errors.FieldError` naming the setting. Cached per (mode, device)."""
    device = torch.device(device)
    key = (mode, str(device))
    if key not in _resolved:
        if mode == GEMM_AUTO:
            capable = device.type == "cuda" and fp8_available(device)[0]
            _resolved[key] = GEMM_FP8 if capable else GEMM_EMULATED
            log.info("gemm=auto on %s: %s", device, "FP8 tensor cores (torch._scaled_mm)" if capable
                     else "the emulated W8A8 GEMM (fp32 accumulator; no FP8 tensor cores here)")
        elif mode == GEMM_FP8:
            ok, why = fp8_available(device)
            if not ok:
                raise FieldError("gemm", f"fp8 cannot run on {device}: {why}; use gemm: emulated (the same "
                                         "arithmetic, emulated) or auto")
            _resolved[key] = mode
        else:
            _resolved[key] = mode
    return _resolved[key]


def decode_factor(*scales: torch.Tensor | None) -> torch.Tensor | None:
    """``1 / (s_a s_b)`` of the quantized operands, rounded once to float32 (computed in float64, so it neither
    overflows nor underflows where the true factor is a float32 number); None when neither is quantized."""
    present = [s.double() for s in scales if s is not None]
    if not present:
        return None
    product = present[0] if len(present) == 1 else present[0] * present[1]
    return torch.reciprocal(product).float()


def _fp32_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D) with an fp32 accumulator and an fp32 result; exact products of grid values."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # widening a grid value (or a bf16 / fp16 value) to fp32 is exact


def scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype, *, bias: torch.Tensor | None = None,
              fp8_tail: str | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of 2-D operands in ``out_dtype``: over the grid with the decode factor and the bias on the
    fp32 accumulator when either is quantized (on FP8 tensor cores when ``fp8_tail`` is given and both are), else
    the plain product."""
    if not (a.quantized or b.quantized):
        out = a.values.to(out_dtype) @ b.values.to(out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    if fp8_tail is not None and a.quantized and b.quantized:
        accumulator = fp8_mm(a.values, a.max_val, b.values.t(), b.max_val, decode_factor(a.scale, b.scale), fp8_tail)
    else:  # in place: the accumulator is a fresh tensor (one pass over the output, no second one)
        accumulator = _fp32_accumulate(a.values, b.values).mul_(decode_factor(a.scale, b.scale))
    if bias is not None:
        accumulator = accumulator.add_(bias.float())
    return accumulator.to(out_dtype)


def scaled_linear(x: Operand, w: Operand, out_dtype: torch.dtype, *, bias: torch.Tensor | None = None,
                  fp8_tail: str | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for an N-D ``x`` (``[..., in]``) and a ``[out, in]`` weight (:func:`scaled_mm`; two
    unquantized operands go through ``F.linear``, as an unquantized layer)."""
    if not (x.quantized or w.quantized):
        return F.linear(x.values.to(out_dtype), w.values.to(out_dtype), bias)
    out = scaled_mm(x.flat(), w.t(), out_dtype, bias=bias, fp8_tail=fp8_tail).contiguous()
    # not a view of the 2-D product (as torch.matmul returns it): a custom Function's output that is a view
    # could not be modified in place, and copying it would cost one more pass
    return torch.ops.aten._unsafe_view(out, (*x.values.shape[:-1], out.shape[-1]))


def column_sums(g: Operand) -> torch.Tensor:
    """The bias gradient of a 2-D output gradient: its column sums (over the grid: in fp32, then the decode scale)."""
    if not g.quantized:
        return g.values.sum(0)
    return g.values.float().sum(0) * decode_factor(g.scale)
