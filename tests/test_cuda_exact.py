"""Every backend gives the reference's bits on CUDA, on the paths the Triton kernel's delayed scaling does not
cover: current scaling, dequantize with a scale, E4M3 / E5M2, stochastic rounding, fp32 / bf16 / fp16 inputs, and
health's SQNR and what-if. The reference is the plain-torch contract run on the CPU.

Inductor's Triton code divides approximately on NVIDIA GPUs (an H200 measured 232,907 of 2^20 values off for
current scaling through torch.compile), so no graph compiled for CUDA may hold a division: the graph audit below
runs on any machine (the graphs are recorded, not run by inductor). The comparisons run on the CUDA device where
there is one, and, for the backends as they are configured for CUDA, on CPU tensors with the Triton kernel under
its interpreter.
"""

from __future__ import annotations

import operator

import pytest
import torch

from qat_app.hif8 import health
from qat_app.hif8.backends import compiled, resolve
from qat_app.hif8.backends.compiled import CompiledBackend
from qat_app.hif8.fake_quant import dequantize_codes, fake_quantize, fake_quantize_current
from qat_app.hif8.formats import get_format, saturation_threshold

FORMATS = {"hif8": 15.0, "e4m3": 448.0, "e5m2": 57344.0}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def issue_tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal x 3 with every 4099th element x 40 (the measurement that found the mismatch): amax is no power of
    two, so neither is the current scale."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    x[::4099] *= 40
    return x.to(dtype)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a.view(INT_VIEW[a.dtype]) == b.view(INT_VIEW[b.dtype])) | (a.isnan() & b.isnan())).all())


def assert_same(ours, ref) -> None:
    for field in ("dequantized", "grid", "codes", "amax", "clipped", "whatif"):
        mine, theirs = getattr(ours, field), getattr(ref, field)
        if not same_bits(mine, theirs):
            diff = "" if mine is None or theirs is None else f": {int((mine.cpu() != theirs.cpu()).sum())} values differ"
            raise AssertionError(f"{field} differs from the reference{diff}")


# --------------------------------------------------------------------------------------------- the graph audit
DIVISIONS = ("truediv", "div", "reciprocal", "rsqrt")


def _is_division(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in (operator.floordiv, operator.mod):  # integer ops (symbolic sizes): exact
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return any(d in name for d in DIVISIONS) and "floor" not in name


class GraphRecorder:
    """A torch.compile backend that keeps every graph it is given and runs it as it is."""

    def __init__(self) -> None:
        self.divisions: list[str] = []
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.divisions += [f"{node.target} in {node.format_node()}" for node in gm.graph.nodes if _is_division(node)]
        return gm.forward


@pytest.fixture
def recorder(monkeypatch):
    """Graphs compiled from here on go to a :class:`GraphRecorder`; health's compiled code is set up as on CUDA."""
    rec = GraphRecorder()
    monkeypatch.setattr(compiled, "COMPILER", rec)
    monkeypatch.setattr(health, "compiles_exact_division", lambda device_type: False)
    monkeypatch.delenv("QAT_APP_NO_COMPILE", raising=False)
    resolve.cache_clear()
    yield rec
    resolve.cache_clear()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_no_graph_compiled_for_cuda_divides(recorder, fmt):
    """Every path of the backend resolved for CUDA tensors (here run on CPU tensors: the kernel only runs on CUDA,
    so the compiled backend takes every call) and of health's compiled code: the recorded graphs hold no division.
    On the main of before this test the current scale (a reciprocal) and every ``q / scale`` were compiled."""
    torch._dynamo.reset()
    backend = resolve("on", "cuda", fmt)
    max_val = FORMATS[fmt]
    threshold = saturation_threshold(fmt, max_val)
    x = issue_tensor(5000, torch.bfloat16)
    scale = torch.tensor(max_val / 37.3)
    whatif = torch.tensor([0.5, 1.0, 2.0]) * scale
    noise = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32) if fmt == "hif8" else None
    for grid in (False, True):
        backend.quantize(x, scale, max_val, threshold, fmt, True, noise, grid, whatif)
    for power_2 in (False, True):
        result, used = backend.quantize_current(x, scale, max_val, threshold, 1.5, fmt, True, noise, power_2, False)
    backend.dequantize(result.codes, used, fmt, torch.bfloat16)
    fmt_obj = get_format(fmt)
    health.measure_health(x, scale, max_val, fmt_obj, noise, fused="on")
    health.measure_health(x, scale, max_val, fmt_obj, None, fused="on",
                          grid=fake_quantize(x, scale, max_val, fmt, grid=True).grid)
    health.whatif_clipped(x, torch.tensor([0.2, 0.3, 0.4]), x.float().abs().amax(), max_val, 0.0, threshold, "on")
    assert recorder.graphs >= 5
    assert not recorder.divisions, "\n".join(recorder.divisions)


def test_the_audit_sees_a_compiled_division(recorder):
    """The recorder does catch a division where one is compiled (the CPU backend divides inside its graphs)."""
    torch._dynamo.reset()
    cpu = CompiledBackend(required=True, exact_division=False)
    x = issue_tensor(1000, torch.float32)
    cpu.quantize_current(x, torch.tensor(1.0), 15.0, 15.5, 0.0, "hif8", False, None, False, False)
    assert any("reciprocal" in d or "div" in d for d in recorder.divisions)


# ------------------------------------------------------------------------------------------- the comparisons
def cuda_configured_backend(device: str, fmt: str):
    """The backend CUDA tensors get; for ``cpu`` the same classes configured for CUDA, the HiF8 kernel interpreted."""
    if device == "cuda":
        resolve.cache_clear()
        return resolve("on", "cuda", fmt)
    fallback = CompiledBackend(required=True, exact_division=True)
    if fmt != "hif8":
        return fallback
    from qat_app.hif8.backends.triton import TritonBackend

    return TritonBackend(fallback, required=True)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request, monkeypatch):
    if request.param == "cpu":
        pytest.importorskip("triton", reason="triton is not installed: the kernel's interpreter is untested")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param


def sizes(device: str) -> int:
    return 2**20 if device == "cuda" else 3 * 4099 + 5  # the interpreter runs in numpy


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_delayed_and_current_scaling_match_the_reference(device, fmt, dtype):
    backend = cuda_configured_backend(device, fmt)
    max_val = FORMATS[fmt]
    threshold = saturation_threshold(fmt, max_val)
    x = issue_tensor(sizes(device), dtype)
    scale = torch.tensor(max_val / 41.7)  # no power of two
    whatif = torch.tensor([0.25, 1.0, 3.0]) * scale
    for grid in (False, True):
        ref = fake_quantize(x, scale, max_val, fmt, want_codes=True, grid=grid, whatif_scales=whatif)
        ours = backend.quantize(x.to(device), scale.to(device), max_val, threshold, fmt, True, None, grid,
                                whatif.to(device))
        assert_same(ours, ref)
    for margin, power_2 in ((0.0, False), (1.0, False), (0.5, False), (0.0, True)):
        ref, ref_scale = fake_quantize_current(x, scale, max_val, margin, fmt, want_codes=True, power_2=power_2)
        ours, our_scale = backend.quantize_current(x.to(device), scale.to(device), max_val, threshold, margin, fmt,
                                                   True, None, power_2, False)
        assert same_bits(our_scale.reshape(()), ref_scale.reshape(())), (our_scale, ref_scale)
        assert_same(ours, ref)
        decoded = backend.dequantize(ours.codes, our_scale, fmt, dtype)
        assert same_bits(decoded, dequantize_codes(ref.codes, ref_scale, fmt, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_stochastic_rounding_matches_the_reference(device, dtype):
    backend = cuda_configured_backend(device, "hif8")
    x = issue_tensor(sizes(device), dtype, seed=1)
    noise = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    scale = torch.tensor(15.0 / 23.9)
    ref = fake_quantize(x, scale, 15.0, "hif8", want_codes=True, noise=noise)
    ours = backend.quantize(x.to(device), scale.to(device), 15.0, 15.5, "hif8", True, noise.to(device), False, None)
    assert_same(ours, ref)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_health_and_whatif_match_the_reference(device, fmt, monkeypatch):
    """Health's counts equal the reference's exactly, its float64 sums to their summation order; the what-if counts
    exactly. On the CPU, health's compiled code is set up as on CUDA (division in plain torch)."""
    if device == "cpu":
        monkeypatch.setattr(health, "compiles_exact_division", lambda device_type: False)
    max_val = FORMATS[fmt]
    fmt_obj = get_format(fmt)
    x = issue_tensor(sizes(device), torch.bfloat16, seed=3)
    scale = torch.tensor(max_val / 31.1)
    ref = health.measure_health(x, scale, max_val, fmt_obj, fused="off")
    ours = health.measure_health(x.to(device), scale.to(device), max_val, fmt_obj, fused="on").cpu()
    counts = [health.FIELDS.index("numel"), health.FIELDS.index("underflow"), *range(health.TIER_OFFSET, len(ref))]
    assert torch.equal(ours[counts], ref[counts])
    torch.testing.assert_close(ours[1:3], ref[1:3], rtol=1e-12, atol=0)
    delayed = torch.tensor([0.5, 1.0, 1.7]) * scale
    amax = x.float().abs().amax()
    for margin in (0.0, -1.0):
        threshold = saturation_threshold(fmt, max_val)
        ref_counts = health.whatif_clipped(x, delayed, amax, max_val, margin, threshold, fused="off")
        our_counts = health.whatif_clipped(x.to(device), delayed.to(device), amax.to(device), max_val, margin,
                                           threshold, fused="on")
        assert our_counts.cpu().tolist() == ref_counts.tolist()
