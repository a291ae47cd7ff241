"""HiF8 GEMMs on FP8 tensor cores: the grid values cast to E4M3 exactly, multiplied by ``torch._scaled_mm``.

Every HiF8 value whose scaled magnitude lies in [2^-12, 15] becomes an E4M3 value when multiplied by 16 (a power
of two: exact), and 15 x 16 = 240 stays under E4M3's 448 (``tests/test_gemm.py`` checks all 256 codes). In
general an operand quantized with ``max_val`` is shifted by the largest power of two that keeps ``max_val``
within 448 (16 for 15, 2 for the gradients' 224). What is left, the *tail* (the few grid values below 2^-12 of
the scale: HiF8's denormals and 1-bit tier there, which E4M3 would round), follows ``tail``:

* ``drop``: the tail elements are left out of the product. Each is under 2^-12 / 15 of its tensor's amax, so
  the relative error of a GEMM is bounded by the tail's share of the operands' mass (``tests/test_gemm.py``
  measures it: about 1e-7 on normal data, far below bf16's output rounding);
* ``exact``: the tail, shifted by a further 2^14, is exact in E4M3 too and is carried by extra GEMMs (tail x
  main, main x tail, tail x tail): the product equals the emulated one up to the accumulation order, at up to 4x
  the GEMM work.

``torch._scaled_mm`` takes a row-major first operand and a column-major second one, both with dimensions padded
here to multiples of 16 (zeros: they add nothing). The decode factor is the emulated GEMM's, ``1 / (s_a s_b)``
rounded once to float32, times the shifts' inverse (powers of two: exact), so FP8 and emulation differ only in
the accumulation order; the bias is added and the result rounded once to the output dtype. It runs on FP8 tensor cores
(CUDA sm89 and later) and, in torch >= 2.13, on the CPU (exactly: tests compare it with the emulation).
"""

from __future__ import annotations

import functools
import math

import torch

from .kernel_count import counted_call

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TAIL_DROP, TAIL_EXACT = "drop", "exact"
FP8_TAILS = (TAIL_DROP, TAIL_EXACT)
TAIL_SHIFT = 2.0**14  # the tail's further shift: its values (< 2^-12, >= 2^-22) x 16 x 2^14 land in [2^-4, 64)
ALIGN = 16  # _scaled_mm's dimension granularity on CUDA


def shift_for(max_val: float) -> float:
    """The largest power of two that keeps ``max_val`` within E4M3's range."""
    return 2.0 ** math.floor(math.log2(E4M3_MAX / max_val))


def fp8_available(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``torch._scaled_mm`` can run E4M3 GEMMs on ``device``, why not)."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"this torch ({torch.__version__}) has no torch._scaled_mm / float8_e4m3fn"
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return False, (f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no FP8 tensor cores "
                           "(sm89 Ada, sm90 Hopper or later)")
        return True, ""
    if device.type == "cpu":
        try:
            one = torch.ones(1, 1).to(E4M3)
            torch._scaled_mm(one, one.t(), scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError) as err:
            return False, f"torch._scaled_mm does not run on the CPU in torch {torch.__version__} ({err})"
        return True, ""
    return False, f"no FP8 GEMM on {device.type}"


def _pad(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) padded with zeros to multiples of :data:`ALIGN`."""
    rows, cols = (-x.shape[0]) % ALIGN, (-x.shape[1]) % ALIGN
    return torch.nn.functional.pad(x, (0, cols, 0, rows)) if rows or cols else x


def grid_to_e4m3(values: torch.Tensor, max_val: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid values (``|v| <= max_val``) times :func:`shift_for` ``(max_val)`` -> (the nearest E4M3 values, ties to
    even as every FP8 cast rounds; where they are exact). Exact for every value of magnitude >= 2^-12 of a HiF8
    range of 15; below that (the tail) E4M3 rounds."""
    shifted = values.float() * shift_for(max_val)
    e4m3 = shifted.to(E4M3)
    return e4m3, e4m3.float() == shifted


def e4m3_decode_scale(scale: torch.Tensor, max_val: float) -> torch.Tensor:
    """The float32 factor that turns :func:`grid_to_e4m3`'s values back into ``grid value / scale``:
    ``1 / (scale x shift)``, computed in float64 and rounded once (exact when ``scale`` is a power of two)."""
    return torch.reciprocal(scale.double() * shift_for(max_val)).float()


def e4m3_parts(values: torch.Tensor, max_val: float, tail: str) -> list[tuple[torch.Tensor, float]]:
    """Grid values ``[rows, K]`` -> ``[(E4M3 tensor, shift)]``: the main part, and the tail (``exact``).

    Each E4M3 tensor is padded to multiples of 16 and row-major and holds its grid values times ``shift`` (a power
    of two, so dividing by it again is exact)."""
    padded = _pad(values.float())
    e4m3, exact = grid_to_e4m3(padded, max_val)
    main = e4m3.view(torch.uint8).masked_fill(~exact, 0).view(E4M3)  # the tail left out (0x00 is +0)
    parts = [(main, shift_for(max_val))]
    if tail == TAIL_EXACT:
        tail_shift = shift_for(max_val) * TAIL_SHIFT
        parts.append((torch.where(exact, 0.0, padded * tail_shift).to(E4M3), tail_shift))  # a power of two: exact
    return parts


@functools.lru_cache(maxsize=None)
def _code_tables(fmt_name: str, max_val: float, device: torch.device) -> torch.Tensor:
    """uint8 ``[2, 256]``: for each 8-bit code, the byte of its E4M3 main part and of its tail part (what
    :func:`e4m3_parts` makes of the code's grid value: whether a grid value fits E4M3 depends on its code alone)."""
    from .backends.reference import decode_grid

    grid = decode_grid(torch.arange(256, dtype=torch.uint8), fmt_name).reshape(16, 16)
    main, tail = e4m3_parts(grid, max_val, TAIL_EXACT)
    return torch.stack([main[0].reshape(-1), tail[0].reshape(-1)]).view(torch.uint8).to(device)


def e4m3_parts_of_codes(codes: torch.Tensor, fmt_name: str, max_val: float, tail: str) -> list[tuple[torch.Tensor, float]]:
    """:func:`e4m3_parts` of the grid values whose 8-bit codes are ``codes`` ``[rows, K]``, by a table lookup: one
    pass reading and writing a byte per element, instead of converting and checking 16-bit grid values."""
    tables = _code_tables(fmt_name, float(max_val), codes.device)
    padded = _pad(codes)
    parts = [(_gather(tables[0], padded).view(E4M3), shift_for(max_val))]
    if tail == TAIL_EXACT:
        parts.append((_gather(tables[1], padded).view(E4M3), shift_for(max_val) * TAIL_SHIFT))
    return parts


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    return table[codes.int()]


def _gather(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``table[codes]``: one kernel on a GPU (compiled: the index widening fused into the gather)."""
    if not codes.is_cuda:
        return counted_call("e4m3_from_codes", _lookup, table, codes)
    from .backends.compiled import run_compiled

    return run_compiled(_lookup, table, codes, name="e4m3_from_codes")


def fp8_mm(parts_a: list[tuple[torch.Tensor, float]], rows: int, parts_b: list[tuple[torch.Tensor, float]], cols: int,
           decode: torch.Tensor, out_dtype: torch.dtype, *, decode_in_gemm: bool = True) -> tuple[torch.Tensor, bool]:
    """``(a @ b_t.T) x decode`` in ``out_dtype`` from the E4M3 parts of ``a`` ``[M, K]`` and ``b_t`` ``[N, K]``
    (:func:`e4m3_parts`; ``rows``, ``cols``: M and N before padding); ``decode`` is the emulated GEMM's one float32
    factor ``1 / (s_a s_b)``, rounded once: the emulated product up to the accumulation order.

    On CUDA, one part each (the tail dropped): the factor rides in ``scale_a`` with the shift taken off (a power of
    two: exact), ``scale_b`` is a power of two, so cuBLAS's epilogue computes ``acc x decode`` rounded once to fp32,
    then to ``out_dtype``, with no pass over an fp32 result. Elsewhere (the CPU's ``_scaled_mm`` applies its
    scales to the operands, so a factor there would round each element) and with a tail, ``_scaled_mm``'s scales
    only take the shifts off, so each part is in grid units; the factor then multiplies their fp32 sum in the
    epilogue pass of :func:`.gemm.apply_decode` (also with ``decode_in_gemm`` False: a bias follows the factor).
    Returns (fp32, False): the caller applies the factor, or (``out_dtype``, True): applied."""
    one = torch.ones((), dtype=torch.float32, device=decode.device)
    if decode_in_gemm and len(parts_a) == 1 and len(parts_b) == 1 and parts_a[0][0].is_cuda:
        (a8, shift_a), (b8, shift_b) = parts_a[0], parts_b[0]
        out = torch._scaled_mm(a8, b8.t(), scale_a=decode.reshape(()).float() * (1.0 / shift_a),
                               scale_b=one * (1.0 / shift_b), out_dtype=out_dtype)
        return out[:rows, :cols], True
    out = None
    for a8, shift_a in parts_a:
        for b8, shift_b in parts_b:
            part = torch._scaled_mm(a8, b8.t(), scale_a=one * (1.0 / shift_a), scale_b=one * (1.0 / shift_b),
                                    out_dtype=torch.float32)
            out = part if out is None else out.add_(part)
    return out[:rows, :cols], False
