"""The default selection on many transformers architectures (tiny random configs, 4 blocks).

For each model type: exactly the MLP projections of the middle blocks become HiF8Linear (the expected
names come from the table below, written per architecture, not from the patcher's regex), a warmup
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

VOCAB = 64
NUM_BLOCKS = 4
HIGH_PRECISION = 2  # blocks 0 and 3 stay in high precision: 1 and 2 are quantized
MIDDLE_BLOCKS = (1, 2)
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, **TOKENS)
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
_FALCON = dict(hidden_size=32, ffn_hidden_size=64, num_hidden_layers=NUM_BLOCKS, num_attention_heads=2, **TOKENS)

# model type -> (config kwargs, the decoder blocks' prefix, the MLP linears inside a block, their class name)
ARCHITECTURES = {
    "llama": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    # openPangu-Embedded as the native loader builds it (qat_app/openpangu.py): Llama with q/k/v/o bias
    "openpangu_embedded": (dict(LLAMA_LIKE, attention_bias=True), "model.layers",
                           [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "qwen2": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "qwen3": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "mistral": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "gemma": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "gemma2": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "gemma3_text": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "olmo2": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "granite": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "stablelm": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    "smollm3": (LLAMA_LIKE, "model.layers", [f"mlp.{p}" for p in GATE_UP_DOWN], "Linear"),
    # fused gate+up: one linear, one HiF8Linear (one weight scale for the fused weight, one input scale)
    "phi3": (LLAMA_LIKE, "model.layers", ["mlp.gate_up_proj", "mlp.down_proj"], "Linear"),
    "phi": (LLAMA_LIKE, "model.layers", ["mlp.fc1", "mlp.fc2"], "Linear"),
    "gpt2": (dict(n_embd=32, n_layer=NUM_BLOCKS, n_head=2, n_inner=64, n_positions=64, **TOKENS),
             "transformer.h", ["mlp.c_fc", "mlp.c_proj"], "Conv1D"),
    # fc1/fc2 directly under the decoder layer, no .mlp
    "opt": (dict(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=NUM_BLOCKS,
                 num_attention_heads=2, max_position_embeddings=64, **TOKENS),
            "model.decoder.layers", ["fc1", "fc2"], "Linear"),
    "gpt_neox": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_BLOCKS, num_attention_heads=2,
                      max_position_embeddings=64, **TOKENS),
                 "gpt_neox.layers", ["mlp.dense_h_to_4h", "mlp.dense_4h_to_h"], "Linear"),
    # FalconLinear is an nn.Linear subclass: dequantize_model must give it back
    "falcon": (_FALCON, "transformer.h", ["mlp.dense_h_to_4h", "mlp.dense_4h_to_h"], "FalconLinear"),
    "falcon_bias": (dict(_FALCON, bias=True), "transformer.h", ["mlp.dense_h_to_4h", "mlp.dense_4h_to_h"],
                    "FalconLinear"),
}
MODEL_TYPE = {"falcon_bias": "falcon", "openpangu_embedded": "llama"}  # a case id that is not a model type -> its model type
# falcon_bias: a biased HiF8Linear on a 3-D input, whose output Falcon modifies in place
# (`mlp_output += attention_output`): the output must not be a view made inside the autograd Function.
CASES = [pytest.param(t, id=t) for t in ARCHITECTURES]


def build(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(MODEL_TYPE.get(model_type, model_type), **ARCHITECTURES[model_type][0])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


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
