"""HiF8Linear: forward numerics, STE gradients, saturation counting, switches, 8-bit saved inputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qat_app.config import QuantConfig
from qat_app.hif8.fake_quant import fake_quantize
from qat_app.hif8.formats import hif8_round_f32
from qat_app.hif8.linear import HiF8Linear


def make_layer(seed=0, bias=True, **quant):
    torch.manual_seed(seed)
    plain = nn.Linear(32, 16, bias=bias)
    layer = HiF8Linear.from_linear(plain, **QuantConfig(**{"fused": "off", **quant}).layer_options())
    return plain, layer


def run_step(dtype, shape, seed, **quant):
    """One forward/backward of a layer with fixed scales (input 2.0, weight 30.0); -> (layer, x, output)."""
    _, layer = make_layer(**quant)
    layer.to(dtype)
    set_scale(layer.input_scaler, 2.0)
    set_scale(layer.weight_scaler, 30.0)
    torch.manual_seed(seed)
    x = (torch.randn(*shape, 32) * 4).to(dtype).requires_grad_()
    out = layer(x)
    out.float().pow(2).sum().backward()
    return layer, x, out.detach()


def set_scale(scaler, scale):
    """Give a scaler a history so it uses delayed scaling with exactly this scale."""
    scaler.observe(torch.tensor(scaler.max_val / scale), None, 1)
    scaler.advance()
    assert scaler.scale.item() == pytest.approx(scale)


def reference_fake_quant(x, scale, max_val=15.0):
    return hif8_round_f32((x.float() * scale).clamp(-max_val, max_val)) / scale


def reference_grid(x, scale, max_val=15.0):
    """The grid values of ``x * scale``: what a W8A8 engine multiplies."""
    return hif8_round_f32((x.float() * scale).clamp(-max_val, max_val))


def test_forward_is_linear_of_fake_quantized_tensors():
    plain, layer = make_layer(gemm="dequantize_first")
    set_scale(layer.input_scaler, 4.0)
    set_scale(layer.weight_scaler, 30.0)
    x = torch.randn(3, 5, 32)
    expected = F.linear(reference_fake_quant(x, 4.0), reference_fake_quant(plain.weight.detach(), 30.0), plain.bias)
    assert torch.equal(layer(x), expected)


def test_forward_multiplies_the_grid_values_and_scales_the_fp32_accumulator():
    plain, layer = make_layer()  # gemm: emulated, the default
    set_scale(layer.input_scaler, 4.0)
    set_scale(layer.weight_scaler, 30.0)
    x = torch.randn(3, 5, 32)
    grid_x, grid_w = reference_grid(x, 4.0), reference_grid(plain.weight.detach(), 30.0)
    factor = torch.tensor(1.0 / (4.0 * 30.0), dtype=torch.float64).float()  # 1 / (s_x s_w), rounded once
    expected = (grid_x.reshape(15, 32) @ grid_w.t()) * factor + plain.bias.detach()
    assert torch.equal(layer(x), expected.reshape(3, 5, 16))
    exact = (grid_x.double() @ grid_w.double().t()) / 120.0 + plain.bias.detach().double()
    assert torch.allclose(layer(x).double(), exact, rtol=1e-6, atol=1e-6)  # fp32 accumulation only


def test_ste_gradients_pass_straight_through():
    plain, layer = make_layer()
    set_scale(layer.input_scaler, 4.0)
    set_scale(layer.weight_scaler, 30.0)
    x = (torch.randn(4, 32) * 5).requires_grad_()  # some inputs saturate: STE passes them anyway
    layer(x).pow(2).sum().backward()
    xq = reference_fake_quant(x.detach(), 4.0).requires_grad_()
    wq = reference_fake_quant(plain.weight.detach(), 30.0).requires_grad_()
    b = plain.bias.detach().clone().requires_grad_()
    F.linear(xq, wq, b).pow(2).sum().backward()
    assert torch.allclose(x.grad, xq.grad, atol=1e-6)
    assert torch.allclose(layer.weight.grad, wq.grad, atol=1e-5)
    assert torch.allclose(layer.bias.grad, b.grad, atol=1e-6)


def test_clipped_ste_zeroes_gradients_of_saturated_elements():
    _, layer = make_layer(ste="clipped")
    set_scale(layer.input_scaler, 1.0)  # |x| > 15 saturates
    set_scale(layer.weight_scaler, 30.0)
    x = torch.randn(4, 32)
    x[0, :3] = torch.tensor([20.0, -16.0, 100.0])
    x.requires_grad_()
    layer(x).sum().backward()
    assert (x.grad[0, :3] == 0).all()
    assert (x.grad[1:] != 0).all()


def test_saturation_is_counted_exactly():
    _, layer = make_layer()
    set_scale(layer.input_scaler, 1.0)
    set_scale(layer.weight_scaler, 30.0)
    layer.input_scaler.discard_step()
    x = torch.full((8, 32), 0.5)
    x[2, 7], x[5, 0], x[7, 31] = 15.5, -40.0, 1e4  # three outliers beyond max_val / scale = 15
    x[0, 0] = 15.0  # exactly max_val: representable, not clipped
    layer(x)
    assert layer.input_scaler.step_clipped.item() == 3
    assert layer.input_scaler.step_numel.item() == x.numel()
    assert layer.input_scaler.step_amax.item() == 1e4


def test_switches_off_give_the_plain_linear_and_still_observe():
    plain, layer = make_layer(quantize_weights=False, quantize_activations=False)
    x = torch.randn(6, 32)
    assert torch.equal(layer(x), plain(x))
    assert layer.input_scaler.step_amax.item() == x.abs().max().item()
    assert layer.weight_scaler.step_amax.item() == plain.weight.abs().max().item()


def test_eval_mode_does_not_touch_observers():
    _, layer = make_layer()
    layer.eval()
    layer(torch.randn(2, 32))
    assert layer.input_scaler.step_seen.item() == 0 and layer.weight_scaler.step_seen.item() == 0


def test_weight_is_quantized_once_per_optimizer_step(monkeypatch):
    _, layer = make_layer()
    set_scale(layer.input_scaler, 4.0)
    set_scale(layer.weight_scaler, 30.0)
    calls = []
    for scaler in (layer.input_scaler, layer.weight_scaler):
        original = scaler.quantize
        monkeypatch.setattr(scaler, "quantize", lambda t, *a, _s=scaler, _o=original, **k: (calls.append(_s), _o(t, *a, **k))[1])
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches of one step
        layer(torch.randn(2, 32)).sum().backward()
    assert sum(s is layer.weight_scaler for s in calls) == 1
    assert layer.weight_scaler.step_numel.item() == layer.weight.numel()  # observed once
    before = layer(torch.randn(1, 32))
    opt.step()
    layer.weight_scaler.advance(), layer.input_scaler.advance()
    layer(torch.randn(2, 32))
    assert sum(s is layer.weight_scaler for s in calls) == 2  # new weights -> re-quantized


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ste", ["identity", "clipped"])
def test_8bit_saved_input_gives_identical_gradients(dtype, ste):
    grads = []
    for save_codes in (False, True):
        layer, x, out = run_step(dtype, (3, 7), 1, save_8bit_activations=save_codes, ste=ste)
        grads.append((out, x.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*grads):
        assert a.dtype == dtype and torch.equal(a, b)


def test_output_gradient_quantization_uses_its_own_scaler():
    _, layer = make_layer(quantize_grads=True, grad_stochastic_rounding=False)
    set_scale(layer.input_scaler, 4.0)
    set_scale(layer.weight_scaler, 30.0)
    set_scale(layer.grad_scaler, 224.0)  # grad_max_val 224 / a_hat 1.0
    x = torch.randn(4, 32, requires_grad=True)
    grad_out = torch.randn(4, 16) * 0.3
    layer(x).backward(grad_out)
    assert layer.grad_scaler.step_seen.item() == 1
    assert layer.grad_scaler.step_amax.item() == grad_out.abs().max().item()
    gq = reference_fake_quant(grad_out, 224.0, max_val=224.0)
    assert torch.allclose(layer.bias.grad, gq.sum(0))
    wq = reference_fake_quant(layer.weight.detach(), 30.0)
    assert torch.allclose(x.grad, gq @ wq, atol=1e-6)


def test_current_scaling_uses_each_tensors_own_amax():
    _, layer = make_layer(amax_algo="current")
    x = torch.randn(4, 32) * 7
    y = layer(x)
    scale = 15.0 / x.abs().max()
    w = layer.weight.detach()
    expected = F.linear(reference_fake_quant(x, scale), reference_fake_quant(w, 15.0 / w.abs().max()), layer.bias)
    assert torch.allclose(y, expected, atol=1e-6)
    assert layer.input_scaler.step_clipped.item() == 0  # CTS never saturates


def test_bf16_autocast_quantizes_in_bf16():
    _, layer = make_layer()
    x = torch.randn(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16


@pytest.mark.slow
def test_fused_kernel_is_bit_identical_to_plain_torch():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(257, 129) * 3).to(dtype)
        x[0, 0] = 1e3  # saturates
        scale = torch.tensor(2.5)
        whatif_scales = torch.tensor([2.5, 0.3, 7.0])
        for grid in (False, True):
            ref = fake_quantize(x, scale, 15.0, want_codes=True, fused="off", grid=grid, whatif_scales=whatif_scales)
            fused = fake_quantize(x, scale, 15.0, want_codes=True, fused="on", grid=grid,
                                  whatif_scales=whatif_scales)
            for name, a, b in zip(ref._fields, ref, fused):
                assert (a is None) == (b is None), name
                assert a is None or torch.equal(a, b), name
            assert ref.whatif[0] == ref.clipped and (ref.grid is not None) == grid


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_matches_reference_outputs_and_gradients(dtype):
    """The whole HiF8Linear step (weight codes cache, 8-bit saved input, backward decode) fused vs plain."""
    results = []
    for fused in ("off", "on"):
        layer, x, out = run_step(dtype, (5, 9), 3, fused=fused)
        results.append((out, x.grad, layer.weight.grad, layer.bias.grad,
                        layer.input_scaler.step_amax, layer.input_scaler.step_clipped))
    for a, b in zip(*results):
        assert torch.equal(a, b)
