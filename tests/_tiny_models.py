"""Tiny random Llama checkpoints saved with the embedded SmolLM2 tokenizer, loadable by path like a hub model."""

from __future__ import annotations

import torch


def save_tiny_llama(path, tokenizer, *, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    max_position_embeddings=256, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
