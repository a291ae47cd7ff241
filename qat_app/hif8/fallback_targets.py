"""The fallback targets: what a tensor that falls back becomes, declared once.

A quantized matmul's ``fall_back`` applies a target to one operand; the policy (:mod:`.fallback`) checks which
target may cure which symptom, the verification, the inventory, the health figures, the export and the summaries
read whether the operand is still quantized, and a person reads the target's text. A new target is one entry of
:data:`TARGETS` (with the scaler method it calls, if it changes the scaling) and its line in
``docs/diagnostics/fallback.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

FALLBACK_CURRENT, FALLBACK_HIGH_PRECISION = "current", "high_precision"


@dataclass(frozen=True)
class FallbackTarget:
    """One ``fallback.policy.on_saturation`` / ``on_low_sqnr`` choice."""

    name: str
    text: str  # how a decision names it to a person
    quantized: bool  # the operand stays 8-bit (False: unquantized from the decision on)
    cures_low_sqnr: bool  # it can raise a tensor's SQNR (a new scale cannot: the format's SQNR stays)
    apply: Optional[Callable[[object], None]]  # what it does to the operand's scaler (None: nothing)
    already: Callable[[object], bool]  # the scaler already is what the target would make it (nothing to cure)


TARGETS = (
    FallbackTarget(FALLBACK_CURRENT, "current scaling", quantized=True, cures_low_sqnr=False,
                   apply=lambda scaler: scaler.use_current_scaling(), already=lambda scaler: scaler.algo == "current"),
    FallbackTarget(FALLBACK_HIGH_PRECISION, "high precision", quantized=False, cures_low_sqnr=True, apply=None,
                   already=lambda scaler: False),
)
BY_NAME = {target.name: target for target in TARGETS}
FALLBACK_TARGETS = tuple(BY_NAME)
TARGET_TEXT = {target.name: target.text for target in TARGETS}


def unquantized_by(record: dict | None) -> bool:
    """Whether a fallback ``record`` (a matmul's ``fallback[operand]``) left its operand unquantized."""
    return record is not None and not BY_NAME[record["target"]].quantized
