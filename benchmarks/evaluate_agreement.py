"""``main.py evaluate`` against lm-eval itself, on a checkpoint's exact W8A8 model: agreement and cost.

The same model object (the checkpoint's QAT model, HiF8 linears at their delayed scales) is scored twice, one
after the other in this process:

* ``evaluate``'s path: :func:`qat_app.eval.harness_tasks.resolve_tasks` (lm-eval's own task YAMLs pointed at the
  shipped data) and :func:`qat_app.evaluate.run_harness`;
* lm-eval by hand: ``simple_evaluate`` with an ``HFLM`` over the model object, on the task YAMLs that
  ``benchmarks/lm_eval_compare.py`` writes independently (``local_arc_challenge``, ``local_hellaswag``,
  ``local_mmlu_<subject>``).

Per task: documents, how many per-choice log-likelihoods are bit-identical and the largest difference
(:func:`qat_app.eval.harness_pairing.loglik_agreement`), how many ``acc`` / ``acc_norm`` values agree, and
documents per second of each path at the same batch size.

    python benchmarks/evaluate_agreement.py --ckpt_path runs/quickstart/checkpoints/last.ckpt --limit 100
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import write_json  # noqa: E402
from lm_eval_compare import run_lm_eval  # noqa: E402

from qat_app.eval.harness_pairing import loglik_agreement, pair  # noqa: E402
from qat_app.eval.harness_tasks import resolve_tasks  # noqa: E402
from qat_app.eval.harness_models import load_evaluated  # noqa: E402
from qat_app.evaluate import run_harness  # noqa: E402


def reference(evaluated, subjects: list[str], limit: int, batch_size: int) -> tuple[dict, float]:
    """lm-eval's simple_evaluate with an HFLM over the model object -> ({our task name: samples}, seconds)."""
    _, logged, seconds = run_lm_eval(evaluated.model, evaluated.tokenizer, None, subjects, 0, batch_size, limit=limit)
    return {key.replace("mmlu/", "mmlu_"): samples for key, samples in logged.items()}, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", default="runs/quickstart/checkpoints/last.ckpt")
    parser.add_argument("--limit", type=int, default=100, help="documents per task")
    parser.add_argument("--mmlu_subjects", default="anatomy,high_school_geography")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--output", default="outputs/evaluate_agreement.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    subjects = args.mmlu_subjects.split(",")
    evaluated = load_evaluated(args.ckpt_path, "cpu", "float32", False)
    tasks = ["arc_challenge", "hellaswag", *(f"mmlu_{s}" for s in subjects)]
    with tempfile.TemporaryDirectory() as directory:
        resolved = resolve_tasks(tasks, directory, "local")
        options = SimpleNamespace(tasks=tasks, limit=args.limit, num_fewshot=None, batch_size=args.batch_size,
                                  max_length=None, bootstrap_iters=0, apply_chat_template=False, gen_kwargs=None)
        ours, ours_seconds = run_harness(evaluated, resolved, options)
    theirs, their_seconds = reference(evaluated, subjects, args.limit, args.batch_size)
    agreement = loglik_agreement(ours["samples"], theirs)
    rows = []
    for task in tasks:
        row = {"task": task, **agreement[task]}
        for metric in ("acc", "acc_norm"):  # the same documents: paired() refuses others
            (paired,) = [r for r in pair({task: theirs[task]}, {task: ours["samples"][task]}) if r.metric == metric]
            row[f"same_{metric}"] = paired.result.n - (paired.result.right_to_wrong + paired.result.wrong_to_right)
        rows.append(row)
    documents = sum(row["documents"] for row in rows)
    print(f"{'task':<30} {'docs':>5} {'identical logliks':>18} {'max|dll|':>9} {'same acc':>9} {'same acc_norm':>13}")
    for row in rows:
        print(f"{row['task']:<30} {row['documents']:>5} {row['identical']:>8}/{row['requests']:<9} "
              f"{row['max_abs_diff']:>9.2e} {row['same_acc']:>4}/{row['documents']:<4} "
              f"{row['same_acc_norm']:>6}/{row['documents']:<6}")
    print(f"cost: evaluate {documents / ours_seconds:.2f} documents/s ({ours_seconds:.1f} s), lm-eval's HFLM "
          f"{documents / their_seconds:.2f} documents/s ({their_seconds:.1f} s): ratio {their_seconds / ours_seconds:.3f} "
          f"(batch size {args.batch_size}, {documents} documents)")
    write_json(args.output, {"args": vars(args), "rows": rows, "evaluate_seconds": ours_seconds,
                             "lm_eval_seconds": their_seconds})
    agree = all(row["identical"] == row["requests"] and row["same_acc"] == row["documents"] for row in rows)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
