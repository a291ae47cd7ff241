"""StepProgressBar: the training bar counts optimizer steps out of ``trainer.max_steps``.

Lightning's bar counts the micro-batches of the current epoch; our train loader is one long (or unbounded)
epoch of ``max_steps x accumulation`` micro-batches, so it read ``Epoch 0/-2 ... 48/24``. Here the bar's
total is ``max_steps``, its position ``global_step`` (a resumed run starts where it stopped), its
description the phase (``warmup`` while the BF16 warmup observes, ``QAT`` once quantization is on,
``step`` for an unquantized run), and its postfix shows the learning rate in scientific notation and the
clipped elements as a count and a fraction (Lightning's bar pads floats to 3 decimals: ``0.000``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from .progress_log import format_clipped

# progress-bar metric -> short postfix name (values formatted in format_postfix)
_RENAMED = {"train/loss": "loss", "train/lr": "lr"}


def format_postfix(items: dict[str, Any]) -> dict[str, Any]:
    """Short names, lr as ``1.00e-05``, and ``sat/clipped`` (if logged) + ``sat/clipped_frac`` as one
    ``clipped`` item ``12 (3.1e-07)``; other items pass through."""
    items = dict(items)
    count, frac = items.pop("sat/clipped", None), items.pop("sat/clipped_frac", None)
    out = {}
    for key, value in items.items():
        name = _RENAMED.get(key, key)
        out[name] = f"{float(value):.2e}" if key == "train/lr" else value
    if frac is not None:
        out["clipped"] = format_clipped(count, frac)
    elif count is not None:
        out["clipped"] = str(int(float(count)))
    return out


def phase(pl_module: L.LightningModule) -> str:
    """``QAT`` / ``warmup`` from the quantized layers' switches (what the last step ran), ``step`` without any."""
    layers = getattr(pl_module, "quantized_linears", lambda: [])()
    if not layers:
        return "step"
    layer = layers[0][1]
    return "QAT" if layer.quantizes_forward() else "warmup"


class StepProgressBar(TQDMProgressBar):
    """A :class:`TQDMProgressBar` whose train bar is optimizer steps of the whole run (same arguments)."""

    def _total_steps(self, trainer: L.Trainer) -> int | None:
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.reset(total=self._total_steps(trainer))
        # a resumed run (or a new epoch) continues at global_step; initial keeps tqdm's rate per step of this run
        bar.initial = bar.n = trainer.global_step
        bar.set_description(phase(trainer.lightning_module))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        bar = self._train_progress_bar
        step = trainer.global_step
        if bar is None or bar.disable or step == bar.n or not self._should_update(step, bar.total):
            return  # only when an optimizer step completed (not every micro-batch)
        bar.n = step
        bar.set_description(phase(pl_module), refresh=False)
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return format_postfix(super().get_metrics(trainer, pl_module))
