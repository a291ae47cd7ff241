"""The quantized GEMM computes like the hardware (qat_app.hif8.gemm, qat_app.hif8.fp8_gemm).

Against an fp64 reference of a W8A8 engine's arithmetic (grid values from en_dtypes, exact products and sums,
the two decode scales, then one rounding to bf16): the emulated path's error is the output rounding alone, in
forward, dgrad and wgrad, while dequantizing first adds about as much again. The HiF8 grid's exactness in E4M3
(what an FP8 tensor core multiplies), over all 256 codes. The decode factor never overflows. The FP8 path
(``torch._scaled_mm``, which runs on the CPU in torch >= 2.13) against the emulation: equal up to the
accumulation order (a bound derived here) with the exact tail, the dropped tail's error measured, odd shapes
padded, and refused by name where it cannot run.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from qat_app.config import QuantConfig
from qat_app.hif8.errors import FieldError, RecipeError
from qat_app.hif8.formats import get_format
from qat_app.hif8.fp8_gemm import (FP8_TAILS, TAIL_DROP, TAIL_EXACT, _pad, e4m3_parts, e4m3_parts_of_codes,
                                   fp8_available, shift_for)
from qat_app.hif8.gemm import GemmOperand, apply_decode, decode_factor, decode_factors, resolve_gemm, scaled_mm
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.recipe import RuntimeOptions
from qat_app.hif8.training import sync_and_advance

en_dtypes = pytest.importorskip("en_dtypes")
HIF8 = en_dtypes.hifloat8
M, K, N = 256, 1024, 512  # the 256x1024 by 1024x512 GEMM


def en_grid(x: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """The HiF8 grid values of ``clamp(x * s, +-15)`` by en_dtypes, as float64."""
    scaled = (x.float() * scale.float()).clamp(-15, 15).numpy()
    return scaled.astype(HIF8).astype(np.float64)


def relative_error(ours: torch.Tensor, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours.double().numpy() - reference) / np.linalg.norm(reference))


def output_rounding_error(reference: np.ndarray) -> float:
    """The error of rounding the exact result to bf16, and nothing else."""
    return relative_error(torch.from_numpy(reference).to(torch.bfloat16), reference)


def bf16_layer(gemm: str, seed: int = 0) -> tuple[HiF8Linear, torch.Tensor]:
    """A bf16 HiF8Linear [K -> N] whose scalers have a history (delayed scales 15 / amax), and an input [M, K]."""
    torch.manual_seed(seed)
    plain = nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
    layer = HiF8Linear.from_linear(plain, **QuantConfig(fused="off", gemm=gemm, amax_algo="most_recent").layer_options())
    x = torch.randn(M, K, dtype=torch.bfloat16) * 3
    for scaler, tensor in ((layer.input_scaler, x), (layer.weight_scaler, layer.weight)):
        scaler.observe(tensor.detach().float().abs().amax(), None, tensor.numel())
        scaler.advance()
    return layer, x


def run(gemm: str):
    layer, x = bf16_layer(gemm)
    x = x.clone().requires_grad_()
    out = layer(x)
    torch.manual_seed(1)
    g = torch.randn_like(out)
    out.backward(g)
    return layer, x, out.detach(), g


@pytest.mark.parametrize("gemm, worse", [("emulated", False), ("dequantize_first", True)])
def test_bf16_gemm_error_is_the_output_rounding_alone(gemm, worse):
    layer, x, out, g = run(gemm)
    s_x, s_w = layer.input_scaler.scale, layer.weight_scaler.scale
    grid_x, grid_w = en_grid(x.detach(), s_x), en_grid(layer.weight.detach(), s_w)
    s_x64, s_w64 = float(s_x), float(s_w)
    g64 = g.double().numpy()
    references = {
        "forward": (out, grid_x @ grid_w.T / (s_x64 * s_w64)),
        "dgrad": (x.grad, g64 @ grid_w / s_w64),
        "wgrad": (layer.weight.grad, g64.T @ grid_x / s_x64),
    }
    for name, (ours, reference) in references.items():
        alone = output_rounding_error(reference)
        error = relative_error(ours, reference)
        assert ours.dtype == torch.bfloat16 and 1.0e-3 < alone < 2.5e-3, name
        if worse:  # q / s rounded to bf16 before the product: a second error of the same size
            assert error > 1.25 * alone, (name, error, alone)
        else:  # the fp32 accumulation adds ~1e-7; a rounding it flips changes the total by far less than 1 %
            assert error == pytest.approx(alone, rel=0.01), (name, error, alone)


def test_the_emulated_grid_operands_are_en_dtypes_values():
    """The forward's operands, decoded from the layer's own codes, are en_dtypes' rounding of x * s."""
    layer, x = bf16_layer("emulated")
    fmt = get_format("hif8")
    result, scale = layer.input_scaler.quantize(x, fmt, want_codes=True)
    assert np.array_equal(fmt.decode(result.codes).double().numpy(), en_grid(x, scale))


def test_the_decode_factor_is_rounded_once_and_does_not_overflow():
    big, small = torch.tensor(3e30), torch.tensor(7e-30)
    assert decode_factor(big, big).item() == 0.0 or decode_factor(big, big).item() > 0  # 1.1e-61: underflows to 0
    assert decode_factor(big, small).item() == pytest.approx(1 / (3e30 * 7e-30), rel=1e-7)  # 2.1e60 / 2.1e60
    assert torch.isfinite(decode_factor(big, small)) and decode_factor(None, None) is None
    s = torch.tensor(15 / 0.37, dtype=torch.float32)
    assert decode_factor(s).item() == torch.tensor(1 / float(s), dtype=torch.float64).float().item()


# ------------------------------------------------------------------------------------------- E4M3
def hif8_magnitudes() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint8)
    values = np.abs(codes.view(HIF8).astype(np.float64))
    return np.unique(values[np.isfinite(values)])


def e4m3_exact(values: np.ndarray) -> np.ndarray:
    cast = torch.from_numpy(values).float().to(torch.float8_e4m3fn).double().numpy()
    return cast == values


@pytest.mark.parametrize("shift, exact_from", [(1.0, 2.0**-8), (16.0, 2.0**-12)])
def test_the_used_hif8_grid_is_exact_in_e4m3_above_a_bound(shift, exact_from):
    """Every HiF8 magnitude the scale maps into (0, 15], times a power-of-two shift, is an E4M3 value from
    ``exact_from`` up (all 256 codes, by en_dtypes and torch's float8_e4m3fn); below it some are not."""
    magnitudes = hif8_magnitudes()
    used = magnitudes[(magnitudes > 0) & (magnitudes <= 15)]
    assert len(used) == 95  # + zero: the 96 used magnitudes
    exact = e4m3_exact(used * shift)
    assert exact[used >= exact_from].all()
    inexact = used[~exact]
    assert len(inexact) == (20 if shift == 1 else 12) and inexact.max() < exact_from
    assert (used * shift).max() <= 448  # E4M3's largest finite value: 15 x 16 = 240
    # below the bound HiF8 keeps at most 1 mantissa bit (denormals down to 2^-22): one shift by 2^14 makes them
    # all E4M3 values (2^-22 -> 2^-8, an E4M3 subnormal; 1.5 x 2^-9 -> 24), so a second GEMM can carry them
    assert e4m3_exact(inexact * 2.0**14).all()


# ------------------------------------------------------------------------------------------- FP8 tensor cores
def grid_operand(shape, scale: float, seed: int, tiny: int = 0) -> GemmOperand:
    """An operand of HiF8 grid values of ``randn * 3`` under ``scale``, with ``tiny`` planted values far below
    2^-12 of the scale (the E4M3 tail)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 3
    s = torch.tensor(scale)
    x.view(-1)[:tiny] = 2.0 ** torch.linspace(-21, -14, tiny) / s  # x * s in [2^-21, 2^-14]: the E4M3 tail
    return GemmOperand(get_format("hif8").round_f32((x * s).clamp(-15, 15)), s)


def accumulation_bound(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """How far two fp32 evaluations of the same exact products may differ: (2K + 4) eps32 (|a| @ |b|) / (s_a s_b)
    (each sum of K terms in any order is within K eps of the exact one; the decode scales add a few roundings)."""
    k = a.values.shape[1]
    eps = torch.finfo(torch.float32).eps
    return (2 * k + 4) * eps * (a.values.abs().double() @ b.values.abs().double()) / float(a.scale * b.scale)


@pytest.mark.parametrize("shape", [(37, 70, 33), (64, 128, 48), (1, 16, 5)])
def test_fp8_exact_tail_equals_the_emulation_up_to_the_accumulation_order(shape):
    m, k, n = shape
    a, b = grid_operand((m, k), 2.7, seed=1, tiny=5), grid_operand((n, k), 41.3, seed=2, tiny=3).t()
    bias = torch.randn(n)
    emulated = scaled_mm(a, b, torch.float32, bias=bias)
    fp8 = scaled_mm(a, b, torch.float32, bias=bias, fp8_tail=TAIL_EXACT)
    assert fp8.shape == (m, n)
    assert ((fp8.double() - emulated.double()).abs() <= accumulation_bound(a, b)).all()


def coarse_grid_operand(shape, scale: float, seed: int) -> GemmOperand:
    """HiF8 grid values of magnitude 1..15 (multiples of 1/8) under a ``scale`` that is no power of two: with K <= 64
    every partial sum of products is a multiple of 2^-6 under 2^14, exact in fp32, so any accumulation order gives
    the same accumulator and the GEMMs may differ only in how they decode it."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 1 + torch.randint(0, 8 * 14 + 1, shape, generator=gen) / 8.0
    values = get_format("hif8").round_f32(magnitude * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0))
    return GemmOperand(values, torch.tensor(scale))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.bfloat16, True)])
@pytest.mark.parametrize("tail", FP8_TAILS)
@pytest.mark.parametrize("scales", [(2.7, 41.3), (0.37, 15 / 7.3), (15 / 3.1, 15 / 0.093)])
def test_fp8_applies_the_emulated_decode_factor_once(tail, scales, out_dtype, with_bias, device):
    """Where the accumulation is exact, fp8 and emulated agree bit for bit: one factor 1 / (s_a s_b) rounded once
    (the two decode scales rounded apart, as _scaled_mm's two scale arguments invite, differ for such scales).
    On CUDA with the tail dropped the factor rides in _scaled_mm's own epilogue, with a bf16 output."""
    if device == "cuda" and not fp8_available("cuda")[0]:
        pytest.skip("no FP8 tensor cores")
    a, b = coarse_grid_operand((48, 64), scales[0], seed=1), coarse_grid_operand((40, 64), scales[1], seed=2).t()
    bias = torch.arange(40, dtype=torch.float32) / 8 - 2.5 if with_bias else None  # added after the factor
    emulated = scaled_mm(a, b, out_dtype, bias=bias)
    a, b = (GemmOperand(op.values.to(device), op.scale.to(device)) for op in (a, b))
    fp8 = scaled_mm(a, b, out_dtype, bias=None if bias is None else bias.to(device), fp8_tail=tail).cpu()
    assert fp8.dtype == out_dtype
    assert torch.equal(fp8, emulated), f"{int((fp8 != emulated).sum())} of {fp8.numel()} differ"
    if out_dtype != torch.float32 or with_bias:
        return
    accumulator = a.values @ b.values  # exact here
    apart = accumulator * (1 / (a.scale.double() * 16)).float() * (1 / (b.scale.double() * 16)).float() * 256
    assert not torch.equal(apart, emulated)  # what two separately rounded scales would give: the test can fail


def test_fp8_drop_leaves_out_the_tail_and_its_error_is_measured():
    a, b = grid_operand((40, 96), 2.7, seed=3, tiny=11), grid_operand((24, 96), 41.3, seed=4, tiny=7).t()
    dropped = scaled_mm(a, b, torch.float32, fp8_tail=TAIL_DROP)
    # the tail, independently: the values that are not E4M3 after the shift (16 for max_val 15)
    def without_tail(op: GemmOperand) -> GemmOperand:
        shifted = op.values * shift_for(15.0)
        keep = shifted.to(torch.float8_e4m3fn).float() == shifted
        return GemmOperand(torch.where(keep, op.values, 0.0), op.scale)
    reference = scaled_mm(without_tail(a), without_tail(b), torch.float32)
    assert ((dropped.double() - reference.double()).abs() <= accumulation_bound(a, b)).all()
    assert (without_tail(a).values != a.values).sum() == 11  # the planted values, and only them, were the tail
    full = scaled_mm(a, b, torch.float32)
    error = float((dropped - full).norm() / full.norm())
    assert 0 < error < 1e-6  # measured on normal data with planted tails: the bound docs/gemm.md states


def test_fp8_pads_to_multiples_of_16():
    values = torch.ones(5, 33)
    padded = _pad(values)
    assert padded.shape == (16, 48) and padded[:5, :33].eq(1).all() and padded.sum() == 5 * 33


@pytest.mark.parametrize("tail", FP8_TAILS)
def test_a_layer_on_fp8_computes_what_the_emulation_computes(tail):
    outs = {}
    for gemm in ("emulated", "fp8"):
        torch.manual_seed(0)
        plain = nn.Linear(48, 40)
        layer = HiF8Linear.from_linear(plain, **QuantConfig(
            fused="off", gemm=gemm, fp8_tail=tail, history_len=4, quantize_grads=True,
            grad_stochastic_rounding=False).layer_options())
        x = (torch.randn(3, 5, 48) * 2).requires_grad_()
        for _ in range(2):  # histories, then one more step with delayed scales everywhere
            layer(x).pow(2).sum().backward()
            sync_and_advance(layer)
        x.grad = layer.weight.grad = layer.bias.grad = None
        out = layer(x)
        out.pow(2).sum().backward()
        outs[gemm] = (out.detach(), x.grad, layer.weight.grad, layer.bias.grad)
    for ours, emulated in zip(outs["fp8"], outs["emulated"]):
        assert torch.allclose(ours, emulated, rtol=1e-5, atol=1e-5 * float(emulated.abs().max()))


def test_fp8_where_it_cannot_run_is_refused_naming_the_setting(caplog):
    with pytest.raises(FieldError, match=r"gemm: fp8 cannot run on meta: no FP8 GEMM on meta; use gemm: emulated"):
        resolve_gemm("fp8", "meta")
    with caplog.at_level(logging.INFO, logger="qat_app.hif8.gemm"):
        assert resolve_gemm("auto", "cpu") == "emulated"  # no FP8 tensor cores on a CPU
        assert resolve_gemm("fp8", "cpu") == "fp8"  # torch._scaled_mm runs on the CPU (torch >= 2.13)
    with pytest.raises(RecipeError, match=r"gemm: unknown value 'fp16'"):
        RuntimeOptions(gemm="fp16")
    with pytest.raises(RecipeError, match=r"fp8_tail: unknown value 'keep'"):
        RuntimeOptions(fp8_tail="keep")


@pytest.mark.parametrize("faster", ["fp8", "emulated"])
def test_auto_picks_the_faster_gemm_where_fp8_tensor_cores_are_and_says_so(monkeypatch, caplog, faster):
    """Timed for real on this machine's GEMMs (a small shape), then with the timings set so that each one wins."""
    from qat_app.hif8 import gemm as gemm_module

    measured = gemm_module.time_gemms(torch.device("cpu"), (64, 32, 48), repeats=2)
    assert set(measured) == {"emulated", "fp8"} and all(t > 0 for t in measured.values())
    monkeypatch.setattr(gemm_module, "_resolved", {})
    monkeypatch.setattr(gemm_module, "fp8_tensor_cores", lambda device: True)
    timings = {"fp8": 1e-3, "emulated": 2e-3} if faster == "fp8" else {"fp8": 3e-3, "emulated": 2e-3}
    monkeypatch.setattr(gemm_module, "time_gemms", lambda device, shape: timings)
    with caplog.at_level(logging.INFO, logger="qat_app.hif8.gemm"):
        assert resolve_gemm("auto", "cpu") == faster
        assert resolve_gemm("auto", "cpu") == faster  # once per device
    lines = [r.getMessage() for r in caplog.records if "gemm=auto" in r.getMessage()]
    assert lines == [f"gemm=auto on cpu: {faster} (a 8192x1536x6144 GEMM: fp8 {timings['fp8'] * 1e3:.3f} ms, "
                     f"emulated {timings['emulated'] * 1e3:.3f} ms)"]


# ------------------------------------------------------------------------------------------- power-of-two scales
def test_power_of_two_scales_round_down_and_keep_the_statistics_consistent():
    from qat_app.hif8.scaling import AmaxScaler

    scaler = AmaxScaler("max", 4, max_val=15.0, power_2=True)
    x = torch.randn(1000) * 2.3
    amax = x.abs().max()
    scaler.observe(amax, None, x.numel())
    scaler.advance()
    exact = 15.0 / float(amax)
    s = float(scaler.scale)
    assert s == 2.0 ** np.floor(np.log2(exact)) and s <= exact < 2 * s  # the power-of-two floor
    assert float(scaler.whatif_scale[2]) == s  # max's what-if column is the real scale
    result, used = scaler.quantize(x, "hif8")
    assert int(result.clipped) == 0 and float(used) == s  # rounding the scale down never clips more
    scaler.observe(result.amax, result.clipped, x.numel())
    scaler.advance()
    # the headroom is that of the estimate the rounded scale stands for: 15 / s >= a_hat
    assert float(scaler.last_headroom) == pytest.approx(15.0 / s / float(amax)) and float(scaler.last_headroom) >= 1.0
    current = AmaxScaler("current", 4, power_2=True)
    _, cts_scale = current.quantize(x, "hif8")
    assert float(cts_scale) == s


def test_with_power_of_two_scales_dequantizing_first_is_exact_too():
    """Scaling by a power of two commutes with every rounding: both GEMM paths give the same bits in fp32."""
    outs = {}
    for gemm in ("emulated", "dequantize_first"):
        torch.manual_seed(0)
        layer = HiF8Linear.from_linear(nn.Linear(48, 24), **QuantConfig(
            fused="off", gemm=gemm, history_len=4, power_2_scales=True).layer_options())
        x = torch.randn(6, 48, requires_grad=True)
        for _ in range(2):
            x.grad = layer.weight.grad = None
            out = layer(x)
            out.pow(2).sum().backward()
            sync_and_advance(layer)
        outs[gemm] = (out.detach(), x.grad, layer.weight.grad)
    assert all(torch.equal(a, b) for a, b in zip(outs["emulated"], outs["dequantize_first"]))


def test_fp8_is_refused_at_start_naming_the_setting(monkeypatch, tmp_path, tiny_model_dir, tiny_corpus):
    """Before the model is loaded, through main.py: a device without FP8 GEMMs stops the run with one line."""
    import main as cli
    from qat_app.errors import ConfigError
    from qat_app.hif8 import gemm as gemm_module
    from tests._cli_runs import write_config

    monkeypatch.setattr(gemm_module, "fp8_available", lambda device: (False, "no FP8 tensor cores here (test)"))
    monkeypatch.setattr(gemm_module, "_resolved", {})
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"model.quant.gemm": "fp8"})
    with pytest.raises(ConfigError, match=r"model\.quant\.gemm: fp8 cannot run on cpu: no FP8 tensor cores here "
                                          r"\(test\); use gemm: emulated"):
        cli.cli_main(["fit", "--config", config])


# ----------------------------------------------------------------------------- the epilogue, the E4M3 operands
def test_a_layers_three_decode_factors_made_at_once_are_decode_factors_bits():
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):  # scales over 2^-60..2^60: products that would overflow or underflow in float32 too
        s_x, s_w = torch.exp(torch.randn(2, generator=gen) * 20)
        made = decode_factors(s_x, s_w)
        assert torch.equal(made, torch.stack([decode_factor(s_x, s_w), decode_factor(s_x), decode_factor(s_w)]))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_epilogue_rounds_as_the_contract_says_in_one_pass(out_dtype, with_bias):
    """acc x decode (+ bias), each rounded to fp32, then once to the output dtype: the same bits as the three ops
    written apart, with the cast done by the last op's write."""
    gen = torch.Generator().manual_seed(5)
    accumulator = torch.randn(64, 48, generator=gen) * 1e3
    decode = torch.tensor(1 / 3.7)
    bias = (torch.randn(48, generator=gen) * 10).to(torch.bfloat16) if with_bias else None
    expected = accumulator * decode
    if bias is not None:
        expected = expected + bias.float()
    ours = apply_decode(accumulator.clone(), decode, out_dtype, bias)
    assert ours.dtype == out_dtype and ours.is_contiguous()
    assert torch.equal(ours, expected.to(out_dtype))


@pytest.mark.parametrize("tail", FP8_TAILS)
@pytest.mark.parametrize("shape", [(16, 256), (37, 70)])
def test_the_e4m3_parts_of_codes_are_those_of_their_grid_values(tail, shape):
    """Whether a grid value is E4M3 depends on its code alone: the table lookup gives the bytes the conversion of
    the decoded grid values gives, for every code (the padding included)."""
    fmt = get_format("hif8")
    codes = torch.arange(256, dtype=torch.uint8).repeat(shape[0] * shape[1] // 256 + 1)[:shape[0] * shape[1]]
    codes = codes[torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(0))].reshape(shape)
    grid = torch.from_numpy(codes.numpy().view(HIF8).astype(np.float32))  # en_dtypes decodes the codes
    ours, theirs = e4m3_parts_of_codes(codes, fmt.name, 15.0, tail), e4m3_parts(grid, 15.0, tail)
    assert len(ours) == len(theirs) == (2 if tail == TAIL_EXACT else 1)
    for (mine, shift), (reference, reference_shift) in zip(ours, theirs):
        assert shift == reference_shift and mine.shape == reference.shape
        assert torch.equal(mine.view(torch.uint8), reference.view(torch.uint8))


@pytest.mark.parametrize("tail", FP8_TAILS)
def test_fp8_from_codes_equals_fp8_from_grid_values(tail):
    a = grid_operand((40, 96), 2.7, seed=3, tiny=11)
    codes = torch.from_numpy(a.values.numpy().astype(HIF8).view(np.uint8))
    b = grid_operand((24, 96), 41.3, seed=4, tiny=7).t()
    with_codes = scaled_mm(GemmOperand(a.values, a.scale, codes=codes), b, torch.bfloat16, fp8_tail=tail)
    assert torch.equal(with_codes, scaled_mm(a, b, torch.bfloat16, fp8_tail=tail))


def test_an_fp8_layer_converts_its_weight_to_e4m3_once_per_optimizer_step(monkeypatch):
    """Micro-batches of one step reuse the weight's E4M3 parts; the step after makes them anew; the outputs are
    those of a layer that converts the weight on every call."""
    from qat_app.hif8 import quantized

    calls = []
    monkeypatch.setattr(quantized, "e4m3_parts_of_codes", lambda *a: calls.append(1) or e4m3_parts_of_codes(*a))
    torch.manual_seed(0)
    layer = HiF8Linear.from_linear(nn.Linear(48, 40, bias=False), **QuantConfig(
        fused="off", gemm="fp8", history_len=4).layer_options())
    x = torch.randn(2, 5, 48)
    layer(x).sum().backward()
    sync_and_advance(layer)
    calls.clear()
    outs = [layer(x) for _ in range(3)]  # three micro-batches
    assert len(calls) == 1
    layer.release_weight_cache()
    assert all(torch.equal(out, layer(x)) for out in outs)
    sync_and_advance(layer)
    calls.clear()
    layer(x)
    assert len(calls) == 1
