"""``main.py evaluate``: lm-eval's tasks on the exact W8A8 model of a checkpoint, offline on the shipped data, paired
against the initial model, with the noise floor and the generation drift."""

import json
import math

import pytest
import torch

from qat_app import stats
from qat_app.errors import ConfigError
from qat_app.eval import harness_pairing as pairing
from qat_app.eval.generation_drift import generation_drift
from qat_app.eval.harness_tasks import TaskError, resolve_tasks
from qat_app.eval.sources import local_data_root
from qat_app.hif8.operand import Operand

TASKS = "arc_challenge,boolq,nq_open"


# ------------------------------------------------------------------------------------------ offline task data
@pytest.mark.slow
def test_offline_tasks_are_lm_evals_own_definitions_on_the_shipped_copies(tmp_path):
    resolved = resolve_tasks(["arc_challenge", "boolq", "mmlu_anatomy"], tmp_path, "local")
    assert resolved.offline and resolved.leaves == ["arc_challenge", "boolq", "mmlu_anatomy"]
    assert "'test' is not shipped, the shipped 'validation' is evaluated" in resolved.notes["arc_challenge"]
    assert resolved.notes["mmlu_anatomy"] == "offline hails/mmlu_no_train/anatomy split 'test'"
    tasks = resolved.manager.load(resolved.leaves)["tasks"]

    arc = tasks["arc_challenge"]
    docs = list(arc.eval_docs)
    import datasets

    shipped = datasets.load_from_disk(str(local_data_root() / "ai2_arc/ARC-Challenge/validation"))
    assert len(docs) == len(shipped) == 299
    assert arc.doc_to_text(docs[0]) == f"Question: {shipped[0]['question']}\nAnswer:"  # lm-eval's prompt
    assert arc.doc_to_choice(docs[0]) == shipped[0]["choices"]["text"]
    boolq = tasks["boolq"]
    first = next(iter(boolq.eval_docs))
    assert boolq.doc_to_target(first) == int(first["answer"])  # the shipped copy's schema, adapted
    assert boolq.doc_to_text(first).endswith(f"Question: {first['question']}?\nAnswer:")
    mmlu = tasks["mmlu_anatomy"]
    assert len(list(mmlu.eval_docs)) == 135 and len(mmlu.fewshot_docs()) == 5  # test split, few-shot from dev


@pytest.mark.slow
def test_an_unknown_task_and_a_task_without_offline_data_are_named(tmp_path):
    with pytest.raises(TaskError, match=r"--tasks: unknown lm-eval task 'arc_challeng' \(did you mean arc_challenge\?\)"):
        resolve_tasks(["arc_challeng"], tmp_path, "local")
    with pytest.raises(TaskError, match=r"--tasks: gsm8k: its dataset 'openai/gsm8k' is not shipped offline") as err:
        resolve_tasks(["gsm8k"], tmp_path, "local")
    assert "\n" not in str(err.value) and "arc_easy" in str(err.value)


@pytest.mark.slow
def test_a_group_expands_to_its_shipped_leaves(tmp_path):
    resolved = resolve_tasks(["mmlu"], tmp_path, "local")
    assert len(resolved.leaves) == 57 and all(leaf.startswith("mmlu_") for leaf in resolved.leaves)
    assert len(list(tmp_path.glob("mmlu_*.yaml"))) == 57


# ------------------------------------------------------------------------------------------ paired statistics
def _samples(values, metric="acc", prompt="p"):
    return [{"doc_id": i, "filter": "none", "metrics": [metric], metric: v, "doc_hash": f"d{i}",
             "prompt_hash": f"{prompt}{i}"} for i, v in enumerate(values)]


def test_pairing_matches_a_few_line_reference():
    before = [1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1]
    after = [1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 1]
    (row,) = pairing.pair({"t": _samples(before)}, {"t": _samples(after)}, {"t": {"acc": True}})
    d = [a - b for a, b in zip(after, before)]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    assert row.result.difference == pytest.approx(mean) and row.result.se == pytest.approx(se)
    assert row.result.low == pytest.approx(mean - 1.959964 * se, abs=1e-6) and row.result.n == n
    b, c = sum(x < 0 for x in d), sum(x > 0 for x in d)  # right -> wrong, wrong -> right
    exact = min(1.0, 2 * sum(math.comb(b + c, k) for k in range(min(b, c) + 1)) / 2 ** (b + c))
    assert row.p_value == pytest.approx(exact)
    assert row.verdict == stats.verdict(row.result.interval)
    continuous = pairing.pair({"t": _samples([0.1, 0.5, 0.2, 0.9], "f1")}, {"t": _samples([0.3, 0.6, 0.2, 1.0], "f1")})
    z = continuous[0].result.z
    assert continuous[0].p_value == pytest.approx(math.erfc(abs(z) / math.sqrt(2)))


def test_pairing_refuses_other_documents_or_prompts_and_reads_the_floor():
    with pytest.raises(pairing.PairingError, match="t: document 0 differs between the two evaluations"):
        pairing.pair({"t": _samples([1, 0])}, {"t": _samples([1, 0], prompt="q")})
    with pytest.raises(pairing.PairingError, match="scored different documents"):
        pairing.pair({"t": _samples([1, 0])}, {"t": _samples([1, 0, 1])})
    before, after = _samples([1] * 30 + [0] * 30), _samples([0] * 6 + [1] * 24 + [0] * 30)
    (row,) = pairing.pair({"t": before}, {"t": after}, {"t": {"acc": True}})
    assert row.verdict == "worse"
    floors = pairing.floor_of({"t": before}, [{"t": after}])
    assert floors[("t", "acc", "none")] == pytest.approx(max(abs(row.result.low), abs(row.result.high)))
    (inside,) = pairing.pair({"t": before}, {"t": after}, {"t": {"acc": True}}, floors)
    assert inside.verdict == "inside the noise floor"
    lower = {key: abs(row.result.high) for key in floors}
    (overlap,) = pairing.pair({"t": before}, {"t": after}, {"t": {"acc": True}}, lower)
    assert overlap.verdict == "worse, overlapping the noise floor"
    total = pairing.summed([row, row], "acc")
    assert total.difference == pytest.approx(2 * row.result.difference)
    assert total.se == pytest.approx(math.sqrt(2) * row.result.se)


def test_loglik_agreement_counts_identical_logliks_and_choices():
    def logged(values):
        return [{"doc_id": i, "filter": "none", "resps": [[[str(v), "False"]] for v in lls]}  # as written to disk
                for i, lls in enumerate(values)]

    before = {"t": logged([[-1.0, -2.0], [-3.0, -0.5]]), "g": [{"doc_id": 0, "resps": [["a text"]]}]}
    after = {"t": logged([[-1.0, -2.5], [-0.4, -0.5]]), "g": [{"doc_id": 0, "resps": [["a text"]]}]}
    assert pairing.loglik_agreement(before, after) == {
        "t": {"documents": 2, "requests": 4, "identical": 2, "max_abs_diff": 2.6, "same_choice": 1}}


def test_multiple_choice_samples_become_records_with_continuous_measures():
    from qat_app.evaluate import continuous_measures

    def logged(lls, target="1"):
        return {"doc_id": 0, "filter": "none", "target": target, "acc": 1.0, "acc_norm": 1.0,
                "arguments": {f"gen_args_{i}": {"arg_0": "Q?", "arg_1": f" choice{i}{'x' * i}"} for i in range(2)},
                "resps": [[[str(v), "False"]] for v in lls]}

    (row,) = pairing.record_rows({"t": [logged([-2.0, -1.0])], "g": [{"doc_id": 0, "resps": [["text"]]}]})
    assert row["gold"] == 1 and row["loglik"] == [-2.0, -1.0] and row["choice_chars"] == [7, 8]
    measures = continuous_measures({"t": [logged([-2.0, -1.0])]}, {"t": [logged([-2.0, -0.5])]})
    p_before, p_after = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-1.5))  # softmax of the gold choice
    assert measures["t"]["p_gold"]["difference"] == pytest.approx(p_after - p_before)
    assert measures["summed over tasks"]["p_gold"]["difference"] == pytest.approx(p_after - p_before)
    assert pairing.record_rows({"t": [logged([-2.0, -1.0], target="7")]}) == []  # not a choice index
    (copa,) = pairing.record_rows({"t": [logged([-2.0, -1.0], target="choice1x")]})  # a target logged as its text
    assert copa["gold"] == 1
    same = logged([-2.0, -1.0], target=" same")
    same["arguments"] = {f"gen_args_{i}": {"arg_0": f"context {i}", "arg_1": " same"} for i in range(2)}
    assert pairing.record_rows({"t": [same]}) == []  # Winogrande: the gold is in the context


# ------------------------------------------------------------------------------------------ generation drift
def test_generation_drift_is_zero_against_itself_and_follows_the_references_greedy_text(tiny_llama):
    class Characters:  # a tokenizer over the tiny model's 128 ids: one id per character
        eos_token_id = None

        def __call__(self, text, return_tensors=None, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])})()

    tiny_llama.eval()
    prompts = ["the model learns", "a scale history"]
    same = generation_drift(tiny_llama, tiny_llama, Characters(), prompts, max_new_tokens=5)
    assert same.kl.difference == 0.0 and same.prompts == 2 and same.new_tokens == 10
    import copy

    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    drift = generation_drift(tiny_llama, other, Characters(), prompts, max_new_tokens=5)
    # the few-line reference: the reference's greedy continuation, then KL at each continuation position
    expected = []
    for prompt in prompts:
        ids = torch.tensor([[ord(c) % 128 for c in prompt]])
        for _ in range(5):
            ids = torch.cat([ids, tiny_llama(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
        p = tiny_llama(input_ids=ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
        q = other(input_ids=ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
        expected.append(float((p.exp() * (p - q)).sum(-1).mean()))
    assert drift.per_prompt == pytest.approx(expected, rel=1e-6)
    assert drift.kl.low < drift.kl.difference < drift.kl.high


# ------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def evaluated_run(module_tmp, tiny_model_dir, tiny_corpus):
    """A tiny QAT fit's checkpoint, evaluated on three tasks (one generative) against its initial model."""
    import main as cli
    from tests._cli_runs import checkpointed_fit

    root = module_tmp("evaluate")
    checkpointed_fit(root / "fit", tiny_model_dir, tiny_corpus)
    ckpt = root / "fit" / "ckpt" / "last.ckpt"
    out = root / "eval"
    cli.main(["evaluate", "--model", str(ckpt), "--tasks", TASKS, "--limit", "5", "--output_path", str(out),
              "--gen_kwargs", "max_gen_toks=6", "--batch_size", "1", "--drift_prompts", "3", "--drift_tokens", "4",
              "--data", "local"])
    return ckpt, out, json.loads((out / "evaluate.json").read_text())


def _logged(out, role, task):
    from qat_app.evaluate import read_samples

    return read_samples(out / role, [task])[task]


def test_written_samples_are_read_by_their_whole_name(tmp_path):
    from qat_app.evaluate import read_samples

    (tmp_path / "samples_arc_challenge_2026-12-06T20-24-06.341234.jsonl").write_text('{"doc_id": 1}\n')
    (tmp_path / "samples_arc_challenge_chat_2026-12-06T20-25-00.000001.jsonl").write_text('{"doc_id": 2}\n')
    assert read_samples(tmp_path, ["arc_challenge"]) == {"arc_challenge": [{"doc_id": 1}]}
    with pytest.raises(ConfigError, match="no samples_arc_easy_"):
        read_samples(tmp_path, ["arc_easy"])


@pytest.mark.slow
def test_evaluate_scores_the_exact_w8a8_model_as_lm_eval_does(evaluated_run):
    from transformers import AutoTokenizer

    from qat_app.export.qat_checkpoint import load_qat_checkpoint

    ckpt, out, summary = evaluated_run
    assert summary["quantized"] and summary["precision"] == "32-true" and summary["leaves"] == TASKS.split(",")
    assert sorted(p.name.split("_2")[0] for p in (out / "model").glob("*")) == [
        "results", "samples_arc_challenge", "samples_boolq", "samples_nq_open"]  # as lm-eval writes them
    module = load_qat_checkpoint(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(module.hparams.model_name)
    plain = load_qat_checkpoint(ckpt)
    for _, layer in __import__("qat_app.hif8.patch", fromlist=["x"]).quantized_linears(plain.model):
        layer.switch(Operand.WEIGHT, False)
        layer.switch(Operand.INPUT, False)
    differs = 0
    for sample in _logged(out, "model", "arc_challenge") + _logged(out, "model", "boolq"):
        for request, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = request["arg_0"], request["arg_1"]
            # HFLM's split of the pair and its input: the last max_length + 1 tokens but the last (batch size 1: the
            # same shapes, so the same kernels; another batch composition moves a W8A8 forward by its noise floor)
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            start = len(tokenizer(context, add_special_tokens=False).input_ids)
            ids = torch.tensor([whole[-(module.model.config.max_position_embeddings + 1):][:-1]])
            length = len(whole) - start
            with torch.no_grad():
                lp = module.model(input_ids=ids).logits[0, -length:].log_softmax(-1)
                lp_plain = plain.model(input_ids=ids).logits[0, -length:].log_softmax(-1)
            target = torch.tensor(whole[start:])[:, None]
            expected = float(lp.gather(1, target).sum())
            assert float(response[0][0]) == pytest.approx(expected, abs=1e-6)
            differs += abs(float(lp_plain.gather(1, target).sum()) - expected) > 1e-4
    assert differs > 0  # the W8A8 numerics, not the unquantized weights
    generated = _logged(out, "model", "nq_open")
    assert len(generated) == 5 and all(isinstance(s["resps"][0][0], str) for s in generated)


@pytest.mark.slow
def test_evaluate_pairs_against_the_initial_model_with_floor_and_drift(evaluated_run):
    ckpt, out, summary = evaluated_run
    assert summary["baseline"].startswith("initial (")
    rows = {(r["task"], r["metric"]): r for r in summary["paired"]}
    assert set(rows) == {("arc_challenge", "acc"), ("arc_challenge", "acc_norm"), ("boolq", "acc"),
                         ("nq_open", "exact_match")}
    model = {s["doc_id"]: s["acc"] for s in _logged(out, "model", "arc_challenge")}
    base = {s["doc_id"]: s["acc"] for s in _logged(out, "baseline", "arc_challenge")}
    expected = stats.paired_difference([base[i] for i in sorted(base)], [model[i] for i in sorted(model)])
    row = rows[("arc_challenge", "acc")]
    assert row["n"] == 5 and row["difference"] == pytest.approx(expected.difference)
    assert row["low"] <= row["difference"] <= row["high"] and 0 <= row["p_value"] <= 1
    assert row["noise_floor"] is not None and (out / "model_noise_floor_seed0").is_dir()
    assert set(summary["measures"]) == {"arc_challenge", "boolq", "summed over tasks"}  # the multiple-choice tasks
    drift = summary["generation_drift"]
    assert drift["prompts"] == 3 and drift["kl"]["difference"] >= 0 and drift["new_tokens"] <= 12
    assert summary["cost"]["model"]["documents"] == 15


@pytest.mark.slow
def test_an_earlier_evaluation_as_baseline_gives_the_same_pairs(evaluated_run, module_tmp, tiny_model_dir, capsys):
    import main as cli

    ckpt, out, summary = evaluated_run
    initial = module_tmp("initial_eval") / "eval"
    common = ["--tasks", TASKS, "--limit", "5", "--gen_kwargs", "max_gen_toks=6", "--batch_size", "1", "--data",
              "local", "--drift_prompts", "0"]
    cli.main(["evaluate", "--model", str(tiny_model_dir), "--output_path", str(initial), *common])
    again = module_tmp("reuse") / "eval"
    cli.main(["evaluate", "--model", str(out), "--baseline", str(initial), "--output_path", str(again), *common])
    reused = json.loads((again / "evaluate.json").read_text())
    assert [(r["task"], r["metric"], r["difference"], r["low"], r["noise_floor"]) for r in reused["paired"]] == \
        [(r["task"], r["metric"], r["difference"], r["low"], r["noise_floor"]) for r in summary["paired"]]
    assert not (again / "model").exists()  # nothing was run again
    assert "- summed over tasks, acc:" in capsys.readouterr().out


@pytest.mark.slow
def test_a_baseline_of_another_model_is_refused_in_one_line(evaluated_run, tmp_path, embedded_tokenizer, capsys):
    import main as cli
    from tests._tiny_models import save_tiny_llama

    ckpt, _, _ = evaluated_run
    other = save_tiny_llama(tmp_path / "other", embedded_tokenizer, hidden_size=48)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["evaluate", "--model", str(ckpt), "--baseline", str(other), "--tasks", "arc_easy", "--limit", "2",
                  "--output_path", str(tmp_path / "out"), "--data", "local"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --baseline {other}: another model than {ckpt} (hidden_size 32 vs 48")
    with pytest.raises(ConfigError, match="is a plain model, not a checkpoint"):
        from qat_app.eval.harness_models import Evaluated, load_baseline

        load_baseline("initial", Evaluated(None, None, "m", False), "cpu", "float32", False)


@pytest.mark.slow
@pytest.mark.skipif(not (__import__("qat_app.export.engine_check", fromlist=["x"]).DEFAULT_VENV / "bin" / "python").is_file(),
                    reason="no vLLM environment (make vllm-env)")
def test_the_served_int8_export_is_scored_on_the_same_documents_and_paired(module_tmp, tiny_corpus, embedded_tokenizer):
    import main as cli
    from tests._cli_runs import checkpointed_fit
    from tests._tiny_models import save_tiny_llama

    root = module_tmp("served_eval")
    model_dir = save_tiny_llama(root / "model", embedded_tokenizer, hidden_size=128, intermediate_size=256)  # head 64
    checkpointed_fit(root / "fit", model_dir, tiny_corpus)
    ckpt = root / "fit" / "ckpt" / "last.ckpt"
    cli.main(["export", "--ckpt_path", str(ckpt), "--out", str(root / "int8"), "--format", "compressed-tensors",
              "--serve_target", "cpu"])
    out = root / "eval"
    cli.main(["evaluate", "--model", str(ckpt), "--tasks", "arc_easy", "--limit", "4", "--output_path", str(out),
              "--baseline", "none", "--noise_floor_seeds", "none", "--data", "local", "--served", str(root / "int8"),
              "--served_timeout", "900"])
    summary = json.loads((out / "evaluate.json").read_text())
    served = summary["served"]
    from qat_app.export.engine_check import expected_cpu_kernels

    assert set(served["kernels"].values()) <= set(expected_cpu_kernels("cpu")) and served["kernels"]
    assert served["cost"]["documents"] == 4
    assert {(r["task"], r["metric"], r["n"]) for r in served["paired"]} == {("arc_easy", "acc", 4), ("arc_easy", "acc_norm", 4)}
    trained = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in _logged(out, "model", "arc_easy")}
    engine = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in served_samples(out)["arc_easy"]}
    assert trained.keys() == engine.keys()
    # int8 on the HiF8 grid, served in bfloat16: the same model within bfloat16's reach, not another model
    worst = max(abs(a - b) for d in trained for a, b in zip(trained[d], engine[d], strict=True))
    assert 0 < worst < 0.5


def served_samples(out):
    return json.loads((out / "served" / "samples.json").read_text())


@pytest.mark.slow
def test_the_report_takes_the_evaluation_beside_the_in_loop_benchmarks(evaluated_run, tmp_path, capsys):
    import main as cli
    from tests._report_fixtures import make_run, records

    _, out, summary = evaluated_run
    base_dir = make_run(tmp_path / "base", False, records("arc_challenge", [1, 0, 1, 1], 3))
    qat_dir = make_run(tmp_path / "qat", True, records("arc_challenge", [1, 0, 0, 1], 3))
    cli.main(["report", "--baseline", str(base_dir), "--qat", str(qat_dir), "--out", str(tmp_path / "report"),
              "--evaluations", str(out)])
    markdown = (tmp_path / "report" / "results.md").read_text()
    assert "## lm-eval tasks on the same models (`main.py evaluate`)" in markdown
    row = next(r for r in summary["paired"] if (r["task"], r["metric"]) == ("boolq", "acc"))
    assert (f"| boolq | acc | {row['after']:.4f} | {row['before']:.4f} | {row['difference']:+.4f} "
            f"[{row['low']:+.4f}, {row['high']:+.4f}]") in markdown
    written = json.loads((tmp_path / "report" / "results.json").read_text())
    assert written["evaluations"][0]["paired"] == summary["paired"]
    with pytest.raises(SystemExit):
        cli.main(["report", "--baseline", str(base_dir), "--qat", str(qat_dir), "--out", str(tmp_path / "r2"),
                  "--evaluations", str(tmp_path)])
    assert f"--evaluations: {tmp_path / 'evaluate.json'} not found" in capsys.readouterr().err


def test_a_sharded_checkpoint_is_the_same_w8a8_model_as_its_file(tmp_path, tiny_model_dir):
    from qat_app.eval.harness_models import load_evaluated
    from tests._tiny_models import save_qat_checkpoint, write_sharded

    file = save_qat_checkpoint(tmp_path / "m.ckpt", tiny_model_dir, precision="bf16-mixed")
    write_sharded(torch.load(file, weights_only=True), tmp_path / "m_dir")
    a, b = (load_evaluated(str(path), "cpu", "float32", False) for path in (file, tmp_path / "m_dir"))
    assert a.quantized and b.quantized and a.precision == b.precision == "bf16-mixed"
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), a.forward_context()():
        assert torch.equal(a.model(input_ids=ids).logits, b.model(input_ids=ids).logits)
    assert a.base == b.base == {"model_name": str(tiny_model_dir), "gguf_file": None, "dtype": "float32"}


def test_the_runs_precision_is_the_evaluations(tiny_llama):
    from qat_app.eval.harness_models import Evaluated, in_run_precision

    assert in_run_precision(tiny_llama, "32-true").lm_head.weight.dtype == torch.float32
    mixed = Evaluated(tiny_llama, None, "m", True, "bf16-mixed")
    with mixed.forward_context()():
        assert tiny_llama(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
    with Evaluated(tiny_llama, None, "m", True, "32-true").forward_context()():
        assert tiny_llama(input_ids=torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32
    assert in_run_precision(tiny_llama, "bf16-true").lm_head.weight.dtype == torch.bfloat16


def test_paths_are_checked_before_anything_loads(tmp_path, capsys):
    import main as cli

    (tmp_path / "file").write_text("x")
    for flags, message in ((["--output_path", str(tmp_path / "file")],
                            f"--output_path {tmp_path / 'file'}: a file, not a directory"),
                           (["--output_path", str(tmp_path / "o"), "--served", str(tmp_path)],
                            f"--served {tmp_path}: not an export (no config.json)")):
        with pytest.raises(SystemExit):
            cli.main(["evaluate", "--model", "/no/such/model", "--tasks", "arc_easy", *flags])
        assert capsys.readouterr().err.strip() == f"error: {message}" + (
            "" if "served" not in message else "; write one with `main.py export --format compressed-tensors`")
