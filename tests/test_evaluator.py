"""qat_app.eval.evaluator: log-likelihood scoring (``score_batch``), ``BenchmarkEvaluator`` / ``evaluate`` and the
DDP-correct metric it keeps per task (qat_app.eval.metric)."""

from __future__ import annotations

import os
import random
import socket
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qat_app.data.benchmarks import BenchmarkDataModule
from qat_app.eval.evaluator import BenchmarkEvaluator, BenchmarkValidationModule, evaluate, score_batch
from qat_app.eval.layout import BenchmarkCollator, TokenizedExample, layout_rows
from qat_app.eval.metric import MultipleChoiceMetric
from qat_app.eval.mmlu import MMLU_SUBJECTS
from tests._tiny_models import byte_level_tokenizer
from tests._tiny_models import random_llama as tiny_llama


class BigramLM(nn.Module):
    """A causal LM whose next-token logits depend only on the current token: ``table[current]``.
    Log-likelihoods are then known in closed form, whatever the padding or packing."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return SimpleNamespace(logits=self.table[input_ids])


def make_example(example_id, context, continuations, gold, char_lengths=None, subject_index=0, max_length=64, packed=True):
    return TokenizedExample(
        example_id=example_id,
        gold=gold,
        subject_index=subject_index,
        choice_char_lengths=char_lengths or [len(c) for c in continuations],
        rows=layout_rows(context, continuations, max_length, packed),
    )


def bigram_loglik(table, context, continuation):
    logprobs = table.log_softmax(-1)
    previous = [context[-1]] + continuation[:-1]
    return sum(float(logprobs[p, t]) for p, t in zip(previous, continuation))


@pytest.mark.parametrize("packed", [True, False])
def test_forced_answers_give_known_loglik_acc_and_acc_norm(packed):
    vocab = 10
    table = torch.zeros(vocab, vocab)
    table[2, 3] = 6.0  # after the context's last token 2, token 3 is forced
    table[2, 4] = 3.0
    table[4, 5] = 5.0
    table[1, 6] = 8.0  # example 2's context ends in 1 and forces token 6
    model = BigramLM(table)
    # example 0: choice 0 = [3] (likely, 1 char), choice 1 = [4, 5] (less likely, 100 chars): acc and acc_norm disagree
    # example 1: three single-token choices, gold is the forced one
    examples = [
        make_example(0, [7, 2], [[3], [4, 5]], gold=1, char_lengths=[1, 100], packed=packed),
        make_example(1, [8, 1], [[6], [7], [9]], gold=0, char_lengths=[3, 3, 3], packed=packed),
    ]
    batch = BenchmarkCollator("arc_challenge", pad_token_id=0, packed=packed)(examples)
    scored = score_batch(model, batch)

    expected = [
        bigram_loglik(table, [7, 2], [3]),
        bigram_loglik(table, [7, 2], [4, 5]),
        bigram_loglik(table, [8, 1], [6]),
        bigram_loglik(table, [8, 1], [7]),
        bigram_loglik(table, [8, 1], [9]),
    ]
    assert scored.choice_loglik.tolist() == pytest.approx(expected, abs=1e-5)
    assert scored.loglik[1].tolist()[:3] == pytest.approx(expected[2:], abs=1e-5)
    assert scored.loglik[0, 2] == float("-inf")  # example 0 has only two choices
    assert scored.pred.tolist() == [0, 0]
    assert scored.pred_norm.tolist() == [1, 0]  # -0.05 / 1 < -3.11 / 100
    assert expected[0] > expected[1] and expected[0] / 1 < expected[1] / 100

    evaluator = BenchmarkEvaluator(["arc_challenge"])
    evaluator.update(model, batch)
    results = evaluator.compute()
    assert results["arc_challenge/acc"] == pytest.approx(0.5)
    assert results["arc_challenge/acc_norm"] == pytest.approx(1.0)
    assert results["arc_challenge/count"] == 2


def test_ties_resolve_to_first_choice_like_numpy_argmax():
    model = BigramLM(torch.zeros(6, 6))  # every choice equally likely
    batch = BenchmarkCollator("hellaswag", 0)([make_example(0, [1], [[2], [3], [4]], gold=0, char_lengths=[5, 5, 5])])
    scored = score_batch(model, batch)
    assert scored.pred.item() == 0 and scored.pred_norm.item() == 0


def reference_loglik(model, context, continuation, max_length):
    """lm-eval's way: one unpadded sequence per (context, choice), log-softmax over all positions."""
    tokens = (context + continuation)[-(max_length + 1) :][:-1]
    with torch.no_grad():
        logprobs = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    tail = logprobs[-len(continuation) :]
    return float(tail.gather(1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("max_length", [64, 12])
def test_packed_scoring_equals_one_sequence_per_choice(attention, packed, max_length):
    model = tiny_llama(50, attention)
    rng = random.Random(0)
    examples, truth = [], []
    for example_id in range(6):
        context = [rng.randrange(1, 50) for _ in range(rng.randint(3, 15))]
        shared = [rng.randrange(1, 50) for _ in range(2)]
        continuations = [
            [rng.randrange(1, 50)],  # single token: read from the context's last logit
            [rng.randrange(1, 50)],
            shared + [rng.randrange(1, 50)],  # two choices with one common branch
            shared + [rng.randrange(1, 50)],
            [rng.randrange(1, 50) for _ in range(rng.randint(2, 6))],
        ]
        examples.append(make_example(example_id, context, continuations, gold=0, max_length=max_length, packed=packed))
        truth += [reference_loglik(model, context, c, max_length) for c in continuations]
    if max_length == 12:
        assert any(len(row.tokens) == 12 for item in examples for row in item.rows)  # truncation exercised
    batch = BenchmarkCollator("mmlu", pad_token_id=0, packed=packed)(examples)
    scored = score_batch(model, batch)
    assert scored.choice_loglik.tolist() == pytest.approx(truth, abs=2e-4)


def test_logits_to_keep_limits_the_vocabulary_projection():
    model = tiny_llama(50)
    seen = {}
    model.lm_head.register_forward_hook(lambda module, args, output: seen.update(positions=output.shape[1]))
    example = make_example(0, list(range(1, 30)), [[5], [6, 7]], gold=0)
    batch = BenchmarkCollator("arc_challenge", 0)([example])
    score_batch(model, batch)
    assert seen["positions"] == 2  # the context's last logit and the one branch token, not 30


def test_metric_counts_each_example_once():
    metric = MultipleChoiceMetric()
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([True, False, True]), torch.tensor([True, True, False]))
    # DistributedSampler padding repeats examples 0 and 1; they must not count twice
    metric.update(torch.tensor([3, 0, 1]), torch.tensor([False, True, False]), torch.tensor([False, True, True]))
    values = metric.compute()
    assert values["count"] == 4
    assert values["acc"] == pytest.approx(2 / 4)
    assert values["acc_norm"] == pytest.approx(2 / 4)


def test_mmlu_overall_is_weighted_by_subject_size():
    evaluator = BenchmarkEvaluator(["mmlu"])
    anatomy, virology = MMLU_SUBJECTS.index("anatomy"), MMLU_SUBJECTS.index("virology")
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1], dtype=torch.bool)  # anatomy 1/4, virology 3/3
    subjects = torch.tensor([anatomy] * 4 + [virology] * 3)
    evaluator.metrics["mmlu"].update(torch.arange(7), correct, correct, subjects)
    results = evaluator.compute()
    assert results["mmlu/acc"] == pytest.approx(4 / 7)  # lm-eval's group: weight_by_size, not (1/4 + 1)/2
    assert results["mmlu/anatomy/acc"] == pytest.approx(0.25)
    assert results["mmlu/virology/acc"] == pytest.approx(1.0)
    assert results["mmlu_stem/acc"] == pytest.approx(0.25)  # anatomy is STEM in lm-eval
    assert results["mmlu_other/acc"] == pytest.approx(1.0)  # virology is "other"
    assert "mmlu/astronomy/acc" not in results and "mmlu_humanities/acc" not in results
    evaluator.reset()
    assert evaluator.compute() == {}


def test_evaluator_rejects_untracked_tasks():
    evaluator = BenchmarkEvaluator(["hellaswag"])
    batch = BenchmarkCollator("arc_challenge", 0)([make_example(0, [1], [[2], [3]], gold=0)])
    with pytest.raises(ValueError, match="batch of task 'arc_challenge'"):
        evaluator.update(BigramLM(torch.zeros(5, 5)), batch)


def test_packed_layout_refuses_models_without_a_4d_mask_route():
    model = BigramLM(torch.zeros(5, 5))
    model.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    batch = BenchmarkCollator("arc_challenge", 0)([make_example(0, [1], [[2, 3], [3]], gold=0)])
    with pytest.raises(ValueError, match="pack_choices=False"):
        score_batch(model, batch)


def test_flash_attention_models_are_scored_through_sdpa_and_restored():
    model = tiny_llama(20)
    example = make_example(0, [1, 2, 3, 4], [[5, 6], [7]], gold=0)
    batch = BenchmarkCollator("arc_challenge", 0)([example])
    expected = score_batch(model, batch).choice_loglik
    switched = []
    original = model.set_attn_implementation

    def record(name):
        switched.append(name)
        if name == "sdpa":
            original("sdpa")  # flash kernels are not installed on CPU: only record the switch back

    model.config._attn_implementation = "flash_attention_2"
    model.set_attn_implementation = record
    scored = score_batch(model, batch)
    assert switched == ["sdpa", "flash_attention_2"]
    assert scored.choice_loglik.tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank, world_size, port, per_rank_updates, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        evaluator = BenchmarkEvaluator(["mmlu"])
        for ids, correct, subjects in per_rank_updates[rank]:
            evaluator.metrics["mmlu"].update(torch.tensor(ids), torch.tensor(correct), torch.tensor(correct), torch.tensor(subjects))
        results[rank] = {key: float(value) for key, value in evaluator.compute().items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_sync_deduplicates_distributed_sampler_padding():
    """Two gloo ranks with a real DistributedSampler over 5 examples: it pads to 6, repeating one."""
    import torch.multiprocessing as mp
    from torch.utils.data import DistributedSampler

    correct = [True, False, True, True, False]  # 3/5
    subjects = [MMLU_SUBJECTS.index("anatomy")] * 3 + [MMLU_SUBJECTS.index("virology")] * 2
    per_rank = {}
    for rank in range(2):
        indices = list(DistributedSampler(range(5), num_replicas=2, rank=rank, shuffle=False))
        per_rank[rank] = [([i], [correct[i]], [subjects[i]]) for i in indices]
    assert sum(len(updates) for updates in per_rank.values()) == 6  # one duplicate
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, _free_port(), per_rank, results), nprocs=2, join=True)
    for rank in range(2):
        assert results[rank]["mmlu/count"] == 5
        assert results[rank]["mmlu/acc"] == pytest.approx(3 / 5)
        assert results[rank]["mmlu/anatomy/acc"] == pytest.approx(2 / 3)
        assert results[rank]["mmlu/virology/acc"] == pytest.approx(1 / 2)


def test_trainer_validate_runs_every_task():
    import lightning

    tokenizer = byte_level_tokenizer()
    module = BenchmarkDataModule(tasks=["arc_challenge", "mmlu"], limit=3, source="local", batch_size=2, mmlu_subjects=["anatomy"])
    module.set_tokenizer(tokenizer)
    model = tiny_llama(len(tokenizer))
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    outputs = trainer.validate(BenchmarkValidationModule(model, module.task_names), datamodule=module, verbose=False)
    logged = outputs[0]
    assert logged["val/arc_challenge/count"] == 3 and logged["val/mmlu/count"] == 3
    assert 0.0 <= logged["val/mmlu/anatomy/acc"] <= 1.0
    # the plain loop gives the same numbers
    plain = evaluate(model, module)
    assert plain["arc_challenge/acc"] == pytest.approx(logged["val/arc_challenge/acc"])
    assert plain["mmlu/acc"] == pytest.approx(logged["val/mmlu/acc"])


@pytest.mark.slow
def test_choice_logliks_match_lm_eval_hflm(embedded_tokenizer):
    """Same model, same rendered requests: our packed scores equal lm-eval HFLM's loglikelihood."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = tiny_llama(len(embedded_tokenizer), seed=1)
    module = BenchmarkDataModule(tasks=["arc_challenge", "hellaswag", "mmlu"], limit=3, source="local", batch_size=4,
                                 mmlu_subjects=["anatomy"], num_fewshot={"mmlu": 2})
    module.set_tokenizer(embedded_tokenizer)
    lm = HFLM(pretrained=model, tokenizer=embedded_tokenizer, batch_size=4, max_length=2048)
    for task, loader in zip(module.task_names, module.val_dataloader()):
        examples = module.examples(task)
        for batch in loader:
            ours = score_batch(model, batch).choice_loglik.tolist()
            requests = [
                Instance("loglikelihood", doc={}, arguments=(examples[i].context, continuation), idx=0)
                for i in batch["example_id"].tolist()
                for continuation in examples[i].continuations
            ]
            theirs = [loglik for loglik, _ in lm.loglikelihood(requests, disable_tqdm=True)]
            assert ours == pytest.approx(theirs, abs=2e-4), task


class KwargsOnlyWrapper(nn.Module):
    """A wrapper exposing only ``forward(**kwargs)``: no KV-cache argument to reuse a prefix through."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kwargs):
        return self.model(**kwargs)


@pytest.mark.parametrize("wrapped", [False, True])
def test_shared_prefix_runs_once_and_scores_unchanged(wrapped):
    model = tiny_llama(60)
    rng = random.Random(1)
    shared = [rng.randrange(1, 60) for _ in range(40)]  # like MMLU's description + few-shot block
    examples, truth = [], []
    for example_id in range(4):
        context = shared + [rng.randrange(1, 60) for _ in range(rng.randint(3, 9))]
        continuations = [[rng.randrange(1, 60)] for _ in range(3)] + [[rng.randrange(1, 60) for _ in range(3)]]
        examples.append(make_example(example_id, context, continuations, gold=0))
        truth += [reference_loglik(model, context, c, 256) for c in continuations]
    batch = BenchmarkCollator("mmlu", pad_token_id=0)(examples)
    assert batch["prefix_ids"].tolist() == shared
    assert batch["input_ids"].shape[1] <= 9 + 2  # rows hold only what follows the prefix
    processed = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, output: processed.append(args[0].numel()))
    scored = score_batch(KwargsOnlyWrapper(model) if wrapped else model, batch)
    assert scored.choice_loglik.tolist() == pytest.approx(truth, abs=2e-4)
    if wrapped:  # prefix put back in front of every row: correct, no saving
        assert processed == [batch["input_ids"].numel() + 4 * len(shared)]
    else:  # the prefix once, then the rows' remainders against its KV cache
        assert processed == [len(shared), batch["input_ids"].numel()]


def test_no_prefix_when_rows_share_too_little():
    examples = [make_example(i, [1, 2, 3 + i, 4, 5], [[6], [7]], gold=0) for i in range(3)]
    batch = BenchmarkCollator("mmlu", pad_token_id=0)(examples)
    assert batch["prefix_ids"].numel() == 0 and batch["input_ids"].shape[1] == 5
