"""qat_app.hif8.backends: the Triton HiF8 fake-quant kernel must match the plain-torch reference bit for bit,
and the backend resolution picks it only where it applies.

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set per test), and also on
CUDA tensors with the compiled kernel when a GPU is present. Skips (with the reason) when triton is
not installed.
"""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton) -- the Triton kernel is untested")
import triton.language as tl  # noqa: E402

from qat_app.hif8 import fake_quant  # noqa: E402
from qat_app.hif8.fake_quant import fake_quantize  # noqa: E402
from qat_app.hif8.formats import HIF8_TABLE, hif8_encode  # noqa: E402
from qat_app.hif8.backends import triton as tfq  # noqa: E402
from qat_app.hif8.backends.triton import fake_quantize_triton, supports, triton_available  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # run the @triton.jit kernel on CPU tensors
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def reference(x, scale, max_val, want_codes, noise):
    """The plain-torch reference path."""
    return fake_quantize(x, scale, max_val, "hif8", want_codes=want_codes, noise=noise, fused="off")


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape and ours.device == ref.device
    a, b = ours.cpu(), ref.cpu()
    same = (a.view(INT_VIEW[a.dtype]) == b.view(INT_VIEW[b.dtype])) | (a.isnan() & b.isnan())
    if not same.all():
        bad = torch.nonzero(~same).flatten()[:8]
        raise AssertionError(f"{int((~same).sum())} mismatches, e.g. at {bad.tolist()}: ours {a[bad]}, reference {b[bad]}")


def assert_same_result(ours, ref) -> None:
    for values in ("dequantized", "grid"):  # the one of the two that was asked for
        assert (getattr(ours, values) is None) == (getattr(ref, values) is None)
        if getattr(ref, values) is not None:
            assert_same_bits(getattr(ours, values), getattr(ref, values))
    assert (ours.whatif is None) == (ref.whatif is None)
    if ref.whatif is not None:
        assert ours.whatif.dtype == torch.int64 and ours.whatif.tolist() == ref.whatif.tolist()
    assert ours.amax.shape == () and ours.amax.dtype == torch.float32
    assert_same_bits(ours.amax, ref.amax)
    assert ours.clipped.shape == () and ours.clipped.dtype == torch.int64
    assert int(ours.clipped) == int(ref.clipped)
    if ref.codes is None:
        assert ours.codes is None
    else:
        assert ours.codes.dtype == torch.uint8 and ours.codes.shape == ref.codes.shape
        torch.testing.assert_close(ours.codes.cpu(), ref.codes.cpu(), rtol=0, atol=0)


def nasty_tensor(n: int, dtype: torch.dtype, scale: float, max_val: float, seed: int = 0, specials: bool = True):
    """Gaussian bulk plus, after scaling: saturating outliers, values at the clamp edge, HiF8
    denormals and below-denormal values, float32 denormals, signed zeros, NaN and infinities."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * (max_val / scale / 3)
    k = max(n // 20, 1)
    idx = torch.randperm(n, generator=gen)
    tail = torch.cat([
        torch.tensor([1.5, 4, 100, 1e4]) * max_val,  # saturate
        torch.tensor([max_val, np.nextafter(np.float32(max_val), np.float32(np.inf)).item()]),  # clamp edge
        torch.tensor([2.0**-23, 2.0**-22, 1.5 * 2**-22, 2.0**-17, 2.0**-16, 2.0**-24, 1.2 * 2.0**-23, 3 * 2.0**-18]),
    ])
    if specials:
        tail = torch.cat([tail, torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("-inf"), float("nan")])])
    tail = tail / scale
    if not specials:  # finite in the input dtype too
        tail = tail.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    sign = torch.where(torch.rand(tail.numel(), generator=gen) < 0.5, -1.0, 1.0)
    tail = tail * sign
    reps = (k + tail.numel() - 1) // tail.numel()
    x[idx[:k]] = tail.repeat(reps)[:k]
    x[idx[k:2 * k]] = torch.rand(k, generator=gen) * 2.0**-14 / scale  # HiF8 denormal range after scaling
    x[idx[2 * k:3 * k]] = torch.rand(k, generator=gen) * 2.0**-21 / scale  # around the smallest denormal 2^-22
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("n,scale,max_val", [
    (1, 2.0, 15.0),
    (4095, 0.37, 15.0),
    (4097, 3.1e3, 15.0),
    (3 * 4096 + 17, 1.0, 32768.0),
    (50_000, 0.011, 448.0),
])
def test_matches_reference_bit_for_bit(device, dtype, n, scale, max_val):
    x = nasty_tensor(n, dtype, scale, max_val, seed=n).to(device)
    s = torch.tensor(scale, device=device)
    ours = fake_quantize_triton(x, s, max_val, want_codes=True)
    ref = reference(x, s, max_val, True, None)
    assert_same_result(ours, ref)
    assert ours.dequantized.device == x.device and ours.codes.device == x.device


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("max_val", [15.0, 32768.0])
def test_grid_values_and_whatif_counts_from_the_same_pass_match_the_reference(device, dtype, max_val):
    """The emulated GEMM's operand (q itself, no division) and the what-if counts under three other scales,
    counted while the tensor is read once: bit for bit the reference's, specials included."""
    x = nasty_tensor(3 * 4096 + 5, dtype, 0.37, max_val, seed=7).to(device)
    s = torch.tensor(0.37, device=device)
    whatif_scales = torch.tensor([0.37, 0.05, 2.9], device=device)
    for grid in (False, True):
        ours = fake_quantize_triton(x, s, max_val, want_codes=True, grid=grid, whatif_scales=whatif_scales)
        ref = fake_quantize(x, s, max_val, "hif8", want_codes=True, fused="off", grid=grid,
                            whatif_scales=whatif_scales)
        assert_same_result(ours, ref)
        assert (ours.grid is not None) == grid and ours.whatif.tolist()[0] == int(ours.clipped)
    counts = ref.whatif.tolist()
    assert min(counts) > 0 and (len(set(counts)) == 3 or max_val > 15)  # three scales, three different counts
    table = HIF8_TABLE[ref.codes.cpu().long()]  # the format's values of the codes, by table
    assert_same_bits(ours.grid.cpu(), table.to(dtype))  # q itself, not q / s
    decoded = fake_quant.dequantize_codes(ref.codes, None, "hif8", dtype)
    assert_same_bits(decoded, ref.grid)  # decoding the codes gives the grid values back


@pytest.mark.parametrize("dtype,tie_bit", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)], ids=["bf16", "fp16"])
def test_output_cast_rounds_ties_to_even(device, dtype, tie_bit):
    """Scales that make q / scale land exactly halfway between two bf16/fp16 values."""
    q = torch.tensor([1.0, 2.0, 0.5, 4.0, 0.25, -1.0, -8.0])
    for odd in (1, 3, 5, 7):
        target = 1.0 + odd * tie_bit  # a tie: odd multiple of half an ulp of the output dtype
        s = torch.tensor(1.0 / target, dtype=torch.float32)
        ties = (q / s) == q * target
        assert ties.all(), "test precondition: q / scale is the exact tie"
        x = q.to(dtype).to(device)  # x * s rounds back to q on the HiF8 grid
        ours = fake_quantize_triton(x, s.to(device), 15.0)
        ref = reference(x, s.to(device), 15.0, False, None)
        assert_same_bits(ours.dequantized, ref.dequantized)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_amax_and_clipped_without_nan(device, dtype):
    x = nasty_tensor(20_000, dtype, 0.5, 15.0, seed=1, specials=False).to(device)
    s = torch.tensor(0.5, device=device)
    ours = fake_quantize_triton(x, s, 15.0)
    ref = reference(x, s, 15.0, False, None)
    assert ours.codes is None
    assert_same_result(ours, ref)
    assert torch.isfinite(ours.amax) and ours.amax.item() == x.float().abs().max().item()
    assert ours.clipped.item() > 0


def test_nan_and_inf_reach_amax(device):
    s = torch.tensor(1.0, device=device)
    x = torch.randn(10_000, device=device)
    x[9_999] = float("-inf")  # in the last, partial block
    assert fake_quantize_triton(x, s, 15.0).amax.item() == float("inf")
    x[123] = float("nan")  # NaN wins over inf, wherever the programs finish
    for nan in (float("nan"), -float("nan")):
        x[123] = nan
        r = fake_quantize_triton(x, s, 15.0, want_codes=True)
        assert torch.isnan(r.amax)
        assert torch.isnan(r.dequantized[123]) and r.codes[123].item() == 0x80
        assert r.dequantized[9_999].item() == -15.0 and r.clipped.item() == int((x.abs() > 15).sum())


def test_all_zero_and_negative_zero(device):
    x = torch.zeros(5000, device=device)
    x[::2] = -0.0
    r = fake_quantize_triton(x, torch.tensor(3.0, device=device), 15.0, want_codes=True)
    assert r.amax.item() == 0.0 and not torch.signbit(r.amax)
    assert not torch.signbit(r.dequantized).any()  # HiF8 has one zero
    assert (r.codes == 0).all() and r.clipped.item() == 0


def _dense_sweep() -> torch.Tensor:
    """Every HiF8 value, every midpoint and their float32 neighbours, the denormal and overflow edges."""
    grid = np.sort(HIF8_TABLE.numpy()[np.isfinite(HIF8_TABLE.numpy()) & (HIF8_TABLE.numpy() >= 0)])
    grid = np.append(grid, np.float32(49152.0))
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    edges = np.array([0, 2**-24, 2**-23, 2**-22, 2**-16, 2**-15, 32768, 40960, 1e30, np.inf, np.nan, 1e-45, 1.17e-38],
                     dtype=np.float32)
    parts = [grid, mids, edges]
    parts += [np.nextafter(p, np.float32(0)) for p in parts] + [np.nextafter(p, np.float32(np.inf)) for p in parts]
    values = np.concatenate(parts).astype(np.float32)
    return torch.from_numpy(np.concatenate([values, -values]))


def test_dense_sweep_rounding_and_codes(device):
    """No clamping (max_val above the overflow tie) so every rounding branch and inf/NaN code is hit."""
    x = _dense_sweep().to(device)
    s = torch.tensor(1.0, device=device)
    ours = fake_quantize_triton(x, s, 1e38, want_codes=True)
    ref = reference(x, s, 1e38, True, None)
    assert_same_result(ours, ref)
    torch.testing.assert_close(ours.codes.cpu(), hif8_encode(x.cpu()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_stochastic_rounding_noise(device, dtype):
    x = nasty_tensor(9000, dtype, 0.7, 15.0, seed=2).to(device)
    s = torch.tensor(0.7, device=device)
    gen = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32, generator=gen).to(device)
    ours = fake_quantize_triton(x, s, 15.0, want_codes=True, noise=noise)
    ref = reference(x, s, 15.0, True, noise)
    assert_same_result(ours, ref)


def test_shapes_and_non_contiguous_input(device):
    base = nasty_tensor(64 * 70, torch.bfloat16, 1.3, 15.0, seed=4).to(device).view(64, 70)
    x = base.t()  # non-contiguous (70, 64)
    s = torch.tensor(1.3, device=device)
    ours = fake_quantize_triton(x, s, 15.0, want_codes=True)
    ref = reference(x, s, 15.0, True, None)
    assert ours.dequantized.shape == x.shape and ours.codes.shape == x.shape
    assert_same_bits(ours.dequantized, ref.dequantized.contiguous())
    torch.testing.assert_close(ours.codes, ref.codes, rtol=0, atol=0)


def test_round_table_matches_hif8_round_f32():
    """(bits + half) & mask with the kernel's table rows == formats.hif8_round_f32, on every sign and
    exponent row: all rounding boundaries of the finest quantum (+-1 ulp) plus random mantissas."""
    from qat_app.hif8.formats import hif8_round_f32

    gen = torch.Generator().manual_seed(5)
    boundaries = (torch.arange(17) << 19).repeat_interleave(3) + torch.tensor([-1, 0, 1]).repeat(17)
    mantissas = torch.cat([boundaries.clamp(0, (1 << 23) - 1), torch.randint(0, 1 << 23, (1000,), generator=gen)])
    rows = torch.arange(512, dtype=torch.int64)
    bits = ((rows[:, None] << 23) | mantissas[None, :]).flatten().to(torch.int32)
    x = bits.view(torch.float32)
    table = torch.tensor(tfq._round_table_rows(), dtype=torch.int64)
    row = table[(bits.to(torch.int64) & 0xFFFFFFFF) >> 23]
    ours = (bits + row.to(torch.int32)) & (row >> 32).to(torch.int32)
    overflow = x.abs() >= 40960  # the kernel's OVERFLOW select
    ours = torch.where(overflow, torch.where(x < 0, -1, 1) * torch.tensor(float("inf")), ours.view(torch.float32))
    ref = hif8_round_f32(x)
    assert_same_bits(ours, ref)


def test_supports_and_availability(device):
    x = torch.randn(10, device=device)
    assert triton_available(x)
    assert supports("hif8", x)
    assert not supports("e4m3", x) and not supports("e5m2", x)
    assert not supports("hif8", x.double())
    assert not supports("hif8", x[:0])
    assert not supports("hif8", x, scale=torch.ones(2, device=device))
    assert not supports("hif8", x, noise=torch.zeros(10, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="does not handle"):
        fake_quantize_triton(x.double(), torch.tensor(1.0, device=device), 15.0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(10)
    assert not triton_available(x) and not supports("hif8", x)


def test_fake_quantize_uses_triton_only_for_cuda_hif8(monkeypatch):
    """The backend resolution: CPU tensors (even under the interpreter) keep the torch path."""
    from qat_app.hif8.backends import resolve

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("auto", "cpu", "hif8").name == "compiled"  # CPU: torch.compile as before
    assert resolve("off", "cpu", "hif8").name == "reference"
    assert resolve("auto", "cpu", "hif8") is resolve("auto", "cpu", "hif8")  # resolved once, cached
    if torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        x, s = torch.randn(100).cuda(), torch.tensor(1.0).cuda()
        assert resolve("auto", "cuda", "hif8").name == "triton"
        assert resolve("off", "cuda", "hif8").name == "reference"
        assert resolve("on", "cuda", "e4m3").name == "compiled"
        ours = fake_quant.fake_quantize(x, s, 15.0, want_codes=True, fused="on")
        assert_same_result(ours, reference(x, s, 15.0, True, None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter has no fused multiply-add")
def test_markstein_division_is_exact_for_every_hif8_value_and_scale_mantissa(monkeypatch):
    """The kernel's q / scale: r = div_rn(1, s); y = q * r; y += r * (q - y * s) (FMAs). Exhaustive
    over the 252 finite nonzero HiF8 values x all 2^23 float32 mantissas of s, at three scale binades
    (the result only depends on the mantissas while nothing under/overflows, which the kernel's
    2^-60..2^60 guard ensures). ~1 s on an H200."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # decorated below: compiled, not interpreted

    @triton.jit
    def _count_mismatches(q_ptr, nq, bad_ptr, sexp, CORRECTIONS: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        s = ((sexp << 23) | m).to(tl.float32, bitcast=True)
        r = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), s)
        bad = tl.zeros([BLOCK], tl.int32)
        for i in range(nq):
            q = tl.load(q_ptr + i)
            ref = tl.math.div_rn(q + tl.zeros([BLOCK], tl.float32), s)
            y = q * r
            y = tl.fma(tl.fma(-y, s, q), r, y)
            if CORRECTIONS == 2:
                y = tl.fma(tl.fma(-y, s, q), r, y)
            bad += (y.to(tl.int32, bitcast=True) != ref.to(tl.int32, bitcast=True)).to(tl.int32)
        tl.atomic_add(bad_ptr, tl.sum(bad, 0))

    q = HIF8_TABLE[torch.isfinite(HIF8_TABLE) & (HIF8_TABLE != 0)].cuda()
    for sexp in (127 - 60, 127, 127 + 59):
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        _count_mismatches[((1 << 23) // 1024,)](q, q.numel(), bad, sexp, CORRECTIONS=tfq.CORRECTIONS, BLOCK=1024)
        assert bad.item() == 0, f"{bad.item()} inexact quotients for scales in [2^{sexp - 127}, 2^{sexp - 126})"


class FailsOn:
    """A torch.compile backend that fails on the graphs of one function (named in their stack traces) and runs
    every other graph as it is."""

    def __init__(self, function: str) -> None:
        self.marker = f", in {function}\n"
        self.compiled = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if any(self.marker in (node.meta.get("stack_trace") or "") for node in gm.graph.nodes):
            raise RuntimeError("this compiler cannot build it")
        self.compiled += 1
        return gm.forward


def test_a_function_that_fails_to_compile_runs_in_plain_torch_said_once(monkeypatch, caplog):
    """"auto": a compiler that fails on one function (fake_quantize, as torch 2.11's dynamo did) does not stop
    the run: that function runs in plain torch (the same bits), the log names it and the reason once, and the
    others (here the what-if counts) stay compiled. "on" (the graph audits): the error propagates."""
    from qat_app.hif8 import health
    from qat_app.hif8.backends import compiled
    from qat_app.hif8.backends.compiled import CompiledBackend

    compiler = FailsOn("fake_quantize")
    monkeypatch.setattr(compiled, "COMPILER", compiler)
    monkeypatch.delenv("QAT_APP_NO_COMPILE", raising=False)
    torch._dynamo.reset()
    x = nasty_tensor(3 * 257, torch.bfloat16, 0.37, 15.0).view(3, 257)  # 2-D: the shape comes back
    scale, whatif = torch.tensor(0.37), torch.tensor([0.2, 0.37, 1.0])
    with pytest.raises(Exception, match="this compiler cannot build it"):
        CompiledBackend(required=True).quantize(x, scale, 15.0, 15.5, "hif8", True, None, False, whatif)
    backend = CompiledBackend(required=False)
    with caplog.at_level("WARNING", logger="qat_app.hif8.backends.compiled"):
        for grid in (False, True, False):
            ours = backend.quantize(x, scale, 15.0, 15.5, "hif8", True, None, grid, whatif)
            assert_same_result(ours, fake_quantize(x, scale, 15.0, "hif8", want_codes=True, grid=grid,
                                                   whatif_scales=whatif, fused="off"))
        counts = health.whatif_clipped(x, whatif, x.float().abs().amax(), 15.0, 0.0, 15.5, fused="auto")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0] == (
        "torch.compile of qat_app.hif8.backends.reference.fake_quantize failed (RuntimeError at test_backends.py:"
        f"{FailsOn.__call__.__code__.co_firstlineno + 2}: this compiler cannot build it); it runs in plain torch "
        "from now on (the same bits)")
    assert compiler.compiled >= 1  # the what-if counts compiled
    assert counts.tolist() == health.whatif_clipped(x, whatif, x.float().abs().amax(), 15.0, 0.0, 15.5,
                                                    fused="off").tolist()
