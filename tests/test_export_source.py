"""One export source: every format writes the 8-bit weights an ExportSource quantized once. The source's codes
and scales decode to the weights the QAT forward uses (checked against the forward's own fake quantization), a
weight whose quantization is off is not among them, each export quantizes every weight exactly once, and a decode
that does not reproduce the quantization is refused naming the weight."""

from __future__ import annotations

import pytest
import torch

from qat_app.config import QuantConfig, quantize_model
from qat_app.export import ExportError, export_compressed_tensors, export_hf, export_hif8
from qat_app.export import source as export_source_module
from qat_app.export.source import export_source
from qat_app.hif8.experts import HiF8Experts
from qat_app.hif8.fake_quant import dequantize_codes
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.scaler_bank import advance_all
from qat_app.hif8.scaling import all_scalers
from qat_app.hif8.operand import Operand
from tests._tiny_models import moe_model, tiny_qat


def test_the_sources_weights_are_what_the_forward_quantizes():
    model = tiny_qat(dtype=torch.float32)
    off = model.get_submodule("model.layers.1.mlp.up_proj")
    off.switch(Operand.WEIGHT, False)  # stored dense by every format
    source = export_source(model, None, "float32", None)
    linears = {name for name, m in model.named_modules() if isinstance(m, HiF8Linear)}
    assert set(source.weights) == linears - {"model.layers.1.mlp.up_proj"}
    for name, (codes, scale) in source.weights.items():
        layer = model.get_submodule(name)
        layer.release_weight_cache()  # quantized now: ``values`` is what the quantization wrote
        used = layer.quantized_weight(layer.weight, layer.weight.dtype).values  # the forward's own weight operand
        assert codes.dtype == torch.uint8 and scale.shape == ()
        assert torch.equal(dequantize_codes(codes, scale, layer.recipe.format, torch.float32), used)
    assert source.weights is source.weights  # quantized once, then kept


@pytest.mark.parametrize("write", ["hif8", "hf-quantized", "compressed-tensors", "int8"])
def test_each_format_quantizes_every_weight_once(write, tmp_path, monkeypatch):
    model = tiny_qat(dtype=torch.float32)
    calls = []
    quantize = export_source_module._quantize_tensor
    monkeypatch.setattr(export_source_module, "_quantize_tensor",
                        lambda weight, owner, dtype: calls.append(owner) or quantize(weight, owner, dtype))
    {"hif8": lambda: export_hif8(model, tmp_path / "out", dtype="float32"),
     "hf-quantized": lambda: export_hf(model, tmp_path / "out", weights="quantized"),
     "compressed-tensors": lambda: export_compressed_tensors(model, tmp_path / "out", dtype="float32"),
     "int8": lambda: export_compressed_tensors(model, tmp_path / "out", dtype="float32", serve_target="cpu")}[write]()
    quantized = [m for m in model.modules() if isinstance(m, HiF8Linear) and m.quantizes(Operand.WEIGHT)]
    assert len(calls) == len(quantized) == 6 and {id(m) for m in calls} == {id(m) for m in quantized}


def test_an_moe_source_holds_each_fused_parameter_expert_by_expert():
    model = moe_model("mixtral")  # 4 blocks: blocks 1-2 quantized (experts only)
    quantize_model(model, QuantConfig(high_precision_layers=2, fused="off", history_len=2))
    model.train()
    for step in range(2):
        with torch.no_grad():
            model(input_ids=torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step)))
        advance_all(all_scalers(model))
    source = export_source(model, None, "float32", None)
    experts = {name: m for name, m in model.named_modules() if isinstance(m, HiF8Experts)}
    assert set(source.weights) == {f"{name}.{param}" for name in experts for param, _ in HiF8Experts.PARAMS}
    for name, module in experts.items():
        for param, _ in HiF8Experts.PARAMS:
            codes, scales = source.weights[f"{name}.{param}"]
            for e, (proj, weight) in enumerate(module.projections(param)):
                proj.release_weight_cache()  # quantized now: ``values`` is what the quantization wrote
                used = proj.quantized_weight(weight, weight.dtype).values  # what the forward multiplies by
                decoded = dequantize_codes(codes[e], scales[e], proj.recipe.format, weight.dtype)
                assert torch.equal(decoded, used) and scales.shape == (module.num_experts,)


def test_codes_that_do_not_decode_to_the_quantized_weight_are_refused_naming_it():
    model = tiny_qat(dtype=torch.float32)
    layer = model.get_submodule("model.layers.1.mlp.up_proj")
    codes, scale, dequantized = export_source_module.quantize_weight(layer)
    kept = export_source_module.stored_codes("up", (codes, scale, dequantized), layer.recipe.format, torch.float32)
    assert kept == (codes, scale) and not hasattr(kept, "dequantized")  # the dequantized copy is not kept
    with pytest.raises(ExportError, match=r"^up: decode\(codes\)/scale does not reproduce"):
        export_source_module.stored_codes("up", (codes, scale * 2, dequantized), layer.recipe.format, torch.float32)
    stacked = (codes[None].repeat(2, 1, 1), scale.repeat(2), dequantized[None].repeat(2, 1, 1))
    bad = (stacked[0], torch.stack([scale, scale * 2]), stacked[2])
    export_source_module.stored_codes("experts.down_proj", stacked, layer.recipe.format, torch.float32)
    with pytest.raises(ExportError, match=r"^experts\.down_proj\[1\]: decode"):
        export_source_module.stored_codes("experts.down_proj", bad, layer.recipe.format, torch.float32)
