"""The report's text outputs: results.md (markdown tables), results.csv, and strict-JSON values for results.json."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from .compare import COMPARISONS, Evaluation
from .distortion import render_distortion, render_floor
from .health import health_scalars, render_fallback, render_forecast, render_headroom, render_health, render_whatif
from .measures_table import MEASURE_CSV_COLUMNS, csv_rows, has_measures, render_measures
from ..eval.records import scored_line
from ..hif8.inventory import INVENTORY_FILE, block_ranges
from .runs import (CONFIG_FILE, SUMMARY_FILE, Run, fmt, inventory_stats, last_value, precision_name, quantized,
                   scored_examples)


def json_safe(value):
    """NaN / inf -> None, paths -> str, recursively (results.json stays strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _diff_cell(c: dict) -> str:
    if c["difference"] is None:
        return "–"
    text = fmt(c["difference"], "+.4f")
    if c["ci_low"] is None:
        return text + " (CI n/a)"
    p = f", p={c['mcnemar_p']:.3g}" if c["mcnemar_p"] is not None else ""
    return f"{text} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]{p} **{c['verdict']}**"


def _n_cell(c: dict) -> str:
    if c["n"] is None:
        return "–"
    return str(c["n"]) if c["n"] == c["n_from"] == c["n_to"] else f"{c['n']} (of {c['n_from']} / {c['n_to']})"


def _describe(run: Run) -> str:
    if run.config is None:
        return f"{run.path} (no {CONFIG_FILE})"
    quant = (f"{str(run.setting('model.quant.format', 'hif8')).upper().replace('HIF8', 'HiF8')} W8A8, "
             f"{run.setting('model.quant.amax_algo')} H={run.setting('model.quant.history_len')}, "
             f"warmup {run.setting('warmup.warmup_steps', 0)}") if quantized(run) else "unquantized"
    return (f"{run.path} ({precision_name(run)}: trainer.precision {run.setting('trainer.precision')}; {quant}; "
            f"{run.config_path}{_describe_inventory(run) if quantized(run) else ''})")


def _scored(run: Run) -> list[str]:
    """The sub-item saying, per benchmark task, the examples its last validation scored of those selected."""
    counts = scored_examples(run)
    return [f"  - benchmark examples scored / selected (last validation): {scored_line(counts)}"] if counts else []


def _describe_inventory(run: Run) -> str:
    """What the fit quantized (its quantized_modules.json), or that an older run did not record it."""
    stats = inventory_stats(run)
    if stats is None:
        return f"; quantized modules not recorded (no {INVENTORY_FILE}: a run made before it was written)"
    return (f"; {stats['quantized_modules']} quantized modules, high-precision blocks "
            f"{block_ranges(stats['high_precision_blocks'])} ({stats['file']})")


def _render_header(baseline: Run, qats: list[Run], initial: Evaluation | None, warnings: list[str],
                   resamples: int, seed: int) -> list[str]:
    """The title, what each run is, the warnings, and how to read the Δ / CI / n columns."""
    q_names = ", ".join(f"`{r.label}`" for r in qats)
    lines = [f"# {q_names} vs `{baseline.label}`", "", f"- baseline `{baseline.label}`: {_describe(baseline)}"]
    lines += _scored(baseline)
    for run in qats:
        lines += [f"- QAT `{run.label}`: {_describe(run)}", *_scored(run)]
    lines.append(f"- initial model: {initial.source}" if initial else
                 "- initial model: **not available** (no step-0 benchmark evaluation in the baseline and no --initial): "
                 "only the quantization difference is shown")
    lines += [""] + [f"> **warning:** {w}" for w in warnings] + ([""] if warnings else [])
    lines.append(f"Δ = after − before (negative: worse); [lo, hi] = paired bootstrap 95% CI of the difference of "
                 f"means over the same examples ({resamples} resamples, seed {seed}); p = McNemar exact two-sided; "
                 "a difference whose CI contains 0 is within noise. n = examples compared (\"n (of a / b)\": the runs evaluated "
                 "different examples, their intersection is used). Rel. drop % = (baseline − QAT) / baseline × 100.")
    return lines


def _render_benchmark_tables(qats: list[Run], initial: Evaluation | None, results: list[dict]) -> list[str]:
    """One table a QAT run of its main benchmark metrics and comparisons, then the CI-n/a notes (each once)."""
    lines: list[str] = []
    notes: list[str] = []
    for run, r in zip(qats, results):
        comps = [c for c in COMPARISONS if initial or c == "quantization"]
        head = (["Metric"] + (["initial"] if initial else []) + ["baseline", "QAT"]
                + [f"{c} ({' → '.join(COMPARISONS[c]).replace('qat', 'QAT')})" for c in comps] + ["n", "rel. drop %"])
        lines += ["", f"## `{run.label}`", "", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        shown = [b for b in r["benchmarks"] if b["metric"].count("/") == 2]
        for b in shown:
            cells = [b["metric"]] + ([fmt(b["initial"])] if initial else []) + [fmt(b["baseline"]), fmt(b["qat"])]
            cells += [_diff_cell(b["comparisons"][c]) for c in comps]
            cells += [_n_cell(b["comparisons"]["quantization"]), fmt(b["relative_drop_pct"], ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
            notes += [b["comparisons"][c]["ci_note"] for c in comps if b["comparisons"][c]["ci_note"]]
        if len(shown) < len(r["benchmarks"]):
            finer = len(r["benchmarks"]) - len(shown)
            lines.append(f"| *{finer} per-subject metrics: results.csv / results.json* |" + " |" * (len(head) - 1))
        if not r["benchmarks"]:
            lines.append("| *no benchmark metrics (`val/<task>/acc`) logged* |" + " |" * (len(head) - 1))
        else:
            lines.append("| **mean relative drop** (main metrics) |" + " |" * (len(head) - 2) + f" {fmt(r['mean_relative_drop_pct'], '.2f')} |")
    notes = list(dict.fromkeys(notes))
    return lines + [""] * bool(notes) + [f"- CI n/a: {note}; point values only" for note in notes[:10]]


def _render_training_loss(baseline: Run, results: list[dict], ape_from_step: int) -> list[str]:
    """The train-loss APE against the baseline and the final losses, one row a run."""
    since = f", steps ≥ {ape_from_step}" if ape_from_step else ""
    lines = ["", "## Training loss", "", f"| run | train-loss APE % (common steps{since}) | final train loss | final val loss |",
             "|---|---:|---:|---:|",
             f"| `{baseline.label}` | – | {fmt(last_value(baseline.train_loss()))} | {fmt(baseline.last('val/loss'))} |"]
    lines += [f"| `{r['label']}` | {fmt(r['train_loss_ape_pct'], '.3f')} ({r['ape_common_steps']}) | "
              f"{fmt(r['final_train_loss'])} | {fmt(r['final_val_loss'])} |" for r in results]
    distilled = [r for r in results if r.get("distill")]
    if distilled:  # their train loss above is the CE they log beside the KL they train on
        lines += ["", "Distilled runs (their train loss above is their next-token CE, `distill/ce`):", "",
                  "| run | KL(teacher ‖ student), last step | CE, last step |", "|---|---:|---:|"]
        lines += [f"| `{r['label']}` | {fmt(r['distill']['kl'])} | {fmt(r['distill']['ce'])} |" for r in distilled]
    return lines


def _render_arc_check(results: list[dict]) -> list[str]:
    """The paper's check: does quantization drop ARC-Challenge by more than 1 %?"""
    lines = ["", "## ARC-Challenge check (paper: quantization drop > 1 %)", ""]
    for r in results:
        for a in r["arc_check"]:
            ci = f" [{a['ci_low']:+.4f}, {a['ci_high']:+.4f}], n={a['n']}" if a["ci_low"] is not None else " (CI n/a)"
            lines.append(f"- `{r['label']}` {a['metric']}: drop {fmt(a['relative_drop_pct'], '.2f')} % "
                         f"({'>' if a['drop_gt_1pct'] else '≤'} 1 %), Δ {fmt(a['difference'], '+.4f')}{ci}: **{a['verdict']}**")
        if not r["arc_check"]:
            lines.append(f"- `{r['label']}`: no ARC-Challenge metric logged")
    return lines


# the saturation table's rows: (title, key of the run's saturation stats, format)
SATURATION_ROWS = [("clipped elements", "clipped", "d"), ("seen (quantized) elements", "seen", "d"),
                   ("clipped fraction", "clipped_frac", ".3e"), ("saturation events", "events", "d"),
                   ("layers that clipped", "layers_clipped", "d"), ("first clipped step", "first_clipped_step", "d"),
                   ("min headroom (a_hat / amax)", "min_headroom", ".4f"), ("quantized steps", "quantized_steps", "d")]


def _render_saturation(results: list[dict]) -> list[str]:
    """The clipping counts, one column a QAT run, then which tensors clipped and where the numbers came from."""
    lines = ["", "## Saturation", "", "| | " + " | ".join(f"`{r['label']}`" for r in results) + " |", "|---|" + "---:|" * len(results)]
    for title, key, spec in SATURATION_ROWS:
        cells = []
        for r in results:
            s = r["saturation"] or {}
            value = s.get(key)
            cells.append("never" if key == "first_clipped_step" and value is None and s.get("clipped") == 0 else fmt(value, spec))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for r in results:
        s = r["saturation"]
        if s and s["tensors_clipped"]:
            lines.append(f"\n`{r['label']}` tensors that clipped ({len(s['tensors_clipped'])}): "
                         + ", ".join(f"`{t}`" for t in s["tensors_clipped"]))
        if s and s["seen"] is None:
            lines.append(f"\n`{r['label']}`: no {SUMMARY_FILE}; saturation from the per-step CSV columns.")
    return lines


def render_markdown(baseline: Run, qats: list[Run], initial: Evaluation | None, results: list[dict],
                    warnings: list[str], ape_from_step: int, resamples: int, seed: int) -> str:
    """results.md: the header, the benchmark tables, the measures and distortion sections, losses, ARC, saturation
    and health."""
    lines = _render_header(baseline, qats, initial, warnings, resamples, seed)
    lines += _render_benchmark_tables(qats, initial, results)
    if has_measures(results):
        lines += render_measures(results, [r["label"] for r in results], initial is not None)
    lines += render_distortion(results)
    lines += render_floor(results)
    lines += _render_training_loss(baseline, results, ape_from_step)
    lines += _render_arc_check(results)
    lines += _render_saturation(results)
    lines += (render_whatif(results) + render_health(results) + render_headroom(results) + render_forecast(results)
              + render_fallback(results))
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ["run", "metric", "comparison", "value", "from", "to", "difference", "ci_low", "ci_high",
               "mcnemar_p", "verdict", "n", "relative_drop_pct", *MEASURE_CSV_COLUMNS]


def write_csv(path: Path, results: list[dict]) -> None:
    """One row per (QAT run, metric, comparison), then the continuous measures' rows (metric
    ``<split>/<task>/<measure>``), then the run's scalars (APE, losses, saturation) in ``value``."""
    def cell(v):
        return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else repr(v) if isinstance(v, float) else v

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            for b in r["benchmarks"]:
                for name, c in b["comparisons"].items():
                    w.writerow({k: cell(v) for k, v in {**c, "run": r["label"], "metric": b["metric"], "comparison": name}.items()})
            for row in csv_rows(r):
                w.writerow({k: cell(v) for k, v in row.items()})
            scalars = {"mean_relative_drop_pct": r["mean_relative_drop_pct"], "train_loss_ape_pct": r["train_loss_ape_pct"],
                       "final_train_loss": r["final_train_loss"], "final_val_loss": r["final_val_loss"]}
            scalars.update({f"saturation_{k}": v for k, v in (r["saturation"] or {}).items() if k not in ("source", "tensors_clipped")})
            if r.get("quantized_modules"):
                scalars["quantized_modules"] = r["quantized_modules"]["quantized_modules"]
                scalars["high_precision_blocks"] = len(r["quantized_modules"]["high_precision_blocks"])
            scalars.update(health_scalars(r))
            for name, value in scalars.items():
                w.writerow({"run": r["label"], "metric": name, "value": cell(value),
                            "n": r["ape_common_steps"] if name == "train_loss_ape_pct" else ""})
