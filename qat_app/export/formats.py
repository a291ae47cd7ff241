"""The exports the command line offers, as a table: each ``--format`` names its :class:`~.writing.ExportFormat`
(compressed-tensors writes its weights as its ``--serve_target`` wants them: E4M3, or int8 for a CPU server)."""

from __future__ import annotations

from .compressed import FP8_EXPORT
from .hf import HF
from .writer import HIF8

FORMATS = {fmt.name: fmt for fmt in (HIF8, HF, FP8_EXPORT)}
