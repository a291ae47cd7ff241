"""The teacher a distilled run matches: frozen, unquantized, never trained, never saved.

It is held outside the LightningModule's modules, so it is in no ``state_dict``, checkpoint, optimizer or DDP
gradient sync; every rank holds a whole replica (also under FSDP2, which shards the student only). A resumed run
builds it again from the same source and checks it against the checkpoint's :attr:`Teacher.fingerprint`
(SHA-256 of its weights as loaded), as the KL cache checks its initial model.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..eval.kl_cache import tensor_sha256
from .config import INITIAL_TEACHER
from .loss import distill_losses, final_hidden


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, by name (the weights, not the object)."""
    names, tensors = zip(*sorted(model.state_dict().items()))
    return tensor_sha256(tensors, names)


def check_same_tokenizer(name: str, teacher_tokenizer, student_tokenizer, teacher: nn.Module, student: nn.Module) -> None:
    """A teacher whose tokens mean something else cannot teach: refused in one line naming ``distill.teacher``."""
    vocab_t, vocab_s = (m.get_output_embeddings().weight.shape[0] for m in (teacher, student))
    if vocab_t != vocab_s:
        raise ConfigError(f"distill.teacher: {name} predicts {vocab_t} tokens, the student {vocab_s}: the teacher "
                          "must share the student's tokenizer and vocabulary")
    if teacher_tokenizer is not None and student_tokenizer is not None and \
            teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(f"distill.teacher: {name} has another tokenizer than the student (their vocabularies "
                          "differ): the teacher must share the student's tokenizer")


class DistilledLoss(NamedTuple):
    """One batch's distilled loss (what is minimized) and its parts, means over the labelled positions."""

    loss: torch.Tensor
    kl: torch.Tensor  # KL(teacher || student) at the temperature
    ce: torch.Tensor  # the student's cross-entropy on the labels


class Teacher:
    """The frozen model the student learns from (see the module doc)."""

    def __init__(self, model: nn.Module, source: str):
        self.model = model.eval().requires_grad_(False)
        self.source = source
        self.fingerprint = fingerprint(model)

    @classmethod
    def initial(cls, student: nn.Module) -> "Teacher":
        """The student's weights as the run starts (call before it is quantized or trained)."""
        return cls(copy.deepcopy(student), INITIAL_TEACHER)

    @classmethod
    def build(cls, source: str, student: nn.Module, tokenizer, *, dtype="float32", trust_remote_code=False) -> "Teacher":
        """``initial`` or another model (directory / hub id), checked to share the student's tokenizer."""
        if source == INITIAL_TEACHER:
            return cls.initial(student)
        from ..models import load_causal_lm

        model, teacher_tokenizer = load_causal_lm(source, dtype=dtype, trust_remote_code=trust_remote_code)
        check_same_tokenizer(source, teacher_tokenizer, tokenizer, model, student)
        return cls(model, source)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "Teacher":
        self.model.to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return final_hidden(self.model, input_ids, attention_mask)

    def loss(self, student: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, config) -> DistilledLoss:
        """The distilled training loss of ``student`` on one batch, with its KL at T and CE, means over the
        labelled positions: ``kl_weight x T^2 x KL + ce_weight x CE`` (:class:`~.config.DistillConfig`)."""
        losses = distill_losses(student, self.model, final_hidden(student, input_ids), self.hidden(input_ids), labels,
                                config.temperature, config.chunk_tokens)
        kl, ce = losses.means()
        return DistilledLoss(config.kl_weight * config.temperature ** 2 * kl + config.ce_weight * ce, kl, ce)

    def state(self) -> dict:
        """What a checkpoint keeps of it: where it came from and what it was."""
        return {"source": self.source, "fingerprint": self.fingerprint}

    def check_resumed(self, saved: dict | None) -> None:
        """The rebuilt teacher must be the one the checkpoint's run was distilled from (:class:`CheckpointError`)."""
        if not saved:
            return
        if saved.get("fingerprint") != self.fingerprint:
            raise CheckpointError(
                f"distill.teacher: the checkpoint was distilled from {saved.get('source')!r} (weights "
                f"{str(saved.get('fingerprint'))[:12]}), this run built {self.source!r} with other weights "
                f"({self.fingerprint[:12]}): resume with the run's own teacher")
