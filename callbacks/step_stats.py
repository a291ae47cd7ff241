"""StepStats: one optimizer step of every quantized tensor, read once and handed to whoever needs it.

:class:`~callbacks.saturation.AmaxSaturationCallback` builds one per optimizer step (:func:`read_step`: one
device->host copy, element counts summed over the data-parallel ranks; built by whichever callback asks first,
:func:`~callbacks.saturation.step_stats_of`); its saturation, what-if, health (:mod:`.health_log`) and forecast
(:mod:`.forecast_log`) figures, the fallback policy (:mod:`.fallback`: the run counters), the spike alarms
(:mod:`.alarms`: the step's clipping beside a spike) and the dashboard's heatmaps all read this record, not the
scalers again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qat_app.hif8.counters import HEALTH, as_rows, gather_columns
from qat_app.hif8.fallback import RUN_FIELDS, RunCounters, run_counters

# per step: (amax, a_hat, headroom) are identical on every rank; the element counts are summed
FIELDS = ("last_amax", "last_a_hat", "last_headroom")
COUNT_FIELDS = ("last_clipped", "last_numel")
WHATIF_COUNT = "last_whatif_clipped"  # per estimator: summed over the ranks


class StepRow(NamedTuple):
    """One tensor's last completed step (:data:`FIELDS` then :data:`COUNT_FIELDS`)."""

    amax: float
    a_hat: float
    headroom: float
    clipped: float
    numel: float


@dataclass(frozen=True)
class StepStats:
    """One optimizer step of every quantized tensor (:func:`read_step`)."""

    step: int  # the optimizer step the figures describe
    pairs: tuple[tuple[str, object], ...]  # (tensor name, scaler), in model order
    rows: tuple[StepRow, ...]  # each tensor's figures, in the same order
    columns: dict[str, torch.Tensor]  # the gathered columns (what-if counts and, when measured, health vectors)
    logged: bool  # logged in full (every log_every_n_steps)
    health: bool  # its numeric health was measured

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


def read_step(pairs: list[tuple[str, object]], step: int, logged: bool, health: bool) -> StepStats:
    """The :class:`StepStats` of ``pairs``' scalers for ``step`` (a collective under data parallelism: every rank)."""
    columns = gather_columns(pairs, FIELDS + RUN_FIELDS,
                             COUNT_FIELDS + (WHATIF_COUNT,) + ((HEALTH,) if health else ()))
    rows = tuple(StepRow(*row) for row in as_rows(columns, FIELDS + COUNT_FIELDS))
    return StepStats(step, tuple(pairs), rows, columns, logged, health)
