"""The paper's results table and figures from your own runs' logs (nothing is re-run): ``python main.py report``.

Per benchmark metric it compares the initial model, the baseline and each QAT run (forgetting, quantization,
total) over the examples both evaluated, with paired 95 % intervals and a verdict; then the continuous measures,
the what-if and numeric-health tables. It writes results.md, results.csv, results.json and the figures to
``--out``. Contract: a QAT run whose config differs from the baseline's in what changes the numbers (quantization
aside), or whose last train step differs, is refused with :class:`ReportError` (``--force``: a warning, also in
results.md); runs that evaluated a task on disjoint examples are refused. :func:`build_report` builds it,
:func:`main` is the command line.

See ``docs/reports.md`` for the comparisons, the checks and the figures.
"""

from .runs import (CONFIG_FILE, METRICS_FILE, PRECISION_NAMES, SAMPLES_DIR, SUMMARY_FILE, ReportError, Run,
                   default_label, find_metrics_files, flatten, load_run, precision_name, quantized, read_config,
                   read_metrics, read_samples, read_summary, warmup_switch_step)
from .compare import (ALLOWED_CONFIG_DIFFERENCES, BENCHMARK_RE, COMPARED_CONFIG, COMPARISONS, REAL_METRICS, Evaluation, arc_check,
                      benchmark_keys, check_pair, compare_metric, config_differences, evaluate_run, example_values,
                      is_main_metric, loss_ape, relative_drop, saturation_stats)
from .measures_table import compare_measures, measure_tasks, render_measures
from .tables import CSV_COLUMNS, render_markdown, write_csv
from .figures import FIGURES, a_hat_points, clipped_steps, plot_amax, plot_heatmap, plot_loss_curves, select_tensors
from .health import health_stats, whatif_stats
from .health_figures import HEALTH_FIGURES, plot_sqnr_heatmap, plot_tiers, plot_whatif
from .build import build_report
from .cli import main

__all__ = [
    "ALLOWED_CONFIG_DIFFERENCES", "BENCHMARK_RE", "COMPARED_CONFIG", "COMPARISONS", "CONFIG_FILE", "CSV_COLUMNS", "Evaluation",
    "FIGURES", "HEALTH_FIGURES", "METRICS_FILE", "PRECISION_NAMES", "REAL_METRICS", "ReportError", "Run", "SAMPLES_DIR",
    "SUMMARY_FILE", "a_hat_points", "arc_check", "benchmark_keys", "build_report", "check_pair", "clipped_steps",
    "compare_measures", "compare_metric", "config_differences", "default_label", "evaluate_run", "example_values",
    "find_metrics_files", "flatten", "health_stats", "is_main_metric", "load_run", "loss_ape", "main", "measure_tasks", "plot_amax",
    "plot_heatmap", "plot_loss_curves", "precision_name", "quantized", "read_config", "read_metrics",
    "read_samples", "read_summary", "relative_drop", "render_markdown", "render_measures", "saturation_stats", "select_tensors",
    "plot_sqnr_heatmap", "plot_tiers", "plot_whatif", "warmup_switch_step", "whatif_stats", "write_csv",
]
