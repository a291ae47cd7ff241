"""docs/cluster.md says what a user runs on their own cluster: its commands, run here on stand-ins (a local model
directory for the downloaded openPangu, FineWeb-shaped parquet files in ``sample/10BT`` for the downloaded data,
one CPU for the GPUs), and its accumulation table, checked against the batch arithmetic the run derives."""

import os
import re
import shlex
import sys

import pytest

import main as cli
from qat_app.data.batching import derive_accumulate_grad_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "cluster.md")
MODEL_DIR, FINEWEB_DIR = "/shared/models/openPangu-Embedded-1B", "/shared/fineweb"


def page() -> str:
    with open(PAGE) as f:
        return f.read()


def documented_fit(marker: str) -> list[str]:
    """The arguments of the page's ``python main.py fit`` command (line continuations joined) that has ``marker``."""
    text = page().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith("python main.py fit") and marker in line:
            return shlex.split(line.strip())[2:]
    raise AssertionError(f"docs/cluster.md has no `python main.py fit` command with {marker!r}")


@pytest.fixture(scope="module")
def deep_tiny_model_dir(module_tmp, embedded_tokenizer):
    from tests._tiny_models import save_tiny_llama

    return save_tiny_llama(module_tmp("deep_tiny_model"), embedded_tokenizer, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=8, max_position_embeddings=64)


def test_the_offline_fineweb_command_reads_the_downloaded_parquet_files(tmp_path, monkeypatch, deep_tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # what `hf download ... --include "sample/10BT/*"` writes: numbered parquet files with FineWeb's columns
    folder = tmp_path / "fineweb" / "sample" / "10BT"
    folder.mkdir(parents=True)
    for shard in range(2):
        texts = [f"Shard {shard} document {i}: the window's largest amax sets the scale of the step." * 3
                 for i in range(40)]
        pq.write_table(pa.table({"text": texts, "id": [f"<urn:{shard}-{i}>" for i in range(40)],
                                 "dump": ["CC-MAIN-2024-10"] * 40, "url": ["https://example.org"] * 40,
                                 "language": ["en"] * 40, "token_count": [60] * 40}),
                       str(folder / f"00{shard}_00000.parquet"), row_group_size=10)
    args = documented_fit("data_files")
    assert "--model.model_name" in args and "--data.init_args.data_files" in args
    args = [a.replace(MODEL_DIR, str(deep_tiny_model_dir)).replace(FINEWEB_DIR, str(tmp_path / "fineweb"))
            .replace("configs/", os.path.join(ROOT, "configs", "")) for a in args]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main.py"])
    assert args[0] == "fit"
    run = cli.cli_main([*args[1:], "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
                        "--trainer.precision", "32-true", "--data.init_args.seq_len", "32",
                        "--data.init_args.micro_batch_size", "2", "--data.init_args.num_workers", "0",
                        "--data.init_args.val_documents", "4", "--data.init_args.benchmarks", "null"], run=False)
    dm = run.datamodule
    assert dm.dataset is None and str(dm.data_files).endswith(os.path.join("sample", "10BT"))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 32)
    assert "document" in dm.tokenizer.decode(batch["input_ids"][0])  # the parquet files' text, tokenized


def test_the_accumulation_table_is_what_the_run_derives():
    rows = re.findall(r"^\| (1 GPU|8 GPUs, one node|2 nodes x 8 GPUs) \| .* \| (\d+) \|", page(), re.M)
    devices = {"1 GPU": 1, "8 GPUs, one node": 8, "2 nodes x 8 GPUs": 16}
    assert [name for name, _ in rows] == list(devices)
    import yaml

    data = yaml.safe_load(open(os.path.join(ROOT, "configs", "exp8.yaml")))["data"]["init_args"]
    for name, accumulation in rows:  # exp8's global batch and micro-batch
        assert int(accumulation) == derive_accumulate_grad_batches(
            data["global_batch_size"], data["micro_batch_size"], devices[name]), name
