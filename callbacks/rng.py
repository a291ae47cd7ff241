"""RNGStateCallback: the random-number-generator states of every rank travel with the checkpoint.

Lightning 2.6 does not put RNG states into checkpoints (it re-seeds with ``seed_everything`` only), so
without this a resumed run would draw other random numbers than the uninterrupted one: stochastic
rounding of quantized gradients (``quant.quantize_grads``) uses the global torch RNG, and so would
dropout.

* The training RNG state is the one at the end of the last training batch (``on_train_batch_end``,
  before Lightning's ModelCheckpoint, which it orders last, saves). ``state_dict()`` returns that
  snapshot -- torch (CPU and the rank's CUDA device), numpy and Python -- of every data-parallel rank
  (gathered with one ``all_gather_object``; Lightning dumps checkpoints on every rank).
* Validation during fit is made RNG-neutral: the snapshot is put back at ``on_validation_end``, so
  whether (and when) validation ran does not change the training stream, and a checkpoint written after
  validation holds the same state as one written before it.
* On resume the rank's saved state is restored at the first training batch, after Lightning built the
  train iterator (the train loaders of :mod:`qat_app.data.pretrain` use private generators, so building
  an iterator does not draw from the global RNG either).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

from qat_app.errors import CheckpointError

log = logging.getLogger(__name__)
_FORMAT = 1


class RNGStateCallback(L.Callback):
    """Checkpoints and restores the global RNG states of every rank (always on; no settings)."""

    def __init__(self) -> None:
        self._snapshot: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None

    # -- state --
    @staticmethod
    def _collect() -> dict[str, Any]:
        """The states in a form ``torch.load(weights_only=True)`` accepts (Lightning's default on resume):
        numpy's key array becomes a tensor. CUDA: the rank's own (current) device only."""
        states = _collect_rng_states(include_cuda=False)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["torch.cuda.current_device"] = torch.cuda.get_rng_state()
        if "numpy" in states:
            name, keys, pos, has_gauss, cached = states["numpy"]
            states["numpy"] = [str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
        return states

    @staticmethod
    def _apply(states: dict[str, Any]) -> None:
        states = dict(states)
        if "numpy" in states:
            name, keys, pos, has_gauss, cached = states["numpy"]
            states["numpy"] = (name, np.asarray(torch.as_tensor(keys).numpy(), dtype=np.uint32), pos, has_gauss, cached)
        cuda = states.pop("torch.cuda.current_device", None)
        states.pop("torch.cuda", None)
        _set_rng_states(states)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)

    def state_dict(self) -> dict[str, Any]:
        own = self._snapshot if self._snapshot is not None else self._collect()
        ranks = [own]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
        return {"format": _FORMAT, "world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict if state_dict and state_dict.get("ranks") else None

    # -- hooks --
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._pending is None:
            return
        saved = self._pending
        self._pending = None
        if saved["world_size"] != trainer.world_size:
            raise CheckpointError(
                f"the checkpoint holds the RNG states of {saved['world_size']} rank(s) but this run has "
                f"{trainer.world_size}: exact resume needs the same number of devices and nodes"
            )
        self._apply(saved["ranks"][trainer.global_rank])
        log.debug("restored the RNG states of rank %d from the checkpoint", trainer.global_rank)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._snapshot = self._collect()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self._snapshot is not None:
            self._apply(self._snapshot)
