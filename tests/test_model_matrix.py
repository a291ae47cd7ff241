"""The default selection on many transformers architectures (tiny random configs, 4 blocks).

For each model type: exactly the MLP projections of the middle blocks become HiF8Linear (the expected
names come from the table in ``tests/_architectures.py``, written per architecture, not from the patcher's regex), a warmup
forward, one scaler advance and a quantized forward+backward give a finite loss and gradients and move
the saturation counters, a state_dict round trip into a freshly built and patched model reproduces the
outputs, and ``dequantize_model`` gives back the original module classes and outputs.
"""

from __future__ import annotations

import pytest
import torch

from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.patch import dequantize_model, quantized_linears, set_quantization
from qat_app.hif8.scaler_bank import advance_all
from qat_app.hif8.scaling import all_scalers
from tests._architectures import ARCHITECTURES, CASES, HIGH_PRECISION, MIDDLE_BLOCKS, NUM_BLOCKS, VOCAB, build


def expected_names(model_type: str) -> set[str]:
    _, prefix, mlp, _ = ARCHITECTURES[model_type]
    return {f"{prefix}.{block}.{name}" for block in MIDDLE_BLOCKS for name in mlp}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("model_type", CASES)
def test_default_selection_train_round_trip_and_restore(model_type):
    quant = QuantConfig(high_precision_layers=HIGH_PRECISION, fused="off")
    model = build(model_type).eval()
    original_types = {name: type(m) for name, m in build(model_type, seed=1).named_modules()}
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)

    # exactly the MLP projections of the middle blocks, nothing else
    report = quantize_model(model, quant)
    want = expected_names(model_type)
    assert {name for name, _ in quantized_linears(model)} == want
    assert sorted(report.modules) == sorted(want) and report.quantized_blocks == list(MIDDLE_BLOCKS)
    assert report.num_blocks == NUM_BLOCKS
    class_name = ARCHITECTURES[model_type][3]
    for name in want:
        assert original_types[name].__name__ == class_name
        layer = model.get_submodule(name)
        # one per-tensor scale for the whole weight (Phi-3: the fused gate_up weight) and one for the input
        assert len(layer.scalers()) == 2 and all(s.scale.numel() == 1 for s in layer.scalers())

    # warmup-like forward (quantization off, observers record), one step advance, then a quantized step
    model.train()
    set_quantization(model, weights=False, activations=False)
    model(input_ids=ids, labels=ids, use_cache=False)
    scalers = all_scalers(model)
    advance_all(scalers)
    assert all(int(s.total_numel) == 0 for s in scalers)  # the warmup quantizes nothing
    set_quantization(model, weights=True, activations=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    for name, layer in quantized_linears(model):
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0, name
        assert int(layer.input_scaler.step_numel) > 0 and int(layer.weight_scaler.step_numel) == layer.weight.numel()
    advance_all(scalers)
    assert all(int(s.total_numel) > 0 for s in scalers)

    # state_dict round trip into a freshly built and patched model
    model.eval()
    quantized = logits(model, ids)
    fresh = build(model_type, seed=1)
    quantize_model(fresh, quant)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(logits(fresh.eval(), ids), quantized)

    # quantization off, then back to the original classes and outputs
    set_quantization(model, weights=False, activations=False)
    switched_off = logits(model, ids)
    assert not torch.equal(switched_off, quantized)  # the quantizers did something
    assert dequantize_model(model) == len(want)
    assert {name: type(m) for name, m in model.named_modules()} == original_types
    restored = logits(model, ids)
    assert torch.equal(restored, before)
    torch.testing.assert_close(restored, switched_off, rtol=0, atol=1e-6)


def test_block_pattern_finds_opt_decoder_layers():
    model = build("opt")
    report = quantize_model(model, QuantConfig(high_precision_layers=0, fused="off"))
    assert report.quantized_blocks == list(range(NUM_BLOCKS))
    assert len(report.modules) == 2 * NUM_BLOCKS
    assert not isinstance(model.model.decoder.layers[1].self_attn.out_proj, HiF8Linear)
