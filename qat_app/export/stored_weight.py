"""The 8-bit export's weights, plugged into a loaded model's quantized matmuls (their ``weight_source``).

:func:`~qat_app.export.reader.load_hif8` gives every quantized matmul (MoE experts' projections included) a
:class:`StoredWeight`: the weight tensor its forward passes, which holds ``decode(codes) / scale``, and, where the
reader gave them, the stored codes and scale. In eval mode, while that tensor is unchanged (moving the model to
another device or dtype keeps it; any in-place change or a new parameter does not), the forward runs on the stored
codes and scale, so the GEMM runs over the same grid values with the same decode scale as training did, or on the
weight as it is; in training mode, or once the weight changed, it is quantized as usual.
"""

from __future__ import annotations

import torch

from ..hif8.quantized import WeightQuantization


def weight_key(weight: torch.Tensor) -> tuple:
    """(parameter identity, its in-place version, the slice): survives ``.to(device/dtype)``, changes with any
    in-place update of the parameter or a new parameter. A slice (one expert's weight) is keyed by the parameter it
    views."""
    base = weight._base if weight._base is not None else weight
    return id(base), base._version, weight.storage_offset(), tuple(weight.shape)


class StoredWeight:
    """The weight a matmul was loaded with (:class:`~qat_app.hif8.quantized.WeightSource`)."""

    def __init__(self, weight: torch.Tensor, codes: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> None:
        self.key = weight_key(weight)
        self.codes = codes
        self.scale = None if scale is None else scale.reshape(()).float()

    def holds(self, weight: torch.Tensor) -> bool:
        """``weight`` is the one loaded, unchanged since."""
        return self.key == weight_key(weight)

    def weight_operand(self, weight: torch.Tensor, dtype: torch.dtype) -> WeightQuantization | None:
        if not self.holds(weight):
            return None
        if self.codes is not None:  # the exported codes and scale: what training computed
            return WeightQuantization(self.codes.to(weight.device), self.scale.to(weight.device))
        return WeightQuantization(weight.detach().to(dtype), None)  # already decode(codes)/scale: as it is
