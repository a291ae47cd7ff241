"""HiF8Linear: a drop-in nn.Linear with W8A8 fake quantization and straight-through gradients.

The quantization itself (scalers, weight codes cache, plan, autograd function, the stored-weight source) is
:class:`~qat_app.hif8.quantized.QuantizedMatmul`'s, shared with the MoE experts' projections; this module
adds what is particular to a dense layer: it is an ``nn.Linear`` (or wraps transformers' ``Conv1D``), and
:meth:`HiF8Linear.to_float` gives back the module it was made from.
"""

from __future__ import annotations

import torch
from torch import nn

from .quantized import QuantizedMatmul
from .recipe import HiF8Recipe, RuntimeOptions


class HiF8Linear(QuantizedMatmul, nn.Linear):
    """An ``nn.Linear`` whose matmul is W8A8 (:class:`~qat_app.hif8.quantized.QuantizedMatmul`); same parameters."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: HiF8Recipe | None = None,
        runtime: RuntimeOptions | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.init_quantization(recipe, runtime, self.weight.device)
        self.source_type = "linear"  # or "conv1d" (GPT-2 style, weight stored transposed)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: HiF8Recipe | None = None,
                    runtime: RuntimeOptions | None = None) -> "HiF8Linear":
        """Wrap an existing nn.Linear (or transformers' Conv1D) sharing its parameters.

        The module's class is recorded (``source_class``, e.g. Falcon's ``FalconLinear``, an nn.Linear
        subclass) so :meth:`to_float` gives back that class, not a plain nn.Linear."""
        is_conv1d = type(linear).__name__ == "Conv1D"
        weight = linear.weight
        in_features, out_features = (weight.shape[0], weight.shape[1]) if is_conv1d else (weight.shape[1], weight.shape[0])
        with torch.device("meta"):
            new = cls(in_features, out_features, linear.bias is not None, recipe=recipe, runtime=runtime, dtype=weight.dtype)
        new.init_quantization(new.recipe, new.runtime, weight.device)  # the scalers were built on meta
        if is_conv1d:
            new.weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
            new.source_type = "conv1d"
        else:
            new.weight = weight
        new.bias = linear.bias
        new.source_class = type(linear)
        new.train(linear.training)
        return new

    def to_float(self) -> nn.Module:
        """The plain module with the same (unquantized, trained) weights, of the class it was made from
        (``source_class``: nn.Linear, an nn.Linear subclass such as ``FalconLinear``, or Conv1D)."""
        source = getattr(self, "source_class", None)  # None: built directly, not by from_linear
        bias = self.bias is not None
        if self.source_type == "conv1d":
            if source is None:
                from transformers.pytorch_utils import Conv1D as source
            with torch.device("meta"):
                plain = source(self.out_features, self.in_features)
            plain.weight = nn.Parameter(self.weight.detach().t().contiguous(), requires_grad=self.weight.requires_grad)
        else:
            source = source if source is not None else nn.Linear
            try:
                with torch.device("meta"):
                    plain = source(self.in_features, self.out_features, bias=bias)
            except TypeError as err:  # a subclass whose constructor is not nn.Linear's
                import warnings

                warnings.warn(f"cannot rebuild {source.__qualname__} ({err}); restored as nn.Linear", stacklevel=2)
                with torch.device("meta"):
                    plain = nn.Linear(self.in_features, self.out_features, bias=bias)
            plain.weight = self.weight
        plain.bias = self.bias
        plain.train(self.training)
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.quantization_repr()}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized_matmul(x, self.weight, self.bias)

