"""HiF8Linear: a drop-in nn.Linear with W8A8 fake quantization and straight-through gradients.

Forward: the input activation and the weight are each fake-quantized with their own per-tensor
scaler (scale, clip to +-max_val, round, dequantize), then multiplied. Backward (STE): the
gradients are those of a linear layer evaluated at the quantized tensors, passed straight through
the rounding and, with ``ste="identity"`` (the paper's), through the clipping as well; with
``ste="clipped"`` elements that saturated get zero gradient. Optionally the output gradient is
fake-quantized too (own scaler, stochastic rounding).

Observers record amax whether or not quantization is switched on (the BF16 warmup relies on
that), but only in training mode, so evaluation never moves a history. The weight is quantized
once per optimizer step: the result is cached until the parameter changes (``_version``) or the
scale does. With ``save_8bit_activations`` the quantized input is kept for backward as uint8
codes plus the scale; decoding reproduces it exactly, so gradients are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fake_quant import dequantize_codes, saturated_mask
from .formats import Float8Format, get_format
from .recipe import HiF8Recipe, RuntimeOptions
from .scaling import AmaxScaler


def _make_scaler(recipe: HiF8Recipe, max_val: float, device) -> AmaxScaler:
    return AmaxScaler(recipe.amax_algo, recipe.history_len, recipe.alpha, max_val, recipe.margin, device=device)


def init_quantization(module: nn.Module, recipe: HiF8Recipe | None, runtime: RuntimeOptions | None, device) -> None:
    """The quantization state of a layer: recipe, runtime options, format, scalers, switches, weight cache."""
    module.recipe = recipe = recipe if recipe is not None else HiF8Recipe()
    module.runtime = runtime = runtime if runtime is not None else RuntimeOptions()
    module.format = get_format(recipe.format)
    module.input_scaler = _make_scaler(recipe, recipe.resolved_max_val, device)
    module.weight_scaler = _make_scaler(recipe, recipe.resolved_max_val, device)
    module.grad_scaler = _make_scaler(recipe, recipe.grad_max_val, device) if recipe.quantize_grads else None
    module.quantize_activations = runtime.quantize_activations
    module.quantize_weights = runtime.quantize_weights
    module.quantize_grads = recipe.quantize_grads
    module._weight_cache = None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class HiF8Linear(nn.Linear):
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
        init_quantization(self, recipe, runtime, self.weight.device)
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
        # the scalers were built on meta: rebuild them on the weight's device
        for name in ("input_scaler", "weight_scaler", "grad_scaler"):
            scaler = getattr(new, name)
            if scaler is not None:
                setattr(new, name, _make_scaler(new.recipe, scaler.max_val, weight.device))
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

    # The switches are part of the state so a checkpoint restores the warmup phase with the weights.
    def get_extra_state(self) -> dict:
        return {
            "quantize_weights": self.quantize_weights,
            "quantize_activations": self.quantize_activations,
            "quantize_grads": self.quantize_grads,
        }

    def set_extra_state(self, state: dict) -> None:
        self.quantize_weights = bool(state["quantize_weights"])
        self.quantize_activations = bool(state["quantize_activations"])
        self.quantize_grads = bool(state.get("quantize_grads", False)) and self.grad_scaler is not None

    def scalers(self) -> list[AmaxScaler]:
        return [s for s in (self.input_scaler, self.weight_scaler, self.grad_scaler) if s is not None]

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, format={self.recipe.format}, amax_algo={self.recipe.amax_algo}, "
            f"w={self.quantize_weights}, a={self.quantize_activations}, ste={self.recipe.ste}"
        )

    # ------------------------------------------------------------------------------------------

    def _passes_gradient(self, x: torch.Tensor, scale: torch.Tensor, scaler: AmaxScaler) -> torch.Tensor | None:
        return _passes_gradient(self.recipe.ste == "clipped", x, scale, scaler, self.format)

    def quantized_weight(self, weight: torch.Tensor, dtype: torch.dtype):
        """-> (saved: uint8 codes or the weight itself, scale or None, clipped-mask or None): the weight
        operand of the forward and backward (``saved`` is decoded when a scale is given, used as it is
        when not). The hook a subclass overrides to supply the weight another way (the 8-bit export's
        reader supplies its decoded weight).

        Quantized once per optimizer step: the codes (1 byte per parameter) are cached until the
        parameter changes (``_version``) or the scale does; forward and backward decode them.
        """
        scaler = self.weight_scaler
        key = (weight._version, weight.data_ptr(), scaler.version, dtype, self.quantize_weights, self.recipe.ste)
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = None  # free the old codes before making new ones
            w = weight.detach().to(dtype)
            if self.quantize_weights:
                result, scale = scaler.quantize(w, self.format, want_codes=True, fused=self.runtime.fused)
                mask = self._passes_gradient(w, scale, scaler)
                entry = (result.codes, scale.clone(), mask, (result.amax, result.clipped))
            else:
                entry = (w, None, None, (w.abs().amax(), None))
            self._weight_cache = (key, *entry)
            scaler.observed_this_step = False
        _, saved, scale, mask, stats = self._weight_cache
        if self.training and not scaler.observed_this_step:
            scaler.observe(stats[0], stats[1], weight.numel())
        return saved, scale, mask

    def release_weight_cache(self) -> None:
        """Drop the cached weight codes: stale once the optimizer steps, so not held through its peak."""
        self._weight_cache = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            w_saved, w_scale, w_mask = self.quantized_weight(self.weight, dtype)
        return _HiF8LinearFunction.apply(x, self.weight, self.bias, w_saved, w_scale, w_mask, self._plan(dtype))

    def _plan(self, dtype: torch.dtype) -> "_Plan":
        """This forward's scalers and switches, for the autograd function."""
        return _Plan(
            input_scaler=self.input_scaler, activations_on=self.quantize_activations, record=self.training,
            grad_scaler=self.grad_scaler, grads_on=self.quantize_grads, fmt=self.format,
            fused=self.runtime.fused, ste_clipped=self.recipe.ste == "clipped",
            save_codes=self.runtime.save_8bit_activations, stochastic_grads=self.recipe.grad_stochastic_rounding,
            dtype=dtype,
        )


def _passes_gradient(ste_clipped: bool, x, scale, scaler: AmaxScaler, fmt) -> torch.Tensor | None:
    """``ste="clipped"``: False where the element was clipped (same definition as the counters)."""
    return ~saturated_mask(x, scale, scaler.max_val, fmt) if ste_clipped else None


@dataclass(frozen=True)
class _Plan:
    """What one forward of a layer does: its scalers and switches at call time (the autograd function
    gets this, not the module)."""

    input_scaler: AmaxScaler
    activations_on: bool
    record: bool  # training mode: observers record
    grad_scaler: AmaxScaler | None
    grads_on: bool
    fmt: Float8Format
    fused: str
    ste_clipped: bool
    save_codes: bool
    stochastic_grads: bool
    dtype: torch.dtype  # compute dtype (the autocast dtype under autocast)

    def decode(self, saved: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:  # not quantized: the tensor itself
            return saved
        return dequantize_codes(saved, scale, self.fmt, self.dtype, fused=self.fused)

    def quantize_input(self, x: torch.Tensor):
        """-> (x for the matmul, codes or None, scale or None, clipped-mask or None)."""
        scaler = self.input_scaler
        if not self.activations_on:
            if self.record:
                scaler.observe(x.abs().amax(), None, x.numel())
            return x, None, None, None
        result, scale = scaler.quantize(x, self.fmt, want_codes=self.save_codes, fused=self.fused)
        if self.record:
            scaler.observe(result.amax, result.clipped, x.numel())
        return result.dequantized, result.codes, scale, _passes_gradient(self.ste_clipped, x, scale, scaler, self.fmt)

    def quantize_grad_output(self, g: torch.Tensor) -> torch.Tensor:
        scaler = self.grad_scaler
        if scaler is None:
            return g
        if not self.grads_on:
            scaler.observe(g.abs().amax(), None, g.numel())
            return g
        noise = torch.randint(0, 1 << 23, g.shape, device=g.device, dtype=torch.int32) if self.stochastic_grads else None
        result, _ = scaler.quantize(g, self.fmt, noise=noise, fused=self.fused)
        scaler.observe(result.amax, result.clipped, g.numel())
        return result.dequantized


class _HiF8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_saved, w_scale, w_mask, plan: _Plan):
        dtype = plan.dtype
        with torch.autocast(x.device.type, enabled=False):
            xq, x_codes, x_scale, x_mask = plan.quantize_input(x.to(dtype))
            b = bias.to(dtype) if bias is not None else None
            out = F.linear(xq, plan.decode(w_saved, w_scale), b)
        if out._base is not None:
            # with a bias, F.linear of an N-D input returns a view (addmm, then a reshape): an output of a
            # custom Function that is a view may not be modified in place (Falcon's `mlp_output += ...`)
            out = out.clone()
        ctx.plan = plan
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.has_bias = bias is not None
        # backward needs the quantized input and weight: kept as 8-bit codes + scale where possible
        x_saved, x_saved_scale = (x_codes, x_scale) if x_codes is not None else (xq, None)
        ctx.save_for_backward(x_saved, x_saved_scale, w_saved, w_scale, x_mask, w_mask)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_saved, x_scale, w_saved, w_scale, x_mask, w_mask = ctx.saved_tensors
        plan: _Plan = ctx.plan
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = plan.quantize_grad_output(grad_out.to(plan.dtype))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ plan.decode(w_saved, w_scale)
            if x_mask is not None:
                grad_x = grad_x * x_mask
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[1]:
            xq = plan.decode(x_saved, x_scale)
            grad_w = g.reshape(-1, g.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
            if w_mask is not None:
                grad_w = grad_w * w_mask
            grad_w = grad_w.to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None
