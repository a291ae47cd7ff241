"""The @triton.jit kernel of ``backends.triton`` (imports triton; never import this module directly).

``backends.triton._kernel`` loads this file as a fresh module per mode (interpreter or compiled),
because triton decides at decoration time whether a function runs in the interpreter
(TRITON_INTERPRET=1) and the interpreter runs a kernel's source against its module globals.

The kernel is compute-bound on a GPU if written as the reference is (about 70 integer ops per
element: 3x a clone() on an H200), so the per-element work is cut down, every step still exact:
- HiF8 rounding (and the sign, the one zero, the HiF8 denormals, NaN) is ``(bits + half) & mask``
  with (half, mask) read from a 512-row table indexed by the sign and exponent bits (the rounding
  quantum depends on the exponent only); the table is built from the reference formula.
- codes: a 4096-entry table indexed by sign, exponent and the top 3 mantissa bits of the rounded value.
- ``q / scale``: Markstein's correction ``y = q*r; y += r*(q - y*scale)`` (FMAs) from
  ``r = div_rn(1, scale)`` computed once per program, correctly rounded like an IEEE division when no
  intermediate under/overflows (scale within 2^+-60; otherwise the kernel divides with ``div_rn``).
  Triton's ``/`` and ``tl.fdiv(..., ieee_rounding=True)`` are approximate (div.full.f32) on NVIDIA.
The interpreter has no fused FMA (it multiplies and adds with two roundings) and truncates in its
bfloat16 casts, so under TRITON_INTERPRET=1 the kernel divides with div_rn and converts bf16 by hand.
"""

import triton
import triton.language as tl

# tl.reduce with the standard library's combine functions instead of tl.max/tl.sum: those two are
# @triton.jit functions decorated when triton was imported, so they only work in the interpreter if
# TRITON_INTERPRET was already set then; tl.reduce is a builtin, and the interpreter recognises these
# combine functions and reduces with numpy (a combine function of our own would run element by
# element in Python). Compiled, it is exactly tl.max / tl.sum.
@triton.jit
def _own_max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _own_add(a, b):
    return a + b


_max_combine = getattr(tl.standard, "_elementwise_max", _own_max)
_add_combine = getattr(tl.standard, "_sum_combine", _own_add)


# bfloat16 <-> float32 on the bit patterns, for the interpreter (whose bf16 casts truncate).
@triton.jit
def _bf16_to_f32(v):
    return ((v.to(tl.int16, bitcast=True).to(tl.int32)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_rtne(v):
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # round to nearest even; overflow -> inf
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, bits | 0x00400000, rounded)  # NaN stays NaN
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def hif8_fake_quant_kernel(
    x_ptr, out_ptr, codes_ptr, noise_ptr, scale_ptr, tab_ptr, acc_ptr, whatif_ptr,
    n, max_val, clip_threshold,
    BLOCK: tl.constexpr, WANT_CODES: tl.constexpr, HAS_NOISE: tl.constexpr, INT64: tl.constexpr,
    OVERFLOW: tl.constexpr, CORRECTIONS: tl.constexpr, INTERPRET: tl.constexpr, GRID: tl.constexpr,
    N_WHATIF: tl.constexpr,
):
    """One BLOCK of x per program. acc_ptr: int64[2 + N_WHATIF] zeroed by the caller; the low int32 word of
    acc[0] takes max |x| as float32 bits (atomic max), acc[1] the clipped count (atomic add): elements with
    |x * scale| >= clip_threshold, acc[2 + k] the elements with |x| * whatif[k] >= clip_threshold (the what-if
    scales, float32[N_WHATIF] at whatif_ptr). out_ptr takes q / scale, or q itself with GRID.
    tab_ptr: int64[1024], the 512 rounding rows then the 4096 uint8 codes. codes_ptr / noise_ptr / whatif_ptr
    are None unless WANT_CODES / HAS_NOISE / N_WHATIF (fewer arguments: less launch overhead)."""
    pid = tl.program_id(0)
    if INT64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    amax_ptr = acc_ptr.to(tl.pointer_type(tl.int32))
    clipped_ptr = acc_ptr + 1
    round_tab_ptr = tab_ptr
    code_tab_ptr = (tab_ptr + 512).to(tl.pointer_type(tl.uint8))
    # Full blocks run without a mask so that loads and stores stay vectorised even when n is not a
    # multiple of 16 (triton only vectorises a masked access when it can prove n % 16 == 0).
    if start + BLOCK <= n:
        _quantize_block(x_ptr, out_ptr, codes_ptr, noise_ptr, scale_ptr, round_tab_ptr, code_tab_ptr, amax_ptr,
                        clipped_ptr, whatif_ptr, offs, n, max_val, clip_threshold, False, WANT_CODES, HAS_NOISE,
                        OVERFLOW, CORRECTIONS, INTERPRET, GRID, N_WHATIF)
    else:
        _quantize_block(x_ptr, out_ptr, codes_ptr, noise_ptr, scale_ptr, round_tab_ptr, code_tab_ptr, amax_ptr,
                        clipped_ptr, whatif_ptr, offs, n, max_val, clip_threshold, True, WANT_CODES, HAS_NOISE,
                        OVERFLOW, CORRECTIONS, INTERPRET, GRID, N_WHATIF)


@triton.jit
def _count_clipped(xf, mag_f, mask, clipped_ptr, whatif_ptr, clip_threshold, MASKED: tl.constexpr,
                   N_WHATIF: tl.constexpr):
    """Add the block's clipped elements to acc[1] and, for each what-if scale, those it would clip to acc[2 + k]."""
    # clipped = the clamp changes the rounded value (formats.saturation_threshold); NaN compares False
    over = mag_f >= clip_threshold
    if MASKED:
        over = over & mask
    n_clipped = tl.reduce(over.to(tl.int32), 0, _add_combine)
    if n_clipped > 0:
        tl.atomic_add(clipped_ptr, n_clipped.to(tl.int64), sem="relaxed")
    if N_WHATIF > 0:  # what-if: the same clipping test under the other estimators' scales, from the same read
        magnitude = tl.abs(xf)
        for k in tl.static_range(N_WHATIF):
            hit = magnitude * tl.load(whatif_ptr + k) >= clip_threshold
            if MASKED:
                hit = hit & mask
            n_hit = tl.reduce(hit.to(tl.int32), 0, _add_combine)
            if n_hit > 0:
                tl.atomic_add(clipped_ptr + 1 + k, n_hit.to(tl.int64), sem="relaxed")


@triton.jit
def _round_stochastic(a_bits, sign, noise_ptr, offs, mask, MASKED: tl.constexpr):
    """Stochastic rounding of the clamped magnitudes (bits) -> the HiF8 value's float32 bits:
    formats.hif8_round_f32 with noise, op for op."""
    mag = a_bits
    exp = (mag >> 23) - 127
    abs_exp = tl.abs(exp)
    mbits = 3 - (abs_exp > 3).to(tl.int32) - (abs_exp > 7).to(tl.int32)
    mbits = tl.where(exp < -15, 0, mbits)
    shift = 23 - mbits
    if MASKED:
        noise = tl.load(noise_ptr + offs, mask=mask, other=0)
    else:
        noise = tl.load(noise_ptr + offs)
    increment = noise & ((1 << shift) - 1)
    # round up below 2^-22 with probability |x| / 2^-22 (powers of two: exact); only lanes
    # with exp < -22 use it, the others are zeroed first so the float->int cast never overflows
    tiny_mag = tl.where(exp < -22, mag, 0).to(tl.float32, bitcast=True)
    threshold = (tiny_mag * 4194304.0 * 8388608.0).to(tl.int32)
    tiny = tl.where((noise & 0x7FFFFF) < threshold, 0x34800000, 0)
    rounded = (mag + increment) & -(1 << shift)
    rounded = tl.where(exp < -22, tiny, rounded)
    rounded = tl.where(rounded > 0x47000000, 0x7F800000, rounded)  # above 2^15 -> inf
    rounded = tl.where(mag > 0x7F800000, mag, rounded)  # NaN stays NaN
    return rounded | tl.where(rounded != 0, sign, 0)  # one zero: -0 -> +0


@triton.jit
def _divide_by_scale(q, qbits, scale, OVERFLOW: tl.constexpr, CORRECTIONS: tl.constexpr, INTERPRET: tl.constexpr,
                     GRID: tl.constexpr):
    """``q / scale`` correctly rounded (Markstein's FMA correction, see the module docstring), or q with GRID."""
    if GRID:  # the grid values themselves (at most 4 significant bits: exact in every output dtype)
        deq = q
    elif INTERPRET:
        deq = tl.math.div_rn(q, scale)
    else:
        if (scale >= 8.673617379884035e-19) & (scale <= 1.152921504606847e18):  # 2^-60 .. 2^60
            r = tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)
            y = q * r
            y = tl.fma(tl.fma(-y, scale, q), r, y)
            if CORRECTIONS == 2:
                y = tl.fma(tl.fma(-y, scale, q), r, y)
            if OVERFLOW:
                y = tl.where((qbits & 0x7FFFFFFF) == 0x7F800000, q * r, y)  # +-inf / scale
            deq = y
        else:
            deq = tl.math.div_rn(q, scale)  # IEEE division, bit-identical to torch's q / scale
    return deq


@triton.jit
def _quantize_block(
    x_ptr, out_ptr, codes_ptr, noise_ptr, scale_ptr, round_tab_ptr, code_tab_ptr, amax_ptr, clipped_ptr, whatif_ptr,
    offs, n, max_val, clip_threshold, MASKED: tl.constexpr, WANT_CODES: tl.constexpr, HAS_NOISE: tl.constexpr,
    OVERFLOW: tl.constexpr, CORRECTIONS: tl.constexpr, INTERPRET: tl.constexpr, GRID: tl.constexpr,
    N_WHATIF: tl.constexpr,
):
    """Load one block, record its amax and clipped counts, round it to HiF8, store q / scale (and the codes)."""
    if MASKED:
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    else:
        mask = None
        x = tl.load(x_ptr + offs)
    if INTERPRET and x_ptr.dtype.element_ty == tl.bfloat16:
        xf = _bf16_to_f32(x)
    else:
        xf = x.to(tl.float32)  # exact widening (a no-op for float32)

    # amax on the magnitude bit patterns (NaN patterns sort above +inf); masked lanes are +0.
    block_amax = tl.reduce(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0, _max_combine)
    tl.atomic_max(amax_ptr, block_amax, sem="relaxed")

    scale = tl.load(scale_ptr)
    scaled = xf * scale
    mag_f = tl.abs(scaled)
    _count_clipped(xf, mag_f, mask, clipped_ptr, whatif_ptr, clip_threshold, MASKED, N_WHATIF)
    # clamp(-max_val, max_val) as min(|scaled|, max_val) with scaled's sign; NaN propagates
    a = tl.minimum(mag_f, max_val, propagate_nan=tl.PropagateNan.ALL)
    a_bits = a.to(tl.int32, bitcast=True)
    sign = scaled.to(tl.int32, bitcast=True) & -2147483648
    bits = a_bits | sign

    if HAS_NOISE:
        qbits = _round_stochastic(a_bits, sign, noise_ptr, offs, mask, MASKED)
    else:  # round to nearest, ties away: one table row per sign and exponent
        row = tl.load(round_tab_ptr + (bits.to(tl.uint32, bitcast=True) >> 23))
        qbits = (bits + row.to(tl.int32)) & (row >> 32).to(tl.int32)
        if OVERFLOW:  # max_val >= 40960: magnitudes from the overflow tie up round to inf
            qbits = tl.where(a >= 40960.0, 0x7F800000 | sign, qbits)
    q = qbits.to(tl.float32, bitcast=True)

    deq = _divide_by_scale(q, qbits, scale, OVERFLOW, CORRECTIONS, INTERPRET, GRID)
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + offs, _f32_to_bf16_rtne(deq), mask=mask)
    else:
        tl.store(out_ptr + offs, deq.to(out_ptr.dtype.element_ty), mask=mask)  # round to nearest even

    if WANT_CODES:  # formats.hif8_encode of q: sign, exponent and 3 mantissa bits index the table
        code = tl.load(code_tab_ptr + (qbits.to(tl.uint32, bitcast=True) >> 20))
        tl.store(codes_ptr + offs, code, mask=mask)
