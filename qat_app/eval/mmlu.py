"""MMLU (lm-eval's ``mmlu``): cais/mmlu, 57 subjects, split ``test``, few-shot from ``dev`` (first n, in order).

Description ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``,
``"{question.strip()}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:"``, choices ``" A"`` .. ``" D"``.
Also the subject and category tables (subject indices and lm-eval's category groups).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from qat_app.eval.spec import TaskSpec

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


def validate_mmlu_subjects(subjects: Sequence[str] | None) -> tuple[str, ...]:
    if subjects is None:
        return MMLU_SUBJECTS
    if isinstance(subjects, str):
        subjects = [subjects]
    from qat_app.errors import ConfigError, nearest

    unknown = [s for s in subjects if s not in MMLU_SUBJECT_CATEGORIES]
    if unknown:
        hints = [f"{s} -> {m[0]}" for s in unknown for m in [nearest(s, MMLU_SUBJECTS)] if m]
        raise ConfigError(f"data.benchmarks.mmlu_subjects: unknown MMLU subject(s) {', '.join(unknown)}"
                          + (f" (did you mean: {'; '.join(hints)}?)" if hints else "")
                          + f"; the 57 subjects: {', '.join(MMLU_SUBJECTS)}")
    if not subjects:
        raise ConfigError("data.benchmarks.mmlu_subjects is empty; pass null for all 57 subjects")
    return tuple(dict.fromkeys(subjects))  # drop repeats, keep order


SPEC = TaskSpec(
    name="mmlu",
    hub_path="cais/mmlu",
    eval_split="test",
    fewshot_split="dev",
    local_subdir="hails/mmlu_no_train/{subset}/{split}",
    doc_to_text=mmlu_doc_to_text,
    doc_to_choices=mmlu_doc_to_choices,
    doc_to_gold=mmlu_doc_to_gold,
    fewshot_sampler="first_n",
    cluster_field="subject",  # the questions of one subject cluster (the doc's own field, else the split's subject)
)
