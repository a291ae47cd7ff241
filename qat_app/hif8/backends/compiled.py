"""The compiled backend: the reference functions under ``torch.compile`` (C++/OpenMP on CPU, Triton on CUDA).

Inputs are flattened to 1-D so one dynamic kernel serves every layer's shape. With ``required=False``
("auto") a function that fails to compile is not fatal: that function runs in plain torch from then on (the same
bits, by the contract), said once in the log with the reason, and the others stay compiled
(:func:`run_compiled`); with ``required=True`` ("on") the error propagates.

Inductor's C++ divides as IEEE does; its Triton code does not (``x / y`` and reciprocals lower to approximate
instructions on NVIDIA GPUs). So with ``exact_division`` (every device but the CPU) no compiled graph divides:
the grid values are computed compiled, the division by the scale and the current scale are plain torch ops
(:func:`.reference.divide_by_scale`, :func:`.reference.current_scale`), correctly rounded everywhere.
"""

from __future__ import annotations

import functools
import logging
import os
import traceback
from typing import Callable

import torch

from ..kernel_count import counted_call
from ..profiling import WHATIF, profiled
from . import reference
from .base import FakeQuantResult

log = logging.getLogger(__name__)


# what torch.compile compiles with; a test records the graphs it is given by replacing it
COMPILER: str | Callable = "inductor"


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable, compiler: str | Callable) -> Callable:
    return torch.compile(fn, dynamic=True, backend=compiler)


def compiled_function(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile`` (dynamic shapes, :data:`COMPILER`), compiled once per function."""
    return _compiled(fn, COMPILER)


# (function, compiler) -> why compiling it failed: it runs in plain torch from then on
_failed: dict[tuple[Callable, str | Callable], str] = {}


def compiles(fn: Callable) -> bool:
    """Whether :func:`run_compiled` compiles ``fn`` (not where it failed before, nor under QAT_APP_NO_COMPILE=1)."""
    return (fn, COMPILER) not in _failed and os.environ.get("QAT_APP_NO_COMPILE") != "1"


def run_compiled(fn: Callable, *args, required: bool = False, name: str | None = None):
    """``fn(*args)`` under ``torch.compile`` (counted as one kernel ``name``, default ``fn``'s name).

    Where ``fn`` fails to compile (any error of the compiled call) and not ``required``: ``fn`` in plain torch, now
    and on every later call (the same bits: every compiled function here is one of the contract's plain-torch
    functions), said once in the log with the function and the reason; other functions stay compiled. With
    ``required`` (``fused="on"``, the tests that audit the compiled graphs) the error propagates."""
    if not compiles(fn):
        return fn(*args)
    try:
        return counted_call(name or fn.__name__, compiled_function(fn), *args)
    except torch.OutOfMemoryError:  # the device's memory, not the compiler: plain torch would not do better
        raise
    except Exception as err:
        if required:
            raise
        why = _reason(err)
        _failed[(fn, COMPILER)] = why
        log.warning("torch.compile of %s.%s failed (%s); it runs in plain torch from now on (the same bits)",
                    fn.__module__, fn.__qualname__, why)
    return fn(*args)


def compiles_exact_division(device_type: str) -> bool:
    """Whether inductor's code for ``device_type`` divides as IEEE does (its C++ on the CPU; not its Triton)."""
    return device_type == "cpu"


def _restore_shape(out, shape: torch.Size):
    if isinstance(out, FakeQuantResult):
        return out._replace(**{field: getattr(out, field).view(shape) for field in ("dequantized", "codes", "grid")
                               if getattr(out, field) is not None})
    if isinstance(out, tuple):  # (FakeQuantResult, scale) from current scaling
        return (_restore_shape(out[0], shape), *out[1:])
    return out.view(shape)


def _reason(err: BaseException) -> str:
    """The innermost cause of a compile error in one line: its type, where it was raised, its first line."""
    while (inner := getattr(err, "inner_exception", None) or err.__cause__) is not None:  # dynamo wraps it
        err = inner
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}{where}: {first[:300]}" if first else f"{type(err).__name__}{where}"


class CompiledBackend:
    name = "compiled"

    def __init__(self, required: bool = False, exact_division: bool = False) -> None:
        self.required = required
        self.exact_division = exact_division  # divide outside the compiled graphs (see the module docstring)

    def _run(self, fn: Callable, *args, like_input: bool = True):
        """``fn(*args)`` compiled, on flattened inputs; ``like_input``: its outputs shaped like ``args[0]`` get
        that shape back (False: ``fn`` returns reductions only). A function that does not compile runs in plain
        torch (:func:`run_compiled`)."""
        if not compiles(fn):
            return fn(*args)
        shape = args[0].shape
        flat = [a.reshape(-1) if isinstance(a, torch.Tensor) and a.shape == shape else a for a in args]
        out = run_compiled(fn, *flat, required=self.required)
        return _restore_shape(out, shape) if like_input else out

    def quantize(self, x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, grid=False,
                 whatif_scales=None) -> FakeQuantResult:
        if self.exact_division and not grid:
            result = self._run(reference.quantize_to_grid, x, scale, max_val, clip_threshold, fmt_name, want_codes,
                               noise)
            result = reference.divide_by_scale(result, scale, x.dtype)
        else:
            result = self._run(reference.fake_quantize, x, scale, max_val, clip_threshold, fmt_name, want_codes,
                               noise, grid)
        if whatif_scales is None:
            return result
        # a kernel of its own: fused into the quantize kernel, inductor's CPU code for the extra counts costs
        # six times what this separate read of x does (measured at 1.5M elements, benchmarks/step_overhead.py)
        with profiled(WHATIF):
            return result._replace(whatif=self._run(reference.whatif_counts, x, whatif_scales, clip_threshold,
                                                    like_input=False))

    def quantize_current(self, x, fallback_scale, max_val, clip_threshold, margin, fmt_name, want_codes, noise,
                         power_2=False, grid=False) -> tuple[FakeQuantResult, torch.Tensor]:
        if not self.exact_division:
            return self._run(reference.fake_quantize_current, x, fallback_scale, max_val, clip_threshold, margin,
                             fmt_name, want_codes, noise, power_2, grid)
        amax = self.amax(x)
        scale = reference.current_scale(amax, max_val, margin, fallback_scale, power_2)
        return self.quantize(x, scale, max_val, clip_threshold, fmt_name, want_codes, noise, grid), scale

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """max |x| in float32 (one compiled reduction: exact on every device)."""
        return self._run(reference.amax_of, x, like_input=False)

    def dequantize(self, codes, scale, fmt_name, dtype) -> torch.Tensor:
        if not self.exact_division or scale is None:
            return self._run(reference.dequantize_codes, codes, scale, fmt_name, dtype)
        return reference.dequantized(self._run(reference.decode_grid, codes, fmt_name), scale, dtype)
