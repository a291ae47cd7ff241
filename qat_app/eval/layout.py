"""The packed-row layout of benchmark batches: how rows are built, and how the scorer reads them.

Each example is turned into one or more *rows*: the context once, followed by every choice's continuation
(minus its last token, which is only ever a target). A 4-D attention mask (:func:`packed_attention_mask`)
keeps choices from seeing each other, so one forward pass scores all choices; single-token choices (MMLU's
letters) just read the context's last logits. Within a batch, a prefix shared by all rows (MMLU's subject
description and few-shot block; MMLU batches are formed subject by subject) goes in ``prefix_ids`` and is
run once, its KV cache reused by every row. ``pack_choices=False`` gives one plain right-padded row per
choice instead, for models whose forward takes only ``input_ids`` and a 2-D ``attention_mask``.

Building side: :class:`ScoringRow` and :func:`layout_rows` (one example), :class:`TokenizedExample`,
:class:`BenchmarkCollator` (a batch). Reading side: :func:`packed_attention_mask`, :func:`target_logprobs`
and :func:`choice_logliks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


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
            choice_example += [example_index] * item.num_choices
            choice_slot += range(item.num_choices)
            choice_char_length += map(float, item.choice_char_lengths)
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


def packed_attention_mask(
    segment_ids: torch.Tensor, dtype: torch.dtype | None = None, prefix_length: int = 0
) -> torch.Tensor:
    """[R, 1, T, P + T] mask for packed rows behind a shared prefix of P tokens: causal, every token sees
    the prefix and the row's context (segment 0) and its own segment only. Padding (segment -1) sees
    earlier padding and the prefix, so no softmax row is empty.
    Boolean (True = attend) when ``dtype`` is None, else additive (0 / dtype min)."""
    rows, length = segment_ids.shape
    device = segment_ids.device
    key_segments = torch.cat([segment_ids.new_zeros(rows, prefix_length), segment_ids], dim=1)
    query_index = torch.arange(length, device=device)[:, None] + prefix_length
    causal = torch.arange(length + prefix_length, device=device)[None, :] <= query_index
    query, key = segment_ids[:, :, None], key_segments[:, None, :]
    allowed = (causal & ((key == 0) | (key == query)))[:, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


# Rows of vocabulary-sized log-softmax evaluated at once: bounds the temporary to ~100 MB at 49k vocab.
_LOGSOFTMAX_CHUNK_ROWS = 512


def target_logprobs(logits: torch.Tensor, batch: Mapping[str, Any], offset: int) -> torch.Tensor:
    """float32 [N]: the log-probability of every target token of ``batch`` (``target_row`` / ``target_pos`` /
    ``target_token``) under ``logits`` [R, T', V], whose column 0 is row position ``offset``."""
    rows, cols, tokens = batch["target_row"], batch["target_pos"] - offset, batch["target_token"]
    token_logprobs = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
    for start in range(0, rows.numel(), _LOGSOFTMAX_CHUNK_ROWS):
        chunk = slice(start, start + _LOGSOFTMAX_CHUNK_ROWS)
        selected = logits[rows[chunk], cols[chunk]].float()
        token_logprobs[chunk] = selected.gather(1, tokens[chunk, None]).squeeze(1) - selected.logsumexp(-1)
    return token_logprobs


def choice_logliks(
    batch: Mapping[str, Any], token_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target log-probabilities summed per choice (``target_choice``): ``choice_loglik`` [M], laid out per
    example (``choice_example`` / ``choice_slot``) as ``loglik`` [E, max_choices] (-inf where an example has
    fewer choices), and the choices' lengths in characters, same shape (1 where there is no choice)."""
    device = token_logprobs.device
    choice_example, choice_slot = batch["choice_example"], batch["choice_slot"]
    choice_loglik = torch.zeros(choice_example.numel(), dtype=torch.float32, device=device)
    choice_loglik.index_add_(0, batch["target_choice"], token_logprobs)

    shape = (batch["example_id"].numel(), int(batch["max_choices"]))
    loglik = torch.full(shape, float("-inf"), device=device)
    loglik[choice_example, choice_slot] = choice_loglik
    char_length = torch.ones(shape, device=device)
    char_length[choice_example, choice_slot] = batch["choice_char_length"].float()
    return choice_loglik, loglik, char_length
