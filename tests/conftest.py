import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_llama():
    """A 4-block random Llama (hidden 64) for fast model-level tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)
