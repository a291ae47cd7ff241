"""The train loader: one stateful stream of packed blocks per consumer (rank x worker), resumable exactly.

Each consumer (see :mod:`qat_app.data.sharding`) reads its shards or documents, packs them
(:mod:`qat_app.data.packing`) and passes the blocks through an optional block-level shuffle buffer
(``shuffle_buffer`` blocks, per consumer) that mixes documents; shard order is permuted per data epoch when
``shuffle`` is on (seeded by ``seed``). Documents that are empty or tokenise to nothing are skipped, with a
warning naming the file and the first such document (once per shard); a file that yields no text at all is
a :class:`~qat_app.data.errors.DataError`.

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

Lightning writes the checkpoint from rank 0 only; :class:`RankedStatefulDataLoader` therefore gathers
the positions of all data-parallel ranks into the saved state and gives each rank its own back on resume.
Creating a loader iterator draws from a private generator, never from the global torch RNG (which the
checkpoint carries through :class:`callbacks.rng.RNGStateCallback`).

A resume is exact only with the same data settings, world size and ``num_workers`` (checked).
"""

from __future__ import annotations

import json
import logging
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


class PackedBlockStream(IterableDataset):
    """One consumer's stream of packed ``seq_len`` blocks (int64 tensors); stateful (see module doc).

    ``state_dict()`` is the live position of the running iterator (or the pending/initial one before
    iteration); ``load_state_dict()`` takes effect at the next ``iter()``.
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
        by_shards = shard_level(len(active), n)
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
                    parts = encode_documents(self.tokenizer, keep, self.sep_id, dropped)
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
                    raise self.source.empty_shard_error(i)
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
