"""FSDP2 sharding of a HiF8 QAT model, for Lightning's ``ModelParallelStrategy``.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder block (the modules the
quantization's ``block_pattern`` names) and then to the whole model, over the data-parallel mesh. What
that means for HiF8 (``tests/test_fsdp.py`` checks each on 2 CPU processes against DDP and 1 process):

* a HiF8Linear's weight is a sharded DTensor between steps; FSDP2 all-gathers it before the block's
  forward, so the weight is quantized from the *unsharded* weight and its amax is the global one; the
  weight-code cache holds codes of that unsharded weight for the step (``release_weight_caches`` drops
  it after every optimizer step, so it never outlives the all-gathered weight it came from);
* scaler buffers are not sharded (every rank holds the whole history); the per-step MAX all-reduce and
  the non-finite skip flag work as under DDP;
* gradients are sharded: :func:`grad_norm` sums the squares of the local shards and all-reduces them, so
  clipping and the non-finite check see the global norm;
* with ``precision: bf16-mixed`` the mixed-precision policy gathers parameters in bf16 and reduces
  gradients in fp32 (the fp32 master weights stay sharded).
Checkpoints are distributed (a directory per checkpoint) and carry every scaler buffer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .errors import ConfigError


def decoder_blocks(model: nn.Module, block_pattern: str) -> list[nn.Module]:
    """The decoder blocks, in order: modules whose full name the pattern matches as a whole block."""
    regex = re.compile(block_pattern)
    blocks = []
    for name, module in model.named_modules():
        match = regex.search(name + ".")
        if match and match.end() >= len(name):  # the block itself, not a module inside it
            blocks.append(module)
    return blocks


def data_parallel_mesh(device_mesh):
    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ConfigError(
            "trainer.strategy: ModelParallelStrategy with tensor_parallel_size > 1 is not supported (HiF8 QAT shards "
            "with FSDP2 only); set init_args: {data_parallel_size: <devices x nodes>, tensor_parallel_size: 1}")
    return device_mesh["data_parallel"] if "data_parallel" in names else device_mesh


def shard_model(model: nn.Module, device_mesh, block_pattern: str, bf16: bool = False) -> int:
    """``fully_shard`` each decoder block, then the root; returns the number of blocks sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = data_parallel_mesh(device_mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    blocks = decoder_blocks(model, block_pattern)
    if not blocks:
        raise ConfigError(f"model.quant.block_pattern {block_pattern!r} names no decoder block to shard with FSDP2")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return len(blocks)


def grad_norm(grads: list[torch.Tensor], device) -> torch.Tensor:
    """The global L2 norm of ``grads``, sharded (DTensor) or whole: one all-reduce when any is sharded."""
    if not grads:
        return torch.zeros((), device=device)
    from torch.distributed.tensor import DTensor

    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    squares = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in local_tensors(grads)]).sum()
    torch.distributed.all_reduce(squares, group=sharded[0].device_mesh.get_group())
    return squares.sqrt()


def local_tensors(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's local shard (the tensor itself when it is not sharded), for in-place scaling."""
    from torch.distributed.tensor import DTensor

    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]
