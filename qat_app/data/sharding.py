"""Which documents train, which are held out, and how the consumers split them.

A consumer is one (data-parallel rank, dataloader worker) pair: ``c = rank * W + worker`` of
``N = world_size * W`` (``W = max(1, num_workers)``). Contract: no two consumers see the same document. When the
number of shards is a multiple of ``N`` or at least ``16 N``, consumer ``c`` reads shards ``order[c::N]`` of the
data epoch's shard order (parquet sources may first be split into row-group shards, ``reshard=True``); otherwise
every consumer reads the whole stream and keeps document ``k`` iff ``k % N == c``. The first ``val_documents``
documents of the canonical stream are held out (packed once, split evenly over the ranks) and never trained on;
``max_documents`` caps training to the next ones. :func:`scan_layout` finds the skip counts in one scan at setup.

See ``docs/configuration.md`` for the ``data.*`` settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qat_app.data.errors import DataError
from qat_app.data.sources import Source

_SHARDS_PER_CONSUMER = 16


@dataclass
class Layout:
    """Which documents of which shards are used for training; computed once by a canonical scan."""

    num_shards: int
    skip: dict[int, int] = field(default_factory=dict)  # shard -> held-out docs at its start
    stop: dict[int, int] = field(default_factory=dict)  # shard -> index where training use stops
    excluded: set[int] = field(default_factory=set)  # shards with no training docs
    val_texts: list[str] = field(default_factory=list)

    @property
    def active(self) -> list[int]:
        return [i for i in range(self.num_shards) if i not in self.excluded]


def scan_layout(source: Source, val_documents: int, max_documents: int | None, doc_batch_size: int) -> Layout:
    """Read the canonical stream (shard 0, 1, ...) up to ``val_documents (+ max_documents)`` documents to
    collect the held-out texts and the per-shard training ranges ``[skip, stop)``."""
    num_shards = source.num_shards
    if num_shards == 0:
        raise DataError(f"{source.name} has no data shards")
    layout = Layout(num_shards=num_shards)
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
        start = g
        for t in (t for texts, _ in source.iter_texts(i, doc_batch_size) for t in texts):
            if g < val_documents:
                layout.val_texts.append(t or "")
            g += 1
            if g >= target:
                break
        n, reached = g - start, g >= target
        if n == 0:
            raise source.empty_shard_error(i)
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


def shard_level(num_shards: int, num_consumers: int) -> bool:
    """Shard-level split when every consumer gets the same number of shards, or so many that the
    imbalance is small (<= 1 shard in 16); document-level split otherwise."""
    return num_shards % num_consumers == 0 or num_shards >= _SHARDS_PER_CONSUMER * num_consumers
