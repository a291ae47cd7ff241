"""How the product of a quantized matmul is computed: like the hardware, over the 8-bit grid.

A :class:`GemmOperand` is one side of a GEMM: the grid values ``q`` (exact in bf16, fp16 and fp32) with their scale
``s``, or an unquantized tensor (scale None). :func:`scaled_mm` computes ``a @ b`` from two of them in one of
:data:`GEMM_MODES` (:func:`resolve_gemm`): ``emulated`` (the default), ``fp8`` (the same product on FP8 tensor
cores, :mod:`.fp8_gemm`), ``dequantize_first`` or ``auto``. Contract of ``emulated``: the grid values are
multiplied with an fp32 accumulator, the decode factor ``1 / (s_a s_b)`` and the bias are applied to the
accumulator, and the result is rounded once to the output dtype, as a W8A8 engine does. Two unquantized operands
are multiplied as they are.

See ``docs/gemm.md`` for the modes and how each step of the product is done.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .errors import FieldError
from .kernel_count import counted_call
from .fp8_gemm import FP8_TAILS, TAIL_DROP, e4m3_parts, e4m3_parts_of_codes, fp8_available, fp8_mm

log = logging.getLogger(__name__)

GEMM_AUTO, GEMM_EMULATED, GEMM_FP8, GEMM_DEQUANTIZE_FIRST = "auto", "emulated", "fp8", "dequantize_first"
GEMM_MODES = (GEMM_AUTO, GEMM_EMULATED, GEMM_FP8, GEMM_DEQUANTIZE_FIRST)
__all__ = ["FP8_TAILS", "GEMM_MODES", "GemmOperand", "TAIL_DROP", "apply_decode", "column_sums", "decode_factors", "resolve_gemm", "scaled_linear", "scaled_mm"]
_resolved: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class GemmOperand:
    """One side of a GEMM: ``values`` (grid values, or the tensor itself) and its scale ``s`` (a 0-d float32
    tensor: the grid values are those of ``x * s``; None when ``values`` are not quantized).

    For the FP8 GEMM an operand may also carry what makes its E4M3 form cheap: ``codes``, the 8-bit codes of
    ``values`` (same layout; :func:`.fp8_gemm.e4m3_parts_of_codes` reads a byte per element), or ``fp8`` /
    ``fp8_t``, the E4M3 parts of ``values`` / of ``values.T`` already made (the weight's, once per optimizer step)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    max_val: float = 15.0  # the clamp of the grid values (for the FP8 path's shift)
    codes: torch.Tensor | None = None
    fmt_name: str = "hif8"
    fp8: tuple | None = None  # (tail, parts) of values, as :func:`.fp8_gemm.e4m3_parts` makes them
    fp8_t: tuple | None = None  # likewise of values.T

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def t(self) -> "GemmOperand":
        return replace(self, values=self.values.t(), codes=None if self.codes is None else self.codes.t(),
                       fp8=self.fp8_t, fp8_t=self.fp8)

    def flat(self) -> "GemmOperand":
        """As 2-D (``[-1, last]``)."""
        def flat(t):
            return None if t is None else t.reshape(-1, t.shape[-1])
        return replace(self, values=flat(self.values), codes=flat(self.codes))

    def e4m3(self, tail: str) -> list[tuple[torch.Tensor, float]]:
        """The E4M3 parts of ``values`` (2-D, as rows) for ``torch._scaled_mm``: made already, from the codes, or
        from the grid values."""
        if self.fp8 is not None and self.fp8[0] == tail:
            return self.fp8[1]
        if self.codes is not None:
            return e4m3_parts_of_codes(self.codes, self.fmt_name, self.max_val, tail)
        return e4m3_parts(self.values, self.max_val, tail)


def resolve_gemm(mode: str, device: torch.device | str) -> str:
    """The GEMM a quantized matmul on ``device`` runs: ``auto`` becomes ``fp8`` where FP8 tensor cores are (CUDA
    sm89+) and it is the faster of the two there (:func:`time_gemms`, once per device; rank 0's choice on every
    rank), else ``emulated``, and logs which with the timings; ``fp8`` where ``torch._scaled_mm`` cannot run raises
    :class:`~qat_app.hif8.errors.FieldError` naming the setting. Cached per (mode, device)."""
    device = torch.device(device)
    key = (mode, str(device))
    if key not in _resolved:
        if mode == GEMM_AUTO:
            _resolved[key] = _auto_gemm(device)
        elif mode == GEMM_FP8:
            ok, why = fp8_available(device)
            if not ok:
                raise FieldError("gemm", f"fp8 cannot run on {device}: {why}; use gemm: emulated (the same "
                                         "arithmetic, emulated) or auto")
            _resolved[key] = mode
        else:
            _resolved[key] = mode
    return _resolved[key]


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores (``gemm: auto`` considers FP8 there only)."""
    return device.type == "cuda" and fp8_available(device)[0]


AUTO_SHAPE = (8192, 1536, 6144)  # the GEMM auto times: a micro-batch of 8 x 1024 tokens through an MLP's gate_proj


def _auto_gemm(device: torch.device) -> str:
    if not fp8_tensor_cores(device):
        log.info("gemm=auto on %s: emulated (the W8A8 arithmetic with an fp32 accumulator; no FP8 tensor cores)",
                 device)
        return GEMM_EMULATED
    seconds = time_gemms(device, AUTO_SHAPE)
    choice = GEMM_FP8 if seconds[GEMM_FP8] < seconds[GEMM_EMULATED] else GEMM_EMULATED
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # every rank computes alike
        flag = torch.tensor([choice == GEMM_FP8], dtype=torch.int32, device=device)
        torch.distributed.broadcast(flag, src=0)
        choice = GEMM_FP8 if bool(flag) else GEMM_EMULATED
    log.info("gemm=auto on %s: %s (a %s GEMM: fp8 %.3f ms, emulated %.3f ms)", device, choice,
             "x".join(map(str, AUTO_SHAPE)), seconds[GEMM_FP8] * 1e3, seconds[GEMM_EMULATED] * 1e3)
    return choice


def time_gemms(device: torch.device, shape: tuple[int, int, int], repeats: int = 10) -> dict[str, float]:
    """Seconds of one ``[M, K] x [K, N]`` quantized GEMM with a bf16 output, emulated and on FP8 tensor cores (the
    median of ``repeats`` after a warm-up; host syncs, once, at the first forward)."""
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    ops = [GemmOperand(torch.randn(rows, k, generator=gen, device=device).clamp(-15, 15).to(torch.bfloat16),
                   torch.ones((), device=device)) for rows in (m, n)]
    a, b = ops[0], ops[1].t()
    seconds = {}
    for mode, tail in ((GEMM_EMULATED, None), (GEMM_FP8, TAIL_DROP)):
        times = []
        for i in range(repeats + 2):
            _synchronize(device)
            start = time.perf_counter()
            scaled_mm(a, b, torch.bfloat16, fp8_tail=tail)
            _synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
        seconds[mode] = statistics.median(times)
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_factor(*scales: torch.Tensor | None) -> torch.Tensor | None:
    """``1 / (s_a s_b)`` of the quantized operands, rounded once to float32 (computed in float64, so it neither
    overflows nor underflows where the true factor is a float32 number); None when neither is quantized."""
    present = [s.double() for s in scales if s is not None]
    if not present:
        return None
    product = present[0] if len(present) == 1 else present[0] * present[1]
    return torch.reciprocal(product).float()


def decode_factors(x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[1 / (s_x s_w), 1 / s_x, 1 / s_w]``: :func:`decode_factor` of the forward's, the weight
    gradient's and the input gradient's GEMMs (unquantized output gradients), the same bits, in one go (a few
    small kernels a layer instead of five a GEMM)."""
    both = torch.stack([x_scale.reshape(()), w_scale.reshape(())]).double()
    return torch.cat([both.prod().reshape(1), both]).reciprocal().float()


def _fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # widening a grid value (or a bf16 / fp16 value) to fp32 is exact


def _fp32_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D) with an fp32 accumulator and an fp32 result; exact products of grid values. Counted as one
    GEMM (:mod:`.kernel_count`): the CPU's widening of 16-bit operands is the CUDA GEMM's own load."""
    return counted_call("mm", _fp32_product, a, b)


def apply_decode(accumulator: torch.Tensor, decode: torch.Tensor, out_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The epilogue over an fp32 accumulator: ``acc x decode (+ bias)``, each op rounded to fp32 as the contract says,
    the last one writing ``out_dtype`` in the same pass (no pass of its own for the cast, none in fp32 for the
    factor when nothing follows it)."""
    last, operand = (torch.mul, decode) if bias is None else (torch.add, bias)
    if bias is not None:
        accumulator.mul_(decode)
    out = accumulator if out_dtype == accumulator.dtype else torch.empty(accumulator.shape, dtype=out_dtype,
                                                                         device=accumulator.device)
    return last(accumulator, operand, out=out)


def scaled_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, *, bias: torch.Tensor | None = None,
              fp8_tail: str | None = None, decode: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of 2-D operands in ``out_dtype``: over the grid with the decode factor (``decode`` when the
    caller made it, :func:`decode_factor` of the scales else) and the bias on the fp32 accumulator when either is
    quantized (on FP8 tensor cores when ``fp8_tail`` is given and both are), else the plain product."""
    if not (a.quantized or b.quantized):
        out = a.values.to(out_dtype) @ b.values.to(out_dtype)
        return out if bias is None else out + bias.to(out_dtype)
    if decode is None:
        decode = decode_factor(a.scale, b.scale)
    if fp8_tail is not None and a.quantized and b.quantized:
        out, decoded = fp8_mm(a.e4m3(fp8_tail), a.values.shape[0], b.t().e4m3(fp8_tail), b.values.shape[1], decode,
                              out_dtype, decode_in_gemm=bias is None)
        return out if decoded else apply_decode(out, decode, out_dtype, bias)
    return apply_decode(_fp32_accumulate(a.values, b.values), decode, out_dtype, bias)


def scaled_linear(x: GemmOperand, w: GemmOperand, out_dtype: torch.dtype, *, bias: torch.Tensor | None = None,
                  fp8_tail: str | None = None, decode: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for an N-D ``x`` (``[..., in]``) and a ``[out, in]`` weight (:func:`scaled_mm`; two
    unquantized operands go through ``F.linear``, as an unquantized layer)."""
    if not (x.quantized or w.quantized):
        return F.linear(x.values.to(out_dtype), w.values.to(out_dtype), bias)
    out = scaled_mm(x.flat(), w.t(), out_dtype, bias=bias, fp8_tail=fp8_tail, decode=decode).contiguous()
    # not a view of the 2-D product (as torch.matmul returns it): a custom Function's output that is a view
    # could not be modified in place, and copying it would cost one more pass
    return torch.ops.aten._unsafe_view(out, (*x.values.shape[:-1], out.shape[-1]))


def column_sums(g: GemmOperand) -> torch.Tensor:
    """The bias gradient of a 2-D output gradient: its column sums (over the grid: in fp32, then the decode scale)."""
    if not g.quantized:
        return g.values.sum(0)
    return g.values.float().sum(0) * decode_factor(g.scale)
