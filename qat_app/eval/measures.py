"""Continuous per-example measures of the benchmark records, and their paired comparison between two models.

:data:`MEASURES` is the one registry of measure names, of two kinds: ``accuracy`` (one value per example and
model, compared as the paired mean difference against 0, the worse side set by ``higher_is_better``) and
``drift`` (one value per example from both models, >= 0, so judged against a budget); :func:`verdict` decides.
:func:`compare_records` pairs two lists of record rows by (task, doc_id, subject) and returns, per task and
measure, the mean difference with a standard error clustered by the records' ``cluster``, its interval and z
(for 0/1 measures also the answer flips and McNemar's p). Rows that lack a field still compare: the measures that
need it are named in ``unavailable``. numpy only, no torch.

See ``docs/reports.md`` for the measures and ``docs/diagnostics/forgetting.md`` for their use in the alarms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qat_app import stats
from qat_app.errors import QATError, did_you_mean

Row = Mapping[str, Any]


class MeasureError(QATError, ValueError):
    """A bad measure request: an unknown measure name or a level outside (0, 1)."""


class DisjointExamplesError(MeasureError):
    """Two evaluations to be paired share no example of a task (the message names the tasks)."""


@dataclass(frozen=True)
class Measure:
    """One measure: ``fn(row)`` (accuracy kind) or ``fn(before_row, after_row)`` (drift kind) -> float, or
    None when the row lacks what the measure needs (``needs``: the record fields beyond task/doc_id/gold/loglik)."""

    name: str
    kind: str  # "accuracy" | "drift"
    higher_is_better: bool  # drift measures: False (more drift is never better)
    fn: Callable[..., float | None]
    description: str
    needs: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------- per example
def _logliks(row: Row) -> list[float] | None:
    """The row's choice log-likelihoods when usable (a list of finite floats holding the gold index), else None.
    Plain Python on purpose: a few choices per example, where numpy's per-call overhead would dominate."""
    ll = row.get("loglik")
    gold = row.get("gold")
    if not ll or not isinstance(gold, int) or not 0 <= gold < len(ll):
        return None
    ll = [float(v) for v in ll]
    return ll if all(math.isfinite(v) for v in ll) else None


def _log_softmax(x: Sequence[float]) -> list[float]:
    top = max(x)
    lse = top + math.log(sum(math.exp(v - top) for v in x))
    return [v - lse for v in x]


def _lengths(row: Row, field: str, size: int) -> list[float] | None:
    lengths = row.get(field)
    if lengths is None or len(lengths) != size or not all(v > 0 for v in lengths):
        return None
    return [float(v) for v in lengths]


def _acc(row: Row) -> float | None:
    return float(row["acc"]) if row.get("acc") is not None else None


def _acc_norm(row: Row) -> float | None:
    return float(row["acc_norm"]) if row.get("acc_norm") is not None else None


def _p_gold(row: Row) -> float | None:
    ll = _logliks(row)
    return None if ll is None else math.exp(_log_softmax(ll)[row["gold"]])


def _p_gold_norm(row: Row) -> float | None:
    ll = _logliks(row)
    chars = None if ll is None else _lengths(row, "choice_chars", len(ll))
    return None if chars is None else math.exp(_log_softmax([v / c for v, c in zip(ll, chars)])[row["gold"]])


def _gold_loglik_per_byte(row: Row) -> float | None:
    ll = _logliks(row)
    size = None if ll is None else _lengths(row, "choice_bytes", len(ll))
    return None if size is None else ll[row["gold"]] / size[row["gold"]]


def _brier(row: Row) -> float | None:
    ll = _logliks(row)
    if ll is None:
        return None
    gold = row["gold"]
    return sum((math.exp(v) - (j == gold)) ** 2 for j, v in enumerate(_log_softmax(ll)))


def _kl_choices(before: Row, after: Row) -> float | None:
    lb, la = _logliks(before), _logliks(after)
    if lb is None or la is None or len(lb) != len(la):
        return None
    log_p, log_q = _log_softmax(lb), _log_softmax(la)
    return max(0.0, sum(math.exp(p) * (p - q) for p, q in zip(log_p, log_q)))


def _flip(metric: str) -> Callable[[Row, Row], float | None]:
    def flip(before: Row, after: Row) -> float | None:
        b, a = before.get(metric), after.get(metric)
        return None if b is None or a is None else float(int(b) != int(a))

    return flip


MEASURES: dict[str, Measure] = {m.name: m for m in (
    Measure("acc", "accuracy", True, _acc, "1 if the argmax of the summed choice log-likelihoods is the gold choice"),
    Measure("acc_norm", "accuracy", True, _acc_norm, "1 if the argmax of loglik / choice length in characters is gold"),
    Measure("p_gold", "accuracy", True, _p_gold, "probability of the gold choice: softmax over the raw choice logliks"),
    Measure("p_gold_norm", "accuracy", True, _p_gold_norm,
            "probability of the gold choice: softmax over loglik / choice length in characters", ("choice_chars",)),
    Measure("gold_loglik_per_byte", "accuracy", True, _gold_loglik_per_byte,
            "log-likelihood of the gold continuation per UTF-8 byte of the choice, in nats (lm-eval's bits-per-byte "
            "view, times ln 2)", ("choice_bytes",)),
    Measure("brier", "accuracy", False, _brier,
            "Brier score over the choices: sum_j (p_j - [j = gold])^2, raw softmax; lower is better"),
    Measure("kl_choices", "drift", False, _kl_choices,
            "KL(before || after) of the raw softmax choice distributions, in nats (>= 0: a drift, needs a budget)"),
    Measure("flips_acc", "drift", False, _flip("acc"),
            "answer flips of acc, both ways (right -> wrong and wrong -> right: McNemar's discordant pairs)"),
    Measure("flips_acc_norm", "drift", False, _flip("acc_norm"),
            "answer flips of acc_norm, both ways (right -> wrong and wrong -> right)"),
)}
MEASURE_NAMES: tuple[str, ...] = tuple(MEASURES)
_FLIPS_OF = {"flips_acc": "acc", "flips_acc_norm": "acc_norm"}


def resolve_measures(measures: Iterable[str] | str | None = None, where: str = "measures") -> tuple[Measure, ...]:
    """The :class:`Measure` of each name (all of them for None); an unknown name is a :class:`MeasureError`
    naming ``where`` (the setting) and the known names."""
    if measures is None:
        return tuple(MEASURES.values())
    names = [measures] if isinstance(measures, str) else list(measures)
    unknown = [name for name in names if name not in MEASURES]
    if unknown:
        raise MeasureError(f"{where}: unknown measure {unknown[0]!r}{did_you_mean(unknown[0], MEASURE_NAMES)}; "
                           f"known measures: {', '.join(MEASURE_NAMES)}")
    if not names:
        raise MeasureError(f"{where}: no measure given; known measures: {', '.join(MEASURE_NAMES)}")
    return tuple(MEASURES[name] for name in dict.fromkeys(names))


def example_values(rows: Iterable[Row], measure: str) -> list[float | None]:
    """The per-example values of an accuracy-kind ``measure`` over ``rows`` (None where a row lacks a field)."""
    (m,) = resolve_measures([measure])
    if m.kind != "accuracy":
        raise MeasureError(f"{measure}: a drift measure has values only for a pair of rows (compare_records)")
    return [m.fn(row) for row in rows]


def verdict(measure: str | Measure, result: stats.PairedResult | None, budget: float | None = None) -> str:
    """Accuracy kind: ``worse`` / ``better`` when the interval excludes 0 on that side (``higher_is_better``
    decides which side is worse), else ``within noise``. Drift kind: ``over budget`` when the whole interval lies
    above ``budget``, ``within budget`` otherwise, ``no budget`` without one. ``n/a`` without a finite interval."""
    m = measure if isinstance(measure, Measure) else resolve_measures([measure])[0]
    if result is None or not (math.isfinite(result.low) and math.isfinite(result.high)):
        return "n/a"
    if m.kind == "accuracy":
        return stats.verdict((result.low, result.high), higher_is_better=m.higher_is_better)
    if budget is None:
        return "no budget"
    return "over budget" if result.low > budget else "within budget"


# ----------------------------------------------------------------------------------------------- paired
def example_key(row: Row) -> tuple:
    """(task, doc_id, subject or ""): what identifies one example across evaluations."""
    return row["task"], row["doc_id"], row.get("subject") or ""


def cluster_of(row: Row):
    """The row's cluster: its ``cluster`` field; for rows written before it existed, the MMLU subject, else None
    (None: the example is its own cluster)."""
    return row["cluster"] if "cluster" in row else row.get("subject")


def cluster_field(task: str) -> str | None:
    """The doc field that clusters a task's examples (:attr:`~qat_app.eval.spec.TaskSpec.cluster_field`: MMLU
    ``subject``, HellaSwag ``source_id``); None for ARC and unknown tasks (each example its own cluster)."""
    from qat_app.eval.tasks import TASK_SPECS

    return getattr(TASK_SPECS.get(task), "cluster_field", None)


class MeasureComparison(dict):
    """``{task: {measure: PairedResult}}`` plus ``unavailable`` (``{task: {measure: why}}``: measures the records
    cannot give, e.g. rows written before ``choice_chars`` existed) and ``n`` (``{task: (paired, before, after)}``
    examples)."""

    def __init__(self):
        super().__init__()
        self.unavailable: dict[str, dict[str, str]] = {}
        self.n: dict[str, tuple[int, int, int]] = {}


def _index(rows: Iterable[Row], side: str) -> dict[str, dict[tuple, Row]]:
    out: dict[str, dict[tuple, Row]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "task" not in row or "doc_id" not in row:
            raise MeasureError(f"{side} row {i}: not a benchmark record (needs 'task' and 'doc_id')")
        out.setdefault(row["task"], {})[example_key(row)] = row
    return out


def _missing(measure: Measure, rows: Sequence[Row], side: str) -> str | None:
    lacking = [field for field in measure.needs if any(field not in row for row in rows)]
    return f"the {side} records have no {', '.join(lacking)} (written before it existed)" if lacking else None


def compare_records(before_rows: Iterable[Row], after_rows: Iterable[Row], measures: Iterable[str] | None = None,
                    level: float = stats.CONFIDENCE, tasks: Iterable[str] | None = None) -> MeasureComparison:
    """Per task and measure, the paired comparison of two evaluations' record rows (``before`` -> ``after``).

    Examples pair by (task, doc_id, subject); the examples both evaluated are compared (``n`` says how many of
    each). Accuracy measures: :func:`qat_app.stats.paired_difference` of the per-example values (for 0/1 ones
    with flips and McNemar's p); drift measures: the mean of the per-pair value with its interval
    (:func:`qat_app.stats.clustered_mean`; flips also count both directions). Standard errors cluster by each
    example's :func:`cluster_of`. ``tasks``: the tasks to compare (default: those both evaluated; a task only one
    side evaluated goes to ``unavailable``). A compared task with no example in common is refused
    (:class:`DisjointExamplesError`, naming the tasks), as is an unknown measure or a level outside (0, 1).
    """
    chosen = resolve_measures(measures)
    if not (isinstance(level, (int, float)) and 0.0 < level < 1.0):
        raise MeasureError(f"level: must lie in (0, 1), got {level!r}")
    before, after = _index(before_rows, "before"), _index(after_rows, "after")
    out = MeasureComparison()
    names = sorted(set(before) | set(after)) if tasks is None else list(dict.fromkeys(tasks))
    disjoint = []
    for task in names:
        b, a = before.get(task, {}), after.get(task, {})
        common = sorted(set(b) & set(a), key=lambda k: tuple(map(str, k)))
        out.n[task] = (len(common), len(b), len(a))
        if not common:
            if (b and a) or tasks is not None:
                disjoint.append(f"{task} ({len(b)} examples before, {len(a)} after, none in common)")
            else:
                side = "before" if b else "after"
                out.unavailable[task] = {m.name: f"only the {side} records evaluated {task}" for m in chosen}
            continue
        pairs = [(b[k], a[k]) for k in common]
        out[task], out.unavailable[task] = _compare_task(pairs, chosen, level)
        if not out.unavailable[task]:
            del out.unavailable[task]
    if disjoint:
        raise DisjointExamplesError("the two evaluations share no example of: " + "; ".join(disjoint)
                                    + " (were they run on the same benchmark selection: limit, seed, doc_ids?)")
    if not out:
        raise DisjointExamplesError(f"no task evaluated by both: before {sorted(before) or 'no records'}, "
                                    f"after {sorted(after) or 'no records'}")
    return out


def _compare_task(pairs: list[tuple[Row, Row]], chosen: Sequence[Measure], level: float):
    results: dict[str, stats.PairedResult] = {}
    unavailable: dict[str, str] = {}
    clusters = [cluster_of(b) for b, _ in pairs]
    for m in chosen:
        if m.kind == "accuracy":
            values = [(m.fn(b), m.fn(a)) for b, a in pairs]
        else:
            values = [(0.0, m.fn(b, a)) for b, a in pairs]
        keep = [i for i, (x, y) in enumerate(values) if x is not None and y is not None]
        if not keep:
            why = (_missing(m, [b for b, _ in pairs], "before") or _missing(m, [a for _, a in pairs], "after")
                   or "no pair has a value (choice logliks missing, non-finite or of different lengths)")
            unavailable[m.name] = why
            continue
        x = np.array([values[i][0] for i in keep])
        y = np.array([values[i][1] for i in keep])
        cl = [clusters[i] for i in keep]
        if m.kind == "accuracy":
            result = stats.paired_difference(x, y, cl, level)
        else:
            result = stats.clustered_mean(y, cl, level)
            if m.name in _FLIPS_OF:
                metric = _FLIPS_OF[m.name]
                b01 = np.array([float(pairs[i][0][metric]) for i in keep])
                a01 = np.array([float(pairs[i][1][metric]) for i in keep])
                counts = stats.discordant_pairs(b01, a01)
                if counts is not None:
                    result = replace(result, right_to_wrong=counts[0], wrong_to_right=counts[1],
                                     mcnemar_p=stats.mcnemar_exact_p(*counts))
        if len(keep) < len(pairs):
            left = f"{len(pairs) - len(keep)} of {len(pairs)} pairs left out (no value: fields missing or mismatched)"
            result = replace(result, note=f"{result.note}; {left}" if result.note else left)
        results[m.name] = result
    return results, unavailable
