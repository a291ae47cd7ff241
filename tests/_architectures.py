"""The supported architectures as tiny configs of the real transformers classes: the table the model-matrix tests
and the distillation tests share."""

from __future__ import annotations

import pytest
import torch

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
