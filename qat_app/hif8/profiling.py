"""Named ranges for the profiler: what a W8A8 step spends on quantization, the GEMM, the scalers and the diagnostics.

The core marks its own work with :func:`profiled` (a ``torch.profiler.record_function`` range while a profiler
records, nothing otherwise: a context manager that checks one flag, so the hot path pays no profiler cost when
none is on). :mod:`qat_app.step_profile` sorts a profile's time into categories by the innermost of these
ranges; the names are declared here once.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

QUANTIZE = "qat/quantize"  # fake quantization of an operand, and decoding saved codes
GEMM = "qat/gemm"  # the W8A8 product over the grid (emulated, FP8 or dequantize-first)
SCALER_UPDATE = "qat/scaler_update"  # the per-step amax sync and the scalers' batched update
HEALTH = "qat/health"  # numeric health (logging steps)
WHATIF = "qat/whatif"  # what the other estimators would have clipped
RANGES = (QUANTIZE, GEMM, SCALER_UPDATE, HEALTH, WHATIF)

_NOT_RECORDING = contextlib.nullcontext()


def profiled(name: str):
    """``record_function(name)`` while the autograd profiler records, else a no-op context."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else _NOT_RECORDING
