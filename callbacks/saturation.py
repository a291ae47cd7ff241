"""AmaxSaturationCallback: each optimizer step's saturation, what-if, health and forecast, logged at the step they
describe, and ``saturation_summary.json`` at the end of fit.

Once per optimizer step it takes the step's record the core read (:class:`~qat_app.hif8.step_record.StepRecord`,
published by the LightningModule as ``step_record``) and logs ``sat/*``, ``whatif/*`` and ``forecast/*`` every
step, the per-tensor keys, ``health/*`` and ``headroom/*`` every ``log_every_n_steps`` (health is measured on those steps
only). The metrics: docs/diagnostics/saturation.md and docs/diagnostics/health.md; the figures:
:mod:`.health_log`, :mod:`.forecast_log`. DDP is told not to broadcast the scalers' buffers (each rank keeps
its own run totals).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import NamedTuple

import lightning as L
import torch

from qat_app.errors import ConfigError
from qat_app.hif8.counters import as_rows, gather_columns
from qat_app.hif8.fallback import fallback_decisions, quantized_tensors
from qat_app.hif8.forecast import SaturationForecast
from qat_app.hif8.health import WHATIF_ALGOS
from qat_app.hif8.quantized import set_health_measurement
from qat_app.hif8.recipe import DEFAULT_BLOCK_PATTERN
from qat_app.hif8.scaling import keep_scalers_out_of_ddp_broadcast

from qat_app.hif8.step_record import WHATIF_COUNT, StepRecord, named_scalers, short_name

from .forecast_log import clip_headrooms, forecast_metrics
from .health_log import HealthLog, finite_or_none, headroom_setup
from .per_step import PerOptimizerStep

log = logging.getLogger(__name__)
TOTAL_FIELDS = ("saturation_events", "quantized_steps", "min_headroom", "a_hat", "scale", "steps_recorded")
TOTAL_COUNT_FIELDS = ("total_clipped", "total_numel")
# the model-wide saturation series (the per-tensor ones are sat/<layer>.<operand>/clipped_frac, a_hat/..., amax/...)
MIN_HEADROOM, MEDIAN_HEADROOM, MAX_CLIPPED_FRAC = "sat/min_headroom", "sat/median_headroom", "sat/max_clipped_frac"


def saturation_metrics(stats: StepRecord) -> dict[str, float]:
    """The model-wide ``sat/*`` series of one step."""
    rows = stats.rows
    clipped, numel = sum(r.clipped for r in rows), sum(r.numel for r in rows)
    metrics = {"sat/clipped": clipped, "sat/clipped_frac": clipped / numel if numel else 0.0,
               "sat/events": float(sum(r.clipped > 0 for r in rows))}
    headrooms = [r.headroom for r in rows if r.numel > 0 and math.isfinite(r.headroom)]
    if headrooms:
        metrics[MIN_HEADROOM] = min(headrooms)
        metrics[MEDIAN_HEADROOM] = float(torch.tensor(headrooms).median())
    fractions = [r.clipped / r.numel for r in rows if r.numel > 0]
    if fractions:
        metrics[MAX_CLIPPED_FRAC] = max(fractions)  # the worst tensor's
    return metrics


def whatif_metrics(stats: StepRecord) -> dict[str, float]:
    """What each estimator would have clipped in the step, over all tensors."""
    whatif = stats.columns[WHATIF_COUNT]
    metrics = {}
    for k, algo in enumerate(WHATIF_ALGOS):
        metrics[f"whatif/{algo}/clipped"] = float(whatif[:, k].sum())
        metrics[f"whatif/{algo}/events"] = float((whatif[:, k] > 0).sum())
    return metrics


class TotalsRow(NamedTuple):
    """One tensor's run totals (:data:`TOTAL_FIELDS` then :data:`TOTAL_COUNT_FIELDS`)."""

    saturation_events: float
    quantized_steps: float
    min_headroom: float
    a_hat: float
    scale: float
    steps_recorded: float
    clipped: float
    seen: float


def step_record_of(pl_module: L.LightningModule, step: int) -> StepRecord | None:
    """The record of optimizer step ``step`` the module published, with the quantized tensors' figures read
    (None: a module that publishes none, or no quantized tensor)."""
    record = getattr(pl_module, "step_record", None)
    return record if record is not None and record.step == step and record.read else None


def fallback_stopped(pl_module: L.LightningModule) -> dict | None:
    """The fallback budget's stop (step, qualified, already, budget, diagnosis) of the module's fallback policy,
    or None while it decides (or without one)."""
    monitor = getattr(pl_module, "fallback_monitor", None)
    return dict(monitor.stopped) if monitor is not None and monitor.stopped is not None else None


# what saturation_summary.json's figures mean (its "definition" entry)
SUMMARY_DEFINITION = ("clipped: the clamp to +-max_val changed the element's quantized value; seen: elements of "
                      "quantized forwards, summed over data-parallel ranks; headroom: a_hat / amax of a quantized step; "
                      "whatif: what each estimator would have clipped on the same tensor with the same history (to "
                      "first order: on the trajectory actually trained), events: steps with >= 1 such element; "
                      "health: measured on logged steps (qat_app.hif8.health): SQNR in dB of x vs its fake "
                      "quantization, underflow: non-zero elements quantized to 0 over all elements, outlier factor: "
                      "amax / p99.9(|x|) (p99.9 from a ~9 % log histogram: at most 12.5 % high), tiers: fractions of "
                      "elements by the mantissa bits of their quantized value; fallback: the tensors the fallback "
                      "policy (qat_app.hif8.fallback) switched to current scaling or high precision, with the step "
                      "whose counters decided, the rule and its evidence; headroom: at the last measured step, each tensor's SQNR "
                      "and clipped elements estimated at every max_val of the grid from its |x| histogram (estimate: "
                      "uniform within a bin; low/high: the bound that holds for any tensor, qat_app.hif8.headroom), "
                      "per operand and block the mean estimated SQNR, and the suggested max_val (the highest mean "
                      "SQNR with no more possibly-clipped elements than at the run's own max_val); forecast: each tensor's "
                      "headroom (a_hat / amax) trend over its last quantized steps (Theil-Sen), warned when it is "
                      "forecast to clip within the horizon; hits: it clipped while warned (lead_steps), false "
                      "alarms: the warning cleared or the run ended without a clip, misses: a first clip unwarned "
                      "(qat_app.hif8.forecast)")


class AmaxSaturationCallback(PerOptimizerStep):
    """Args:
        per_layer: log the per-layer keys (every ``trainer.log_every_n_steps``).
        summary_file: name of the JSON summary written at the end of fit (None: none).
        health: measure and log numeric health every ``trainer.log_every_n_steps`` (per tensor with ``per_layer``).
        headroom: with the health figures, the what-if headroom (:mod:`qat_app.hif8.headroom`): each tensor's
            SQNR and clipping at every ``max_val`` of ``headroom_grid``, and the suggested ``max_val``. None (the
            default): on where health is measured.
        headroom_grid: the ``max_val`` settings evaluated (None: :data:`qat_app.hif8.headroom.DEFAULT_GRID`); the
            run's own ``max_val`` is always added.
        forecast: the saturation forecast (:mod:`qat_app.hif8.forecast`): every step, each tensor's headroom trend
            and its steps to the first clip at that rate; a warning when that is within ``forecast_horizon``.
        forecast_horizon: in optimizer steps (None: one window, the scalers' ``history_len``).
    """

    def __init__(self, per_layer: bool = True, summary_file: str | None = "saturation_summary.json",
                 health: bool = True, headroom: bool | None = None, headroom_grid: list[float] | None = None,
                 forecast: bool = True, forecast_horizon: int | None = None) -> None:
        self.per_layer = per_layer
        self.summary_file = summary_file
        self.health = health
        if headroom and not health:
            raise ConfigError("saturation.headroom needs the health measurement (its histograms): set "
                              "saturation.health true, or saturation.headroom false")
        self.headroom = health if headroom is None else headroom
        self.headroom_grid = headroom_grid
        self.health_log = HealthLog(per_layer)
        if forecast_horizon is not None and not (isinstance(forecast_horizon, int) and forecast_horizon > 0):
            raise ConfigError(f"saturation.forecast_horizon: must be a positive number of optimizer steps, got "
                              f"{forecast_horizon!r}")
        self.forecast_on, self.forecast_horizon = forecast, forecast_horizon
        self.forecast: SaturationForecast | None = None  # built at setup, when the window is known
        self._forecast_state: dict | None = None  # a checkpoint's, until then
        self._clip_headroom: dict[str, float] = {}  # tensor -> the headroom under which it clips (at setup)
        self._measuring = False  # the quantized matmuls' health switch, as last set
        self.summary_path: str | None = None
        self.first_clipped_step: dict[str, int] = {}  # tensor -> first optimizer step that clipped
        self.last_logged: StepRecord | None = None  # the last step logged in full (the dashboard's heatmaps)

    # the health figures live in the HealthLog; the checkpoint's state keys name them as before
    @property
    def health_last(self) -> dict[str, dict]:
        return self.health_log.last

    @property
    def health_worst(self) -> dict[str, dict]:
        return self.health_log.worst

    @property
    def headroom_last(self) -> dict | None:
        return self.health_log.headroom_last

    def state_dict(self) -> dict:
        return {"first_clipped_step": dict(self.first_clipped_step), "health_last": dict(self.health_last),
                "health_worst": dict(self.health_worst), "headroom_last": self.headroom_last,
                "forecast": self.forecast.state_dict() if self.forecast is not None else self._forecast_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.first_clipped_step = dict(state_dict.get("first_clipped_step", {}))
        self.health_log.last = dict(state_dict.get("health_last", {}))
        self.health_log.worst = dict(state_dict.get("health_worst", {}))
        self.health_log.headroom_last = state_dict.get("headroom_last")
        self._forecast_state = state_dict.get("forecast")
        if self.forecast is not None and self._forecast_state is not None:
            self.forecast.load_state_dict(self._forecast_state)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before the strategy wraps the module: DDP must not overwrite each rank's counters with rank 0's
        keep_scalers_out_of_ddp_broadcast(pl_module)
        tensors = quantized_tensors(pl_module.model)
        if self.forecast_on and tensors and self.forecast is None:
            window = tensors[0][1].scaler_of(tensors[0][2]).history_len
            self.forecast = SaturationForecast(window, self.forecast_horizon)
            self._clip_headroom = clip_headrooms(tensors)
            if self._forecast_state is not None:
                self.forecast.load_state_dict(self._forecast_state)
        if self.headroom:
            quant = getattr(pl_module, "quant", None)
            self.health_log.setup = headroom_setup(pl_module.model, self.headroom_grid,
                                                  getattr(quant, "block_pattern", DEFAULT_BLOCK_PATTERN), tensors)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # health is measured on the steps it is logged for: those completing step global_step + 1 (below)
        measure = self.health and self.logging_step(trainer, trainer.global_step + 1)
        if measure != self._measuring:
            set_health_measurement(pl_module.model, measure)
            self._measuring = measure

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._measuring:
            set_health_measurement(pl_module.model, False)
            self._measuring = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = self.completed_step(trainer)
        if step is None or step < 0:
            return
        stats = step_record_of(pl_module, step)
        if stats is None:
            return
        logged = self.logging_step(trainer, step + 1)
        for name, row in zip(stats.names, stats.rows):
            if row.clipped > 0:
                self.first_clipped_step.setdefault(name, step)
        metrics = {**saturation_metrics(stats), **whatif_metrics(stats)}
        if stats.health:
            metrics.update(self.health_log.metrics(stats))
        if self.forecast is not None:
            metrics.update(forecast_metrics(self.forecast, self._clip_headroom, stats, self.per_layer and logged,
                                            trainer.is_global_zero))
        if self.per_layer and logged:
            metrics.update(self._per_tensor_metrics(stats))
        self.log_at(trainer, metrics, step)  # not via self.log: on the step they describe, once
        pl_module.log("sat/clipped", metrics["sat/clipped"], on_step=True, prog_bar=True, logger=False)
        pl_module.log("sat/clipped_frac", metrics["sat/clipped_frac"], on_step=True, prog_bar=True, logger=False)

    def _per_tensor_metrics(self, stats: StepRecord) -> dict[str, float]:
        """The logged step's per-tensor keys; the step kept for the dashboard's pictures (``last_logged``)."""
        self.last_logged = stats
        metrics = {}
        for name, row in zip(stats.names, stats.rows):
            metrics[f"amax/{name}"] = row.amax
            if row.numel:  # quantized this step: the estimate it used, and what it clipped
                metrics[f"a_hat/{name}"] = row.a_hat
                metrics[f"sat/{name}/clipped_frac"] = row.clipped / row.numel
        return metrics

    def _tensor_summaries(self, pl_module: L.LightningModule) -> tuple[dict[str, dict], dict[str, dict]]:
        """Each quantized tensor's run totals over all ranks (a collective), what-if counts, health and fallback
        -> (the summary's tensors, the fallback entries by tensor)."""
        pairs = named_scalers(pl_module.model)
        columns = gather_columns(pairs, TOTAL_FIELDS + ("whatif_events",),
                                 TOTAL_COUNT_FIELDS + ("total_whatif_clipped",))
        rows = [TotalsRow(*row) for row in as_rows(columns, TOTAL_FIELDS + TOTAL_COUNT_FIELDS)]

        def whatif_of(index: int) -> dict[str, dict[str, int]]:
            clipped, events = columns["total_whatif_clipped"][index], columns["whatif_events"][index]
            return {algo: {"clipped": int(clipped[k]), "events": int(events[k])} for k, algo in enumerate(WHATIF_ALGOS)}

        decisions = {operand.tensor_name(short_name(name)): decision
                     for name, operand, decision in fallback_decisions(pl_module.model)}
        fallback = {name: decision.as_dict() for name, decision in decisions.items()}
        tensors = {
            name: {
                "clipped": int(r.clipped), "seen": int(r.seen), "clipped_frac": r.clipped / r.seen if r.seen else 0.0,
                "saturation_events": int(r.saturation_events), "quantized_steps": int(r.quantized_steps),
                "min_headroom": finite_or_none(r.min_headroom),
                "first_clipped_step": self.first_clipped_step.get(name),
                "a_hat": r.a_hat, "scale": r.scale, "steps_recorded": int(r.steps_recorded),
                "whatif": whatif_of(index), "health": self.health_log.of(name, decisions.get(name)),
                "fallback": fallback.get(name),
            }
            for index, ((name, _), r) in enumerate(zip(pairs, rows))
        }
        return tensors, {name: {"tensor": name, **entry} for name, entry in fallback.items()}

    def summary(self, pl_module: L.LightningModule) -> dict:
        """Run totals over all ranks (a collective: call it on every rank)."""
        tensors, fallback = self._tensor_summaries(pl_module)
        # tensors by their worst logged SQNR, lowest first (an SQNR of inf: quantized without error, last)
        worst_first = sorted(self.health_worst.items(), key=lambda item: item[1]["sqnr_db"])
        clipped = sum(t["clipped"] for t in tensors.values())
        seen = sum(t["seen"] for t in tensors.values())
        headrooms = [t["min_headroom"] for t in tensors.values() if t["min_headroom"] is not None]
        return {
            "quantized_tensors": len(tensors),
            "clipped": clipped,
            "seen": seen,
            "clipped_frac": clipped / seen if seen else 0.0,
            "saturation_events": sum(t["saturation_events"] for t in tensors.values()),
            "quantized_steps": max((t["quantized_steps"] for t in tensors.values()), default=0),
            "first_clipped_step": min(self.first_clipped_step.values(), default=None),
            "min_headroom": min(headrooms, default=None),
            "tensors_clipped": [name for name, t in tensors.items() if t["clipped"] > 0],
            "whatif": {algo: {key: sum(t["whatif"][algo][key] for t in tensors.values())
                              for key in ("clipped", "events")} for algo in WHATIF_ALGOS},
            "fallback": sorted(fallback.values(), key=lambda entry: entry.get("step", 0)),  # in the order decided
            "fallback_stopped": fallback_stopped(pl_module),
            "headroom": self.headroom_last,
            "forecast": self.forecast.scored() if self.forecast is not None else None,
            "health_worst": [{"tensor": name, "worst_sqnr_db": finite_or_none(w["sqnr_db"]), "step": w["step"],
                              "last": self.health_last.get(name)} for name, w in worst_first],
            "definition": SUMMARY_DEFINITION,
            "tensors": tensors,
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.summary_file:
            return
        directory = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): on every rank
        summary = self.summary(pl_module)  # a collective too
        if not trainer.is_global_zero:
            return
        summary["global_step"] = trainer.global_step
        os.makedirs(directory, exist_ok=True)
        self.summary_path = os.path.join(directory, self.summary_file)
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        log.info(
            "saturation: %d of %d quantized elements clipped (%.3g%%), %d saturation events; summary in %s",
            summary["clipped"], summary["seen"], 100 * summary["clipped_frac"], summary["saturation_events"],
            self.summary_path,
        )
