"""Saturation counted exactly: an element is clipped when the clamp to +-max_val changes its HiF8 value.

The independent reference is en_dtypes' hifloat8 cast: round ``x * s`` with and without the clamp and
count the elements that differ. Plain torch, torch.compile and (under TRITON_INTERPRET=1) the Triton
kernel must all give that count; rounding noise (the element equal to a_hat lands one ulp above 15)
must count as nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qat_app.config import QuantConfig
from qat_app.hif8.fake_quant import compute_scale, fake_quantize, fake_quantize_current
from qat_app.hif8.formats import saturation_threshold
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.scaling import AmaxScaler

en_dtypes = pytest.importorskip("en_dtypes")


def en_dtypes_clipped(x: torch.Tensor, scale: float, max_val: float = 15.0) -> int:
    """Elements whose hifloat8 value changes when x * scale is clamped first (float32 arithmetic)."""
    scaled = x.float().numpy() * np.float32(scale)
    unclamped = scaled.astype(en_dtypes.hifloat8).astype(np.float32)
    clamped = np.clip(scaled, -max_val, max_val).astype(en_dtypes.hifloat8).astype(np.float32)
    same = (unclamped == clamped) | (np.isnan(unclamped) & np.isnan(clamped))  # NaN stays NaN: unchanged
    return int(np.sum(~same))


def backends():
    out = [("plain", {}, "off"), ("compiled", {}, "on")]
    try:
        import triton  # noqa: F401

        out.append(("triton", {"TRITON_INTERPRET": "1"}, "triton"))
    except Exception:
        pass
    return out


def run_backend(kind: str, x: torch.Tensor, scale: torch.Tensor):
    if kind == "triton":
        from qat_app.hif8.backends.triton import fake_quantize_triton

        return fake_quantize_triton(x, scale, 15.0, want_codes=False)
    return fake_quantize(x, scale, 15.0, "hif8", fused=kind)


def test_threshold_is_the_rounding_midpoint_derived_from_the_format():
    assert saturation_threshold("hif8", 15.0) == 15.5  # 15 and 16 are neighbours; 15.5 ties away -> 16
    assert saturation_threshold("hif8", 14.7) == 15.5  # 14.7 rounds to 15 already
    assert saturation_threshold("hif8", 224.0) == 240.0  # the 1-bit tier: 224, 256
    assert saturation_threshold("e5m2", 57344.0) == 61440.0  # the midpoint to inf
    assert math.isnan(saturation_threshold("e4m3", 448.0))  # torch's e4m3 cast saturates: nothing can clip
    for name, max_val in (("hif8", 15.0), ("hif8", 3.3), ("e4m3", 15.0), ("e5m2", 100.0)):
        t = saturation_threshold(name, max_val)
        below = torch.tensor([t], dtype=torch.float32).view(torch.int32).sub(1).view(torch.float32)
        from qat_app.hif8.formats import get_format

        fmt = get_format(name)
        bound = torch.tensor([max_val], dtype=torch.float32)
        assert torch.equal(fmt.round_f32(below), fmt.round_f32(bound))  # the float32 below t: unchanged
        assert not torch.equal(fmt.round_f32(torch.tensor([t])), fmt.round_f32(bound))  # t itself: changed


def test_current_scaling_on_random_tensors_clips_nothing():
    """The issue's reproduction: it printed 81 of 400 before the fix."""
    g = torch.Generator().manual_seed(5)
    counts = [int(fake_quantize_current(torch.randn(4096, generator=g), torch.tensor(1.0), 15.0, 0.0)[0].clipped)
              for _ in range(400)]
    assert sum(c > 0 for c in counts) == 0


@pytest.mark.parametrize("kind,env,fused", backends(), ids=lambda v: v if isinstance(v, str) else "")
def test_unchanged_tensor_under_delayed_scaling_clips_nothing(kind, env, fused, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    g = torch.Generator().manual_seed(7)
    for _ in range(100 if kind != "triton" else 20):
        x = torch.randn(4096, generator=g) * torch.rand((), generator=g) * 10
        scale = compute_scale(x.abs().amax(), 15.0, 0.0, torch.tensor(1.0))  # a_hat == amax
        assert int(run_backend(fused, x, scale).clipped) == 0


@pytest.mark.parametrize("kind,env,fused", backends(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_outliers_count_equals_the_elements_the_clamp_changed(kind, env, fused, dtype, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    g = torch.Generator().manual_seed(11)
    a_hat = 2.0
    scale = torch.tensor(15.0 / a_hat)
    x = torch.randn(20_000, generator=g).clamp(-a_hat, a_hat)
    # outliers over a range of sizes, and the boundary itself: 15.5 / s and the float32 just below it
    boundary = torch.tensor([15.5 / 7.5], dtype=torch.float32)
    just_below = boundary.view(torch.int32).sub(1).view(torch.float32)
    planted = torch.cat([torch.linspace(1.0, 1.1, 300) * a_hat, boundary, -boundary, just_below, -just_below,
                         torch.tensor([a_hat, -a_hat, 1e6, float("inf"), float("nan")])])
    positions = torch.randperm(x.numel(), generator=g)[: planted.numel()]
    x[positions] = planted
    x = x.to(dtype)
    expected = en_dtypes_clipped(x, float(scale))
    assert 150 < expected < 300  # a real mix: some outliers clip, those within half a step do not
    assert int(run_backend(fused, x, scale).clipped) == expected


def test_clipped_ste_mask_uses_the_same_definition():
    layer = HiF8Linear(4, 2, bias=False, **QuantConfig(ste="clipped", amax_algo="max", history_len=2).layer_options())
    with torch.no_grad():  # not the random init: two quantized weights of a column may cancel (x.grad == 0)
        layer.weight.fill_(0.5)
    layer.input_scaler.observe(torch.tensor(2.0), None, 1)
    layer.input_scaler.advance()  # a_hat 2 -> scale 7.5: clipped from |x| >= 15.5 / 7.5
    boundary = float(torch.tensor(15.5 / 7.5, dtype=torch.float32))
    x = torch.tensor([[2.0, 2.05, boundary, 3.0]], requires_grad=True)
    layer(x).sum().backward()
    passes = (x.grad != 0).squeeze(0).tolist()
    assert passes == [True, True, False, False]
    assert int(layer.input_scaler.step_clipped) == 2


def test_scaler_without_a_recorded_step_keeps_current_scaling_and_resumes_alike():
    """advance() of a step that saw nothing must not switch to the initial scale 1.0."""
    scaler = AmaxScaler("max", history_len=4)
    scaler.advance()  # the tensor was not seen
    assert int(scaler.steps_recorded) == 0 and scaler.uses_current_scaling
    layer = HiF8Linear(64, 1, bias=False, **QuantConfig(history_len=4).layer_options())
    layer.input_scaler.advance()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 100
    layer(x)
    assert int(layer.input_scaler.step_clipped) == 0  # current scaling, not scale 1.0 (54 of 64 clipped)
    restored = AmaxScaler("max", history_len=4)
    restored.load_state_dict(scaler.state_dict())
    assert restored.uses_current_scaling == scaler.uses_current_scaling


def test_headroom_and_quantized_element_counts():
    scaler = AmaxScaler("max", history_len=2)
    scaler.observe(torch.tensor(2.0), None, 10)  # warmup: observed, not quantized
    scaler.advance()
    assert int(scaler.total_numel) == 0 and int(scaler.quantized_steps) == 0
    assert math.isinf(float(scaler.min_headroom))
    scaler.observe(torch.tensor(4.0), torch.tensor(3), 10)  # quantized with a_hat 2: headroom 0.5
    scaler.advance()
    scaler.observe(torch.tensor(1.0), torch.tensor(0), 10)  # a_hat 4: headroom 4
    scaler.advance()
    assert float(scaler.last_headroom) == 4.0 and float(scaler.min_headroom) == 0.5
    assert int(scaler.total_numel) == 20 and int(scaler.quantized_steps) == 2
    assert int(scaler.saturation_events) == 1 and int(scaler.total_clipped) == 3


def test_state_dict_without_the_new_buffers_still_loads():
    scaler = AmaxScaler("max", history_len=2)
    scaler.observe(torch.tensor(3.0), torch.tensor(0), 5)
    scaler.advance()
    old = {k: v for k, v in scaler.state_dict().items() if k not in ("quantized_steps", "last_headroom", "min_headroom")}
    restored = AmaxScaler("max", history_len=2)
    restored.load_state_dict(old)  # strict: a checkpoint of the previous layout
    assert float(restored.scale) == 5.0 and not restored.uses_current_scaling
    assert math.isinf(float(restored.min_headroom))
