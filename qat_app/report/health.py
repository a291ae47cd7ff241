"""The report's what-if and numeric-health tables: what the other amax estimators would have clipped, and which
quantized tensors lose the most precision (the figures are defined in :mod:`qat_app.hif8.health`).

Read from what :class:`callbacks.saturation.AmaxSaturationCallback` wrote:

- **what-if**, per estimator of :data:`~qat_app.hif8.health.WHATIF_ALGOS`: the elements its scale would have clipped
  (summed over tensors and steps) and the saturation events (tensor-steps with >= 1 such element, the real counter's
  definition), next to the real counter. From ``saturation_summary.json``'s ``whatif`` totals, else the sums of the
  per-step ``whatif/<algo>/clipped|events`` columns of metrics.csv. To first order only: every estimator is measured
  on the trajectory trained with the run's own estimator.
- **health**, per tensor: its worst SQNR and the step of it, and its figures at its last logged step (SQNR,
  underflow, outlier factor, precision tiers). From the summary's per-tensor ``health`` (and ``health_worst``), else
  the ``health/<tensor>/<figure>`` columns; per run: the min SQNR, the underflow fraction over all tensors, the
  largest outlier factor.

A run written before these keys existed has neither: its entry is ``{"recorded": False, "note": ...}`` and the
tables say "not recorded".
"""

from __future__ import annotations

import math
import re

from ..hif8.fallback import pending_verification
from ..hif8.fallback_summary import summary_lines as fallback_lines
from ..hif8.health import TIERS, WHATIF_ALGOS
from ..hif8.operand import Operand
from ..hif8.recipe import DEFAULT_BLOCK_PATTERN
from .runs import METRICS_FILE, SUMMARY_FILE, Run, fmt, natural_key

# the per-tensor figures of qat_app.hif8.health.summarize, as logged under health/<tensor>/
TIER_FIGURES = tuple(f"tier/{tier}" for tier in TIERS)
TENSOR_FIGURES = ("sqnr_db", "underflow_frac", "outlier_factor", *TIER_FIGURES)
RUN_MIN_SQNR = "health/min_sqnr_db"  # over the tensors of one logged step
RUN_UNDERFLOW = "health/underflow_frac"  # underflowed elements of all tensors over their elements, one logged step
REAL_CLIPPED, REAL_EVENTS = "sat/clipped", "sat/events"  # the real counter, per step
WHATIF_COUNTS = ("clipped", "events")
TOP_TENSORS = 10  # rows of the worst-tensor table in results.md (results.json keeps every tensor)
NOT_RECORDED = "not recorded"
# module names in a decoder block's forward order: orders the tensors of a run without a summary (which lists them in
# the model's order); other names follow by name
FORWARD_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
WHATIF_CAVEAT = ("to first order: each estimator is measured on the tensors and amax history of the trajectory "
                 "actually trained with the run's own estimator, not on the one it would have led to")


def whatif_column(algo: str, count: str) -> str:
    return f"whatif/{algo}/{count}"


def health_column(tensor: str, figure: str) -> str:
    return f"health/{tensor}/{figure}"


def estimator_used(run: Run) -> str | None:
    """The amax estimator the run quantized with (its config's ``model.quant.amax_algo``); None without a config."""
    algo = run.setting("model.quant.amax_algo")
    return str(algo) if algo is not None else None


def _csv_total(run: Run, column: str) -> int:
    return int(round(sum(v for v in run.series(column).values() if math.isfinite(v))))


# ----------------------------------------------------------------------------------------------- what-if
def whatif_stats(run: Run) -> dict:
    """The what-if totals per estimator with the real counter's, from the summary or else from metrics.csv."""
    summary = run.summary or {}
    recorded = summary.get("whatif")
    if isinstance(recorded, dict) and recorded:
        estimators = {algo: {count: int(recorded[algo].get(count) or 0) for count in WHATIF_COUNTS}
                      for algo in WHATIF_ALGOS if isinstance(recorded.get(algo), dict)}
        real = {"clipped": int(summary["clipped"]), "events": int(summary["saturation_events"])}
        source = SUMMARY_FILE  # a file name, not its path: a report's numbers do not depend on where the run lives
    elif any(whatif_column(algo, "clipped") in run.columns for algo in WHATIF_ALGOS):
        estimators = {algo: {count: _csv_total(run, whatif_column(algo, count)) for count in WHATIF_COUNTS}
                      for algo in WHATIF_ALGOS if whatif_column(algo, "clipped") in run.columns}
        real = {"clipped": _csv_total(run, REAL_CLIPPED), "events": _csv_total(run, REAL_EVENTS)}
        source = f"{METRICS_FILE} (sums of the per-step whatif/<estimator>/clipped|events columns)"
    else:
        return {"recorded": False, "note": f"{NOT_RECORDED} (no whatif/* columns in {METRICS_FILE} and no 'whatif' "
                                           f"in {SUMMARY_FILE}: a run made before the what-if statistics existed)"}
    used = estimator_used(run)
    # the estimator the scaler ran counts what the real counter counts: a difference means mismatched inputs
    matches = estimators[used] == real if used in estimators else None
    return {"recorded": True, "estimator_used": used, "estimators": estimators, "real": real,
            "used_matches_real": matches, "source": source, "caveat": WHATIF_CAVEAT}


def cumulative(series: dict[int, float]) -> dict[int, float]:
    """step -> the running sum of a per-step count (non-finite steps add nothing)."""
    total, out = 0.0, {}
    for step, value in sorted(series.items()):
        total += value if math.isfinite(value) else 0.0
        out[step] = total
    return out


# ----------------------------------------------------------------------------------------------- health
def _tensor_entry(worst_db, worst_step, last: dict | None, unquantized_since: int | None = None) -> dict:
    return {"worst_sqnr_db": worst_db, "worst_sqnr_step": worst_step, "last": last,
            "unquantized_since": unquantized_since}


def _health_from_summary(summary: dict) -> dict[str, dict]:
    """tensor -> entry, from the summary's per-tensor ``health`` and its ``health_worst`` list (either may be absent)."""
    entries: dict[str, dict] = {}
    for name, tensor in (summary.get("tensors") or {}).items():
        health = tensor.get("health") if isinstance(tensor, dict) else None
        if isinstance(health, dict) and health.get("last"):
            entries[name] = _tensor_entry(health.get("worst_sqnr_db"), health.get("worst_sqnr_step"), health["last"],
                                          health.get("unquantized_since"))  # a fallback to high precision
    for item in summary.get("health_worst") or []:
        if isinstance(item, dict) and item.get("tensor") and item["tensor"] not in entries:
            entries[item["tensor"]] = _tensor_entry(item.get("worst_sqnr_db"), item.get("step"), item.get("last"))
    return entries


def health_tensors_in_csv(run: Run) -> list[str]:
    """Tensors with a ``health/<tensor>/<figure>`` column."""
    names = set()
    for column in run.columns:
        if column.startswith("health/"):
            for figure in TENSOR_FIGURES:
                if column.endswith("/" + figure) and column.count("/") > figure.count("/") + 1:
                    names.add(column[len("health/"):-len(figure) - 1])
    return sorted(names, key=natural_key)


def _health_from_csv(run: Run) -> dict[str, dict]:
    entries = {}
    for name in health_tensors_in_csv(run):
        series = {figure: run.series(health_column(name, figure)) for figure in TENSOR_FIGURES}
        last_step = max(step for values in series.values() for step in values)
        last = {"step": last_step, **{figure: values.get(last_step) for figure, values in series.items()}}
        sqnr = {s: v for s, v in series["sqnr_db"].items() if math.isfinite(v)}
        worst_step = min(sqnr, key=lambda s: (sqnr[s], s)) if sqnr else None
        entries[name] = _tensor_entry(sqnr[worst_step] if sqnr else None, worst_step, last)
    return entries


def worst_first(entries: dict[str, dict]) -> list[dict]:
    """Tensors by their worst SQNR, lowest first; those without a finite one (quantized without error) last."""
    def key(name):
        db = entries[name]["worst_sqnr_db"]
        finite = isinstance(db, (int, float)) and math.isfinite(db)
        return (not finite, db if finite else 0.0, natural_key(name))

    return [{"tensor": name, **entries[name]} for name in sorted(entries, key=key)]


def health_stats(run: Run) -> dict:
    """Per tensor (worst SQNR first) and per run: min SQNR, underflow, outlier factor; ``recorded`` False for a
    run that logged no health."""
    entries = _health_from_summary(run.summary or {})
    source = SUMMARY_FILE
    if not entries:
        entries, source = _health_from_csv(run), f"{METRICS_FILE} (health/<tensor>/<figure> columns)"
    if not entries:
        return {"recorded": False, "note": f"{NOT_RECORDED} (no health/* columns in {METRICS_FILE} and no 'health' in "
                                           f"{SUMMARY_FILE}: a run made before the health figures existed, or "
                                           "saturation.health=false)"}
    tensors = worst_first(entries)
    worst = tensors[0] if isinstance(tensors[0]["worst_sqnr_db"], (int, float)) else None
    outliers = {t["tensor"]: t["last"].get("outlier_factor") for t in tensors if t["last"]}
    outliers = {name: v for name, v in outliers.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    underflow = run.series(RUN_UNDERFLOW)
    steps = sorted({s for column in (RUN_MIN_SQNR, RUN_UNDERFLOW) for s in run.series(column)})
    max_underflow_step = max(underflow, key=lambda s: (underflow[s], -s)) if underflow else None
    largest = max(outliers, key=outliers.get) if outliers else None
    return {
        "recorded": True, "source": source, "tensors": tensors,
        "min_sqnr_db": (worst or {}).get("worst_sqnr_db"), "min_sqnr_step": (worst or {}).get("worst_sqnr_step"),
        "min_sqnr_tensor": (worst or {}).get("tensor"),
        "underflow_frac": underflow[max(underflow)] if underflow else None,
        "underflow_frac_step": max(underflow) if underflow else None,
        "max_underflow_frac": underflow[max_underflow_step] if underflow else None,
        "max_underflow_frac_step": max_underflow_step,
        "max_outlier_factor": outliers[largest] if largest else None, "max_outlier_tensor": largest,
        "logged_steps": len(steps) or None,
    }


def _block_regex(run: Run) -> re.Pattern:
    return re.compile(str(run.setting("model.quant.block_pattern", DEFAULT_BLOCK_PATTERN)))


def _block_and_kind(block_regex: re.Pattern, name: str) -> tuple[int | None, str]:
    found = block_regex.search(name + ".")
    if found is None or found.end() > len(name):
        return None, name
    return int(found.group(1)), name[found.end():]


def module_kind(run: Run, tensor: str) -> tuple[int | None, str]:
    """(decoder block, the tensor's name inside its block: ``mlp.down_proj.input``); block None outside the blocks."""
    return _block_and_kind(_block_regex(run), tensor)


def tensor_order(run: Run, names: list[str]) -> list[str]:
    """Tensors by decoder block, then module in the model's order (the summary's, else :data:`FORWARD_ORDER`, then
    by name), then operand (input, weight, grad); tensors outside the blocks last."""
    block_regex = _block_regex(run)
    operand_rank = {operand: i for i, operand in enumerate(Operand)}

    def split(name: str) -> tuple[int | None, str, Operand | None]:
        module, operand = Operand.of_tensor(name)
        return (*_block_and_kind(block_regex, module), operand)

    in_model_order = [split(name)[1] for name in (run.summary or {}).get("tensors") or {}]
    def forward_rank(kind: str):
        last = kind.rsplit(".", 1)[-1]
        return (FORWARD_ORDER.index(last) if last in FORWARD_ORDER else len(FORWARD_ORDER), natural_key(kind))

    kinds = list(dict.fromkeys(in_model_order + sorted((split(n)[1] for n in names), key=forward_rank)))

    def key(name: str):
        block, kind, operand = split(name)
        return (block is None, block or 0, kinds.index(kind), operand_rank.get(operand, len(operand_rank)), natural_key(name))

    return sorted(names, key=key)


# ----------------------------------------------------------------------------------------------- tables
def _vs_real(clipped: int, real: int) -> str:
    difference = clipped - real
    ratio = f" ({clipped / real:.3g}×)" if real else ""
    return "= real" if difference == 0 else f"{difference:+,d}{ratio}"


def render_whatif(results: list[dict]) -> list[str]:
    """Markdown lines: one row per (QAT run, estimator), the run's own estimator first."""
    lines = ["", "## What-if: the other amax estimators on the same tensors", "",
             f"Clipped elements each estimator's scale would have clipped, summed over tensors and steps; saturation "
             f"events = tensor-steps with ≥ 1 clipped element (as for the real clipping). {WHATIF_CAVEAT.capitalize()} "
             "(another estimator would have trained a slightly different model). *used*: the run's own estimator, whose "
             "numbers are the real ones. Figure: whatif_clipped.png (cumulative clipped elements per estimator).", "",
             "| run | estimator | clipped elements | saturation events | clipped vs real |", "|---|---|---:|---:|---:|"]
    for r in results:
        w = r.get("whatif") or {"recorded": False, "note": NOT_RECORDED}
        if not w["recorded"]:
            lines.append(f"| `{r['label']}` | {w['note']} | – | – | – |")
            continue
        used = w["estimator_used"]
        real = w["real"]
        order = ([used] if used in w["estimators"] else []) + [a for a in w["estimators"] if a != used]
        for algo in order:
            counts = w["estimators"][algo]
            name = f"`{algo}` (used)" if algo == used else f"`{algo}`"
            lines.append(f"| `{r['label']}` | {name} | {counts['clipped']:,d} | {counts['events']:,d} | "
                         f"{_vs_real(counts['clipped'], real['clipped'])} |")
        lines.append(f"| `{r['label']}` | real: what the run clipped (sat/clipped) | {real['clipped']:,d} | "
                     f"{real['events']:,d} | |")
    for r in results:
        w = r.get("whatif") or {}
        if w.get("recorded") and w["used_matches_real"] is False:
            own, real = w["estimators"][w["estimator_used"]], w["real"]
            lines.append(f"\n> **note:** `{r['label']}`: its own estimator `{w['estimator_used']}` gives {own['clipped']:,d} "
                         f"clipped / {own['events']:,d} events, but the run clipped {real['clipped']:,d} / "
                         f"{real['events']:,d} ({w['source']}): the two should be equal")
        elif w.get("recorded") and w["estimator_used"] is None:
            lines.append(f"\n`{r['label']}`: no config.yaml, so the estimator it used is not known.")
    return lines


def _tiers_cell(last: dict | None) -> str:
    if not last:
        return "–"
    return " / ".join(fmt(None if last.get(f) is None else 100 * last[f], ".1f") for f in TIER_FIGURES)


def _last_sqnr_cell(last: dict, unquantized_since: int | None) -> str:
    """The last 8-bit SQNR; for an operand that fell back to high precision, said so: it has no 8-bit error since."""
    value = fmt(last.get("sqnr_db"), ".2f")
    return value if unquantized_since is None else f"{value} (high precision after step {unquantized_since})"


def render_health(results: list[dict], top: int = TOP_TENSORS) -> list[str]:
    """Markdown lines: the run-level figures side by side, then each run's worst tensors by SQNR."""
    tier_names = " / ".join(TIERS)
    lines = ["", "## Numeric health", "",
             "Measured on the logged steps (every `log_every_n_steps`) on each quantized tensor: SQNR = 10 log10(Σx² / "
             "Σ(x − dequantized)²) in dB (higher is better; each halving of the error adds 6 dB); underflow = non-zero "
             "elements quantized to 0, over all elements; outlier factor = amax / p99.9(|x|) (at most 12.5 % high); "
             f"tiers: % of elements by the mantissa bits of their quantized value ({tier_names}). "
             "Figures: sqnr_heatmap.png (SQNR per tensor and step), precision_tiers.png (tier fractions at the last "
             "logged step).", "",
             "| | " + " | ".join(f"`{r['label']}`" for r in results) + " |", "|---|" + "---:|" * len(results)]

    def at(value, spec: str, where: str) -> str:  # "value (where)", or "–" without a value
        return "–" if value is None else f"{fmt(value, spec)} ({where})"

    run_rows = {
        "min SQNR (dB)": lambda h: at(h["min_sqnr_db"], ".2f", f"step {h['min_sqnr_step']}, `{h['min_sqnr_tensor']}`"),
        "underflow fraction, last logged step": lambda h: fmt(h["underflow_frac"], ".3e"),
        "max underflow fraction": lambda h: at(h["max_underflow_frac"], ".3e", f"step {h['max_underflow_frac_step']}"),
        "max outlier factor, last logged": lambda h: at(h["max_outlier_factor"], ".3g", f"`{h['max_outlier_tensor']}`"),
        "tensors measured": lambda h: str(len(h["tensors"])),
    }
    healths = [r.get("health") or {"recorded": False} for r in results]
    for title, cell in run_rows.items():
        lines.append(f"| {title} | " + " | ".join(cell(h) if h["recorded"] else NOT_RECORDED for h in healths) + " |")
    for r in results:
        h = r.get("health") or {"recorded": False}
        if not h["recorded"]:
            lines.append(f"\n`{r['label']}`: numeric health {h.get('note', NOT_RECORDED)}.")
            continue
        shown = h["tensors"][:top]
        lines += ["", f"### `{r['label']}`: the {len(shown)} worst tensors by SQNR (of {len(h['tensors'])})", "",
                  f"| # | tensor | worst SQNR (dB) | at step | last SQNR (dB) | last underflow | last outlier factor | "
                  f"tiers % ({tier_names}) |", "|---:|---|---:|---:|---:|---:|---:|---|"]
        for rank, t in enumerate(shown, start=1):
            last = t["last"] or {}
            cells = [str(rank), f"`{t['tensor']}`", fmt(t["worst_sqnr_db"], ".2f"), fmt(t["worst_sqnr_step"], "d"),
                     _last_sqnr_cell(last, t.get("unquantized_since")), fmt(last.get("underflow_frac"), ".2e"),
                     fmt(last.get("outlier_factor"), ".3g"), _tiers_cell(last)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_headroom(results: list[dict]) -> list[str]:
    """Markdown lines: per QAT run, the what-if headroom of its last measured step (:mod:`qat_app.hif8.headroom`):
    the mean estimated SQNR per operand at each max_val, the suggestion and whether it is beyond the estimate's
    error (or one line: no run recorded it)."""
    from ..hif8.headroom import ACCURACY_DB

    runs = [(r["label"], h) for r in results if isinstance(h := (r.get("saturation") or {}).get("headroom"), dict)]
    lines = ["", "## What-if headroom (max_val)", ""]
    if not runs:
        return lines + [f"{NOT_RECORDED} (saturation.headroom: measured with the health figures, by runs made since)."]
    lines.append("Each tensor's SQNR at other `max_val` settings (same a_hat), estimated from its |x| histogram at the last "
                 f"measured step; within {ACCURACY_DB} dB of exact recomputation on the tests' tensors, with a bound that "
                 "holds for any tensor (`saturation_summary.json`). To first order, on this run's trajectory; an SQNR "
                 "gain is not a loss or benchmark gain.")
    for label, h in runs:
        grid = h["grid"]
        lines += ["", f"### `{label}` (step {h.get('step')}): suggested max_val {fmt(h['suggested'].get('all'), 'g')}, "
                      f"{fmt(h.get('gain_db'), '+.2f')} dB estimated, "
                      + ("beyond" if h.get("significant") else "inside") + " the estimate's error", "",
                  "| operand | " + " | ".join(f"{m:g}" for m in grid) + " | suggested | gain (dB) |",
                  "|---|" + "---:|" * (len(grid) + 2)]
        for operand, entry in h.get("by_operand", {}).items():
            cells = [fmt(v, ".2f") for v in entry["sqnr_db"]]
            lines.append(f"| {operand} (run: {entry['run_max_val']:g}) | " + " | ".join(cells)
                         + f" | {fmt(entry.get('suggested'), 'g')} | {fmt(entry.get('gain_db'), '+.2f')} |")
        if h.get("by_block"):
            lines += ["", "Per block (mean estimated SQNR in dB over its quantized tensors):", "",
                      "| block | " + " | ".join(f"{m:g}" for m in grid) + " |", "|---:|" + "---:|" * len(grid)]
            lines += [f"| {block} | " + " | ".join(fmt(v, ".2f") for v in entry["sqnr_db"]) + " |"
                      for block, entry in h["by_block"].items()]
    return lines + headroom_crosscheck_lines(runs)


def headroom_crosscheck(runs: list[tuple[str, dict]]) -> list[dict]:
    """Each run's estimate at each *other* run's max_val (one for all its operands, in its grid) against what that run
    measured at the same step: mean SQNR over the tensors (estimate, bound: the mean of the per-tensor bounds) and
    clipped elements (estimate and bound, summed)."""
    rows = []
    for label, predictor in runs:
        grid, tensors = predictor["grid"], predictor.get("tensors") or {}
        for other, measured in runs:
            values = set((measured.get("run_max_val") or {}).values())
            if other == label or len(values) != 1 or not measured.get("measured") or next(iter(values)) not in grid:
                continue
            m = next(iter(values))
            j = grid.index(m)

            def mean(key):  # None (not finite) anywhere: an upper bound is then infinite, an estimate undefined
                values = [t[key][j] for t in tensors.values()]
                return None if not values or None in values else sum(values) / len(values)

            def total(key):
                return sum(t[key][j] for t in tensors.values())

            rows.append({"predictor": label, "run": other, "max_val": m, "step": predictor.get("step"),
                         "measured_step": measured.get("step"), "sqnr_db": mean("sqnr_db"),
                         "sqnr_db_low": mean("sqnr_db_low"), "sqnr_db_high": mean("sqnr_db_high"),
                         "measured_sqnr_db": measured["measured"]["sqnr_db"], "clipped": total("clipped"),
                         "clipped_low": total("clipped_low"), "clipped_high": total("clipped_high"),
                         "measured_clipped": measured["measured"]["clipped"]})
    return rows


def headroom_crosscheck_lines(runs: list[tuple[str, dict]]) -> list[str]:
    rows = headroom_crosscheck(runs)
    if not rows:
        return []
    lines = ["", "### One run's estimate against the runs made at other max_val settings", "",
             "The predicting run's tensors at its last measured step, the other run's at its own (the same step of the "
             "same schedule, another trajectory: the estimate is to first order); the bound is exact only for the "
             "predicting run's own tensors.", "",
             "| predicted by | run | max_val | est. mean SQNR (dB) [bound] | measured | est. clipped [bound] | measured |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['predictor']}` | `{r['run']}` | {r['max_val']:g} | {fmt(r['sqnr_db'], '.2f')} "
                     f"[{fmt(r['sqnr_db_low'], '.2f')}, {fmt(r['sqnr_db_high'], '.2f')}] | "
                     f"{fmt(r['measured_sqnr_db'], '.2f')} | {r['clipped']:.1f} [{r['clipped_low']:.0f}, "
                     f"{r['clipped_high']:.0f}] | {r['measured_clipped']} |")
    return lines


def render_forecast(results: list[dict]) -> list[str]:
    """Markdown lines: per QAT run, the saturation forecast scored against what happened (:mod:`qat_app.hif8.forecast`;
    the warnings themselves are in saturation_summary.json), or one line: no run recorded it."""
    runs = [(r["label"], f) for r in results if isinstance(f := (r.get("saturation") or {}).get("forecast"), dict)]
    lines = ["", "## Saturation forecast", ""]
    if not runs:
        return lines + [f"{NOT_RECORDED} (saturation.forecast: by runs made since it existed)."]
    lines += ["Each tensor's headroom a_hat / amax, fitted over its recent steps (Theil-Sen) and extrapolated to the clip "
              "line: a warning when that is within the horizon. Hit: it clipped while warned (lead: steps ahead); false "
              "alarm: its horizon ran out without a clip; open at the end: the run ended within it; miss: a first clip "
              "nobody forecast (a spike with no trend is one by construction).", "",
              "| run | horizon (steps) | warnings | hits | false alarms | open at the end | clipped tensors | misses | "
              "lead steps |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, f in runs:
        leads = ", ".join(str(v) for v in f.get("lead_steps", [])) or "–"
        lines.append(f"| `{label}` | {f['horizon']} | {f['warnings']} | {f['hits']} | {f['false_alarms']} | "
                     f"{f.get('open_at_end', 0)} | {f['tensors_clipped']} | {f['misses']} | {leads} |")
    return lines


def render_fallback(results: list[dict]) -> list[str]:
    """Markdown lines: per QAT run the decisions grouped by symptom and remedy (with their verification and the
    budget's stop), then every tensor the fallback policy switched (or one line: none did)."""
    lines = ["", "## Automatic fallback", ""]
    decided = [(r["label"], d) for r in results for d in ((r.get("saturation") or {}).get("fallback") or [])]
    stops = [(r["label"], (r.get("saturation") or {}).get("fallback_stopped")) for r in results]
    if not decided and not any(stop for _, stop in stops):
        return lines + ["No tensor fell back (the policy is opt-in: `--fallback.enabled true`; "
                        "`saturation_summary.json` lists its decisions)."]
    lines += ["A tensor fell back, for the rest of its run, to the remedy of its symptom (`callbacks.fallback`): "
              "persistent saturation to `fallback.policy.on_saturation` (default current scaling), an SQNR under the "
              "floor to `on_low_sqnr` (high precision); the step is the one whose counters decided, and each decision "
              "was then verified (high precision: never quantized again; current scaling: no saturation event in the "
              "window after it). An export keeps it that way.", ""]
    for label, stop in stops:
        entries = [d for run, d in decided if run == label]
        if entries or stop:
            first, *rest = fallback_lines(entries, stop, prefix="", indent="")
            lines += [f"- `{label}`: {first}"] + [f"  - {line}" for line in rest]
    lines += ["", "| run | tensor | fell back to | at step | rule | evidence | verified |", "|---|---|---|---:|---|---|---|"]
    for label, d in decided:
        verified = d.get("verified")
        check = pending_verification(d) or (("worked" if verified["worked"] else "**did not work**")
                                            + f" (step {verified['step']}: {verified['text']})")
        lines.append(f"| `{label}` | `{d['tensor']}` | {d['target']} | {d['step']} | {d['reason']} | {d['evidence']} "
                     f"| {check} |")
    return lines


def health_scalars(result: dict) -> dict[str, object]:
    """results.csv scalars of one QAT run: what-if totals per estimator, the tensors that fell back, the run-level
    health figures."""
    out: dict[str, object] = {}
    w = result.get("whatif") or {}
    for algo, counts in (w.get("estimators") or {}).items():
        out.update({f"whatif_{algo}_{count}": counts[count] for count in WHATIF_COUNTS})
    out["fallback_tensors"] = len((result.get("saturation") or {}).get("fallback") or [])
    h = result.get("health") or {}
    if h.get("recorded"):
        out.update({f"health_{key}": h[key] for key in ("min_sqnr_db", "min_sqnr_step", "underflow_frac",
                                                        "max_underflow_frac", "max_outlier_factor")})
    return out
