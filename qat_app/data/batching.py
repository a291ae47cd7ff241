"""Batch-size arithmetic: the global batch as micro-batches x devices x gradient accumulation steps."""

from __future__ import annotations

from qat_app.errors import ConfigError


def derive_accumulate_grad_batches(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """``global_batch_size / (micro_batch_size * world_size)``, the gradient accumulation steps.

    Raises ``ValueError`` naming ``data.global_batch_size`` / ``data.micro_batch_size`` / ``devices`` when the
    numbers are not positive or do not divide.
    """
    for name, v in (
        ("data.global_batch_size", global_batch_size),
        ("data.micro_batch_size", micro_batch_size),
        ("devices (world size)", world_size),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"data.global_batch_size={global_batch_size} is not divisible by data.micro_batch_size={micro_batch_size}"
            f" x devices={world_size} (= {per_step} sequences per micro-step); choose a global batch size that is a"
            f" multiple of {per_step}, or change data.micro_batch_size / the number of devices"
        )
    return global_batch_size // per_step


def limited_batches(batches: int, limit: int | float | None) -> int:
    """How many of ``batches`` a limit keeps, by Lightning's rule for ``limit_val_batches``: an int counts batches, a
    float is a fraction of them (rounded down), None all."""
    if limit is None:
        return batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)
