"""The @triton.jit kernel of ``triton_fake_quant`` (imports triton; never import this module directly).

``triton_fake_quant._kernel`` loads this file as a fresh module per mode (interpreter or compiled),
because triton decides at decoration time whether a function runs in the interpreter
(TRITON_INTERPRET=1) and the interpreter runs a kernel's source against its module globals.
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


# bfloat16 <-> float32 by hand on the bit patterns. Compiled, these are the same instructions as the
# native casts (cvt.rn.bf16.f32 rounds to nearest even too); the interpreter's own bf16 casts
# truncate instead of rounding, so doing it here keeps one code path, bit-identical in both modes.
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
    x_ptr, out_ptr, codes_ptr, noise_ptr, scale_ptr, amax_ptr, clipped_ptr,
    n, max_val,
    BLOCK: tl.constexpr, WANT_CODES: tl.constexpr, HAS_NOISE: tl.constexpr, INT64: tl.constexpr,
):
    pid = tl.program_id(0)
    if INT64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        xf = _bf16_to_f32(x)
    else:
        xf = x.to(tl.float32)  # exact widening (or a no-op for float32)

    # amax on the magnitude bit patterns (NaN patterns sort above +inf); masked lanes are +0.
    block_amax = tl.reduce(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0, _max_combine)
    tl.atomic_max(amax_ptr, block_amax, sem="relaxed")

    scale = tl.load(scale_ptr)
    scaled = xf * scale
    over = (tl.abs(scaled) > max_val) & mask  # NaN compares False: not clipped, stays NaN
    n_clipped = tl.reduce(over.to(tl.int32), 0, _add_combine)
    if n_clipped > 0:
        tl.atomic_add(clipped_ptr, n_clipped.to(tl.int64), sem="relaxed")
    clamped = tl.where(over, tl.where(scaled > 0, max_val, -max_val), scaled)

    # HiF8 round to nearest (ties away) on the int32 pattern, as formats.hif8_round_f32.
    bits = clamped.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127
    abs_exp = tl.abs(exp)
    mbits = 3 - (abs_exp > 3).to(tl.int32) - (abs_exp > 7).to(tl.int32)
    mbits = tl.where(exp < -15, 0, mbits)
    shift = 23 - mbits
    if HAS_NOISE:
        noise = tl.load(noise_ptr + offs, mask=mask, other=0)
        increment = noise & ((1 << shift) - 1)
        # round up below 2^-22 with probability |x| / 2^-22 (powers of two: exact); only lanes
        # with exp < -22 use it, the others are zeroed first so the float->int cast never overflows
        tiny_mag = tl.where(exp < -22, mag, 0).to(tl.float32, bitcast=True)
        threshold = (tiny_mag * 4194304.0 * 8388608.0).to(tl.int32)
        tiny = tl.where((noise & 0x7FFFFF) < threshold, 0x34800000, 0)
    else:
        increment = 1 << (shift - 1)
        tiny = tl.where(mag >= 0x34000000, 0x34800000, 0)  # >= 2^-23 (ties away) -> 2^-22
    rounded = (mag + increment) & -(1 << shift)
    rounded = tl.where(exp < -22, tiny, rounded)
    rounded = tl.where(rounded > 0x47000000, 0x7F800000, rounded)  # above 2^15 -> inf
    rounded = tl.where(mag > 0x7F800000, mag, rounded)  # NaN stays NaN
    sign = tl.where(rounded != 0, sign, 0)  # one zero: -0 -> +0
    qbits = rounded | sign
    q = qbits.to(tl.float32, bitcast=True)

    deq = tl.math.div_rn(q, scale)  # IEEE division, bit-identical to torch's q / scale
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + offs, _f32_to_bf16_rtne(deq), mask=mask)
    else:
        tl.store(out_ptr + offs, deq.to(out_ptr.dtype.element_ty), mask=mask)  # float16: round to nearest even

    if WANT_CODES:  # formats.hif8_encode of q (already on the grid)
        r_exp = (rounded >> 23) - 127
        mant3 = (rounded >> 20) & 7
        r_abs = tl.abs(r_exp)
        e_sign = (r_exp < 0).to(tl.int32)
        code = tl.where(r_exp == 0, 0x08 | mant3, 0)
        code = tl.where(r_abs == 1, 0x10 | (e_sign << 3) | mant3, code)
        code = tl.where((r_abs >= 2) & (r_abs <= 3), 0x20 | (e_sign << 4) | ((r_abs - 2) << 3) | mant3, code)
        code = tl.where((r_abs >= 4) & (r_abs <= 7), 0x40 | (e_sign << 4) | ((r_abs - 4) << 2) | (mant3 >> 1), code)
        code = tl.where((r_abs >= 8) & (r_abs <= 15), 0x60 | (e_sign << 4) | ((r_abs - 8) << 1) | (mant3 >> 2), code)
        code = tl.where((r_exp >= -22) & (r_exp <= -16), r_exp + 23, code)
        code = tl.where(rounded == 0, 0, code)
        code = tl.where(rounded == 0x7F800000, 0x6F, code)
        code = tl.where((sign != 0) & (rounded != 0), code | 0x80, code)
        code = tl.where(rounded > 0x7F800000, 0x80, code)
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)

