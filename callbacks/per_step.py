"""PerOptimizerStep: the base of the callbacks that act once per optimizer step.

Lightning calls ``on_train_batch_end`` once per micro-batch; the optimizer step is done on the first call after
``trainer.global_step`` moved (the scalers have advanced by then). A resumed run has already handled the step
before its checkpoint, so counting starts at the step it resumes from.
"""

from __future__ import annotations

import lightning as L


def validation_log_step(trainer: L.Trainer) -> int:
    """The step Lightning logs a validation's metrics at (its count of batches that stepped): what the callbacks
    that log per validation (forgetting, the noise floor) log at too, so each series sits beside ``val/loss``."""
    return getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)


def callback_of(trainer: L.Trainer, kind: type) -> L.Callback | None:
    """The trainer's callback of type ``kind`` (the first), or None."""
    return next((c for c in trainer.callbacks if isinstance(c, kind)), None)


class PerOptimizerStep(L.Callback):
    """Gives :meth:`completed_step` (once per optimizer step), :meth:`logging_step` and :meth:`log_at`."""

    _seen_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen_step = trainer.global_step

    def completed_step(self, trainer: L.Trainer) -> int | None:
        """The index of the optimizer step just completed (``trainer.global_step - 1``: the step its counters and
        metrics describe) on the first call after it, None on every other call."""
        step = trainer.global_step
        if step == self._seen_step:
            return None
        self._seen_step = step
        return step - 1

    @staticmethod
    def logging_step(trainer: L.Trainer, completed_steps: int) -> bool:
        """Whether the step that makes ``completed_steps`` is logged in full (every ``log_every_n_steps``)."""
        return completed_steps > 0 and completed_steps % max(1, trainer.log_every_n_steps) == 0

    @staticmethod
    def log_at(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
        """``metrics`` to every logger at ``step``, the step they describe (not Lightning's current one)."""
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
