"""Benchmark docs rendered as lm-eval renders them: :class:`MultipleChoiceExample`, the ``limit`` draw, few-shot.

Few-shot: MMLU takes the first n dev docs (lm-eval's first_n sampler); ARC and HellaSwag draw from their
training split with lm-eval's default random sampler.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qat_app.eval.mmlu import mmlu_description, validate_mmlu_subjects
from qat_app.eval.sources import load_split
from qat_app.eval.spec import FEWSHOT_SEED, TARGET_DELIMITER, TaskSpec, build_prompt
from qat_app.eval.tasks import task_spec


@dataclass(frozen=True)
class MultipleChoiceExample:
    """One benchmark question, rendered as lm-eval renders it."""

    task: str
    doc_index: int  # index of the doc in its (task, subject) evaluation split, as lm-eval's `samples` counts
    context: str  # full prompt: description + few-shot + query
    choices: tuple[str, ...]  # choice strings without the delimiter (their length normalises acc_norm)
    gold: int
    subject: str | None = None  # MMLU only
    target_delimiter: str = TARGET_DELIMITER
    cluster: str | None = None  # items sharing a source (TaskSpec.cluster_field); None: the item is its own cluster

    @property
    def continuations(self) -> list[str]:
        return [f"{self.target_delimiter}{choice}" for choice in self.choices]


def select_doc_indices(num_docs: int, limit: int | None, seed: int, mode: str = "sample",
                       doc_ids: Sequence[int] | None = None, where: str = "") -> list[int]:
    """Which docs to score: ``doc_ids`` when given (like lm-eval's ``--samples``); else ``limit`` docs, the
    first ones (``mode="first"``, like lm-eval's ``--limit``) or drawn without replacement with ``seed``
    (``"sample"``), in doc order; all docs if no limit."""
    if doc_ids is not None:
        bad = [i for i in doc_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_docs]
        if bad or not doc_ids:
            from qat_app.errors import ConfigError

            raise ConfigError(f"data.benchmarks.doc_ids{where}: " + (
                f"{bad[:5]} out of range for {num_docs} docs (0-based indices)" if bad else "is empty"))
        return sorted(dict.fromkeys(doc_ids))
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    if limit is None or limit >= num_docs:
        return list(range(num_docs))
    if mode == "first":
        return list(range(limit))
    return sorted(random.Random(seed).sample(range(num_docs), limit))


def build_examples(
    task: str,
    eval_docs: Sequence[Mapping[str, Any]],
    doc_indices: Sequence[int],
    num_fewshot: int = 0,
    fewshot_docs: Sequence[Mapping[str, Any]] | None = None,
    subject: str | None = None,
    fewshot_seed: int = FEWSHOT_SEED,
) -> list[MultipleChoiceExample]:
    """Render the selected docs as lm-eval would.

    Few-shot: MMLU takes the first ``num_fewshot`` dev docs (lm-eval's first_n sampler); ARC and
    HellaSwag draw from the training split with one ``random.Random(fewshot_seed)`` stream consumed in
    doc order, as lm-eval's default sampler does (so draws match lm-eval when both evaluate the same docs).
    """
    spec = task_spec(task)
    description = mmlu_description(subject) if task == "mmlu" else ""
    shots: list[tuple[str, str]] = []
    pool: list[Mapping[str, Any]] = []
    if num_fewshot > 0:
        if not fewshot_docs:
            raise ValueError(f"{task}: num_fewshot={num_fewshot} but no few-shot docs were given")
        if num_fewshot > len(fewshot_docs):
            raise ValueError(f"{task}: num_fewshot={num_fewshot} exceeds the {len(fewshot_docs)} few-shot docs available")
        if spec.fewshot_sampler == "first_n":
            shots = [_render_shot(spec, doc) for doc in fewshot_docs[:num_fewshot]]
        else:
            pool = list(fewshot_docs)
    rng = random.Random(fewshot_seed)
    examples = []
    for index in doc_indices:
        doc = eval_docs[index]
        if pool:
            shots = [_render_shot(spec, shot) for shot in rng.sample(pool, num_fewshot)]
        choices = spec.doc_to_choices(doc)
        gold = spec.doc_to_gold(doc)
        if not 0 <= gold < len(choices):
            raise ValueError(f"{task}{f'/{subject}' if subject else ''} doc {index}: gold index {gold} outside {len(choices)} choices")
        examples.append(
            MultipleChoiceExample(
                task=task,
                doc_index=index,
                context=build_prompt(spec.doc_to_text(doc), shots, description),
                choices=tuple(choices),
                gold=gold,
                subject=subject,
                cluster=_cluster(spec, doc, subject),
            )
        )
    return examples


def _cluster(spec: TaskSpec, doc: Mapping[str, Any], subject: str | None) -> str | None:
    if spec.cluster_field is None:
        return None
    value = doc.get(spec.cluster_field, subject if spec.cluster_field == "subject" else None)
    return None if value is None else str(value)


def _render_shot(spec: TaskSpec, doc: Mapping[str, Any]) -> tuple[str, str]:
    return spec.doc_to_text(doc), spec.doc_to_choices(doc)[spec.doc_to_gold(doc)]


def load_task_examples(
    task: str,
    num_fewshot: int = 0,
    limit: int | None = None,
    seed: int = 1234,
    source: str = "auto",
    mmlu_subjects: Sequence[str] | None = None,
    limit_mode: str = "sample",
    doc_ids: Mapping[str, Sequence[int]] | None = None,
) -> tuple[list[MultipleChoiceExample], list[str]]:
    """All examples of a task with a module of its own (for MMLU: of the chosen subjects, ``limit`` applying per
    subject like lm-eval's per-subtask limit) and a provenance line per loaded split; any other task's come from
    :func:`~qat_app.eval.harness_examples.lm_eval_examples`. ``doc_ids``: indices per task name
    (``mmlu_<subject>`` for an MMLU subject, lm-eval's subtask names)."""
    spec = task_spec(task)
    subjects: list[str | None] = list(validate_mmlu_subjects(mmlu_subjects)) if task == "mmlu" else [None]
    examples: list[MultipleChoiceExample] = []
    provenance: list[str] = []
    for subject in subjects:
        evaluation = load_split(task, spec.eval_split, subject, source)
        fewshot_docs = None
        if num_fewshot > 0:
            if spec.fewshot_split is None:
                raise ValueError(f"{task}: few-shot evaluation is not supported")
            fewshot = load_split(task, spec.fewshot_split, subject, source)
            fewshot_docs = fewshot.docs
            if task != "mmlu":
                provenance.append(f"{task} few-shot: {fewshot.description}")
        key = f"mmlu_{subject}" if subject else task
        ids = (doc_ids or {}).get(key)
        indices = select_doc_indices(len(evaluation.docs), limit, seed, limit_mode, ids, f".{key}")
        examples += build_examples(task, evaluation.docs, indices, num_fewshot, fewshot_docs, subject)
        if task != "mmlu" or subject == subjects[0]:
            provenance.append(f"{task}{f'/{subject}' if subject else ''}: {evaluation.description}, {len(indices)} used")
    if task == "mmlu":
        provenance.append(f"mmlu: {len(subjects)} subjects, {len(examples)} examples, {num_fewshot}-shot from 'dev'")
    return examples, provenance
