"""TensorBoardDashboard: one custom-scalars page of the low-bit training signals, read at a glance, and a picture
per logging step.

The page (TensorBoard's "Custom Scalars" tab) shows per category the model-wide series a person compares: the
median and the worst tensor, per operand, the precision tiers' shares; every per-tensor series is in the last
category, "per tensor", one click away. Charts of features a run has off (fallback, health, headroom, the
forecast, benchmarks, the noise floor, alarms, memory) are left out of its layout. On every logging step the
Images tab gets block x operand heatmaps of the SQNR and the clipped fraction (:mod:`.dashboard_images`). How to
read it: docs/dashboard.md.
"""

from __future__ import annotations

import logging
import re

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from qat_app.distill.config import DISTILL_CE, DISTILL_KL
from qat_app.eval.records import FORGET_GENERATION_KL
from qat_app.hif8.recipe import DEFAULT_BLOCK_PATTERN

from .alarms import EVENTS, GRAD_NORM_Z, LOSS_Z, NONFINITE, SpikeAlarm
from .dashboard_images import HEATMAPS, block_grid, heatmap
from .fallback import FALLBACK_METRIC, FallbackCallback
from .forgetting import ForgettingMonitor, benchmark_tasks
from .health_log import MAX_UNDERFLOW, MEDIAN_SQNR, MIN_SQNR, OPERAND_MEDIAN_SQNR, TIER_SHARE, UNDERFLOW
from .memory import ACTIVATIONS_PEAK_MB, GRADS_MB, OPTIMIZER_MB, PARAMS_MB, PEAK_MB, RSS_MB, MemoryMonitor
from .noise_floor import NoiseFloorCallback
from .per_step import callback_of
from .saturation import MAX_CLIPPED_FRAC, MEDIAN_HEADROOM, MIN_HEADROOM, AmaxSaturationCallback
from .throughput import TokenThroughputMonitor

log = logging.getLogger(__name__)

DISTILL_CHART = "distillation: KL(teacher ‖ student) and the CE, nats/token"


def _multiline(*patterns: str) -> list:
    return ["Multiline", list(patterns)]


def _margin(tag: str) -> list:
    """One series with its 95 % interval as a band (``tag``, ``tag_low``, ``tag_high``)."""
    return ["Margin", [tag, f"{tag}_low", f"{tag}_high"]]


def _exact(tag: str) -> str:
    """A tag as a regex matching only itself."""
    return re.escape(tag) + "$"


PER_TENSOR = "per tensor"
# {category: {chart title: ["Multiline", [tag regexes]]}} (SummaryWriter.add_custom_scalars); a per-tensor tag has a
# dot in its tensor name (layers.7.mlp.up_proj.input), a model-wide one none
TENSOR = r"[^/]*\.[^/]*"
LAYOUT = {
    "saturation": {
        "clipped fraction: all tensors, the worst tensor": _multiline(_exact("sat/clipped_frac"),
                                                                      _exact(MAX_CLIPPED_FRAC)),
        "headroom a_hat / amax: the lowest, the median (clipping needs < 1)": _multiline(_exact(MIN_HEADROOM),
                                                                                         _exact(MEDIAN_HEADROOM)),
        "saturation events, clipped elements": _multiline(_exact("sat/events"), _exact("sat/clipped")),
        "tensors fallen back (automatic fallback)": _multiline(_exact(FALLBACK_METRIC)),
    },
    "saturation forecast": {
        "tensors at risk, nearest forecast clip (steps)": _multiline(_exact("forecast/at_risk"),
                                                                      _exact("forecast/min_steps_to_clip")),
    },
    "numeric health": {
        "SQNR (dB): the worst tensor, the median": _multiline(_exact(MIN_SQNR), _exact(MEDIAN_SQNR)),
        "median SQNR per operand (dB)": _multiline(OPERAND_MEDIAN_SQNR.format("[a-z]+$")),
        "underflow fraction: all elements, the worst tensor": _multiline(_exact(UNDERFLOW), _exact(MAX_UNDERFLOW)),
        "precision tiers (share of all elements)": _multiline(TIER_SHARE.format(".*")),
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
        DISTILL_CHART: _multiline(_exact(DISTILL_KL), _exact(DISTILL_CE)),
        "gradient norm": _multiline(_exact("train/grad_norm")),
        "learning rate": _multiline(_exact("train/lr"), r"lr-.*"),
        "spike alarms (robust z)": _multiline(_exact(LOSS_Z), _exact(GRAD_NORM_Z)),
        "alarm events, non-finite steps": _multiline(_exact(EVENTS), _exact(NONFINITE), _exact("train/skipped_steps")),
        "throughput": _multiline(r"train/.*per_sec", r"train/.*mfu"),
    },
    "forgetting": {
        "KL to the initial model on held-out text (95 % interval)": _margin("forget/kl"),
        "its parts: drift (training), quantization (HiF8), the noise floor": _multiline(
            _exact("forget/kl_drift"), _exact("forget/kl_quantization"), _exact("noise_floor/kl")),
        "generation drift: KL to the initial model along its greedy continuations (95 % interval)":
            _margin(FORGET_GENERATION_KL),
        # and one chart per benchmark task and measure (:func:`layout_for`)
    },
    "memory": {
        "breakdown (MiB)": _multiline(*(_exact(t) for t in (PARAMS_MB, GRADS_MB, OPTIMIZER_MB, ACTIVATIONS_PEAK_MB))),
        "peak (CUDA) or resident set (CPU), MiB": _multiline(_exact(PEAK_MB), _exact(RSS_MB)),
    },
    PER_TENSOR: {
        "clipped fraction": _multiline(f"sat/{TENSOR}/clipped_frac"),
        "a_hat, the estimate a tensor was scaled by": _multiline(r"a_hat/.*"),
        "amax, the tensor's true max": _multiline(r"amax/.*"),
        "SQNR (dB)": _multiline(f"health/{TENSOR}/sqnr_db"),
        "underflow fraction": _multiline(f"health/{TENSOR}/underflow_frac"),
        "precision tiers": _multiline(f"health/{TENSOR}/tier/.*"),
    },
}


def _enabled(trainer, kind) -> bool:
    """Whether a callback of type ``kind`` is in the trainer, switched on."""
    return bool(getattr(callback_of(trainer, kind), "enabled", False))


def _shown(trainer) -> dict[tuple[str, str | None], bool]:
    """(category, chart or None for the whole category) -> whether the run logs anything it shows."""
    saturation = callback_of(trainer, AmaxSaturationCallback)
    health = saturation is not None and saturation.health
    per_layer = saturation is not None and saturation.per_layer
    forecast = saturation is not None and saturation.forecast_on
    benchmarks = bool(benchmark_tasks(trainer.datamodule)) if getattr(trainer, "datamodule", None) else False
    forgetting = getattr(callback_of(trainer, ForgettingMonitor), "enabled", False) is not False
    noise_floor = _enabled(trainer, NoiseFloorCallback)
    return {
        ("saturation", None): saturation is not None,
        ("saturation", "tensors fallen back (automatic fallback)"): _enabled(trainer, FallbackCallback),
        ("saturation forecast", None): forecast,
        ("numeric health", None): health,
        ("what-if headroom (max_val)", None): health and bool(saturation.headroom),
        ("what-if estimators", None): saturation is not None,
        ("training", "spike alarms (robust z)"): _enabled(trainer, SpikeAlarm),
        ("training", "alarm events, non-finite steps"): _enabled(trainer, SpikeAlarm),
        ("training", "throughput"): callback_of(trainer, TokenThroughputMonitor) is not None,
        ("training", DISTILL_CHART): getattr(getattr(trainer, "lightning_module", None), "teacher", None) is not None,
        ("forgetting", None): forgetting and (benchmarks or noise_floor),
        ("memory", None): _enabled(trainer, MemoryMonitor),
        (PER_TENSOR, None): per_layer,
        (PER_TENSOR, "SQNR (dB)"): health,
        (PER_TENSOR, "underflow fraction"): health,
        (PER_TENSOR, "precision tiers"): health,
    }


def layout_for(trainer) -> dict:
    """:data:`LAYOUT` without the charts (and categories) of features the run has off (the whole of it without a
    trainer's callbacks to judge by)."""
    if getattr(trainer, "callbacks", None) is None:
        return LAYOUT
    shown = _shown(trainer)
    layout = {}
    for category, charts in LAYOUT.items():
        if not shown.get((category, None), True):
            continue
        kept = {title: chart for title, chart in charts.items() if shown.get((category, title), True)}
        if category == "forgetting" and kept:
            kept.update(benchmark_charts(trainer))
        if kept:
            layout[category] = kept
    return layout


def benchmark_charts(trainer) -> dict:
    """One chart per benchmark task and monitored measure: its difference to the initial model with its interval."""
    monitor = callback_of(trainer, ForgettingMonitor)
    datamodule = getattr(trainer, "datamodule", None)
    if monitor is None or datamodule is None:
        return {}
    return {f"{task} {measure} - initial (95 % interval)": _margin(f"forget/{task}/{measure}")
            for task in benchmark_tasks(datamodule) for measure in monitor.measures}


class TensorBoardDashboard(L.Callback):
    """The TensorBoard custom-scalars layout of the run's charts, and the heatmaps of each logging step.

    Args:
        enabled: write the layout to every TensorBoard logger at fit start, and the heatmaps on logging steps.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.written_to: list[str] = []  # the log directories that got the layout (tests)
        self.layout: dict = {}  # the layout written
        self._drawn_step = -1  # the last step whose heatmaps were written

    def _writers(self, trainer):
        return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero:  # the experiment is rank 0's
            return
        self.layout = layout_for(trainer)
        for logger in self._writers(trainer):
            writer = logger.experiment
            writer.add_custom_scalars(self.layout)  # once per writer (torch's rule); a resumed fit has a new one
            writer.flush()
            self.written_to.append(logger.log_dir)
            log.debug("dashboard: custom-scalars layout written to %s", logger.log_dir)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.enabled or not trainer.is_global_zero:
            return
        saturation = callback_of(trainer, AmaxSaturationCallback)
        logged = getattr(saturation, "last_logged", None)  # the StepRecord of the last step logged in full
        if logged is None or logged.step <= self._drawn_step or not self._writers(trainer):
            return
        self._drawn_step = logged.step
        pattern = getattr(getattr(pl_module, "quant", None), "block_pattern", DEFAULT_BLOCK_PATTERN)
        for tag, figure, cmap, _ in HEATMAPS:
            blocks, columns, matrix = block_grid(getattr(logged, figure)(), pattern)
            if not blocks:
                continue
            title = f"{figure} per block and operand, step {logged.step}"
            for logger in self._writers(trainer):
                logger.experiment.add_figure(tag, heatmap(title, blocks, columns, matrix, cmap), logged.step)
