"""Worker functions for the multi-process tests (a light module: spawned children import only this)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from qat_app.hif8.scaler_bank import sync_step_amax
from qat_app.hif8.scaling import AmaxScaler


def sync_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        scalers = [AmaxScaler("max", history_len=4) for _ in range(3)]
        results = {}
        # step 1: different amax per rank; scaler 2 only runs on rank 1
        scalers[0].observe(torch.tensor(1.0 + rank), None, 1)
        scalers[1].observe(torch.tensor(5.0 - rank), None, 1)
        if rank == 1:
            scalers[2].observe(torch.tensor(3.0), None, 1)
        results["bad1"] = bool(sync_step_amax(scalers, bad_step=torch.tensor(False)))
        for s in scalers:
            s.advance()
        # step 2: NaN on rank 0 only for scaler 0 -> inf on both ranks -> not recorded by either
        scalers[0].observe(torch.tensor(float("nan") if rank == 0 else 0.5), None, 1)
        scalers[1].observe(torch.tensor(7.0 * rank), None, 1)
        results["bad2"] = bool(sync_step_amax(scalers, bad_step=torch.tensor(False)))
        for s in scalers:
            s.advance()
        # step 3: a non-finite gradient on rank 1 only: both ranks must see the step as bad
        scalers[1].observe(torch.tensor(1.0), None, 1)
        results["bad3"] = bool(sync_step_amax(scalers, bad_step=torch.tensor(rank == 1)))
        for s in scalers:
            s.discard_step()
        results["calls"] = list(calls)
        results["state"] = [{k: v.clone() for k, v in s.state_dict().items()} for s in scalers]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


def saturation_counts_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Each rank runs a HiF8Linear on its half of one global batch (with planted outliers) for two
    optimizer steps; the saturation callback's gather sums the counts over the ranks."""
    from callbacks.saturation import COUNT_FIELDS, FIELDS, TOTAL_COUNT_FIELDS, TOTAL_FIELDS, gather, named_scalers

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = saturation_model()
        per_step = []
        for step in range(2):
            batch = saturation_batch(step)
            model(batch.chunk(world)[rank])
            sync_step_amax([s for _, s in named_scalers(model)])
            for _, scaler in named_scalers(model):
                scaler.advance()
            per_step.append(gather(named_scalers(model), FIELDS, COUNT_FIELDS))
        totals = gather(named_scalers(model), TOTAL_FIELDS, TOTAL_COUNT_FIELDS)
        torch.save({"per_step": per_step, "totals": totals}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def saturation_model():
    """A model whose quantized layer clips: max window of 2 seeded with a small amax."""
    from torch import nn

    from qat_app.config import QuantConfig
    from qat_app.hif8.linear import HiF8Linear

    torch.manual_seed(0)
    layer = HiF8Linear(16, 8, bias=False, **QuantConfig(amax_algo="max", history_len=2, fused="off").layer_options())
    with torch.no_grad():
        layer.weight[0, 0] = 0.9  # the weight's own amax: grows at the step below
    for scaler in layer.scalers():
        scaler.observe(torch.tensor(0.5), None, 1)
        scaler.advance()
    model = nn.Sequential()
    model.add_module("model", nn.Sequential())
    model.model.add_module("proj", layer)
    return model


def saturation_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 16, generator=g) * 0.2
    x[1, 3], x[6, 2], x[7, 0] = 3.0, -2.0, 0.55  # outliers on both halves of the batch
    return x
