"""The case table: mistakes a tired user makes, each run through the command line (``main.py``'s ``main``).

Every row asserts what the user sees and what is left on disk: the exit code (2 for input errors), exactly
one ``error: ...`` line naming the field, flag or file (with the allowed values or the nearest valid name
where there is one), no traceback (``main`` is called in-process: an exception that escapes it fails the
row), and the run directory byte-identical afterwards (no new file or folder, nothing rewritten). Rows:
settings, data files, models, checkpoints and resumes, export, report, evaluation. The "bad input"
section of docs/runs.md says what is refused and what is handled (e.g. non-string text rows are skipped, counted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil

import pytest
import torch
import yaml

import main as cli
from tests._cli_runs import write_config

ALGOS = "most_recent, exp_smooth, max, current"
BENCH = "qat_app.data.benchmarks.BenchmarkDataModule"


def _main(argv, capsys) -> tuple[int, str]:
    """-> (exit code, stderr) of ``python main.py ARGV``."""
    capsys.readouterr()
    try:
        cli.main(list(map(str, argv)))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, capsys.readouterr().err


def _tree(directory) -> dict[str, tuple]:
    """Every file (size, mtime, sha1) and folder under ``directory``."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), directory) + "/"] = ()
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, directory)] = (os.path.getsize(p), os.stat(p).st_mtime_ns,
                                                      hashlib.sha1(f.read()).hexdigest())
    return out


def assert_refused(code: int, err: str, pattern: str, expected_code: int = 2) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == expected_code, f"exit code {code}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1, err[-3000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err
    return lines[0]


def _refused_without_writing(argv, directory, pattern, capsys, expected_code=2) -> str:
    before = _tree(directory)
    line = assert_refused(*_main(argv, capsys), pattern, expected_code)
    assert _tree(directory) == before, "the run directory changed"
    return line


# --------------------------------------------------------------------------------------------- settings
def _bench(**init_args) -> list[str]:
    return ["--data.init_args.benchmarks", json.dumps({"class_path": BENCH, "init_args": {"source": "local", **init_args}})]


SETTING_ROWS = [
    ("unknown amax algorithm", ["--model.quant.amax_algo", "median"], rf"model\.quant\.amax_algo=median: expected one of {ALGOS}$"),
    ("misspelled amax algorithm", ["--model.quant.amax_algo", "mx"], r"amax_algo=mx: .*\(did you mean max\?\)"),
    ("unknown format", ["--model.quant.format", "int8"], r"quant\.format: unknown format 'int8'; allowed: e4m3, e5m2, hif8"),
    ("history_len < 1", ["--model.quant.history_len", "0"], r"quant\.history_len: must be an integer >= 1, got 0"),
    ("alpha = 0", ["--model.quant.alpha", "0"], r"quant\.alpha: must be in \(0, 1\], got 0"),
    ("alpha > 1", ["--model.quant.alpha", "1.5"], r"quant\.alpha: must be in \(0, 1\], got 1\.5"),
    ("max_val = 0", ["--model.quant.max_val", "0"], r"quant\.max_val: must be in \(0, 32768\]"),
    ("max_val < 0", ["--model.quant.max_val", "-1"], r"quant\.max_val: must be in \(0, 32768\]"),
    ("high_precision_layers > blocks", ["--model.quant.high_precision_layers", "4"],
     r"quant\.high_precision_layers: 4 is larger than the model's 3 blocks"),
    ("module pattern matches nothing", ["--model.quant.module_pattern", r"\.mlp\.nothing$"],
     r"quant\.module_pattern .*nothing.* matches no linear layer of LlamaForCausalLM; linear layers look like"),
    ("module pattern only in high-precision blocks", ["--model.quant.module_pattern", r"layers\.0\.mlp\.up_proj$"],
     r"quant\.module_pattern .* matches no linear layer inside the quantized blocks .*high_precision_layers=1"),
    ("invalid module regex", ["--model.quant.module_pattern", "mlp.(("], r"quant\.module_pattern: not a valid regular expression"),
    ("block pattern without group", ["--model.quant.block_pattern", r"layers\.\d+"], r"quant\.block_pattern: needs one capturing group"),
    ("quant flag misspelled", ["--model.quant.histroy_len", "5"], r"unknown flag --model\.quant\.histroy_len \(did you mean --model\.quant\.history_len\?\)"),
    ("warmup longer than the run", ["--warmup.warmup_steps", "6"], r"warmup\.warmup_steps \(6\) must be smaller than trainer\.max_steps \(6\)"),
    ("negative warmup", ["--warmup.warmup_steps", "-1"], r"warmup\.warmup_steps: must be >= 0"),
    ("warmup not a number", ["--warmup.warmup_steps", "five"], r"warmup\.warmup_steps=five: expected an int"),
    ("global batch not a multiple of micro-batch", ["--data.init_args.global_batch_size", "5"],
     r"data\.global_batch_size=5 is not divisible by data\.micro_batch_size=2 x devices=1"),
    ("global batch not a multiple of micro-batch x devices", ["--trainer.devices", "2", "--data.init_args.global_batch_size", "6"],
     r"data\.global_batch_size=6 is not divisible by data\.micro_batch_size=2 x devices=2"),
    ("global batch 0", ["--data.init_args.global_batch_size", "0"], r"data\.global_batch_size"),
    ("zero micro-batch", ["--data.init_args.micro_batch_size", "0"], r"data\.micro_batch_size must be a positive integer, got 0"),
    ("seq_len < 2", ["--data.init_args.seq_len", "1"], r"data\.seq_len must be an integer >= 2, got 1"),
    ("negative val_documents", ["--data.init_args.val_documents", "-1"], r"data\.val_documents must be a non-negative integer, got -1"),
    ("negative LM validation limit", ["--data.init_args.limit_val_batches", "-1"],
     r"data\.limit_val_batches must be null, a number of batches >= 0 or a fraction in \[0, 1\], got -1"),
    ("LM validation limit given twice", ["--trainer.limit_val_batches", "2", "--data.init_args.limit_val_batches", "3"],
     r"trainer\.limit_val_batches=2 and data\.init_args\.limit_val_batches=3: both limit the held-out LM validation; set one$"),
    ("LM validation limit that keeps no batch", ["--trainer.limit_val_batches", "0.01"],
     r"data\.limit_val_batches=0\.01 keeps none of the \d+ held-out LM batches a rank; raise it, or 0 for none"),
    ("negative num_workers", ["--data.init_args.num_workers", "-1"], r"data\.num_workers must be a non-negative integer, got -1"),
    ("max_documents 0", ["--data.init_args.max_documents", "0"], r"data\.max_documents must be a positive integer or None, got 0"),
    ("unknown text_sample_by", ["--data.init_args.text_sample_by", "word"], r"data\.text_sample_by must be paragraph/line/document, got 'word'"),
    ("unknown embedded dataset", ["--data.init_args.data_files", "null", "--data.init_args.dataset", "embedded:wiki"],
     r"data\.dataset: unknown embedded dataset 'embedded:wiki'; known: 'embedded:boolq-passages'"),
    ("no dataset and no files", ["--data.init_args.data_files", "null", "--data.init_args.dataset", "null"],
     r"set data\.dataset .* or data\.data_files"),
    ("data flag misspelled", ["--data.init_args.seq_length", "64"], r"data\.init_args\.seq_length: PretrainDataModule has no such setting \(did you mean data\.init_args\.seq_len\?\)"),
    ("lr <= 0", ["--model.lr", "0"], r"model\.lr: must be > 0, got 0"),
    ("lr not a number", ["--model.lr", "1e-4x"], r"model\.lr=1e-4x: expected a float"),
    ("unknown lr schedule", ["--model.lr_schedule", "linear"], r"model\.lr_schedule=linear: expected one of cosine, constant"),
    ("cosine schedule without max_steps", ["--trainer.max_steps", "-1", "--model.lr_schedule", "cosine"],
     r"model\.lr_schedule=cosine needs trainer\.max_steps > 0"),
    ("negative lr warmup", ["--model.lr_warmup_steps", "-1"], r"model\.lr_warmup_steps: must be >= 0, got -1"),
    ("min_lr_ratio > 1", ["--model.min_lr_ratio", "2"], r"model\.min_lr_ratio: must be in \[0, 1\], got 2"),
    ("non-finite limit < 1", ["--model.max_consecutive_nonfinite", "0"], r"model\.max_consecutive_nonfinite: must be an integer >= 1, got 0"),
    ("unknown model flag", ["--model.lrr", "1e-4"], r"unknown flag --model\.lrr \(did you mean --model\.lr\?\)"),
    ("max_steps not a number", ["--trainer.max_steps", "abc"], r"trainer\.max_steps=abc: expected an int$"),
    ("misspelled precision", ["--trainer.precision", "16-mixd"], r"trainer\.precision=16-mixd: expected one of .*bf16-mixed.*\(did you mean 16-mixed\?\)"),
    ("misspelled bf16 precision", ["--trainer.precision", "bf16-mix"], r"trainer\.precision=bf16-mix: .*\(did you mean bf16-mixed\?\)"),
    ("misspelled data class_path", ["--data.class_path", "qat_app.data.pretrain.PretrainDataModul"],
     r"data\.class_path=qat_app\.data\.pretrain\.PretrainDataModul: no such class \(did you mean qat_app\.data\.pretrain\.PretrainDataModule\?\)"),
    ("misspelled logger class_path", ["--trainer.logger.class_path", "CSVLoger"],
     r"trainer\.logger\.class_path=CSVLoger: no such class \(did you mean lightning\.pytorch\.loggers\.CSVLogger\?\)"),
    ("gpu on a machine without one", ["--trainer.accelerator", "gpu"], r"trainer\.accelerator=gpu, but torch sees no CUDA GPU"),
    ("3 gpus on a machine without one", ["--trainer.accelerator", "gpu", "--trainer.devices", "3"], r"trainer\.accelerator=gpu, but torch sees no CUDA GPU"),
    ("cuda on a machine without one", ["--trainer.accelerator", "cuda", "--trainer.devices", "8", "--data.init_args.global_batch_size", "16"],
     r"trainer\.accelerator=cuda, but torch sees no CUDA GPU"),
    ("misspelled accelerator", ["--trainer.accelerator", "gpuu"], r"trainer\.accelerator=gpuu: unknown; expected one of .*\(did you mean gpu\?\)"),
    ("misspelled strategy", ["--trainer.strategy", "dpp"], r"trainer\.strategy=dpp: unknown.*\(did you mean ddp\?\)"),
    ("float8 storage dtype", ["--model.dtype", "float8"], r"model\.dtype='float8' is not a floating point dtype .*bfloat16.*float32"),
    ("integer dtype", ["--model.dtype", "int8"], r"model\.dtype='int8' is not a floating point dtype"),
    ("missing absolute model dir", ["--model.model_name", "/no/such/model"], r"model\.model_name=/no/such/model: no such directory"),
    ("missing relative model dir", ["--model.model_name", "./my-model"], r"model\.model_name=\./my-model: no such directory \(relative to "),
    ("missing dir that looks like a hub id", ["--model.model_name", "models/no-such-model-dir"],
     r"model\.model_name='models/no-such-model-dir': there is no such directory \(relative to .*\), and as a Hugging Face Hub id it could not be loaded"),
    ("gguf_file with the embedded model", ["--model.model_name", "embedded:smollm2-135m-instruct", "--model.gguf_file", "nope.gguf"],
     r"model\.gguf_file='nope\.gguf' cannot be used with model\.model_name='embedded:smollm2-135m-instruct'"),
    ("unknown embedded model", ["--model.model_name", "embedded:llama-7b"], r"unknown embedded model 'embedded:llama-7b'; known: embedded:smollm2-135m-instruct"),
    ("benchmark task unknown", _bench(tasks=["mmlu_proo"]),
     r"data\.benchmarks\.tasks: unknown benchmark task 'mmlu_proo'; known tasks: arc_challenge, hellaswag, mmlu or any "
     r"lm-eval task \(did you mean mmlu_pro\?\)"),
    ("benchmark tasks empty", _bench(tasks=[]), r"data\.benchmarks\.tasks is empty; choose from arc_challenge, hellaswag, mmlu"),
    ("benchmark task twice", _bench(tasks=["mmlu", "mmlu"]), r"data\.benchmarks\.tasks has repeats"),
    ("benchmark limit 0", _bench(tasks=["arc_challenge"], limit=0), r"data\.benchmarks\.limit for arc_challenge must be a positive integer or null \(all docs\), got 0"),
    ("benchmark limit negative", _bench(tasks=["arc_challenge"], limit=-3), r"data\.benchmarks\.limit for arc_challenge must be a positive integer .*got -3"),
    ("benchmark limit for a task not run", _bench(tasks=["arc_challenge"], limit={"hellaswag": 5}),
     r"data\.benchmarks\.limit names task\(s\) \['hellaswag'\] that are not in tasks=\['arc_challenge'\]"),
    ("unknown MMLU subject", _bench(tasks=["mmlu"], mmlu_subjects=["astronomyy"]),
     r"data\.benchmarks\.mmlu_subjects: unknown MMLU subject\(s\) astronomyy \(did you mean: astronomyy -> astronomy\?\)"),
    ("MMLU subjects empty", _bench(tasks=["mmlu"], mmlu_subjects=[]), r"data\.benchmarks\.mmlu_subjects is empty; pass null for all 57 subjects"),
    ("MMLU 6-shot", _bench(tasks=["mmlu"], num_fewshot=6), r"data\.benchmarks\.num_fewshot for mmlu must be in \[0, 5\), got 6"),
    ("few-shot for a task not run", _bench(tasks=["mmlu"], num_fewshot={"arc_challenge": 1}),
     r"data\.benchmarks\.num_fewshot names task\(s\) \['arc_challenge'\] that are not in tasks=\['mmlu'\]"),
    ("ARC few-shot offline", _bench(tasks=["arc_challenge"], num_fewshot=2, limit=3),
     r"arc_challenge: no local copy of split 'train' .*set source='hub' where the hub is reachable"),
    ("benchmark batch 0", _bench(tasks=["arc_challenge"], batch_size=0), r"data\.benchmarks\.batch_size \(0\) and max_length \(2048\) must be positive"),
    ("benchmark source unknown", _bench(tasks=["arc_challenge"], source="web"), r"data\.benchmarks\.source must be 'auto', 'hub' or 'local', got 'web'"),
    ("benchmark limit_mode unknown", _bench(tasks=["arc_challenge"], limit_mode="last"), r"limit_mode=last: expected one of sample, first"),
    ("doc_ids of a task not run", _bench(tasks=["arc_challenge"], doc_ids={"hellaswag": [1]}), r"data\.benchmarks\.doc_ids: hellaswag not among the evaluated tasks"),
    ("doc_ids out of range", _bench(tasks=["arc_challenge"], doc_ids={"arc_challenge": [3, 5000]}),
     r"data\.benchmarks\.doc_ids\.arc_challenge: \[5000\] out of range for 299 docs"),
    ("forgetting measure misspelled", ["--forgetting.measures", '["acc_nrom"]'],
     r"forgetting\.measures: unknown measure 'acc_nrom' \(did you mean acc_norm\?\); known measures: acc, acc_norm"),
    ("forgetting level 0", ["--forgetting.level", "0"], r"forgetting\.level: .* must lie in \(0, 1\), got 0"),
    ("forgetting level > 1", ["--forgetting.level", "1.5"], r"forgetting\.level: .* must lie in \(0, 1\), got 1\.5"),
    ("negative KL budget", ["--forgetting.kl_budget", "-0.1"], r"forgetting\.kl_budget: must be a number >= 0 \(nats\) or null, got -0\.1"),
    ("negative kl_choices budget", ["--forgetting.kl_choices_budget", "-1"], r"forgetting\.kl_choices_budget: must be a number >= 0"),
    ("unknown forgetting action", ["--forgetting.action", "halt"], r"forgetting\.action=halt: expected one of warn, stop"),
    ("forgetting monitor without benchmarks", ["--forgetting.enabled", "true"],
     r"forgetting\.enabled: true needs benchmarks to compare \(data\.benchmarks is not set\)"),
    ("forgetting monitor without the initial evaluation",
     [*_bench(tasks=["arc_challenge"], limit=3), "--initial_eval.enabled", "false", "--forgetting.enabled", "true"],
     r"forgetting\.enabled: true compares with the initial evaluation, but initial_eval\.enabled is false"),
    ("forgetting task not evaluated", [*_bench(tasks=["arc_challenge"], limit=3), "--forgetting.tasks", '["arc_challeng"]'],
     r"forgetting\.tasks: unknown task 'arc_challeng' \(did you mean arc_challenge\?\); evaluated tasks: arc_challenge$"),
    ("alarms window < 3", ["--alarms.window", "2"], r"alarms\.window: must be an integer >= 3 \(steps\), got 2"),
    ("alarms z threshold 0", ["--alarms.z_threshold", "0"], r"alarms\.z_threshold: must be a number > 0, got 0"),
    ("alarms min_history over the window", ["--alarms.window", "8", "--alarms.min_history", "9"],
     r"alarms\.min_history: must be an integer from 3 to alarms\.window \(8\), got 9"),
    ("unknown alarms action", ["--alarms.action", "halt"], r"alarms\.action=halt: expected one of warn, stop"),
    ("run_dir outside the config's paths", ["--trainer.logger.init_args.save_dir", "/elsewhere/logs", "--run_dir", "somewhere"],
     r"--run_dir somewhere: trainer\.logger\[0\]\.init_args\.save_dir=/elsewhere/logs is not under trainer\.default_root_dir"),
]


@pytest.mark.parametrize("args", [r[1] for r in SETTING_ROWS], ids=[r[0] for r in SETTING_ROWS])
def test_bad_setting(args, tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    pattern = next(r[2] for r in SETTING_ROWS if r[1] is args)
    _refused_without_writing(["fit", "--config", config, *args], tmp_path, pattern, capsys)


# ---------------------------------------------------------------------------------------- config files
CONFIG_FILE_ROWS = [
    ("YAML syntax error", "trainer:\n  max_steps: [1\n", r"--config .*bad\.yaml: not valid YAML at line 3, column 1"),
    ("YAML tab indentation", "trainer:\n\tmax_steps: 1\n", r"--config .*bad\.yaml: not valid YAML at line 2"),
    ("empty config file", "", r"--config .*bad\.yaml: the config file is empty"),
    ("only comments", "# nothing here\n", r"--config .*bad\.yaml: the config file is empty"),
    ("a list, not settings", "- fit\n- model\n", r"--config .*bad\.yaml: expected a mapping of settings"),
    ("unknown section", "modle:\n  lr: 1.0e-4\n", r"modle"),
    ("unknown model key", "model:\n  lrr: 1.0e-4\n", r"lrr"),
]


@pytest.mark.parametrize("text,pattern", [r[1:] for r in CONFIG_FILE_ROWS], ids=[r[0] for r in CONFIG_FILE_ROWS])
def test_bad_config_file(text, pattern, tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    _refused_without_writing(["fit", "--config", config, "--config", bad], tmp_path, pattern, capsys)


def test_missing_config_file(tmp_path, capsys):
    _refused_without_writing(["fit", "--config", tmp_path / "nope.yaml"], tmp_path, r"--config .*nope\.yaml: no such file", capsys)


# ------------------------------------------------------------------------------------------------ models
def _model_dir(kind: str, good, d):
    """A broken copy of the tiny model directory."""
    target = d / kind.replace(" ", "_")
    shutil.copytree(good, target)
    if kind == "no weights":
        for f in target.glob("*.safetensors"):
            f.unlink()
    elif kind == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
            (target / name).unlink(missing_ok=True)
    elif kind == "no config":
        (target / "config.json").unlink()
    elif kind == "a file":
        shutil.rmtree(target)
        target = d / "model.safetensors"
        shutil.copy(next(good.glob("*.safetensors")), target)
    elif kind == "nan weights":
        from safetensors.torch import load_file, save_file

        weights = next(target.glob("*.safetensors"))
        state = load_file(weights)
        key = next(k for k in state if k.endswith("mlp.up_proj.weight"))
        state[key][0, 0] = float("nan")
        save_file(state, weights, metadata={"format": "pt"})
    elif kind == "missing gguf":
        return target, ["--model.gguf_file", "model.Q8_0.gguf"]
    return target, []


MODEL_ROWS = [
    ("no weights", r"model\.model_name=.*no_weights is not a loadable model directory: it has no weights"),
    ("no tokenizer", r"model\.model_name=.*no_tokenizer is not a loadable model directory: it has no tokenizer files"),
    ("no config", r"model\.model_name=.*no_config is not a loadable model directory: it has no config\.json"),
    ("a file", r"model\.model_name=.*model\.safetensors is a file; give the model's directory"),
    ("nan weights", r"model\.model_name=.*nan_weights: 1 of \d+ weight tensors hold NaN or inf \(first: .*up_proj\.weight\)"),
    ("missing gguf", r"model\.gguf_file='model\.Q8_0\.gguf' is not in .*missing_gguf \(it holds no \.gguf file\)"),
]


@pytest.mark.parametrize("kind,pattern", MODEL_ROWS, ids=[r[0] for r in MODEL_ROWS])
def test_bad_model(kind, pattern, tmp_path, tiny_model_dir, tiny_corpus, capsys):
    model, extra = _model_dir(kind, tiny_model_dir, tmp_path)
    config = write_config(tmp_path, model, tiny_corpus)
    _refused_without_writing(["fit", "--config", config, *extra], tmp_path, pattern, capsys)


# -------------------------------------------------------------------------------------------------- data
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _make_data(kind: str, d) -> str:
    good = [{"text": f"Document {i}: the model learns the amax history of every block."} for i in range(40)]
    if kind == "missing text column":
        _jsonl(d / "body.jsonl", [{"body": r["text"]} for r in good])
        return str(d / "body.jsonl")
    if kind == "empty file":
        (d / "empty.jsonl").write_text("")
        return str(d / "empty.jsonl")
    if kind == "unreadable jsonl":
        (d / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "unterminated\n' * 20)
        return str(d / "broken.jsonl")
    if kind == "unreadable parquet":
        (d / "corrupt.parquet").write_bytes(b"PAR1" + os.urandom(256))
        return str(d / "corrupt.parquet")
    if kind == "only empty documents":
        _jsonl(d / "blank.jsonl", [{"text": "   "} for _ in range(40)])
        return str(d / "blank.jsonl")
    if kind == "only non-string text":
        _jsonl(d / "numbers.jsonl", [{"text": i} for i in range(40)])
        return str(d / "numbers.jsonl")
    if kind == "missing file":
        return str(d / "nope.jsonl")
    if kind == "pattern matches nothing":
        return str(d / "shards-*.jsonl")
    if kind == "unsupported extension":
        (d / "data.csv").write_text("text\nhello\n")
        return str(d / "data.csv")
    if kind == "a directory of nothing":
        (d / "empty_dir").mkdir()
        return str(d / "empty_dir")
    raise AssertionError(kind)


DATA_ROWS = [
    ("missing text column", r"body\.jsonl.*no column 'text' \(data\.text_column\); columns found: \['body'\]"),
    ("empty file", r"empty\.jsonl is empty \(0 bytes\)"),
    ("unreadable jsonl", r"could not read .*broken\.jsonl"),
    ("unreadable parquet", r"corrupt\.parquet"),
    ("only empty documents", r"blank\.jsonl.*every document in column 'text' is empty"),
    ("only non-string text", r"numbers\.jsonl .* is empty \(no documents\): all 40 rows' 'text' are not strings"),
    ("missing file", r"data file '.*nope\.jsonl' does not exist"),
    ("pattern matches nothing", r"data_files pattern '.*shards-\*\.jsonl' matched no files"),
    ("unsupported extension", r"data\.csv: unsupported extension '\.csv'"),
    ("a directory of nothing", r"empty_dir"),
]


@pytest.mark.parametrize("kind,pattern", DATA_ROWS, ids=[r[0] for r in DATA_ROWS])
def test_bad_data_file(kind, pattern, tmp_path, tiny_model_dir, tiny_corpus, capsys):
    data = tmp_path / "data"
    data.mkdir()
    path = _make_data(kind, data)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "data.init_args.data_files": path, "data.init_args.val_documents": 0, "trainer.max_steps": 2,
        "warmup.warmup_steps": 1})
    _refused_without_writing(["fit", "--config", config], tmp_path, pattern, capsys)


def test_dirty_but_usable_data_trains_and_says_what_it_skipped(tmp_path, tiny_model_dir, caplog, capsys):
    """Rows whose text is null / a number / a list are skipped and counted (docs/runs.md says so); a document
    that tokenises to nothing is skipped with a warning naming it."""
    data = tmp_path / "data"
    data.mkdir()
    docs = [{"text": f"Document {i}: the model learns the amax history of every block."} for i in range(60)]
    docs[3], docs[8], docs[20], docs[30] = {"text": 7}, {"text": None}, {"text": ["a", "list"]}, {"text": " \n "}
    _jsonl(data / "mixed.jsonl", docs)
    config = write_config(tmp_path, tiny_model_dir, data / "mixed.jsonl", **{
        "data.init_args.val_documents": 4, "trainer.max_steps": 2, "warmup.warmup_steps": 1,
        "data.init_args.shuffle": False})
    with caplog.at_level(logging.WARNING):
        code, err = _main(["fit", "--config", config], capsys)
    assert code == 0, err[-3000:]
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"mixed\.jsonl: skipping rows whose 'text' is not a string \(the first: row 3, type int\)", m)
               for m in messages), messages
    assert any(re.search(r"mixed\.jsonl.*is empty or tokenises to nothing; skipped", m) for m in messages), messages
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()


# ------------------------------------------------------------------------------------ checkpoints, resume
@pytest.fixture(scope="module")
def finished_run(module_tmp, tiny_model_dir, tiny_corpus):
    """A 2-step run with its checkpoints, logs and config.yaml (the run a bad resume must not damage)."""
    run_dir = module_tmp("run")
    config = write_config(run_dir, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 2, "warmup.warmup_steps": 1})
    cli.cli_main(["fit", "--config", config])
    assert (run_dir / "ckpt" / "last.ckpt").exists() and (run_dir / "logs" / "version_0" / "config.yaml").exists()
    return run_dir, config


@pytest.fixture(scope="module")
def other_model_run(module_tmp, tiny_corpus, embedded_tokenizer):
    """A finished run of another (wider) model."""
    from tests._tiny_models import save_tiny_llama

    base = module_tmp("other")
    save_tiny_llama(base / "model", embedded_tokenizer, hidden_size=48, intermediate_size=96, seed=1)
    config = write_config(base, base / "model", tiny_corpus, **{"trainer.max_steps": 2, "warmup.warmup_steps": 1})
    cli.cli_main(["fit", "--config", config])
    return base / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def unquantized_run(module_tmp, tiny_model_dir, tiny_corpus):
    base = module_tmp("unquantized")
    config = write_config(base, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 2, "warmup.warmup_steps": 0,
                                                                "model.quant.enabled": False})
    cli.cli_main(["fit", "--config", config])
    return base / "ckpt" / "last.ckpt"


def _make_checkpoint(kind: str, good: str, d) -> str:
    path = d / f"{kind.replace(' ', '_')}.ckpt"
    raw = open(good, "rb").read()
    if kind == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "foreign file":
        path.write_text("this is not a checkpoint\n")
    elif kind == "plain state_dict":
        torch.save(torch.load(good, weights_only=True)["state_dict"], path)
    elif kind == "weights only":
        ckpt = torch.load(good, weights_only=True)
        for key in ("optimizer_states", "lr_schedulers", "loops"):
            ckpt.pop(key)
        torch.save(ckpt, path)
    elif kind == "other program":  # a Lightning checkpoint of some other LightningModule
        ckpt = torch.load(good, weights_only=True)
        ckpt.pop("qat_app")
        ckpt["hyper_parameters"] = {"hidden_dim": 64, "learning_rate": 0.1}
        torch.save(ckpt, path)
    elif kind == "other settings":  # a QATModule checkpoint of a run with quant.history_len=3
        ckpt = torch.load(good, weights_only=True)
        ckpt["state_dict"] = {k: (v[:3] if k.endswith("amax_history") else v) for k, v in ckpt["state_dict"].items()}
        ckpt["hyper_parameters"]["quant"]["history_len"] = 3
        torch.save(ckpt, path)
    elif kind == "a directory":
        path = d / "ckpt_dir"
        path.mkdir()
        shutil.copy(good, path / "last.ckpt")
    elif kind == "missing":
        pass
    else:
        raise AssertionError(kind)
    return str(path)


CKPT_ROWS = [
    ("truncated", r"truncated\.ckpt cannot be read .*truncated"),
    ("empty", r"empty\.ckpt is empty \(0 bytes\)"),
    ("foreign file", r"foreign_file\.ckpt cannot be read"),
    ("plain state_dict", r"plain_state_dict\.ckpt is not a Lightning training checkpoint"),
    ("weights only", r"weights_only\.ckpt lacks optimizer_states, lr_schedulers, loops"),
    ("other program", r"other_program\.ckpt was not written by this application's QATModule: hyperparameters "
                      r"hidden_dim, learning_rate are not QATModule's"),
    ("other settings", r"other_settings\.ckpt does not belong to this model .*other shape: .*amax_history \(3,\) in the "
                       r"checkpoint vs \(5,\) now.*model\.quant\.history_len: 3 -> 5"),
    ("a directory", r"--ckpt_path .*ckpt_dir is a directory, not a checkpoint file .*it holds last\.ckpt: give one of them"),
    ("missing", r"missing\.ckpt does not exist"),
]


@pytest.mark.parametrize("kind,pattern", CKPT_ROWS, ids=[r[0] for r in CKPT_ROWS])
def test_bad_checkpoint_is_refused_and_nothing_is_overwritten(kind, pattern, finished_run, tmp_path, capsys):
    run_dir, config = finished_run
    bad = _make_checkpoint(kind, str(run_dir / "ckpt" / "last.ckpt"), tmp_path)
    _refused_without_writing(["fit", "--config", config, "--ckpt_path", bad], run_dir, pattern, capsys)


def test_checkpoint_of_another_model_is_refused(finished_run, other_model_run, capsys):
    run_dir, config = finished_run
    _refused_without_writing(["fit", "--config", config, "--ckpt_path", other_model_run], run_dir,
                             r"last\.ckpt does not belong to this model .*other shape: .* in the checkpoint vs .* now",
                             capsys)


def test_checkpoint_of_an_unquantized_run_is_refused(finished_run, unquantized_run, capsys):
    run_dir, config = finished_run
    _refused_without_writing(["fit", "--config", config, "--ckpt_path", unquantized_run], run_dir,
                             r"last\.ckpt does not belong to this model.*missing: .*amax_history.*model\.quant\.enabled: False -> True",
                             capsys)


def _copy_run(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    text = (run_dir / "config.yaml").read_text().replace(str(run_dir), str(copy))  # the same run, in the copy
    (copy / "config.yaml").write_text(text)
    return copy


LAST_ROWS = [
    # the job died while writing last.ckpt, and every older checkpoint is gone too
    ("truncated", r"--ckpt_path last: no checkpoint in .* can resume this run; the newest: .*last\.ckpt cannot be read .*truncated"),
    # the run directory holds a checkpoint of a run with other settings than the config resumed with
    ("other settings", r"last\.ckpt does not belong to this model .*: other shape: .*amax_history \(3,\) in the "
                       r"checkpoint vs \(5,\) now.*settings that differ \(checkpoint -> now\): model\.quant\.history_len: 3 -> 5"),
]


@pytest.mark.parametrize("kind,pattern", LAST_ROWS, ids=[r[0] for r in LAST_ROWS])
def test_bad_last_checkpoint_is_refused_and_nothing_is_overwritten(kind, pattern, finished_run, tmp_path, capsys):
    copy = _copy_run(finished_run[0], tmp_path)
    last = copy / "ckpt" / "last.ckpt"
    # every other checkpoint of the run is unusable too (else --ckpt_path last falls back to the newest
    # intact one: tests/test_resume_fallback.py); written before last.ckpt, so last.ckpt stays the newest
    for other in (copy / "ckpt").glob("*.ckpt"):
        if other.name != "last.ckpt":
            other.write_bytes(b"")
    if kind == "truncated":
        raw = last.read_bytes()
        last.write_bytes(raw[: len(raw) - 4096])
    else:
        shutil.move(_make_checkpoint(kind, str(last), tmp_path), last)
    os.utime(last)
    _refused_without_writing(["fit", "--config", copy / "config.yaml", "--ckpt_path", "last"], copy, pattern, capsys)


CHANGED_ON_RESUME = [
    ("seq_len", ["--data.init_args.seq_len", "16"], r"data\.seq_len: 32 -> 16"),
    ("micro-batch", ["--data.init_args.micro_batch_size", "1"], r"data\.micro_batch_size: 2 -> 1"),
    ("num_workers", ["--data.init_args.num_workers", "1"], r"data\.num_workers: 0 -> 1.*devices x data\.num_workers .*: 1 -> 1|data\.num_workers: 0 -> 1"),
    ("val_documents", ["--data.init_args.val_documents", "2"], r"data\.val_documents: 4 -> 2"),
    ("warmup steps", ["--warmup.warmup_steps", "0"], r"warmup\.warmup_steps: 1 -> 0"),
    ("amax algorithm", ["--model.quant.amax_algo", "most_recent"], r"model\.quant\.amax_algo: 'max' -> 'most_recent'"),
    ("dtype", ["--model.dtype", "bfloat16"], r"model\.dtype: 'float32' -> 'bfloat16'"),
]


@pytest.mark.parametrize("how", ["last", "file"])
@pytest.mark.parametrize("args,pattern", [r[1:] for r in CHANGED_ON_RESUME], ids=[r[0] for r in CHANGED_ON_RESUME])
def test_changed_run_settings_on_resume_are_refused(args, pattern, how, finished_run, tmp_path, capsys):
    """``--ckpt_path last`` and ``--ckpt_path FILE`` mean the same: continue the saved run; a setting that
    defines it (model, data, warmup) cannot change, and the message names it with both values."""
    copy = _copy_run(finished_run[0], tmp_path)
    ckpt = "last" if how == "last" else copy / "ckpt" / "last.ckpt"
    line = _refused_without_writing(["fit", "--config", copy / "config.yaml", "--ckpt_path", ckpt, *args], copy,
                                    r"checkpoint .*last\.ckpt was saved with other settings, which a resume cannot change",
                                    capsys)
    assert re.search(pattern, line), line
    assert "start a new run" in line


def test_changed_lr_on_resume_is_used_with_a_warning(finished_run, tmp_path, capsys, caplog):
    copy = _copy_run(finished_run[0], tmp_path)
    with caplog.at_level(logging.WARNING):
        code, err = _main(["fit", "--config", copy / "config.yaml", "--ckpt_path", copy / "ckpt" / "last.ckpt",
                           "--trainer.max_steps", "3", "--model.lr", "2e-3"], capsys)
    assert code == 0, err[-3000:]
    assert any("model.lr: 0.001 -> 0.002" in r.getMessage() and "new values are used" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------------------------------------- evaluation
def test_validate_refuses_a_quantized_model_without_history(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    """Scores of a fresh quantized model would depend on the batch size (each batch its own scale)."""
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    _refused_without_writing(["validate", "--config", config], tmp_path,
                             r"validate: model\.quant\.enabled=true but the \d+ quantized layers have no amax history yet.*"
                             r"--model\.quant\.enabled false.*--ckpt_path", capsys)
    code, err = _main(["validate", "--config", config, "--model.quant.enabled", "false"], capsys)
    assert code == 0, err[-3000:]  # the unquantized model is evaluated as asked


# ---------------------------------------------------------------------------------------- export, report
EXPORT_ROWS = [  # (flags replacing the defaults --ckpt_path <the run's last.ckpt> --out <tmp>/export, extra flags)
    ("float8 storage dtype", {"--dtype": "float8"}, [], r"--dtype='float8' is not a floating point dtype"),
    ("integer compute dtype", {"--compute_dtype": "int8"}, [], r"--compute_dtype='int8' is not a floating point dtype"),
    ("missing checkpoint", {"--ckpt_path": "{run}/nope.ckpt"}, [], r"nope\.ckpt does not exist"),
    ("truncated checkpoint", {"--ckpt_path": "{truncated}"}, [], r"half\.ckpt cannot be read"),
    ("into the run directory", {"--out": "{run}"}, ["--overwrite"],
     r"run0: --overwrite only replaces an earlier export, and it holds files of a run \(.*last\.ckpt, config\.yaml\)"),
    ("into the checkpoint folder", {"--out": "{run}/ckpt"}, ["--overwrite"],
     r"run0/ckpt: --overwrite only replaces an earlier export, and it holds files of a run"),
    ("non-empty folder without --overwrite", {"--out": "{run}/logs"}, [], r"already exists and is not empty; pass --overwrite"),
]


@pytest.mark.parametrize("flags,extra,pattern", [r[1:] for r in EXPORT_ROWS], ids=[r[0] for r in EXPORT_ROWS])
def test_bad_export(flags, extra, pattern, finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    truncated = tmp_path / "half.ckpt"
    raw = (run_dir / "ckpt" / "last.ckpt").read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2])
    given = {"--ckpt_path": str(run_dir / "ckpt" / "last.ckpt"), "--out": str(tmp_path / "export"),
             **{k: v.format(run=run_dir, truncated=truncated) for k, v in flags.items()}}
    argv = ["export", *[x for kv in given.items() for x in kv], *extra]
    _refused_without_writing(argv, run_dir, pattern, capsys)
    assert not (tmp_path / "export").exists()


REPORT_ROWS = [
    ("missing baseline", ["--baseline", "{tmp}/nope", "--qat", "{run}"], r"nope: no such run directory"),
    ("a directory without logs", ["--baseline", "{tmp}", "--qat", "{run}"], r"no metrics\.csv in it or below"),
    ("labels of the wrong count", ["--baseline", "{run}", "--qat", "{run}", "--labels", "a", "b", "c"], r"--labels: give 1 .* or 2"),
]


@pytest.mark.parametrize("args,pattern", [r[1:] for r in REPORT_ROWS], ids=[r[0] for r in REPORT_ROWS])
def test_bad_report(args, pattern, finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    (tmp_path / "empty").mkdir()
    argv = ["report", *[a.format(tmp=tmp_path / "empty", run=run_dir) for a in args], "--out", tmp_path / "report"]
    _refused_without_writing(argv, run_dir, pattern, capsys)
    assert not (tmp_path / "report").exists()


# --------------------------------------------------------------------------------------------- inspect
def _without_history(good, d) -> str:
    """The run's checkpoint with every scaler's history wiped: a QATModule checkpoint that holds no scales."""
    ckpt = torch.load(good, weights_only=True)
    for key, value in ckpt["state_dict"].items():
        if key.endswith(("steps_recorded", "amax_history")):
            value.zero_()
    torch.save(ckpt, d / "no_scales.ckpt")
    return str(d / "no_scales.ckpt")


INSPECT_ROWS = [  # (flags after --config <the run's config>, the error)
    ("no batches", ["--batches", "0"], r"--batches: must be >= 1, got 0"),
    ("no held-out text", ["--split", "val", "--data.init_args.val_documents", "0"],
     r"--split val: data\.val_documents=0 holds no document out; set --data\.init_args\.val_documents N or use --split train"),
    ("calibration takes every batch", ["--split", "val", "--calibration_batches", "500"],
     r"no batches available to compare: held-out text .* gives \d+ batches, all taken by the 500 of the calibration"),
    ("missing checkpoint", ["--ckpt_path", "{tmp}/nope.ckpt"], r"checkpoint .*nope\.ckpt does not exist"),
    ("checkpoint without scales", ["--ckpt_path", "{no_scales}"],
     r"--ckpt_path .*no_scales\.ckpt: no amax history \(steps_recorded == 0 in all \d+ scalers\)"),
    ("calibration of a checkpoint", ["--ckpt_path", "{last}", "--calibration", "current"],
     r"--calibration / --calibration_batches: a --ckpt_path checkpoint brings its own scales"),
    ("missing config", ["--config", "{tmp}/nope.yaml"], r"--config .*nope\.yaml: no such file"),
]


@pytest.mark.parametrize("args,pattern", [r[1:] for r in INSPECT_ROWS], ids=[r[0] for r in INSPECT_ROWS])
def test_bad_inspect(args, pattern, finished_run, tmp_path, capsys):
    run_dir, config = finished_run
    last = run_dir / "ckpt" / "last.ckpt"
    given = [a.format(tmp=tmp_path, last=last, no_scales=_without_history(last, tmp_path) if "{no_scales}" in a else "")
             for a in args]
    _refused_without_writing(["inspect", "--config", config, *given, "--out", tmp_path / "inspect"], run_dir, pattern,
                             capsys)
    assert not (tmp_path / "inspect").exists()


def test_inspect_refuses_a_checkpoint_of_an_unquantized_run(finished_run, unquantized_run, capsys):
    run_dir, config = finished_run
    _refused_without_writing(["inspect", "--config", config, "--ckpt_path", unquantized_run], run_dir,
                             r"--ckpt_path .*last\.ckpt: no quantized layer in it \(a run with model\.quant\.enabled=false\)",
                             capsys)


def test_the_table_has_at_least_80_cases():
    rows = (len(SETTING_ROWS) + len(CONFIG_FILE_ROWS) + 1 + len(MODEL_ROWS) + len(DATA_ROWS) + 1 + len(CKPT_ROWS) + 2
            + len(LAST_ROWS) + 2 * len(CHANGED_ON_RESUME) + 1 + 1 + len(EXPORT_ROWS) + len(REPORT_ROWS) + len(INSPECT_ROWS) + 1)
    assert rows >= 80, rows
