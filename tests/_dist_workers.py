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
    from callbacks.saturation import TOTAL_COUNT_FIELDS, TOTAL_FIELDS
    from qat_app.hif8.step_record import COUNT_FIELDS, FIELDS, named_scalers
    from qat_app.hif8.counters import gather

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


class _DistilledStep(torch.nn.Module):
    """The distilled loss of one micro-batch as a module's forward -> (loss, KL)."""

    def __init__(self, model, teacher, settings) -> None:
        super().__init__()
        self.model, self.settings = model, settings
        self.__dict__["teacher"] = teacher  # not a submodule, as in QATModule

    def forward(self, ids):
        loss, kl, _ = self.teacher.loss(self.model, ids, ids, self.settings)
        return loss, kl


def equivalence_worker(rank: int, world: int, mode: str, init_file: str, out_dir: str, steps: int = 4,
                       distill: bool = False) -> None:
    """The recipe (one warmup step, then QAT) on one global batch of 4 sequences: one process (``single``), or
    2 processes with half the batch each under DDP (``ddp``) or FSDP2 (``fsdp``). Saves the global losses and
    the scaler states; with ``distill``, trained on KL(initial model || student) (one replica of the teacher per
    rank), also the global KLs and the teacher's fingerprint at the end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qat_app.config import QuantConfig, quantize_model
    from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                             num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
                                             max_position_embeddings=64))
        teacher = None
        if distill:
            from qat_app.distill import DistillConfig, Teacher

            teacher, settings = Teacher.initial(model), DistillConfig(enabled=True, ce_weight=0.1)
        quantize_model(model, QuantConfig(amax_algo="max", history_len=8, high_precision_layers=1, fused="off"))
        if mode == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            from qat_app.fsdp import shard_model

            shard_model(model, init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",)),
                        QuantConfig().block_pattern)
        # as Lightning runs it: the whole step inside the (DDP-wrapped) module's forward
        trained = _DistilledStep(model, teacher, settings) if teacher is not None else model
        if mode == "ddp":
            trained = torch.nn.parallel.DistributedDataParallel(trained)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        losses, kls = [], []
        start_warmup(model)  # step 0 unquantized, observed: the recipe's warmup fills the (synced) histories
        for step in range(steps):
            batch = torch.randint(0, 128, (4, 16), generator=gen)
            local = batch.chunk(world)[rank]
            if teacher is None:
                loss = trained(input_ids=local, labels=local).loss
            else:
                loss, kl = trained(local)
                kl = kl.detach().clone()
                if world > 1:
                    dist.all_reduce(kl)
                kls.append(float(kl) / world)
            loss.backward()
            skipped = sync_and_advance(model, nonfinite=~torch.isfinite(loss.detach())).skipped
            assert not skipped
            if step == 0:
                end_warmup(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            if world > 1:
                dist.all_reduce(total)
            losses.append(float(total) / world)
        scalers = {k: v.detach().clone() for k, v in model.state_dict().items() if "_scaler." in k}
        extra = {}
        if teacher is not None:
            from qat_app.distill.teacher import fingerprint

            extra = {"kl": kls, "teacher": fingerprint(teacher.model), "teacher_initial": teacher.fingerprint}
        torch.save({"losses": losses, "scalers": scalers, **extra}, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    finally:
        if world > 1:
            dist.destroy_process_group()
