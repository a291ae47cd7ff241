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


def world_size() -> int:
    """The number of data-parallel ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_columns(pairs, fields, count_fields=(), summed: dict | None = None, same: dict | None = None
                   ) -> dict[str, torch.Tensor]:
    """All requested fields of all ``(tensor name, scaler)`` pairs in one host transfer: field -> a CPU float64
    tensor, ``[n]`` for a 0-d buffer, ``[n, k]`` for a vector. ``count_fields`` are summed over the
    data-parallel ranks first; a collective when given: call it on every rank. ``summed`` and ``same``: 0-d
    tensors read in the same transfer by name (``summed`` ones summed over the ranks too, ``same`` ones as this
    rank holds them).

    Each rank quantizes its own share of the activations and gradients, so theirs are summed; the
    weight (a name ending in ``.weight``) is the same tensor on every rank (replicated, or unsharded for the
    forward under FSDP), so its counts are rank 0's alone, as one process would count them.
    """
    summed, same = summed or {}, same or {}
    if not pairs:
        fields = count_fields = ()
        if not (summed or same):
            return {}
    device = pairs[0][1].scale.device if pairs else next(iter({**summed, **same}.values())).device

    def stack(names) -> torch.Tensor:
        if not names:
            return torch.zeros((len(pairs), 0), dtype=torch.float64, device=device)
        return torch.stack([torch.cat([_flat(s, f) for f in names]) for _, s in pairs])

    def scalars(values: dict) -> list[torch.Tensor]:
        return [v.detach().to(device, torch.float64).reshape(1) for v in values.values()]

    plain, counts = stack(fields), stack(count_fields)
    if count_fields and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        replicated = torch.tensor([name.endswith(".weight") for name, _ in pairs], device=device)
        counts = counts.masked_fill(replicated[:, None], 0.0)
    parts = [plain.reshape(-1), *scalars(same)]
    if count_fields or summed:
        parts.append(sum_over_ranks(torch.cat([counts.reshape(-1), *scalars(summed)])))
    read = torch.cat(parts).cpu()
    shapes = (plain.shape, counts.shape)
    plain, same_read, counts, summed_read = read.split([plain.numel(), len(same), counts.numel(), len(summed)])
    out = {**dict(zip(same, same_read)), **dict(zip(summed, summed_read))}
    names = (*fields, *count_fields)
    if names:
        first = pairs[0][1]
        table = torch.cat([plain.view(shapes[0]), counts.view(shapes[1])], dim=1)
        columns = table.split([_flat(first, f).numel() for f in names], dim=1)
        out.update({f: c.squeeze(1) if f != HEALTH and getattr(first, f).dim() == 0 else c for f, c in zip(names, columns)})
    return out


def as_rows(columns: dict[str, torch.Tensor], names) -> list[list[float]]:
    """The 0-d-buffer ``columns`` named ``names`` as rows, one per scaler (none without scalers)."""
    return torch.stack([columns[f] for f in names], dim=1).tolist() if columns else []


def gather(pairs, fields, count_fields=()) -> list[list[float]]:
    """:func:`gather_columns` of 0-d buffers as rows, one per scaler: ``fields`` then ``count_fields``."""
    return as_rows(gather_columns(pairs, fields, count_fields), (*fields, *count_fields))
