"""Kernels and bytes of a piece of work, counted on any device (the CPU too), so GPU costs can be read without a GPU.

:class:`KernelCounter` is a ``TorchDispatchMode``: every aten op that computes (not a view, an allocation or a
metadata query) counts as one kernel launch, with the bytes it reads (its tensor inputs) and writes (its
outputs). A compiled function or a Triton kernel of the backends (:func:`counted_call`) counts as one kernel with
the bytes of its inputs and outputs, as the GPU runs it, not as the ops it is written in. Figures are a model of
a GPU's work (one pass per kernel, no cache reuse), not a measurement: docs/performance.md says how to read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SMALL = 64  # a kernel whose output has at most this many elements is bookkeeping (a scale, a counter)
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
                "lift_fresh", "_unsafe_view", "view", "_reshape_alias", "set_", "resize_", "_local_scalar_dense",
                "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "record_stream"}
_active: list["KernelCounter"] = []


def _bytes(tensors) -> int:
    """The bytes of distinct tensors (a tensor passed twice is read once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


@dataclass
class KernelCount:
    """What a piece of work launched: ``kernels`` (of them ``small``: outputs of <= :data:`SMALL` elements), bytes
    read and written, and the kernels by name."""

    kernels: int = 0
    small: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    by_name: Counter = field(default_factory=Counter)
    bytes_by_name: Counter = field(default_factory=Counter)
    kernel_list: list = field(default_factory=list)  # (name, bytes read, bytes written) of each, in order

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    def record(self, name: str, inputs, outputs) -> None:
        outs = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        read, written = _bytes(tree_leaves(inputs)), _bytes(outs)
        self.kernels += 1
        self.small += all(t.numel() <= SMALL for t in outs)
        self.bytes_read += read
        self.bytes_written += written
        self.by_name[name] += 1
        self.bytes_by_name[name] += read + written
        self.kernel_list.append((name, read, written))

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "small": self.small, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written}


class KernelCounter(TorchDispatchMode):
    """``with KernelCounter() as counter: ...`` -> ``counter.count``, a :class:`KernelCount`."""

    def __init__(self) -> None:
        super().__init__()
        self.count = KernelCount()
        self._inside = 0  # > 0 inside a region counted as one kernel

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if not self._inside and not func.is_view and name not in _NOT_KERNELS:
            inputs = (args, {k: v for k, v in kwargs.items() if k != "out"})  # an out= tensor is written, not read
            self.count.record(name, inputs, out)
        return out


def counted_call(name: str, fn, *args, reads=None):
    """``fn(*args)``; while a counter is active, counted as one kernel named ``name`` that reads ``reads`` (default:
    ``args``) and writes what ``fn`` returns, the ops inside not counted. Without a counter: the call alone (one
    list check), so the hot path pays nothing."""
    if not _active:
        return fn(*args)
    counter = _active[-1]
    counter._inside += 1
    try:
        out = fn(*args)
    finally:
        counter._inside -= 1
    counter.count.record(name, args if reads is None else reads, out)
    return out
