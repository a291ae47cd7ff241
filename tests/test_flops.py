"""Model FLOPs (qat_app.flops) against torch's FLOP counter (Lightning's measure_flops) on real tiny models."""

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from transformers import AutoConfig, AutoModelForCausalLM

from qat_app.flops import FlopsModel, matmul_parameters


def _model(model_type: str, tied: bool):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                  tie_word_embeddings=tied)
    config._attn_implementation = "eager"  # attention as matmuls, which the FLOP counter sees
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type,tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_forward_flops_equal_torchs_flop_counter(model_type, tied):
    model = _model(model_type, tied)
    batch, seq = 2, 24
    ids = torch.randint(0, 96, (batch, seq))
    counted = measure_flops(model, lambda: model(input_ids=ids).logits)
    # torch counts each matmul and the T x T attention products (q/k/v biases of qwen2 and norms are not)
    assert FlopsModel(model).batch(batch, seq, training=False) == counted


def test_training_flops_are_three_forwards_within_the_counters_accounting():
    """The 6N rule: backward = 2 x forward. torch's counter agrees up to what it leaves out: the first layer's
    input gradient is still counted, the embedding lookup's gradient is no matmul; both are small here."""
    model = _model("llama", tied=True)
    batch, seq = 2, 24
    ids = torch.randint(0, 96, (batch, seq))
    counted = measure_flops(model, lambda: model(input_ids=ids).logits, lambda y: y.sum())
    ours = FlopsModel(model).batch(batch, seq, training=True)
    assert abs(ours - counted) / counted < 0.02


def test_tied_head_counts_as_a_matmul_and_the_lookup_does_not():
    tied, untied = _model("llama", True), _model("llama", False)
    embedding = tied.get_input_embeddings().weight.numel()
    matrices = [sum(p.numel() for p in m.parameters() if p.ndim == 2) for m in (tied, untied)]
    assert matmul_parameters(tied) == matrices[0]  # the lookup out, the tied head in: the same matrix
    assert matmul_parameters(untied) == matrices[1] - embedding
