"""Two lm-eval evaluations of the same documents, paired: per task and metric the mean difference with its 95 %
interval, a p-value and n, beside the noise floor of the W8A8 arithmetic.

lm-eval's per-sample logs (``log_samples``) carry each document's metric values, its ``doc_hash`` and its
``prompt_hash``. Documents are paired by ``(doc_id, filter)`` and must carry the same hashes on both sides (the
same document under the same prompt), else :class:`PairingError` names the task. A metric is paired when every
sample has a number for it (``acc``, ``acc_norm``, ``exact_match``, ...); corpus-level metrics whose per-sample
value is a tuple (``word_perplexity``, ``bleu``) are listed as not paired. For 0/1 metrics the p-value is McNemar's
exact test on the discordant pairs, else the normal test of the paired mean (:func:`qat_app.stats.paired_difference`).

The floor (:func:`floor_of`): the same model evaluated with its inputs perturbed at a float rounding's size
(:func:`qat_app.eval.noise_floor.perturbed_inputs`), paired against itself: the largest |bound| over the seeds is
how much the arithmetic alone moves each metric; a difference inside it is not evidence of a change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from .. import stats
from ..errors import QATError

Samples = Mapping[str, Sequence[Mapping]]  # task -> lm-eval's logged samples


class PairingError(QATError):
    """Two evaluations that did not score the same documents under the same prompts."""


@dataclass(frozen=True)
class PairedMetric:
    """One task's metric, paired: ``result.difference`` is mean(after) - mean(before) over ``result.n`` documents."""

    task: str
    metric: str
    filter: str
    result: stats.PairedResult
    p_value: float
    higher_is_better: bool | None
    floor: float | None = None  # the largest |bound| of the perturbed model against itself (None: not measured)

    @property
    def verdict(self) -> str:
        return verdict(self.result, self.higher_is_better is not False, self.floor)

    def to_dict(self) -> dict:
        return {"task": self.task, "metric": self.metric, "filter": self.filter, "p_value": self.p_value,
                "higher_is_better": self.higher_is_better, "noise_floor": self.floor, "verdict": self.verdict,
                **stats.jsonable(self.result)}


def verdict(result: stats.PairedResult, higher_is_better: bool = True, floor: float | None = None) -> str:
    """``worse`` / ``better`` (the interval excludes 0), else ``within noise``; a resolved difference whose
    interval lies inside the floor is ``inside the noise floor`` (the arithmetic alone moves it that far), one whose
    interval reaches into the floor is ``..., overlapping the noise floor``."""
    words = stats.verdict(result.interval, higher_is_better)
    if words in ("worse", "better") and floor is not None:
        if max(abs(result.low), abs(result.high)) <= floor:
            return "inside the noise floor"
        if min(abs(result.low), abs(result.high)) <= floor:
            return f"{words}, overlapping the noise floor"
    return words


def _number(value) -> float | None:
    # a bool is an int: True / False count as 1 / 0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def p_value(result: stats.PairedResult) -> float:
    """McNemar's exact p for 0/1 outcomes, else the two-sided normal p of z (1 for an exact 0 difference)."""
    if result.mcnemar_p is not None:
        return result.mcnemar_p
    if math.isnan(result.z):
        return math.nan
    return 2.0 * (1.0 - NormalDist().cdf(abs(result.z))) if math.isfinite(result.z) else 0.0


def _keyed(samples: Sequence[Mapping]) -> dict[tuple, Mapping]:
    return {(s["doc_id"], s.get("filter", "none")): s for s in samples}


def paired_values(task: str, before: Sequence[Mapping], after: Sequence[Mapping]) -> dict[tuple[str, str], tuple]:
    """{(metric, filter): (before values, after values)} over the documents both scored (checked identical)."""
    a, b = _keyed(before), _keyed(after)
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[:3]
        raise PairingError(f"{task}: the two evaluations scored different documents ({len(set(a) ^ set(b))} "
                           f"unpaired, e.g. {only}): run both with the same --limit")
    pairs: dict[tuple[str, str], tuple[list, list]] = {}
    skipped: set[tuple[str, str]] = set()
    for key in sorted(a, key=lambda k: (str(k[1]), k[0])):
        x, y = a[key], b[key]
        for field in ("doc_hash", "prompt_hash"):
            if x.get(field) != y.get(field):
                raise PairingError(f"{task}: document {key[0]} differs between the two evaluations ({field}): "
                                   "the same task under another prompt or data")
        for metric in x.get("metrics", ()):
            slot = (metric, key[1])
            u, v = _number(x.get(metric)), _number(y.get(metric))
            if u is None or v is None:
                skipped.add(slot)
                continue
            pairs.setdefault(slot, ([], []))
            pairs[slot][0].append(u)
            pairs[slot][1].append(v)
    return {slot: values for slot, values in pairs.items() if slot not in skipped}


def pair(before: Samples, after: Samples, higher_is_better: Mapping[str, Mapping[str, bool]] | None = None,
         floors: Mapping[tuple[str, str, str], float] | None = None) -> list[PairedMetric]:
    """Every (task, metric, filter) both evaluations logged, as a :class:`PairedMetric` (after - before)."""
    missing = sorted(set(before) ^ set(after))
    if missing:
        raise PairingError(f"the two evaluations ran different tasks ({', '.join(missing)} in one only)")
    rows = []
    for task in sorted(before):
        for (metric, filter_key), (u, v) in paired_values(task, before[task], after[task]).items():
            result = stats.paired_difference(u, v)
            better = (higher_is_better or {}).get(task, {}).get(metric)
            rows.append(PairedMetric(task, metric, filter_key, result, p_value(result), better,
                                     (floors or {}).get((task, metric, filter_key))))
    return rows


SUMMED = "summed over tasks"  # the task name of a floor of a metric summed over tasks


def _bound(result: stats.PairedResult) -> float:
    bound = max(abs(result.low), abs(result.high), abs(result.difference))
    return abs(result.difference) if math.isnan(bound) else bound


def floor_of(reference: Samples, perturbed_runs: Sequence[Samples]) -> dict[tuple[str, str, str], float]:
    """(task, metric, filter) -> the largest |bound| of the perturbed model against itself over the seeds; and
    (:data:`SUMMED`, metric, "all") -> the same of the metric summed over tasks (:func:`summed`)."""
    floors: dict[tuple[str, str, str], float] = {}
    for perturbed in perturbed_runs:
        rows = pair(reference, perturbed)
        for row in rows:
            key = (row.task, row.metric, row.filter)
            floors[key] = max(floors.get(key, 0.0), _bound(row.result))
        for metric in {row.metric for row in rows}:
            key = (SUMMED, metric, "all")
            floors[key] = max(floors.get(key, 0.0), _bound(summed(rows, metric)))
    return floors


def summed(rows: Sequence[PairedMetric], metric: str) -> stats.PairedResult | None:
    """The difference of ``metric`` summed over tasks (:func:`sum_of`); None when no task has the metric."""
    return sum_of([r.result for r in rows if r.metric == metric])


def sum_of(results: Sequence[stats.PairedResult]) -> stats.PairedResult | None:
    """Per-task mean differences added, with the standard error of the sum (the tasks' documents are independent:
    variances add) and its normal interval; None for no result."""
    if not results:
        return None
    total = sum(r.difference for r in results)
    se = math.sqrt(sum(r.se ** 2 for r in results if math.isfinite(r.se)))
    z_level = stats.normal_quantile(stats.CONFIDENCE)
    z = total / se if se > 0 else math.nan
    return stats.PairedResult(total, se, total - z_level * se, total + z_level * se, sum(r.n for r in results),
                              sum(r.n_clusters for r in results), z)


def _logliks(sample: Mapping) -> list[float] | None:
    """A log-likelihood sample's per-request log-likelihoods (lm-eval's ``resps``: ``[[(ll, is_greedy)], ...]``,
    strings once written), or None for another request type."""
    try:
        return [float(response[0][0]) for response in sample["resps"]]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def loglik_agreement(before: Samples, after: Samples) -> dict[str, dict]:
    """Per log-likelihood task: documents, requests, how many log-likelihoods are identical, the largest
    difference, and how many documents pick the same choice (argmax of the log-likelihood)."""
    rows = {}
    for task in sorted(set(before) & set(after)):
        a, b = _keyed(before[task]), _keyed(after[task])
        documents = requests = identical = same_choice = 0
        worst = 0.0
        for key in sorted(set(a) & set(b)):
            x, y = _logliks(a[key]), _logliks(b[key])
            if not x or not y or len(x) != len(y):
                continue
            documents += 1
            requests += len(x)
            identical += sum(u == v for u, v in zip(x, y))
            worst = max(worst, max(abs(u - v) for u, v in zip(x, y)))
            same_choice += max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__)
        if documents:
            rows[task] = {"documents": documents, "requests": requests, "identical": identical,
                          "max_abs_diff": worst, "same_choice": same_choice}
    return rows


def _continuations(sample: Mapping) -> list[str] | None:
    """The continuation strings of a log-likelihood sample's requests (in memory: argument tuples; written:
    ``{"gen_args_i": {"arg_0": context, "arg_1": continuation}}``)."""
    arguments = sample.get("arguments")
    if isinstance(arguments, Mapping):
        arguments = [[a.get("arg_0"), a.get("arg_1")] for a in arguments.values()]
    try:
        return [str(a[1]) for a in arguments]
    except (TypeError, IndexError, KeyError):
        return None


def record_rows(samples: Samples, target_delimiter: str = " ") -> list[dict]:
    """lm-eval's multiple-choice samples as the project's benchmark records (:mod:`qat_app.eval.records`: task,
    doc_id, gold, the choices' log-likelihoods and lengths), so :func:`qat_app.eval.measures.compare_records`
    gives the continuous measures (p_gold, Brier, KL between choice distributions). Other request types are
    left out; so is a document whose gold choice the log cannot tell (Winogrande's choices differ in the context,
    not the continuation)."""
    rows = []
    for task, task_samples in samples.items():
        for sample in task_samples:
            logliks, continuations = _logliks(sample), _continuations(sample)
            target = sample.get("target")
            if isinstance(target, str) and target.lstrip("-").isdigit():
                target = int(target)
            if not logliks or continuations is None or len(continuations) != len(logliks):
                continue
            choices = [c[len(target_delimiter):] if c.startswith(target_delimiter) else c for c in continuations]
            if isinstance(target, str) and choices.count(target) == 1:  # a target logged as its choice (copa)
                target = choices.index(target)
            if not isinstance(target, int) or not 0 <= target < len(logliks):
                continue
            rows.append({"task": task, "doc_id": sample["doc_id"], "gold": target, "loglik": logliks,
                         "acc": float(sample.get("acc", math.nan)), "acc_norm": float(sample.get("acc_norm", math.nan)),
                         "choice_chars": [len(c) for c in choices],
                         "choice_bytes": [len(c.encode("utf-8")) for c in choices]})
    return rows
