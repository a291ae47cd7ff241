"""The paper's recipe from any training loop: convert, then one call per optimizer step.

    from qat_app.hif8 import convert_to_hif8_training, end_warmup, start_warmup, sync_and_advance

    convert_to_hif8_training(model)                # the paper's layout and recipe (max window, H=64)
    start_warmup(model)                            # BF16 warmup: observe amax, quantize nothing
    for step, batch in enumerate(loader):
        if step == warmup_steps:
            end_warmup(model)                      # seed the histories, switch W8A8 on
        loss = model(**batch).loss
        loss.backward()
        if sync_and_advance(model, nonfinite=~torch.isfinite(loss)):
            optimizer.zero_grad()                  # a NaN/inf step (on any rank): skip it
            continue
        optimizer.step()
        optimizer.zero_grad()

``sync_and_advance`` is the whole per-step protocol (torchao's ``sync_float8_amax_and_scale_history``
plus the skip decision): under data parallelism one MAX all-reduce gives every rank the step's amax
(and the non-finite flag, so all ranks skip alike); then every scaler is advanced in one batched update
(:mod:`.scaler_bank`) and the cached weight codes are released before the optimizer changes the weights;
or, for a skipped step, the step's observations are discarded so no NaN reaches a history. It must run
after the last backward of the step (all micro-batches) and before ``optimizer.step()``. One host sync
per call (the skip decision); none per forward.
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


def start_warmup(model: nn.Module) -> None:
    """BF16 warmup: quantization off, observers still recording amax into the histories."""
    set_quantization(model, weights=False, activations=False, grads=False)


def end_warmup(model: nn.Module, weights: bool = True, activations: bool = True) -> None:
    """The switch: seed every history (slots the warmup did not reach take its max, so the first
    quantized step sees a full window), then turn weight and/or activation quantization on."""
    seed_all([s for _, layer in quantized_linears(model) for s in layer.scalers()])
    set_quantization(model, weights=weights, activations=activations, grads=True)
