"""InitialEvaluationCallback: score the model *before* training, at global step 0, on the same documents.

Forgetting is measured against this: the report's *initial* column (initial -> baseline is forgetting,
baseline -> QAT is quantization). At the start of a new fit (not a resume) it runs one full validation
pass (the LM loss and every configured benchmark, logged at step 0 with per-example records) with
quantization switched off, so every run of a study scores the same pretrained model; the warmup's
switches are restored afterwards. Runs only when the datamodule has benchmarks.
"""

from __future__ import annotations

import logging

import lightning as L

from qat_app.hif8.patch import quantized_linears

log = logging.getLogger(__name__)


class InitialEvaluationCallback(L.Callback):
    """Args:
        enabled: validate at step 0 when benchmarks are configured.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        has_benchmarks = bool(getattr(datamodule, "task_names", None) or getattr(datamodule, "benchmarks", None))
        if not self.enabled or trainer.global_step != 0 or not has_benchmarks or trainer.limit_val_batches == 0:
            return
        layers = [layer for _, layer in quantized_linears(pl_module)]
        switches = [(layer.quantize_weights, layer.quantize_activations, layer.quantize_grads) for layer in layers]
        for layer in layers:
            layer.quantize_weights = layer.quantize_activations = layer.quantize_grads = False
        log.info("scoring the initial model (step 0, unquantized) on the validation data")
        # what the training epoch loop does around its own validation runs (fit_loop.epoch_loop.on_advance_end)
        loop = trainer.fit_loop.epoch_loop
        first_loop_iter = trainer._logger_connector._first_loop_iter
        trainer.validating = True
        try:
            loop.val_loop.run()
        finally:
            trainer.training = True
            trainer._logger_connector._first_loop_iter = first_loop_iter
            for layer, (weights, activations, grads) in zip(layers, switches):
                layer.quantize_weights, layer.quantize_activations, layer.quantize_grads = weights, activations, grads
