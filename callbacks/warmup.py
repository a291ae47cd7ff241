"""BF16WarmupCallback: train unquantized for ``warmup_steps`` optimizer steps, then switch QAT on.

During the warmup the observers of every HiF8Linear keep recording amax, so the histories fill
with representative values. At the switch (the first micro-batch of optimizer step
``warmup_steps``) every history is seeded (slots the warmup did not reach take the warmup's max,
so the first quantized step already sees a full window) and weight and/or activation
quantization is turned on. The phase is a function of ``trainer.global_step`` and is also kept in
the HiF8Linear state, so a resumed run (inside or after the warmup) continues in the right phase.
"""

from __future__ import annotations

import logging

import lightning as L

from qat_app.errors import ConfigError
from qat_app.hif8.patch import quantized_linears, set_quantization
from qat_app.hif8.training import end_warmup, start_warmup

log = logging.getLogger(__name__)


def check_warmup_fits(warmup_steps: int, max_steps: int) -> None:
    """Raise :class:`ConfigError` when the BF16 warmup is not shorter than the run (it would never quantize)."""
    if max_steps > 0 and warmup_steps >= max_steps:
        raise ConfigError(
            f"warmup.warmup_steps ({warmup_steps}) must be smaller than trainer.max_steps ({max_steps}): the run "
            "would never quantize"
        )


class BF16WarmupCallback(L.Callback):
    """The BF16 warmup: observers fill the amax histories, then W8A8 switches on.

    Args:
        warmup_steps: optimizer steps without quantization (paper: 500).
        quantize_weights: quantize the weights at the switch.
        quantize_activations: quantize the activations (the linears' inputs) at the switch.
    """

    def __init__(self, warmup_steps: int = 500, quantize_weights: bool = True, quantize_activations: bool = True) -> None:
        if warmup_steps < 0:
            raise ConfigError(f"warmup.warmup_steps: must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.quantize_weights = quantize_weights
        self.quantize_activations = quantize_activations
        self.switched_at: int | None = None  # the global step QAT started at (None: still warming up)

    def state_dict(self) -> dict:
        return {"warmup_steps": self.warmup_steps, "switched_at": self.switched_at}

    def load_state_dict(self, state_dict: dict) -> None:
        self.switched_at = state_dict.get("switched_at")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        max_steps = trainer.max_steps
        if stage == "fit" and max_steps is not None and max_steps > 0:
            check_warmup_fits(self.warmup_steps, max_steps)
        if not quantized_linears(pl_module.model):
            log.warning("BF16WarmupCallback: the model has no HiF8Linear (quant.enabled=false?); nothing to switch")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._apply_phase(trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._apply_phase(trainer, pl_module)

    def _apply_phase(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        in_warmup = trainer.global_step < self.warmup_steps
        if in_warmup:
            start_warmup(pl_module.model)
            return
        if self.switched_at is None:
            layers = quantized_linears(pl_module.model)
            end_warmup(pl_module.model, weights=self.quantize_weights, activations=self.quantize_activations)
            self.switched_at = trainer.global_step
            if layers:  # an unquantized baseline has nothing to switch on
                log.info("BF16 warmup over at step %d: histories seeded, quantization on (weights=%s, activations=%s)",
                         trainer.global_step, self.quantize_weights, self.quantize_activations)
        set_quantization(
            pl_module.model, weights=self.quantize_weights, activations=self.quantize_activations, grads=True
        )
