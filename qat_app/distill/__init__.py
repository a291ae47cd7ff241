"""Quantization-aware distillation (QAD): the quantized student learns the teacher's next-token distribution,
KL(p_teacher || p_student) per token, instead of the next-token loss or beside it.

:class:`DistillConfig` (the settings, ``--model.distill.*``), :class:`Teacher` (the frozen model the student
matches: by default the run's own initial weights) and :func:`distill_losses` (the KL and the CE through both
LM heads, chunk by chunk, never the whole logits at once). See ``docs/distillation.md``.
"""

from .config import DISTILL_CE, DISTILL_KL, DistillConfig
from .loss import DistillLosses, distill_losses, final_hidden, head_logits
from .teacher import Teacher

__all__ = ["DISTILL_CE", "DISTILL_KL", "DistillConfig", "DistillLosses", "Teacher", "distill_losses",
           "final_hidden", "head_logits"]
