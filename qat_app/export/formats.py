"""The exports the command line offers, as a table: each ``--format`` names its :class:`~.writing.ExportFormat`
(compressed-tensors: the one of its ``--serve_target``: FP8, or int8 for a CPU server)."""

from __future__ import annotations

from .compressed import FP8_EXPORT, served_as
from .hf import HF
from .writer import HIF8
from .writing import ExportFormat

FORMATS = {fmt.name: fmt for fmt in (HIF8, HF, FP8_EXPORT)}


def export_format(name: str, serve_target: str) -> ExportFormat:
    """What ``--format name --serve_target serve_target`` writes."""
    return served_as(serve_target) if FORMATS[name] is FP8_EXPORT else FORMATS[name]
