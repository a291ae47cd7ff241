""":func:`build_report`: load the runs, check them, compare them, write the tables and figures."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from .. import stats
from ..distill.config import DISTILL_CE, DISTILL_KL
from ..eval.records import scored_line
from .compare import (arc_check, benchmark_keys, check_pair, compare_metric, evaluate_run, is_main_metric, loss_ape,
                      saturation_stats)
from .evaluations import load_evaluation, render_evaluations
from .distortion import forget_kl_parts, kl_baseline_qat, noise_floor_of
from .figures import FIGURES, plot_amax, plot_heatmap, plot_loss_curves, select_tensors
from .health import health_stats, whatif_stats
from .health_figures import HEALTH_FIGURES, plot_sqnr_heatmap, plot_tiers, plot_whatif
from .measures_table import compare_measures, measure_tasks
from .runs import (ReportError, Run, default_label, inventory_stats, last_value, load_run, precision_name, quantized,
                   scored_examples, warmup_switch_step)
from .tables import json_safe, render_markdown, write_csv

log = logging.getLogger("qat_app.report")


def _default_qat_label(run: Run, path) -> str:
    if run.config is None:
        return default_label(path)
    fmt = str(run.setting("model.quant.format", "hif8")).upper().replace("HIF8", "HiF8")
    what = f"{fmt} W8A8, {precision_name(run)}" if quantized(run) else f"{precision_name(run)}, unquantized"
    return f"{default_label(path)} ({what})"


def _load_labelled_runs(baseline_dir, qat_dirs, labels: list[str] | None) -> tuple[Run, list[Run]]:
    """The baseline and the QAT runs, each with the label the tables print: the given one, else a derived one;
    ``labels`` may name the baseline first (one more label than QAT runs)."""
    labels = list(labels or [])
    if labels and len(labels) not in (len(qat_dirs), len(qat_dirs) + 1):
        raise ReportError(f"--labels: give {len(qat_dirs)} (QAT runs) or {len(qat_dirs) + 1} (baseline first) labels, got {len(labels)}")
    base_label = labels.pop(0) if len(labels) == len(qat_dirs) + 1 else None
    baseline = load_run(baseline_dir, base_label)
    if base_label is None:
        baseline.label = f"{precision_name(baseline)} baseline" if baseline.config else "baseline"
    qats = []
    for i, d in enumerate(qat_dirs):
        run = load_run(d, labels[i] if labels else None)
        run.label = labels[i] if labels else _default_qat_label(run, d)
        qats.append(run)
    _make_labels_unique(baseline, qats)
    return baseline, qats


def _make_labels_unique(baseline: Run, qats: list[Run]) -> None:
    """Suffix ``#2``, ``#3``, ... to a QAT label seen before (or equal to the baseline's): labels key the tables."""
    seen: dict[str, int] = {}
    for run in qats:
        if run.label in seen or run.label == baseline.label:
            seen[run.label] = seen.get(run.label, 1) + 1
            run.label = f"{run.label}#{seen[run.label]}"
        seen.setdefault(run.label, 1)


def _run_warnings(baseline: Run, qats: list[Run], force: bool) -> list[str]:
    """What makes a comparison doubtful: the pair checks (each message once) and runs without train-loss rows."""
    warnings = [w for run in qats for w in check_pair(baseline, run, force)]
    warnings = list(dict.fromkeys(warnings))
    for run in [baseline] + qats:
        if not run.train_loss():
            warnings.append(f"`{run.label}`: no train/loss rows in {', '.join(map(str, run.files))}")
        short = {task: c for task, c in scored_examples(run).items() if c[1] is not None and c[0] < c[1]}
        if short:
            warnings.append(f"`{run.label}`: its last validation did not score every selected benchmark example "
                            f"({scored_line(short)} scored / selected)")
    return warnings


def _initial_evaluation(initial_run: Run | None, initial_dir, baseline: Run, keys, warnings: list[str]):
    """The scores before fine-tuning: ``--initial``'s last evaluation, else the baseline's step-0 validation
    (None where it has none); a mismatched ``--initial`` model is appended to ``warnings``."""
    if initial_run is not None:
        initial = evaluate_run(initial_run, keys, None, f"--initial {initial_dir} (its last evaluation)")
        b_name, i_name = baseline.setting("model.model_name"), initial_run.setting("model.model_name")
        if b_name is not None and i_name is not None and b_name != i_name:
            warnings.append(f"--initial {initial_dir} evaluated model.model_name {i_name!r}, the baseline started from {b_name!r}")
        return initial
    initial = evaluate_run(baseline, keys, 0, f"the baseline's step-0 validation ({baseline.path})")
    return initial if initial.records or any(v is not None for v in initial.values.values()) else None


def _benchmark_rows(keys, forgetting: dict, initial, base_eval, q_eval, resamples: int, seed: int) -> list[dict]:
    """One row a benchmark key: the scores and the forgetting / quantization / total comparisons that exist."""
    rows = []
    for k in keys:
        comps = {"forgetting": forgetting.get(k), "quantization": compare_metric(k, base_eval, q_eval, resamples, seed),
                 "total": compare_metric(k, initial, q_eval, resamples, seed) if initial else None}
        comps = {name: c for name, c in comps.items() if c is not None}
        q = comps["quantization"]
        rows.append({"metric": k, "initial": comps["total"]["from"] if initial else None, "baseline": q["from"],
                     "qat": q["to"], "n": q["n"], "relative_drop_pct": q["relative_drop_pct"], "comparisons": comps})
    return rows


def _qat_result(run: Run, baseline: Run, rows: list[dict], ape_from_step: int, measures: dict) -> dict:
    """One QAT run's entry of results.json: its benchmark rows, loss agreement with the baseline and health."""
    main_drops = [r["relative_drop_pct"] for r in rows if is_main_metric(r["metric"]) and math.isfinite(r["relative_drop_pct"])]
    ape, n = loss_ape(baseline.train_loss(), run.train_loss(), ape_from_step)
    return {
        "label": run.label, "path": str(run.path), "precision": precision_name(run),
        "config": str(run.config_path) if run.config_path else None, "warmup_switch_step": warmup_switch_step(run),
        "benchmarks": rows, "mean_relative_drop_pct": sum(main_drops) / len(main_drops) if main_drops else math.nan,
        "train_loss_ape_pct": ape, "ape_common_steps": n, "final_train_loss": last_value(run.train_loss()),
        "final_val_loss": run.last("val/loss"), "saturation": saturation_stats(run), "arc_check": arc_check(rows),
        "scored": scored_examples(run),
        "quantized_modules": inventory_stats(run),
        "whatif": whatif_stats(run), "health": health_stats(run),
        "kl_baseline_qat": kl_baseline_qat(baseline, run), "noise_floor": noise_floor_of(run),
        "forget_kl": forget_kl_parts(run),
        "distill": {"kl": run.last(DISTILL_KL), "ce": run.last(DISTILL_CE)} if DISTILL_KL in run.columns else None,
        "measures": {name: m for name, m in measures.items() if m},
    }


def _write_figures(out: Path, baseline: Run, qats: list[Run], results: list[dict], tensors) -> dict:
    """Draw FIGURES and HEALTH_FIGURES into ``out``; returns what each plot returned, by file name."""
    figures = {FIGURES[0]: plot_loss_curves(out / FIGURES[0], baseline, qats, results),
               FIGURES[1]: plot_amax(out / FIGURES[1], qats, tensors),
               FIGURES[2]: plot_heatmap(out / FIGURES[2], qats)}
    whatifs, healths = [r["whatif"] for r in results], [r["health"] for r in results]
    figures.update({HEALTH_FIGURES[0]: plot_whatif(out / HEALTH_FIGURES[0], qats, whatifs),
                    HEALTH_FIGURES[1]: plot_sqnr_heatmap(out / HEALTH_FIGURES[1], qats, healths),
                    HEALTH_FIGURES[2]: plot_tiers(out / HEALTH_FIGURES[2], qats, healths)})
    return figures


def _baseline_entry(baseline: Run, base_eval, keys) -> dict:
    """The baseline's entry of results.json."""
    return {"label": baseline.label, "path": str(baseline.path), "precision": precision_name(baseline),
            "config": str(baseline.config_path) if baseline.config_path else None,
            "files": [str(f) for f in baseline.files], "final_train_loss": last_value(baseline.train_loss()),
            "final_val_loss": baseline.last("val/loss"), "benchmarks": {k: base_eval.values[k] for k in keys},
            "scored": scored_examples(baseline)}


def build_report(
    baseline_dir: str | os.PathLike,
    qat_dirs: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    labels: list[str] | None = None,
    layers: list[str] | None = None,
    benchmarks: str | None = None,
    ape_from_step: int = 0,
    initial_dir: str | os.PathLike | None = None,
    force: bool = False,
    resamples: int = stats.DEFAULT_RESAMPLES,
    seed: int = stats.DEFAULT_SEED,
    evaluations: list[str | os.PathLike] | None = None,
) -> dict:
    """Write results.md / results.csv / results.json and the figures (FIGURES, HEALTH_FIGURES); returns the numbers.
    ``evaluations``: output directories of ``main.py evaluate``, whose paired tables are added."""
    if not qat_dirs:
        raise ReportError("give at least one QAT run (--qat DIR)")
    evaluated = [load_evaluation(d) for d in evaluations or []]
    baseline, qats = _load_labelled_runs(baseline_dir, qat_dirs, labels)
    warnings = _run_warnings(baseline, qats, force)
    initial_run = load_run(initial_dir, "initial") if initial_dir is not None else None
    keys = benchmark_keys([baseline] + qats + ([initial_run] if initial_run else []), benchmarks)
    initial = _initial_evaluation(initial_run, initial_dir, baseline, keys, warnings)
    for message in warnings:
        log.warning("%s", message)
    base_eval = evaluate_run(baseline, keys, None, "baseline")
    forgetting = {k: compare_metric(k, initial, base_eval, resamples, seed) for k in keys} if initial else {}
    tasks = measure_tasks(keys)
    forgetting_measures = compare_measures(initial, base_eval, tasks)

    results = []
    for run in qats:
        q_eval = evaluate_run(run, keys, None, run.label)
        rows = _benchmark_rows(keys, forgetting, initial, base_eval, q_eval, resamples, seed)
        measures = {"forgetting": forgetting_measures, "quantization": compare_measures(base_eval, q_eval, tasks),
                    "total": compare_measures(initial, q_eval, tasks)}
        results.append(_qat_result(run, baseline, rows, ape_from_step, measures))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(baseline, qats, initial, results, warnings, ape_from_step, resamples, seed)
    markdown += render_evaluations(evaluated)
    (out / "results.md").write_text(markdown)
    write_csv(out / "results.csv", results)
    tensors = select_tensors(qats, layers)
    report = {
        "baseline": _baseline_entry(baseline, base_eval, keys),
        "initial": {"source": initial.source, "records": {s: str(p) for s, p in initial.record_files.items()},
                    "benchmarks": {k: forgetting[k]["from"] for k in keys}} if initial else None,
        "qat": results,
        "ci": {"method": "paired bootstrap, percentile", "level": stats.CONFIDENCE, "resamples": resamples, "seed": seed,
               "test": "McNemar exact two-sided (acc metrics)",
               "measures": "paired mean difference, normal interval, CR1 cluster-robust SE (qat_app.eval.measures)"},
        "warnings": warnings,
        "evaluations": evaluated,
        "ape_from_step": ape_from_step,
        "amax_tensors": tensors,
        "figures": _write_figures(out, baseline, qats, results, tensors),
        "files": ["results.md", "results.csv", "results.json", *FIGURES, *HEALTH_FIGURES],
    }
    (out / "results.json").write_text(json.dumps(json_safe(report), indent=1))
    report["markdown"] = markdown
    return report
