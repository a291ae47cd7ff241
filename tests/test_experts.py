"""MoE experts quantized per expert: each expert's scalers see exactly its routed tokens, as a dense
HiF8Linear given the same tokens would; an expert no token reached keeps its history untouched."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from qat_app.hif8.experts import HiF8Experts
from qat_app.hif8.patch import convert_to_hif8_training, dequantize_model, set_quantization
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.recipe import HiF8Recipe, LayerSelection, RuntimeOptions
from qat_app.hif8.scaler_bank import advance_all
from qat_app.hif8.scaling import all_scalers
from tests._tiny_models import moe_model

RECIPE, RUNTIME = HiF8Recipe(amax_algo="max", history_len=3), RuntimeOptions(fused="off")


def convert_experts(model, keep=lambda name: True) -> list[str]:
    """Only the experts modules whose name ``keep`` accepts (a filter_fn selection)."""
    selection = LayerSelection(filter_fn=lambda module, name: name.endswith(".experts") and keep(name))
    return convert_to_hif8_training(model, RECIPE, selection, RUNTIME).modules
E, H, I = 4, 32, 48


def tiny_mixtral():
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2, vocab_size=64)
    model = MixtralForCausalLM(config)
    model.config._experts_implementation = "eager"  # the per-expert loop HiF8Experts runs (not grouped_mm)
    return model


def routing(step: int, tokens: int = 10):
    """Top-2 routing that never picks expert 3."""
    g = torch.Generator().manual_seed(step)
    index = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g).softmax(-1)
    return torch.randn(tokens, H, generator=g), index, weights


def test_per_expert_scalers_equal_a_dense_reference_on_the_routed_tokens():
    model = tiny_mixtral()
    experts = model.model.layers[0].mlp.experts
    (name,) = convert_experts(model, keep=lambda n: n.startswith("model.layers.0."))
    quantized: HiF8Experts = model.get_submodule(name)
    assert isinstance(quantized, HiF8Experts) and quantized.gate_up_proj is experts.gate_up_proj
    # the reference: one dense HiF8Linear per expert and projection, on copies of the same weights
    dense = {}
    for e in range(E):
        for proj, weight in (("gate_up", quantized.gate_up_proj[e]), ("down", quantized.down_proj[e])):
            layer = HiF8Linear(weight.shape[1], weight.shape[0], bias=False, recipe=RECIPE, runtime=RUNTIME)
            with torch.no_grad():
                layer.weight.copy_(weight)
            dense[e, proj] = layer
    act = quantized.act_fn
    for step in range(4):
        x, index, weights = routing(step)
        out = quantized(x, index, weights)
        expected = torch.zeros_like(x)
        for e in range(E):
            top_k_pos, token_idx = torch.where((index == e).T)  # the routed tokens, in the module's order
            if token_idx.numel() == 0:
                continue
            gate, up = dense[e, "gate_up"](x[token_idx]).chunk(2, dim=-1)
            h = dense[e, "down"](act(gate) * up) * weights[token_idx, top_k_pos, None]
            expected.index_add_(0, token_idx, h)
        assert torch.equal(out, expected)
        advance_all(all_scalers(quantized)), advance_all([s for layer in dense.values() for s in layer.scalers()])
    for e in range(E):
        for proj in ("gate_up", "down"):
            ours, ref = getattr(quantized, proj)[e], dense[e, proj]
            for tensor in ("input_scaler", "weight_scaler"):
                a, b = getattr(ours, tensor).state_dict(), getattr(ref, tensor).state_dict()
                for key in a:
                    assert torch.equal(a[key], b[key]), (e, proj, tensor, key)
    never = quantized.gate_up[3].input_scaler
    assert int(never.steps_recorded) == 0 and not never.amax_history.any()  # expert 3 never reached
    assert int(quantized.gate_up[0].input_scaler.steps_recorded) == 4


def test_quantized_mixtral_trains_and_restores():
    model = tiny_mixtral()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids).logits.detach()
    names = convert_experts(model)
    assert len(names) == 2
    set_quantization(model, weights=False, activations=False)
    assert torch.equal(model(input_ids=ids).logits, reference)  # switched off: the same model
    set_quantization(model, weights=True, activations=True)
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        advance_all(all_scalers(model))
    assert torch.isfinite(loss) and model.model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    assert any(int(s.total_numel) > 0 for s in all_scalers(model))
    state = model.state_dict()
    other = tiny_mixtral()
    convert_experts(other)
    other.load_state_dict(state)
    model.eval(), other.eval()
    assert torch.equal(model(input_ids=ids).logits, other(input_ids=ids).logits)
    assert dequantize_model(model) == len(names)
    assert type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_models_quantize_the_experts_of_the_middle_blocks(model_type):
    from qat_app.config import QuantConfig, quantize_model
    from qat_app.hif8.patch import dequantize_model, quantized_linears

    model = moe_model(model_type)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    model.eval()
    reference = model(input_ids=ids).logits.detach()
    report = quantize_model(model, QuantConfig(high_precision_layers=2, fused="off", history_len=2))
    expected = [f"model.layers.{b}.mlp.experts" for b in (1, 2)]
    if model_type == "qwen2_moe":  # the shared expert is a dense MLP: matched like one
        expected += [f"model.layers.{b}.mlp.shared_expert.{p}" for b in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(report.modules) == sorted(expected)
    assert report.quantized_blocks == [1, 2]
    names = [n for n, _ in quantized_linears(model)]
    assert all(".gate." not in n and "router" not in n for n in names)  # routers stay in high precision
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        advance_all(all_scalers(model))
    assert torch.isfinite(loss)
    assert dequantize_model(model) == len(expected)
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, reference)  # no optimizer step: the original model back
