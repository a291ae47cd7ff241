"""Generation drift: KL(reference || model) along the reference model's own greedy continuations.

``forget/kl`` is teacher-forced on natural text; what a user of an instruct model meets is its generations. Here
the reference (the initial model) continues each prompt greedily for ``max_new_tokens`` tokens, then both models
read prompt + continuation and, at every continuation position, the full-vocabulary KL(reference || model)
(:func:`qat_app.hif8.health.full_kl`, float64) is taken. Each prompt's mean over its positions is one value; the
mean over prompts has a 95 % interval with each prompt its own cluster (:func:`qat_app.stats.clustered_mean`), as
ModelOpt's ``kl_eval.py`` measures a quantized model against BF16.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import stats
from ..hif8.health import full_kl
from .records import FORGET_GENERATION_KL

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------------------ in a fit
@torch.no_grad()
def greedy_continuations(model: nn.Module, prompts: torch.Tensor, new_tokens: int, pad_token_id: int) -> torch.Tensor:
    """``prompts [n, P]`` (equal lengths, no padding) greedily continued by exactly ``new_tokens`` tokens each
    (EOS suppressed until then: every rank runs the same number of forwards, which a sharded model needs)
    -> ``[n, P + new_tokens]``."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad_token_id, num_beams=1)
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)


def continuation_logprobs(model: nn.Module, sequences: torch.Tensor, prompt_tokens: int, batch_size: int,
                          store_dtype: torch.dtype) -> torch.Tensor:
    """Full-vocabulary log-probabilities ``[n, T, V]`` (``store_dtype``) of ``model`` at the positions that predict
    each continuation token of ``sequences [n, P + T]``, scored in batches of ``batch_size``."""
    out = []
    for i in range(0, sequences.shape[0], batch_size):
        logits = model(input_ids=sequences[i:i + batch_size]).logits[:, prompt_tokens - 1:-1]
        with torch.autocast(logits.device.type, enabled=False):  # a run's autocast refuses float16 ops on a CPU
            out.append(logits.float().log_softmax(-1).to(store_dtype))
    with torch.autocast(sequences.device.type, enabled=False):
        return torch.cat(out)


class InitialGenerations:
    """Generation drift in a fit: ``forget/generation_kl``, KL(initial || now) per generated token over the full
    vocabulary, along the initial model's greedy continuations of held-out prompts, with its 95 % interval over
    prompts (as ``forget/kl`` over sequences).

    At the start of a new fit (quantization off) the first ``prompts`` held-out blocks' first ``prompt_tokens``
    tokens are continued greedily by ``new_tokens`` tokens, and the initial model's log-probabilities along them
    are kept (float16, full vocabulary: ``<log_dir>/initial_generations.pt``, ``prompts x new_tokens x vocab x 2``
    bytes; 50 MB at the defaults for a 49k vocabulary). Every later validation scores the same sequences with the
    model as it is. Both sides are rounded to float16 and renormalised (:func:`qat_app.eval.kl_cache.coarse_kl`
    over the whole vocabulary), so a model that did not change gives exactly 0; the rounding adds a second-order
    term of ~1e-7 nats. A missing, damaged or foreign file on resume is named in one warning and the run goes on
    without the measure.
    """

    def __init__(self, prompts: int = 16, prompt_tokens: int = 64, new_tokens: int = 32, model_name: str = "",
                 path: str = "") -> None:
        self.prompts, self.prompt_tokens, self.new_tokens = prompts, prompt_tokens, new_tokens
        self.model_name, self.path = str(model_name), path
        self.header: dict | None = None  # of the file in use; None: off
        self.sequences = self.logprobs = None  # this rank's, on the module's device
        self.batch_size = 1  # sequences scored at a time (the LM validation's batch size)
        self.last = None  # the latest kl_cache.Interval
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.header is not None

    def _off(self, why: str) -> None:
        self.header = self.sequences = self.logprobs = None
        if not self._warned:
            self._warned = True
            log.warning("%s off for this run: %s", FORGET_GENERATION_KL, why)

    def _score(self, pl_module, sequences: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
        from .kl_cache import STORE_DTYPE, evaluating

        with evaluating(pl_module):
            return continuation_logprobs(pl_module.model, sequences, prompt_tokens, self.batch_size, STORE_DTYPE)

    @torch.no_grad()
    def record(self, pl_module, blocks: torch.Tensor, limit: int, batch_size: int, pad_token_id: int) -> None:
        """The initial model (the caller switches quantization off) continues this rank's prompts; rank 0 writes
        the file. Every rank calls it (collective)."""
        from .kl_cache import _gather, evaluating, save_topk, tensor_sha256

        trainer = pl_module.trainer
        world, self.batch_size = trainer.world_size, batch_size
        prompt_tokens = min(self.prompt_tokens, blocks.shape[1])
        n = min(max(1, self.prompts // world), limit, blocks.shape[0])
        n = int(_gather(pl_module, torch.tensor(n, device=pl_module.device)).min())  # equal on every rank
        prompts = blocks[:n, :prompt_tokens].to(pl_module.device)
        with evaluating(pl_module):
            sequences = greedy_continuations(pl_module.model, prompts, self.new_tokens, pad_token_id)
        self.sequences = sequences
        self.logprobs = self._score(pl_module, sequences, prompt_tokens)
        every = [_gather(pl_module, t).flatten(0, 1) for t in (sequences, self.logprobs)]
        header = {"kind": "generations", "model": self.model_name, "prompts": int(n * world),
                  "prompt_tokens": int(prompt_tokens), "new_tokens": int(self.new_tokens), "world_size": int(world),
                  "vocab": int(self.logprobs.shape[-1]), "data_fingerprint": tensor_sha256([every[0][:, :prompt_tokens]])}
        if trainer.is_global_zero:
            header = save_topk(self.path, header, every[1], tokens=every[0])
        self.header = header
        log.info("initial greedy continuations: %d prompts x %d tokens, full vocabulary, in %s", n * world,
                 self.new_tokens, self.path)

    def resume(self, pl_module, blocks: torch.Tensor, batch_size: int, expected_sha256: str | None = None) -> None:
        """A resumed fit reads the file back and checks it is this run's (model, prompts, world size, payload)."""
        from .kl_cache import TopKCacheError, foreign_to_run, load_topk

        trainer, self.batch_size = pl_module.trainer, batch_size
        try:
            cache = load_topk(self.path)
        except TopKCacheError as err:
            return self._off(f"the initial generations cannot be used: {err}")
        h, world = cache.header, trainer.world_size
        foreign = foreign_to_run(h, "generations", cache.tokens is not None, self.model_name, world, expected_sha256)
        if not foreign:
            n, prompt_tokens = h["prompts"] // world, h["prompt_tokens"]
            mine = slice(trainer.global_rank * n, (trainer.global_rank + 1) * n)
            here = blocks[:n, :prompt_tokens].to(cache.tokens.dtype)
            if here.shape != cache.tokens[mine, :prompt_tokens].shape or not torch.equal(here, cache.tokens[mine, :prompt_tokens]):
                foreign.append(f"other prompts (fingerprint {str(h.get('data_fingerprint'))[:12]})")
        if foreign:
            return self._off(f"{self.path} is of another run: {'; '.join(foreign)}")
        self.sequences, self.logprobs = (t[mine].to(pl_module.device) for t in (cache.tokens, cache.logprobs))
        self.header = h

    @torch.no_grad()
    def measure(self, pl_module):
        """The model as it is against the initial one -> a :class:`qat_app.eval.kl_cache.Interval` (per generated
        token, over prompts), or None when off. Every rank calls it (collective)."""
        from .kl_cache import _gather, coarse_kl, interval

        if not self.enabled:
            return None
        now = self._score(pl_module, self.sequences, self.header["prompt_tokens"])
        per_prompt = torch.stack([coarse_kl(a, b).mean() for a, b in zip(self.logprobs, now)])
        self.last = interval(_gather(pl_module, per_prompt).flatten())
        return self.last
