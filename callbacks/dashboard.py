"""TensorBoardDashboard: one custom-scalars page that puts the low-bit training signals side by side.

Loss alone shows a failure late; throughput alone overstates the gain. The page (TensorBoard's "Custom
Scalars" tab) groups, per category, the charts a low-bit run is read by: saturation (clipped fractions,
headroom, a_hat against the true amax, tensors fallen back), numeric health (SQNR, underflow, precision tiers), the what-if
estimators, training (loss, gradient norm, learning rate, alarms, skipped steps, throughput), forgetting
and the memory breakdown (:mod:`callbacks.memory`). Every chart names its tags by regular expression
(TensorBoard matches them from the start of the tag), so the layout holds whatever tensors, layers and
tasks a run logs, and a chart with no matching tag stays empty.

At fit start it is written once to every ``TensorBoardLogger`` (``logger.experiment.add_custom_scalars``,
rank 0); without one it does nothing (the CSV logger has no layouts). A resumed fit logs into a new
version directory and gets the layout again.
"""

from __future__ import annotations

import logging
import re

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from .alarms import EVENTS, GRAD_NORM_Z, LOSS_Z, NONFINITE
from .fallback import FALLBACK_METRIC
from .memory import ACTIVATIONS_PEAK_MB, GRADS_MB, OPTIMIZER_MB, PARAMS_MB, PEAK_MB, RSS_MB

log = logging.getLogger(__name__)


def _multiline(*patterns: str) -> list:
    return ["Multiline", list(patterns)]


def _exact(tag: str) -> str:
    """A tag as a regex matching only itself."""
    return re.escape(tag) + "$"


# {category: {chart title: ["Multiline", [tag regexes]]}} (SummaryWriter.add_custom_scalars)
LAYOUT = {
    "saturation": {
        "clipped fraction (all tensors; per layer.tensor)": _multiline(r"sat/.*clipped_frac"),
        "min headroom a_hat / amax (clipping needs < 1)": _multiline(r"sat/min_headroom"),
        "saturation events": _multiline(r"sat/events", r"sat/clipped$"),
        "tensors fallen back (automatic fallback)": _multiline(_exact(FALLBACK_METRIC)),
        "a_hat, the estimate a tensor was scaled by": _multiline(r"a_hat/.*"),
        "amax, the tensor's true max": _multiline(r"amax/.*"),
    },
    "saturation forecast": {
        "tensors at risk, nearest forecast clip (steps)": _multiline(_exact("forecast/at_risk"),
                                                                      _exact("forecast/min_steps_to_clip")),
        "steps to the first clip at this rate (per tensor)": _multiline(r"forecast/.*/steps_to_clip"),
        "headroom trend per window (per tensor)": _multiline(r"forecast/.*/slope_per_window"),
    },
    "numeric health": {
        "SQNR (dB)": _multiline(r"health/.*sqnr_db"),
        "underflow fraction": _multiline(r"health/.*underflow_frac"),
        "precision tiers": _multiline(r"health/.*tier/.*"),
    },
    "what-if headroom (max_val)": {
        "suggested max_val": _multiline(r"headroom/.*/best_max_val"),
        "estimated SQNR gain over the run's max_val (dB)": _multiline(r"headroom/.*/gain_db"),
        "mean estimated SQNR at each max_val (dB)": _multiline(r"headroom/.*/sqnr_db/.*"),
    },
    "what-if estimators": {
        "clipped under each estimator": _multiline(r"whatif/.*/clipped"),
        "saturation events under each estimator": _multiline(r"whatif/.*/events"),
    },
    "training": {
        "loss": _multiline(_exact("train/loss"), _exact("val/loss")),
        "gradient norm": _multiline(_exact("train/grad_norm")),
        "learning rate": _multiline(_exact("train/lr"), r"lr-.*"),
        "spike alarms (robust z)": _multiline(_exact(LOSS_Z), _exact(GRAD_NORM_Z)),
        "alarm events, non-finite steps": _multiline(_exact(EVENTS), _exact(NONFINITE), _exact("train/skipped_steps")),
        "throughput": _multiline(r"train/.*per_sec", r"train/.*mfu"),
    },
    "forgetting": {
        "benchmark differences to the initial model": _multiline(r"forget/(?!kl).*"),
        "KL to the initial model (held-out text)": _multiline(r"forget/kl(_low|_high)?$"),
        "its parts: drift (training) and quantization (HiF8), the noise floor": _multiline(
            r"forget/kl_(drift|quantization).*", r"noise_floor/kl.*"),
    },
    "memory": {
        "breakdown (MiB)": _multiline(*(_exact(t) for t in (PARAMS_MB, GRADS_MB, OPTIMIZER_MB, ACTIVATIONS_PEAK_MB))),
        "peak (CUDA) or resident set (CPU), MiB": _multiline(_exact(PEAK_MB), _exact(RSS_MB)),
    },
}


class TensorBoardDashboard(L.Callback):
    """The TensorBoard custom-scalars layout of the run's charts.

    Args:
        enabled: write the custom-scalars layout to every TensorBoard logger at fit start.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.written_to: list[str] = []  # the log directories that got the layout (tests)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero:  # the experiment is rank 0's
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment
                writer.add_custom_scalars(LAYOUT)  # once per writer (torch's rule); a resumed fit has a new one
                writer.flush()
                self.written_to.append(logger.log_dir)
                log.debug("dashboard: custom-scalars layout written to %s", logger.log_dir)
