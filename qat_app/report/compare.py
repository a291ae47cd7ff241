"""The comparisons (initial -> baseline -> QAT, paired intervals over the same examples) and the checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .. import stats
from ..eval.mmlu import MMLU_SUBJECT_CATEGORIES
from .runs import CONFIG_FILE, SAMPLES_DIR, ReportError, Run, natural_key, flatten, read_samples


BENCHMARK_RE = re.compile(r"^(val|test)/[^/]+/.+$")
REAL_METRICS = ("acc", "acc_norm")
COMPARISONS = {"forgetting": ("initial", "baseline"), "quantization": ("baseline", "qat"), "total": ("initial", "qat")}


# config fields a QAT run may set differently from its baseline: quantization and bookkeeping paths
# What changes a run's numbers, and so must match between a baseline and its QAT run: the model, data,
# optimizer and schedule (``model.*``, ``data.*``), the seed, and the trainer settings of the arithmetic and
# its length (steps, precision, accumulation, clipping, devices). Everything else -- checkpoint callbacks and
# their directories, loggers, progress, logging intervals, the run directory -- changes no number and is
# ignored, as are the quantization itself (``model.quant.*``: what the pair compares) and the evaluation's
# example selection (``data.init_args.benchmarks``: the report pairs the examples both runs scored).
COMPARED_CONFIG = re.compile(
    r"^(seed_everything|model|data|trainer\.(max_steps|max_epochs|limit_train_batches|precision|"
    r"accumulate_grad_batches|gradient_clip_val|gradient_clip_algorithm|devices|num_nodes|strategy|"
    r"deterministic|limit_val_batches))(\.|$)"
)
# what a report compares (quantization, or distillation against plain QAT), and what does not change the numbers
ALLOWED_CONFIG_DIFFERENCES = re.compile(r"^(model\.quant|model\.distill|data\.init_args\.benchmarks)(\.|$)")


@dataclass
class Evaluation:
    """One evaluation of one model: metrics.csv values and, where written, per-split per-example records."""

    source: str
    values: dict[str, float | None]
    records: dict[str, dict[tuple, dict]]  # split -> records
    record_files: dict[str, Path]
    missing: dict[str, str]  # split -> why there are no records
    cache: dict[str, dict] = field(default_factory=dict)  # metric key -> per-example values


def evaluate_run(run: Run, keys: list[str], step: int | None, source: str) -> Evaluation:
    """``step`` None: each key's last logged value and each split's last records file; else that step's."""
    values = {k: (run.last(k) if step is None else run.series(k).get(step)) for k in keys}
    records, files, missing = {}, {}, {}
    for split in sorted({k.split("/")[0] for k in keys}):
        steps = [s for stage, s in run.samples if stage == split and (step is None or s == step)]
        if steps:
            files[split] = run.samples[(split, max(steps))]
            records[split] = read_samples(files[split])
        else:
            at = f"_step{step:07d}" if step is not None else "_step*"
            missing[split] = f"no per-example records ({SAMPLES_DIR}/{split}{at}.jsonl) in {run.path}"
    return Evaluation(source, values, records, files, missing)


def example_values(records: dict[tuple, dict], key: str, path: Path | None = None) -> dict[tuple, float]:
    """Per-example values of a metric key (``val/arc_challenge/acc``, ``val/mmlu/<subject>/acc``,
    ``val/mmlu_<category>/acc``)."""
    parts = key.split("/")
    task, subject, metric = parts[1], (parts[2] if len(parts) == 4 else None), parts[-1]
    category = task[len("mmlu_"):] if task.startswith("mmlu_") and subject is None else None
    out = {}
    for k, record in records.items():
        if category is not None:
            if k[0] != "mmlu" or MMLU_SUBJECT_CATEGORIES.get(k[1]) != category:
                continue
        elif k[0] != task or (subject is not None and k[1] != subject):
            continue
        if metric not in record:
            raise ReportError(f"{path}: record {k} has no {metric!r}")
        out[k] = float(record[metric])
    return out


def _examples(evaluation: Evaluation, key: str) -> dict[tuple, float] | None:
    """Per-example values of ``key`` in one evaluation (memoized); None without records for its split."""
    split = key.split("/")[0]
    if split not in evaluation.records:
        return None
    if key not in evaluation.cache:
        evaluation.cache[key] = example_values(evaluation.records[split], key, evaluation.record_files[split])
    return evaluation.cache[key]


def compare_metric(key: str, before: Evaluation, after: Evaluation, resamples: int, seed: int) -> dict:
    """One difference (after - before) with its paired interval, McNemar p and verdict."""
    split = key.split("/")[0]
    x_all, y_all = _examples(before, key), _examples(after, key)
    b, a = before.values.get(key), after.values.get(key)
    if b is None and x_all:
        b = sum(x_all.values()) / len(x_all)
    if a is None and y_all:
        a = sum(y_all.values()) / len(y_all)
    row = {"from": b, "to": a, "difference": a - b if a is not None and b is not None else None,
           "relative_drop_pct": relative_drop(b, a), "n": None, "n_from": None, "n_to": None,
           "ci_low": None, "ci_high": None, "mcnemar_p": None, "verdict": "n/a", "ci_note": None}
    if x_all is None or y_all is None:
        row["ci_note"] = (before.missing.get(split) if x_all is None else after.missing.get(split))
        return row
    common = sorted(set(x_all) & set(y_all), key=lambda k: tuple(map(str, k)))
    row.update(n=len(common), n_from=len(x_all), n_to=len(y_all))
    if not common:
        row["ci_note"] = f"{key}: no example evaluated by both"
        return row
    import numpy as np

    xs, ys = np.array([x_all[k] for k in common]), np.array([y_all[k] for k in common])
    low, high = stats.paired_bootstrap_ci(xs, ys, resamples, seed)
    pairs = stats.discordant_pairs(xs, ys)
    row.update(difference=float(ys.mean() - xs.mean()), ci_low=low, ci_high=high,
               mcnemar_p=stats.mcnemar_exact_p(*pairs) if pairs else None, verdict=stats.verdict((low, high)))
    return row


def config_differences(base: dict, other: dict) -> list[str]:
    """Fields that change the numbers (:data:`COMPARED_CONFIG`, quantization aside) in which two configs differ,
    as 'key: a vs b'."""
    a, b = _lm_limit_on_data(flatten(base)), _lm_limit_on_data(flatten(other))
    return [f"{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b), key=natural_key)
            if a.get(k, "<absent>") != b.get(k, "<absent>") and COMPARED_CONFIG.match(k)
            and not ALLOWED_CONFIG_DIFFERENCES.match(k)]


def _lm_limit_on_data(flat: dict) -> dict:
    """A saved config's LM validation limit where a run today keeps it: ``trainer.limit_val_batches`` (other than
    0 or all) is ``data.init_args.limit_val_batches`` (:func:`qat_app.preflight.route_limit_val_batches`), so a run
    saved before it was moved pairs with one saved after."""
    limit = flat.get("trainer.limit_val_batches")
    if (limit is None or limit == 0 or (isinstance(limit, float) and limit == 1.0)
            or flat.get("data.init_args.limit_val_batches") is not None):
        return flat
    return {**flat, "trainer.limit_val_batches": None, "data.init_args.limit_val_batches": limit}


def check_pair(baseline: Run, qat: Run, force: bool) -> list[str]:
    """Refuse a QAT run not matched to the baseline (``force``: warn); returns the warnings."""
    warnings, problems = [], []
    for run in (baseline, qat):
        if run.config is None:
            warnings.append(f"`{run.label}`: no {CONFIG_FILE} next to {run.files[-1]}; its settings were not checked")
    if baseline.config is not None and qat.config is not None:
        problems += config_differences(baseline.config, qat.config)
    base_steps, qat_steps = baseline.train_loss(), qat.train_loss()
    if base_steps and qat_steps and max(base_steps) != max(qat_steps):
        problems.append(f"last logged train step: {max(base_steps)} vs {max(qat_steps)}")
    if problems:
        files = (f"{baseline.config_path or baseline.files[-1]} (baseline) and "
                 f"{qat.config_path or qat.files[-1]} (QAT `{qat.label}`)")
        message = f"{files} differ in more than quantization (and distillation) settings: " + "; ".join(problems)
        if not force:
            raise ReportError(message + ". Pass --force to report anyway.")
        warnings.append("forced (--force): " + message)
    return warnings


def relative_drop(baseline: float | None, qat: float | None) -> float:
    """(baseline - qat) / baseline * 100; positive = QAT worse. NaN when undefined."""
    if baseline is None or qat is None or not math.isfinite(baseline) or not math.isfinite(qat) or baseline == 0:
        return math.nan
    return (baseline - qat) / baseline * 100.0


def loss_ape(base: dict[int, float], qat: dict[int, float], from_step: int = 0) -> tuple[float, int]:
    """Mean over the common steps (>= from_step) of |qat - base| / base * 100 -> (APE %, number of steps)."""
    terms = [
        abs(qat[s] - base[s]) / abs(base[s]) * 100.0
        for s in sorted(set(base) & set(qat))
        if s >= from_step and math.isfinite(base[s]) and math.isfinite(qat[s]) and base[s] != 0
    ]
    return (sum(terms) / len(terms), len(terms)) if terms else (math.nan, 0)


def is_main_metric(key: str) -> bool:
    """``<split>/<task>/acc|acc_norm`` (not MMLU subjects or categories): the metrics of the mean drop."""
    parts = key.split("/")
    return len(parts) == 3 and parts[2] in REAL_METRICS and not parts[1].startswith("mmlu_")


def benchmark_keys(runs: Iterable[Run], pattern: str | None = None) -> list[str]:
    """Real benchmark metrics (acc / acc_norm; never ``count``) logged by any run."""
    regex = re.compile(pattern) if pattern else None
    keys = {k for run in runs for k in run.columns if BENCHMARK_RE.match(k) and k.split("/")[-1] in REAL_METRICS}
    return sorted((k for k in keys if regex is None or regex.search(k)), key=lambda k: (not is_main_metric(k), natural_key(k)))


def saturation_stats(run: Run) -> dict | None:
    """Clipped / seen elements, events, tensors that clipped, first clipped step, min headroom, the tensors that fell
    back (``callbacks.fallback``), the what-if headroom of the last measured step."""
    s = run.summary
    first_csv = next((step for step, v in run.series("sat/clipped").items() if v > 0), None)
    if s is not None and (s.get("quantized_tensors", 1) or s.get("seen")):
        tensors = s.get("tensors") or {}
        names = s.get("tensors_clipped")
        if names is None:
            names = [n for n, t in tensors.items() if (t.get("clipped") or 0) > 0]
        headrooms = [t["min_headroom"] for t in tensors.values() if isinstance(t.get("min_headroom"), (int, float))]
        seen = int(s.get("seen") or 0)
        out = {"clipped": int(s["clipped"]), "seen": seen,
               "clipped_frac": s.get("clipped_frac", s["clipped"] / seen if seen else 0.0),
               "events": int(s["saturation_events"]),
               "first_clipped_step": s["first_clipped_step"] if "first_clipped_step" in s else first_csv,
               "min_headroom": s.get("min_headroom", min(headrooms) if headrooms else None),
               "quantized_steps": s.get("quantized_steps"), "source": str(run.summary_path)}
    else:
        events = run.series("sat/events")
        if not events:
            return None
        fracs = run.series("sat/clipped_frac")
        names = [t for t in run.tensors() if any(v > 0 for v in run.series(f"sat/{t}/clipped_frac").values())]
        out = {"clipped": int(round(sum(run.series("sat/clipped").values()))), "seen": None,
               "clipped_frac": sum(fracs.values()) / len(fracs) if fracs else math.nan,
               "events": int(round(sum(events.values()))), "first_clipped_step": first_csv, "min_headroom": None,
               "quantized_steps": None, "source": "metrics.csv (no summary: mean of per-step sat/clipped_frac)"}
    out["tensors_clipped"] = sorted(names, key=natural_key)
    out["layers_clipped"] = len(out["tensors_clipped"])
    out["fallback"] = list(s.get("fallback") or []) if s is not None else []  # the fallback policy's decisions
    out["fallback_stopped"] = s.get("fallback_stopped") if s is not None else None  # the budget's stop
    out["headroom"] = s.get("headroom") if s is not None else None  # the what-if headroom (qat_app.hif8.headroom)
    out["forecast"] = s.get("forecast") if s is not None else None  # the saturation forecast, scored
    return out


def arc_check(rows: list[dict]) -> list[dict]:
    """The paper's 'ARC-Challenge drop > 1 %' check, with whether the drop is outside the noise."""
    out = []
    for row in rows:
        if row["metric"].split("/")[1:] in (["arc_challenge", "acc_norm"], ["arc_challenge", "acc"]):
            q = row["comparisons"]["quantization"]
            drop = q["relative_drop_pct"]
            out.append({"metric": row["metric"], "relative_drop_pct": drop, "drop_gt_1pct": bool(drop > 1.0),
                        "difference": q["difference"], "ci_low": q["ci_low"], "ci_high": q["ci_high"], "n": q["n"],
                        "verdict": q["verdict"], "significant": q["verdict"] in ("worse", "better")})
    return out
