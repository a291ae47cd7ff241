"""HiF8 must agree bit for bit with the reference en_dtypes.hifloat8."""

import numpy as np
import pytest
import torch

en_dtypes = pytest.importorskip("en_dtypes")
from qat_app.hif8.formats import (  # noqa: E402
    HIF8_TABLE, get_format, hif8_decode, hif8_encode, hif8_round, hif8_round_f32,
)

HIF8 = en_dtypes.hifloat8


def reference_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(HIF8).astype(np.float32)


def assert_same_bits(ours: np.ndarray, ref: np.ndarray, inputs: np.ndarray) -> None:
    same = (ours.view(np.int32) == ref.view(np.int32)) | (np.isnan(ours) & np.isnan(ref))
    if not same.all():
        bad = np.nonzero(~same)[0][:10]
        raise AssertionError(f"mismatch at inputs {inputs[bad]}: ours {ours[bad]}, reference {ref[bad]}")


def test_all_256_codes_decode_and_round_trip():
    codes = np.arange(256, dtype=np.uint8)
    ref_values = codes.view(HIF8).astype(np.float32)
    assert_same_bits(HIF8_TABLE.numpy(), ref_values, codes)
    assert_same_bits(hif8_decode(torch.from_numpy(codes)).numpy(), ref_values, codes)
    encoded = hif8_encode(torch.from_numpy(ref_values)).numpy()
    finite_or_inf = ~np.isnan(ref_values)
    np.testing.assert_array_equal(encoded[finite_or_inf], codes[finite_or_inf])
    assert (encoded[~finite_or_inf] == 0x80).all()
    # the reference encodes the decoded values back to the same codes too
    np.testing.assert_array_equal(ref_values.astype(HIF8).view(np.uint8)[finite_or_inf], codes[finite_or_inf])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_decode_of_all_codes_matches_the_reference(dtype):
    """The fused decode (backward reads the 8-bit saved tensors through it) over every code and scale bit."""
    from qat_app.hif8.fake_quant import dequantize_codes

    codes = np.arange(256, dtype=np.uint8).repeat(3)  # a length the vector loop does not divide
    scale = torch.tensor(0.75)
    ref = (torch.from_numpy(codes.view(HIF8).astype(np.float32)) / scale).to(dtype)
    for fused in ("off", "on"):
        ours = dequantize_codes(torch.from_numpy(codes), scale, "hif8", dtype, fused=fused)
        assert ours.dtype == dtype
        assert_same_bits(ours.float().numpy(), ref.float().numpy(), codes)


def _dense_sweep() -> np.ndarray:
    """Every binade from 2^-26 to 2^17 at 1/4096 resolution, all midpoints between neighbouring
    HiF8 values and their float32 neighbours, the denormal and overflow edges, both signs."""
    parts = []
    for e in range(-26, 18):
        parts.append(np.float32(2.0**e) * (1 + np.arange(4096, dtype=np.float32) / 4096))
    grid = np.sort(HIF8_TABLE.numpy()[np.isfinite(HIF8_TABLE.numpy()) & (HIF8_TABLE.numpy() >= 0)])
    grid = np.append(grid, np.float32(49152.0))  # the inf code's magnitude: 40960 is the overflow tie
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    parts += [grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))]
    edges = np.array(
        [0, 2**-24, 2**-23, 2**-22, 1.5 * 2**-22, 2**-16, 1.5 * 2**-16, 2**-15, 32768, 40959.996, 40960, 40960.004,
         49152, 1e30, np.inf, np.nan, 1e-45, 1.17e-38], dtype=np.float32)
    parts += [edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(np.inf))]
    values = np.concatenate(parts).astype(np.float32)
    return np.concatenate([values, -values])


def test_dense_sweep_matches_reference_bit_for_bit():
    x = _dense_sweep()
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference_round(x)
        ref_codes = x.astype(HIF8).view(np.uint8)
    ours = hif8_round_f32(torch.from_numpy(x)).numpy()
    assert_same_bits(ours, ref, x)
    np.testing.assert_array_equal(hif8_encode(torch.from_numpy(x)).numpy(), ref_codes)


def test_every_float32_bit_pattern_sampled():
    # a stride coprime to 2^23 visits every mantissa residue across all exponents and both signs
    patterns = (np.arange(0, 2**32, 4099, dtype=np.uint64)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference_round(patterns)
    assert_same_bits(hif8_round_f32(torch.from_numpy(patterns.copy())).numpy(), ref, patterns)


def test_format_facts():
    assert hif8_round_f32(torch.tensor([32768.0, 40959.99, 40960.0, -40960.0])).tolist() == [
        32768.0, 32768.0, float("inf"), float("-inf")]
    # ties away from zero: 1 + 1/16 lies halfway between 1 and 1.125
    assert hif8_round_f32(torch.tensor([1.0625, -1.0625])).tolist() == [1.125, -1.125]
    # one zero: negative values that round to zero give +0
    assert hif8_encode(torch.tensor([-1e-9])).item() == 0
    assert torch.isnan(hif8_round_f32(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_dtype_and_match(dtype):
    torch.manual_seed(0)
    x = (torch.randn(100_000) * torch.logspace(-6, 4, 100_000)).to(dtype)
    out = hif8_round(x)
    assert out.dtype == dtype
    ref = reference_round(x.float().numpy())
    assert_same_bits(out.float().numpy(), ref, x.float().numpy())


def test_stochastic_rounding_is_unbiased_and_stays_on_the_grid():
    gen = torch.Generator().manual_seed(0)
    for value, lo, hi in [(1.03, 1.0, 1.125), (-300.0, -384.0, -256.0), (1.25 * 2**-22, 2**-22, 2**-21), (0.25 * 2**-22, 0.0, 2**-22)]:
        x = torch.full((200_000,), value)
        out = hif8_round(x, stochastic=True, generator=gen)
        assert set(out.unique().tolist()) <= {lo, hi}
        assert abs(out.double().mean().item() - value) < 0.01 * abs(value)


@pytest.mark.parametrize("name,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_torch_float8_formats_behind_the_same_interface(name, dtype):
    fmt = get_format(name)
    x = torch.randn(4096) * 10
    assert torch.equal(fmt.round_f32(x), x.to(dtype).float())
    assert torch.equal(fmt.decode(fmt.encode(x)), x.to(dtype).float())
    with pytest.raises(ValueError, match="unknown format"):
        get_format("int8")
