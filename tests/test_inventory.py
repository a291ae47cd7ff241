"""quantized_modules.json: what was quantized and why the rest was not (the core's inventory of a converted model)."""

import json
import math

import pytest
import torch
from torch import nn

from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.inventory import (BOUNDARY, FILTERED, NOT_MATCHED, block_ranges, inventory_lines, inventory_summary,
                                    quantization_inventory)
from qat_app.hif8.patch import convert_to_hif8_training, quantized_linears
from qat_app.hif8.recipe import HiF8Recipe, LayerSelection, RuntimeOptions
from tests._tiny_models import moe_model

MLP = ("gate_proj", "up_proj", "down_proj")


def strict_json(inventory: dict) -> dict:
    """The inventory as the file holds it (strict JSON: no NaN or inf)."""
    return json.loads(json.dumps(inventory, allow_nan=False))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_lists_exactly_the_quantized_matmuls_and_the_boundary_blocks(tiny_llama, k):
    quant = QuantConfig(high_precision_layers=k, fused="off")
    quantize_model(tiny_llama, quant)
    inventory = strict_json(quantization_inventory(tiny_llama, quant.selection))

    assert [m["name"] for m in inventory["modules"]] == [name for name, _ in quantized_linears(tiny_llama)]
    kept = list(range(math.ceil(k / 2))) + list(range(4 - k // 2, 4))  # the tiny Llama has 4 blocks
    assert inventory["num_blocks"] == 4 and inventory["high_precision_blocks"] == kept
    assert inventory["quantized_blocks"] == [b for b in range(4) if b not in kept]
    for m in inventory["modules"]:
        weight = tiny_llama.get_submodule(m["name"]).weight
        assert m["block"] not in kept and m["weight_shape"] == list(weight.shape) and m["parameters"] == weight.numel()
        assert (m["format"], m["amax_algo"], m["history_len"], m["alpha"], m["max_val"]) == ("hif8", "max", 64, None, 15.0)
        assert m["quantized"] == {"input": True, "weight": True, "grad": False}
    reasons = {}
    for entry in inventory["excluded"]:
        reasons.setdefault(entry["reason"], set()).add(entry["name"])
    assert reasons.get(BOUNDARY, set()) == {f"model.layers.{b}.mlp.{p}" for b in kept for p in MLP}
    linears = [name for name, m in tiny_llama.named_modules() if isinstance(m, nn.Linear)]
    assert reasons[NOT_MATCHED] == {name for name in linears if ".mlp." not in name}  # attention and lm_head
    assert inventory["totals"] == {
        "quantized_modules": 3 * (4 - k), "quantized_linears": 3 * (4 - k), "linears": len(linears),
        "quantized_parameters": sum(tiny_llama.get_submodule(n).weight.numel() for n, _ in quantized_linears(tiny_llama)),
    }
    assert f"high_precision_layers={k}" in inventory["high_precision_reason"]


def test_the_paper_layout_in_a_few_lines():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1536, intermediate_size=6144, num_hidden_layers=26, num_attention_heads=12,
                         num_key_value_heads=12, vocab_size=153376)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quant = QuantConfig(high_precision_layers=5)
    quantize_model(model, quant)
    inventory = quantization_inventory(model, quant.selection)
    lines = inventory_lines(inventory)
    assert len(lines) <= 6  # grouped by block ranges, not one line per module
    assert any(line.split()[:2] == ["blocks", "3-23"] and line.count("mlp.") == 3 for line in lines)
    assert "blocks 0-2, 24-25" in "\n".join(lines) and "594,542,592" in lines[0]
    assert inventory_summary(inventory) == ("63 quantized modules in blocks 3-23 of 26 (594.5M parameters); "
                                            "high precision: blocks 0-2, 24-25")


def test_a_module_filter_excluding_a_module(tiny_llama):
    dropped = "model.layers.2.mlp.down_proj"

    def mlp_but_one(module, name):
        return ".mlp." in name and name != dropped

    selection = LayerSelection(filter_fn=mlp_but_one)
    convert_to_hif8_training(tiny_llama, HiF8Recipe(amax_algo="exp_smooth", alpha=0.25), selection)
    inventory = strict_json(quantization_inventory(tiny_llama, selection))
    names = [m["name"] for m in inventory["modules"]]
    assert dropped not in names and len(names) == 11
    assert {"name": dropped, "block": 2, "reason": FILTERED} in inventory["excluded"]
    assert {e["reason"] for e in inventory["excluded"]} == {FILTERED}  # k and the patterns are not used
    assert inventory["selection"]["filter_fn"].endswith("mlp_but_one")
    assert inventory["high_precision_blocks"] == [] and "module filter" in inventory["high_precision_reason"]
    assert {m["alpha"] for m in inventory["modules"]} == {0.25}


def test_moe_experts_one_entry_per_expert_projection():
    model = moe_model("qwen2_moe")
    quant = QuantConfig(high_precision_layers=1, fused="off")
    report = quantize_model(model, quant)
    inventory = strict_json(quantization_inventory(model, quant.selection))
    names = [m["name"] for m in inventory["modules"]]
    assert names == [name for name, _ in quantized_linears(model)]
    hidden, intermediate, experts = 32, 48, 4
    gate_up = [m for m in inventory["modules"] if m["kind"] == "mlp.experts.gate_up.*"]
    down = [m for m in inventory["modules"] if m["kind"] == "mlp.experts.down.*"]
    assert len(gate_up) == len(down) == experts * 3  # blocks 1-3
    assert {tuple(m["weight_shape"]) for m in gate_up} == {(2 * intermediate, hidden)}
    assert {tuple(m["weight_shape"]) for m in down} == {(hidden, intermediate)}
    assert inventory["totals"]["quantized_parameters"] == report.num_params
    assert {"name": "model.layers.0.mlp.experts", "block": 0, "reason": BOUNDARY} in inventory["excluded"]


def test_the_operands_a_warmup_switches_on(tiny_llama):
    """During a BF16 warmup nothing is quantized yet; the file lists what the run switches on at its end."""
    quant = QuantConfig(high_precision_layers=1, fused="off", quantize_grads=True, quantize_weights=False,
                        quantize_activations=False)
    quantize_model(tiny_llama, quant)
    now = quantization_inventory(tiny_llama, quant.selection)
    assert {json.dumps(m["quantized"]) for m in now["modules"]} == {json.dumps({"input": False, "weight": False,
                                                                               "grad": True})}
    later = quantization_inventory(tiny_llama, quant.selection, {"input": True, "weight": False, "grad": True})
    assert all(m["quantized"] == {"input": True, "weight": False, "grad": True} for m in later["modules"])
    plain = moe_model("mixtral")  # no gradient scaler: the gradient is never quantized, whatever is switched on
    convert_to_hif8_training(plain, runtime=RuntimeOptions(fused="off"), selection=LayerSelection(high_precision_layers=1))
    assert not any(m["quantized"]["grad"] for m in quantization_inventory(plain, LayerSelection(high_precision_layers=1),
                                                                          {"grad": True})["modules"])


def test_block_ranges():
    assert block_ranges([0, 1, 2, 24, 25]) == "0-2, 24-25"
    assert block_ranges([5]) == "5" and block_ranges([]) == "none" and block_ranges([3, 1, 2, 7]) == "1-3, 7"
