"""The paper's recipe from any training loop: convert, then one call per optimizer step.

After :func:`~qat_app.hif8.patch.convert_to_hif8_training`, :func:`start_warmup` observes amax and quantizes
nothing, and :func:`end_warmup` seeds the histories and switches W8A8 on. :func:`sync_and_advance` is the whole
per-step protocol. Contract: call it after the last backward of the step (all micro-batches) and before
``optimizer.step()``. Under data parallelism one MAX all-reduce gives every rank the step's amax and the
non-finite flag, so all ranks decide alike; then every scaler advances in one batched update (:mod:`.scaler_bank`)
and the cached weight codes are released. For a non-finite step its record says ``skipped`` (skip the optimizer
step) and the step's observations are discarded, so no NaN reaches a history. One host sync per call (two when
the step's record is read), none per forward.

See ``docs/core.md`` for the loop.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .fallback import FallbackMonitor, fallback_step
from .patch import quantized_linears, set_quantization
from .profiling import SCALER_UPDATE, profiled
from .scaler_bank import advance_all, discard_all, seed_all, sync_step_amax
from .scaling import all_scalers
from .step_record import StepRecord, read_record


def sync_and_advance(model: nn.Module, nonfinite: torch.Tensor | bool | None = None, group=None, *, step: int = 0,
                     read: bool = False, loss: torch.Tensor | None = None, grad_norm: torch.Tensor | None = None,
                     fallback: FallbackMonitor | None = None) -> StepRecord:
    """Close optimizer step ``step`` of every HiF8 layer of ``model`` -> its :class:`StepRecord`, whose ``skipped``
    says the optimizer step must be skipped.

    ``nonfinite``: this rank's flag that its loss or gradients were NaN/inf (a bool or 0-d bool tensor);
    ``group``: the data-parallel process group (default: the world, a no-op without one). With ``read`` (or a
    ``fallback`` monitor) the record holds every quantized tensor's figures of the step, read in one more host
    transfer (element counts and ``loss``, this rank's mean over its micro-batches, summed over the ranks; the
    record's loss is their mean), and the decisions ``fallback`` (:class:`~.fallback.FallbackMonitor`) took on them.
    """
    with profiled(SCALER_UPDATE):
        scalers = all_scalers(model)
        flag = None if nonfinite is None else torch.as_tensor(nonfinite, dtype=torch.bool)
        if flag is not None and scalers:
            flag = flag.to(scalers[0].step_amax.device)
        reduced = sync_step_amax(scalers, group=group, bad_step=flag)
        skipped = reduced is not None and bool(reduced)  # the one host sync of the step's protocol
        if skipped:
            discard_all(scalers)
        else:
            advance_all(scalers)
            release_weight_caches(model)
    if not (read or fallback is not None):
        return StepRecord(step, skipped)
    record = read_record(model, step, skipped, loss, grad_norm)
    if fallback is None or not record.read:
        return record
    return replace(record, fallback=tuple(fallback_step(model, fallback, step, record.counters)))


def release_weight_caches(model: nn.Module) -> None:
    """Drop every layer's cached weight codes (stale once the optimizer steps; not held through its peak)."""
    for _, module in quantized_linears(model):
        module.release_weight_cache()


def resolve_gemms(model: nn.Module, device: torch.device) -> None:
    """Resolve every quantized matmul's GEMM (``gemm: auto`` times the two on a GPU and, under data parallelism,
    broadcasts rank 0's choice: every rank calls this at setup, not inside a forward)."""
    for _, module in quantized_linears(model):
        module.gemm_for(torch.device(device))


def start_warmup(model: nn.Module) -> None:
    """BF16 warmup: quantization off, observers still recording amax into the histories."""
    set_quantization(model, weights=False, activations=False, grads=False)


def end_warmup(model: nn.Module, weights: bool = True, activations: bool = True) -> None:
    """The switch: seed every history (slots the warmup did not reach take its max, so the first
    quantized step sees a full window), then turn weight and/or activation quantization on."""
    seed_all([s for _, layer in quantized_linears(model) for s in layer.scalers()])
    set_quantization(model, weights=weights, activations=activations, grads=True)
