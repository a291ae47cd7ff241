"""HellaSwag (lm-eval's ``hellaswag``): Rowan/hellaswag, split ``validation``.

``preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize())``, choices
``" " + preprocess(ending)``; few-shot examples drawn from ``train`` (lm-eval's random sampler).

Cluster (for clustered standard errors): ``source_id``, the ActivityNet video or WikiHow article the context was
taken from (``activitynet~v_-JhWjGDPHMY``); items written from one source share it (10042 validation items come
from 8407 sources). Not ``ind`` (one per item), ``activity_label`` (a category of ~190 labels, many sources each)
or ``ctx`` (the item's own text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from qat_app.eval.spec import TaskSpec


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


SPEC = TaskSpec(
    name="hellaswag",
    hub_path="Rowan/hellaswag",
    eval_split="validation",
    fewshot_split="train",
    local_subdir="hellaswag/none/{split}",
    doc_to_text=hellaswag_doc_to_text,
    doc_to_choices=hellaswag_doc_to_choices,
    doc_to_gold=hellaswag_doc_to_gold,
    fewshot_sampler="random",
    cluster_field="source_id",
)
