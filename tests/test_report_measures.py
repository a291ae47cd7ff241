"""The report's continuous measures and answer flips (qat_app/report/measures_table.py) on synthetic runs."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

import qat_app.report as rp
from qat_app.eval import measures as ms
from tests._report_fixtures import make_run, records

CHOICES = ["yes", "no", "perhaps not", "naïve"]


def _records(step: int, gold_shift: float, seed: int) -> list[dict]:
    """ARC (no cluster), HellaSwag (clusters of 3 by source) and MMLU (two subjects): 60 / 60 / 40 examples with
    the new fields; the same questions in every run, the gold's loglik moved by ``gold_shift``."""
    base, noise = np.random.default_rng(7), np.random.default_rng(seed)
    rows = []
    for task, n in (("arc_challenge", 60), ("hellaswag", 60), ("mmlu", 40)):
        for i in range(n):
            gold = int(base.integers(0, 4))
            ll = -base.uniform(2.0, 9.0, 4) + noise.normal(0.0, 0.3, 4)
            ll[gold] += gold_shift
            chars = np.array([len(c) for c in CHOICES])
            pred, pred_norm = int(ll.argmax()), int((ll / chars).argmax())
            subject = ("anatomy" if i % 2 else "virology") if task == "mmlu" else None
            cluster = {"arc_challenge": None, "hellaswag": f"activitynet~v_{i // 3}", "mmlu": subject}[task]
            rows.append({"task": task, "doc_id": i // 2 if task == "mmlu" else i, "subject": subject,
                         "example_id": i, "gold": gold, "loglik": ll.tolist(), "pred": pred, "pred_norm": pred_norm,
                         "acc": int(pred == gold), "acc_norm": int(pred_norm == gold), "choice_chars": chars.tolist(),
                         "choice_bytes": [len(c.encode()) for c in CHOICES], "cluster": cluster, "step": step})
    return rows


@pytest.fixture
def measured_runs(tmp_path):
    initial, baseline, qat = _records(0, 0.0, 1), _records(3, 0.0, 2), _records(3, -1.5, 3)
    base = make_run(tmp_path / "base", False, final=baseline, initial=initial)
    q = make_run(tmp_path / "qat", True, final=qat)
    return base, q, (initial, baseline, qat)


def test_report_adds_the_measures_with_clustered_intervals(measured_runs, tmp_path):
    base, qat, (initial, baseline, q_rows) = measured_runs
    report = rp.build_report(base, [qat], tmp_path / "out")
    tables = report["qat"][0]["measures"]
    assert set(tables) == {"forgetting", "quantization", "total"}
    direct = ms.compare_records(baseline, q_rows)
    for task in ("arc_challenge", "hellaswag", "mmlu"):
        entry = tables["quantization"][f"val/{task}"]
        for name in ms.MEASURE_NAMES:
            row, want = entry["measures"][name], direct[task][name]
            assert (row["difference"], row["se"], row["ci_low"], row["n_clusters"]) == (
                want.difference, want.se, want.low, want.n_clusters), (task, name)
    hs = tables["quantization"]["val/hellaswag"]
    assert hs["clusters"] == "source_id (20 clusters)" and hs["measures"]["p_gold"]["n_clusters"] == 20
    assert tables["quantization"]["val/mmlu"]["clusters"] == "subject (2 clusters)"
    assert tables["quantization"]["val/arc_challenge"]["clusters"].startswith("none")
    # the QAT run lowered every gold loglik: p_gold worse, brier worse (it rose), the KL is a drift
    q = tables["quantization"]["val/arc_challenge"]["measures"]
    assert q["p_gold"]["verdict"] == "worse" and q["brier"]["verdict"] == "worse" and q["brier"]["difference"] > 0
    assert q["gold_loglik_per_byte"]["verdict"] == "worse" and q["kl_choices"]["verdict"] == "drift"
    assert q["flips_acc"]["right_to_wrong"] > 0 and q["flips_acc"]["wrong_to_right"] == 0

    md = (tmp_path / "out" / "results.md").read_text()
    section = md.split("## Continuous measures and answer flips")[1].split("## Training loss")[0]
    head = ("| Task | Measure | n | clusters | forgetting (initial → baseline) | quantization (baseline → QAT) "
            "| total (initial → QAT) |")
    assert head in section and "CR1" in section
    line = next(x for x in section.splitlines() if x.startswith("| val/hellaswag | `p_gold` |"))
    assert "| 60 | source_id (20 clusters) |" in line and line.count("**worse**") == 2
    assert "| val/arc_challenge | `acc` |" not in section  # acc / acc_norm: the accuracy table's rows
    assert "count" not in md
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    p = {r["comparison"]: r for r in rows if r["metric"] == "val/mmlu/p_gold"}
    assert set(p) == {"forgetting", "quantization", "total"} and p["quantization"]["verdict"] == "worse"
    assert p["quantization"]["n_clusters"] == "2" and float(p["quantization"]["se"]) > 0
    accuracy = [r for r in rows if r["metric"] == "val/arc_challenge/acc"]
    assert len(accuracy) == 3 and all(r["se"] == "" for r in accuracy)  # the bootstrap rows, unchanged
    saved = json.load(open(tmp_path / "out" / "results.json"))
    assert saved["qat"][0]["measures"]["total"]["val/mmlu"]["n"] == [40, 40, 40]


def test_disjoint_examples_are_refused_naming_the_records(tmp_path):
    rows = _records(3, 0.0, 2)
    base = make_run(tmp_path / "base", False, final=rows)
    moved = [dict(r, doc_id=r["doc_id"] + 1000) if r["task"] == "hellaswag" else r for r in _records(3, 0.0, 3)]
    qat = make_run(tmp_path / "qat", True, final=moved)
    with pytest.raises(rp.ReportError) as err:
        rp.build_report(base, [qat], tmp_path / "out")
    message = str(err.value)
    assert "hellaswag (60 examples before, 60 after, none in common" in message and "arc_challenge" not in message
    assert str(tmp_path / "base" / "logs" / "version_0" / "benchmark_samples" / "val_step0000003.jsonl") in message
    assert str(tmp_path / "qat" / "logs" / "version_0" / "benchmark_samples" / "val_step0000003.jsonl") in message


def test_old_records_compare_and_name_what_they_lack(tmp_path):
    correct = [1] * 30 + [0] * 30
    base = make_run(tmp_path / "base", False, final=records("arc_challenge", correct, 3),
                    initial=records("arc_challenge", correct, 0))
    qat = make_run(tmp_path / "qat", True, final=records("arc_challenge", correct[::-1], 3))
    report = rp.build_report(base, [qat], tmp_path / "out")
    entry = report["qat"][0]["measures"]["quantization"]["val/arc_challenge"]
    assert {"p_gold", "brier", "kl_choices", "flips_acc"} <= set(entry["measures"])
    assert set(entry["unavailable"]) == {"p_gold_norm", "gold_loglik_per_byte"}
    flips = entry["measures"]["flips_acc"]
    assert (flips["right_to_wrong"], flips["wrong_to_right"], flips["difference"]) == (30, 30, 1.0)
    md = (tmp_path / "out" / "results.md").read_text()
    assert ("- val/arc_challenge: `p_gold_norm` n/a: the before records have no choice_chars (written before it "
            "existed) (forgetting, quantization, total)") in md
    # a QAT run without records: its comparisons say why; without any records: no measures section, as before
    bare = make_run(tmp_path / "bare", True, final=records("arc_challenge", correct, 3), samples=False)
    tables = rp.build_report(base, [bare], tmp_path / "out2")["qat"][0]["measures"]
    assert tables["quantization"]["val/arc_challenge"]["note"].startswith("no per-example records")
    assert "p_gold" in tables["forgetting"]["val/arc_challenge"]["measures"]
    plain = make_run(tmp_path / "plain", False, final=records("arc_challenge", correct, 3), samples=False)
    rp.build_report(plain, [bare], tmp_path / "out3")
    assert "## Continuous measures" not in (tmp_path / "out3" / "results.md").read_text()
