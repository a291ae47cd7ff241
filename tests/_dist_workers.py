"""Worker functions for the multi-process tests (a light module: spawned children import only this)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from qat_app.scaling import AmaxScaler, sync_step_amax


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
