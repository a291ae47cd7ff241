"""Benchmark-evaluation throughput: ours vs lm-evaluation-harness, same model, same docs, same threads.

Both sides are timed end to end from the offline arrow files to the metrics (data loading, prompt
rendering, tokenisation, model passes, scoring), each task separately, after a warm-up forward.
lm-eval runs its own task YAMLs on the same doc indices (see lm_eval_compare.py) with HFLM on the
already-loaded model; both use the same batch size (ours: examples per batch; lm-eval: requests per
batch, its usual meaning) and ``torch.set_num_threads(--threads)``. With ``--repeats`` > 1 the two sides
alternate and the fastest run of each counts (the CPU is shared).

    python benchmarks/eval_throughput.py                   # 150 ARC, 150 HellaSwag, 2 MMLU subjects x 50
    python benchmarks/eval_throughput.py --repeats 2 --output outputs/eval_throughput.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from _common import int_options, write_json
from lm_eval_compare import build_datamodule, load_model, run_lm_eval

from qat_app.data.benchmarks import EMBEDDED_SMOLLM2
from qat_app.eval.evaluator import evaluate


def time_ours(model, tokenizer, task, limit, seed, subjects, fewshot, batch_size, max_length):
    started = time.perf_counter()
    (module,) = build_datamodule(tokenizer, [task], {task: limit}, seed, subjects, fewshot, batch_size, max_length).values()
    module.setup("validate")
    examples = module.examples(task)
    setup_seconds = time.perf_counter() - started
    metrics = evaluate(model, module)
    seconds = time.perf_counter() - started
    samples = {}
    for example in examples:
        key = f"mmlu/{example.subject}" if task == "mmlu" else task
        samples.setdefault(key, []).append(example.doc_index)
    return seconds, setup_seconds, len(examples), metrics, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_SMOLLM2)
    parser.add_argument("--tasks", default="arc_challenge,hellaswag,mmlu")
    parser.add_argument("--limit", type=int, default=150, help="docs for ARC and HellaSwag")
    parser.add_argument("--mmlu-limit", type=int, default=50, help="docs per MMLU subject")
    parser.add_argument("--mmlu-subjects", default="anatomy,high_school_geography")
    int_options(parser, mmlu_fewshot=0, seed=1234, batch_size=32, max_length=2048, threads=2, repeats=1)
    parser.add_argument("--output", default="outputs/eval_throughput.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("lm_eval", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    model, tokenizer = load_model(args.model)
    subjects = args.mmlu_subjects.split(",")
    with torch.no_grad():  # warm-up: first passes allocate and pick kernels
        model(torch.ones(4, 64, dtype=torch.long))

    rows = []
    for task in args.tasks.split(","):
        limit = args.mmlu_limit if task == "mmlu" else args.limit
        ours_best, lm_best = float("inf"), float("inf")
        for _ in range(args.repeats):
            seconds, setup_seconds, count, metrics, samples = time_ours(
                model, tokenizer, task, limit, args.seed, subjects, args.mmlu_fewshot, args.batch_size, args.max_length
            )
            ours_best = min(ours_best, seconds)
            _, _, lm_seconds = run_lm_eval(model, tokenizer, samples, subjects if task == "mmlu" else [],
                                           args.mmlu_fewshot, args.batch_size, args.max_length)
            lm_best = min(lm_best, lm_seconds)
        row = {
            "task": task,
            "examples": count,
            "ours_seconds": ours_best,
            "ours_setup_seconds": setup_seconds,
            "lm_eval_seconds": lm_best,
            "ours_examples_per_s": count / ours_best,
            "lm_eval_examples_per_s": count / lm_best,
            "speedup": lm_best / ours_best,
            "ours_acc": metrics[f"{task}/acc"],
        }
        rows.append(row)
        print(
            f"{task:14s} {count:4d} examples: ours {row['ours_examples_per_s']:6.2f}/s "
            f"({ours_best:.1f} s, setup {setup_seconds:.1f} s), lm-eval {row['lm_eval_examples_per_s']:6.2f}/s "
            f"({lm_best:.1f} s): {row['speedup']:.2f}x",
            flush=True,
        )
    total_examples = sum(row["examples"] for row in rows)
    ours_total = sum(row["ours_seconds"] for row in rows)
    lm_total = sum(row["lm_eval_seconds"] for row in rows)
    summary = {
        "examples": total_examples,
        "ours_examples_per_s": total_examples / ours_total,
        "lm_eval_examples_per_s": total_examples / lm_total,
        "speedup": lm_total / ours_total,
        "threads": args.threads,
        "batch_size": args.batch_size,
    }
    print(
        f"{'all':14s} {total_examples:4d} examples: ours {summary['ours_examples_per_s']:6.2f}/s, "
        f"lm-eval {summary['lm_eval_examples_per_s']:6.2f}/s: {summary['speedup']:.2f}x (target >= 1.5x)"
    )
    write_json(args.output, {"args": vars(args), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
