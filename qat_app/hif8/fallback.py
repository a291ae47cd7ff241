"""Automatic fallback: a quantized tensor that keeps saturating, or whose SQNR stays low, leaves 8-bit delayed scaling.

Opt-in and per tensor (input, weight, output gradient of one quantized matmul): persistent saturation (events in
at least ``min_events`` of its last ``window`` quantized steps) or a low SQNR (under ``sqnr_floor_db`` on
``sqnr_patience`` consecutive measurements) moves the tensor, for the rest of the run, to current scaling or to
high precision (:class:`FallbackPolicy`). Contract: the decision, with its step and evidence, lives in the
matmul's extra state, so a checkpoint, a resumed run and an 8-bit export all carry it; :class:`FallbackMonitor`
holds the evidence in its ``state_dict``, so a resumed run decides the same at the same steps. :func:`fallback_step`
does it all for a model once per optimizer step (one device-to-host copy; an all-reduce only on measured steps).

See ``docs/diagnostics/fallback.md`` for the rules, the remedies, the verification and the budget.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, Optional

import torch
from torch import nn

from .errors import FieldError
from .counters import HEALTH, gather_columns
from .health import FIELDS as HEALTH_FIELDS, sqnr_from_powers
from .patch import quantized_linears
from .operand import Operand
from .fallback_targets import (BY_NAME, FALLBACK_CURRENT, FALLBACK_HIGH_PRECISION, FALLBACK_TARGETS, FallbackDecision,
                               Verdict)
from .quantized import QuantizedMatmul
from .sqnr_bound import gaussian_sqnr_bound

SATURATION, LOW_SQNR = "persistent saturation", "SQNR under the floor"
DEFAULT_BUDGET = 0.25  # of the quantized tensors: past it, the recipe is the problem, not a few tensors
log = logging.getLogger(__name__)


class FallbackError(FieldError):
    """An invalid fallback setting, or evidence that does not fit the model."""


@dataclass(frozen=True)
class FallbackPolicy:
    """When a quantized tensor falls back, and to what: the remedy that fits the symptom.

    Attributes:
        on_saturation: what a persistently saturating tensor falls back to for the rest of the run: ``current``
            (default: current scaling, its scale from its own amax, so it never clips) or ``high_precision`` (that
            operand is no longer quantized).
        on_low_sqnr: what a tensor whose SQNR stays under the floor falls back to: ``high_precision`` (default).
            ``current`` is refused with a floor set: current scaling changes the scale, not the format, and cannot
            raise the SQNR of a tensor that does not clip.
        window: W, how many of a tensor's last quantized steps the saturation rule looks at; a decision is verified
            over the W quantized steps after it.
        min_events: k, a tensor with saturation events in at least k of its last W quantized steps falls back;
            0 switches the saturation rule off.
        sqnr_floor_db: a tensor whose SQNR (measured on logging steps) is under this many dB on ``sqnr_patience``
            consecutive measurements falls back; null switches the SQNR rule off. It must be under the SQNR the
            format gives a Gaussian tensor at its best scale (HiF8: 31.56 dB; :mod:`.sqnr_bound`).
        sqnr_patience: consecutive measurements under the floor that make a tensor fall back.
        max_tensors: the budget: at most this many tensors fall back (an integer >= 1), or this fraction of the
            quantized tensors (in (0, 1); default 0.25); null: no budget. A step whose decisions would pass it takes
            none, and the policy stops, saying that the recipe, not a few tensors, is the problem.
        target: deprecated: ``on_saturation`` (``high_precision`` also sets ``on_low_sqnr``).
    """

    on_saturation: Literal[FALLBACK_TARGETS] = FALLBACK_CURRENT
    on_low_sqnr: Literal[FALLBACK_TARGETS] = FALLBACK_HIGH_PRECISION
    window: int = 16
    min_events: int = 8
    sqnr_floor_db: Optional[float] = None
    sqnr_patience: int = 3
    max_tensors: Optional[float] = DEFAULT_BUDGET
    target: Optional[Literal[FALLBACK_TARGETS]] = None

    def __post_init__(self) -> None:
        if self.target is not None:
            self._replace_deprecated_target()
        for field in ("on_saturation", "on_low_sqnr"):
            if getattr(self, field) not in FALLBACK_TARGETS:
                raise FallbackError(field, f"unknown target {getattr(self, field)!r}; allowed: {', '.join(FALLBACK_TARGETS)}")
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
        if self.sqnr_floor_db is not None and not BY_NAME[self.on_low_sqnr].cures_low_sqnr:
            target = BY_NAME[self.on_low_sqnr]
            raise FallbackError("on_low_sqnr", f"{target.name} cannot cure a low SQNR: {target.text} changes the "
                                               "scale, not the format, and a tensor that does not clip keeps the SQNR "
                                               "its format gives it (HiF8: at most 31.56 dB on a Gaussian at any "
                                               "scale); use high_precision")
        budget = self.max_tensors
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (
                0 < budget < 1 or (budget >= 1 and float(budget).is_integer()))):
            raise FallbackError("max_tensors", f"must be a fraction in (0, 1), an integer >= 1 or null, got {budget!r}")

    def _replace_deprecated_target(self) -> None:
        target = self.target
        if target not in FALLBACK_TARGETS:
            raise FallbackError("target", f"unknown target {target!r}; allowed: {', '.join(FALLBACK_TARGETS)}")
        log.warning("fallback.policy.target is deprecated: use on_saturation and on_low_sqnr (target %s read as "
                    "on_saturation %s%s)", target, target,
                    ", on_low_sqnr high_precision" if target == FALLBACK_HIGH_PRECISION else
                    "; a low SQNR still falls back to high precision, which current scaling cannot raise")
        object.__setattr__(self, "on_saturation", target)
        if target == FALLBACK_HIGH_PRECISION:
            object.__setattr__(self, "on_low_sqnr", target)
        object.__setattr__(self, "target", None)

    def remedy(self, reason: str) -> str:
        """The target of a decision for ``reason`` (:data:`SATURATION` or :data:`LOW_SQNR`)."""
        return self.on_saturation if reason == SATURATION else self.on_low_sqnr

    def budget(self, tensors: int) -> int | None:
        """The most tensors that may fall back out of ``tensors`` quantized ones (None: no budget)."""
        if self.max_tensors is None:
            return None
        if self.max_tensors < 1:
            return max(1, math.floor(self.max_tensors * tensors))
        if self.max_tensors > tensors:
            raise FallbackError("max_tensors", f"{int(self.max_tensors)} is more than the model's {tensors} quantized "
                                               "tensors; give at most that, a fraction in (0, 1) or null")
        return int(self.max_tensors)


def check_reachable_floor(policy: FallbackPolicy, format_name: str, max_val: float) -> None:
    """Refuse a floor above what ``format_name`` gives a Gaussian tensor at its best scale (:mod:`.sqnr_bound`)."""
    if policy.sqnr_floor_db is None:
        return
    bound, a_hat = gaussian_sqnr_bound(format_name, float(max_val))
    if policy.sqnr_floor_db >= bound:
        raise FallbackError("sqnr_floor_db", f"{policy.sqnr_floor_db:g} dB is above what {format_name} can give: "
                                             f"{bound:.2f} dB on a Gaussian tensor at its best scale (a_hat = "
                                             f"{a_hat:.1f} sigma); real activations, heavier-tailed, measure below it, "
                                             "so nearly every tensor would fall back; set a floor under it "
                                             f"(e.g. {math.floor(bound) - 6})")


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
        self.budget = policy.budget(n) if n else None  # the most tensors that may fall back
        self.stopped: dict | None = None  # the budget's stop: qualified, already, budget, diagnosis (+ step)
        self.verified: list[dict] = []  # the decisions :func:`fallback_step` verified at its last call

    @classmethod
    def for_model(cls, policy: FallbackPolicy, model: nn.Module) -> "FallbackMonitor":
        """A monitor of every quantized tensor of ``model`` (names ``<layer>.<operand>``, as :func:`quantized_tensors`)."""
        return cls(policy, [operand.tensor_name(name) for name, _, operand in quantized_tensors(model)])

    def start(self, events: torch.Tensor, quantized_steps: torch.Tensor) -> None:
        """Evidence starts from these counters (a fresh run: zeros; a run resumed without fallback state: its
        counters so far, which are not evidence of the last W steps)."""
        self.events_seen, self.steps_seen = events.long().clone(), quantized_steps.long().clone()
        self.started = True

    def update(self, events: torch.Tensor, quantized_steps: torch.Tensor, sqnr_db: torch.Tensor | None = None,
               eligible: torch.Tensor | None = None, saturation_eligible: torch.Tensor | None = None,
               already: int = 0) -> list[Decision]:
        """One optimizer step: the run counters now (``[n]``), the SQNR of the tensors measured this step (NaN:
        not measured), which tensors may still fall back (``saturation_eligible``: for the saturation rule, default
        the same) and how many fell back before (``already``, against the budget) -> the tensors that fall back now.

        Called once per step, each tensor gains at most one quantized step; if steps were missed, the new ones
        are pushed with their events first (their order is not known). A step whose decisions would pass the
        budget takes none and stops the policy (:attr:`stopped` says why); the evidence goes on being kept.
        """
        if not self.started:
            self.start(torch.zeros_like(events), torch.zeros_like(quantized_steps))
        events, quantized_steps = events.long(), quantized_steps.long()
        self._push(events, quantized_steps)
        n = len(self.names)
        in_window = self.recent.sum(dim=1)
        saturating = in_window >= self.policy.min_events if self.policy.min_events > 0 else torch.zeros(n, dtype=torch.bool)
        low = torch.zeros(n, dtype=torch.bool)
        if self.policy.sqnr_floor_db is not None and sqnr_db is not None:
            measured = ~torch.isnan(sqnr_db)
            under = measured & (sqnr_db < self.policy.sqnr_floor_db)
            self.low_sqnr = torch.where(measured, torch.where(under, self.low_sqnr + 1, 0), self.low_sqnr)
            low = self.low_sqnr >= self.policy.sqnr_patience
        if self.stopped is not None:  # the evidence above is kept; no decision is taken any more
            return []
        eligible = eligible if eligible is not None else torch.ones(n, dtype=torch.bool)
        saturating &= saturation_eligible if saturation_eligible is not None else eligible
        low &= eligible
        decisions = [self._decision(index, bool(saturating[index]), in_window, quantized_steps, sqnr_db)
                     for index in (saturating | low).nonzero().flatten().tolist()]
        if decisions and self.budget is not None and already + len(decisions) > self.budget:
            self.stopped = {"qualified": len(decisions), "already": already, "budget": self.budget,
                            "diagnosis": self._diagnosis(decisions, in_window, sqnr_db)}
            return []
        return decisions

    def _push(self, events: torch.Tensor, quantized_steps: torch.Tensor) -> None:
        """Shift each tensor's window by its new quantized steps, their events first."""
        new_steps, new_events = quantized_steps - self.steps_seen, events - self.events_seen
        if bool((new_steps < 0).any() | (new_events < 0).any() | (new_events > new_steps).any()):
            bad = int(((new_steps < 0) | (new_events < 0) | (new_events > new_steps)).nonzero()[0, 0])
            raise FallbackError("fallback", f"{self.names[bad]}: its counters went from {int(self.events_seen[bad])} "
                                            f"events in {int(self.steps_seen[bad])} quantized steps to {int(events[bad])} "
                                            f"in {int(quantized_steps[bad])}: not this run's evidence", sep=" ")
        slots = torch.arange(self.policy.window)
        older = slots[None, :] - new_steps[:, None]  # where each slot's value was before this update
        shifted = self.recent.gather(1, older.clamp(min=0))
        self.recent = torch.where(older >= 0, shifted, slots[None, :] < new_events[:, None])
        self.events_seen, self.steps_seen = events.clone(), quantized_steps.clone()

    def _decision(self, index: int, saturating: bool, in_window, quantized_steps, sqnr_db) -> Decision:
        if saturating:  # saturation first: it is what both remedies cure
            window = self.policy.window
            return Decision(index, SATURATION, f"saturation events in {int(in_window[index])} of its last "
                                               f"{min(window, int(quantized_steps[index]))} quantized steps "
                                               f"(k={self.policy.min_events}, W={window})")
        return Decision(index, LOW_SQNR, f"SQNR {float(sqnr_db[index]):.2f} dB, under {self.policy.sqnr_floor_db:g} dB "
                                         f"on {int(self.low_sqnr[index])} consecutive measurements")

    def _diagnosis(self, decisions: list[Decision], in_window, sqnr_db) -> str:
        """One line of evidence that the recipe, not a few tensors, is the problem."""
        saturating = [d.index for d in decisions if d.reason == SATURATION]
        low = [d.index for d in decisions if d.reason == LOW_SQNR]
        parts = []
        if low:
            median = float(sqnr_db[low].median())
            parts.append(f"{len(low)} under the SQNR floor, median {median:.1f} dB against sqnr_floor_db "
                         f"{self.policy.sqnr_floor_db:g}: the floor is above what the format gives these tensors "
                         "(lower it)")
        if saturating:
            median = int(in_window[saturating].median())
            parts.append(f"{len(saturating)} saturating, median {median} events in their last {self.policy.window} "
                         "quantized steps: the delayed scales cannot follow the tensors (a learning rate too high, a "
                         "window too short or a format too narrow)")
        return "; ".join(parts)

    def state_dict(self) -> dict:
        return {"names": list(self.names), "recent": self.recent.clone(), "events_seen": self.events_seen.clone(),
                "steps_seen": self.steps_seen.clone(), "low_sqnr": self.low_sqnr.clone(), "started": self.started,
                "window": self.policy.window, "stopped": dict(self.stopped) if self.stopped is not None else None}

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
        self.stopped = dict(state["stopped"]) if state.get("stopped") is not None else None  # older states: none


def quantized_tensors(model: nn.Module) -> list[tuple[str, QuantizedMatmul, Operand]]:
    """``(layer name, layer, operand)`` of every quantized tensor of ``model`` (the operands with a scaler), in
    model order: the order of the saturation logs and of :class:`FallbackMonitor`'s names."""
    return [(name, layer, operand) for name, layer in quantized_linears(model)
            for operand in Operand if layer.scaler_of(operand) is not None]


def fallback_decisions(model: nn.Module) -> list[tuple[str, Operand, FallbackDecision]]:
    """``(layer name, operand, decision)`` of every tensor of ``model`` a fallback decided on, in model order."""
    return [(name, operand, layer.fallback[operand]) for name, layer, operand in quantized_tensors(model)
            if operand in layer.fallback]


def fallen_back(model: nn.Module) -> list[dict]:
    """Every fallback decision of ``model``: ``{"module", "operand", "target", "step", "reason", "evidence"}``."""
    return [{"module": name, "operand": str(operand), **decision.as_dict()}
            for name, operand, decision in fallback_decisions(model)]


RUN_FIELDS = ("saturation_events", "quantized_steps")  # the run counters the policy decides on


class RunCounters(NamedTuple):
    """What the policy decides on, per quantized tensor in model order (CPU tensors)."""

    events: torch.Tensor  # saturation events so far (long)
    steps: torch.Tensor  # quantized steps so far (long)
    sqnr: torch.Tensor | None  # the step's SQNR in dB, NaN where not measured (None: no health vectors read)


def run_counters(columns: dict[str, torch.Tensor]) -> RunCounters:
    """The :class:`RunCounters` in ``columns`` (:func:`.counters.gather_columns` of :data:`RUN_FIELDS`, with the
    health vectors summed over the ranks when they were read)."""
    sqnr = None
    if HEALTH in columns:
        vectors = columns[HEALTH]
        numel, sum_x2, sum_err2 = (vectors[:, HEALTH_FIELDS.index(f)] for f in ("numel", "sum_x2", "sum_err2"))
        sqnr = torch.where(numel > 0, sqnr_from_powers(sum_x2, sum_err2), math.nan)
    return RunCounters(columns["saturation_events"].long(), columns["quantized_steps"].long(), sqnr)


def read_counters(pairs: list, health: bool) -> RunCounters:
    """The :class:`RunCounters` of the ``(tensor name, scaler)`` pairs, in one device->host copy; with ``health``,
    the SQNR of the step's health vectors summed over the data-parallel ranks (a collective: call it on every
    rank)."""
    return run_counters(gather_columns(pairs, RUN_FIELDS, (HEALTH,) if health else ()))


def scaler_pairs(tensors: list[tuple[str, QuantizedMatmul, Operand]]) -> list[tuple[str, object]]:
    """``(layer.operand, scaler)`` of :func:`quantized_tensors`' entries, as :mod:`.counters` reads them."""
    return [(operand.tensor_name(name), layer.scaler_of(operand)) for name, layer, operand in tensors]


def fallback_step(model: nn.Module, monitor: FallbackMonitor, step: int, counters: RunCounters) -> list[dict]:
    """One optimizer step of the policy on ``model`` (after the scalers advanced) on its ``counters`` (the step
    record's, :func:`~.training.sync_and_advance`): update the evidence, make the tensors that qualify fall back to
    the remedy of their symptom (recording ``step``, the rule, the evidence and the counters at that point), and verify the earlier decisions (:func:`verify_decisions`) -> the new decisions,
    as :func:`fallen_back` lists them. Every data-parallel rank takes the same decisions (the counters are the same
    on every rank, the SQNR is summed over them)."""
    tensors = quantized_tensors(model)
    if not tensors:
        return []
    events, steps, sqnr = counters
    policy = monitor.policy
    eligible = torch.tensor([operand not in layer.fallback for _, layer, operand in tensors])
    # a current-scaled tensor cannot be cured of saturation by current scaling
    saturation_eligible = eligible & torch.tensor([not BY_NAME[policy.on_saturation].already(layer.scaler_of(operand))
                                                   for _, layer, operand in tensors])
    monitor.verified = verify_decisions(tensors, policy, events, steps, sqnr, step)
    already = int((~eligible).sum())
    new = []
    for decision in monitor.update(events, steps, sqnr if policy.sqnr_floor_db is not None else None, eligible,
                                   saturation_eligible, already):
        name, layer, operand = tensors[decision.index]
        i = decision.index
        layer.fall_back(operand, policy.remedy(decision.reason), step=step, reason=decision.reason,
                        evidence=decision.evidence, events_at=int(events[i]), steps_at=int(steps[i]),
                        sqnr_at=None if sqnr is None or math.isnan(float(sqnr[i])) else round(float(sqnr[i]), 2))
        new.append({"module": name, "operand": str(operand), **layer.fallback[operand].as_dict()})
    if monitor.stopped is not None and "step" not in monitor.stopped:
        monitor.stopped["step"] = step
    return new


def verify_decisions(tensors: list, policy: FallbackPolicy, events: torch.Tensor, steps: torch.Tensor,
                     sqnr: torch.Tensor | None, step: int) -> list[dict]:
    """Check each unverified decision against the tensor's counters since: a high-precision operand must not have
    been quantized again (verified at the next step); a current-scaled one must show no saturation event over the
    ``window`` quantized steps after it (its SQNR then and before, where measured). The verdict (``worked``,
    ``did not work``) goes into the decision's record -> the decisions verified now."""
    done = []
    for i, (name, layer, operand) in enumerate(tensors):
        record = layer.fallback.get(operand)
        if record is None or record.verified is not None or record.steps_at is None or record.step >= step:
            continue
        since_steps, since_events = int(steps[i]) - record.steps_at, int(events[i]) - record.events_at
        measured = sqnr is not None and not math.isnan(float(sqnr[i]))
        sqnr_after = round(float(sqnr[i]), 2) if measured else record.sqnr_after
        if record.unquantized:
            worked = since_steps == 0
            text = ("unquantized since: no 8-bit error, nothing clipped" if worked else
                    f"still quantized: {since_steps} quantized steps since")
        elif since_steps >= policy.window:
            worked = since_events == 0
            text = f"{since_events} saturation events in the {since_steps} quantized steps since"
            if record.sqnr_at is not None and sqnr_after is not None:
                text += f"; SQNR {record.sqnr_at:.2f} -> {sqnr_after:.2f} dB"
        else:
            if sqnr_after != record.sqnr_after:  # the SQNR after, measured while the window fills
                layer.fallback[operand] = replace(record, sqnr_after=sqnr_after)
            continue
        layer.fallback[operand] = record = replace(record, verified=Verdict(step, worked, text), sqnr_after=sqnr_after)
        done.append({"module": name, "operand": str(operand), **record.as_dict()})
    return done


def pending_verification(record: dict) -> str | None:
    """``None`` once a decision is verified, else what it waits for (a decision recorded by an earlier version: not recorded)."""
    if record.get("verified") is not None:
        return None
    return "not verified: its counters at the decision were not recorded" if "steps_at" not in record else \
        "pending: fewer quantized steps since than the window"
