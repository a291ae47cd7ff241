"""A table of bad settings, bad data files and bad checkpoints, each run through ``main.py fit``.

Each row must fail early with a clear, typed error whose message names the field / file (and, for a
setting, the allowed values) -- a QATError / FileNotFoundError that ``python main.py`` prints as one
``error: ...`` line, or jsonargparse's argument error (SystemExit 2, message on stderr) -- never a bare
traceback from deep inside. A refused checkpoint must leave the run directory untouched.
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
from qat_app.config import QuantConfigError
from qat_app.data.errors import DataError
from qat_app.errors import CheckpointError, ConfigError, QATError
from tests.test_cli_fit import write_config

ALGOS = r"most_recent', 'exp_smooth', 'max', 'current"


def _run(argv, capsys):
    """-> (exception type, message): SystemExit carries jsonargparse's stderr."""
    try:
        cli.cli_main(argv)
    except SystemExit as e:
        assert e.code not in (0, None), "argument error must exit non-zero"
        return SystemExit, capsys.readouterr().err
    except Exception as e:  # noqa: BLE001 - the table checks the type
        return type(e), str(e)
    return None, ""


def _check(kind, message, expected_kind, pattern):
    assert kind is not None, "expected an error, the run succeeded"
    assert issubclass(kind, expected_kind), f"{kind.__name__}: {message}"
    if kind is not SystemExit:  # printed by main() as `error: ...` without a traceback
        assert issubclass(kind, (QATError, FileNotFoundError)), kind
    assert re.search(pattern, message, re.S), message


# --------------------------------------------------------------------------------------------- settings
CONFIG_ROWS = [
    ("unknown amax algorithm", ["--model.quant.amax_algo", "median"], SystemExit,
     rf"model\.quant\.amax_algo.*{ALGOS}.*median"),
    ("unknown format", ["--model.quant.format", "int8"], QuantConfigError,
     r"quant\.format: unknown format 'int8'; allowed: e4m3, e5m2, hif8"),
    ("history_len < 1", ["--model.quant.history_len", "0"], QuantConfigError,
     r"quant\.history_len: must be an integer >= 1, got 0"),
    ("alpha = 0", ["--model.quant.alpha", "0"], QuantConfigError, r"quant\.alpha: must be in \(0, 1\], got 0"),
    ("alpha > 1", ["--model.quant.alpha", "1.5"], QuantConfigError, r"quant\.alpha: must be in \(0, 1\], got 1\.5"),
    ("max_val = 0", ["--model.quant.max_val", "0"], QuantConfigError, r"quant\.max_val: must be in \(0, 32768\]"),
    ("max_val < 0", ["--model.quant.max_val", "-1"], QuantConfigError, r"quant\.max_val: must be in \(0, 32768\]"),
    ("high_precision_layers > blocks", ["--model.quant.high_precision_layers", "4"], QuantConfigError,
     r"quant\.high_precision_layers: 4 is larger than the model's 3 blocks"),
    ("module pattern matches nothing", ["--model.quant.module_pattern", r"\.mlp\.nothing$"], QuantConfigError,
     r"quant\.module_pattern .*nothing.* matches no linear layer of LlamaForCausalLM; linear layers look like"),
    ("module pattern only in high-precision blocks", ["--model.quant.module_pattern", r"layers\.0\.mlp\.up_proj$"],
     QuantConfigError, r"quant\.module_pattern .* matches no linear layer inside the quantized blocks .*"
     r"high_precision_layers=1"),
    ("invalid module regex", ["--model.quant.module_pattern", "mlp.(("], QuantConfigError,
     r"quant\.module_pattern: not a valid regular expression"),
    ("block pattern without group", ["--model.quant.block_pattern", r"layers\.\d+"], QuantConfigError,
     r"quant\.block_pattern: needs one capturing group"),
    ("warmup longer than the run", ["--warmup.warmup_steps", "6"], ConfigError,
     r"warmup\.warmup_steps \(6\) must be smaller than trainer\.max_steps \(6\)"),
    ("negative warmup", ["--warmup.warmup_steps", "-1"], ConfigError, r"warmup\.warmup_steps: must be >= 0"),
    ("global batch not a multiple of micro-batch", ["--data.init_args.global_batch_size", "5"], ConfigError,
     r"data\.global_batch_size=5 is not divisible by data\.micro_batch_size=2 x devices=1"),
    ("global batch not a multiple of micro-batch x devices",
     ["--trainer.devices", "2", "--data.init_args.global_batch_size", "6"], ConfigError,
     r"data\.global_batch_size=6 is not divisible by data\.micro_batch_size=2 x devices=2"),
    ("zero micro-batch", ["--data.init_args.micro_batch_size", "0"], ConfigError,
     r"data\.micro_batch_size must be a positive integer, got 0"),
    ("seq_len < 2", ["--data.init_args.seq_len", "1"], ConfigError, r"data\.seq_len must be an integer >= 2, got 1"),
    ("lr <= 0", ["--model.lr", "0"], ConfigError, r"model\.lr: must be > 0, got 0"),
    ("unknown lr schedule", ["--model.lr_schedule", "linear"], SystemExit,
     r"model\.lr_schedule.*'cosine', 'constant'.*linear"),
    ("cosine schedule without max_steps", ["--trainer.max_steps", "-1", "--model.lr_schedule", "cosine"],
     ConfigError, r"model\.lr_schedule=cosine needs trainer\.max_steps > 0"),
    ("non-finite limit < 1", ["--model.max_consecutive_nonfinite", "0"], ConfigError,
     r"model\.max_consecutive_nonfinite: must be an integer >= 1, got 0"),
    ("missing model", ["--model.model_name", "/no/such/model"], FileNotFoundError,
     r"model path '/no/such/model' does not exist"),
]


@pytest.mark.parametrize("args,kind,pattern", [r[1:] for r in CONFIG_ROWS], ids=[r[0] for r in CONFIG_ROWS])
def test_bad_setting(args, kind, pattern, tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    _check(*_run(["fit", "--config", config, *args], capsys), kind, pattern)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "logs").exists()  # failed before writing


# ------------------------------------------------------------------------------------------------- data
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
    if kind == "non-string text":
        _jsonl(d / "numbers.jsonl", [{"text": i} for i in range(40)])
        return str(d / "numbers.jsonl")
    if kind == "missing file":
        return str(d / "nope.jsonl")
    if kind == "pattern matches nothing":
        return str(d / "shards-*.jsonl")
    if kind == "unsupported extension":
        (d / "data.csv").write_text("text\nhello\n")
        return str(d / "data.csv")
    if kind == "a document that tokenises to nothing":
        _jsonl(d / "mostly_good.jsonl", good[:7] + [{"text": " \n "}] + good[7:])
        return str(d / "mostly_good.jsonl")
    raise AssertionError(kind)


DATA_ROWS = [
    ("missing text column", DataError, r"body\.jsonl.*no column 'text' \(data\.text_column\); columns found: \['body'\]"),
    ("empty file", DataError, r"empty\.jsonl is empty \(0 bytes\)"),
    ("unreadable jsonl", DataError, r"could not read .*broken\.jsonl"),
    ("unreadable parquet", DataError, r"corrupt\.parquet"),
    ("only empty documents", DataError, r"blank\.jsonl.*every document in column 'text' is empty"),
    ("non-string text", DataError, r"numbers\.jsonl: column 'text' must hold strings, found int"),
    ("missing file", FileNotFoundError, r"data file '.*nope\.jsonl' does not exist"),
    ("pattern matches nothing", FileNotFoundError, r"data_files pattern '.*shards-\*\.jsonl' matched no files"),
    ("unsupported extension", DataError, r"data\.csv: unsupported extension '\.csv'"),
    # not an error (real corpora have a few): skipped, with a warning naming the file and the document
    ("a document that tokenises to nothing", None,
     r"mostly_good\.jsonl.*document 7 \(0-based\) is empty or tokenises to nothing; skipped"),
]


@pytest.mark.parametrize("kind,exc,pattern", DATA_ROWS, ids=[r[0] for r in DATA_ROWS])
def test_bad_data_file(kind, exc, pattern, tmp_path, tiny_model_dir, tiny_corpus, capsys, caplog):
    data = tmp_path / "data"
    data.mkdir()
    path = _make_data(kind, data)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "data.init_args.data_files": path, "data.init_args.val_documents": 0, "trainer.max_steps": 2,
        "warmup.warmup_steps": 1})
    with caplog.at_level(logging.WARNING, logger="qat_app.data.loader"):
        outcome = _run(["fit", "--config", config], capsys)
    if exc is None:
        assert outcome == (None, ""), outcome
        assert any(re.search(pattern, r.getMessage()) for r in caplog.records), [r.getMessage() for r in caplog.records]
    else:
        _check(*outcome, exc, pattern)


# ------------------------------------------------------------------------------------------ checkpoints
def _snapshot(directory) -> dict[str, tuple[int, int, str]]:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(root, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, directory)] = (os.path.getsize(p), os.stat(p).st_mtime_ns,
                                                      hashlib.sha1(f.read()).hexdigest())
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """A 2-step run with its checkpoints, logs and config.yaml (the run a bad resume must not damage)."""
    run_dir = tmp_path_factory.mktemp("run")
    config = write_config(run_dir, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 2, "warmup.warmup_steps": 1})
    cli.cli_main(["fit", "--config", config])
    assert (run_dir / "ckpt" / "last.ckpt").exists() and (run_dir / "logs" / "version_0" / "config.yaml").exists()
    return run_dir, config


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
    ("missing", r"missing\.ckpt does not exist"),
]


@pytest.mark.parametrize("kind,pattern", CKPT_ROWS, ids=[r[0] for r in CKPT_ROWS])
def test_bad_checkpoint_is_refused_and_nothing_is_overwritten(kind, pattern, finished_run, tmp_path, capsys):
    run_dir, config = finished_run
    bad = _make_checkpoint(kind, str(run_dir / "ckpt" / "last.ckpt"), tmp_path)
    before = _snapshot(run_dir)
    _check(*_run(["fit", "--config", config, "--ckpt_path", bad], capsys), CheckpointError, pattern)
    assert _snapshot(run_dir) == before  # no checkpoint, log or config.yaml of the run was written


LAST_ROWS = [
    # the job died while writing last.ckpt
    ("truncated", r"last\.ckpt cannot be read .*truncated"),
    # the run directory holds a checkpoint of a run with other settings than the config resumed with
    ("other settings", r"last\.ckpt does not belong to this model .*: other shape: .*amax_history \(3,\) in the "
                       r"checkpoint vs \(5,\) now.*settings that differ \(checkpoint -> now\): "
                       r"model\.quant\.history_len: 3 -> 5"),
]


@pytest.mark.parametrize("kind,pattern", LAST_ROWS, ids=[r[0] for r in LAST_ROWS])
def test_bad_last_checkpoint_is_refused_and_nothing_is_overwritten(kind, pattern, finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = yaml.safe_load(open(run_dir / "config.yaml"))
    text = yaml.safe_dump(config).replace(str(run_dir), str(copy))  # the same run, in the copy
    (copy / "config.yaml").write_text(text)
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
    before = _snapshot(copy)
    _check(*_run(["fit", "--config", str(copy / "config.yaml"), "--ckpt_path", "last"], capsys), CheckpointError,
           pattern)
    assert _snapshot(copy) == before


def test_main_prints_one_line_errors_without_traceback(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    for args, code, pattern in [
        (["--model.quant.history_len", "0"], 2, r"^error: quant\.history_len: must be an integer >= 1, got 0$"),
        (["--data.init_args.global_batch_size", "5"], 2, r"^error: data\.global_batch_size=5 is not divisible"),
        (["--data.init_args.data_files", str(tmp_path / "nope.jsonl")], 2, r"^error: data file .*nope\.jsonl"),
        (["--ckpt_path", str(tmp_path / "nope.ckpt")], 2, r"^error: checkpoint .*nope\.ckpt does not exist"),
        (["--model.quant.amax_algo", "median"], 2, r"error: Parser key \"model\.quant\.amax_algo\""),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["fit", "--config", config, *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == code, err
        assert re.search(pattern, err.strip().splitlines()[-1] if "Parser" not in pattern else err, re.M), err
        assert "Traceback" not in err


def test_validate_refuses_a_quantized_model_without_history(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    """Scores of a fresh quantized model would depend on the batch size (each batch its own scale)."""
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    _check(*_run(["validate", "--config", config], capsys), ConfigError,
           r"validate: model\.quant\.enabled=true but the \d+ quantized layers have no amax history yet.*"
           r"--model\.quant\.enabled false.*--ckpt_path")
    # the unquantized model is evaluated as asked
    trainer = cli.cli_main(["validate", "--config", config, "--model.quant.enabled", "false"]).trainer
    assert "val/loss" in trainer.callback_metrics
