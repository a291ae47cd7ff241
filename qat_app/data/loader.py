"""The train loader: one stateful stream of packed blocks per consumer (rank x worker), resumable exactly.

Each consumer (:mod:`qat_app.data.sharding`) reads its shards or documents, packs them
(:mod:`qat_app.data.packing`) and passes the blocks through an optional per-consumer shuffle buffer. Empty
documents are skipped with a warning; a file with no text at all is a :class:`~qat_app.data.errors.DataError`.
Contract: :class:`PackedBlockStream`'s ``state_dict`` is the consumer's whole position, and
:class:`RankedStatefulDataLoader` saves every rank's and worker's in the checkpoint and gives each its own back,
so a resumed fit reads exactly the blocks an uninterrupted one would. That needs the same data settings, world
size and ``num_workers`` (checked). Iterators draw from a private generator, never from the global torch RNG.

See ``docs/runs.md`` (exact resume).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from qat_app.data.errors import DataError
from qat_app.data.packing import encode_documents
from qat_app.data.sharding import Layout, shard_level
from qat_app.data.sources import Source
from qat_app.errors import CheckpointError

log = logging.getLogger(__name__)

_STATE_VERSION = 1


@dataclass
class StreamState:
    """The live position of one consumer's stream; ``to_dict()`` / ``from_dict()`` are the saved format
    (version 1: the same keys and values checkpoints have always held, so old checkpoints resume)."""

    consumer: int
    num_consumers: int
    rng: dict  # the shuffle buffer's numpy bit-generator state
    config: str  # the fingerprint of the data settings the position is valid for
    version: int = _STATE_VERSION
    epoch: int = 0
    pos: int = 0  # index into this consumer's shard list of the epoch
    hf_state: dict | None = None  # datasets state of the current shard, after the last batch read
    in_shard: int = 0  # docs of the current shard read so far
    shard_nonempty: int = 0  # non-blank docs of the current shard read so far
    doc_counter: int = 0  # running doc index over the epoch (document-level split)
    epoch_tokens: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # partial-block buffer
    shuffle: list[np.ndarray] = field(default_factory=list)  # the block shuffle buffer
    blocks: int = 0  # blocks yielded

    # the saved dictionary's keys, in the order the first version wrote them
    KEYS = ("version", "consumer", "num_consumers", "epoch", "pos", "hf_state", "in_shard", "shard_nonempty",
            "doc_counter", "epoch_tokens", "tokens", "shuffle", "rng", "blocks", "config")

    def to_dict(self) -> dict:
        """The saved form: tensors and JSON strings (loadable with ``torch.load(weights_only=True)``)."""
        out = {k: getattr(self, k) for k in self.KEYS}
        out["tokens"] = torch.from_numpy(np.array(self.tokens, dtype=np.int32, copy=True))
        out["shuffle"] = torch.from_numpy(np.stack(self.shuffle)) if self.shuffle else torch.zeros(0, dtype=torch.int32)
        out["hf_state"] = None if self.hf_state is None else json.dumps(self.hf_state)
        out["rng"] = json.dumps(self.rng)
        return out

    @classmethod
    def from_dict(cls, saved: dict) -> StreamState:
        sb = torch.as_tensor(saved["shuffle"]).numpy().astype(np.int32, copy=True)
        return cls(**{
            **{k: saved[k] for k in cls.KEYS if k in saved},
            "tokens": torch.as_tensor(saved["tokens"]).numpy().astype(np.int32, copy=True),
            "shuffle": [sb[i] for i in range(sb.shape[0])] if sb.ndim == 2 else [],
            "hf_state": None if saved["hf_state"] is None else json.loads(saved["hf_state"]),
            "rng": json.loads(saved["rng"]),
            "config": saved.get("config"),
        })

    def next_shard(self) -> None:
        self.pos, self.hf_state, self.in_shard, self.shard_nonempty = self.pos + 1, None, 0, 0

    def next_epoch(self) -> None:
        self.epoch, self.pos, self.hf_state, self.in_shard, self.shard_nonempty = self.epoch + 1, 0, None, 0, 0
        self.doc_counter = self.epoch_tokens = 0


@dataclass(frozen=True)
class _Consumer:
    """Who reads: consumer ``index`` of ``count``; ``by_shards``: shards are split between consumers (else
    documents are, round robin over each epoch's running document index)."""

    index: int
    count: int
    by_shards: bool


class PackedBlockStream(IterableDataset):
    """One consumer's stream of packed ``seq_len`` blocks (int64 tensors); stateful (see module doc).

    ``state_dict()`` is the live position of the running iterator (or the pending/initial one before
    iteration); ``load_state_dict()`` takes effect at the next ``iter()``. The stream is a few nested
    generators over one :class:`StreamState`: epochs -> shards -> document batches -> blocks (through the
    shuffle buffer); the state is consistent at every ``yield``, so resuming from any saved state continues
    with exactly the blocks (and states) of the uninterrupted stream.
    """

    def __init__(
        self,
        source: Source,
        layout: Layout,
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
        self._pending: StreamState | None = None
        self._live: StreamState | None = None
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
    def _fresh_state(self, c: int, n: int) -> StreamState:
        rng = np.random.default_rng([self.seed, c, n, 0xB10C]).bit_generator.state
        return StreamState(consumer=c, num_consumers=n, rng=rng, config=self.fingerprint)

    def state_dict(self) -> dict:
        state = self._live or self._pending or self._fresh_state(*self._consumer())
        return state.to_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if state_dict.get("version") != _STATE_VERSION:
            raise CheckpointError(f"unsupported data state version {state_dict.get('version')!r}")
        self._pending = StreamState.from_dict(state_dict)
        self._live = None

    # -- iteration --
    def __iter__(self) -> Iterator[torch.Tensor]:
        c, n = self._consumer()
        state = self._pending if self._pending is not None else self._fresh_state(c, n)
        self._pending = None
        if (state.consumer, state.num_consumers) != (c, n):
            raise CheckpointError(
                f"data state was saved by consumer {state.consumer} of {state.num_consumers} "
                f"(rank x dataloader worker) but is being restored into consumer {c} of {n}: exact resume needs "
                "the same number of devices and data.num_workers"
            )
        if state.config != self.fingerprint:
            saved, now = json.loads(state.config or "{}"), json.loads(self.fingerprint)
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
        who = _Consumer(c, n, shard_level(len(self.layout.active), n))
        return self._generate(state, who)

    def _generate(self, st: StreamState, who: _Consumer) -> Iterator[torch.Tensor]:
        """Data epochs, one after the other (one, then the buffer's rest, when ``cycle`` is off)."""
        rng = np.random.default_rng()
        rng.bit_generator.state = st.rng
        # full blocks still in the token buffer of a saved position come first (the uninterrupted stream
        # emitted them before reading on)
        yield from self._blocks(st, rng)
        while True:
            order = self._epoch_order(st.epoch)
            mine = order[who.index :: who.count] if who.by_shards else order
            while st.pos < len(mine):
                yield from self._shard(st, rng, mine[st.pos], who)
                st.next_shard()
            if st.epoch_tokens == 0:
                raise DataError(
                    f"data consumer {who.index} of {who.count} (rank x dataloader worker) received no documents in "
                    f"a full pass over {self.source.name}: too few documents for {who.count} consumers; lower "
                    "data.num_workers or add data"
                )
            if not self.cycle:
                yield from self._drain(st, rng)
                self._live = None
                return
            log.info("data consumer %d/%d: starting data epoch %d (the stream wrapped around)",
                     who.index, who.count, st.epoch + 1)
            st.next_epoch()

    def _shard(self, st: StreamState, rng: np.random.Generator, i: int, who: _Consumer) -> Iterator[torch.Tensor]:
        """The blocks of shard ``i`` from the state's position in it; checks the shard held some text."""
        stopped = reported = False  # one warning per shard about documents that tokenise to nothing
        for texts, hf_state in self.source.iter_texts(i, self.doc_batch_size, st.hf_state):
            keep, keep_idx, empty, stopped = self._select(st, texts, i, who)
            reported = self._append(st, i, keep, keep_idx, empty, warn=not reported) or reported
            st.hf_state = hf_state
            yield from self._blocks(st, rng)
            if stopped:
                return
        if st.in_shard == 0:
            raise self.source.empty_shard_error(i)
        if st.shard_nonempty == 0:
            raise DataError(
                f"{self.source.describe(i)} of {self.source.name}: every document in column "
                f"{self.source.text_column!r} is empty; the file yields no training text"
            )

    def _select(self, st: StreamState, texts: list, i: int, who: _Consumer) -> tuple[list, list, list, bool]:
        """This consumer's documents of one batch of shard ``i`` -> (texts, their indices in the shard, indices
        of the empty ones, whether the shard's training range ended); advances the document counters."""
        skip, stop = self.layout.skip.get(i, 0), self.layout.stop.get(i)
        keep, keep_idx, empty = [], [], []
        for t in texts:
            j = st.in_shard
            if stop is not None and j >= stop:
                return keep, keep_idx, empty, True
            st.in_shard = j + 1
            if t is not None and t.strip():
                st.shard_nonempty += 1
            if j < skip:
                continue
            if not who.by_shards:
                k, st.doc_counter = st.doc_counter, st.doc_counter + 1
                if k % who.count != who.index:
                    continue
            if t and not t.isspace():
                keep.append(t)
                keep_idx.append(j)
            else:
                empty.append(j)
        return keep, keep_idx, empty, False

    def _append(self, st: StreamState, i: int, keep: list, keep_idx: list, empty: list, *, warn: bool) -> bool:
        """Tokenise the kept documents onto the token buffer -> whether a skipped document was reported."""
        dropped: list[int] = []
        parts = encode_documents(self.tokenizer, keep, self.sep_id, dropped)
        if parts:
            st.tokens = np.concatenate([st.tokens, *parts])
            st.epoch_tokens += sum(len(p) for p in parts)
        if warn and (empty or dropped):
            first = min(empty + [keep_idx[d] for d in dropped])
            log.warning(
                "%s of %s: document %d (0-based) is empty or tokenises to nothing; skipped (further "
                "such documents of this shard are skipped without a warning)",
                self.source.describe(i), self.source.name, first,
            )
            return True
        return False

    def _blocks(self, st: StreamState, rng: np.random.Generator) -> Iterator[torch.Tensor]:
        """Every full block of the token buffer, through the shuffle buffer."""
        while len(st.tokens) >= self.seq_len:
            block, st.tokens = st.tokens[: self.seq_len].copy(), st.tokens[self.seq_len :]
            if self.shuffle_buffer <= 0:
                yield self._emit(st, block)
                continue
            st.shuffle.append(block)
            if len(st.shuffle) >= self.shuffle_buffer:
                yield self._emit(st, self._pop_random(st, rng))

    def _drain(self, st: StreamState, rng: np.random.Generator) -> Iterator[torch.Tensor]:
        """The rest of the shuffle buffer, in random order (the end of a finite stream)."""
        while st.shuffle:
            yield self._emit(st, self._pop_random(st, rng))

    @staticmethod
    def _pop_random(st: StreamState, rng: np.random.Generator) -> np.ndarray:
        buf = st.shuffle
        j = int(rng.integers(len(buf)))
        buf[j], buf[-1] = buf[-1], buf[j]
        out = buf.pop()
        st.rng = rng.bit_generator.state
        return out

    @staticmethod
    def _emit(st: StreamState, block: np.ndarray) -> torch.Tensor:
        st.blocks += 1
        return torch.from_numpy(block.astype(np.int64))


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


class ValBlocks(IterableDataset):
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
