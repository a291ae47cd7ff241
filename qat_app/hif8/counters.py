"""The scalers' buffers on the host, in one device->host copy per call.

What the saturation callback logs and what the fallback policy decides on are the same counters, read the same
way: every requested field of every scaler stacked on the device, the per-rank counts (clipped elements, health
vectors, what-if counts) summed over the data-parallel ranks, then one ``.cpu()``. Called once per optimizer
step at most, never per forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .health import HEALTH_LEN
from .scaling import sum_over_ranks

HEALTH = "health_last"  # the last step's health vector (zeros where none was measured)


def _flat(scaler, field: str) -> torch.Tensor:
    """A field of a scaler as a flat float64 vector: a buffer (0-d or a vector), or :data:`HEALTH` (zeros where
    the last step measured nothing, so that every rank stacks the same shape)."""
    if field == HEALTH:
        vector = scaler.health_last
        return torch.zeros(HEALTH_LEN, dtype=torch.float64, device=scaler.scale.device) if vector is None else vector
    return getattr(scaler, field).double().reshape(-1)


def gather_columns(pairs, fields, count_fields=()) -> dict[str, torch.Tensor]:
    """All requested fields of all ``(tensor name, scaler)`` pairs in one host transfer: field -> a CPU float64
    tensor, ``[n]`` for a 0-d buffer, ``[n, k]`` for a vector. ``count_fields`` are summed over the
    data-parallel ranks first; a collective when given: call it on every rank.

    Each rank quantizes its own share of the activations and gradients, so theirs are summed; the
    weight (a name ending in ``.weight``) is the same tensor on every rank (replicated, or unsharded for the
    forward under FSDP), so its counts are rank 0's alone, as one process would count them.
    """
    if not pairs:
        return {}
    names = (*fields, *count_fields)
    first = pairs[0][1]
    widths = [_flat(first, f).numel() for f in names]
    stacked = torch.stack([torch.cat([_flat(s, f) for f in fields]) for _, s in pairs]) if fields else None
    if count_fields:
        counts = torch.stack([torch.cat([_flat(s, f) for f in count_fields]) for _, s in pairs])
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            replicated = torch.tensor([name.endswith(".weight") for name, _ in pairs], device=counts.device)
            counts = counts.masked_fill(replicated[:, None], 0.0)
        counts = sum_over_ranks(counts)
        stacked = counts if stacked is None else torch.cat([stacked, counts], dim=1)
    columns = stacked.cpu().split(widths, dim=1)
    return {f: c.squeeze(1) if f != HEALTH and getattr(first, f).dim() == 0 else c for f, c in zip(names, columns)}


def as_rows(columns: dict[str, torch.Tensor], names) -> list[list[float]]:
    """The 0-d-buffer ``columns`` named ``names`` as rows, one per scaler (none without scalers)."""
    return torch.stack([columns[f] for f in names], dim=1).tolist() if columns else []


def gather(pairs, fields, count_fields=()) -> list[list[float]]:
    """:func:`gather_columns` of 0-d buffers as rows, one per scaler: ``fields`` then ``count_fields``."""
    return as_rows(gather_columns(pairs, fields, count_fields), (*fields, *count_fields))
