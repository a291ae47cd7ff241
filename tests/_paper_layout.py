"""The paper's layout on an openPangu-Embedded-1B-shaped model (shared by the patching and openPangu tests)."""

from __future__ import annotations

from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.inventory import quantization_inventory
from qat_app.hif8.linear import HiF8Linear


def assert_paper_layout(model) -> None:
    """The paper's layout on an openPangu-Embedded-1B-shaped model: 63 MLP linears of blocks 3-23,
    594,542,592 parameters (in the QuantReport and in quantized_modules.json's totals); attention and lm_head untouched."""
    quant = QuantConfig(high_precision_layers=5)
    report = quantize_model(model, quant)
    assert report.num_linears == 63
    assert report.num_params == 594_542_592
    totals = quantization_inventory(model, quant.selection)["totals"]
    assert totals["quantized_linears"] == totals["quantized_modules"] == 63
    assert totals["quantized_parameters"] == 594_542_592
    assert report.quantized_blocks == list(range(3, 24))
    names = {n for n, m in model.named_modules() if isinstance(m, HiF8Linear)}
    assert names == {f"model.layers.{b}.mlp.{p}" for b in range(3, 24) for p in ("gate_proj", "up_proj", "down_proj")}
    assert not isinstance(model.lm_head, HiF8Linear)
    assert not isinstance(model.model.layers[10].self_attn.q_proj, HiF8Linear)
