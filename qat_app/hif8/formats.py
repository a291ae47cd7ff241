"""8-bit floating-point formats: HiF8 (bit-exact with ``en_dtypes.hifloat8``), E4M3 and E5M2.

HiF8 is a tapered float: sign, a prefix-coded *dot* field giving the exponent width D, a
sign-magnitude exponent of D bits, and the remaining bits of mantissa:

    dot  D  exponent |e|   mantissa bits
    11   4  8..15          1
    10   3  4..7           2
    01   2  2..3           3
    001  1  1              3
    0001 0  0              3
    0000 -  denormal       value 2^(m-23), m = 1..7  (2^-22 .. 2^-16)

Max finite 2^15 = 32768; the code of 1.5 * 2^15 is infinity, so magnitudes >= 40960 (the midpoint)
overflow to inf. Rounding is to nearest, ties away from zero. One zero (0x00); 0x80 is NaN.

Rounding works on the float32 bit pattern: adding half a quantum and masking the bits below it
rounds the magnitude to nearest with ties away from zero, and a carry into the exponent field is
exactly the roll-over into the next binade. Every op is elementwise and exact, so eager, compiled
and GPU runs agree bit for bit.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

HIF8_MAX = 32768.0
HIF8_OVERFLOW = 40960.0  # midpoint between 2^15 and 1.5 * 2^15; ties away -> inf
HIF8_MIN_SUBNORMAL = 2.0**-22
HIF8_NAN_CODE = 0x80

_F32_INF_BITS = 0x7F800000
_F32_MAG_MASK = 0x7FFFFFFF
_BITS_2_POW_M22 = (127 - 22) << 23
_BITS_2_POW_M23 = (127 - 23) << 23
_BITS_HIF8_MAX = (127 + 15) << 23


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _mantissa_bits(unbiased_exp: torch.Tensor) -> torch.Tensor:
    """HiF8 mantissa width for a float32 exponent: 3 for |e|<=3, 2 for 4..7, 1 for 8..15, 0 for denormals."""
    magnitude = unbiased_exp.abs()
    bits = 3 - (magnitude > 3).int() - (magnitude > 7).int()
    return torch.where(unbiased_exp < -15, 0, bits)


def hif8_round_f32(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round a float32 tensor to the nearest HiF8 value (ties away from zero), returned as float32.

    ``noise``: optional int32 tensor of uniform random bits in [0, 2^23); when given the rounding is
    stochastic (round up with probability equal to the discarded fraction) instead of to-nearest.
    """
    bits = _f32_bits(x)
    sign = bits & torch.iinfo(torch.int32).min
    mag = bits & _F32_MAG_MASK
    exp = (mag >> 23) - 127
    shift = 23 - _mantissa_bits(exp)
    if noise is None:
        increment = (1 << (shift - 1))
    else:
        increment = noise & ((1 << shift) - 1)
    rounded = (mag + increment) & -(1 << shift)
    # Below 2^-22 the only neighbours are 0 and 2^-22 (midpoint 2^-23, ties away).
    if noise is None:
        tiny = (mag >= _BITS_2_POW_M23).int() * _BITS_2_POW_M22
    else:
        # probability of rounding up = |x| / 2^-22 (noise bits reinterpreted as a fraction of 2^23)
        threshold = (x.abs() * 2.0**22 * 2.0**23).to(torch.int32)
        tiny = ((noise & ((1 << 23) - 1)) < threshold).int() * _BITS_2_POW_M22
    rounded = torch.where(exp < -22, tiny, rounded)
    rounded = torch.where(rounded > _BITS_HIF8_MAX, _F32_INF_BITS, rounded)
    rounded = torch.where(mag > _F32_INF_BITS, mag, rounded)  # NaN stays NaN
    sign = sign * (rounded != 0).int()  # HiF8 has one zero: -0 rounds to +0
    return (rounded | sign).view(torch.float32)


def hif8_round(x: torch.Tensor, stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round to HiF8, keeping the input dtype (float32, bfloat16 and float16 hold every HiF8 value)."""
    noise = None
    if stochastic:
        noise = torch.randint(0, 1 << 23, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    return hif8_round_f32(x.float(), noise).to(x.dtype)


def hif8_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to HiF8 and return the uint8 codes."""
    return hif8_encode_rounded(hif8_round_f32(x.float()))


def hif8_encode_rounded(value: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float32 values already on the HiF8 grid (``hif8_round_f32``'s output)."""
    bits = _f32_bits(value)
    negative = bits < 0
    mag = bits & _F32_MAG_MASK
    exp = (mag >> 23) - 127
    mant3 = (mag >> 20) & 7  # top three mantissa bits of the rounded value
    abs_exp = exp.abs()
    exp_sign = (exp < 0).int()
    code = torch.where(exp == 0, 0x08 | mant3, 0)
    code = torch.where(abs_exp == 1, 0x10 | (exp_sign << 3) | mant3, code)
    code = torch.where((abs_exp >= 2) & (abs_exp <= 3), 0x20 | (exp_sign << 4) | ((abs_exp - 2) << 3) | mant3, code)
    code = torch.where((abs_exp >= 4) & (abs_exp <= 7), 0x40 | (exp_sign << 4) | ((abs_exp - 4) << 2) | (mant3 >> 1), code)
    code = torch.where((abs_exp >= 8) & (abs_exp <= 15), 0x60 | (exp_sign << 4) | ((abs_exp - 8) << 1) | (mant3 >> 2), code)
    code = torch.where((exp >= -22) & (exp <= -16), exp + 23, code)
    code = torch.where(mag == 0, 0, code)
    code = torch.where(mag == _F32_INF_BITS, 0x6F, code)
    code = code | (negative & (mag != 0)).int() * 0x80
    code = torch.where(mag > _F32_INF_BITS, HIF8_NAN_CODE, code)
    return code.to(torch.uint8)


def _decode_code(code: int) -> float:
    if code == HIF8_NAN_CODE:
        return math.nan
    sign = -1.0 if code & 0x80 else 1.0
    c = code & 0x7F
    if c == 0:
        return 0.0
    if c < 0x08:  # denormal
        return sign * 2.0 ** (c - 23)
    if c < 0x10:  # D=0
        exp, mant, mbits = 0, c & 7, 3
    elif c < 0x20:  # D=1
        exp, mant, mbits = (-1 if c & 0x08 else 1), c & 7, 3
    elif c < 0x40:  # D=2
        mag = 2 + ((c >> 3) & 1)
        exp, mant, mbits = (-mag if c & 0x10 else mag), c & 7, 3
    elif c < 0x60:  # D=3
        mag = 4 + ((c >> 2) & 3)
        exp, mant, mbits = (-mag if c & 0x10 else mag), c & 3, 2
    else:  # D=4
        mag = 8 + ((c >> 1) & 7)
        exp, mant, mbits = (-mag if c & 0x10 else mag), c & 1, 1
        if exp == 15 and mant == 1:
            return sign * math.inf
    return sign * (1.0 + mant / (1 << mbits)) * 2.0**exp


HIF8_TABLE = torch.tensor([_decode_code(c) for c in range(256)], dtype=torch.float32)


def hif8_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 HiF8 codes -> values (exact in float32/bfloat16/float16); equals ``HIF8_TABLE[codes]``.

    Built from the bit fields rather than a table lookup: elementwise integer ops vectorize in
    compiled kernels, where a gather from a 256-entry table runs element by element.
    """
    c = codes.to(torch.int32)
    m = c & 0x7F
    exp_negative = torch.where(m < 0x20, (m >> 3) & 1, (m >> 4) & 1)  # D=1 keeps its sign one bit lower
    magnitude = torch.where(
        m >= 0x60, 8 + ((m >> 1) & 7),  # D=4
        torch.where(m >= 0x40, 4 + ((m >> 2) & 3),  # D=3
                    torch.where(m >= 0x20, 2 + ((m >> 3) & 1), (m >= 0x10).int())),  # D=2, D=1, D=0
    )
    mantissa = torch.where(m >= 0x60, (m & 1) << 22, torch.where(m >= 0x40, (m & 3) << 21, (m & 7) << 20))
    exp = torch.where(exp_negative == 1, -magnitude, magnitude)
    bits = ((exp + 127) << 23) | mantissa
    bits = torch.where(m < 0x08, (m + 104) << 23, bits)  # denormals 2^(m-23)
    bits = torch.where(m == 0, 0, bits)
    bits = torch.where(m == 0x6F, _F32_INF_BITS, bits)  # 1.5 * 2^15 is infinity
    bits = torch.where(c >= 0x80, bits | torch.iinfo(torch.int32).min, bits)  # the sign bit
    bits = torch.where(c == HIF8_NAN_CODE, 0x7FC00000, bits)
    return bits.view(torch.float32).to(dtype)


# --------------------------------------------------------------------------------------------
# The small interface the quantizers use, so experiments can swap formats.


@dataclass(frozen=True)
class Float8Format:
    name: str
    max_finite: float
    default_max_val: float  # where a per-tensor scale maps amax to (HiF8: top of the 3-bit tier)
    round_f32: Callable[..., torch.Tensor]  # float32 -> float32 on the format's grid
    encode: Callable[[torch.Tensor], torch.Tensor]  # -> uint8
    decode: Callable[..., torch.Tensor]  # uint8 -> values
    encode_rounded: Callable[[torch.Tensor], torch.Tensor]  # float32 already on the grid -> uint8, no re-rounding
    supports_stochastic: bool = False


def _torch_float8(dtype: torch.dtype, name: str) -> Float8Format:
    finfo = torch.finfo(dtype)

    def round_f32(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        if noise is not None:
            raise ValueError(f"stochastic rounding is only implemented for hif8, not {name}")
        return x.to(dtype).to(torch.float32)

    def encode(x: torch.Tensor) -> torch.Tensor:
        return x.float().to(dtype).view(torch.uint8)

    def decode(codes: torch.Tensor, dtype_out: torch.dtype = torch.float32) -> torch.Tensor:
        return codes.view(dtype).to(dtype_out)

    return Float8Format(name, finfo.max, finfo.max, round_f32, encode, decode, encode_rounded=encode)


FORMATS: dict[str, Float8Format] = {
    "hif8": Float8Format("hif8", HIF8_MAX, 15.0, hif8_round_f32, hif8_encode, hif8_decode, hif8_encode_rounded,
                         supports_stochastic=True),
    "e4m3": _torch_float8(torch.float8_e4m3fn, "e4m3"),
    "e5m2": _torch_float8(torch.float8_e5m2, "e5m2"),
}


def get_format(name: str) -> Float8Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; allowed: {sorted(FORMATS)}") from None


@functools.lru_cache(maxsize=None)
def saturation_threshold(fmt_name: str, max_val: float) -> float:
    """The smallest float32 ``t`` whose rounding differs from that of ``max_val``: an element with
    ``|x * s| >= t`` is *clipped* (clamping it to ``max_val`` changes its quantized value); anything
    below rounds to the same value clamped or not. For HiF8 and max_val 15 it is 15.5, the midpoint to
    16 (ties away from zero). NaN when no value rounds differently (``max_val`` already rounds to inf):
    nothing can clip, and every comparison with NaN is False.

    Derived from the format by a bisection over the float32 bit patterns above ``max_val`` (the
    predicate is monotone: rounding is monotone), so it holds for any format and any ``max_val``.
    """
    fmt = get_format(fmt_name)
    bound = torch.tensor(float(max_val), dtype=torch.float32)
    target = fmt.round_f32(bound.view(1))
    lo, hi = int(_f32_bits(bound.view(1))), _F32_INF_BITS  # round(lo) == target; answer in (lo, hi]

    def differs(bits: int) -> bool:
        value = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
        return not bool(torch.equal(fmt.round_f32(value), target))

    if not differs(hi):
        return math.nan
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if differs(mid) else (mid, hi)
    return float(torch.tensor([hi], dtype=torch.int32).view(torch.float32))
