"""The paper's results table and figures from your own runs' logs (nothing is re-run).

    python main.py report --baseline runs/bf16_baseline --qat runs/exp8 [runs/exp7 ...] [--initial DIR] \\
        [--labels BASE exp8 exp7] [--out reports/exp8] [--layers layers.10.mlp.down_proj ...] [--force]
    python -m qat_app.report ...            (the same)

A run DIR holds a Lightning ``CSVLogger`` output: a version directory (``runs/x/logs/version_0``),
the logger directory or the run root. All ``metrics.csv`` of one run (a resumed fit, a separate
``main.py test``) are merged, later versions winning on a step logged twice; ``saturation_summary.json``
and ``config.yaml`` come from the latest version that has one, per-example records
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

Before comparing, each QAT run's config.yaml is checked against the baseline's: only quantization
(``model.quant.*``, ``warmup.*``, ``saturation.*``) and bookkeeping paths may differ, and the last
logged train step must match; otherwise :class:`ReportError` (``--force``: a warning, also in results.md).

Written to ``--out``: results.md, results.csv (one row per run, metric, comparison), results.json
(everything), loss_curves.png, amax_vs_ahat.png, saturation_heatmap.png (the warmup -> quantization switch is
drawn on every step axis).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from . import stats
from .errors import QATError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "saturation_summary.json"
CONFIG_FILE = "config.yaml"
SAMPLES_DIR = "benchmark_samples"
FIGURES = ("loss_curves.png", "amax_vs_ahat.png", "saturation_heatmap.png")
BENCHMARK_RE = re.compile(r"^(val|test)/[^/]+/.+$")
REAL_METRICS = ("acc", "acc_norm")
COMPARISONS = {"forgetting": ("initial", "baseline"), "quantization": ("baseline", "qat"), "total": ("initial", "qat")}
_VERSION_RE = re.compile(r"^version_(\d+)$")
_SAMPLES_RE = re.compile(r"^(val|test)_step(\d+)\.jsonl$")
# config fields a QAT run may set differently from its baseline: quantization and bookkeeping paths
ALLOWED_CONFIG_DIFFERENCES = re.compile(
    r"^(model\.quant|warmup|saturation|ckpt_path|trainer\.default_root_dir)(\.|$)"
    r"|^trainer\.logger(\.\d+)?\.init_args\.(save_dir|name|version)$"
    r"|^trainer\.callbacks(\.\d+)?\.init_args\.dirpath$"
)
PRECISION_NAMES = {"32-true": "fp32", "32": "fp32", "64-true": "fp64", "64": "fp64", "bf16-mixed": "BF16",
                   "bf16-true": "BF16", "bf16": "BF16", "16-mixed": "FP16", "16-true": "FP16", "16": "FP16"}


class ReportError(QATError, ValueError):
    """Bad report input; the message names the file."""


# ------------------------------------------------------------------------------------------- input
def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(text))]


def _version_number(directory: Path) -> int:
    m = _VERSION_RE.match(directory.name)
    return int(m.group(1)) if m else -1


def find_metrics_files(path: str | os.PathLike) -> list[Path]:
    """The metrics.csv files of one run (oldest version first)."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.name == METRICS_FILE:
            return [p]
        raise ReportError(f"{p}: expected a run directory or a {METRICS_FILE}")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such run directory")
    if (p / METRICS_FILE).is_file():
        return [p / METRICS_FILE]
    found = sorted(p.rglob(METRICS_FILE), key=lambda f: _natural_key(f.relative_to(p)))
    if not found:
        raise FileNotFoundError(
            f"{p}: no {METRICS_FILE} in it or below (expected a CSVLogger run: runs/<name>, "
            f"runs/<name>/logs or runs/<name>/logs/version_N)"
        )
    groups: dict[Path, list[Path]] = {}
    for f in found:
        groups.setdefault(f.parent.parent if _VERSION_RE.match(f.parent.name) else f.parent, []).append(f)
    if len(groups) > 1:
        raise ReportError(f"{p}: holds several runs ({', '.join(map(str, groups))}); pass one of them")
    return sorted(next(iter(groups.values())), key=lambda f: _version_number(f.parent))


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a CSVLogger metrics.csv as {column: float} (empty cells left out; 'step' is an int)."""
    path = Path(path)
    rows: list[dict[str, float]] = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                raise ReportError(f"{path}: not a Lightning CSVLogger metrics file (no 'step' column)")
            for line, raw in enumerate(reader, start=2):
                row: dict[str, float] = {}
                for key, value in raw.items():
                    if key is None or value is None or value == "":
                        continue
                    try:
                        row[key] = float(value)
                    except ValueError:
                        raise ReportError(f"{path}, line {line}: column {key!r} is not a number: {value!r}") from None
                if "step" in row:
                    row["step"] = int(row["step"])
                    rows.append(row)
    except csv.Error as err:
        raise ReportError(f"{path}: malformed CSV ({err})") from None
    except UnicodeDecodeError as err:
        raise ReportError(f"{path}: not a text CSV file ({err})") from None
    return rows


def read_summary(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"{path}: not a readable saturation summary ({err})") from None
    for key in ("saturation_events", "clipped", "seen"):
        if not isinstance(summary, dict) or key not in summary:
            raise ReportError(f"{path}: not a saturation summary (no {key!r})")
    return summary


def read_config(path: str | os.PathLike) -> dict:
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ReportError(f"{path}: not a readable config ({err})") from None
    if not isinstance(config, dict):
        raise ReportError(f"{path}: not a LightningCLI config (no mapping at the top)")
    return config


def read_samples(path: Path) -> dict[tuple, dict]:
    """Per-example records of one jsonl file, keyed by (task, subject, doc_id)."""
    records: dict[tuple, dict] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ReportError(f"{path}, line {line_no}: not JSON ({err})") from None
            if not isinstance(record, dict) or "task" not in record or "doc_id" not in record:
                raise ReportError(f"{path}, line {line_no}: not a benchmark record (needs 'task' and 'doc_id')")
            records[(record["task"], record.get("subject") or "", record["doc_id"])] = record
    return records


@dataclass
class Run:
    label: str
    path: Path
    files: list[Path]
    rows: list[list[dict[str, float]]]  # per metrics file
    summary: dict | None = None
    summary_path: Path | None = None
    config: dict | None = None
    config_path: Path | None = None
    samples: dict[tuple[str, int], Path] = field(default_factory=dict)  # (stage, step) -> jsonl
    _columns: set[str] = field(default_factory=set)
    _flat_config: dict | None = None

    @property
    def columns(self) -> set[str]:
        if not self._columns:
            self._columns = {k for rows in self.rows for row in rows for k in row}
        return self._columns

    def series(self, key: str) -> dict[int, float]:
        """step -> value of ``key``; rows of one step are averaged, a later version file wins."""
        out: dict[int, float] = {}
        for rows in self.rows:
            acc: dict[int, list[float]] = {}
            for row in rows:
                if key in row:
                    acc.setdefault(row["step"], []).append(row[key])
            for step, values in acc.items():
                finite = [v for v in values if math.isfinite(v)]
                out[step] = sum(finite) / len(finite) if finite else values[-1]
        return dict(sorted(out.items()))

    def train_loss(self) -> dict[int, float]:
        """step -> train/loss (``train/loss_step`` when the loss was also logged per epoch)."""
        for key in ("train/loss", "train/loss_step"):
            if key in self.columns:
                return self.series(key)
        return {}

    def last(self, key: str) -> float | None:
        return _last(self.series(key))

    def setting(self, dotted: str, default=None):
        """A config field by its dotted name (``trainer.precision``); ``default`` when absent."""
        if self.config is None:
            return default
        if self._flat_config is None:
            self._flat_config = flatten(self.config)
        return self._flat_config.get(dotted, default)

    def tensors(self) -> list[str]:
        """Quantized tensors with per-layer keys in the CSV (``layers.3.mlp.up_proj.input`` ...)."""
        names = set()
        for col in self.columns:
            if col.startswith(("amax/", "a_hat/")):
                names.add(col.split("/", 1)[1])
            elif col.startswith("sat/") and col.endswith("/clipped_frac") and col.count("/") >= 2:
                names.add(col[len("sat/"):-len("/clipped_frac")])
        return sorted(names, key=_natural_key)


def _last(series: dict[int, float]) -> float | None:
    return series[max(series)] if series else None


def load_run(path: str | os.PathLike, label: str | None = None) -> Run:
    files = find_metrics_files(path)
    run = Run(label or default_label(path), Path(path), files, [read_metrics(f) for f in files])
    for f in reversed(files):
        if run.summary is None and (f.parent / SUMMARY_FILE).is_file():
            run.summary, run.summary_path = read_summary(f.parent / SUMMARY_FILE), f.parent / SUMMARY_FILE
        if run.config is None and (f.parent / CONFIG_FILE).is_file():
            run.config, run.config_path = read_config(f.parent / CONFIG_FILE), f.parent / CONFIG_FILE
    for f in files:
        for sample in sorted((f.parent / SAMPLES_DIR).glob("*.jsonl")):
            m = _SAMPLES_RE.match(sample.name)
            if m:
                run.samples[(m.group(1), int(m.group(2)))] = sample
    return run


def default_label(path: str | os.PathLike) -> str:
    p = Path(path).expanduser().absolute()
    if p.name == METRICS_FILE:
        p = p.parent
    parts = [part for part in p.parts if not _VERSION_RE.match(part) and part not in ("logs", "csv", "lightning_logs")]
    return parts[-1] if parts else str(path)


def precision_name(run: Run) -> str | None:
    """``trainer.precision`` as a name (fp32 / BF16 / FP16); None without a config."""
    if run.config is None:
        return None
    value = run.setting("trainer.precision")
    return "fp32" if value is None else PRECISION_NAMES.get(str(value), str(value))


def quantized(run: Run) -> bool:
    """False when the config turns quantization off (``model.quant.enabled: false`` or ``model.quant: null``)."""
    if run.config is not None and run.setting("model.quant", "<dict>") is None:
        return False
    return run.setting("model.quant.enabled", True) is not False


def warmup_switch_step(run: Run) -> int | None:
    """The first quantized optimizer step (``warmup.warmup_steps`` when > 0 in a quantized run's config)."""
    steps = run.setting("warmup.warmup_steps")
    return int(steps) if isinstance(steps, (int, float)) and steps > 0 and quantized(run) else None


# ------------------------------------------------------------------------------------- evaluations
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


def _mmlu_category(subject: str) -> str | None:
    from qat_app.data.benchmarks import MMLU_SUBJECT_CATEGORIES

    return MMLU_SUBJECT_CATEGORIES.get(subject)


def example_values(records: dict[tuple, dict], key: str, path: Path | None = None) -> dict[tuple, float]:
    """Per-example values of a metric key (``val/arc_challenge/acc``, ``val/mmlu/<subject>/acc``,
    ``val/mmlu_<category>/acc``)."""
    parts = key.split("/")
    task, subject, metric = parts[1], (parts[2] if len(parts) == 4 else None), parts[-1]
    category = task[len("mmlu_"):] if task.startswith("mmlu_") and subject is None else None
    out = {}
    for k, record in records.items():
        if category is not None:
            if k[0] != "mmlu" or _mmlu_category(k[1]) != category:
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


# -------------------------------------------------------------------------------------- checks
def flatten(value, prefix: str = "") -> dict[str, object]:
    """Nested config -> {"trainer.logger.0.init_args.save_dir": ...} (empty mappings / lists kept as values)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if not items:
        return {prefix: value} if prefix else {}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_differences(base: dict, other: dict) -> list[str]:
    """Fields (other than quantization and bookkeeping) in which two configs differ, as 'key: a vs b'."""
    a, b = flatten(base), flatten(other)
    return [f"{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}"
            for k in sorted(set(a) | set(b), key=_natural_key)
            if a.get(k, "<absent>") != b.get(k, "<absent>") and not ALLOWED_CONFIG_DIFFERENCES.match(k)]


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
        message = f"{files} differ in more than quantization settings: " + "; ".join(problems)
        if not force:
            raise ReportError(message + ". Pass --force to report anyway.")
        warnings.append("forced (--force): " + message)
    return warnings


# -------------------------------------------------------------------------------------- arithmetic
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
    return sorted((k for k in keys if regex is None or regex.search(k)), key=lambda k: (not is_main_metric(k), _natural_key(k)))


def saturation_stats(run: Run) -> dict | None:
    """Clipped / seen elements, events, tensors that clipped, first clipped step, min headroom."""
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
    out["tensors_clipped"] = sorted(names, key=_natural_key)
    out["layers_clipped"] = len(out["tensors_clipped"])
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


# ----------------------------------------------------------------------------------------- output
def _fmt(value, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def _json_safe(value):
    """NaN / inf -> None, paths -> str, recursively (results.json stays strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _diff_cell(c: dict) -> str:
    if c["difference"] is None:
        return "–"
    text = _fmt(c["difference"], "+.4f")
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
    return f"{run.path} ({precision_name(run)}: trainer.precision {run.setting('trainer.precision')}; {quant}; {run.config_path})"


def render_markdown(baseline: Run, qats: list[Run], initial: Evaluation | None, results: list[dict],
                    warnings: list[str], ape_from_step: int, resamples: int, seed: int) -> str:
    q_names = ", ".join(f"`{r.label}`" for r in qats)
    lines = [f"# {q_names} vs `{baseline.label}`", "", f"- baseline `{baseline.label}`: {_describe(baseline)}"]
    lines += [f"- QAT `{run.label}`: {_describe(run)}" for run in qats]
    lines.append(f"- initial model: {initial.source}" if initial else
                 "- initial model: **not available** (no step-0 benchmark evaluation in the baseline and no --initial): "
                 "only the quantization difference is shown")
    lines += [""] + [f"> **warning:** {w}" for w in warnings] + ([""] if warnings else [])
    lines.append(f"Δ = after − before (negative: worse); [lo, hi] = paired bootstrap 95% CI of the difference of "
                 f"means over the same examples ({resamples} resamples, seed {seed}); p = McNemar exact two-sided; "
                 "a difference whose CI contains 0 is within noise. n = examples compared (\"n (of a / b)\": the runs evaluated "
                 "different examples, their intersection is used). Rel. drop % = (baseline − QAT) / baseline × 100.")
    notes: list[str] = []
    for run, r in zip(qats, results):
        comps = [c for c in COMPARISONS if initial or c == "quantization"]
        head = (["Metric"] + (["initial"] if initial else []) + ["baseline", "QAT"]
                + [f"{c} ({' → '.join(COMPARISONS[c]).replace('qat', 'QAT')})" for c in comps] + ["n", "rel. drop %"])
        lines += ["", f"## `{run.label}`", "", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        shown = [b for b in r["benchmarks"] if b["metric"].count("/") == 2]
        for b in shown:
            cells = [b["metric"]] + ([_fmt(b["initial"])] if initial else []) + [_fmt(b["baseline"]), _fmt(b["qat"])]
            cells += [_diff_cell(b["comparisons"][c]) for c in comps]
            cells += [_n_cell(b["comparisons"]["quantization"]), _fmt(b["relative_drop_pct"], ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
            notes += [b["comparisons"][c]["ci_note"] for c in comps if b["comparisons"][c]["ci_note"]]
        if len(shown) < len(r["benchmarks"]):
            finer = len(r["benchmarks"]) - len(shown)
            lines.append(f"| *{finer} per-subject metrics: results.csv / results.json* |" + " |" * (len(head) - 1))
        if not r["benchmarks"]:
            lines.append("| *no benchmark metrics (`val/<task>/acc`) logged* |" + " |" * (len(head) - 1))
        else:
            lines.append("| **mean relative drop** (main metrics) |" + " |" * (len(head) - 2) + f" {_fmt(r['mean_relative_drop_pct'], '.2f')} |")
    notes = list(dict.fromkeys(notes))
    lines += [""] * bool(notes) + [f"- CI n/a: {note}; point values only" for note in notes[:10]]
    since = f", steps ≥ {ape_from_step}" if ape_from_step else ""
    lines += ["", "## Training loss", "", f"| run | train-loss APE % (common steps{since}) | final train loss | final val loss |",
              "|---|---:|---:|---:|",
              f"| `{baseline.label}` | – | {_fmt(_last(baseline.train_loss()))} | {_fmt(baseline.last('val/loss'))} |"]
    lines += [f"| `{r['label']}` | {_fmt(r['train_loss_ape_pct'], '.3f')} ({r['ape_common_steps']}) | "
              f"{_fmt(r['final_train_loss'])} | {_fmt(r['final_val_loss'])} |" for r in results]
    lines += ["", "## ARC-Challenge check (paper: quantization drop > 1 %)", ""]
    for r in results:
        for a in r["arc_check"]:
            ci = f" [{a['ci_low']:+.4f}, {a['ci_high']:+.4f}], n={a['n']}" if a["ci_low"] is not None else " (CI n/a)"
            lines.append(f"- `{r['label']}` {a['metric']}: drop {_fmt(a['relative_drop_pct'], '.2f')} % "
                         f"({'>' if a['drop_gt_1pct'] else '≤'} 1 %), Δ {_fmt(a['difference'], '+.4f')}{ci}: **{a['verdict']}**")
        if not r["arc_check"]:
            lines.append(f"- `{r['label']}`: no ARC-Challenge metric logged")
    lines += ["", "## Saturation", "", "| | " + " | ".join(f"`{r['label']}`" for r in results) + " |", "|---|" + "---:|" * len(results)]
    sat_rows = [("clipped elements", "clipped", "d"), ("seen (quantized) elements", "seen", "d"),
                ("clipped fraction", "clipped_frac", ".3e"), ("saturation events", "events", "d"),
                ("layers that clipped", "layers_clipped", "d"), ("first clipped step", "first_clipped_step", "d"),
                ("min headroom (a_hat / amax)", "min_headroom", ".4f"), ("quantized steps", "quantized_steps", "d")]
    for title, key, spec in sat_rows:
        cells = []
        for r in results:
            s = r["saturation"] or {}
            value = s.get(key)
            cells.append("never" if key == "first_clipped_step" and value is None and s.get("clipped") == 0 else _fmt(value, spec))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    for r in results:
        s = r["saturation"]
        if s and s["tensors_clipped"]:
            lines.append(f"\n`{r['label']}` tensors that clipped ({len(s['tensors_clipped'])}): "
                         + ", ".join(f"`{t}`" for t in s["tensors_clipped"]))
        if s and s["seen"] is None:
            lines.append(f"\n`{r['label']}`: no {SUMMARY_FILE}; saturation from the per-step CSV columns.")
    return "\n".join(lines) + "\n"


CSV_COLUMNS = ["run", "metric", "comparison", "value", "from", "to", "difference", "ci_low", "ci_high",
               "mcnemar_p", "verdict", "n", "relative_drop_pct"]


def write_csv(path: Path, results: list[dict]) -> None:
    """One row per (QAT run, metric, comparison), then the run's scalars (APE, losses, saturation) in ``value``."""
    def cell(v):
        return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else repr(v) if isinstance(v, float) else v

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            for b in r["benchmarks"]:
                for name, c in b["comparisons"].items():
                    w.writerow({k: cell(v) for k, v in {**c, "run": r["label"], "metric": b["metric"], "comparison": name}.items()})
            scalars = {"mean_relative_drop_pct": r["mean_relative_drop_pct"], "train_loss_ape_pct": r["train_loss_ape_pct"],
                       "final_train_loss": r["final_train_loss"], "final_val_loss": r["final_val_loss"]}
            scalars.update({f"saturation_{k}": v for k, v in (r["saturation"] or {}).items() if k not in ("source", "tensors_clipped")})
            for name, value in scalars.items():
                w.writerow({"run": r["label"], "metric": name, "value": cell(value),
                            "n": r["ape_common_steps"] if name == "train_loss_ape_pct" else ""})


# ---------------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _warmup_line(ax, x: float, step: int, run: Run, color: str = "grey", label: bool = True) -> None:
    """The switch to quantization, labelled with the warmup's real precision (fp32 on CPU configs)."""
    text = f"quantization on (end of {precision_name(run) or 'unquantized'} warmup, step {step})"
    ax.axvline(x, color=color, ls="--", lw=1, label=text if label else None)


def plot_loss_curves(path: Path, baseline: Run, qats: list[Run], results: list[dict]) -> dict:
    plt = _plt()
    fig, (ax, ax_err) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    base = baseline.train_loss()
    for i, run in enumerate([baseline] + qats):
        color = "black" if i == 0 else f"C{i - 1}"
        loss = run.train_loss()
        if loss:
            ax.plot(list(loss), list(loss.values()), color=color, lw=1.2, label=f"{run.label} train")
        val = run.series("val/loss")
        if val:
            ax.plot(list(val), list(val.values()), color=color, ls="none", marker="o", label=f"{run.label} val")
        steps = sorted(s for s in set(base) & set(loss) if base[s] and math.isfinite(base[s]) and math.isfinite(loss[s]))
        if i > 0 and steps:
            ax_err.plot(steps, [abs(loss[s] - base[s]) / abs(base[s]) * 100 for s in steps], color=color, lw=1,
                        label=f"{run.label}: APE {results[i - 1]['train_loss_ape_pct']:.3f} %")
            ax_err.axhline(results[i - 1]["train_loss_ape_pct"], color=color, ls="--", lw=0.8)
    switches = {}  # step -> the first run switching then
    for run in qats:
        if warmup_switch_step(run) is not None:
            switches.setdefault(warmup_switch_step(run), run)
    for step, run in sorted(switches.items()):
        for a in (ax, ax_err):
            _warmup_line(a, step, step, run, label=a is ax)
    ax.set_ylabel("loss")
    ax.set_title(f"Training loss: {', '.join(r.label for r in qats)} vs {baseline.label}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_err.set_xlabel("optimizer step")
    ax_err.set_ylabel("|Δloss| / loss_base (%)")
    if ax_err.lines:
        ax_err.legend(fontsize=8)
    ax_err.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"warmup_lines": sorted(switches)}


def select_tensors(qats: list[Run], layers: list[str] | None, limit: int = 6) -> list[str]:
    """Tensors for the a_hat-vs-amax figure.

    Each ``--layers`` item is a tensor name (``layers.10.mlp.down_proj.input``), a layer name (its
    ``.input`` tensor) or a regular expression searched in the tensor names; a leading ``model.`` is
    ignored. Default: the input tensors of the first, middle and last quantized layer plus the most
    clipped tensor.
    """
    available = sorted({t for run in qats for t in run.tensors()}, key=_natural_key)
    if layers:
        chosen: list[str] = []
        for item in layers:
            item = item.removeprefix("model.")
            if item in available:
                matches = [item]
            elif item + ".input" in available:
                matches = [item + ".input"]
            else:
                try:
                    regex = re.compile(item)
                except re.error as err:
                    raise ReportError(f"--layers {item!r}: not a tensor name nor a valid regex ({err})") from None
                matches = [t for t in available if regex.search(t)]
            if not matches:
                raise ReportError(f"--layers {item!r} matches no logged tensor; logged tensors look like {available[:3] or 'none'}")
            chosen += [m for m in matches if m not in chosen]
        return chosen[: max(limit, len(layers))]
    inputs = [t for t in available if t.endswith(".input")] or available
    if not inputs:
        return []
    picks = [inputs[0], inputs[len(inputs) // 2], inputs[-1]]
    worst, worst_value = None, 0
    for run in qats:
        for name, t in ((run.summary or {}).get("tensors") or {}).items():
            if (t.get("clipped") or 0) > worst_value and name in available:
                worst, worst_value = name, t["clipped"]
    return list(dict.fromkeys(picks + ([worst] if worst else [])))


def a_hat_points(run: Run, tensor: str) -> dict[int, float]:
    """step -> a_hat from the first quantized step on, positive estimates only (no ramp from 0)."""
    switch = warmup_switch_step(run)
    return {s: v for s, v in run.series(f"a_hat/{tensor}").items() if v > 0 and (switch is None or s >= switch)}


def clipped_steps(run: Run, tensor: str) -> list[int]:
    """Steps whose logged per-tensor clipped fraction is > 0 (the exact counter; nothing inferred)."""
    return [s for s, v in run.series(f"sat/{tensor}/clipped_frac").items() if v > 0]


def plot_amax(path: Path, qats: list[Run], tensors: list[str]) -> dict:
    """True amax vs a_hat (from the first quantized step, only positive estimates); red x = clipped > 0."""
    plt = _plt()
    n = max(1, len(tensors))
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    if not tensors:
        axes[0][0].text(0.5, 0.5, "no per-layer amax / a_hat logged\n(saturation.per_layer=false, or no QAT run)",
                        ha="center", va="center", transform=axes[0][0].transAxes)
        axes[0][0].set_axis_off()
    lines = set()
    for ax, tensor in zip(axes.flat, tensors):
        for i, run in enumerate(qats):
            color, switch = f"C{i}", warmup_switch_step(run)
            amax, a_hat = run.series(f"amax/{tensor}"), a_hat_points(run, tensor)
            if amax:
                ax.plot(list(amax), list(amax.values()), color=color, lw=1.2, label=f"{run.label} amax")
            if a_hat:
                ax.plot(list(a_hat), list(a_hat.values()), color=color, lw=1.2, ls="--", label=f"{run.label} a_hat")
            over = [s for s in clipped_steps(run, tensor) if s in amax or s in a_hat]
            if over:
                ax.plot(over, [amax.get(s, a_hat.get(s)) for s in over], "x", color="red", ms=6,
                        label="clipped fraction > 0" if i == 0 else None)
            if switch is not None:
                _warmup_line(ax, switch, switch, run)
                lines.add(switch)
        ax.set_title(tensor, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("|x| max")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("a_hat (the estimate each step was quantized with) vs true amax")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"warmup_lines": sorted(lines)}


def plot_heatmap(path: Path, qats: list[Run]) -> dict:
    """Clipped fraction per tensor (every row labelled) and logged step; input / weight / grad panels."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _plt()
    kinds = [k for k in ("input", "weight", "grad")
             if any(t.endswith("." + k) and f"sat/{t}/clipped_frac" in r.columns for r in qats for t in r.tensors())]
    panels = []  # (run, kind, tensors, steps, matrix)
    for run in qats:
        for kind in kinds or ["input"]:
            tensors = [t for t in run.tensors() if t.endswith("." + kind) and f"sat/{t}/clipped_frac" in run.columns]
            series = {t: run.series(f"sat/{t}/clipped_frac") for t in tensors}
            steps = sorted({s for values in series.values() for s in values})
            matrix = np.full((len(tensors), len(steps)), np.nan)
            index = {s: j for j, s in enumerate(steps)}
            for i, t in enumerate(tensors):
                for s, v in series[t].items():
                    matrix[i, index[s]] = v
            panels.append((run, kind, tensors, steps, matrix))
    ncols = max(1, len(kinds))
    heights = [2.2 + 0.13 * max([len(p[2]) for p in panels if p[0] is run] or [1]) for run in qats] or [3]
    fig, axes = plt.subplots(max(1, len(qats)), ncols, figsize=(7.5 * ncols, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    positive = np.concatenate([m[m > 0] for *_, m in panels] or [np.array([])])
    norm = LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 10)) if positive.size else None
    lines = set()
    for ax, (run, kind, tensors, steps, matrix) in zip(axes.flat, panels):
        if not tensors:
            ax.text(0.5, 0.5, f"{run.label}: no per-layer {kind} saturation logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        shown = np.ma.masked_where(~(matrix > 0), matrix)
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=plt.get_cmap("magma_r").with_extremes(bad="#f2f2f2"),
                       norm=norm, extent=(-0.5, len(steps) - 0.5, len(tensors) - 0.5, -0.5))
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(steps[j]) for j in ticks], fontsize=7)
        ax.set_yticks(range(len(tensors)))
        ax.set_yticklabels([t.removesuffix("." + kind) for t in tensors], fontsize=6)  # 0.13 in per row
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"quantized {kind} tensor")
        switch = warmup_switch_step(run)
        if switch is not None:
            after = [j for j, s in enumerate(steps) if s >= switch]
            _warmup_line(ax, (after[0] if after else len(steps)) - 0.5, switch, run, color="tab:blue")
            ax.legend(fontsize=7, loc="upper right")
            lines.add(switch)
        ax.set_title(f"{run.label}: {kind} clipped fraction" + ("" if norm else " (no element clipped)"), fontsize=9)
        if norm is not None:
            fig.colorbar(im, ax=ax, label="clipped fraction (log)")
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"warmup_lines": sorted(lines)}


# ------------------------------------------------------------------------------------------ entry
def _default_qat_label(run: Run, path) -> str:
    if run.config is None:
        return default_label(path)
    fmt = str(run.setting("model.quant.format", "hif8")).upper().replace("HIF8", "HiF8")
    what = f"{fmt} W8A8, {precision_name(run)}" if quantized(run) else f"{precision_name(run)}, unquantized"
    return f"{default_label(path)} ({what})"


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
) -> dict:
    """Write results.md / results.csv / results.json and the three figures; returns the numbers."""
    if not qat_dirs:
        raise ReportError("give at least one QAT run (--qat DIR)")
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
    seen: dict[str, int] = {}
    for run in qats:  # unique labels
        if run.label in seen or run.label == baseline.label:
            seen[run.label] = seen.get(run.label, 1) + 1
            run.label = f"{run.label}#{seen[run.label]}"
        seen.setdefault(run.label, 1)
    warnings = [w for run in qats for w in check_pair(baseline, run, force)]
    warnings = list(dict.fromkeys(warnings))
    for run in [baseline] + qats:
        if not run.train_loss():
            warnings.append(f"`{run.label}`: no train/loss rows in {', '.join(map(str, run.files))}")
    initial_run = load_run(initial_dir, "initial") if initial_dir is not None else None
    keys = benchmark_keys([baseline] + qats + ([initial_run] if initial_run else []), benchmarks)

    if initial_run is not None:
        initial = evaluate_run(initial_run, keys, None, f"--initial {initial_dir} (its last evaluation)")
        b_name, i_name = baseline.setting("model.model_name"), initial_run.setting("model.model_name")
        if b_name is not None and i_name is not None and b_name != i_name:
            warnings.append(f"--initial {initial_dir} evaluated model.model_name {i_name!r}, the baseline started from {b_name!r}")
    else:
        initial = evaluate_run(baseline, keys, 0, f"the baseline's step-0 validation ({baseline.path})")
        if not initial.records and not any(v is not None for v in initial.values.values()):
            initial = None
    for message in warnings:
        log.warning("%s", message)
    base_eval = evaluate_run(baseline, keys, None, "baseline")
    forgetting = {k: compare_metric(k, initial, base_eval, resamples, seed) for k in keys} if initial else {}

    results = []
    for run in qats:
        q_eval = evaluate_run(run, keys, None, run.label)
        rows = []
        for k in keys:
            comps = {"forgetting": forgetting.get(k), "quantization": compare_metric(k, base_eval, q_eval, resamples, seed),
                     "total": compare_metric(k, initial, q_eval, resamples, seed) if initial else None}
            comps = {name: c for name, c in comps.items() if c is not None}
            q = comps["quantization"]
            rows.append({"metric": k, "initial": comps["total"]["from"] if initial else None, "baseline": q["from"],
                         "qat": q["to"], "n": q["n"], "relative_drop_pct": q["relative_drop_pct"], "comparisons": comps})
        main_drops = [r["relative_drop_pct"] for r in rows if is_main_metric(r["metric"]) and math.isfinite(r["relative_drop_pct"])]
        ape, n = loss_ape(baseline.train_loss(), run.train_loss(), ape_from_step)
        results.append({
            "label": run.label, "path": str(run.path), "precision": precision_name(run),
            "config": str(run.config_path) if run.config_path else None, "warmup_switch_step": warmup_switch_step(run),
            "benchmarks": rows, "mean_relative_drop_pct": sum(main_drops) / len(main_drops) if main_drops else math.nan,
            "train_loss_ape_pct": ape, "ape_common_steps": n, "final_train_loss": _last(run.train_loss()),
            "final_val_loss": run.last("val/loss"), "saturation": saturation_stats(run), "arc_check": arc_check(rows),
        })

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(baseline, qats, initial, results, warnings, ape_from_step, resamples, seed)
    (out / "results.md").write_text(markdown)
    write_csv(out / "results.csv", results)
    tensors = select_tensors(qats, layers)
    figures = {FIGURES[0]: plot_loss_curves(out / FIGURES[0], baseline, qats, results),
               FIGURES[1]: plot_amax(out / FIGURES[1], qats, tensors),
               FIGURES[2]: plot_heatmap(out / FIGURES[2], qats)}
    report = {
        "baseline": {"label": baseline.label, "path": str(baseline.path), "precision": precision_name(baseline),
                     "config": str(baseline.config_path) if baseline.config_path else None,
                     "files": [str(f) for f in baseline.files], "final_train_loss": _last(baseline.train_loss()),
                     "final_val_loss": baseline.last("val/loss"), "benchmarks": {k: base_eval.values[k] for k in keys}},
        "initial": {"source": initial.source, "records": {s: str(p) for s, p in initial.record_files.items()},
                    "benchmarks": {k: forgetting[k]["from"] for k in keys}} if initial else None,
        "qat": results,
        "ci": {"method": "paired bootstrap, percentile", "level": stats.CONFIDENCE, "resamples": resamples, "seed": seed,
               "test": "McNemar exact two-sided (acc metrics)"},
        "warnings": warnings,
        "ape_from_step": ape_from_step,
        "amax_tensors": tensors,
        "figures": figures,
        "files": ["results.md", "results.csv", "results.json", *FIGURES],
    }
    (out / "results.json").write_text(json.dumps(_json_safe(report), indent=1))
    report["markdown"] = markdown
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI; bad input exits with a message naming the file (SystemExit), success returns 0."""
    parser = argparse.ArgumentParser(
        prog="python main.py report",
        description="Paper-style table (initial / baseline / QAT with paired CIs, training-loss APE, saturation) and figures.",
    )
    parser.add_argument("--baseline", required=True, metavar="DIR", help="the matched baseline run")
    parser.add_argument("--qat", required=True, nargs="+", metavar="DIR", help="one or more QAT runs")
    parser.add_argument("--initial", default=None, metavar="DIR",
                        help="a run (e.g. main.py validate) evaluating the model before training; default: the baseline's step 0")
    parser.add_argument("--labels", nargs="+", default=None, help="names of the QAT runs (or baseline first, then the QAT runs)")
    parser.add_argument("--out", default="reports", metavar="DIR", help="output directory (default: reports)")
    parser.add_argument("--layers", nargs="+", default=None,
                        help="tensors for the a_hat-vs-amax figure: names (layers.10.mlp.down_proj[.input]) or regexes")
    parser.add_argument("--benchmarks", default=None, metavar="REGEX", help="only benchmark metrics matching REGEX")
    parser.add_argument("--ape-from-step", type=int, default=0, help="APE over common steps >= this (default 0: all)")
    parser.add_argument("--force", action="store_true", help="report runs whose configs or steps do not match (with a warning)")
    parser.add_argument("--resamples", type=int, default=stats.DEFAULT_RESAMPLES, help="bootstrap resamples (default 10000)")
    parser.add_argument("--seed", type=int, default=stats.DEFAULT_SEED, help="bootstrap seed (default 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = build_report(args.baseline, args.qat, args.out, args.labels, args.layers, args.benchmarks,
                              args.ape_from_step, args.initial, args.force, args.resamples, args.seed)
    except (ReportError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    print(report["markdown"])
    print(f"wrote {', '.join(report['files'])} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
