"""Packed-token pretraining data for continued pretraining / QAT of causal LMs: :class:`PretrainDataModule`.

The pieces, one module each:

* :mod:`qat_app.data.batching` -- the global batch as micro-batches x devices x accumulation steps;
* :mod:`qat_app.data.corpus` -- the embedded corpus ``embedded:boolq-passages``;
* :mod:`qat_app.data.files` -- local data files (``data_files``): resolution and checks;
* :mod:`qat_app.data.sources` -- the document stream: hub streaming or local parquet/jsonl/txt;
* :mod:`qat_app.data.sharding` -- held-out / training document ranges and the rank x worker split;
* :mod:`qat_app.data.packing` -- EOS-separated packing into ``seq_len`` blocks;
* :mod:`qat_app.data.loader` -- the stateful per-consumer block stream and loader (exact resume).

Exact resume in Lightning
-------------------------
Lightning pre-fetches one batch ahead when the train loader has no length, which would make the saved
state one batch ahead of the last trained batch. The train loader therefore reports a length:
``batches_per_epoch`` or, by default, ``trainer.max_steps * trainer.accumulate_grad_batches`` (one
Lightning epoch = the whole run; with ``cycle=True`` the stream itself wraps around into a new data
epoch when exhausted, so every rank always has data and DDP never hangs). Known Lightning trap (issue
#20550): reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` makes Lightning skip
restoring dataloader state; compute the schedule length from ``trainer.max_steps`` instead.

A resume is exact only with the same data settings, world size and ``num_workers`` (checked).
"""

from __future__ import annotations

import math
import os
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

from qat_app.data.batching import derive_accumulate_grad_batches, limited_batches
from qat_app.data.benchmarks import BenchmarkDataModule
from qat_app.data.corpus import EMBEDDED_BOOLQ, boolq_passages_path
from qat_app.data.errors import DataError
from qat_app.data.files import resolve_data_files
from qat_app.data.loader import PackedBlockStream, RankedStatefulDataLoader, ValBlocks
from qat_app.data.packing import collate_blocks, pack_texts
from qat_app.data.sharding import Layout, scan_layout, shard_level
from qat_app.data.sources import Source
from qat_app.errors import ConfigError
from qat_app.models import EMBEDDED_MODEL, load_tokenizer


def _check_settings(*, seq_len, micro_batch_size, doc_batch_size, num_workers, val_documents, shuffle_buffer,
                    max_documents, text_sample_by, global_batch_size, dataset, data_files) -> None:
    """Refuse a setting the loaders cannot use (:class:`ConfigError` naming the ``data.*`` flag) at construction,
    before anything is downloaded or tokenised."""
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


def check_limit_val_batches(limit: int | float | None) -> int | float | None:
    """``data.limit_val_batches`` as Lightning takes ``limit_val_batches``: None, an int >= 0 or a float in [0, 1]."""
    if limit is None:
        return None
    if (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0
            or (isinstance(limit, float) and limit > 1)):
        raise ConfigError(f"data.limit_val_batches must be null, a number of batches >= 0 or a fraction in [0, 1], "
                          f"got {limit!r}")
    return limit


def limited_items(n: int, batch_size: int, limit: int | float | None) -> int:
    """How many of ``n`` items in batches of ``batch_size`` a limit of batches keeps, by Lightning's rule for
    ``limit_val_batches``: an int counts batches, a float is a fraction of them (rounded down), None / 1.0 all."""
    return min(n, limited_batches(math.ceil(n / batch_size), limit) * batch_size)


class PretrainDataModule(L.LightningDataModule):
    """Packed continued-pretraining data (see the module docstrings of :mod:`qat_app.data` for sources,
    sharding, packing, resume).

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
            LM-loss loader in validation (benchmark scores during fit; it gets this module's tokenizer). Every
            selected example is scored at every validation, whatever ``limit_val_batches`` says.
        revision: hub dataset revision.
        trust_remote_code: passed to the tokenizer loading.
        limit_val_batches: held-out LM batches a validation scores, per rank, with Lightning's rule (an int counts
            batches, 0 none; a float is a fraction of them; None all). ``main.py`` moves ``trainer.limit_val_batches``
            here, so it limits the LM validation only and never the benchmarks.
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
        limit_val_batches: int | float | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["benchmarks"] if isinstance(tokenizer, str) else ["tokenizer", "benchmarks"])
        _check_settings(seq_len=seq_len, micro_batch_size=micro_batch_size, doc_batch_size=doc_batch_size,
                        num_workers=num_workers, val_documents=val_documents, shuffle_buffer=shuffle_buffer,
                        max_documents=max_documents, text_sample_by=text_sample_by,
                        global_batch_size=global_batch_size, dataset=dataset, data_files=data_files)
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
        self.limit_val_batches = check_limit_val_batches(limit_val_batches)
        self._tokenizer = None if isinstance(tokenizer, str) else tokenizer
        self._source: Source | None = None
        self._layouts: dict[bool, Layout] = {}
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
    def source(self) -> Source:
        if self._source is None:
            if self.data_files is not None:
                files = resolve_data_files(self.data_files)
            elif self.dataset == EMBEDDED_BOOLQ:
                files = [boolq_passages_path()]
            else:
                files = None
            self._source = Source(
                self.dataset, self.dataset_config, self.split, files, self.text_column, self.text_sample_by,
                self.revision,
            )
        return self._source

    def layout(self, num_consumers: int) -> Layout:
        """Shard layout for ``num_consumers`` consumers (reshards parquet when it has too few files)."""
        src = self.source
        src.open()
        if self.reshard and not src.resharded and not shard_level(src.num_shards, num_consumers):
            if src.reshard():
                self._layouts.clear()
        key = src.resharded
        if key not in self._layouts:
            self._layouts[key] = scan_layout(src, self.val_documents, self.max_documents, self.doc_batch_size)
        return self._layouts[key]

    def sharding_mode(self, world_workers: tuple[int, int] | None = None) -> str:
        """``"shards"`` or ``"documents"`` for ``(world_size, num_workers)`` (default: the trainer's)."""
        world, workers = world_workers or (self._dp()[1], self.num_workers)
        n = world * max(1, workers)
        return "shards" if shard_level(len(self.layout(n).active), n) else "documents"

    def check_inputs(self, world_size: int) -> None:
        """Open and scan the data, load the tokenizer and the benchmark docs: what ``setup`` does, called by the
        CLI before the trainer creates log directories, so bad data fails with nothing written."""
        self.prepare_data()
        self.layout(world_size * max(1, self.num_workers))
        next(iter(self.make_train_dataset(0, world_size)))  # rank 0's first block: reads, tokenises, packs
        if self.val_documents > 0 and self.limit_val_batches != 0:
            self.val_blocks(0, world_size)  # enough held-out blocks for the devices, and limit_val_batches keeps some
        if self.benchmarks is not None:
            self.benchmarks.set_tokenizer(self.tokenizer)
            self.benchmarks.setup()
        else:
            _ = self.tokenizer

    # -- Lightning hooks --
    def prepare_data(self) -> None:
        if self.data_files is None and self.dataset == EMBEDDED_BOOLQ:
            boolq_passages_path()

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit", "validate"):
            _, world = self._dp()
            self.layout(world * max(1, self.num_workers))
            _ = self.tokenizer
        if self.benchmarks is not None and stage in ("fit", "validate") and self.trainer is not None:
            self.benchmarks.set_tokenizer(self.tokenizer)
            self.benchmarks.check_limit(self.trainer, stage)  # a Lightning limit cutting a task stops here

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
        if self.val_documents > 0 and self.limit_val_batches != 0:
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
        """This rank's held-out validation blocks ``[n, seq_len]`` that a validation scores (equal ``n`` on every
        rank; ``limit_val_batches`` applied)."""
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
        kept = limited_items(per_rank, self.val_batch_size, self.limit_val_batches)
        if kept == 0 and self.limit_val_batches != 0:
            batches = math.ceil(per_rank / self.val_batch_size)
            raise ConfigError(f"data.limit_val_batches={self.limit_val_batches} keeps none of the {batches} held-out "
                              "LM batches a rank; raise it, or 0 for none")
        return blocks[rank * per_rank : rank * per_rank + kept]

    def make_val_dataloader(self, rank: int, world_size: int):
        return DataLoader(
            ValBlocks(self.val_blocks(rank, world_size)),
            batch_size=self.val_batch_size,
            num_workers=0,
            collate_fn=collate_blocks,
            generator=torch.Generator().manual_seed(self.seed),  # leaves the global torch RNG alone
        )


__all__ = [
    "DataError",  # raised here; defined in qat_app.data.errors
    "PretrainDataModule",
    "limited_items",
    "derive_accumulate_grad_batches",  # used here; defined in qat_app.data.batching
]
