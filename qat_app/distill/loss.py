"""The distillation losses through both LM heads, a chunk of tokens at a time.

:func:`final_hidden` runs a causal LM's own forward and keeps what enters its LM head, while the head itself
computes logits for no token. :func:`distill_losses` then takes the positions that have a label, ``chunk``
rows at a time: the student's logits (with gradient) and the teacher's (without), KL(teacher_T || student_T)
and the student's cross-entropy, summed. Each chunk runs under activation checkpointing, so backward keeps only
its inputs and recomputes its logits: no (tokens x vocabulary) tensor of either model ever exists whole. The
model's own post-processing of the logits (Gemma 2/3's soft-capping, Granite's and Cohere's scaling) is
applied by :func:`head_logits`, so the logits equal what ``model(...).logits`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 25  # logits values of one model in one chunk (128 MiB in float32)
IGNORE_INDEX = -100  # transformers' label for a position without a target


@dataclass
class DistillLosses:
    """Sums over the ``tokens`` positions that have a label (device tensors: no host sync)."""

    kl: torch.Tensor
    ce: torch.Tensor
    tokens: torch.Tensor

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        count = self.tokens.clamp_min(1).to(self.kl.dtype)
        return self.kl / count, self.ce / count


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``model``'s LM head on ``hidden``, post-processed as its forward does (the logits ``model(...)`` returns)."""
    logits = model.get_output_embeddings()(hidden)
    config = model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:  # Gemma 2 / 3
        logits = torch.tanh(logits / cap) * cap
    scaling = getattr(config, "logits_scaling", None)
    if scaling and scaling != 1:  # Granite divides
        logits = logits / scaling
    scale = getattr(config, "logit_scale", None)
    if scale and scale != 1:  # Cohere multiplies
        logits = logits * scale
    return logits


def final_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden states ``model``'s LM head receives for ``input_ids`` (its full forward runs, hooks and sharding
    included; the head is handed no token)."""
    captured: list[torch.Tensor] = []

    def keep(module, args):
        captured.append(args[0])
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(model).__name__}: its forward did not call its output embeddings (LM head)")
    return captured[-1]


def chunk_rows(vocab: int, chunk_tokens: int = 0) -> int:
    """Rows per chunk: ``chunk_tokens``, or (0) as many as keep one model's chunk of logits under
    :data:`CHUNK_ELEMENTS`."""
    return chunk_tokens if chunk_tokens > 0 else max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk(student_hidden, teacher_hidden, labels, student, teacher, temperature):
    logits = head_logits(student, student_hidden).float()
    with torch.no_grad():
        target = torch.log_softmax(head_logits(teacher, teacher_hidden).float() / temperature, -1)
    per_row = (target.exp() * (target - torch.log_softmax(logits / temperature, -1))).sum(-1)
    kl = (per_row * (labels != IGNORE_INDEX)).sum()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return kl, ce


def distill_losses(student: nn.Module, teacher: nn.Module, student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                   labels: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 0) -> DistillLosses:
    """KL(teacher_T || student_T) and the student's cross-entropy, summed over the positions with a label.

    ``*_hidden``: ``[B, L, H]`` from :func:`final_hidden`; ``labels``: ``[B, L]`` as transformers takes them
    (position ``t`` predicts ``labels[t + 1]``; ``-100``: no target). The CE equals transformers' causal-LM
    loss times the number of labelled positions. Every position is computed (an unlabelled one with weight 0),
    so the shapes never depend on the data: no host sync."""
    targets = labels[:, 1:].reshape(-1)
    rows_s = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])
    rows_t = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    step = chunk_rows(student.get_output_embeddings().weight.shape[0], chunk_tokens)
    kl = ce = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, targets.shape[0], step):
        end = start + step
        part_kl, part_ce = checkpoint(_chunk, rows_s[start:end], rows_t[start:end], targets[start:end], student,
                                      teacher, temperature, use_reentrant=False)
        kl, ce = kl + part_kl, ce + part_ce
    return DistillLosses(kl=kl, ce=ce, tokens=(targets != IGNORE_INDEX).sum())
