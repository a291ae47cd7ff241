"""The document stream: a hub dataset or local files, streamed with ``datasets``.

* Hub (default): ``datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)``, e.g.
  ``HuggingFaceFW/fineweb`` / ``sample-10BT`` / ``train`` (the paper's recipe).
* Local files: ``data_files`` (a path, a directory, a glob pattern or a list of them; ``.parquet``,
  ``.jsonl``/``.json``, ``.txt``, optionally ``.gz``/``.bz2``/``.xz``/``.zst`` compressed, resolved by
  :func:`qat_app.data.files.resolve_data_files`). When given they replace the hub dataset and go through the
  *same* code path: ``load_dataset("parquet"|"json"|"text", data_files=<sorted resolved files>, streaming=True)``.
  Text files are split into documents by blank lines (``text_sample_by="paragraph"``; ``"line"`` and
  ``"document"`` are the alternatives).
* ``dataset="embedded:boolq-passages"``: see :mod:`qat_app.data.corpus` (read as local ``data_files``).

A source is read shard by shard (files, or parquet row groups after :meth:`Source.reshard`); errors name the
shard's file.
"""

from __future__ import annotations

import logging

from qat_app.data.errors import DataError
from qat_app.data.files import builder_for

log = logging.getLogger(__name__)


class Source:
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
        self.skipped: dict[str, int] = {}  # shard -> rows skipped in its first full pass (non-string text)
        self.warned: set[str] = set()
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
                builder = builder_for(self.data_files[0])
                kwargs = {"sample_by": self.text_sample_by} if builder == "text" else {}
                base = datasets.load_dataset(
                    builder, data_files=list(self.data_files), split="train", streaming=True, **kwargs
                )
            else:
                kwargs = {} if self.revision is None else {"revision": self.revision}
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

    def empty_shard_error(self, i: int) -> DataError:
        """Shard i yielded no document: say so, and why when every row's text was not a string."""
        skipped = self.skipped.get(self.describe(i))
        return DataError(f"{self.describe(i)} of {self.name} is empty (no documents)" + (
            f": all {skipped} rows' {self.text_column!r} are not strings (data.text_column must hold text)"
            if skipped else ""))

    def iter_texts(self, i: int, doc_batch_size: int, state: dict | None = None):
        """Yield ``(texts, hf_state_after)`` for shard i, resuming from ``state``. Errors name the shard."""
        ds = self.shard(i)
        desc = self.describe(i, ds)
        if state is not None:
            ds.load_state_dict(state)
        it = ds.iter(batch_size=doc_batch_size)
        row, skipped, first_bad = 0, 0, None
        while True:
            try:
                batch = next(it)
            except StopIteration:
                if skipped and desc not in self.skipped:  # once per shard: the scan reads it before training
                    self.skipped[desc] = skipped
                    log.warning("%s: skipped %d row(s) whose %r is not a string (the first: row %s, %s); "
                                "data.text_column must hold text", desc, skipped, self.text_column, *first_bad)
                return
            except Exception as e:
                raise DataError(f"could not read {desc} of {self.name}: {type(e).__name__}: {e}") from e
            if self.text_column not in batch:
                raise DataError(
                    f"{desc}: no column {self.text_column!r} (data.text_column); columns found: {sorted(batch)}"
                )
            texts = batch[self.text_column]
            kept = [t for t in texts if isinstance(t, str)]
            if len(kept) != len(texts):  # null / number / list rows are skipped and counted, not fed as text
                if first_bad is None:
                    j = next(j for j, t in enumerate(texts) if not isinstance(t, str))
                    where = str(row + j) if state is None else f"{j} of a resumed batch"
                    first_bad = (where, "null" if texts[j] is None else f"type {type(texts[j]).__name__}")
                    if desc not in self.warned:
                        self.warned.add(desc)
                        log.warning("%s: skipping rows whose %r is not a string (the first: row %s, %s); "
                                    "the count follows at the end of the file", desc, self.text_column, *first_bad)
                skipped += len(texts) - len(kept)
                texts = kept
            row += len(batch[self.text_column])
            yield texts, ds.state_dict()
