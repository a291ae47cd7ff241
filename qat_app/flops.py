"""Model FLOPs of a decoder-only causal LM, for throughput and MFU (Lightning's ``flops_per_batch``).

The PaLM appendix-B rule (Chowdhery et al. 2022), which is also Kaplan et al.'s ``6N`` with attention:
per token, a forward costs ``2 N + 4 L d_attn T`` and a training step (forward + backward) three times that,
``6 N + 12 L d_attn T``, where ``N`` counts the weights that take part in a matmul (the matrices but the
input-embedding lookup; a tied ``lm_head`` is a matmul, so it counts; norms' scales and biases are elementwise), ``L`` is the number of layers,
``d_attn`` the attention width (heads x head dim) and ``T`` the sequence length. Like PaLM's, the attention
term counts the full T x T score matrix, not the causal half: it is "model FLOPs", not what a kernel executes.
Fake quantization, norms and activations are not counted (elementwise, not matmuls).
"""

from __future__ import annotations

from torch import nn


def matmul_parameters(model: nn.Module) -> int:
    """N: the weights that take part in a matmul per token (every matrix but the input-embedding lookup)."""
    total = sum(p.numel() for p in model.parameters() if p.ndim >= 2)  # a tied weight is counted once here
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if get_in is not None else None
    if embedding is None:
        return total
    output = get_out() if get_out is not None else None
    tied = output is not None and output.weight is embedding.weight
    return total - embedding.weight.numel() + (output.weight.numel() if tied else 0)


def attention_width(model: nn.Module) -> tuple[int, int]:
    """(L, d_attn) from the model's config; (0, 0) when the config does not say (the attention term is dropped)."""
    config = getattr(model, "config", None)
    if config is None:
        return 0, 0
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not layers or not heads or not hidden:
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(layers), int(heads * head_dim)


class FlopsModel:
    """Forward / training FLOPs of a batch of ``batch x seq_len`` tokens for one model (N, L, d_attn read once)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = matmul_parameters(model)
        self.layers, self.attention = attention_width(model)

    def forward_per_token(self, seq_len: int) -> int:
        return 2 * self.params + 4 * self.layers * self.attention * seq_len

    def batch(self, batch_size: int, seq_len: int, training: bool) -> int:
        """FLOPs of one batch: forward, times 3 with the backward (gradients of activations and weights)."""
        return (3 if training else 1) * self.forward_per_token(seq_len) * batch_size * seq_len
