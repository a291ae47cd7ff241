"""Automatic fallback: a quantized tensor that keeps saturating, or whose SQNR stays low, leaves 8-bit delayed scaling.

The paper's first failure mode, amax saturation, is per tensor: one activation whose amax keeps outgrowing its
delayed estimate clips step after step while every other tensor is fine. TransformerEngine moves such a GEMM to
high precision (its ``AutoswitchGemm`` proposal: underflow or MSE over a threshold); here the policy is
opt-in and per tensor (input, weight, output gradient of one quantized matmul):

* **persistent saturation**: saturation events (>= 1 clipped element, on any data-parallel rank) in at least
  ``min_events`` (k) of the tensor's last ``window`` (W) quantized steps;
* **low SQNR**: the tensor's quantization SQNR (:mod:`.health`, measured on logging steps) under
  ``sqnr_floor_db`` on ``sqnr_patience`` consecutive measurements.

Such a tensor falls back, for the rest of the run, to ``target``: ``current`` scaling (its scale from its own
amax: it can no longer clip; :meth:`~qat_app.hif8.quantized.QuantizedMatmul.fall_back`) or ``high_precision``
(it is no longer quantized). The decision, with its step and evidence, lives in the matmul's extra state, so a
checkpoint, a resumed run and an 8-bit export all carry it.

:class:`FallbackMonitor` holds the evidence (host-side CPU tensors, with ``state_dict``): call
:meth:`~FallbackMonitor.update` once per optimizer step with the scalers' run counters (``saturation_events``
and ``quantized_steps``, the same on every rank) and, on steps whose health was measured, the SQNR (summed over
the ranks first); each step's events are the counters' differences, so nothing but two counters per tensor is
read. :func:`fallback_step` does all of it for a model (one device->host copy per step; the SQNR's all-reduce
only on measured steps); the Lightning app's ``fallback`` callback calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from .errors import FieldError
from .counters import HEALTH, gather_columns
from .health import FIELDS as HEALTH_FIELDS, sqnr_from_powers
from .patch import quantized_linears
from .quantized import FALLBACK_CURRENT, FALLBACK_TARGETS, OPERANDS, QuantizedMatmul

SATURATION, LOW_SQNR = "persistent saturation", "SQNR under the floor"


class FallbackError(FieldError):
    """An invalid fallback setting, or evidence that does not fit the model."""


@dataclass(frozen=True)
class FallbackPolicy:
    """When a quantized tensor falls back, and to what.

    Attributes:
        target: what a tensor falls back to for the rest of the run: ``current`` (current scaling: its scale
            from its own amax, so it never clips) or ``high_precision`` (that operand is no longer quantized).
        window: W, how many of a tensor's last quantized steps the saturation rule looks at.
        min_events: k, a tensor with saturation events in at least k of its last W quantized steps falls back;
            0 switches the saturation rule off.
        sqnr_floor_db: a tensor whose SQNR (measured on logging steps) is under this many dB on ``sqnr_patience``
            consecutive measurements falls back; null switches the SQNR rule off.
        sqnr_patience: consecutive measurements under the floor that make a tensor fall back.
    """

    target: Literal[FALLBACK_TARGETS] = FALLBACK_CURRENT
    window: int = 16
    min_events: int = 8
    sqnr_floor_db: Optional[float] = None
    sqnr_patience: int = 3

    def __post_init__(self) -> None:
        if self.target not in FALLBACK_TARGETS:
            raise FallbackError("target", f"unknown target {self.target!r}; allowed: {', '.join(FALLBACK_TARGETS)}")
        if not isinstance(self.window, int) or self.window < 1:
            raise FallbackError("window", f"must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.min_events, int) or not 0 <= self.min_events <= self.window:
            raise FallbackError("min_events", f"must be an integer in [0, window={self.window}] (0: no saturation "
                                              f"rule), got {self.min_events!r}")
        if self.sqnr_floor_db is not None and not math.isfinite(self.sqnr_floor_db):
            raise FallbackError("sqnr_floor_db", f"must be a finite number of dB or null, got {self.sqnr_floor_db!r}")
        if not isinstance(self.sqnr_patience, int) or self.sqnr_patience < 1:
            raise FallbackError("sqnr_patience", f"must be an integer >= 1, got {self.sqnr_patience!r}")
        if self.min_events == 0 and self.sqnr_floor_db is None:
            raise FallbackError("min_events", "is 0 and sqnr_floor_db is null: no rule is left to trigger a fallback")


@dataclass(frozen=True)
class Decision:
    """One tensor that falls back: its index in the monitor's names, the rule and the evidence."""

    index: int
    reason: str
    evidence: str


class FallbackMonitor:
    """The evidence of every quantized tensor (``names``, in a fixed order) under ``policy``; see the module doc."""

    def __init__(self, policy: FallbackPolicy, names: list[str]) -> None:
        self.policy = policy
        self.names = list(names)
        n = len(self.names)
        self.recent = torch.zeros(n, policy.window, dtype=torch.bool)  # column 0: the newest quantized step
        self.events_seen = torch.zeros(n, dtype=torch.int64)  # the counters at the last update
        self.steps_seen = torch.zeros(n, dtype=torch.int64)
        self.low_sqnr = torch.zeros(n, dtype=torch.int64)  # consecutive measurements under the floor
        self.started = False

    @classmethod
    def for_model(cls, policy: FallbackPolicy, model: nn.Module) -> "FallbackMonitor":
        """A monitor of every quantized tensor of ``model`` (names ``<layer>.<operand>``, as :func:`quantized_tensors`)."""
        return cls(policy, [f"{name}.{operand}" for name, _, operand in quantized_tensors(model)])

    def start(self, events: torch.Tensor, quantized_steps: torch.Tensor) -> None:
        """Evidence starts from these counters (a fresh run: zeros; a run resumed without fallback state: its
        counters so far, which are not evidence of the last W steps)."""
        self.events_seen, self.steps_seen = events.long().clone(), quantized_steps.long().clone()
        self.started = True

    def update(self, events: torch.Tensor, quantized_steps: torch.Tensor, sqnr_db: torch.Tensor | None = None,
               eligible: torch.Tensor | None = None) -> list[Decision]:
        """One optimizer step: the run counters now (``[n]``), the SQNR of the tensors measured this step (NaN:
        not measured) and which tensors may still fall back -> the tensors that fall back now.

        Called once per step, each tensor gains at most one quantized step; if steps were missed, the new ones
        are pushed with their events first (their order is not known).
        """
        if not self.started:
            self.start(torch.zeros_like(events), torch.zeros_like(quantized_steps))
        events, quantized_steps = events.long(), quantized_steps.long()
        new_steps, new_events = quantized_steps - self.steps_seen, events - self.events_seen
        if bool((new_steps < 0).any() | (new_events < 0).any() | (new_events > new_steps).any()):
            bad = int(((new_steps < 0) | (new_events < 0) | (new_events > new_steps)).nonzero()[0, 0])
            raise FallbackError("fallback", f"{self.names[bad]}: its counters went from {int(self.events_seen[bad])} "
                                            f"events in {int(self.steps_seen[bad])} quantized steps to {int(events[bad])} "
                                            f"in {int(quantized_steps[bad])}: not this run's evidence", sep=" ")
        window = self.policy.window
        slots = torch.arange(window)
        older = slots[None, :] - new_steps[:, None]  # where each slot's value was before this update
        shifted = self.recent.gather(1, older.clamp(min=0))
        self.recent = torch.where(older >= 0, shifted, slots[None, :] < new_events[:, None])
        self.events_seen, self.steps_seen = events.clone(), quantized_steps.clone()

        n = len(self.names)
        in_window = self.recent.sum(dim=1)
        saturating = in_window >= self.policy.min_events if self.policy.min_events > 0 else torch.zeros(n, dtype=torch.bool)
        low = torch.zeros(n, dtype=torch.bool)
        if self.policy.sqnr_floor_db is not None and sqnr_db is not None:
            measured = ~torch.isnan(sqnr_db)
            under = measured & (sqnr_db < self.policy.sqnr_floor_db)
            self.low_sqnr = torch.where(measured, torch.where(under, self.low_sqnr + 1, 0), self.low_sqnr)
            low = self.low_sqnr >= self.policy.sqnr_patience
        fire = (saturating | low) & (eligible if eligible is not None else True)
        decisions = []
        for index in fire.nonzero().flatten().tolist():
            if saturating[index]:
                evidence = (f"saturation events in {int(in_window[index])} of its last "
                            f"{min(window, int(quantized_steps[index]))} quantized steps (k={self.policy.min_events}, "
                            f"W={window})")
                decisions.append(Decision(index, SATURATION, evidence))
            else:
                evidence = (f"SQNR {float(sqnr_db[index]):.2f} dB, under {self.policy.sqnr_floor_db:g} dB on "
                            f"{int(self.low_sqnr[index])} consecutive measurements")
                decisions.append(Decision(index, LOW_SQNR, evidence))
        return decisions

    def state_dict(self) -> dict:
        return {"names": list(self.names), "recent": self.recent.clone(), "events_seen": self.events_seen.clone(),
                "steps_seen": self.steps_seen.clone(), "low_sqnr": self.low_sqnr.clone(), "started": self.started,
                "window": self.policy.window}

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != self.names:
            raise FallbackError("fallback", f"the saved evidence is for {len(state['names'])} other tensors "
                                            f"(first: {state['names'][:1]}), not this model's {len(self.names)}", sep=" ")
        recent = state["recent"].bool()
        # a changed window keeps the newest min(old, new) steps
        self.recent = torch.zeros(len(self.names), self.policy.window, dtype=torch.bool)
        keep = min(recent.shape[1], self.policy.window)
        self.recent[:, :keep] = recent[:, :keep]
        self.events_seen, self.steps_seen = state["events_seen"].long().clone(), state["steps_seen"].long().clone()
        self.low_sqnr = state["low_sqnr"].long().clone()
        self.started = bool(state["started"])


def quantized_tensors(model: nn.Module) -> list[tuple[str, QuantizedMatmul, str]]:
    """``(layer name, layer, operand)`` of every quantized tensor of ``model`` (the operands with a scaler), in
    model order: the order of the saturation logs and of :class:`FallbackMonitor`'s names."""
    return [(name, layer, operand) for name, layer in quantized_linears(model)
            for operand in OPERANDS if layer.scaler_of(operand) is not None]


def fallen_back(model: nn.Module) -> list[dict]:
    """Every fallback decision of ``model``: ``{"module", "operand", "target", "step", "reason", "evidence"}``."""
    return [{"module": name, "operand": operand, **layer.fallback[operand]}
            for name, layer, operand in quantized_tensors(model) if operand in layer.fallback]


def read_counters(pairs: list, health: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(saturation_events, quantized_steps, SQNR in dB or None)`` of the ``(tensor name, scaler)`` pairs on the
    CPU, in one device->host copy (:func:`.counters.gather_columns`); with ``health``, the SQNR of the step's
    health vectors summed over the data-parallel ranks (a collective: call it on every rank), NaN where a tensor
    was not measured."""
    columns = gather_columns(pairs, ("saturation_events", "quantized_steps"), (HEALTH,) if health else ())
    sqnr = None
    if health:
        vectors = columns[HEALTH]
        numel, sum_x2, sum_err2 = (vectors[:, HEALTH_FIELDS.index(f)] for f in ("numel", "sum_x2", "sum_err2"))
        sqnr = torch.where(numel > 0, sqnr_from_powers(sum_x2, sum_err2), math.nan)
    return columns["saturation_events"].long(), columns["quantized_steps"].long(), sqnr


def scaler_pairs(tensors: list[tuple[str, QuantizedMatmul, str]]) -> list[tuple[str, object]]:
    """``(layer.operand, scaler)`` of :func:`quantized_tensors`' entries, as :mod:`.counters` reads them."""
    return [(f"{name}.{operand}", layer.scaler_of(operand)) for name, layer, operand in tensors]


def fallback_step(model: nn.Module, monitor: FallbackMonitor, step: int) -> list[dict]:
    """One optimizer step of the policy on ``model`` (after the scalers advanced): update the evidence, make the
    tensors that qualify fall back (recording ``step``, the rule and the evidence) -> the new decisions, as
    :func:`fallen_back` lists them. Every data-parallel rank takes the same decisions (the counters are the same
    on every rank, the SQNR is summed over them)."""
    tensors = quantized_tensors(model)
    if not tensors:
        return []
    pairs = scaler_pairs(tensors)
    measured = monitor.policy.sqnr_floor_db is not None and any(s.health_last is not None for _, s in pairs)
    events, steps, sqnr = read_counters(pairs, measured)
    eligible = torch.tensor([operand not in layer.fallback and not (
        monitor.policy.target == FALLBACK_CURRENT and layer.scaler_of(operand).algo == "current")
        for _, layer, operand in tensors])
    new = []
    for decision in monitor.update(events, steps, sqnr, eligible):
        name, layer, operand = tensors[decision.index]
        layer.fall_back(operand, monitor.policy.target, step=step, reason=decision.reason, evidence=decision.evidence)
        new.append({"module": name, "operand": operand, **layer.fallback[operand]})
    return new
