"""Any lm-eval multiple-choice task as in-loop benchmark examples, built from lm-eval's own task object.

The three tasks with modules of their own (ARC-Challenge, HellaSwag, MMLU) keep them; every other
``data.benchmarks.tasks`` name is an lm-eval task: its requests are built by lm-eval itself
(``Task.build_all_requests``: lm-eval's prompt, description, few-shot sampler and seed, target delimiter), on the
hub's data or, offline, the shipped copy (:mod:`qat_app.eval.harness_tasks`), and each document's requests become
one :class:`~qat_app.eval.examples.MultipleChoiceExample`. No code per task: what lm-eval's task config says is
what is scored, and the evaluator scores it as it scores the three.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence

from ..errors import ConfigError
from .examples import MultipleChoiceExample, select_doc_indices
from .spec import FEWSHOT_SEED


def _gold(task: str, doc_index: int, target, choices: list[str]) -> int:
    if isinstance(target, bool) or not isinstance(target, (int, str)):
        raise ConfigError(f"data.benchmarks.tasks: {task} doc {doc_index}: target {target!r} is not one choice (tasks "
                          "with several gold answers are scored by `main.py evaluate`)")
    if isinstance(target, str):
        if target not in choices:
            raise ConfigError(f"data.benchmarks.tasks: {task} doc {doc_index}: target {target!r} not among {choices}")
        return choices.index(target)
    if not 0 <= target < len(choices):
        raise ConfigError(f"data.benchmarks.tasks: {task} doc {doc_index}: gold {target} outside {len(choices)} choices")
    return target


def lm_eval_examples(task: str, num_fewshot: int = 0, limit: int | None = None, seed: int = 1234,
                     source: str = "auto", limit_mode: str = "sample",
                     doc_ids: Mapping[str, Sequence[int]] | None = None) -> tuple[list[MultipleChoiceExample], list[str]]:
    """The examples of lm-eval task ``task`` (a leaf multiple-choice task) and a provenance line."""
    try:
        from .harness_tasks import resolve_tasks
    except ImportError:  # pragma: no cover -- lm-eval is a runtime requirement
        raise ConfigError(f"data.benchmarks.tasks: {task} is not one of arc_challenge, hellaswag, mmlu and lm-eval "
                          "is not installed") from None
    with tempfile.TemporaryDirectory(prefix="qat_app_tasks_") as directory:
        resolved = resolve_tasks([task], directory, source, num_fewshot, "data.benchmarks.tasks")
        if resolved.leaves != [task]:
            raise ConfigError(f"data.benchmarks.tasks: {task} is an lm-eval group of {len(resolved.leaves)} tasks; "
                              f"name the tasks (e.g. {', '.join(resolved.leaves[:3])})")
        lm_task = resolved.manager.load([task])["tasks"][task]
    if lm_task.OUTPUT_TYPE != "multiple_choice":
        raise ConfigError(f"data.benchmarks.tasks: {task} is a {lm_task.OUTPUT_TYPE} task; in-loop benchmarks score "
                          "multiple-choice tasks (score it with `main.py evaluate`)")
    lm_task.set_config(key="num_fewshot", value=num_fewshot)
    lm_task.set_fewshot_seed(seed=FEWSHOT_SEED)
    docs = list(lm_task.eval_docs)
    indices = select_doc_indices(len(docs), limit, seed, limit_mode, (doc_ids or {}).get(task), f".{task}")
    lm_task.build_all_requests(samples=indices)
    delimiter = lm_task.config.target_delimiter
    by_doc: dict[int, list] = {}
    for instance in lm_task.instances:
        by_doc.setdefault(instance.doc_id, []).append(instance)
    examples = []
    for index in indices:
        requests = sorted(by_doc[index], key=lambda r: r.idx)
        context = requests[0].args[0]
        choices = [r.args[1][len(delimiter):] if r.args[1].startswith(delimiter) else r.args[1] for r in requests]
        doc = docs[index]
        examples.append(MultipleChoiceExample(task=task, doc_index=index, context=context, choices=tuple(choices),
                                              gold=_gold(task, index, lm_task.doc_to_target(doc), choices),
                                              target_delimiter=delimiter))
    return examples, [f"{task}: lm-eval's task, {resolved.notes[task]}, {len(indices)} of {len(docs)} used, "
                      f"{num_fewshot}-shot"]
