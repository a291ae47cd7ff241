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
