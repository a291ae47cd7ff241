"""StepRecord: one optimizer step of the whole model, read once by the core and handed to whoever needs it.

:func:`~qat_app.hif8.training.sync_and_advance` closes the step and, asked to, reads every scaler's last
completed step (:func:`read_record`: one device->host copy; element counts and the loss summed over the
data-parallel ranks first, on every rank in the same place of the loop), with the step's skip, loss, gradient
norm and the fallback policy's decisions. :class:`qat_app.module.QATModule` publishes it as ``step_record``; the
saturation, what-if, health and forecast figures, the fallback log, the spike alarms and the dashboard's heatmaps
all read this record, not the scalers again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .counters import HEALTH, as_rows, gather_columns, world_size
from .fallback import RUN_FIELDS, RunCounters, quantized_tensors, run_counters, scaler_pairs

# per step: (amax, a_hat, headroom) are identical on every rank; the element counts are summed
FIELDS = ("last_amax", "last_a_hat", "last_headroom")
COUNT_FIELDS = ("last_clipped", "last_numel")
WHATIF_COUNT = "last_whatif_clipped"  # per estimator: summed over the ranks
LOSS = "loss"  # the step's loss, summed over the ranks in the read (then divided by their number)


def short_name(name: str) -> str:
    """A tensor's name without the LightningModule's ``model.`` prefix."""
    return name[len("model."):] if name.startswith("model.") else name


def named_scalers(model: nn.Module, tensors: list | None = None) -> list[tuple[str, object]]:
    """``(tensor name, scaler)`` of every quantized tensor (of ``tensors``, :func:`~.fallback.quantized_tensors`'
    entries, when given): ``layers.7.mlp.up_proj.input``."""
    return [(short_name(name), scaler) for name, scaler in scaler_pairs(quantized_tensors(model) if tensors is None
                                                                        else tensors)]


class StepRow(NamedTuple):
    """One tensor's last completed step (:data:`FIELDS` then :data:`COUNT_FIELDS`)."""

    amax: float
    a_hat: float
    headroom: float
    clipped: float
    numel: float


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of every quantized tensor (:func:`read_record`), its skip, loss and fallback."""

    step: int  # the optimizer step the figures describe
    skipped: bool  # a non-finite loss or gradient on some rank: the optimizer step is skipped
    pairs: tuple[tuple[str, object], ...] = ()  # (tensor name, scaler), in model order (none when not read)
    rows: tuple[StepRow, ...] = ()  # each tensor's figures, in the same order
    columns: dict[str, torch.Tensor] | None = None  # the gathered columns (what-if counts, health vectors)
    health: bool = False  # its numeric health was measured
    loss: float | None = None  # the step's loss over its micro-batches and the ranks (when handed over)
    grad_norm: float | None = None  # the global gradient norm (when handed over)
    fallback: tuple = ()  # the fallback policy's decisions taken at this step

    @property
    def read(self) -> bool:
        """Whether the counters were read (``sync_and_advance(..., read=True)`` with quantized tensors)."""
        return bool(self.pairs)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.pairs]

    @property
    def counters(self) -> RunCounters:
        """The run counters (and, when measured, the SQNR) the fallback policy decides on."""
        return run_counters(self.columns)

    def clipped_frac(self) -> dict[str, float]:
        """tensor -> the fraction of its elements the step clipped (the tensors it quantized)."""
        return {name: row.clipped / row.numel for name, row in zip(self.names, self.rows) if row.numel}

    def sqnr_db(self) -> dict[str, float]:
        """tensor -> its measured SQNR in dB (finite values of the tensors measured; none without health)."""
        sqnr = self.counters.sqnr  # NaN where not measured
        return {} if sqnr is None else {name: db for name, db in zip(self.names, sqnr.tolist()) if math.isfinite(db)}


def read_record(model: nn.Module, step: int, skipped: bool, loss: torch.Tensor | None = None,
                grad_norm: torch.Tensor | None = None) -> StepRecord:
    """The :class:`StepRecord` of ``model``'s scalers for ``step`` (a collective under data parallelism: every
    rank). The health vectors are read when the step measured them (``measure_health`` on: every rank alike)."""
    tensors = quantized_tensors(model)
    pairs = named_scalers(model, tensors)
    health = any(layer.measure_health for _, layer, _ in tensors)
    summed = {} if loss is None else {LOSS: loss}
    same = {} if grad_norm is None else {"grad_norm": grad_norm}
    columns = gather_columns(pairs, FIELDS + RUN_FIELDS, COUNT_FIELDS + (WHATIF_COUNT,) + ((HEALTH,) if health else ()),
                             summed=summed, same=same)
    read_loss = columns.pop(LOSS, None)
    read_norm = columns.pop("grad_norm", None)
    rows = tuple(StepRow(*row) for row in as_rows(columns, FIELDS + COUNT_FIELDS)) if pairs else ()
    return StepRecord(step, skipped, tuple(pairs), rows, columns, health,
                      None if read_loss is None else float(read_loss) / world_size(),
                      None if read_norm is None else float(read_norm))
