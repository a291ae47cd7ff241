"""SpikeAlarm: loss spikes, gradient-norm spikes and non-finite steps, as events with their step.

Once per optimizer step it takes the step's record the core read (:class:`~qat_app.hif8.step_record.StepRecord`,
published by :class:`qat_app.module.QATModule` as ``step_record``): the loss (averaged over the micro-batches and
the ranks, so every rank decides alike), the gradient norm and whether the step was skipped (non-finite). The
loss and the gradient norm are scored against their last ``window`` finite values by a robust z, (value - median) / (1.4826 MAD) (:func:`robust_z`); an upward jump past ``z_threshold`` and every
skipped step are events: a log line, ``alarm/*`` at the step they describe, ``alarms.json`` at the end of fit.
Contract: the state is checkpointed, so a resumed run raises exactly the events of an uninterrupted one.
``action="stop"`` also saves a checkpoint, stops the fit and prints the resume command.

See ``docs/diagnostics/alarms.md`` for the metrics and the settings.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import deque
from typing import Literal, NamedTuple, Optional

import lightning as L

from qat_app.errors import ConfigError, did_you_mean

from .per_step import PerOptimizerStep
from qat_app.hif8.step_record import StepRecord

from .saturation import MAX_CLIPPED_FRAC, MIN_HEADROOM, saturation_metrics, step_record_of
from .stopping import stop_with_checkpoint

log = logging.getLogger(__name__)

LOSS_Z, GRAD_NORM_Z = "alarm/loss_z", "alarm/grad_norm_z"
EVENTS, NONFINITE = "alarm/events", "alarm/nonfinite"
ACTIONS = ("warn", "stop")
LOSS_SPIKE, GRAD_NORM_SPIKE, NONFINITE_STEP = "loss spike", "grad-norm spike", "non-finite"
MAD_TO_SIGMA = 1.4826  # 1 / Phi^-1(3/4): MAD x this estimates the standard deviation of normal noise
RELATIVE_FLOOR = 1e-3  # the spread is at least this fraction of |median| (a flat window has MAD 0)
EVENTS_FILE = "alarms.json"
STOP_FILE = "alarm-stop-step={step}.ckpt"
CAUSES = {
    LOSS_SPIKE: "usual causes: a learning rate too high for this stage (model.lr, model.lr_warmup_steps), a bad "
                "or repeated batch, or an activation outlier that a scale clipped (see sat/clipped_frac and "
                "sat/min_headroom at this step)",
    GRAD_NORM_SPIKE: "usual causes: an activation outlier (SwiGLU) or a saturating scale in the backward pass, or "
                     "too high a learning rate; trainer.gradient_clip_val bounds the update",
    NONFINITE_STEP: "the step was skipped (weights and optimizer moments unchanged); usual causes: an overflow in a "
                    "high-precision op or a diverging update; model.max_consecutive_nonfinite stops the run after "
                    "that many in a row",
}


class RobustZ(NamedTuple):
    """A value scored against a window (:func:`robust_z`)."""

    z: float
    median: float
    spread: float  # max(1.4826 MAD, 0.1 % of |median|)


def robust_z(value: float, history) -> RobustZ:
    """``value``'s robust z against ``history``: (value - median) / max(1.4826 MAD, 0.1 % of |median|)."""
    median = statistics.median(history)
    mad = statistics.median(abs(v - median) for v in history)
    spread = max(MAD_TO_SIGMA * mad, RELATIVE_FLOOR * abs(median))
    if spread == 0.0:  # a window of zeros
        return RobustZ(0.0 if value == median else math.copysign(math.inf, value - median), median, spread)
    return RobustZ((value - median) / spread, median, spread)


class Scored(NamedTuple):
    """One new value of a series (:meth:`SpikeDetector.observe`): z and median None while the window is short."""

    z: float | None
    median: float | None
    history: int  # the values it was scored against


class SpikeDetector:
    """One series: the last ``window`` finite values; each new value is scored against them, then kept."""

    def __init__(self, window: int, min_history: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.min_history = min_history

    def observe(self, value: float) -> Scored:
        """``value`` scored against the window before it (z and median None while it holds < min_history values),
        then kept."""
        z = median = None
        history = len(self.values)
        if history >= self.min_history:
            z, median, _ = robust_z(value, self.values)
        self.values.append(value)
        return Scored(z, median, history)


def clipping_of(stats: StepRecord | None) -> dict | None:
    """The step's clipping beside an event (:func:`~callbacks.saturation.saturation_metrics`): the fraction of all
    quantized elements clipped, the worst tensor's fraction and the lowest headroom (None without quantized tensors
    or a saturation callback)."""
    if stats is None:
        return None
    metrics = saturation_metrics(stats)
    return {"clipped_frac": metrics["sat/clipped_frac"], "max_clipped_frac": metrics.get(MAX_CLIPPED_FRAC, 0.0),
            "min_headroom": metrics.get(MIN_HEADROOM)}  # None: no tensor quantized in the step


def _json_number(value):
    """Non-finite floats as text ("nan", "inf"): JSON has no NaN."""
    return value if value is None or math.isfinite(value) else str(value)


class SpikeAlarm(PerOptimizerStep):
    """Loss and gradient-norm spikes and non-finite steps, read once per optimizer step.

    Args:
        enabled: watch the loss, the gradient norm and the non-finite steps.
        window: the recent optimizer steps (finite values) each new value is scored against (>= 3).
        z_threshold: alarm when (value - median) / (1.4826 MAD) exceeds this (> 0).
        min_history: the values the window must hold before it can alarm (3 .. window): the first steps
            (LR warmup, the first descent) only fill it. The MAD of a handful of values is a noisy scale (of 3,
            it is the smaller of two gaps), so below about 10 expect false alarms.
        action: ``warn`` (one log line per event) or ``stop`` (also save a checkpoint, stop, print the resume
            command).
        events_file: the JSON list of events written into the logger directory at the end of fit (null: none).
    """

    def __init__(self, enabled: bool = True, window: int = 64, z_threshold: float = 6.0, min_history: int = 16,
                 action: Literal["warn", "stop"] = "warn", events_file: Optional[str] = EVENTS_FILE) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ConfigError(f"alarms.window: must be an integer >= 3 (steps), got {window!r}")
        if isinstance(z_threshold, bool) or not isinstance(z_threshold, (int, float)) \
                or not (math.isfinite(z_threshold) and z_threshold > 0):
            raise ConfigError(f"alarms.z_threshold: must be a number > 0, got {z_threshold!r}")
        if isinstance(min_history, bool) or not isinstance(min_history, int) or not 3 <= min_history <= window:
            raise ConfigError(f"alarms.min_history: must be an integer from 3 to alarms.window ({window}), "
                              f"got {min_history!r}")
        if action not in ACTIONS:
            raise ConfigError(f"alarms.action: unknown action {action!r}{did_you_mean(action, ACTIONS)}; "
                              f"allowed: {', '.join(ACTIONS)}")
        self.enabled, self.window, self.z_threshold, self.min_history = enabled, window, float(z_threshold), min_history
        self.action, self.events_file = action, events_file
        self.loss = SpikeDetector(window, min_history)
        self.grad_norm = SpikeDetector(window, min_history)
        self.events: list[dict] = []
        self.last_z: dict[str, float] = {}  # the last step's z per metric (once its window is long enough)
        self.nonfinite = 0  # skipped steps seen
        self.events_path: str | None = None
        self.stop_checkpoint: str | None = None

    # ----------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        return {"loss_window": list(self.loss.values), "grad_norm_window": list(self.grad_norm.values),
                "events": [dict(e) for e in self.events], "nonfinite": self.nonfinite}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loss.values.extend(state_dict.get("loss_window", []))  # deque(maxlen=window): the newest kept
        self.grad_norm.values.extend(state_dict.get("grad_norm_window", []))
        self.events = [dict(e) for e in state_dict.get("events", [])]
        self.nonfinite = int(state_dict.get("nonfinite", 0))

    # ------------------------------------------------------------------------------------- the decision
    def observe(self, step: int, loss: float | None, grad_norm: float | None, nonfinite: bool) -> list[dict]:
        """Score one optimizer step; returns its new events (also appended to :attr:`events`). A non-finite
        (skipped) step is one event and enters neither window."""
        new = []
        self.last_z = {}
        if nonfinite:
            self.nonfinite += 1
            value = loss if loss is None or not math.isfinite(loss) else grad_norm
            new.append({"step": step, "kind": NONFINITE_STEP, "value": value, "median": None, "z": None,
                        "loss": loss, "grad_norm": grad_norm})
        else:
            for kind, metric, detector, value in ((LOSS_SPIKE, LOSS_Z, self.loss, loss),
                                                  (GRAD_NORM_SPIKE, GRAD_NORM_Z, self.grad_norm, grad_norm)):
                if value is None:
                    continue
                z, median, history = detector.observe(value)
                if z is None:
                    continue
                self.last_z[metric] = z
                if z > self.z_threshold:
                    new.append({"step": step, "kind": kind, "value": value, "median": median, "z": z,
                                "history": history})
        self.events.extend(new)
        return new

    def describe(self, event: dict) -> str:
        """The one log line of an event."""
        if event["kind"] == NONFINITE_STEP:
            what = f"train/loss {event['loss']}, train/grad_norm {event['grad_norm']}"
        else:
            name = "train/loss" if event["kind"] == LOSS_SPIKE else "train/grad_norm"
            what = (f"{name} {event['value']:.6g} vs median {event['median']:.6g} of the last "
                    f"{event['history']} steps, robust z {event['z']:.1f} > {self.z_threshold:g}")
        clipping = event.get("clipping")
        if clipping is not None:
            headroom = clipping["min_headroom"]
            what += (f"; the step clipped {clipping['clipped_frac']:.3g} of its quantized elements (worst tensor "
                     f"{clipping['max_clipped_frac']:.3g}" +
                     (f", lowest headroom a_hat/amax {headroom:.3g})" if headroom is not None else ")"))
        return f"alarm: {event['kind']} at step {event['step']}: {what}; {CAUSES[event['kind']]}"

    # ------------------------------------------------------------------------------------------ the loop
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.enabled:
            return
        step = self.completed_step(trainer)
        if step is None:  # the optimizer step is not done yet
            return
        record = getattr(pl_module, "step_record", None)
        if record is None or record.step != step:  # a module that publishes no record of its steps
            return
        new = self.observe(step, record.loss, record.grad_norm, record.skipped)
        if new:  # the same on every rank (the loss is averaged over them)
            clipping = clipping_of(step_record_of(pl_module, step))
            for event in new:
                event["clipping"] = clipping
        metrics = {**self.last_z, EVENTS: float(len(self.events)), NONFINITE: float(self.nonfinite)}
        self.log_at(trainer, metrics, step)  # at the step the values describe, as train/loss
        if trainer.is_global_zero:  # every rank holds the same events; one line each
            for event in new:
                log.warning(self.describe(event))
        if new and self.action == "stop":
            self._stop(trainer)

    def _stop(self, trainer) -> None:
        log_dir = trainer.log_dir  # a broadcast: every rank
        step = trainer.global_step
        self.stop_checkpoint, command = stop_with_checkpoint(trainer, log_dir, STOP_FILE.format(step=step))
        if trainer.is_global_zero:
            message = (f"alarm: stopping at step {step} (alarms.action=stop); checkpoint {self.stop_checkpoint}. "
                       f"Resume with: {command} (with a lower --model.lr, or --alarms.action warn to go on as before)")
            log.warning(message)
            print(message, flush=True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not self.events_file:
            return
        directory = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): on every rank
        if not trainer.is_global_zero:
            return
        counts = {kind: sum(e["kind"] == kind for e in self.events) for kind in CAUSES}
        document = {
            "global_step": trainer.global_step,
            "settings": {"window": self.window, "z_threshold": self.z_threshold, "min_history": self.min_history,
                         "action": self.action},
            "definition": "z = (value - median) / max(1.4826 MAD, 0.1% of |median|) over the last `history` (at "
                          "most `window`) finite values before the step; a spike is z > z_threshold; a non-finite "
                          "step was skipped",
            "counts": counts,
            "causes": CAUSES,
            "events": [{k: _json_number(v) if isinstance(v, float) else v for k, v in e.items()} for e in self.events],
        }
        os.makedirs(directory, exist_ok=True)
        self.events_path = os.path.join(directory, self.events_file)
        with open(self.events_path, "w") as f:
            json.dump(document, f, indent=1)
        if self.events:
            log.info("alarms: %d events (%s); list in %s", len(self.events),
                     ", ".join(f"{n} {kind}" for kind, n in counts.items() if n), self.events_path)
