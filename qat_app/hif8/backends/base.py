"""The backend contract: the result type of a fake quantization and what every backend implements.

A leaf module (imports only torch), so the reference, compiled and Triton backends, the quantized
linear and the export all depend on it and never on each other.

Contract, for a tensor ``x``, a 0-d float32 ``scale`` and ``max_val``: ``q = round(clamp(x * scale,
+-max_val))`` on the format's grid, ``dequantized = (q / scale).to(x.dtype)``, ``amax = max |x|``
(NaN/inf propagate), ``clipped`` = elements with ``|x * scale| >= clip_threshold`` (the clamp changed
their quantized value: :func:`qat_app.hif8.formats.saturation_threshold`), ``codes`` = uint8 codes of
``q`` when asked for. With ``grid``, ``q`` itself instead of ``dequantized`` (the emulated GEMM's operand: no
division, no second pass to decode the codes); with ``whatif_scales`` (float32 ``[k]``), the elements each of
those scales would clip, counted in the same pass (:mod:`qat_app.hif8.health`'s what-if). Every backend gives
the same bits.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class FakeQuantResult(NamedTuple):
    dequantized: torch.Tensor | None  # same dtype as the input; None when the grid values were asked for instead
    amax: torch.Tensor  # float32 0-d: max |x| of the input (NaN/inf propagate)
    clipped: torch.Tensor  # int64 0-d: elements whose quantized value the clamp changed
    codes: torch.Tensor | None  # uint8 codes of x * scale when asked for
    grid: torch.Tensor | None = None  # q itself (the grid values of x * scale, input dtype: exact) when asked for
    whatif: torch.Tensor | None = None  # int64 [k]: elements clipped under each of k other scales, when given


class Backend(Protocol):
    """One way to run the contract on one kind of tensor (resolved per device, dtype and format)."""

    name: str

    def quantize(self, x: torch.Tensor, scale: torch.Tensor, max_val: float, clip_threshold: float, fmt_name: str,
                 want_codes: bool, noise: torch.Tensor | None, grid: bool = False,
                 whatif_scales: torch.Tensor | None = None) -> FakeQuantResult:
        """Delayed scaling: ``scale`` is given."""

    def quantize_current(self, x: torch.Tensor, fallback_scale: torch.Tensor, max_val: float, clip_threshold: float,
                         margin: float, fmt_name: str, want_codes: bool,
                         noise: torch.Tensor | None, power_2: bool = False,
                         grid: bool = False) -> tuple[FakeQuantResult, torch.Tensor]:
        """Current scaling: the scale comes from ``x``'s own amax; returns (result, scale used)."""

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor | None, fmt_name: str,
                   dtype: torch.dtype) -> torch.Tensor:
        """uint8 codes of ``x * scale`` -> the dequantized tensor, bit-identical to ``quantize``'s; ``scale=None``:
        the grid values (``quantize``'s ``grid``)."""
