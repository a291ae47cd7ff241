"""The fallback targets are one table (qat_app/hif8/fallback_targets.py): applying each to a real quantized linear
does what the table says (the operand stays quantized or not, the scaler becomes what ``already`` recognises),
the policy refuses a low-SQNR remedy that cannot cure it, every target is documented, and a third target added
as one entry is a policy choice, applied, inventoried and named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from qat_app.config import QuantConfig
from qat_app.hif8 import fallback_targets
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
    assert not target.already(scaler) and layer.quantizes(Operand.INPUT)
    layer.fall_back("input", target.name, step=3, reason="saturation")
    assert layer.quantizes(Operand.INPUT) == target.quantized == (not unquantized_by(layer.fallback["input"]))
    assert operands_quantized(layer)["input"] == target.quantized  # what the inventory reports
    if target.quantized:
        assert target.already(scaler)  # nothing left to cure by the same remedy
    layer(torch.randn(3, 8))  # the matmul runs after the fallback
    assert layer.quantizes(Operand.WEIGHT)  # only the operand that fell back changed


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


THIRD = ('    FallbackTarget("recalibrate", "current scaling, said otherwise", quantized=True, cures_low_sqnr=False,\n'
         '                   apply=lambda scaler: scaler.use_current_scaling(), already=lambda scaler: False),\n')
# loads the targets module with one more entry before anything imports it, then uses it through the policy
SCRIPT = r"""
import importlib.util, json, sys
path, third = sys.argv[1], sys.argv[2]
source = open(path).read().replace("\n)\nBY_NAME = {", "\n" + third + ")\nBY_NAME = {", 1)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("qat_app.hif8.fallback_targets", loader=None))
sys.modules["qat_app.hif8.fallback_targets"] = module
exec(compile(source, path, "exec"), module.__dict__)

import torch
from qat_app.config import QuantConfig
from qat_app.hif8.fallback import SATURATION, FallbackPolicy
from qat_app.hif8.fallback_summary import TARGET_TEXT
from qat_app.hif8.inventory import operands_quantized
from qat_app.hif8.linear import HiF8Linear

policy = FallbackPolicy(on_saturation="recalibrate")
layer = HiF8Linear(8, 4, bias=False, **QuantConfig(amax_algo="max", history_len=2, fused="off").layer_options())
layer.fall_back("input", policy.remedy(SATURATION), step=1, reason=SATURATION)
print(json.dumps({"targets": list(module.FALLBACK_TARGETS), "algo": layer.input_scaler.algo,
                  "quantized": operands_quantized(layer)["input"], "text": TARGET_TEXT["recalibrate"]}))
"""


def test_a_third_target_is_one_entry_of_the_table():
    done = subprocess.run([sys.executable, "-c", SCRIPT, fallback_targets.__file__, THIRD], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"targets": ["current", "high_precision", "recalibrate"], "algo": "current", "quantized": True,
                   "text": "current scaling, said otherwise"}
