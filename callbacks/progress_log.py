"""StepLogCallback: a plain log line every few optimizer steps, readable in files and CI logs
(progress bars only redraw on a terminal)."""

from __future__ import annotations

import logging
import time

import lightning as L

log = logging.getLogger("qat_app.progress")


def format_clipped(count, frac) -> str:
    """``12 (3.1e-07)``: clipped elements as a count and a fraction. QAT clips a few elements in billions, which
    a percentage with fixed decimals shows as ``0.000%``; ``count`` may be absent (None): the fraction alone."""
    frac = f"{float(frac):.1e}"
    return frac if count is None else f"{int(float(count))} ({frac})"


class StepLogCallback(L.Callback):
    """A plain log line every few optimizer steps, readable in files and CI logs.

    Args:
        every_n_steps: log every N optimizer steps (default: trainer.log_every_n_steps).
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._last_step = 0
        self._start = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        every = self.every_n_steps or max(1, trainer.log_every_n_steps)
        if step == self._last_step or (step % every and step != trainer.max_steps):
            return
        self._last_step = step
        m = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}"]
        for key, label, fmt in (("train/loss", "loss", "{:.4f}"), ("train/lr", "lr", "{:.2e}"),
                                ("train/grad_norm", "grad_norm", "{:.3f}")):
            if key in m:
                parts.append(f"{label} " + fmt.format(float(m[key])))
        if "sat/clipped_frac" in m:
            parts.append("clipped " + format_clipped(m.get("sat/clipped"), m["sat/clipped_frac"]))
        layers = getattr(pl_module, "quantized_linears", lambda: [])()
        if layers:
            on = layers[0][1].quantizes_forward()
            parts.append("QAT" if on else "warmup (BF16, observing)")
        parts.append(f"{time.perf_counter() - self._start:.0f}s elapsed")
        log.info(" | ".join(parts))
