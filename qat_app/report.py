"""The paper's results table and figures from your own runs' logs (nothing is re-run).

    python main.py report --baseline runs/bf16_baseline --qat runs/exp8 [runs/exp7 ...] \\
        [--labels BF16 exp8 exp7] [--out reports/exp8] [--layers layers.10.mlp.down_proj ...]
    python -m qat_app.report ...            (the same)

A run DIR is anything holding a Lightning ``CSVLogger`` output: a version directory
(``runs/x/logs/version_0``), the logger directory (``runs/x/logs``) or the run root (``runs/x``).
All ``metrics.csv`` of one run (several ``version_N``: a resumed fit, a separate ``main.py test``)
are merged, later versions winning on a step logged twice; ``saturation_summary.json`` (written by
``AmaxSaturationCallback`` at the end of fit) is taken from the latest version that has one.

Written to ``--out``:
  results.md    the table in the paper's form: per benchmark metric the baseline, each QAT run and
                its relative drop; training-loss APE over the common steps; saturation events and
                clipped fraction; final train / val loss
  results.csv   the same numbers, one row per (QAT run, metric); results.json everything
  loss_curves.png        train/loss of every run overlaid (+ val/loss), and the per-step relative error
  amax_vs_ahat.png       a_hat (the estimate a step was quantized with) vs the true amax, per selected
                         tensor; red crosses on the steps that clipped (per-tensor sat/.../clipped_frac > 0)
  saturation_heatmap.png clipped fraction per quantized tensor (rows) and logged step (columns)

Definitions:
  relative drop %  = (baseline - qat) / baseline * 100 for each benchmark metric (``val/<task>/<metric>``
                     or ``test/<task>/<metric>``, the value at the last step it was logged); positive =
                     QAT worse (for accuracy-like metrics).
  training-loss APE = mean over the common logged steps of |loss_qat - loss_base| / loss_base * 100
                     (the paper's "APE"), aligned on ``step``, from the ``train/loss`` rows (several rows of
                     one step are averaged; non-finite losses are skipped).
  saturation events = number of (tensor, optimizer step) pairs with >= 1 clipped element: the
                     ``saturation_events`` total of saturation_summary.json, else the sum of the per-step
                     ``sat/events`` column.
  clipped fraction  = total clipped / total seen elements (summary file); from the CSV alone, the mean of
                     the per-step ``sat/clipped_frac``, which is the same when every step sees the same
                     number of elements (fixed batch shape).
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

from .errors import QATError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "saturation_summary.json"
FIGURES = ("loss_curves.png", "amax_vs_ahat.png", "saturation_heatmap.png")
BENCHMARK_RE = re.compile(r"^(val|test)/[^/]+/.+$")
MAIN_TABLE_RE = re.compile(r"^(val|test)/[^/]+/[^/]+$")  # split/task/metric (per-subject keys: CSV only)
_VERSION_RE = re.compile(r"^version_(\d+)$")


class ReportError(QATError, ValueError):
    """Bad report input; the message names the file."""


# ------------------------------------------------------------------------------------------- input
def _natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(text))]


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
        run_dir = f.parent.parent if _VERSION_RE.match(f.parent.name) else f.parent
        groups.setdefault(run_dir, []).append(f)
    if len(groups) > 1:
        listing = ", ".join(str(g) for g in groups)
        raise ReportError(f"{p}: holds several runs ({listing}); pass one of them")
    files = next(iter(groups.values()))
    return sorted(files, key=lambda f: _version_number(f.parent))


def _version_number(directory: Path) -> int:
    m = _VERSION_RE.match(directory.name)
    return int(m.group(1)) if m else -1


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
                if "step" not in row:
                    continue
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


@dataclass
class Run:
    label: str
    path: Path
    files: list[Path]
    rows: list[list[dict[str, float]]]  # per metrics file
    summary: dict | None = None
    summary_path: Path | None = None
    _columns: set[str] = field(default_factory=set)

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
        """The value at the last step ``key`` was logged (None if never)."""
        values = self.series(key)
        return values[max(values)] if values else None

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
    rows = [read_metrics(f) for f in files]
    summary = summary_path = None
    for f in reversed(files):
        candidate = f.parent / SUMMARY_FILE
        if candidate.is_file():
            summary, summary_path = read_summary(candidate), candidate
            break
    return Run(label or default_label(path), Path(path), files, rows, summary, summary_path)


def default_label(path: str | os.PathLike) -> str:
    p = Path(path).expanduser().absolute()
    if p.name == METRICS_FILE:
        p = p.parent
    parts = [part for part in p.parts if not _VERSION_RE.match(part) and part not in ("logs", "csv", "lightning_logs")]
    return parts[-1] if parts else str(path)


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


def saturation_stats(run: Run) -> dict | None:
    """events / clipped / seen / clipped_frac of a run (None when it has no quantized tensor)."""
    s = run.summary
    if s is not None and (s.get("quantized_tensors", 1) or s.get("seen")):
        seen = s.get("seen") or 0
        return {
            "events": int(s["saturation_events"]), "clipped": int(s["clipped"]), "seen": int(seen),
            "clipped_frac": s["clipped"] / seen if seen else 0.0, "source": str(run.summary_path),
        }
    events = run.series("sat/events")
    if not events:
        return None
    fracs = run.series("sat/clipped_frac")
    clipped = run.series("sat/clipped")
    return {
        "events": int(round(sum(events.values()))),
        "clipped": int(round(sum(clipped.values()))),
        "seen": None,
        "clipped_frac": sum(fracs.values()) / len(fracs) if fracs else math.nan,
        "source": "metrics.csv (mean of per-step sat/clipped_frac)",
    }


def benchmark_keys(runs: Iterable[Run], pattern: str | None = None) -> list[str]:
    regex = re.compile(pattern) if pattern else None
    keys = {k for run in runs for k in run.columns if BENCHMARK_RE.match(k)}
    if regex is not None:
        keys = {k for k in keys if regex.search(k)}
    return sorted(keys, key=_natural_key)


def compare(baseline: Run, qat: Run, keys: list[str], ape_from_step: int = 0) -> dict:
    """All numbers of one QAT run against the baseline."""
    benchmarks = []
    for key in keys:
        b, q = baseline.last(key), qat.last(key)
        benchmarks.append({"metric": key, "baseline": b, "qat": q, "relative_drop_pct": relative_drop(b, q)})
    main_drops = [r["relative_drop_pct"] for r in benchmarks if MAIN_TABLE_RE.match(r["metric"]) and math.isfinite(r["relative_drop_pct"])]
    ape, n = loss_ape(baseline.train_loss(), qat.train_loss(), ape_from_step)
    return {
        "label": qat.label,
        "path": str(qat.path),
        "benchmarks": benchmarks,
        "mean_relative_drop_pct": sum(main_drops) / len(main_drops) if main_drops else math.nan,
        "train_loss_ape_pct": ape,
        "ape_common_steps": n,
        "final_train_loss": _last(qat.train_loss()),
        "final_val_loss": qat.last("val/loss"),
        "saturation": saturation_stats(qat),
    }


# ----------------------------------------------------------------------------------------- output
def _fmt(value, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


def render_markdown(baseline: Run, results: list[dict], keys: list[str], ape_from_step: int) -> str:
    labels = [r["label"] for r in results]
    head = ["Metric", baseline.label] + [x for label in labels for x in (label, "Δ %")]
    lines = [
        "# HiF8 QAT vs BF16 baseline",
        "",
        f"Baseline: `{baseline.label}` ({baseline.path}); QAT: " + ", ".join(f"`{r['label']}` ({r['path']})" for r in results),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]

    def row(name: str, base_cell: str, cells: list[tuple[str, str]]) -> None:
        lines.append("| " + " | ".join([name, base_cell] + [c for pair in cells for c in pair]) + " |")

    table_keys = [k for k in keys if MAIN_TABLE_RE.match(k)]
    for key in table_keys:
        cells = []
        for r in results:
            b = next(x for x in r["benchmarks"] if x["metric"] == key)
            cells.append((_fmt(b["qat"]), _fmt(b["relative_drop_pct"], ".2f")))
        row(key, _fmt(baseline.last(key)), cells)
    if table_keys:
        row("**mean relative drop**", "", [("", _fmt(r["mean_relative_drop_pct"], ".2f")) for r in results])
    else:
        lines.append("| *no benchmark metrics (`val/<task>/<metric>`) logged* | | " + " | ".join("" for _ in range(2 * len(results))) + " |")
    since = f", steps >= {ape_from_step}" if ape_from_step else ""
    row(f"train-loss APE % (common steps{since})", "–",
        [(f"{_fmt(r['train_loss_ape_pct'], '.3f')} ({r['ape_common_steps']})", "") for r in results])
    row("final train loss", _fmt(_last(baseline.train_loss())),
        [(_fmt(r["final_train_loss"]), "") for r in results])
    if baseline.last("val/loss") is not None or any(r["final_val_loss"] is not None for r in results):
        row("final val loss", _fmt(baseline.last("val/loss")), [(_fmt(r["final_val_loss"]), "") for r in results])
    base_sat = saturation_stats(baseline)
    row("saturation events", str(base_sat["events"]) if base_sat else "–",
        [(str(r["saturation"]["events"]) if r["saturation"] else "–", "") for r in results])
    row("clipped fraction", _fmt(base_sat["clipped_frac"], ".3e") if base_sat else "–",
        [(_fmt(r["saturation"]["clipped_frac"], ".3e") if r["saturation"] else "–", "") for r in results])
    lines += [
        "",
        "Δ % = relative drop = (baseline − QAT) / baseline × 100 (positive: QAT worse). "
        "APE = mean over the common logged steps of |loss_QAT − loss_base| / loss_base × 100 "
        "(number of common steps in parentheses). Saturation events = (tensor, step) pairs with ≥ 1 clipped "
        "element; clipped fraction = clipped / seen elements.",
    ]
    extra = [k for k in keys if k not in table_keys]
    if extra:
        lines.append(f"{len(extra)} finer-grained metrics (e.g. `{extra[0]}`) are in results.csv only.")
    for r in results:
        if r["saturation"] and r["saturation"]["seen"] is None:
            lines.append(f"`{r['label']}`: no {SUMMARY_FILE}; saturation from the per-step CSV columns.")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, baseline: Run, results: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["qat_run", "metric", "baseline", "qat", "relative_drop_pct", "n"])

        def cell(v):
            return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else repr(v) if isinstance(v, float) else v

        for r in results:
            for b in r["benchmarks"]:
                w.writerow([r["label"], b["metric"], cell(b["baseline"]), cell(b["qat"]), cell(b["relative_drop_pct"]), ""])
            w.writerow([r["label"], "mean_relative_drop_pct", "", cell(r["mean_relative_drop_pct"]), "", ""])
            w.writerow([r["label"], "train_loss_ape_pct", "", cell(r["train_loss_ape_pct"]), "", r["ape_common_steps"]])
            w.writerow([r["label"], "final_train_loss", cell(_last(baseline.train_loss())), cell(r["final_train_loss"]), "", ""])
            w.writerow([r["label"], "final_val_loss", cell(baseline.last("val/loss")), cell(r["final_val_loss"]), "", ""])
            sat = r["saturation"] or {}
            for name in ("events", "clipped", "seen", "clipped_frac"):
                w.writerow([r["label"], f"saturation_{name}" if name != "clipped_frac" else "clipped_frac", "",
                            cell(sat.get(name)), "", ""])


# ---------------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curves(path: Path, baseline: Run, qats: list[Run], results: list[dict]) -> None:
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
        if i > 0:
            steps = sorted(s for s in set(base) & set(loss) if base[s] and math.isfinite(base[s]) and math.isfinite(loss[s]))
            if steps:
                ax_err.plot(steps, [abs(loss[s] - base[s]) / abs(base[s]) * 100 for s in steps], color=color, lw=1,
                            label=f"{run.label}: APE {results[i - 1]['train_loss_ape_pct']:.3f} %")
                ax_err.axhline(results[i - 1]["train_loss_ape_pct"], color=color, ls="--", lw=0.8)
    ax.set_ylabel("loss")
    ax.set_title("Training loss: QAT vs baseline")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_err.set_xlabel("step")
    ax_err.set_ylabel("|Δloss| / loss_base (%)")
    if ax_err.lines:
        ax_err.legend(fontsize=8)
    ax_err.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select_tensors(qats: list[Run], layers: list[str] | None, limit: int = 6) -> list[str]:
    """Tensors for the a_hat-vs-amax figure.

    Each ``--layers`` item is a tensor name (``layers.10.mlp.down_proj.input``), a layer name (its
    ``.input`` tensor) or a regular expression searched in the tensor names; a leading ``model.`` is
    ignored. Default: the input tensors of the first, middle and last quantized layer plus the most
    clipped tensor.
    """
    available: list[str] = []
    for run in qats:
        available += [t for t in run.tensors() if t not in available]
    available.sort(key=_natural_key)
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
                raise ReportError(
                    f"--layers {item!r} matches no logged tensor; logged tensors look like {available[:3] or 'none'}"
                )
            chosen += [m for m in matches if m not in chosen]
        return chosen[: max(limit, len(layers))]
    inputs = [t for t in available if t.endswith(".input")] or available
    if not inputs:
        return []
    picks = [inputs[0], inputs[len(inputs) // 2], inputs[-1]]
    worst, worst_value = None, 0.0
    for run in qats:
        for name, stats in ((run.summary or {}).get("tensors") or {}).items():
            if stats.get("clipped", 0) > worst_value and name in available:
                worst, worst_value = name, stats["clipped"]
    if worst is not None:
        picks.append(worst)
    return list(dict.fromkeys(picks))


def plot_amax(path: Path, qats: list[Run], tensors: list[str]) -> None:
    plt = _plt()
    n = max(1, len(tensors))
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    if not tensors:
        axes[0][0].text(0.5, 0.5, "no per-layer amax / a_hat logged\n(AmaxSaturationCallback per_layer=false, or no QAT run)",
                        ha="center", va="center", transform=axes[0][0].transAxes)
        axes[0][0].set_axis_off()
    for ax, tensor in zip(axes.flat, tensors):
        for i, run in enumerate(qats):
            amax, a_hat = run.series(f"amax/{tensor}"), run.series(f"a_hat/{tensor}")
            color = f"C{i}"
            if amax:
                ax.plot(list(amax), list(amax.values()), color=color, lw=1.2, label=f"{run.label} amax")
            if a_hat:
                ax.plot(list(a_hat), list(a_hat.values()), color=color, lw=1.2, ls="--", label=f"{run.label} a_hat")
            # steps that clipped: the logged per-tensor clipped fraction when there is one (it is 0 during
            # the BF16 warmup, when nothing is quantized), else amax > a_hat (|x| > a_hat clips: s = max_val/a_hat)
            clipped = run.series(f"sat/{tensor}/clipped_frac")
            if clipped:
                over = [s for s in amax if clipped.get(s, 0.0) > 0]
            else:
                over = [s for s in amax if s in a_hat and a_hat[s] > 0 and amax[s] > a_hat[s]]
            if over:
                ax.plot(over, [amax[s] for s in over], "x", color="red", ms=6,
                        label="step with clipped elements" if i == 0 else None)
        ax.set_title(tensor, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("|x| max")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("a_hat (estimate used) vs true amax")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmap(path: Path, qats: list[Run]) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _plt()
    data = []
    for run in qats:
        tensors = [t for t in run.tensors() if f"sat/{t}/clipped_frac" in run.columns]
        series = {t: run.series(f"sat/{t}/clipped_frac") for t in tensors}
        steps = sorted({s for values in series.values() for s in values})
        matrix = np.full((len(tensors), len(steps)), np.nan)
        index = {s: j for j, s in enumerate(steps)}
        for i, t in enumerate(tensors):
            for s, v in series[t].items():
                matrix[i, index[s]] = v
        data.append((run, tensors, steps, matrix))
    height = sum(min(14, 1.5 + 0.12 * max(1, len(t))) for _, t, _, _ in data) if data else 3
    fig, axes = plt.subplots(max(1, len(data)), 1, figsize=(10, max(3, height)), squeeze=False)
    positive = [m[m > 0] for _, _, _, m in data if m.size]
    positive = np.concatenate(positive) if positive else np.array([])
    norm = LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 10)) if positive.size else None
    for ax, (run, tensors, steps, matrix) in zip(axes.flat, data):
        if not tensors:
            ax.text(0.5, 0.5, f"{run.label}: no per-layer saturation logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        shown = np.ma.masked_where(~(matrix > 0), matrix)
        cmap = plt.get_cmap("magma_r").with_extremes(bad="#f2f2f2")
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                       extent=(-0.5, len(steps) - 0.5, len(tensors) - 0.5, -0.5))
        step_ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)
        ax.set_xticks(step_ticks)
        ax.set_xticklabels([str(steps[j]) for j in step_ticks])
        every = max(1, math.ceil(len(tensors) / 40))
        ax.set_yticks(range(0, len(tensors), every))
        ax.set_yticklabels(tensors[::every], fontsize=6)
        ax.set_xlabel("step")
        title = f"{run.label}: clipped fraction per tensor and step"
        if norm is None:
            title += " (no element clipped)"
        ax.set_title(title, fontsize=10)
        if norm is not None:
            fig.colorbar(im, ax=ax, label="clipped fraction (log)")
    if not data:
        axes[0][0].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ entry
def build_report(
    baseline_dir: str | os.PathLike,
    qat_dirs: list[str | os.PathLike],
    out_dir: str | os.PathLike,
    labels: list[str] | None = None,
    layers: list[str] | None = None,
    benchmarks: str | None = None,
    ape_from_step: int = 0,
) -> dict:
    """Write results.md / results.csv / results.json and the three figures; returns the numbers."""
    if not qat_dirs:
        raise ReportError("give at least one QAT run (--qat DIR)")
    labels = list(labels or [])
    if labels and len(labels) not in (len(qat_dirs), len(qat_dirs) + 1):
        raise ReportError(f"--labels: give {len(qat_dirs)} (QAT runs) or {len(qat_dirs) + 1} (baseline first) labels, got {len(labels)}")
    base_label = labels.pop(0) if len(labels) == len(qat_dirs) + 1 else "BF16 baseline"
    baseline = load_run(baseline_dir, base_label)
    qats = [load_run(d, labels[i] if labels else None) for i, d in enumerate(qat_dirs)]
    seen: dict[str, int] = {}
    for run in qats:  # unique labels
        if run.label in seen or run.label == baseline.label:
            seen[run.label] = seen.get(run.label, 1) + 1
            run.label = f"{run.label}#{seen[run.label]}"
        seen.setdefault(run.label, 1)
    for run in [baseline] + qats:
        if not run.train_loss():
            log.warning("%s: no train/loss rows in %s", run.label, ", ".join(map(str, run.files)))
    keys = benchmark_keys([baseline] + qats, benchmarks)
    results = [compare(baseline, run, keys, ape_from_step) for run in qats]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(baseline, results, keys, ape_from_step)
    (out / "results.md").write_text(markdown)
    write_csv(out / "results.csv", baseline, results)
    tensors = select_tensors(qats, layers)
    plot_loss_curves(out / FIGURES[0], baseline, qats, results)
    plot_amax(out / FIGURES[1], qats, tensors)
    plot_heatmap(out / FIGURES[2], qats)
    report = {
        "baseline": {"label": baseline.label, "path": str(baseline.path), "files": [str(f) for f in baseline.files],
                     "final_train_loss": _last(baseline.train_loss()), "final_val_loss": baseline.last("val/loss"),
                     "benchmarks": {k: baseline.last(k) for k in keys}},
        "qat": results,
        "ape_from_step": ape_from_step,
        "amax_tensors": tensors,
        "files": ["results.md", "results.csv", "results.json", *FIGURES],
    }
    (out / "results.json").write_text(json.dumps(report, indent=1, default=lambda v: None))
    report["markdown"] = markdown
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI; bad input exits with a message naming the file (SystemExit), success returns 0."""
    parser = argparse.ArgumentParser(
        prog="python main.py report",
        description="Paper-style table (benchmark drops, training-loss APE, saturation) and figures from run logs.",
    )
    parser.add_argument("--baseline", required=True, metavar="DIR", help="the matched BF16 baseline run")
    parser.add_argument("--qat", required=True, nargs="+", metavar="DIR", help="one or more QAT runs")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="names of the QAT runs (or baseline first, then the QAT runs)")
    parser.add_argument("--out", default="reports", metavar="DIR", help="output directory (default: reports)")
    parser.add_argument("--layers", nargs="+", default=None,
                        help="tensors for the a_hat-vs-amax figure: names (layers.10.mlp.down_proj[.input]) or regexes")
    parser.add_argument("--benchmarks", default=None, metavar="REGEX", help="only benchmark metrics matching REGEX")
    parser.add_argument("--ape-from-step", type=int, default=0, help="APE over common steps >= this (default 0: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = build_report(args.baseline, args.qat, args.out, args.labels, args.layers, args.benchmarks, args.ape_from_step)
    except (ReportError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    print(report["markdown"])
    print(f"wrote {', '.join(report['files'])} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
