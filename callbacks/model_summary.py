"""QATModelSummary: Lightning's model summary with model FLOPs that mean something.

Lightning's summary counts FLOPs only by running the module's ``example_input_array``, which here would run
the quantized layers and push a made-up batch's amax into their histories; without one it prints a FLOPs
column of zeros and "Total FLOPs: 0". This summary drops that column and reports, as Lightning's "Total
FLOPs" (the FLOPs of one forward of an input batch), the forward of one training micro-batch by the
PaLM / 6N rule of :mod:`qat_app.flops`, the rule the ThroughputMonitor's ``flops_per_sec`` uses too.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary


def micro_batch_shape(datamodule) -> tuple[int, int] | None:
    """(sequences, tokens) of one training micro-batch, when the datamodule says (PretrainDataModule does)."""
    batch, seq = getattr(datamodule, "micro_batch_size", None), getattr(datamodule, "seq_len", None)
    return (int(batch), int(seq)) if batch and seq else None


class QATModelSummary(ModelSummary):
    def on_fit_start(self, trainer, pl_module) -> None:
        flops, shape = getattr(pl_module, "_flops", None), micro_batch_shape(trainer.datamodule)
        self._forward_flops = flops.batch(*shape, training=False) if flops is not None and shape else 0
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        ModelSummary.summarize(columns, total_parameters, trainable_parameters, model_size, total_training_modes,
                               total_flops=self._forward_flops or total_flops, **summarize_kwargs)
