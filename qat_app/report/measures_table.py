"""The continuous measures and answer flips of the report (:mod:`qat_app.eval.measures`), per task and comparison.

Next to the accuracy rows (which keep their bootstrap intervals), each benchmark task gets the registry's measures
compared over the examples both models evaluated: forgetting (initial -> baseline), quantization (baseline -> QAT)
and total (initial -> QAT): the mean difference (for a drift measure, the mean per-pair value), its standard error
clustered as the task's records say (MMLU: subject; HellaSwag: ``source_id``; ARC: each question alone), the normal
95 % interval, z, and a verdict (accuracy kind: ``worse`` / ``within noise`` / ``better`` against 0; drift kind:
``drift``, since a drift is > 0 for any changed model and needs a budget, not a test). Flips: right -> wrong and
wrong -> right with McNemar's exact p. ``acc`` / ``acc_norm`` stay in the accuracy table only (bootstrap interval,
McNemar p; results.json has their normal-interval rows too).
"""

from __future__ import annotations

from .. import stats
from ..eval.measures import MEASURES, MeasureError, cluster_field, compare_records, verdict
from .compare import COMPARISONS, Evaluation, is_main_metric
from .runs import ReportError, fmt

MEASURE_CSV_COLUMNS = ("se", "z", "n_clusters", "right_to_wrong", "wrong_to_right", "kind")
# shown in the accuracy table (bootstrap interval, McNemar p), so not repeated in the measures' table
IN_ACCURACY_TABLE = ("acc", "acc_norm")


def measure_tasks(keys: list[str]) -> dict[str, list[str]]:
    """``{split: [task, ...]}`` of the main benchmark keys (``<split>/<task>/acc|acc_norm``) being reported."""
    out: dict[str, dict[str, None]] = {}
    for key in filter(is_main_metric, keys):
        split, task, _ = key.split("/")
        out.setdefault(split, {})[task] = None  # an ordered set
    return {split: list(tasks) for split, tasks in out.items()}


def compare_measures(before: Evaluation | None, after: Evaluation, tasks: dict[str, list[str]],
                     level: float = stats.CONFIDENCE) -> dict:
    """``{"<split>/<task>": {"n": .., "clusters": .., "measures": {name: row}, "unavailable": {name: why}}}``
    for one comparison; a split without records on either side is ``{"note": why}``. Runs that evaluated a
    task on disjoint examples are refused (:class:`ReportError` naming both records files)."""
    if before is None:
        return {}
    out: dict = {}
    for split, names in tasks.items():
        missing = [e.missing.get(split, f"no records for {split}") for e in (before, after) if split not in e.records]
        if missing:
            out.update({f"{split}/{task}": {"note": missing[0]} for task in names})
            continue
        common = [t for t in names if any(k[0] == t for k in before.records[split])
                  and any(k[0] == t for k in after.records[split])]
        try:
            result = compare_records(before.records[split].values(), after.records[split].values(),
                                     level=level, tasks=common) if common else None
        except MeasureError as err:
            raise ReportError(f"{before.record_files[split]} ({before.source}) and {after.record_files[split]} "
                              f"({after.source}): {err}") from None
        for task in names:
            if task not in common:
                out[f"{split}/{task}"] = {"note": f"{task}: not in both runs' records"}
                continue
            out[f"{split}/{task}"] = {
                "n": result.n[task], "clusters": _clusters(task, result.get(task, {})),
                "measures": {name: _row(name, r) for name, r in result.get(task, {}).items()},
                "unavailable": result.unavailable.get(task, {})}
    return out


def _clusters(task: str, results: dict) -> str:
    field = cluster_field(task)
    any_result = next(iter(results.values()), None)
    if field is None or any_result is None or any_result.n_clusters == any_result.n:
        return "none (each example its own cluster)"
    if any_result.n_clusters < 2:
        return f"{field} (one cluster: unclustered SE)"
    return f"{field} ({any_result.n_clusters} clusters)"


def _row(name: str, r: stats.PairedResult) -> dict:
    m = MEASURES[name]
    return {"kind": m.kind, "from": r.before, "to": r.after, "difference": r.difference, "se": r.se, "z": r.z,
            "ci_low": r.low, "ci_high": r.high, "n": r.n, "n_clusters": r.n_clusters, "mcnemar_p": r.mcnemar_p,
            "right_to_wrong": r.right_to_wrong, "wrong_to_right": r.wrong_to_right,
            "verdict": "drift" if m.kind == "drift" else verdict(m, r), "note": r.note}


def _cell(row: dict | None) -> str:
    if row is None:
        return "–"
    text = f"{fmt(row['difference'], '+.4f')} [{fmt(row['ci_low'], '+.4f')}, {fmt(row['ci_high'], '+.4f')}]"
    text += f" z={fmt(row['z'], '+.1f')}"
    if row["right_to_wrong"] is not None:
        text += f", {row['right_to_wrong']} r→w / {row['wrong_to_right']} w→r, p={row['mcnemar_p']:.3g}"
    return f"{text} **{row['verdict']}**"


def has_measures(results: list[dict]) -> bool:
    """Whether any QAT run's comparisons hold a measure (not only notes: no records, no common task)."""
    return any(entry.get("measures") for r in results for table in (r.get("measures") or {}).values()
               for entry in (table or {}).values())


def render_measures(results: list[dict], labels: list[str], with_initial: bool) -> list[str]:
    """Markdown lines: one table per QAT run (task, measure, then a cell per comparison), notes below."""
    comps = [c for c in COMPARISONS if with_initial or c == "quantization"]
    lines = ["", "## Continuous measures and answer flips", "",
             "Paired over the examples both models evaluated: Δ = mean(after − before) (drift measures: the mean "
             "per-example value); [lo, hi] = normal 95% interval, mean ± 1.96 SE, the SE clustered (CR1; E. Miller, "
             "arXiv 2411.00640) by the clusters named per task; z = Δ / SE. Accuracy-type measures are tested "
             "against 0 (brier: lower is better); drift measures (kl_choices, flips) are ≥ 0 for any changed model: "
             "they need a budget, not a test. r→w / w→r: answer flips right → wrong / wrong → right, p = McNemar exact."]
    lines += [f"- `{m.name}` ({m.kind}): {m.description}" for m in MEASURES.values() if m.name not in IN_ACCURACY_TABLE]
    for label, result in zip(labels, results):
        tables = result.get("measures") or {}
        head = ["Task", "Measure", "n", "clusters"] + [f"{c} ({' → '.join(COMPARISONS[c]).replace('qat', 'QAT')})"
                                                          for c in comps]
        lines += ["", f"### `{label}`", "", "| " + " | ".join(head) + " |",
                  "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
        notes: dict[str, list[str]] = {}  # note -> comparisons
        for task in (tables.get("quantization") or {}):
            entries = {c: (tables.get(c) or {}).get(task) or {} for c in comps}
            q = entries["quantization"]
            for c, e in entries.items():
                for note in ([f"{task}: {e['note']}"] if "note" in e else []) + [
                        f"{task}: `{name}` n/a: {why}" for name, why in e.get("unavailable", {}).items()]:
                    notes.setdefault(note, []).append(c)
            for name in MEASURES:
                if name in IN_ACCURACY_TABLE or not any(name in e.get("measures", {}) for e in entries.values()):
                    continue
                n = q.get("n", (None,))[0]
                cells = [task, f"`{name}`", fmt(n, "d"), q.get("clusters", "–")]
                cells += [_cell(e.get("measures", {}).get(name)) for e in entries.values()]
                lines.append("| " + " | ".join(cells) + " |")
        lines += [""] * bool(notes) + [f"- {note} ({', '.join(where)})" for note, where in list(notes.items())[:20]]
    return lines


def csv_rows(result: dict) -> list[dict]:
    """results.csv rows (metric ``<split>/<task>/<measure>``) of one QAT run's measure comparisons."""
    rows = []
    for comparison, tables in (result.get("measures") or {}).items():
        for task, entry in (tables or {}).items():
            for name, row in entry.get("measures", {}).items():
                if name in IN_ACCURACY_TABLE:
                    continue
                rows.append({**row, "run": result["label"], "metric": f"{task}/{name}", "comparison": comparison})
    return rows
