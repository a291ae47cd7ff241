"""QuantizedModulesCallback: at fit start, write what was quantized (``quantized_modules.json``) and print it.

The inventory is the core's (:func:`qat_app.hif8.inventory.quantization_inventory`: every quantized matmul with
its shape, block and numerics, the blocks kept in high precision and why, every module left out and why, the
totals); this callback only writes it into the run's log directory on global rank 0 and prints its few-line
table. The operands listed as quantized are those the BF16 warmup switches on at its end. An unquantized run
(``quant.enabled=false``) writes nothing.
"""

from __future__ import annotations

import json
import logging
import os

import lightning as L

from qat_app.hif8.inventory import INVENTORY_FILE, inventory_lines, quantization_inventory

from .per_step import callback_of
from .warmup import BF16WarmupCallback

log = logging.getLogger(__name__)


class QuantizedModulesCallback(L.Callback):
    def __init__(self, file_name: str = INVENTORY_FILE) -> None:
        self.file_name = file_name
        self.path: str | None = None  # where it was written (rank 0)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): on every rank
        if getattr(pl_module, "quant_report", None) is None or not trainer.is_global_zero:
            return
        warmup = callback_of(trainer, BF16WarmupCallback)
        switched_on = (None if warmup is None else
                       {"input": warmup.quantize_activations, "weight": warmup.quantize_weights, "grad": True})
        inventory = quantization_inventory(pl_module.model, pl_module.quant.selection, switched_on)
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, self.file_name)
        with open(self.path, "w") as f:
            json.dump(inventory, f, indent=1)
        print("\n".join([*inventory_lines(inventory), f"  every module      {self.path}"]), flush=True)
