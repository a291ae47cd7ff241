"""Per-example benchmark records and the initial-model evaluation, end to end through main.py.

A fit with benchmarks scores the model at step 0 (quantization off) and at the end; each pass writes
``benchmark_samples/val_step<N>.jsonl`` with one row per example, and the rows must reproduce the
logged acc / acc_norm exactly.
"""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

import main as cli
from tests._cli_runs import STEPS, write_config

BENCHMARKS = {
    "class_path": "qat_app.data.benchmarks.BenchmarkDataModule",
    "init_args": {"tasks": ["arc_challenge", "mmlu"], "mmlu_subjects": ["anatomy", "astronomy"], "limit": 6,
                  "batch_size": 4, "source": "local"},
}


def fit_with_benchmarks(tmp_path, model_dir, corpus, **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = write_config(tmp_path, model_dir, corpus, **{"data.init_args.benchmarks": BENCHMARKS,
                                                          "trainer.val_check_interval": 2 * STEPS, **overrides})
    return cli.cli_main(["fit", "--config", config]).trainer


def read_records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def logged(log_dir: str) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        by_step.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return by_step


@pytest.mark.slow
def test_fit_scores_the_initial_model_and_writes_records_that_reproduce_the_metrics(tmp_path, tiny_model_dir, tiny_corpus):
    trainer = fit_with_benchmarks(tmp_path, tiny_model_dir, tiny_corpus, **{"warmup.warmup_steps": 0})
    log_dir = trainer.log_dir
    samples = sorted(os.listdir(os.path.join(log_dir, "benchmark_samples")))
    assert samples == ["val_step0000000.jsonl", f"val_step{STEPS:07d}.jsonl"]
    metrics = logged(log_dir)
    # Lightning logs the last validation at the logger step before the final optimizer step's increment
    passes = sorted(s for s, row in metrics.items() if "val/arc_challenge/acc" in row)
    assert len(passes) == 2 and passes[0] == 0
    for name, logged_step in zip(samples, passes):
        step = int(name[len("val_step"):-len(".jsonl")])
        rows = read_records(os.path.join(log_dir, "benchmark_samples", name))
        for task, expected_count in (("arc_challenge", 6), ("mmlu", 12)):
            task_rows = [r for r in rows if r["task"] == task]
            keys = {(r["subject"], r["doc_id"]) for r in task_rows}
            assert len(task_rows) == len(keys) == expected_count  # each example once
            for metric in ("acc", "acc_norm"):
                mean = sum(r[metric] for r in task_rows) / len(task_rows)
                assert mean == pytest.approx(metrics[logged_step][f"val/{task}/{metric}"], abs=1e-7)
            for r in task_rows:
                assert r["step"] == step and len(r["loglik"]) >= 2 and 0 <= r["gold"] < len(r["loglik"])
                best = max(range(len(r["loglik"])), key=lambda i: r["loglik"][i])
                assert r["pred"] == best and r["acc"] == int(best == r["gold"])
        assert {r["subject"] for r in rows if r["task"] == "mmlu"} == {"anatomy", "astronomy"}
    assert "val/loss" in metrics[0]  # the initial pass scores the LM loss too


@pytest.mark.slow
def test_initial_evaluation_is_of_the_unquantized_model(tmp_path, tiny_model_dir, tiny_corpus):
    """A QAT run without warmup (quantized from step 0) and the BF16 baseline score the same model at step 0."""
    qat = fit_with_benchmarks(tmp_path / "qat", tiny_model_dir, tiny_corpus,
                              **{"warmup.warmup_steps": 0, "trainer.max_steps": 2, "trainer.val_check_interval": 4})
    base = fit_with_benchmarks(tmp_path / "base", tiny_model_dir, tiny_corpus,
                               **{"warmup.warmup_steps": 0, "trainer.max_steps": 2, "trainer.val_check_interval": 4,
                                  "model.quant.enabled": False})
    first = [read_records(os.path.join(t.log_dir, "benchmark_samples", "val_step0000000.jsonl")) for t in (qat, base)]
    assert first[0] == first[1]
    # while the QAT run's last pass is quantized, so its log-likelihoods differ
    last = [read_records(os.path.join(t.log_dir, "benchmark_samples", "val_step0000002.jsonl")) for t in (qat, base)]
    assert [r["loglik"] for r in last[0]] != [r["loglik"] for r in last[1]]


@pytest.mark.slow
def test_initial_evaluation_does_not_change_training(tmp_path, tiny_model_dir, tiny_corpus):
    """Same losses and final weights with and without the step-0 pass (it draws no RNG, moves no history)."""
    runs = [fit_with_benchmarks(tmp_path / name, tiny_model_dir, tiny_corpus,
                                **{"initial_eval.enabled": enabled, "trainer.max_steps": 4, "warmup.warmup_steps": 2,
                                   "trainer.val_check_interval": 8})
            for name, enabled in (("with", True), ("without", False))]
    losses = [{s: row["train/loss"] for s, row in logged(t.log_dir).items() if "train/loss" in row} for t in runs]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    states = [t.lightning_module.state_dict() for t in runs]
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        other = states[1][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
