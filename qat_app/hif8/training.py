"""The paper's recipe from any training loop: convert, then one call per optimizer step.

After :func:`~qat_app.hif8.patch.convert_to_hif8_training`, :func:`start_warmup` observes amax and quantizes
nothing, and :func:`end_warmup` seeds the histories and switches W8A8 on. :func:`sync_and_advance` is the whole
per-step protocol. Contract: call it after the last backward of the step (all micro-batches) and before
``optimizer.step()``. Under data parallelism one MAX all-reduce gives every rank the step's amax and the
non-finite flag, so all ranks decide alike; then every scaler advances in one batched update (:mod:`.scaler_bank`)
and the cached weight codes are released. For a non-finite step it returns True (skip the optimizer step) and
discards the step's observations, so no NaN reaches a history. One host sync per call, none per forward.

See ``docs/core.md`` for the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from .patch import quantized_linears, set_quantization
from .profiling import SCALER_UPDATE, profiled
from .scaler_bank import advance_all, discard_all, seed_all, sync_step_amax
from .scaling import all_scalers


def sync_and_advance(model: nn.Module, nonfinite: torch.Tensor | bool | None = None, group=None) -> bool:
    """Close one optimizer step of every HiF8 layer of ``model``; returns True when the step must be skipped.

    ``nonfinite``: this rank's flag that its loss or gradients were NaN/inf (a bool or 0-d bool tensor);
    ``group``: the data-parallel process group (default: the world, a no-op without one).
    """
    with profiled(SCALER_UPDATE):
        scalers = all_scalers(model)
        flag = None if nonfinite is None else torch.as_tensor(nonfinite, dtype=torch.bool)
        if flag is not None and scalers:
            flag = flag.to(scalers[0].step_amax.device)
        reduced = sync_step_amax(scalers, group=group, bad_step=flag)
        if reduced is not None and bool(reduced):  # the one host sync
            discard_all(scalers)
            return True
        advance_all(scalers)
        release_weight_caches(model)
        return False


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
