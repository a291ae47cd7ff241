"""The saturation forecast's metrics and warnings for :mod:`callbacks.saturation` (``forecast/*``; the forecast itself
is :mod:`qat_app.hif8.forecast`)."""

from __future__ import annotations

import logging
import math

from qat_app.hif8.forecast import SaturationForecast
from qat_app.hif8.formats import saturation_threshold
from qat_app.hif8.step_record import StepRecord, short_name

log = logging.getLogger("callbacks.saturation")


def clip_headrooms(tensors) -> dict[str, float]:
    """tensor name -> the headroom a_hat / amax under which a step of it clips: max_val / (threshold 2^margin), for
    :func:`~qat_app.hif8.fallback.quantized_tensors`' entries (a fallback keeps the scaler and its max_val)."""
    return {short_name(operand.tensor_name(name)): (scaler := layer.scaler_of(operand)).max_val / (
        saturation_threshold(layer.format.name, scaler.max_val) * 2.0**scaler.margin)
        for name, layer, operand in tensors}


def forecast_metrics(forecast: SaturationForecast, clip_headroom: dict[str, float], stats: StepRecord,
                     per_layer: bool, say: bool) -> dict[str, float]:
    """The forecast's step (the one that ended): new warnings logged as warnings; the tensors at risk and the
    nearest forecast clip every step, each tensor's forecast on the logged steps (with ``per_layer``)."""
    tensors = [(name, row.headroom, row.clipped > 0, clip_headroom[name]) for name, row in zip(stats.names, stats.rows)]
    forecasts, warnings = forecast.update(stats.step, tensors)
    for w in warnings if say else ():  # every rank decides the same; one of them says it
        log.warning("saturation forecast: %s is forecast to clip in ~%.0f steps at this rate (headroom a_hat/amax "
                    "%.4f, falling %.4f per window of %d steps; horizon %d)", w["tensor"], w["steps_to_clip"],
                    w["headroom"], -w["slope_per_window"], forecast.window, forecast.horizon)
    finite = [f["steps_to_clip"] for f in forecasts.values() if math.isfinite(f["steps_to_clip"])]
    metrics = {"forecast/at_risk": float(len(forecast.open))}
    if finite:
        metrics["forecast/min_steps_to_clip"] = min(finite)
    if per_layer:
        for name, f in forecasts.items():
            metrics[f"forecast/{name}/slope_per_window"] = f["slope_per_window"]
            if math.isfinite(f["steps_to_clip"]):
                metrics[f"forecast/{name}/steps_to_clip"] = f["steps_to_clip"]
    return metrics
