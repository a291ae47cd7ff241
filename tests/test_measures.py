"""Continuous per-example measures and their paired comparison (qat_app.eval.measures, qat_app.stats additions),
each against an independent few-line computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qat_app import stats
from qat_app.eval import measures as ms


def _row(task, doc_id, gold, loglik, choices=None, subject=None, cluster=None, step=0):
    """A record row as qat_app.eval.records.record_rows writes it (``choices``: the choice strings)."""
    ll = np.asarray(loglik, dtype=float)
    row = {"task": task, "doc_id": doc_id, "subject": subject, "example_id": doc_id, "gold": gold,
           "loglik": list(map(float, ll)), "pred": int(ll.argmax()), "acc": int(ll.argmax() == gold), "step": step}
    if choices is not None:
        chars = [len(c) for c in choices]
        row.update(choice_chars=chars, choice_bytes=[len(c.encode("utf-8")) for c in choices], cluster=cluster)
        row["pred_norm"] = int((ll / np.array(chars)).argmax())
    else:
        row["pred_norm"] = row["pred"]
    row["acc_norm"] = int(row["pred_norm"] == gold)
    return row


CHOICES = ["Paris", "a much longer answer", "café", "no"]


def _rows(n=40, seed=0, shift=0.0, task="arc_challenge", clusters=None, choices=True):
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(123)  # the same questions (gold, lengths) for every model
    rows = []
    for i in range(n):
        gold = int(base.integers(0, 4))
        ll = -base.uniform(1.0, 12.0, 4) + rng.normal(0.0, 1.0, 4)
        ll[gold] += shift
        rows.append(_row(task, i, gold, ll, CHOICES if choices else None,
                         cluster=None if clusters is None else clusters[i]))
    return rows


def _reference(row):
    """numpy reference of every per-example measure, written out independently."""
    ll = np.array(row["loglik"])
    g = row["gold"]
    p = np.exp(ll) / np.exp(ll).sum()
    chars = np.array([len(c) for c in CHOICES], dtype=float)
    pn = np.exp(ll / chars) / np.exp(ll / chars).sum()
    onehot = np.eye(len(ll))[g]
    return {"acc": float(ll.argmax() == g), "acc_norm": float((ll / chars).argmax() == g), "p_gold": p[g],
            "p_gold_norm": pn[g], "gold_loglik_per_byte": ll[g] / len(CHOICES[g].encode("utf-8")),
            "brier": float(((p - onehot) ** 2).sum())}


def test_per_example_measures_equal_a_numpy_reference():
    rows = _rows()
    assert len(CHOICES[2].encode("utf-8")) == 5 and len(CHOICES[2]) == 4  # bytes differ from characters
    for name in ("acc", "acc_norm", "p_gold", "p_gold_norm", "gold_loglik_per_byte", "brier"):
        got = ms.example_values(rows, name)
        want = [_reference(r)[name] for r in rows]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=name)
    assert ms.MEASURE_NAMES == ("acc", "acc_norm", "p_gold", "p_gold_norm", "gold_loglik_per_byte", "brier",
                                "kl_choices", "flips_acc", "flips_acc_norm")  # one registry
    assert {ms.MEASURES[n].kind for n in ("kl_choices", "flips_acc", "flips_acc_norm")} == {"drift"}
    assert not ms.MEASURES["brier"].higher_is_better and ms.MEASURES["p_gold"].higher_is_better


def test_paired_comparison_equals_the_reference_differences_and_kl():
    before, after = _rows(seed=1), _rows(seed=2, shift=0.5)
    out = ms.compare_records(before, after)
    assert list(out) == ["arc_challenge"] and out.n["arc_challenge"] == (40, 40, 40) and not out.unavailable
    for name in ("p_gold", "p_gold_norm", "gold_loglik_per_byte", "brier"):
        d = np.array([_reference(a)[name] - _reference(b)[name] for b, a in zip(before, after)])
        r = out["arc_challenge"][name]
        assert r.difference == pytest.approx(d.mean(), rel=1e-12)
        assert r.se == pytest.approx(d.std(ddof=1) / math.sqrt(d.size), rel=1e-9)  # ARC: no clusters
        assert (r.n, r.n_clusters) == (40, 40) and r.z == pytest.approx(r.difference / r.se)
        assert r.before == pytest.approx(np.mean([_reference(b)[name] for b in before]))
    kl = []
    for b, a in zip(before, after):
        p = np.exp(b["loglik"]) / np.exp(b["loglik"]).sum()
        q = np.exp(a["loglik"]) / np.exp(a["loglik"]).sum()
        kl.append(float((p * np.log(p / q)).sum()))
    r = out["arc_challenge"]["kl_choices"]
    assert r.difference == pytest.approx(np.mean(kl), rel=1e-9) and r.difference > 0 and r.before is None
    assert ms.verdict("kl_choices", r) == "no budget"
    assert ms.verdict("kl_choices", r, budget=r.low / 2) == "over budget"
    assert ms.verdict("kl_choices", r, budget=r.high) == "within budget"
    # flips: both directions, McNemar's discordant pairs and its exact p
    b01, a01 = np.array([x["acc"] for x in before]), np.array([x["acc"] for x in after])
    rw, wr = int(((b01 == 1) & (a01 == 0)).sum()), int(((b01 == 0) & (a01 == 1)).sum())
    for name in ("acc", "flips_acc"):
        r = out["arc_challenge"][name]
        assert (r.right_to_wrong, r.wrong_to_right) == (rw, wr) and r.mcnemar_p == stats.mcnemar_exact_p(rw, wr)
    assert out["arc_challenge"]["flips_acc"].difference == pytest.approx((rw + wr) / 40)
    assert out["arc_challenge"]["acc"].difference == pytest.approx((wr - rw) / 40)
    # the same model with the gold's loglik raised by 1 on every example: p_gold better, brier (lower) better
    same, raised = _rows(seed=1), _rows(seed=1, shift=1.0)
    out = ms.compare_records(same, raised)["arc_challenge"]
    assert ms.verdict("p_gold", out["p_gold"]) == "better" and ms.verdict("brier", out["brier"]) == "better"
    assert out["flips_acc"].right_to_wrong == 0 and out["flips_acc"].wrong_to_right > 0
    assert ms.verdict("brier", ms.compare_records(raised, same)["arc_challenge"]["brier"]) == "worse"


def test_clustered_standard_error_by_hand():
    # d = 1, 2, 3, 6 in clusters a, a, b, c: mean 3, residuals -2, -1, 0, +3; cluster sums -3, 0, +3 -> 18;
    # CR1: se^2 = G / (G - 1) * 18 / n^2 = 3/2 * 18 / 16 = 1.6875
    r = stats.clustered_mean([1, 2, 3, 6], ["a", "a", "b", "c"])
    assert (r.difference, r.n, r.n_clusters) == (3.0, 4, 3)
    assert r.se == pytest.approx(math.sqrt(1.6875), rel=1e-12)
    assert (r.low, r.high) == pytest.approx((3 - 1.959963984540054 * r.se, 3 + 1.959963984540054 * r.se))
    # unclustered: s^2 = (4 + 1 + 0 + 9) / 3, se^2 = s^2 / 4 = 14 / 12; singleton clusters (None) give the same
    assert stats.clustered_mean([1, 2, 3, 6]).se == pytest.approx(math.sqrt(14 / 12), rel=1e-12)
    assert stats.clustered_mean([1, 2, 3, 6], [None] * 4).se == pytest.approx(math.sqrt(14 / 12), rel=1e-12)
    assert stats.clustered_mean([1, 2, 3, 6], ["a", "b", "c", "d"]).se == pytest.approx(math.sqrt(14 / 12))
    one = stats.clustered_mean([1, 2, 3, 6], ["a"] * 4)  # one cluster: CR1 undefined, unclustered instead
    assert one.se == pytest.approx(math.sqrt(14 / 12)) and "one cluster" in one.note
    # paired: after - before = the d above
    r = stats.paired_difference([0, 0, 1, 1], [1, 2, 4, 7], ["a", "a", "b", "c"])
    assert r.difference == 3.0 and r.se == pytest.approx(math.sqrt(1.6875)) and (r.before, r.after) == (0.5, 3.5)
    # through compare_records: HellaSwag-like rows cluster by their `cluster` field
    before = [_row("hellaswag", i, 0, [0.0, 0.0], ["x", "y"], cluster=c) for i, c in enumerate("aabc")]
    after = [_row("hellaswag", i, 0, [math.log(k), 0.0], ["x", "y"], cluster=c) for i, (c, k) in
             enumerate(zip("aabc", (3, 4, 5, 8)))]  # p_gold = k / (k + 1)
    d = np.array([k / (k + 1) - 0.5 for k in (3, 4, 5, 8)])
    res = d - d.mean()
    want = math.sqrt(3 / 2 * ((res[0] + res[1]) ** 2 + res[2] ** 2 + res[3] ** 2) / 16)
    r = ms.compare_records(before, after, ["p_gold"])["hellaswag"]["p_gold"]
    assert r.se == pytest.approx(want, rel=1e-12) and r.n_clusters == 3


def test_normal_interval_matches_the_normal_approximation_and_the_bootstrap():
    """n = 2000 seeded paired sample: the interval is mean -/+ 1.96 s / sqrt(n) (to 1e-12) and agrees with the
    paired bootstrap percentile interval (10000 resamples) to within 0.1 standard error at each end (the bootstrap's
    own Monte Carlo error at a 2.5 % tail is about 0.027 SE; here the ends differ by 0.015 and 0.049 SE)."""
    rng = np.random.default_rng(2024)
    before = rng.normal(0.0, 1.0, 2000)
    after = before + 0.05 + rng.normal(0.0, 0.5, 2000)
    r = stats.paired_difference(before, after)
    d = after - before
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert r.se == pytest.approx(se, rel=1e-12)
    assert (r.low, r.high) == pytest.approx((d.mean() - 1.959963984540054 * se, d.mean() + 1.959963984540054 * se),
                                            rel=1e-12)
    low, high = stats.paired_bootstrap_ci(before, after)
    assert abs(low - r.low) < 0.1 * se and abs(high - r.high) < 0.1 * se
    assert r.z == pytest.approx(d.mean() / se) and r.low > 0  # +0.05 with se ~ 0.011: resolved
    r90 = stats.paired_difference(before, after, level=0.9)
    assert r90.high - r90.low == pytest.approx(2 * 1.6448536269514722 * se, rel=1e-9)


def test_disjoint_examples_are_refused_naming_the_tasks():
    before = _rows(10, task="arc_challenge") + _rows(5, task="hellaswag")
    after = [dict(r, doc_id=r["doc_id"] + 100) for r in _rows(10, task="arc_challenge")] + _rows(5, task="hellaswag")
    with pytest.raises(ms.DisjointExamplesError, match=r"arc_challenge \(10 examples before, 10 after, none in common"):
        ms.compare_records(before, after)
    with pytest.raises(ms.DisjointExamplesError, match="no task evaluated by both"):
        ms.compare_records(_rows(5, task="arc_challenge"), _rows(5, task="mmlu"))
    with pytest.raises(ms.DisjointExamplesError, match="mmlu"):  # an asked-for task must be in both
        ms.compare_records(_rows(5), _rows(5), tasks=["arc_challenge", "mmlu"])
    # a task only one side evaluated is named, not compared
    out = ms.compare_records(_rows(5) + _rows(5, task="mmlu"), _rows(5))
    assert list(out) == ["arc_challenge"] and "only the before records" in out.unavailable["mmlu"]["p_gold"]
    # partial overlap: the common examples are compared
    out = ms.compare_records(_rows(10), _rows(10)[3:])
    assert out.n["arc_challenge"] == (7, 10, 7) and out["arc_challenge"]["p_gold"].n == 7


def test_old_records_without_the_new_fields_still_compare():
    old_before, old_after = _rows(30, seed=1, choices=False), _rows(30, seed=2, choices=False)
    assert "choice_chars" not in old_before[0] and "cluster" not in old_before[0]
    out = ms.compare_records(old_before, old_after)
    got = set(out["arc_challenge"])
    assert {"acc", "acc_norm", "p_gold", "brier", "kl_choices", "flips_acc", "flips_acc_norm"} <= got
    assert set(out.unavailable["arc_challenge"]) == {"p_gold_norm", "gold_loglik_per_byte"}
    assert "choice_chars" in out.unavailable["arc_challenge"]["p_gold_norm"]
    assert "choice_bytes" in out.unavailable["arc_challenge"]["gold_loglik_per_byte"]
    # new records against old ones: the same measures; old MMLU rows cluster by their subject
    out = ms.compare_records(old_before, _rows(30, seed=2))
    assert "before records have no choice_chars" in out.unavailable["arc_challenge"]["p_gold_norm"]
    mmlu = [dict(r, task="mmlu", subject="anatomy" if r["doc_id"] < 15 else "virology") for r in old_before]
    r = ms.compare_records(mmlu, [dict(r, task="mmlu", subject=m["subject"]) for r, m in zip(old_after, mmlu)])
    assert r["mmlu"]["p_gold"].n_clusters == 2


def test_bad_requests_name_the_field():
    with pytest.raises(ms.MeasureError, match=r"measures: unknown measure 'p_gld' \(did you mean p_gold\?\)"):
        ms.compare_records(_rows(3), _rows(3), ["p_gld"])
    with pytest.raises(ms.MeasureError, match=r"level: must lie in \(0, 1\), got 1.5"):
        ms.compare_records(_rows(3), _rows(3), level=1.5)
    with pytest.raises(ms.MeasureError, match="before row 0: not a benchmark record"):
        ms.compare_records([{"doc_id": 1}], _rows(3))
    with pytest.raises(ms.MeasureError, match="drift measure"):
        ms.example_values(_rows(3), "kl_choices")
    assert issubclass(ms.MeasureError, ValueError)


def test_verdicts_honour_the_direction():
    up = stats.PairedResult(0.1, 0.01, 0.08, 0.12, 100, 100, 10.0)
    down = stats.PairedResult(-0.1, 0.01, -0.12, -0.08, 100, 100, -10.0)
    noise = stats.PairedResult(0.01, 0.01, -0.01, 0.03, 100, 100, 1.0)
    assert [ms.verdict("p_gold", r) for r in (up, down, noise)] == ["better", "worse", "within noise"]
    assert [ms.verdict("brier", r) for r in (up, down, noise)] == ["worse", "better", "within noise"]
    assert stats.verdict((-0.2, -0.1), higher_is_better=False) == "better" and stats.verdict((-0.2, -0.1)) == "worse"
    nan = stats.clustered_mean([1.0])  # one example: no standard error, no interval
    assert math.isnan(nan.se) and ms.verdict("acc", nan) == "n/a"
    same = stats.paired_difference([0.5, 0.5], [0.5, 0.5])  # nothing changed: a zero-width interval at 0
    assert (same.se, same.z, ms.verdict("p_gold", same)) == (0.0, 0.0, "within noise")
