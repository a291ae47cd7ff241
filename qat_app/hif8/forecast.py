"""Saturation forecast: see a tensor heading for its first clip before it happens (:class:`SaturationForecast`).

Per tensor, a robust line (Theil-Sen) is fitted to the headroom ``a_hat / amax`` of its last quantized steps;
where it falls significantly it is extrapolated to the clip line ``max_val / (threshold * 2^margin)``, raised by
two robust spreads: the steps to the first clip at this rate. A tensor forecast to clip within ``horizon`` steps
is at risk and warned about once, again only after it cleared. At the end of a run each warning is scored (a hit
with its lead, a false alarm, open at the end) and each first clip without a warning is a miss. Contract:
host-side, on the headrooms the saturation callback already reads once per step (no per-forward work, no extra
sync); the state is a plain ``state_dict``, so a resumed run forecasts exactly what the uninterrupted one would.

See ``docs/diagnostics/saturation.md`` ("Saturation forecast") for the logged figures and the settings.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import torch

from .errors import FieldError

DEFAULT_POINTS = 16  # quantized steps the trend is fitted on, at least (and at least the horizon)
MIN_POINTS = 6
# a step clips when its headroom is under h_clip, and steps scatter about the trend: the forecast is for the trend
# coming within this many robust spreads of h_clip (about 2.3 % of steps fall further below a line)
NOISE_SIGMAS = 2.0
# a trend is one when its slope is at least this many standard errors below zero (one-sided; a stationary tensor's
# fit gets there about once in 30,000, and its fits overlap step after step): the scatter of a stationary tensor's
# headroom makes smaller slopes on its own
SIGNIFICANCE = 4.0


def _median_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's median as ``statistics.median`` takes it: the middle value, or the mean of the two middle ones."""
    ordered = x.sort(dim=1).values
    k = ordered.shape[1]
    return ordered[:, k // 2] if k % 2 else (ordered[:, k // 2 - 1] + ordered[:, k // 2]) / 2


class RobustFits(NamedTuple):
    """Per row: the Theil-Sen line and the robust spread of its residuals (:func:`robust_fits`)."""

    slopes: torch.Tensor
    intercepts: torch.Tensor
    spreads: torch.Tensor


def robust_fits(trails: torch.Tensor) -> RobustFits:
    """Per row of ``trails`` [m, n] (float64) against 0, 1, ..., n - 1: the Theil-Sen slope (the median of the pairwise
    slopes) and intercept (the median of value - slope k), robust to outlying points, and the robust spread of the
    residuals (1.4826 MAD). All rows at once: one fit per tensor per step would cost ~0.4 ms each in Python at 64
    points."""
    n = trails.shape[1]
    i, j = torch.triu_indices(n, n, 1)
    slopes = _median_rows((trails[:, j] - trails[:, i]) / (j - i).double())
    k = torch.arange(n, dtype=torch.float64)
    intercepts = _median_rows(trails - slopes[:, None] * k)
    spreads = 1.4826 * _median_rows((trails - (intercepts[:, None] + slopes[:, None] * k)).abs())
    return RobustFits(slopes, intercepts, spreads)


def extrapolate(slope: float, intercept: float, spread: float, n: int, h_clip: float, sigmas: float = 0.0,
                significance: float = 0.0) -> float:
    """Steps until a fitted headroom line (over ``n`` steps) comes within ``sigmas`` spreads of ``h_clip``, counted from
    its last step: inf where it does not fall, or falls by less than ``significance`` standard errors of a slope
    (spread sqrt(12 / (n (n^2 - 1)))): a slope the scatter alone makes; 0 where it is there already."""
    standard_error = spread * math.sqrt(12.0 / (n * (n * n - 1)))  # of a fitted slope over n equally spaced steps
    if slope >= 0 or -slope < significance * standard_error:
        return math.inf
    line = h_clip + sigmas * spread  # one noisy step below the line clips
    now = intercept + slope * (n - 1)
    return 0.0 if now < line else (now - line) / -slope


def steps_to_clip(values: list[float], h_clip: float, sigmas: float = 0.0,
                  significance: float = 0.0) -> tuple[float, float]:
    """(:func:`extrapolate` of the robust fit of ``values``, the slope per step)."""
    slope, intercept, spread = (float(v) for v in robust_fits(torch.tensor([values], dtype=torch.float64)))
    return extrapolate(slope, intercept, spread, len(values), h_clip, sigmas, significance), slope


class SaturationForecast:
    """The forecast of a run's tensors (docs/diagnostics/saturation.md). ``window``: the scalers' history length (the unit of
    the reported slope and the default ``horizon``)."""

    def __init__(self, window: int, horizon: int | None = None, points: int | None = None,
                 min_points: int | None = None, sigmas: float = NOISE_SIGMAS,
                 significance: float = SIGNIFICANCE) -> None:
        horizon = window if horizon is None else horizon
        # extrapolating h steps ahead needs a fit over as many: the slope's noise falls as points^-1.5
        points = max(DEFAULT_POINTS, horizon) if points is None else points
        # a trend over less than one window after quantization starts is the warmup's transient, not a drift
        min_points = min(max(MIN_POINTS, int(window)), points) if min_points is None else min_points
        if not (isinstance(horizon, int) and horizon > 0):
            raise FieldError("forecast_horizon", f"must be a positive number of steps, got {horizon!r}")
        if not (isinstance(points, int) and points >= min_points >= 3):
            raise FieldError("forecast_points", f"must be an integer >= {max(3, min_points)}, got {points!r}")
        self.window, self.horizon, self.points, self.min_points = int(window), horizon, points, min_points
        self.sigmas, self.significance = sigmas, significance
        self.trails: dict[str, deque] = {}
        self.open: dict[str, dict] = {}  # tensor -> its warning not yet cleared
        self.warnings: list[dict] = []  # every warning, in order, with what became of it
        self.clips: list[dict] = []  # every tensor-step that clipped: {"tensor", "step", "warned_at"}
        self.last_step = -1

    def state_dict(self) -> dict:
        return {"trails": {name: list(trail) for name, trail in self.trails.items()}, "open": dict(self.open),
                "last_step": self.last_step,
                "warnings": [dict(w) for w in self.warnings], "clips": [dict(c) for c in self.clips]}

    def load_state_dict(self, state: dict) -> None:
        self.trails = {name: deque(values, maxlen=self.points) for name, values in state.get("trails", {}).items()}
        self.warnings = [dict(w) for w in state.get("warnings", [])]
        self.clips = [dict(c) for c in state.get("clips", [])]
        self.last_step = int(state.get("last_step", -1))
        # the open warnings are the same objects as their entries of the list (a warning is scored where it is)
        self.open = {name: next((w for w in self.warnings if w["tensor"] == name and w["step"] == o["step"]), o)
                     for name, o in state.get("open", {}).items()}

    def update(self, step: int, tensors: list[tuple[str, float, bool, float]]) -> tuple[dict[str, dict], list[dict]]:
        """One optimizer step: ``tensors`` = (name, its headroom this step (inf: not quantized), whether it clipped,
        its h_clip). -> (tensor -> its forecast {"steps_to_clip", "slope_per_window", "headroom"}, the new warnings)."""
        forecasts, new = {}, []
        self.last_step = step
        fitted = []  # (name, headroom, clipped, h_clip) of the tensors with enough quantized steps to fit
        for name, headroom, clipped, h_clip in tensors:
            if clipped:
                warned = self.open.get(name)
                self.clips.append({"tensor": name, "step": step, "warned_at": warned["step"] if warned else None})
                if warned is not None and warned.get("clipped_at") is None:
                    warned["clipped_at"] = step
            if not math.isfinite(headroom):
                continue
            trail = self.trails.setdefault(name, deque(maxlen=self.points))
            trail.append(float(headroom))
            if len(trail) >= self.min_points:
                fitted.append((name, headroom, clipped, h_clip))
        fits = self._fits([name for name, *_ in fitted])
        for name, headroom, clipped, h_clip in fitted:  # in the order given: the warnings' order
            slope, intercept, spread, n = fits[name]
            steps = extrapolate(slope, intercept, spread, n, h_clip, self.sigmas, self.significance)
            forecasts[name] = {"steps_to_clip": steps, "slope_per_window": slope * self.window, "headroom": headroom}
            if steps <= self.horizon and not clipped and name not in self.open:
                warning = {"tensor": name, "step": step, "steps_to_clip": steps, "headroom": headroom,
                           "slope_per_window": slope * self.window, "clipped_at": None}
                self.open[name] = warning
                self.warnings.append(warning)
                new.append(warning)
            elif steps > self.horizon and name in self.open and self.open[name].get("clipped_at") is None \
                    and step - self.open[name]["step"] > self.horizon:
                del self.open[name]  # cleared: a later drift warns again
        return forecasts, new

    def _fits(self, names: list[str]) -> dict[str, tuple[float, float, float, int]]:
        """name -> (slope, intercept, spread, points) of the robust fit of its trail, the trails of one length at once."""
        by_length: dict[int, list[str]] = {}
        for name in names:
            by_length.setdefault(len(self.trails[name]), []).append(name)
        fits = {}
        for n, group in by_length.items():
            rows = torch.tensor([list(self.trails[name]) for name in group], dtype=torch.float64)
            fits.update({name: (*fit, n) for name, fit in zip(group, zip(*(v.tolist() for v in robust_fits(rows))))})
        return fits

    def scored(self) -> dict:
        """Hits (the tensor clipped while its warning was open; lead time: the steps between them), false alarms (the
        warning cleared, or the run ended, without a clip), misses (a tensor's first clip with no warning open),
        with the warnings themselves."""
        hits = [{**w, "lead_steps": w["clipped_at"] - w["step"]} for w in self.warnings if w.get("clipped_at") is not None]
        # a warning whose horizon had not run out when the run ended is neither: nobody saw what came next
        open_at_end = [dict(w) for w in self.warnings if w.get("clipped_at") is None and self.open.get(w["tensor"]) is w
                       and w["step"] + self.horizon > self.last_step]
        false_alarms = [dict(w) for w in self.warnings if w.get("clipped_at") is None and not any(
            o["tensor"] == w["tensor"] and o["step"] == w["step"] for o in open_at_end)]
        first_clips: dict[str, dict] = {}
        for clip in self.clips:
            first_clips.setdefault(clip["tensor"], clip)
        misses = [{"tensor": c["tensor"], "step": c["step"]} for c in first_clips.values() if c["warned_at"] is None]
        return {"horizon": self.horizon, "window": self.window, "warnings": len(self.warnings), "hits": len(hits),
                "false_alarms": len(false_alarms), "open_at_end": len(open_at_end), "misses": len(misses),
                "tensors_clipped": len(first_clips), "lead_steps": [h["lead_steps"] for h in hits], "hit_list": hits,
                "false_alarm_list": false_alarms, "open_at_end_list": open_at_end, "miss_list": misses}


def summary_lines(scored: dict | None) -> list[str]:
    """The run summary's line for :meth:`SaturationForecast.scored` (none without one)."""
    if not scored:
        return []
    leads = sorted(scored["lead_steps"])
    lead = f", lead {leads[len(leads) // 2]} steps (median)" if leads else ""
    pending = f", {scored['open_at_end']} open at the end" if scored.get("open_at_end") else ""
    return [f"forecast      {scored['warnings']} warning(s) within {scored['horizon']} steps: {scored['hits']} hit(s)"
            f"{lead}, {scored['false_alarms']} false alarm(s){pending}; {scored['misses']} of "
            f"{scored['tensors_clipped']} clipped tensors not forecast"]
