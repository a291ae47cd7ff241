"""Fake-quantization backends behind one contract (:mod:`.base`), resolved once per kind of tensor.

``resolve(mode, device_type, fmt_name)`` returns the backend for ``mode`` ("off": reference plain torch;
"auto": the fastest that works here, falling back with a warning; "on": the fastest, errors propagate):
the Triton kernel for HiF8 on CUDA (QAT_APP_NO_TRITON=1 disables it; on CPU tensors the kernel runs
only when called directly, under TRITON_INTERPRET=1, as the tests do), torch.compile elsewhere. The result is cached, and a backend that fails in "auto" falls
back inside itself, so the choice is made once, not on every call.
"""

from __future__ import annotations

import functools
import os

from .base import Backend, FakeQuantResult
from .compiled import CompiledBackend, compiles_exact_division
from .reference import ReferenceBackend

MODES = ("auto", "on", "off")

__all__ = ["Backend", "FakeQuantResult", "MODES", "resolve"]


def _triton_applies(device_type: str, fmt_name: str) -> bool:
    if fmt_name != "hif8" or os.environ.get("QAT_APP_NO_TRITON") == "1":
        return False
    from .triton import _triton_importable  # imports triton lazily, only when asked

    return device_type == "cuda" and _triton_importable()


@functools.lru_cache(maxsize=None)
def resolve(mode: str, device_type: str, fmt_name: str) -> Backend:
    """The backend for ``mode`` on tensors of ``device_type`` in format ``fmt_name`` (cached)."""
    if mode not in MODES:
        raise ValueError(f"fused: unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "off":
        return ReferenceBackend()
    compiled = CompiledBackend(required=mode == "on", exact_division=not compiles_exact_division(device_type))
    if _triton_applies(device_type, fmt_name):
        from .triton import TritonBackend

        return TritonBackend(compiled, required=mode == "on")
    return compiled
