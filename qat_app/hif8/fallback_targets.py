"""The fallback targets: what a tensor that falls back becomes, declared once.

A quantized matmul's ``fall_back`` applies a target to one operand; the policy (:mod:`.fallback`) checks which
target may cure which symptom, the verification, the inventory, the health figures, the export and the summaries
read whether the operand is still quantized, and a person reads the target's text. A new target is one entry of
:data:`TARGETS` (with the scaler method it calls, if it changes the scaling) and its line in
``docs/diagnostics/fallback.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

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


@dataclass(frozen=True)
class Verdict:
    """A fallback decision checked against the tensor's counters since (:func:`~.fallback.verify_decisions`)."""

    step: int
    worked: bool
    text: str


@dataclass(frozen=True)
class FallbackDecision:
    """One operand's fallback: its target, the step and rule that decided, the evidence and the counters then
    (``events_at``, ``steps_at``, ``sqnr_at``: recorded together), and once checked the SQNR after and the
    verdict. Made once by the policy; a verification makes a new one (``dataclasses.replace``), never edits it."""

    target: str
    step: Optional[int] = None
    reason: Optional[str] = None
    evidence: Optional[str] = None
    events_at: Optional[int] = None
    steps_at: Optional[int] = None
    sqnr_at: Optional[float] = None
    sqnr_after: Optional[float] = None
    verified: Optional[Verdict] = None

    def __post_init__(self) -> None:
        if self.target not in BY_NAME:
            raise ValueError(f"fallback target: unknown {self.target!r}; allowed: {', '.join(FALLBACK_TARGETS)}")

    @property
    def unquantized(self) -> bool:
        """The operand is no longer quantized (a high-precision target)."""
        return not BY_NAME[self.target].quantized

    def as_dict(self) -> dict[str, Any]:
        """The record as checkpoints, exports and summaries hold it: the fields recorded (the counters at the
        decision together, the SQNR after and the verdict once there)."""
        out: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None or (field.name == "sqnr_at" and self.steps_at is not None):
                out[field.name] = value.__dict__.copy() if isinstance(value, Verdict) else value
        return out

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "FallbackDecision":
        """A record :meth:`as_dict` wrote (or an earlier version: fewer fields)."""
        record = dict(record)
        verdict = record.pop("verified", None)
        return cls(**record, verified=None if verdict is None else Verdict(**verdict))


def unquantized_by(decision: FallbackDecision | None) -> bool:
    """Whether a fallback decision (a matmul's ``fallback[operand]``; None: none) left its operand unquantized."""
    return decision is not None and decision.unquantized
