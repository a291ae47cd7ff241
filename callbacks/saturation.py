"""AmaxSaturationCallback: per-step saturation and a_hat-vs-amax logging, plus a JSON summary.

Once per optimizer step (the first ``on_train_batch_end`` after ``global_step`` moved, i.e. after
the scalers advanced) it reads the last completed step of every scaler in ONE device->host copy,
the element counts summed over the data-parallel ranks first (one SUM all-reduce), and logs to
every Lightning logger:
  sat/clipped, sat/clipped_frac, sat/events    totals over all quantized tensors (every step)
  sat/min_headroom                             min over tensors of a_hat / amax (quantized steps)
  sat/<layer>.<tensor>/clipped_frac            per layer and tensor (input, weight, grad)
  amax/<layer>.<tensor>, a_hat/<layer>.<tensor> true amax vs the estimate it was quantized with
  whatif/<algo>/clipped, whatif/<algo>/events  what each estimator (most_recent, exp_smooth, max, current)
                                               would have clipped on the same tensors with the same
                                               histories: elements, and tensors with >= 1 (every step)
  health/<tensor>/sqnr_db, .../underflow_frac, .../outlier_factor, .../tier/<mant3|mant2|mant1|denormal|zero>
  health/min_sqnr_db, health/underflow_frac    numeric health (every ``log_every_n_steps``)
(per-layer keys every ``log_every_n_steps``; a_hat only once the tensor is quantized). "Clipped"
means the clamp changed the quantized value (:mod:`qat_app.hif8.fake_quant`); fractions are of the
elements of quantized forwards only (the BF16 warmup quantizes nothing). The what-if counts and the health
figures are defined in :mod:`qat_app.hif8.health`; health is measured only on the steps it is logged for
(the callback switches it on before their forwards), and non-finite figures (an SQNR of a tensor quantized
without error, an undefined outlier factor) are not logged. At the end of fit it writes
``saturation_summary.json`` (run totals, per tensor and overall; what-if totals per estimator; the last
logged health of each tensor and its worst SQNR, worst first; the fallback decisions) into the logger's directory.

Before DDP wraps the model it tells DDP not to broadcast the scalers' buffers
(:func:`qat_app.hif8.scaling.keep_scalers_out_of_ddp_broadcast`): rank 0's would overwrite each rank's own
run totals, which are summed over the ranks when read.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import NamedTuple

import lightning as L
import torch

from qat_app.errors import ConfigError, settings_of
from qat_app.hif8.counters import HEALTH, as_rows, gather_columns
from qat_app.hif8.fallback import fallen_back, quantized_tensors, scaler_pairs
from qat_app.hif8.forecast import SaturationForecast
from qat_app.hif8.formats import saturation_threshold
from qat_app.hif8.headroom import DEFAULT_GRID, digest, estimate_headroom, validate_grid
from qat_app.hif8.health import FIELDS as HEALTH_FIELDS, WHATIF_ALGOS, summarize
from qat_app.hif8.quantized import FALLBACK_HIGH_PRECISION, set_health_measurement
from qat_app.hif8.recipe import DEFAULT_BLOCK_PATTERN
from qat_app.hif8.scaling import keep_scalers_out_of_ddp_broadcast

log = logging.getLogger(__name__)
# per step: (amax, a_hat, headroom) are identical on every rank; the element counts are summed
FIELDS = ("last_amax", "last_a_hat", "last_headroom")
COUNT_FIELDS = ("last_clipped", "last_numel")
TOTAL_FIELDS = ("saturation_events", "quantized_steps", "min_headroom", "a_hat", "scale", "steps_recorded")
TOTAL_COUNT_FIELDS = ("total_clipped", "total_numel")
WHATIF_COUNT = "last_whatif_clipped"  # per estimator: summed over the ranks


def _short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def named_scalers(model) -> list[tuple[str, object]]:
    """``(tensor name, scaler)`` of every quantized tensor: ``layers.7.mlp.up_proj.input``."""
    return [(_short(name), scaler) for name, scaler in scaler_pairs(quantized_tensors(model))]


def fallback_entries(model) -> list[dict]:
    """The fallback decisions of ``model`` (:func:`qat_app.hif8.fallback.fallen_back`), named like the tensors here."""
    return [{"tensor": f"{_short(d['module'])}.{d['operand']}", **{k: v for k, v in d.items() if k not in ("module", "operand")}}
            for d in fallen_back(model)]


def _fallback_stopped(pl_module: L.LightningModule) -> dict | None:
    """The fallback budget's stop (``callbacks.fallback``, which imports this module: found by its method)."""
    trainer = getattr(pl_module, "_trainer", None)
    found = (c.fallback_stopped() for c in (trainer.callbacks if trainer is not None else []) if hasattr(c, "fallback_stopped"))
    return next((stopped for stopped in found if stopped is not None), None)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def clip_headrooms(tensors) -> dict[str, float]:
    """tensor name -> the headroom a_hat / amax under which a step of it clips: max_val / (threshold 2^margin), for
    :func:`~qat_app.hif8.fallback.quantized_tensors`' entries (a fallback keeps the scaler and its max_val)."""
    return {_short(f"{name}.{operand}"): (scaler := layer.scaler_of(operand)).max_val / (
        saturation_threshold(layer.format.name, scaler.max_val) * 2.0**scaler.margin)
        for name, layer, operand in tensors}


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
    run_max_val = {operand: float(layer.scaler_of(operand).max_val) for _, layer, operand in tensors}
    scaler = layer.scaler_of(tensors[0][2])
    if grid is None:  # the default grid, up to the format's largest finite value (E4M3: 448)
        top = layer.format.max_finite
        grid = [v for v in DEFAULT_GRID if v < top] + [top]
    with settings_of("saturation"):
        values = validate_grid(grid, layer.format.name, "headroom_grid")
    values = tuple(sorted(set(values) | set(run_max_val.values())))
    return HeadroomSetup(values, run_max_val, layer.format.name, float(scaler.margin), bool(scaler.power_2),
                         block_pattern)


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


class AmaxSaturationCallback(L.Callback):
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
        self._headroom_setup: HeadroomSetup | None = None  # found at setup
        self.headroom_last: dict | None = None  # the last measured step's digest (qat_app.hif8.headroom.digest)
        if forecast_horizon is not None and not (isinstance(forecast_horizon, int) and forecast_horizon > 0):
            raise ConfigError(f"saturation.forecast_horizon: must be a positive number of optimizer steps, got "
                              f"{forecast_horizon!r}")
        self.forecast_on, self.forecast_horizon = forecast, forecast_horizon
        self.forecast: SaturationForecast | None = None  # built at setup, when the window is known
        self._forecast_state: dict | None = None  # a checkpoint's, until then
        self._clip_headroom: dict[str, float] = {}  # tensor -> the headroom under which it clips (at setup)
        self._logged_step = -1
        self._measuring = False  # the quantized matmuls' health switch, as last set
        self.summary_path: str | None = None
        self.first_clipped_step: dict[str, int] = {}  # tensor -> first optimizer step that clipped
        self.health_last: dict[str, dict] = {}  # tensor -> its last logged health figures (and their step)
        self.health_worst: dict[str, dict] = {}  # tensor -> {"sqnr_db", "step"}: its lowest logged SQNR

    def state_dict(self) -> dict:
        return {"first_clipped_step": dict(self.first_clipped_step), "health_last": dict(self.health_last),
                "health_worst": dict(self.health_worst), "headroom_last": self.headroom_last,
                "forecast": self.forecast.state_dict() if self.forecast is not None else self._forecast_state}

    def load_state_dict(self, state_dict: dict) -> None:
        self.first_clipped_step = dict(state_dict.get("first_clipped_step", {}))
        self.health_last = dict(state_dict.get("health_last", {}))
        self.health_worst = dict(state_dict.get("health_worst", {}))
        self.headroom_last = state_dict.get("headroom_last")
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
            self._headroom_setup = headroom_setup(pl_module.model, self.headroom_grid,
                                                  getattr(quant, "block_pattern", DEFAULT_BLOCK_PATTERN), tensors)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a resumed run logged the step before the checkpoint already: start with the next one
        self._logged_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        # health is measured on the steps it is logged for: those completing step global_step + 1 (below)
        measure = self.health and (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) == 0
        if measure != self._measuring:
            set_health_measurement(pl_module.model, measure)
            self._measuring = measure

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._measuring:
            set_health_measurement(pl_module.model, False)
            self._measuring = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._logged_step or step == 0:
            return
        self._logged_step = step
        pairs = named_scalers(pl_module.model)
        if not pairs:
            return
        log_layers = step % max(1, trainer.log_every_n_steps) == 0
        health_step = self.health and log_layers  # the step that ended was measured (on_train_batch_start)
        columns = gather_columns(pairs, FIELDS, COUNT_FIELDS + (WHATIF_COUNT,) + ((HEALTH,) if health_step else ()))
        rows = as_rows(columns, FIELDS + COUNT_FIELDS)
        clipped = sum(r[3] for r in rows)
        numel = sum(r[4] for r in rows)
        for (name, _), row in zip(pairs, rows):
            if row[3] > 0:
                self.first_clipped_step.setdefault(name, step - 1)  # the step the counts describe
        headrooms = [r[2] for r in rows if r[4] > 0 and math.isfinite(r[2])]
        metrics = {
            "sat/clipped": clipped,
            "sat/clipped_frac": clipped / numel if numel else 0.0,
            "sat/events": float(sum(r[3] > 0 for r in rows)),
        }
        if headrooms:
            metrics["sat/min_headroom"] = min(headrooms)
        whatif = columns[WHATIF_COUNT]
        for k, algo in enumerate(WHATIF_ALGOS):
            metrics[f"whatif/{algo}/clipped"] = float(whatif[:, k].sum())
            metrics[f"whatif/{algo}/events"] = float((whatif[:, k] > 0).sum())
        if health_step:
            metrics.update(self._health_metrics(pairs, columns, step - 1))
        if self.forecast is not None:
            metrics.update(self._forecast_metrics(pairs, rows, step - 1, log_layers, trainer.is_global_zero))
        if self.per_layer and log_layers:
            for (name, _), (amax, a_hat, _headroom, n_clipped, n_seen) in zip(pairs, rows):
                metrics[f"amax/{name}"] = amax
                if n_seen:  # quantized this step: the estimate it used, and what it clipped
                    metrics[f"a_hat/{name}"] = a_hat
                    metrics[f"sat/{name}/clipped_frac"] = n_clipped / n_seen
        # logged directly (not via self.log) so they land on the step they describe, once per step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        pl_module.log("sat/clipped", clipped, on_step=True, prog_bar=True, logger=False)
        pl_module.log("sat/clipped_frac", metrics["sat/clipped_frac"], on_step=True, prog_bar=True, logger=False)

    def _health_metrics(self, pairs, columns: dict[str, torch.Tensor], step: int) -> dict[str, float]:
        """The health figures of ``step`` (the one that ended), per tensor (with ``per_layer``) and over the run;
        updates each tensor's last and worst figures."""
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
            self.health_last[name] = {"step": step, **{key: _finite_or_none(v) for key, v in values.items()}}
            sqnr = values["sqnr_db"]
            if not math.isnan(sqnr):
                sqnrs.append(sqnr)
                worst = self.health_worst.get(name)
                if worst is None or sqnr < worst["sqnr_db"]:
                    self.health_worst[name] = {"sqnr_db": sqnr, "step": step}
        if sqnrs and math.isfinite(min(sqnrs)):
            metrics["health/min_sqnr_db"] = min(sqnrs)
        if any(measured):
            metrics["health/underflow_frac"] = float(underflow.sum()) / float(numel.sum())
            if self._headroom_setup is not None:
                metrics.update(self._headroom_metrics(pairs, columns, measured, step, figures["sqnr_db"]))
        return metrics

    def _forecast_metrics(self, pairs, rows, step: int, log_layers: bool, say: bool) -> dict[str, float]:
        """The forecast's step (the one that ended): new warnings logged as warnings; the tensors at risk and the
        nearest forecast clip every step, each tensor's forecast on the logged steps (with ``per_layer``)."""
        tensors = [(name, headroom, n_clipped > 0, self._clip_headroom[name])
                   for (name, _), (_amax, _a_hat, headroom, n_clipped, _n) in zip(pairs, rows)]
        forecasts, warnings = self.forecast.update(step, tensors)
        for w in warnings if say else ():  # every rank decides the same; one of them says it
            log.warning("saturation forecast: %s is forecast to clip in ~%.0f steps at this rate (headroom a_hat/amax "
                        "%.4f, falling %.4f per window of %d steps; horizon %d)", w["tensor"], w["steps_to_clip"],
                        w["headroom"], -w["slope_per_window"], self.forecast.window, self.forecast.horizon)
        finite = [f["steps_to_clip"] for f in forecasts.values() if math.isfinite(f["steps_to_clip"])]
        metrics = {"forecast/at_risk": float(len(self.forecast.open))}
        if finite:
            metrics["forecast/min_steps_to_clip"] = min(finite)
        if self.per_layer and log_layers:
            for name, f in forecasts.items():
                metrics[f"forecast/{name}/slope_per_window"] = f["slope_per_window"]
                if math.isfinite(f["steps_to_clip"]):
                    metrics[f"forecast/{name}/steps_to_clip"] = f["steps_to_clip"]
        return metrics

    def _headroom_metrics(self, pairs, columns: dict[str, torch.Tensor], measured: list[bool], step: int,
                          sqnr_db: torch.Tensor) -> dict[str, float]:
        """The what-if headroom of the measured tensors of ``step``: kept as ``headroom_last`` (the summary's), logged
        per operand (the mean estimated SQNR at each max_val, the suggested max_val and its estimated gain)."""
        grid, run_max_val, fmt_name, margin, power_2, block_pattern = self._headroom_setup
        rows = [i for i, m in enumerate(measured) if m]
        names = [pairs[i][0] for i in rows]
        a_hat, amax = columns["last_a_hat"][rows], columns["last_amax"][rows]
        estimate = estimate_headroom(columns[HEALTH][rows], torch.where(a_hat > 0, a_hat, amax), amax, grid, fmt_name,
                                     margin, power_2)
        self.headroom_last = {"step": step, **digest(names, estimate, run_max_val, block_pattern)}
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

    def _health_of(self, name: str, fallback: dict | None = None) -> dict:
        """One tensor's last logged health and its worst SQNR (and when), and since when it is unquantized (a
        fallback to high precision: its 8-bit figures stop there)."""
        worst = self.health_worst.get(name, {})
        out = {"last": self.health_last.get(name), "worst_sqnr_db": _finite_or_none(worst.get("sqnr_db", math.nan)),
               "worst_sqnr_step": worst.get("step")}
        if fallback is not None and fallback.get("target") == FALLBACK_HIGH_PRECISION:
            out["unquantized_since"] = fallback.get("step")
        return out

    def _tensor_summaries(self, pl_module: L.LightningModule) -> tuple[dict[str, dict], dict[str, dict]]:
        """Each quantized tensor's run totals over all ranks (a collective), what-if counts, health and fallback
        -> (the summary's tensors, the fallback entries by tensor)."""
        pairs = named_scalers(pl_module.model)
        columns = gather_columns(pairs, TOTAL_FIELDS + ("whatif_events",),
                                 TOTAL_COUNT_FIELDS + ("total_whatif_clipped",))
        rows = as_rows(columns, TOTAL_FIELDS + TOTAL_COUNT_FIELDS)

        def whatif_of(index: int) -> dict[str, dict[str, int]]:
            clipped, events = columns["total_whatif_clipped"][index], columns["whatif_events"][index]
            return {algo: {"clipped": int(clipped[k]), "events": int(events[k])} for k, algo in enumerate(WHATIF_ALGOS)}

        fallback = {entry["tensor"]: entry for entry in fallback_entries(pl_module.model)}
        tensors = {
            name: {
                "clipped": int(r[6]), "seen": int(r[7]), "clipped_frac": r[6] / r[7] if r[7] else 0.0,
                "saturation_events": int(r[0]), "quantized_steps": int(r[1]), "min_headroom": _finite_or_none(r[2]),
                "first_clipped_step": self.first_clipped_step.get(name),
                "a_hat": r[3], "scale": r[4], "steps_recorded": int(r[5]),
                "whatif": whatif_of(index), "health": self._health_of(name, fallback.get(name)),
                "fallback": {k: v for k, v in fallback[name].items() if k != "tensor"} if name in fallback else None,
            }
            for index, ((name, _), r) in enumerate(zip(pairs, rows))
        }
        return tensors, fallback

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
            "fallback_stopped": _fallback_stopped(pl_module),
            "headroom": self.headroom_last,
            "forecast": self.forecast.scored() if self.forecast is not None else None,
            "health_worst": [{"tensor": name, "worst_sqnr_db": _finite_or_none(w["sqnr_db"]), "step": w["step"],
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
