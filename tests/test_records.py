"""Per-example benchmark records (qat_app.eval.records): the file the report reads."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from qat_app.eval.records import SAMPLES_DIR, records_path, write_benchmark_records
from qat_app.report import runs


def test_records_are_written_where_the_report_reads_them(tmp_path):
    assert runs.SAMPLES_DIR == SAMPLES_DIR  # one declaration
    records = {"arc_challenge": {
        "example_id": torch.tensor([1, 0]), "gold": torch.tensor([2, 0]),
        "loglik": torch.tensor([[-1.0, -2.0, -0.5, float("-inf")], [-0.25, -3.0, float("-inf"), float("-inf")]]),
        "pred": torch.tensor([2, 0]), "pred_norm": torch.tensor([1, 0]),
        "acc": torch.tensor([True, True]), "acc_norm": torch.tensor([False, True]),
    }}
    examples = [SimpleNamespace(choices=["a", "b"], doc_index=10, subject=None),
                SimpleNamespace(choices=["a", "b", "c"], doc_index=11, subject=None)]
    datamodule = SimpleNamespace(examples=lambda task: examples)
    path = write_benchmark_records(records, datamodule, str(tmp_path), "val", 3)
    assert path == records_path(str(tmp_path), "val", 3) == os.path.join(tmp_path, SAMPLES_DIR, "val_step0000003.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert [(r["doc_id"], r["loglik"], r["acc_norm"], r["step"]) for r in rows] == [
        (11, [-1.0, -2.0, -0.5], 0, 3), (10, [-0.25, -3.0], 1, 3)]
    assert not os.path.exists(path + ".tmp")


def test_records_hold_choice_lengths_and_the_cluster():
    """choice_chars / choice_bytes from the rendered choices (without the delimiter); the cluster from the task's
    cluster field: HellaSwag source_id, MMLU subject, ARC none."""
    from qat_app.eval.examples import build_examples
    from qat_app.eval.records import record_rows

    hellaswag = {"activity_label": "Cooking", "ctx_a": "A chef is in a kitchen.", "ctx_b": "she", "label": "0",
                 "endings": ["cuts a crêpe.", "sings.", "leaves.", "sits."], "source_id": "activitynet~v_abc"}
    examples = build_examples("hellaswag", [hellaswag, {**hellaswag, "source_id": "wikihow~12"}], [0, 1])
    assert [e.cluster for e in examples] == ["activitynet~v_abc", "wikihow~12"]
    mmlu = {"question": "2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1}  # no subject field: the split's
    assert build_examples("mmlu", [mmlu], [0], subject="anatomy")[0].cluster == "anatomy"
    arc = {"id": "q1", "question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"}
    assert build_examples("arc_challenge", [arc], [0])[0].cluster is None
    records = {"example_id": torch.tensor([1]), "gold": torch.tensor([0]),
               "loglik": torch.tensor([[-1.0, -2.0, -3.0, -4.0]]), "pred": torch.tensor([0]),
               "pred_norm": torch.tensor([0]), "acc": torch.tensor([True]), "acc_norm": torch.tensor([True])}
    (row,) = record_rows("hellaswag", records, examples, 5)
    assert row["choice_chars"] == [13, 6, 7, 5] and row["choice_bytes"] == [14, 6, 7, 5]
    assert row["cluster"] == "wikihow~12" and row["doc_id"] == 1
    (row,) = record_rows("hellaswag", records, None, 5)  # no rendered examples: no lengths, no cluster
    assert "choice_chars" not in row and "cluster" not in row
