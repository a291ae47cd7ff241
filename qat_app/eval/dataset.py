"""Tokenisation of rendered examples as lm-eval's HFLM does it, and the per-task dataset.

Context and context+continuation are encoded separately and the continuation tokens are the tail of the
joint encoding; the rows are then laid out by :func:`qat_app.eval.layout.layout_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.data import Dataset

from qat_app.eval.examples import MultipleChoiceExample
from qat_app.eval.layout import TokenizedExample, layout_rows
from qat_app.eval.mmlu import MMLU_SUBJECTS


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Encode like lm-eval's HFLM.tok_encode: the tokenizer's default special tokens, none if the text
    already starts with the BOS string."""
    bos = tokenizer.bos_token
    starts_with_bos = [bool(bos) and text.startswith(bos) for text in texts]
    out: list[list[int]] = [[] for _ in texts]
    for add_special in (True, False):  # the plain texts, then those already starting with BOS
        indices = [i for i, flag in enumerate(starts_with_bos) if flag != add_special]
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
    contexts, wholes = [], []
    for example in examples:
        # lm-eval moves the context's trailing whitespace onto the continuation (the whole text is unchanged)
        stripped = example.context.rstrip()
        if not stripped:
            raise ValueError(f"{example.task} doc {example.doc_index}: empty context")
        contexts.append(stripped)
        wholes += [example.context + continuation for continuation in example.continuations]
    context_ids = _encode(tokenizer, contexts)
    whole_ids = _encode(tokenizer, wholes)

    tokenized = []
    cursor = 0
    for example_id, (example, ctx) in enumerate(zip(examples, context_ids)):
        continuations = []
        for choice in range(len(example.choices)):
            continuation = whole_ids[cursor + choice][len(ctx) :]
            if not continuation:
                raise ValueError(f"{example.task} doc {example.doc_index}: choice {choice} encodes to no tokens")
            if len(continuation) > max_length:
                raise ValueError(f"{example.task} doc {example.doc_index}: choice {choice} is longer than max_length={max_length}")
            continuations.append(continuation)
        cursor += len(example.choices)
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
        self.items = sorted(tokenized, key=lambda item: (item.subject_index if group_by_subject else 0,
                                                         -item.longest_row, item.example_id))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> TokenizedExample:
        return self.items[index]
