"""The numeric health and what-if headroom figures of the logged steps, for :mod:`callbacks.saturation`: each
tensor's last and worst health, the last headroom digest, and the metrics of a measured step (``health/*``,
``headroom/*``; defined in :mod:`qat_app.hif8.health` and :mod:`qat_app.hif8.headroom`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from qat_app.errors import settings_of
from qat_app.hif8.counters import HEALTH
from qat_app.hif8.fallback import quantized_tensors
from qat_app.hif8.headroom import DEFAULT_GRID, digest, estimate_headroom, validate_grid
from qat_app.hif8.health import FIELDS as HEALTH_FIELDS, TIERS, summarize
from qat_app.hif8.fallback_targets import FallbackDecision, unquantized_by
from qat_app.hif8.recipe import DEFAULT_BLOCK_PATTERN
from qat_app.hif8.step_record import StepRecord


# the model-wide series a person compares at a glance (the per-tensor ones are health/<layer>.<operand>/...)
MIN_SQNR, MEDIAN_SQNR = "health/min_sqnr_db", "health/median_sqnr_db"
UNDERFLOW, MAX_UNDERFLOW = "health/underflow_frac", "health/max_underflow_frac"
TIER_SHARE = "health/tier/{}"  # of all measured elements
OPERAND_MEDIAN_SQNR = "health/median_sqnr_db/{}"  # per operand: input, weight, grad


def model_wide(pairs, figures: dict[str, torch.Tensor], numel: torch.Tensor, measured: list[bool]) -> dict[str, float]:
    """The measured tensors' median SQNR (all, and per operand), largest underflow fraction and the precision tiers'
    shares of all their elements."""
    rows = [i for i, m in enumerate(measured) if m]
    metrics: dict[str, float] = {}
    sqnr = figures["sqnr_db"][rows]
    finite = sqnr[torch.isfinite(sqnr)]
    if finite.numel():
        metrics[MEDIAN_SQNR] = float(finite.median())
    by_operand: dict[str, list[float]] = {}
    for i in rows:
        value = float(figures["sqnr_db"][i])
        if math.isfinite(value):
            by_operand.setdefault(pairs[i][1].operand, []).append(value)
    metrics.update({OPERAND_MEDIAN_SQNR.format(op): float(torch.tensor(v).median()) for op, v in by_operand.items()})
    underflow = figures["underflow_frac"][rows]
    if underflow.numel():
        metrics[MAX_UNDERFLOW] = float(underflow.max())
    weights = numel[rows].double()
    for tier in TIERS:
        share = figures[f"tier/{tier}"][rows].double()
        metrics[TIER_SHARE.format(tier)] = float((share * weights).sum() / weights.sum())
    return metrics


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class HeadroomSetup(NamedTuple):
    """What the what-if headroom needs of a model's quantized tensors, found once at setup."""

    grid: tuple[float, ...]  # the max_val grid, the run's own added
    run_max_val: dict[str, float]  # operand -> the run's max_val
    fmt_name: str
    margin: float
    power_2: bool
    block_pattern: str


def headroom_setup(model, grid, block_pattern: str = DEFAULT_BLOCK_PATTERN, tensors=None) -> HeadroomSetup | None:
    """The :class:`HeadroomSetup` of ``model``'s quantized tensors (``tensors``: :func:`~qat_app.hif8.fallback.quantized_tensors`'s, when
    at hand; None without any); a grid the format cannot hold names ``saturation.headroom_grid``."""
    tensors = quantized_tensors(model) if tensors is None else tensors
    if not tensors:
        return None
    _, layer, _ = tensors[0]
    run_max_val = {operand.value: float(layer.scaler_of(operand).max_val) for _, layer, operand in tensors}
    scaler = layer.scaler_of(tensors[0][2])
    if grid is None:  # the default grid, up to the format's largest finite value (E4M3: 448)
        top = layer.format.max_finite
        grid = [v for v in DEFAULT_GRID if v < top] + [top]
    with settings_of("saturation"):
        values = validate_grid(grid, layer.format.name, "headroom_grid")
    values = tuple(sorted(set(values) | set(run_max_val.values())))
    return HeadroomSetup(values, run_max_val, layer.format.name, float(scaler.margin), bool(scaler.power_2),
                         block_pattern)


class HealthLog:
    """Each tensor's last logged health (``last``), its worst SQNR (``worst``) and the last what-if headroom digest
    (``headroom_last``); :meth:`metrics` turns one measured step's health vectors into metrics and updates them."""

    def __init__(self, per_layer: bool) -> None:
        self.per_layer = per_layer
        self.setup: HeadroomSetup | None = None  # found at the callback's setup, when the headroom is on
        self.last: dict[str, dict] = {}  # tensor -> its last logged health figures (and their step)
        self.worst: dict[str, dict] = {}  # tensor -> {"sqnr_db", "step"}: its lowest logged SQNR
        self.headroom_last: dict | None = None  # the last measured step's digest (qat_app.hif8.headroom.digest)

    def metrics(self, stats: StepRecord) -> dict[str, float]:
        """The health figures of the step that ended (measured), per tensor (with ``per_layer``) and over the run;
        updates each tensor's last and worst figures."""
        pairs, columns, step = stats.pairs, stats.columns, stats.step
        vectors = columns[HEALTH]
        figures = summarize(vectors, columns["last_amax"])
        numel, underflow = (vectors[:, HEALTH_FIELDS.index(f)] for f in ("numel", "underflow"))
        measured = (numel > 0).tolist()
        metrics: dict[str, float] = {}
        sqnrs = []
        for index, (name, _) in enumerate(pairs):
            if not measured[index]:
                continue
            values = {key: float(value[index]) for key, value in figures.items()}
            if self.per_layer:
                metrics.update({f"health/{name}/{key}": v for key, v in values.items() if math.isfinite(v)})
            self.last[name] = {"step": step, **{key: finite_or_none(v) for key, v in values.items()}}
            sqnr = values["sqnr_db"]
            if not math.isnan(sqnr):
                sqnrs.append(sqnr)
                worst = self.worst.get(name)
                if worst is None or sqnr < worst["sqnr_db"]:
                    self.worst[name] = {"sqnr_db": sqnr, "step": step}
        if sqnrs and math.isfinite(min(sqnrs)):
            metrics[MIN_SQNR] = min(sqnrs)
        if any(measured):
            metrics[UNDERFLOW] = float(underflow.sum()) / float(numel.sum())
            metrics.update(model_wide(pairs, figures, numel, measured))
            if self.setup is not None:
                metrics.update(self._headroom_metrics(pairs, columns, measured, step, figures["sqnr_db"]))
        return metrics

    def _headroom_metrics(self, pairs, columns: dict[str, torch.Tensor], measured: list[bool], step: int,
                          sqnr_db: torch.Tensor) -> dict[str, float]:
        """The what-if headroom of the measured tensors of ``step``: kept as ``headroom_last`` (the summary's), logged
        per operand (the mean estimated SQNR at each max_val, the suggested max_val and its estimated gain)."""
        grid, run_max_val, fmt_name, margin, power_2, block_pattern = self.setup
        rows = [i for i, m in enumerate(measured) if m]
        names = [pairs[i][0] for i in rows]
        a_hat, amax = columns["last_a_hat"][rows], columns["last_amax"][rows]
        estimate = estimate_headroom(columns[HEALTH][rows], torch.where(a_hat > 0, a_hat, amax), amax, grid, fmt_name,
                                     margin, power_2)
        operands = [pairs[i][1].operand for i in rows]
        self.headroom_last = {"step": step, **digest(names, operands, estimate, run_max_val, block_pattern)}
        # what the step really had at the run's own max_val (the health's exact SQNR, the real counter): what another
        # run's estimate at this max_val is checked against (the report's cross-check)
        measured_db = sqnr_db[rows]
        finite = measured_db[torch.isfinite(measured_db)]
        self.headroom_last["measured"] = {"sqnr_db": float(finite.mean()) if finite.numel() else None,
                                          "clipped": int(columns["last_clipped"][rows].sum())}
        metrics = {}
        for operand, entry in (("all", self.headroom_last), *self.headroom_last["by_operand"].items()):
            best = entry["suggested"]["all"] if operand == "all" else entry["suggested"]
            if best is not None:
                metrics[f"headroom/{operand}/best_max_val"] = best
            if entry["gain_db"] is not None:
                metrics[f"headroom/{operand}/gain_db"] = entry["gain_db"]
            if operand != "all":
                metrics.update({f"headroom/{operand}/sqnr_db/max_val_{m:g}": v
                                for m, v in zip(grid, entry["sqnr_db"]) if v is not None})
        return metrics

    def of(self, name: str, decision: FallbackDecision | None = None) -> dict:
        """One tensor's last logged health and its worst SQNR (and when), and since when it is unquantized (a
        fallback to high precision: its 8-bit figures stop there)."""
        worst = self.worst.get(name, {})
        out = {"last": self.last.get(name), "worst_sqnr_db": finite_or_none(worst.get("sqnr_db", math.nan)),
               "worst_sqnr_step": worst.get("step")}
        if unquantized_by(decision):
            out["unquantized_since"] = decision.step
        return out
