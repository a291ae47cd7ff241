"""The compiled backend: the reference functions under ``torch.compile`` (C++/OpenMP on CPU).

Inputs are flattened to 1-D so one dynamic kernel serves every layer's shape. With ``required=False``
("auto") a compiler that fails here is not fatal: the backend logs once and runs the reference from then
on (same numbers); with ``required=True`` ("on") the error propagates.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

from . import reference
from .base import FakeQuantResult

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def _restore_shape(out, shape: torch.Size):
    if isinstance(out, FakeQuantResult):
        codes = out.codes.view(shape) if out.codes is not None else None
        return out._replace(dequantized=out.dequantized.view(shape), codes=codes)
    if isinstance(out, tuple):  # (FakeQuantResult, scale) from current scaling
        return (_restore_shape(out[0], shape), *out[1:])
    return out.view(shape)


class CompiledBackend:
    name = "compiled"

    def __init__(self, required: bool = False) -> None:
        self.required = required
        self.broken = os.environ.get("QAT_APP_NO_COMPILE") == "1"  # plain torch, on request

    def _run(self, fn: Callable, *args):
        if not self.broken:
            try:
                shape = args[0].shape
                flat = [a.reshape(-1) if isinstance(a, torch.Tensor) and a.shape == shape else a for a in args]
                return _restore_shape(_compiled(fn)(*flat), shape)
            except Exception as err:  # a missing compiler must not stop training: fall back, same numbers
                if self.required:
                    raise
                self.broken = True
                log.warning("torch.compile of the fake-quant kernel failed (%s); using plain torch", err)
        return fn(*args)

    def quantize(self, *args) -> FakeQuantResult:
        return self._run(reference.fake_quantize, *args)

    def quantize_current(self, *args) -> tuple[FakeQuantResult, torch.Tensor]:
        return self._run(reference.fake_quantize_current, *args)

    def dequantize(self, *args) -> torch.Tensor:
        return self._run(reference.dequantize_codes, *args)
