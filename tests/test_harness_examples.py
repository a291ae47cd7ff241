"""Any lm-eval multiple-choice task in the loop: lm-eval builds the requests, the evaluator scores them as lm-eval's
HFLM does, every example once at any rank count."""

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from qat_app.data.benchmarks import BenchmarkDataModule
from qat_app.errors import ConfigError
from qat_app.eval.evaluator import BenchmarkEvaluator, move_batch
from qat_app.eval.harness_tasks import resolve_tasks
from tests._tiny_models import random_llama

TASKS = ["arc_easy", "piqa", "copa"]


@pytest.fixture(scope="module")
def datamodule(embedded_tokenizer):
    module = BenchmarkDataModule(tasks=TASKS, limit=6, limit_mode="first", source="local", batch_size=4)
    module.set_tokenizer(embedded_tokenizer)
    module.setup("validate")
    return module


@pytest.mark.slow
def test_lm_eval_tasks_become_examples_as_lm_eval_renders_them(datamodule):
    import datasets

    from qat_app.eval.sources import local_data_root

    piqa = datasets.load_from_disk(str(local_data_root() / "piqa/plain_text/validation"))
    example = datamodule.examples("piqa")[2]
    assert example.context == f"Question: {piqa[2]['goal']}\nAnswer:"  # lm-eval's piqa.yaml
    assert example.choices == (piqa[2]["sol1"], piqa[2]["sol2"]) and example.gold == int(piqa[2]["label"])
    arc = datamodule.examples("arc_easy")[0]
    assert arc.context.startswith("Question: ") and arc.continuations[0] == " " + arc.choices[0]
    assert [e.doc_index for e in datamodule.examples("copa")] == list(range(6))
    assert any("arc_easy: lm-eval's task, offline ai2_arc/ARC-Easy split 'validation'" in line
               for line in datamodule.provenance)


@pytest.mark.slow
def test_the_evaluator_scores_lm_eval_tasks_as_lm_eval_does_once_per_example(datamodule, embedded_tokenizer, tmp_path):
    model = random_llama(len(embedded_tokenizer), seed=3)
    evaluator = BenchmarkEvaluator(TASKS)
    seen = {task: [] for task in TASKS}
    with torch.no_grad():
        for rank in range(2):  # two ranks' whole batches: every example once
            for task, loader in zip(TASKS, datamodule.loaders(rank, 2)):
                for batch in loader:
                    seen[task] += batch["example_id"].tolist()
                    evaluator.update(model, move_batch(batch, "cpu"))
    assert all(sorted(ids) == list(range(6)) for ids in seen.values())
    ours, records = evaluator.compute_with_records()
    resolved = resolve_tasks(TASKS, tmp_path, "local")
    output = simple_evaluate(model=HFLM(pretrained=model, tokenizer=embedded_tokenizer, batch_size=4), tasks=TASKS,
                             task_manager=resolved.manager, limit=6, log_samples=True, bootstrap_iters=0)
    for task in TASKS:
        theirs = {s["doc_id"]: s for s in output["samples"][task]}
        rows = records[task]
        for example_id, correct, correct_norm in zip(rows["example_id"].tolist(), rows["acc"].tolist(),
                                                     rows["acc_norm"].tolist()):
            doc = datamodule.examples(task)[example_id].doc_index
            assert bool(correct) == bool(theirs[doc]["acc"])
            assert bool(correct_norm) == bool(theirs[doc].get("acc_norm", correct_norm))  # copa has acc only
        assert float(ours[f"{task}/acc"]) == pytest.approx(output["results"][task]["acc,none"])


@pytest.mark.slow
def test_a_generative_task_or_a_group_in_the_loop_is_refused_in_one_line(embedded_tokenizer):
    for task, message in (("nq_open", "data.benchmarks.tasks: nq_open is a generate_until task; in-loop benchmarks "
                                      "score multiple-choice tasks"),
                          ("ai2_arc", "data.benchmarks.tasks: ai2_arc is an lm-eval group of 2 tasks; name the tasks")):
        module = BenchmarkDataModule(tasks=[task], limit=2, source="local")
        module.set_tokenizer(embedded_tokenizer)
        with pytest.raises(ConfigError, match=message):
            module.setup("validate")
