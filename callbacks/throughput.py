"""TokenThroughputMonitor: Lightning's ThroughputMonitor counting sequences and tokens of LM batches."""

from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor


def batch_sequences(batch) -> int:
    return int(batch["input_ids"].shape[0])


def batch_tokens(batch) -> int:
    return int(batch["input_ids"].numel())


class TokenThroughputMonitor(ThroughputMonitor):
    """Logs ``train/...samples_per_sec`` and ``train/...items_per_sec`` (tokens/s) every few steps.

    Args:
        window_size: batches the rates are averaged over (Lightning's ``ThroughputMonitor``).
        separator: between the metric names' parts (``train/device/flops_per_sec``).
    """

    def __init__(self, window_size: int = 20, separator: str = "/") -> None:
        super().__init__(batch_size_fn=batch_sequences, length_fn=batch_tokens, window_size=window_size,
                         separator=separator)
