"""MemoryMonitor: where the training memory goes, every ``trainer.log_every_n_steps`` optimizer steps.

A total hides what low precision saves and what it costs (ZeRO's breakdown: parameters, gradients, optimizer
state, activations). Logged, in MiB (2^20 bytes), at the step they describe (the x of ``train/loss``):

    mem/params_mb               the parameters
    mem/grads_mb                the gradients at the optimizer step (all micro-batches accumulated)
    mem/optimizer_mb            the optimizer state (AdamW: two moments and a step count per parameter)
    mem/peak_mb                 (CUDA) torch.cuda.max_memory_allocated over the interval
    mem/activations_peak_mb     (CUDA) that peak minus the three above: activations, autograd's saved tensors
                                and temporaries at the peak (the peak is reset every interval)
    mem/rss_mb                  (CPU) the process's resident set size: everything, the Python heap and the
                                allocator's cache included; a CPU has no allocator peak to subtract from

The first three are counted from the tensors themselves (elements x element size; metadata only, no host
sync). They are per device, as the GPU memory is: under FSDP2 (``ModelParallelStrategy``) parameters,
gradients and moments are DTensors and each rank counts its local shard (``to_local()``), so the numbers
fall with the number of ranks; rank 0's are logged.
"""

from __future__ import annotations

import logging

import lightning as L
import torch

from .per_step import PerOptimizerStep

log = logging.getLogger(__name__)

PARAMS_MB, GRADS_MB, OPTIMIZER_MB = "mem/params_mb", "mem/grads_mb", "mem/optimizer_mb"
PEAK_MB, ACTIVATIONS_PEAK_MB, RSS_MB = "mem/peak_mb", "mem/activations_peak_mb", "mem/rss_mb"
MIB = 2 ** 20


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(tensor, "to_local", None)  # DTensor (FSDP2)
    return to_local() if callable(to_local) else tensor


def tensor_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors``, each tensor once (``parameters()`` already yields a tied weight once)."""
    unique = {id(t): t for t in tensors if isinstance(t, torch.Tensor)}
    return sum(local.numel() * local.element_size() for local in map(local_tensor, unique.values()))


def parameter_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    return tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizers) -> int:
    return tensor_bytes(value for optimizer in optimizers for state in optimizer.state.values()
                        for value in state.values())


def rss_bytes() -> int:
    """The process's resident set size (psutil, a requirement; /proc/self/statm without it)."""
    try:
        import psutil
    except ImportError:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return psutil.Process().memory_info().rss


class MemoryMonitor(PerOptimizerStep):
    """The memory breakdown (``mem/*``) every ``log_every_n_steps``.

    Args:
        enabled: log the memory breakdown every ``trainer.log_every_n_steps`` optimizer steps.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._grads_bytes: int | None = None
        self.last: dict[str, float] = {}  # the last logged values (tests, the summary)

    def _cuda_device(self, pl_module) -> torch.device | None:
        device = pl_module.device
        return device if device.type == "cuda" else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        device = self._cuda_device(pl_module)
        if self.enabled and device is not None:
            torch.cuda.reset_peak_memory_stats(device)  # the first interval starts here, not at model loading
        if self.enabled and trainer.is_global_zero and any(
                hasattr(p, "to_local") for p in pl_module.parameters()):
            log.info("memory: the parameters are sharded (FSDP2): mem/params_mb, grads_mb and optimizer_mb count "
                     "this rank's local shards")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # before the module's own hook, which drops the gradients of a skipped (non-finite) step
        if self.enabled and self.logging_step(trainer, trainer.global_step + 1):
            self._grads_bytes = gradient_bytes(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.enabled:
            return
        step = self.completed_step(trainer)
        if step is None or not self.logging_step(trainer, step + 1):
            return
        params, grads = parameter_bytes(pl_module), self._grads_bytes or 0
        moments = optimizer_state_bytes(trainer.optimizers)
        self._grads_bytes = None
        metrics = {PARAMS_MB: params / MIB, GRADS_MB: grads / MIB, OPTIMIZER_MB: moments / MIB}
        device = self._cuda_device(pl_module)
        if device is not None:
            peak = torch.cuda.max_memory_allocated(device)
            metrics[PEAK_MB] = peak / MIB
            # the persistent tensors did not all exist at every peak (the moments appear at the first step)
            metrics[ACTIVATIONS_PEAK_MB] = max(0, peak - params - grads - moments) / MIB
            torch.cuda.reset_peak_memory_stats(device)
        else:
            metrics[RSS_MB] = rss_bytes() / MIB
        self.last = metrics
        self.log_at(trainer, metrics, step)  # at the step the values describe, as train/loss
