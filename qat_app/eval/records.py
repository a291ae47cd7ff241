"""Per-example benchmark records: one JSON line per scored example, for paired statistics in the report.

Written by :func:`write_benchmark_records` (from :class:`qat_app.module.QATModule` at the end of each
validation / test epoch) to ``<log_dir>/benchmark_samples/<val|test>_step<NNNNNNN>.jsonl``; read by
:mod:`qat_app.report` (which imports :data:`SAMPLES_DIR` from here). Light on purpose: the report imports this
module without torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SAMPLES_DIR = "benchmark_samples"  # per-example benchmark records, in the logger's directory
# the top-k next-token files of qat_app.eval.kl_cache (named here, where the report can import them without torch)
INITIAL_TOPK_FILE = "initial_topk.pt"  # in the logger's directory of the fit that took it
FINAL_TOPK_FILE = "final_topk.pt"  # in the logger's directory
# the KL-to-the-initial-model metrics of qat_app.eval.kl_cache (each with _low / _high)
FORGET_KL, FORGET_KL_DRIFT, FORGET_KL_QUANTIZATION = "forget/kl", "forget/kl_drift", "forget/kl_quantization"
# generation drift in a fit (qat_app.eval.generation_drift): KL(initial || now) along the initial model's greedy
# continuations of held-out prompts, full vocabulary (with _low / _high); the initial side kept in the log dir
FORGET_GENERATION_KL = "forget/generation_kl"
INITIAL_GENERATIONS_FILE = "initial_generations.pt"
PROFILE_FILE = "profile.json"  # qat_app.step_profile: where a profiled fit's steps spent their time (log dir)
NOISE_FLOOR_FILE = "noise_floor.json"  # callbacks.noise_floor: the W8A8 forward's floor at the end of a fit (log dir)


RECORDS_NAME = re.compile(r"^(val|test)_step(\d+)\.jsonl$")  # the file names records_path writes


def records_path(log_dir: str, prefix: str, step: int) -> str:
    """``<log_dir>/benchmark_samples/<prefix>_step<NNNNNNN>.jsonl``."""
    return os.path.join(log_dir, SAMPLES_DIR, f"{prefix}_step{step:07d}.jsonl")


def recorded_steps(log_dir: str, prefix: str = "val") -> list[int]:
    """The steps of ``log_dir``'s ``prefix`` records files, ascending ([] without any)."""
    directory = os.path.join(log_dir, SAMPLES_DIR)
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(m.group(2)) for m in map(RECORDS_NAME.match, names) if m and m.group(1) == prefix)


def record_rows(task: str, records: Mapping[str, torch.Tensor], examples: list | None, step: int,
                selected: int | None = None) -> list[dict]:
    """JSON-ready rows, one per example: task, doc_id (the doc's index in its split, as lm-eval's samples
    count it; for MMLU within its subject), subject, gold, per-choice log-likelihoods, both predictions
    and whether each is correct; with ``selected``, the task's number of selected examples (the rows of a
    task are the examples scored: every evaluation scores them all). ``examples``: the datamodule's rendered
    examples, by example id; with them each row also holds its choices' lengths in characters and in UTF-8
    bytes (``choice_chars``, ``choice_bytes``, of the choice strings without the delimiter, as lm-eval's
    acc_norm / acc_bytes count them) and its
    ``cluster`` (:attr:`~qat_app.eval.spec.TaskSpec.cluster_field`: MMLU subject, HellaSwag source_id; None for
    ARC), which :mod:`qat_app.eval.measures` uses."""
    from qat_app.eval.metric import MAX_RECORDED_CHOICES

    columns = {key: value.cpu().tolist() for key, value in records.items()}
    rows = []
    for i, example_id in enumerate(columns["example_id"]):
        example = examples[example_id] if examples is not None else None
        choices = len(example.choices) if example is not None else MAX_RECORDED_CHOICES
        lengths = {} if example is None else {
            "choice_chars": [len(c) for c in example.choices],
            "choice_bytes": [len(c.encode("utf-8")) for c in example.choices],
            "cluster": getattr(example, "cluster", None)}
        rows.append({
            "task": task,
            "doc_id": example.doc_index if example is not None else example_id,
            "subject": example.subject if example is not None else None,
            "example_id": example_id,
            "gold": columns["gold"][i],
            "loglik": [v for v in columns["loglik"][i][:choices] if v != float("-inf")],
            "pred": columns["pred"][i],
            "pred_norm": columns["pred_norm"][i],
            "acc": int(columns["acc"][i]),
            "acc_norm": int(columns["acc_norm"][i]),
            **lengths,
            "step": step,
            **({"selected": selected} if selected is not None else {}),
        })
    return rows


def read_records(path: str) -> list[dict]:
    """The rows of a records file (OSError / ValueError when unreadable)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_records(path: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line, written to a temporary file and renamed (never a half-written file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def write_benchmark_records(records: Mapping[str, Mapping[str, torch.Tensor]], datamodule, log_dir: str,
                            prefix: str, step: int, selected: Mapping[str, int] | None = None) -> str:
    """Write the evaluator's ``records`` (by task; :meth:`BenchmarkEvaluator.compute_with_records`) of one
    evaluation at optimizer ``step``, with each example's doc id and subject from the benchmark
    ``datamodule`` (when it renders ``examples(task)``) and each task's ``selected`` count, to
    :func:`records_path`; returns the path."""
    rows = []
    for task, task_records in records.items():
        examples = datamodule.examples(task) if hasattr(datamodule, "examples") else None
        rows += record_rows(task, task_records, examples, step, (selected or {}).get(task))
    path = records_path(log_dir, prefix, step)
    write_records(path, rows)
    log.info("benchmark records of %d examples written to %s", len(rows), path)
    return path


def scored_line(counts: Mapping[str, tuple[int, int | None]]) -> str:
    """``arc_challenge 25/25, mmlu 80/80``: per task the examples scored / selected (only the scored count where
    selected is unknown)."""
    return ", ".join(f"{task} {n}/{of}" if of is not None else f"{task} {n}" for task, (n, of) in counts.items())


def read_noise_floor(path: str | os.PathLike) -> dict | None:
    """A fit's ``noise_floor.json`` (:mod:`callbacks.noise_floor`) with its ``file``; ``{"note": why}`` when it is
    not one; None when there is no such file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            document = json.load(f)
        document["text"]["kl"]["difference"]  # noqa: B018  (the one field every reader needs)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return {"note": f"{path}: not a noise-floor file ({type(err).__name__}: {err})"}
    return {**document, "file": str(path)}
