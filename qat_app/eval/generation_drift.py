"""Generation drift: KL(reference || model) along the reference model's own greedy continuations.

``forget/kl`` is teacher-forced on natural text; what a user of an instruct model meets is its generations. Here
the reference (the initial model) continues each prompt greedily for ``max_new_tokens`` tokens, then both models
read prompt + continuation and, at every continuation position, the full-vocabulary KL(reference || model)
(:func:`qat_app.hif8.health.full_kl`, float64) is taken. Each prompt's mean over its positions is one value; the
mean over prompts has a 95 % interval with each prompt its own cluster (:func:`qat_app.stats.clustered_mean`), as
ModelOpt's ``kl_eval.py`` measures a quantized model against BF16.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import stats
from ..hif8.health import full_kl


@dataclass(frozen=True)
class GenerationDrift:
    """KL(reference || model) per generated token, nats: the mean over prompts with its interval."""

    kl: stats.PairedResult
    per_prompt: tuple[float, ...]
    prompts: int
    new_tokens: int  # generated tokens in all
    seconds: float

    def describe(self) -> str:
        return (f"generation drift KL(initial || model) along the initial model's greedy continuations: "
                f"{self.kl.difference:.5f} [{self.kl.low:.5f}, {self.kl.high:.5f}] nats/token over {self.prompts} "
                f"prompts, {self.new_tokens} tokens")

    def to_dict(self) -> dict:
        return {"kl": stats.jsonable(self.kl), "per_prompt": list(self.per_prompt), "prompts": self.prompts,
                "new_tokens": self.new_tokens, "seconds": self.seconds}


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy_continuation(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """The model's greedy continuation of one prompt (ids [1, t]) -> its new ids [n] (stops at EOS, kept)."""
    output = model.generate(prompt_ids.to(_device(model)), attention_mask=torch.ones_like(prompt_ids).to(_device(model)),
                            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                            pad_token_id=eos_token_id if eos_token_id is not None else 0)
    return output[0, prompt_ids.shape[1]:].cpu()


@torch.no_grad()
def generation_drift(reference: nn.Module, model: nn.Module, tokenizer, prompts: Sequence[str],
                     max_new_tokens: int = 32, max_prompt_tokens: int = 512, forward_context=None) -> GenerationDrift:
    """KL(reference || model) along ``reference``'s greedy continuations of ``prompts`` (module doc).
    ``forward_context``: a context manager factory the model's forwards run under (a run's autocast)."""
    from contextlib import nullcontext

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    started = time.perf_counter()
    context = forward_context or nullcontext
    reference.eval()
    model.eval()
    per_prompt, new_tokens = [], 0
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids[:, -max_prompt_tokens:]
        if ids.shape[1] == 0:
            continue
        continuation = greedy_continuation(reference, ids, max_new_tokens, tokenizer.eos_token_id)
        if continuation.numel() == 0:
            continue
        full = torch.cat([ids[0], continuation])[None]
        first = ids.shape[1] - 1  # the logits at position i predict token i + 1: the continuation's predictors
        positions = slice(first, full.shape[1] - 1)
        logits_ref = reference(input_ids=full.to(_device(reference))).logits[0, positions].float().cpu()
        with context():
            logits = model(input_ids=full.to(_device(model))).logits[0, positions].float().cpu()
        per_prompt.append(float(full_kl(logits_ref, logits).mean()))
        new_tokens += continuation.numel()
    if not per_prompt:
        raise ValueError("generation drift: no prompt gave a continuation")
    return GenerationDrift(stats.clustered_mean(per_prompt), tuple(per_prompt), len(per_prompt), new_tokens,
                           time.perf_counter() - started)
