"""The paper's results table and figures from your own runs' logs (nothing is re-run).

    python main.py report --baseline runs/bf16_baseline --qat runs/exp8 [runs/exp7 ...] [--initial DIR] \\
        [--labels BASE exp8 exp7] [--out reports/exp8] [--layers layers.10.mlp.down_proj ...] [--force]
    python -m qat_app.report ...            (the same)

A run DIR holds a Lightning ``CSVLogger`` output: a version directory (``runs/x/logs/version_0``),
the logger directory or the run root. All ``metrics.csv`` of one run (a resumed fit, a separate
``main.py test``) are merged, later versions winning on a step logged twice; ``saturation_summary.json``,
``config.yaml`` and ``quantized_modules.json`` (what the fit quantized: its count and high-precision blocks are
shown per QAT run; older runs have none) come from the latest version that has one, per-example records
(``benchmark_samples/<val|test>_step<NNNNNNN>.jsonl``) from every version (later wins).

Three models per benchmark metric (``<split>/<task>/acc|acc_norm``, MMLU subjects and categories;
``count`` is not a metric): the *initial* model (the baseline's step-0 validation, or ``--initial
DIR``'s last records, e.g. a ``main.py validate`` run), the *baseline* and each *QAT* run at their
last evaluation; compared as forgetting (initial -> baseline), quantization (baseline -> QAT) and
total (initial -> QAT). Each difference (after - before, over the examples both evaluated, matched by
(task, subject, doc_id)) gets a paired bootstrap 95% interval (:mod:`qat_app.stats`), McNemar's
exact p and a verdict (``worse`` / ``within noise`` / ``better``: the interval below, around or above 0).
Relative drop % = (before - after) / before * 100. Training-loss APE = mean over common logged steps of
|loss_qat - loss_base| / loss_base * 100.

Next to them, per task, the continuous measures of :mod:`qat_app.eval.measures` (p_gold, p_gold_norm,
gold_loglik_per_byte, brier, the choice-distribution KL and the answer flips both ways) in the same three
comparisons: paired mean difference, normal 95% interval with a standard error clustered by the task's records
(MMLU subject, HellaSwag source_id, ARC none; CR1), z, verdict (:mod:`.measures_table`). Runs that evaluated a task
on disjoint examples are refused.

Before comparing, each QAT run's config.yaml is checked against the baseline's: only quantization
(``model.quant.*``, ``warmup.*``, ``saturation.*``) and bookkeeping paths may differ, and the last
logged train step must match; otherwise :class:`ReportError` (``--force``: a warning, also in results.md).

Written to ``--out``: results.md, results.csv (one row per run, metric, comparison), results.json
(everything), loss_curves.png, amax_vs_ahat.png, saturation_heatmap.png (the warmup -> quantization switch is
drawn on every step axis), and from what the saturation callback logged (:mod:`.health`, :mod:`.health_figures`):
whatif_clipped.png (cumulative clipped elements each amax estimator would have clipped, to first order),
sqnr_heatmap.png (SQNR per tensor and logged step), precision_tiers.png (tier fractions per tensor kind); their
tables (what-if totals per estimator next to the real counter; the run's min SQNR, underflow and outlier factor, the
worst tensors by SQNR) close results.md. Runs made before these were logged say "not recorded".

Modules: :mod:`.runs` (reading a run: metrics, summary, config, records), :mod:`.compare` (evaluations,
comparisons, checks, arithmetic), :mod:`.measures_table` (the continuous measures' comparisons and table),
:mod:`.tables` (markdown / csv / json), :mod:`.figures`, :mod:`.health` (what-if and health: reading, tables),
:mod:`.health_figures`, :mod:`.build`
(:func:`build_report`), :mod:`.cli` (:func:`main`).
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
