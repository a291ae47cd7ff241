"""The distillation settings (``--model.distill.*``): off by default; a bad value is one line naming the field."""

from __future__ import annotations

import dataclasses

from ..config import coerce_settings
from ..errors import ConfigError

DISTILL_KL, DISTILL_CE = "distill/kl", "distill/ce"  # the logged names, declared once
INITIAL_TEACHER = "initial"


@dataclasses.dataclass
class DistillConfig:
    """Quantization-aware distillation: the loss is ``kl_weight x T^2 x KL(teacher_T || student_T) + ce_weight x CE``
    per token (T: ``temperature``; both distributions softened by it, as in Hinton et al. and ModelOpt's
    ``LogitsDistillationLoss``); ``distill/kl`` (at T) and ``distill/ce`` are logged at every step, whatever the
    weights.

    Attributes:
        enabled: train against the teacher (false: the next-token loss alone, as without this section).
        teacher: ``initial`` (the weights the run starts from, frozen and unquantized, in the run's compute
            precision) or a local directory / hub id of another causal LM with the same tokenizer.
        kl_weight: weight of the KL term (>= 0).
        ce_weight: weight of the next-token cross-entropy (>= 0; 0: pure distillation).
        temperature: softens both distributions (> 0; the KL term is scaled by its square).
        chunk_tokens: tokens whose logits exist at once in the loss (0: as many as keep one chunk of each model's
            logits under 2^25 values, 128 MiB in float32).
    """

    enabled: bool = False
    teacher: str = INITIAL_TEACHER
    kl_weight: float = 1.0
    ce_weight: float = 0.0
    temperature: float = 1.0
    chunk_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("kl_weight", "ce_weight", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ConfigError(f"distill.{name}: must be a number, got {value!r}")
        if self.kl_weight < 0 or self.ce_weight < 0:
            name = "kl_weight" if self.kl_weight < 0 else "ce_weight"
            raise ConfigError(f"distill.{name}: must be >= 0, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature: must be > 0, got {self.temperature}")
        if self.enabled and self.kl_weight == 0 and self.ce_weight == 0:
            raise ConfigError("distill.kl_weight, distill.ce_weight: both 0 leaves no loss to train on")
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 0:
            raise ConfigError(f"distill.chunk_tokens: must be an integer >= 0, got {self.chunk_tokens!r}")
        if not isinstance(self.teacher, str) or not self.teacher.strip():
            raise ConfigError(f"distill.teacher: '{INITIAL_TEACHER}' or a model directory / hub id, got {self.teacher!r}")

    @classmethod
    def coerce(cls, value) -> "DistillConfig":
        """From what a caller holds: one already, a checkpoint's plain dict, or None (the defaults)."""
        return coerce_settings(cls, value, "distill", "distillation")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
