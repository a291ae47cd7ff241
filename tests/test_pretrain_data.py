"""Tests of qat_app.data.pretrain: packing, sharding, exact resume, local formats, errors, Lightning resume."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch


from qat_app.data.batching import derive_accumulate_grad_batches  # noqa: E402
from qat_app.data.corpus import EMBEDDED_BOOLQ, boolq_passages_path  # noqa: E402
from qat_app.data.errors import DataError  # noqa: E402
from qat_app.data.files import resolve_data_files  # noqa: E402
from qat_app.data.packing import pack_texts  # noqa: E402
from qat_app.data.pretrain import PretrainDataModule  # noqa: E402

N_DOC_IDS = 3000
N_WORDS = 50
DOC0 = 2  # token id of "d0"


# ----------------------------------------------------------------------------------------- fixtures
def _doc(k: int) -> str:
    """Document k: a unique id word followed by 3..15 filler words (so doc membership is traceable)."""
    return " ".join([f"d{k}"] + [f"w{(k * j + 3) % N_WORDS}" for j in range(3 + (k * 7) % 13)])


def _doc_ids(t: torch.Tensor) -> list[int]:
    """Document ids present in a tensor of token ids."""
    return [int(x) - DOC0 for x in t.flatten() if DOC0 <= int(x) < DOC0 + N_DOC_IDS]


@pytest.fixture(scope="module")
def tok_dir(module_tmp):
    """A small offline word-level tokenizer (one token per word; eos '<eos>', no pad token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for k in range(N_DOC_IDS):
        vocab[f"d{k}"] = len(vocab)
    for k in range(N_WORDS):
        vocab[f"w{k}"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    d = module_tmp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(str(d))
    return str(d)


def _write_jsonl(path, docs, column="text"):
    with open(path, "w") as f:
        for t in docs:
            f.write(json.dumps({column: t, "other": 1}) + "\n")
    return str(path)


def _write_parquet(path, docs, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), str(path), row_group_size=row_group_size)
    return str(path)


def _dm(tok_dir, data_files, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("micro_batch_size", 2)
    return PretrainDataModule(tokenizer=tok_dir, data_files=data_files, **kw)


def _all_batches(dl):
    return [b for b in dl]


def _take(dl, n):
    out = []
    for b in dl:
        out.append(b)
        if len(out) == n:
            break
    return out


# ----------------------------------------------------------------------------------------- batch sizes
def test_derive_accumulate_grad_batches():
    assert derive_accumulate_grad_batches(1024, 4, 8) == 32
    assert derive_accumulate_grad_batches(8, 8, 1) == 1
    with pytest.raises(ValueError) as e:
        derive_accumulate_grad_batches(1000, 4, 8)
    msg = str(e.value)
    assert "data.global_batch_size=1000" in msg and "data.micro_batch_size=4" in msg and "devices=8" in msg
    with pytest.raises(ValueError, match="data.micro_batch_size"):
        derive_accumulate_grad_batches(16, 0, 1)
    dm = PretrainDataModule(data_files="x.jsonl", micro_batch_size=4, global_batch_size=64)
    assert dm.accumulate_grad_batches(2) == 8
    assert PretrainDataModule(data_files="x.jsonl").accumulate_grad_batches(4) == 1
    with pytest.raises(ValueError, match="data.global_batch_size=64"):
        dm.accumulate_grad_batches(3)


# ----------------------------------------------------------------------------------------- packing
def test_pack_texts_blocks_exact_and_eos_separated(tok_dir):
    from qat_app.models import load_tokenizer

    tok = load_tokenizer(tok_dir)
    assert tok.pad_token == tok.eos_token == "<eos>"  # pad set from eos
    blocks = pack_texts(tok, ["d1 w1 w2", "", "d2 w3"], seq_len=3)
    assert blocks.dtype == torch.long and blocks.shape == (2, 3)
    assert blocks.flatten().tolist() == [DOC0 + 1, 2 + N_DOC_IDS + 1, 2 + N_DOC_IDS + 2, 1, DOC0 + 2, 2 + N_DOC_IDS + 3]


@pytest.mark.parametrize("n_files", [1, 8])
def test_disjoint_over_2_ranks_x_2_workers(tmp_path, tok_dir, n_files):
    """1 file -> document-level split, 8 files -> shard-level split; every block exactly seq_len tokens,
    no document seen by two consumers, held-out validation documents never trained on."""
    docs = [_doc(k) for k in range(400)]
    per = len(docs) // n_files
    for i in range(n_files):
        _write_jsonl(tmp_path / f"part{i}.jsonl", docs[i * per : (i + 1) * per])
    dm = _dm(tok_dir, str(tmp_path / "*.jsonl"), num_workers=2, val_documents=20, cycle=False, seed=7)
    assert dm.sharding_mode((2, 2)) == ("shards" if n_files == 8 else "documents")
    seen: list[int] = []
    for rank in range(2):
        batches = _all_batches(dm.make_train_dataloader(rank, 2))
        assert batches
        for b in batches:
            assert b["input_ids"].dtype == torch.long and b["input_ids"].shape[1] == 16
            assert b["input_ids"].shape[0] in (1, 2)
            assert torch.equal(b["labels"], b["input_ids"]) and b["labels"].data_ptr() != b["input_ids"].data_ptr()
        seen += _doc_ids(torch.cat([b["input_ids"] for b in batches]))
    assert len(seen) == len(set(seen)), "a document was read by two consumers"
    assert not set(seen) & set(range(20)), "a held-out validation document was trained on"
    # everything except the partial block dropped at the end of each of the 4 consumers' streams
    assert len(set(seen)) >= 380 - 4 * 4
    val = [dm.val_blocks(r, 2) for r in range(2)]
    assert val[0].shape == val[1].shape and val[0].shape[1] == 16
    val_ids = set(_doc_ids(torch.cat(val)))
    assert val_ids and val_ids <= set(range(20))


def test_parquet_reshard_row_groups_for_shard_level_split(tmp_path, tok_dir):
    docs = [_doc(k) for k in range(200)]
    _write_parquet(tmp_path / "a.parquet", docs[:100], row_group_size=10)
    _write_parquet(tmp_path / "b.parquet", docs[100:], row_group_size=10)
    dm = _dm(tok_dir, str(tmp_path), num_workers=2, cycle=False)  # a directory
    assert dm.sharding_mode((2, 2)) == "shards" and dm.source.num_shards == 20
    seen = []
    for rank in range(2):
        seen += _doc_ids(torch.cat([b["input_ids"] for b in dm.make_train_dataloader(rank, 2)]))
    assert len(seen) == len(set(seen)) and len(seen) >= 200 - 4 * 4


# ----------------------------------------------------------------------------------------- resume
def _equal_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


@pytest.mark.parametrize(
    "num_workers,n_files,shuffle_buffer",
    [(0, 1, 0), (0, 4, 8), (2, 1, 0), (2, 4, 8)],
)
def test_exact_resume(tmp_path, tok_dir, num_workers, n_files, shuffle_buffer):
    """state_dict() after k batches, loaded into a fresh datamodule + dataloader, continues with exactly the
    next batches -- across shard boundaries and the wrap-around into a new data epoch (cycle=True)."""
    docs = [_doc(k) for k in range(120)]
    per = len(docs) // n_files
    for i in range(n_files):
        _write_jsonl(tmp_path / f"p{i}.jsonl", docs[i * per : (i + 1) * per])
    kw = dict(num_workers=num_workers, val_documents=5, shuffle_buffer=shuffle_buffer, doc_batch_size=4, seed=3)
    world, rank, k, m = 2, 1, 7, 40  # a consumer has ~30 blocks per data epoch: m crosses the wrap-around

    ref = _take(_dm(tok_dir, str(tmp_path / "*.jsonl"), **kw).make_train_dataloader(rank, world), k + m)
    dl = _dm(tok_dir, str(tmp_path / "*.jsonl"), **kw).make_train_dataloader(rank, world)
    head = _take(dl, k)
    _equal_batches(head, ref[:k])
    state = dl.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # must survive a checkpoint round trip with weights_only loading
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    del dl

    dl2 = _dm(tok_dir, str(tmp_path / "*.jsonl"), **kw).make_train_dataloader(rank, world)
    dl2.load_state_dict(state)
    tail = _take(dl2, m)
    _equal_batches(tail, ref[k:])


def test_resume_with_other_worker_count_is_refused(tmp_path, tok_dir):
    _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(60)])
    dl = _dm(tok_dir, str(tmp_path / "a.jsonl")).make_train_dataloader(0, 1)
    _take(dl, 2)
    state = dl.state_dict()
    dl2 = _dm(tok_dir, str(tmp_path / "a.jsonl")).make_train_dataloader(0, 2)
    dl2.load_state_dict(state)
    with pytest.raises(ValueError, match="same number of devices"):
        _take(dl2, 1)


def test_resume_with_other_data_settings_is_refused(tmp_path, tok_dir):
    _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(60)])
    dl = _dm(tok_dir, str(tmp_path / "a.jsonl")).make_train_dataloader(0, 1)
    _take(dl, 2)
    state = dl.state_dict()
    dl2 = _dm(tok_dir, str(tmp_path / "a.jsonl"), doc_batch_size=5).make_train_dataloader(0, 1)
    dl2.load_state_dict(state)
    with pytest.raises(ValueError, match=r"different data settings.*doc_batch_size.*\(32, 5\)"):
        _take(dl2, 1)


# ----------------------------------------------------------------------------------------- local formats
def test_parquet_jsonl_txt_same_path_same_blocks(tmp_path, tok_dir):
    docs = [_doc(k) for k in range(50)]
    (tmp_path / "pq").mkdir()
    _write_parquet(tmp_path / "pq" / "a.parquet", docs)
    jl = _write_jsonl(tmp_path / "a.jsonl", docs)
    txt = tmp_path / "a.txt"
    txt.write_text("\n\n".join(docs) + "\n")
    results = {}
    for name, files in (("parquet", str(tmp_path / "pq" / "*.parquet")), ("jsonl", [jl]), ("txt", str(txt))):
        dm = _dm(tok_dir, files, shuffle=False, cycle=False, val_documents=3)
        results[name] = torch.cat([b["input_ids"] for b in dm.make_train_dataloader(0, 1)])
        assert torch.equal(dm.val_blocks(0, 1), results.setdefault("val", dm.val_blocks(0, 1)))
    assert torch.equal(results["parquet"], results["jsonl"]) and torch.equal(results["jsonl"], results["txt"])
    assert set(_doc_ids(results["jsonl"])) <= set(range(3, 50))


def test_max_documents_and_val_holdout_span_files(tmp_path, tok_dir):
    for i in range(3):
        _write_jsonl(tmp_path / f"f{i}.jsonl", [_doc(10 * i + j) for j in range(10)])
    dm = _dm(tok_dir, str(tmp_path / "*.jsonl"), val_documents=12, max_documents=9, cycle=False, seq_len=4)
    train = set(_doc_ids(torch.cat([b["input_ids"] for b in dm.make_train_dataloader(0, 1)])))
    assert train <= set(range(12, 21)) and len(train) >= 8
    assert set(_doc_ids(dm.val_blocks(0, 1))) <= set(range(12))


def test_embedded_boolq_passages(tmp_path, tok_dir, monkeypatch):
    monkeypatch.setenv("QAT_APP_CACHE", str(tmp_path / "cache"))
    path = boolq_passages_path()
    assert path.startswith(str(tmp_path / "cache" / "data")) and path.endswith(".jsonl")
    lines = [json.loads(x)["text"] for x in open(path)]
    assert len(lines) == len(set(lines)) > 2000 and all(t.strip() for t in lines)
    mtime = os.stat(path).st_mtime_ns
    assert boolq_passages_path() == path and os.stat(path).st_mtime_ns == mtime  # cached
    dm = PretrainDataModule(tokenizer=tok_dir, dataset=EMBEDDED_BOOLQ, seq_len=64, micro_batch_size=2)
    b = next(iter(dm.make_train_dataloader(0, 1)))
    assert b["input_ids"].shape == (2, 64)


# ----------------------------------------------------------------------------------------- errors
def test_error_missing_text_column_names_file_and_columns(tmp_path, tok_dir):
    f = _write_jsonl(tmp_path / "a.jsonl", ["x y"], column="content")
    with pytest.raises(DataError) as e:
        next(iter(_dm(tok_dir, f).make_train_dataloader(0, 1)))
    msg = str(e.value)
    assert "a.jsonl" in msg and "'text'" in msg and "content" in msg and "other" in msg


def test_error_missing_column_with_val_holdout(tmp_path, tok_dir):
    f = _write_jsonl(tmp_path / "b.jsonl", ["x y"], column="body")
    with pytest.raises(DataError, match=r"b\.jsonl.*columns found: \['body', 'other'\]"):
        _dm(tok_dir, f, val_documents=1).setup("fit")


def test_error_pattern_matches_nothing_and_missing_file(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="matched no files"):
        resolve_data_files(str(tmp_path / "*.parquet"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        _dm(tok_dir, str(tmp_path / "nope.jsonl")).make_train_dataloader(0, 1)


def test_error_empty_file(tmp_path, tok_dir):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        resolve_data_files(str(tmp_path / "empty.jsonl"))


def test_error_unreadable_parquet_names_file(tmp_path, tok_dir):
    (tmp_path / "bad.parquet").write_bytes(b"this is not a parquet file" * 10)
    with pytest.raises(DataError, match=r"bad\.parquet"):
        _all_batches(_dm(tok_dir, str(tmp_path / "bad.parquet")).make_train_dataloader(0, 1))


def test_error_file_with_only_empty_documents(tmp_path, tok_dir):
    _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(30)])
    _write_jsonl(tmp_path / "b.jsonl", ["", "   ", ""])
    dm = _dm(tok_dir, str(tmp_path / "*.jsonl"), cycle=False, shuffle=False)
    with pytest.raises(DataError, match=r"b\.jsonl.*every document.*empty"):
        _all_batches(dm.make_train_dataloader(0, 1))


def test_empty_documents_are_skipped(tmp_path, tok_dir):
    _write_jsonl(tmp_path / "a.jsonl", ["", _doc(1), " \n ", _doc(2), ""])
    dm = _dm(tok_dir, str(tmp_path / "a.jsonl"), cycle=False, seq_len=4, micro_batch_size=1)
    ids = torch.cat([b["input_ids"] for b in dm.make_train_dataloader(0, 1)]).flatten().tolist()
    assert ids[0] == DOC0 + 1 and 1 in ids  # first real doc first, then eos


def test_error_unsupported_extension_and_mixed_formats(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match="unsupported extension"):
        resolve_data_files(str(tmp_path / "a.csv"))
    _write_jsonl(tmp_path / "b.jsonl", ["x"])
    _write_parquet(tmp_path / "c.parquet", ["x"])
    with pytest.raises(DataError, match="mixes formats"):
        resolve_data_files([str(tmp_path / "b.jsonl"), str(tmp_path / "c.parquet")])


def test_error_too_few_documents(tmp_path, tok_dir):
    f = _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(5)])
    with pytest.raises(DataError, match="only 5 documents but data.val_documents=10"):
        _dm(tok_dir, f, val_documents=10).setup("fit")
    with pytest.raises(DataError, match="received no documents"):  # 5 docs over 8 consumers
        for r in range(8):
            _take(_dm(tok_dir, f).make_train_dataloader(r, 8), 1)


def test_error_hub_dataset_unreachable_is_clear(tok_dir, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    dm = PretrainDataModule(tokenizer=tok_dir, dataset="no-such-org/no-such-dataset", dataset_config=None)
    with pytest.raises(DataError, match="could not open no-such-org/no-such-dataset"):
        dm.make_train_dataloader(0, 1)


# ----------------------------------------------------------------------------------------- Lightning
def _lightning_run(tmp_path, tok_dir, data, num_workers, *, max_steps, resume_from=None, ckpt_every=None):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(N_DOC_IDS + N_WORDS + 2, 4)
            self.seen: list[torch.Tensor] = []
            self.val_losses: list[float] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].clone())
            return self.emb(batch["input_ids"]).float().pow(2).mean()

        def validation_step(self, batch, batch_idx):
            loss = self.emb(batch["input_ids"]).float().pow(2).mean()
            self.val_losses.append(float(loss))
            self.log("val_loss", loss)

        def configure_optimizers(self):
            # NB: not trainer.estimated_stepping_batches (Lightning #20550 would drop the data state)
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = _dm(tok_dir, data, num_workers=num_workers, micro_batch_size=2, global_batch_size=4, val_documents=8)
    cbs = []
    if ckpt_every:
        cbs.append(
            ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=ckpt_every, save_top_k=-1,
                            filename="{step}")
        )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=dm.accumulate_grad_batches(1),
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=cbs,
        enable_checkpointing=bool(ckpt_every), val_check_interval=4, num_sanity_val_steps=1, limit_val_batches=2,
        default_root_dir=str(tmp_path),
    )
    model = Tiny()
    trainer.fit(model, datamodule=dm, ckpt_path=resume_from)
    return model


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_checkpoint_resume_continues_with_next_batches(tmp_path, tok_dir, num_workers):
    """Train 6 optimizer steps (2 micro-batches each) with a checkpoint at step 3; resuming from it trains
    on exactly the micro-batches 7..12 of the uninterrupted run."""
    data = _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(200)])
    full = _lightning_run(tmp_path / "a", tok_dir, data, num_workers, max_steps=6, ckpt_every=3)
    assert len(full.seen) == 12 and full.val_losses
    ckpt = tmp_path / "a" / "ckpt" / "step=3.ckpt"
    assert ckpt.is_file()
    state = torch.load(str(ckpt), weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert len(state) == 1
    resumed = _lightning_run(tmp_path / "b", tok_dir, data, num_workers, max_steps=6, resume_from=str(ckpt))
    assert len(resumed.seen) == 6
    for a, b in zip(resumed.seen, full.seen[6:]):
        assert torch.equal(a, b)


def test_lightning_without_validation_split(tmp_path, tok_dir):
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(N_DOC_IDS + N_WORDS + 2, 2)
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return self.emb(batch["input_ids"]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            raise AssertionError("no validation data expected")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(50)])
    dm = _dm(tok_dir, data, val_documents=0)
    assert dm.val_dataloader() == []
    model = Tiny()
    L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, val_check_interval=2, default_root_dir=str(tmp_path)).fit(model, datamodule=dm)
    assert model.steps == 3


def test_lightning_checks_accumulate_matches_global_batch(tmp_path, tok_dir):
    import lightning as L

    data = _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(50)])
    dm = _dm(tok_dir, data, micro_batch_size=2, global_batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=1, logger=False)
    dm.trainer = trainer
    with pytest.raises(ValueError, match="needs trainer.accumulate_grad_batches=4"):
        dm.train_dataloader()


def test_train_loader_length_from_max_steps(tmp_path, tok_dir):
    import lightning as L

    data = _write_jsonl(tmp_path / "a.jsonl", [_doc(k) for k in range(50)])
    dm = _dm(tok_dir, data, micro_batch_size=2, global_batch_size=6)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, accumulate_grad_batches=3, logger=False)
    dm.trainer = trainer
    assert len(dm.train_dataloader()) == 15


# ----------------------------------------------------------------------------------------- the block stream
class _WordIds:
    """A tokenizer stand-in: one id per word (from its characters); the word "~" tokenises to nothing."""

    eos_token_id = 1

    def __call__(self, texts, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [[2 + sum(map(ord, w)) % 97 for w in t.split() if w != "~"] for t in texts]}


class _ListSource:
    """An in-memory source: shards are lists of documents; the resume state is the next row."""

    name, text_column, resharded = "lists", "text", False

    def __init__(self, shards):
        self.shards = shards
        self.num_shards = len(shards)

    def describe(self, i, shard_ds=None):
        return f"shard {i}"

    def empty_shard_error(self, i):
        return DataError(f"shard {i} of lists is empty (no documents)")

    def iter_texts(self, i, doc_batch_size, state=None):
        row = 0 if state is None else state["row"]
        while row < len(self.shards[i]):
            batch = self.shards[i][row : row + doc_batch_size]
            row += len(batch)
            yield list(batch), {"row": row}


def _stream(n_shards, *, rank, world, shuffle_buffer, cycle, skip_stop):
    import numpy as np

    from qat_app.data.loader import PackedBlockStream
    from qat_app.data.sharding import Layout

    rng = np.random.default_rng(n_shards)
    shards, k = [], 0
    for s in range(n_shards):
        docs = []
        for _ in range((90 if n_shards == 1 else 23) + s):
            r, k = rng.random(), k + 1
            docs.append("   " if r < 0.05 else "~ ~" if r < 0.08 else
                        " ".join(f"x{k}w{j}" for j in range(1 + int(rng.integers(12)))))
        shards.append(docs)
    source = _ListSource(shards)
    skip, stop = ({0: 3}, {1: 10} if n_shards > 1 else {0: 70}) if skip_stop else ({}, {})
    layout = Layout(num_shards=n_shards, skip=skip, stop=stop)
    return PackedBlockStream(source, layout, _WordIds(), seq_len=7, rank=rank, world_size=world, seed=11,
                             shuffle=True, shuffle_buffer=shuffle_buffer, cycle=cycle, doc_batch_size=4)


def _run(make, n, state=None):
    stream = make()
    if state is not None:
        stream.load_state_dict(state)
    blocks, states = [], []
    for block in iter(stream):
        if len(blocks) == n:
            break
        blocks.append(block)
        states.append(stream.state_dict())
    return blocks, states


def _digest(blocks, states) -> str:
    import hashlib

    h = hashlib.sha256()
    for b in blocks:
        h.update(str(b.dtype).encode() + b.numpy().tobytes())
    for s in states:
        for key, value in s.items():
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                h.update(f"{value.dtype}{tuple(value.shape)}".encode() + value.numpy().tobytes())
            else:
                h.update(json.dumps(value).encode())
    return h.hexdigest()[:16]


def _same_state(a, b):
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert type(a[key]) is type(b[key]) and a[key] == b[key], key


# (n_shards, rank, world, shuffle_buffer, cycle, skip_stop) -> digest of the first 60 blocks (all of a finite one) and the state
# after each, recorded with the implementation before PackedBlockStream became small generators over a
# dataclass (integer arithmetic and numpy's PCG64 only: the same on every machine). A different digest means
# other blocks, another order, or another saved state format: checkpoints of older runs would not resume.
STREAM_DIGESTS = {
    (1, 1, 2, 0, True, False): "21ef84e308aa57ea",
    (6, 3, 4, 5, True, True): "379cb205ff3992cb",
    (6, 0, 1, 5, False, True): "1cd86741c23f90a6",
    (1, 2, 3, 5, True, True): "2b85d83558961ef0",
    (1, 1, 2, 0, False, False): "9addf58004d0af94",
    (1, 0, 2, 5, False, True): "1da21bbd7ecd7ed9",
}


@pytest.mark.parametrize("config", list(STREAM_DIGESTS), ids=[str(c) for c in STREAM_DIGESTS])
def test_stream_blocks_and_states_as_recorded_and_resume_from_every_state(config):
    """The same blocks, in the same order, with the same saved states as recorded; and a fresh stream loaded
    with the state saved after any block (through torch.save, weights_only) continues with exactly the rest of
    the uninterrupted stream: mid-batch, mid-shuffle-buffer, across shards, epochs and the final drain. (The
    implementation the digests were recorded with read the next document batch before emitting the full blocks
    left in a restored token buffer: the same blocks, except that a finite stream resumed after its last batch
    lost them; the states it saved after such a resume ran one batch ahead of the uninterrupted ones.)"""
    import io

    n_shards, rank, world, shuffle_buffer, cycle, skip_stop = config

    def make():
        return _stream(n_shards, rank=rank, world=world, shuffle_buffer=shuffle_buffer, cycle=cycle, skip_stop=skip_stop)

    blocks, states = _run(make, 60)
    assert _digest(blocks, states) == STREAM_DIGESTS[config]
    for k, state in enumerate(states):
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        rest_blocks, rest_states = _run(make, len(blocks) - k - 1, torch.load(buf, weights_only=True))
        assert len(rest_blocks) == len(blocks) - k - 1, f"resumed after block {k}"
        for x, y in zip(rest_blocks, blocks[k + 1 :]):
            assert torch.equal(x, y), f"resumed after block {k}"
        for x, y in zip(rest_states, states[k + 1 :]):
            _same_state(x, y)
