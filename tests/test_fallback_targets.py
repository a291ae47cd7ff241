"""The fallback targets are one table (qat_app/hif8/fallback_targets.py): applying each to a real quantized linear
does what the table says (the operand stays quantized or not, the scaler becomes what ``already`` recognises),
the policy refuses a low-SQNR remedy that cannot cure it, and every target is documented."""

from __future__ import annotations

import os

import pytest
import torch

from qat_app.config import QuantConfig
from qat_app.hif8.fallback import FallbackError, FallbackPolicy
from qat_app.hif8.fallback_targets import TARGET_TEXT, TARGETS, unquantized_by
from qat_app.hif8.inventory import operands_quantized
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.operand import Operand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_each_target_does_what_the_table_says(target):
    layer = HiF8Linear(8, 4, bias=False, **QuantConfig(amax_algo="max", history_len=2, fused="off").layer_options())
    scaler = layer.input_scaler
    assert not target.already(scaler) and layer.switched_on(Operand.INPUT)
    layer.fall_back("input", target.name, step=3, reason="saturation")
    assert layer.switched_on(Operand.INPUT) == target.quantized == (not unquantized_by(layer.fallback["input"]))
    assert operands_quantized(layer)["input"] == target.quantized  # what the inventory reports
    if target.quantized:
        assert target.already(scaler)  # nothing left to cure by the same remedy
    layer(torch.randn(3, 8))  # the matmul runs after the fallback
    assert layer.switched_on(Operand.WEIGHT)  # only the operand that fell back changed


def test_a_remedy_that_cannot_raise_the_sqnr_is_refused_for_a_floor():
    for target in TARGETS:
        if target.cures_low_sqnr:
            FallbackPolicy(sqnr_floor_db=20.0, on_low_sqnr=target.name)
        else:
            with pytest.raises(FallbackError, match=f"on_low_sqnr: {target.name} cannot cure a low SQNR"):
                FallbackPolicy(sqnr_floor_db=20.0, on_low_sqnr=target.name)


def test_every_target_is_documented():
    page = open(os.path.join(ROOT, "docs", "diagnostics", "fallback.md")).read()
    assert all(f"`{name}`" in page for name in TARGET_TEXT)
