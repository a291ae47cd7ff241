"""QuantizedMatmul: the one quantized-matmul concept of the core, shared by the dense linear and the MoE experts.

``x @ W.T (+ b)`` with the input and the weight each fake-quantized by its own per-tensor scaler; the backward is
the straight-through estimator (``ste="identity"``, the paper's, or ``"clipped"``: no gradient where an element
saturated). :class:`QuantizedMatmul`, the base of :class:`~qat_app.hif8.linear.HiF8Linear` and
:class:`~qat_app.hif8.experts.QuantizedProjection`, owns the scalers (:data:`SCALER_NAMES`, the checkpoint's
keys), the switches (extra state: a checkpoint restores the warmup phase), the weight operand (quantized once per
optimizer step) and the :class:`Plan` handed to :class:`QuantizedMatmulFunction`. Contract: amax is observed only
in training mode, quantized or not, so evaluation never moves a history; saved 8-bit inputs decode exactly.

See ``docs/gemm.md`` for the product and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .fake_quant import dequantize_codes, saturated_mask
from .formats import Float8Format, get_format
from .fp8_gemm import e4m3_parts_of_codes
from .gemm import (GEMM_DEQUANTIZE_FIRST, GEMM_EMULATED, GEMM_FP8, Operand, column_sums, decode_factors, resolve_gemm,
                   scaled_linear, scaled_mm)
from .profiling import GEMM, QUANTIZE, profiled
from .recipe import HiF8Recipe, RuntimeOptions
from .scaling import AmaxScaler

# the scalers of a quantized matmul, in registration (and state-dict) order; grad_scaler only with quantize_grads
SCALER_NAMES = ("input_scaler", "weight_scaler", "grad_scaler")
# the operands they quantize (the names the logs, the summary and the fallback use), in the same order
OPERANDS = ("input", "weight", "grad")
SCALER_OF = dict(zip(OPERANDS, SCALER_NAMES))
# what an operand may fall back to (:mod:`.fallback`): its scaler switches to current scaling, or it is no longer
# quantized
FALLBACK_CURRENT, FALLBACK_HIGH_PRECISION = "current", "high_precision"
FALLBACK_TARGETS = (FALLBACK_CURRENT, FALLBACK_HIGH_PRECISION)


class QuantizedInput(NamedTuple):
    """The input as a quantized matmul's forward takes it (:meth:`Plan.quantize_input`)."""

    operand: Operand  # what the GEMM multiplies
    saved: torch.Tensor  # what backward keeps: 8-bit codes, or a tensor
    scale: torch.Tensor | None  # the codes' scale; None: ``saved`` is used as it is
    mask: torch.Tensor | None  # ste="clipped": where the gradient passes


class WeightOperand(NamedTuple):
    """The weight as a quantized matmul's forward and backward take it (:meth:`QuantizedMatmul.quantized_weight`)."""

    saved: torch.Tensor  # uint8 codes, the 16-bit grid values, or the weight itself (not quantized)
    scale: torch.Tensor | None  # None: ``saved`` is used as it is
    mask: torch.Tensor | None  # ste="clipped": where the gradient passes
    values: torch.Tensor | None  # on the call that quantized it: what the quantization wrote (no decode needed)
    fp8: tuple | None = None  # gemm fp8: (tail, E4M3 parts) of the grid values, made once per optimizer step


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmul runs in: the autocast dtype under autocast, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grid_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype grid values are kept in between GEMMs: the compute dtype when it has 16 bits, else bfloat16 (HiF8's
    values have at most 4 significant bits and exponents 2^-22..2^15, exact in bfloat16 and float16)."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def passes_gradient(ste_clipped: bool, x, scale, scaler: AmaxScaler, fmt) -> torch.Tensor | None:
    """``ste="clipped"``: False where the element was clipped (same definition as the counters)."""
    return ~saturated_mask(x, scale, scaler.max_val, fmt) if ste_clipped else None


class _Switch:
    """An operand's quantization switch (set by the BF16 warmup, ``set_quantization``, the extra state); an operand
    that fell back to high precision reads as off whatever it is set to."""

    def __init__(self, operand: str) -> None:
        self.operand = operand

    def __get__(self, module, owner=None):
        return self if module is None else module._switch(self.operand)

    def __set__(self, module, on: bool) -> None:
        module._switches[self.operand] = bool(on)


class QuantizedMatmul(nn.Module):
    """The quantization state and behaviour of one W8A8 matmul (docs/gemm.md).

    A subclass calls :meth:`init_quantization` in its constructor and :meth:`quantized_matmul` in its
    forward; it defines no ``__init__`` here, so it combines with ``nn.Linear`` (``HiF8Linear``).
    """

    _exported_key: tuple | None = None  # set by mark_exported (the 8-bit export's reader)
    _exported_codes: tuple | None = None  # (uint8 codes, scale) of the exported weight, when the reader gave them
    measure_health = False  # host-side switch (set_health_measurement): training forwards measure numeric health

    def init_quantization(self, recipe: HiF8Recipe | None, runtime: RuntimeOptions | None, device) -> None:
        """Recipe, runtime options, format, scalers (built on ``device``), switches, weight cache."""
        self.recipe = recipe = recipe if recipe is not None else HiF8Recipe()
        self.runtime = runtime = runtime if runtime is not None else RuntimeOptions()
        self.format = get_format(recipe.format)
        max_vals = (recipe.resolved_max_val, recipe.resolved_max_val, recipe.grad_max_val if recipe.quantize_grads else None)
        for name, max_val in zip(SCALER_NAMES, max_vals):
            setattr(self, name, None if max_val is None else AmaxScaler(
                recipe.amax_algo, recipe.history_len, recipe.alpha, max_val, recipe.margin, device=device,
                power_2=recipe.power_2_scales))
        # operand -> its fallback decision (target, step, reason, evidence); set by fall_back, in the extra state
        self.fallback: dict[str, dict] = {}
        self._switches = {"input": runtime.quantize_activations, "weight": runtime.quantize_weights,
                          "grad": recipe.quantize_grads}
        self._weight_cache = None

    def _switch(self, operand: str) -> bool:
        return self._switches[operand] and self.fallback.get(operand, {}).get("target") != FALLBACK_HIGH_PRECISION

    quantize_activations = _Switch("input")
    quantize_weights = _Switch("weight")
    quantize_grads = _Switch("grad")

    def scaler_of(self, operand: str) -> AmaxScaler | None:
        return getattr(self, SCALER_OF[operand], None)

    def fall_back(self, operand: str, target: str, **record) -> None:
        """Switch ``operand`` for the rest of the run to ``target`` (:data:`FALLBACK_TARGETS`): ``current`` scaling
        (its scaler becomes a CTS scaler: never clips) or ``high_precision`` (no longer quantized). ``record``
        (step, reason, evidence) is kept with it, in the extra state, so a checkpoint or an export carries it."""
        if target not in FALLBACK_TARGETS:
            raise ValueError(f"fallback target: unknown {target!r}; allowed: {', '.join(FALLBACK_TARGETS)}")
        scaler = self.scaler_of(operand)
        if scaler is None:
            raise ValueError(f"{operand}: this matmul has no {SCALER_OF[operand]} to fall back")
        self.fallback[operand] = {"target": target, **record}
        if target == FALLBACK_CURRENT:
            scaler.algo = "current"  # its bank regroups at the next step boundary (banks are keyed by algo)
            scaler.version += 1  # a cached weight quantized with the delayed scale is stale
        self._weight_cache = None

    def named_scalers(self) -> list[tuple[str, AmaxScaler]]:
        return [(name, s) for name in SCALER_NAMES if (s := getattr(self, name, None)) is not None]

    def scalers(self) -> list[AmaxScaler]:
        return [s for _, s in self.named_scalers()]

    # The switches are part of the state so a checkpoint restores the warmup phase with the weights.
    # The fallback decisions too (a checkpoint before them has none).
    def get_extra_state(self) -> dict:
        return {
            "quantize_weights": self._switches["weight"],
            "quantize_activations": self._switches["input"],
            "quantize_grads": self._switches["grad"],
            "fallback": {operand: dict(record) for operand, record in self.fallback.items()},
        }

    def set_extra_state(self, state: dict) -> None:
        self.quantize_weights = bool(state["quantize_weights"])
        self.quantize_activations = bool(state["quantize_activations"])
        self.quantize_grads = bool(state.get("quantize_grads", False)) and self.grad_scaler is not None
        self.fallback = {}
        for operand, record in state.get("fallback", {}).items():
            record = dict(record)
            self.fall_back(operand, record.pop("target"), **record)

    def quantization_repr(self) -> str:
        return (f"format={self.recipe.format}, amax_algo={self.recipe.amax_algo}, "
                f"w={self.quantize_weights}, a={self.quantize_activations}, ste={self.recipe.ste}")

    # ------------------------------------------------------------------------ the exported-weight hook
    @staticmethod
    def weight_key(weight: torch.Tensor) -> tuple:
        """(parameter identity, its in-place version, the slice): survives ``.to(device/dtype)``, changes with
        any in-place update of the parameter or a new parameter. A slice (one expert's weight) is keyed by
        the parameter it views."""
        base = weight._base if weight._base is not None else weight
        return id(base), base._version, weight.storage_offset(), tuple(weight.shape)

    def mark_exported(self, weight: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> None:
        """The export hook: ``weight`` (the tensor this matmul's forward passes; default: the module's own
        ``weight``) already holds ``decode(codes) / scale``. In eval mode, while it is unchanged, the forward uses
        the stored ``codes`` and ``scale`` when given (the GEMM then runs over the grid values as in training),
        else the weight as it is; in training mode, or once it changed, it is quantized as usual."""
        self._exported_key = self.weight_key(self.weight if weight is None else weight)
        self._exported_codes = None if codes is None else (codes, scale.reshape(()).float())

    def is_exported(self, weight: torch.Tensor) -> bool:
        """``weight`` is the one :meth:`mark_exported` marked, unchanged since."""
        return self._exported_key is not None and self._exported_key == self.weight_key(weight)

    # ------------------------------------------------------------------------------- the forward
    def quantized_weight(self, weight: torch.Tensor, dtype: torch.dtype, grid: bool = False,
                         fp8_tail: str | None = None) -> "WeightOperand":
        """-> :class:`WeightOperand`: the weight operand of the forward and backward (``saved`` is decoded when a scale is given, used as it is
        when not); ``values``: on the call that quantized it, what the quantization wrote (the grid values with
        ``grid``, else the dequantized weight), so that this forward needs no decode of the codes.

        Quantized once per optimizer step and cached until the parameter changes (``_version``) or the scale does:
        with ``grid`` (the emulated and FP8 GEMMs), the grid values themselves in 16 bits (:func:`grid_dtype`:
        exact, 2 bytes per parameter; the GEMM takes them as they are, or widens them exactly), so that neither an
        encode nor a decode pass is paid for the weight; else (``dequantize_first``) the uint8 codes, decoded with
        the scale by forward and backward. ``fp8_tail`` (the FP8 GEMM): the E4M3 parts of the grid values too, made
        with the cache (once per optimizer step, not once per micro-batch).
        """
        if self._exported_key is not None and self.quantize_weights and not self.training and self.is_exported(weight):
            if self._exported_codes is not None:  # the exported codes and scale: what training computed
                codes, scale = self._exported_codes
                return WeightOperand(codes.to(weight.device), scale.to(weight.device), None, None)
            return WeightOperand(weight.detach().to(dtype), None, None, None)  # already decode(codes)/scale: as it is
        scaler = self.weight_scaler
        health = self.measure_health and self.training  # in the key: a cache made without health is remade
        key = (weight._version, weight.data_ptr(), scaler.version, dtype, self.quantize_weights, self.recipe.ste,
               health, fp8_tail)
        values = None
        if self._weight_cache is None or self._weight_cache[0] != key:
            self._weight_cache = None  # free the old codes before making new ones
            w = weight.detach().to(dtype)
            if self.quantize_weights:
                fused = self.runtime.fused
                result, scale = scaler.quantize(w, self.format, want_codes=not grid or bool(fp8_tail), fused=fused,
                                                grid=grid, whatif=True)
                mask = passes_gradient(self.recipe.ste == "clipped", w, scale, scaler, self.format)
                measured = scaler.measure(w, result, scale, self.format, fused=fused, health=health)
                values = result.grid if grid else result.dequantized
                saved = values.to(grid_dtype(dtype)) if grid else result.codes
                fp8 = None
                if grid and fp8_tail:  # from the codes the quantization wrote: a byte read, a byte written
                    fp8 = (fp8_tail, e4m3_parts_of_codes(result.codes, self.format.name, scaler.max_val, fp8_tail))
                entry = (saved, scale.clone(), mask, (result.amax, result.clipped, *measured), fp8)
            else:
                entry = (w, None, None, (w.abs().amax(), None), None)
            self._weight_cache = (key, *entry)
            scaler.observed_this_step = False
        _, saved, scale, mask, stats, fp8 = self._weight_cache
        if self.training and not scaler.observed_this_step:
            scaler.observe(*stats[:2], weight.numel(), *stats[2:])
        return WeightOperand(saved, scale, mask, values, fp8)

    def release_weight_cache(self) -> None:
        """Drop the cached weight codes: stale once the optimizer steps, so not held through its peak."""
        self._weight_cache = None

    def plan(self, dtype: torch.dtype, device: torch.device) -> "Plan":
        """This forward's scalers and switches, for the autograd function."""
        return Plan(
            input_scaler=self.input_scaler, activations_on=self.quantize_activations, record=self.training,
            grad_scaler=self.grad_scaler, grads_on=self.quantize_grads, fmt=self.format,
            fused=self.runtime.fused, ste_clipped=self.recipe.ste == "clipped",
            save_codes=self.runtime.save_8bit_activations, stochastic_grads=self.recipe.grad_stochastic_rounding,
            dtype=dtype, health=self.measure_health and self.training, gemm=resolve_gemm(self.runtime.gemm, device),
            fp8_tail=self.runtime.fp8_tail, weight_max_val=self.weight_scaler.max_val,
        )

    def quantized_matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, W8A8, with straight-through gradients for ``x``, ``weight`` and ``bias``."""
        dtype = compute_dtype(x)
        plan = self.plan(dtype, x.device)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            w = self.quantized_weight(weight, dtype, grid=plan.on_grid, fp8_tail=plan.tail)
        return QuantizedMatmulFunction.apply(x, weight, bias, w.saved, w.scale, w.mask, w.values, w.fp8, plan)


@dataclass(frozen=True)
class Plan:
    """What one forward of a quantized matmul does: its scalers and switches at call time (the autograd
    function gets this, not the module)."""

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
    health: bool = False  # measure numeric health (a logging step, training mode)

    gemm: str = GEMM_EMULATED  # how the products are computed (:mod:`.gemm`), resolved for the device
    fp8_tail: str = "drop"  # gemm fp8: the values E4M3 cannot hold (:mod:`.fp8_gemm`)
    weight_max_val: float = 15.0

    @property
    def on_grid(self) -> bool:
        """The GEMMs take grid values and scales (emulated, fp8), not dequantized operands."""
        return self.gemm != GEMM_DEQUANTIZE_FIRST

    @property
    def tail(self) -> str | None:
        """The FP8 tail policy, for the GEMMs whose operands are both quantized (None: no FP8 GEMM)."""
        return self.fp8_tail if self.gemm == GEMM_FP8 else None

    def operand(self, saved: torch.Tensor, scale: torch.Tensor | None, max_val: float,
                values: torch.Tensor | None = None, fp8: tuple | None = None) -> Operand:
        """A saved operand (uint8 codes + scale, or a tensor) as the GEMM takes it: the grid values with their
        scale (the codes decoded through the backend: exact; the codes kept for the FP8 GEMM), or dequantized
        (``dequantize_first``). ``values``: those values when the quantization just wrote them (nothing to decode);
        ``fp8``: their E4M3 parts, made already."""
        if scale is None:  # not quantized: the tensor itself
            return Operand(saved)
        if self.on_grid:
            codes = None if saved.is_floating_point() else saved
            if values is None:  # kept as grid values (a weight), or as codes (a saved input)
                with profiled(QUANTIZE):
                    values = saved if codes is None else dequantize_codes(saved, None, self.fmt, self.dtype,
                                                                          fused=self.fused)
            return Operand(values, scale, max_val, codes=codes if self.tail else None, fmt_name=self.fmt.name, fp8=fp8)
        if values is not None:
            return Operand(values)
        with profiled(QUANTIZE):
            return Operand(dequantize_codes(saved, scale, self.fmt, self.dtype, fused=self.fused))

    def quantize_input(self, x: torch.Tensor) -> QuantizedInput:
        """``x`` as the GEMM takes it and as backward keeps it (:class:`QuantizedInput`)."""
        scaler = self.input_scaler
        if not self.activations_on:
            if self.record:
                scaler.observe(x.abs().amax(), None, x.numel())
            return QuantizedInput(Operand(x), x, None, None)
        result, scale = scaler.quantize(x, self.fmt, want_codes=self.save_codes or self.on_grid, fused=self.fused,
                                        grid=self.on_grid, whatif=self.record)
        if self.record:
            measured = scaler.measure(x, result, scale, self.fmt, fused=self.fused, health=self.health)
            scaler.observe(result.amax, result.clipped, x.numel(), *measured)
        mask = passes_gradient(self.ste_clipped, x, scale, scaler, self.fmt)
        operand = (Operand(result.grid, scale, scaler.max_val, codes=result.codes if self.tail else None,
                           fmt_name=self.fmt.name) if self.on_grid else Operand(result.dequantized))
        if result.codes is not None:  # kept for backward as 8-bit codes + scale
            return QuantizedInput(operand, result.codes, scale, mask)
        return QuantizedInput(operand, operand.values, None, mask)  # dequantize_first without save_8bit_activations

    def quantize_grad_output(self, g: torch.Tensor) -> Operand:
        scaler = self.grad_scaler
        if scaler is None:
            return Operand(g)
        if not self.grads_on:
            scaler.observe(g.abs().amax(), None, g.numel())
            return Operand(g)
        noise = torch.randint(0, 1 << 23, g.shape, device=g.device, dtype=torch.int32) if self.stochastic_grads else None
        result, scale = scaler.quantize(g, self.fmt, noise=noise, fused=self.fused, grid=self.on_grid, whatif=True)
        measured = scaler.measure(g, result, scale, self.fmt, fused=self.fused, health=self.health, noise=noise)
        scaler.observe(result.amax, result.clipped, g.numel(), *measured)
        return Operand(result.grid, scale, scaler.max_val) if self.on_grid else Operand(result.dequantized)


class QuantizedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_saved, w_scale, w_mask, w_values, w_fp8, plan: Plan):
        dtype = plan.dtype
        with torch.autocast(x.device.type, enabled=False):
            x_op, x_saved, x_saved_scale, x_mask = plan.quantize_input(x.to(dtype))
            b = bias.to(dtype) if bias is not None else None
            w_op = plan.operand(w_saved, w_scale, plan.weight_max_val, w_values, fp8=w_fp8)
            # the three GEMMs' decode factors at once, when the output gradient is not quantized (else backward's)
            factors = (decode_factors(x_op.scale, w_op.scale) if plan.on_grid and x_op.quantized and w_op.quantized
                       else None)
            with profiled(GEMM):
                out = scaled_linear(x_op, w_op, dtype, bias=b, fp8_tail=plan.tail,
                                    decode=None if factors is None else factors[0])
        if out._base is not None:
            # an output of a custom Function that is a view may not be modified in place (Falcon's
            # `mlp_output += ...`); scaled_linear returns none, this guards the rule
            out = out.clone()
        ctx.plan = plan
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.has_bias = bias is not None
        # backward needs the quantized input and weight: kept as 8-bit codes + scale where possible
        ctx.save_for_backward(x_saved, x_saved_scale, w_saved, w_scale, x_mask, w_mask, factors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_saved, x_scale, w_saved, w_scale, x_mask, w_mask, factors = ctx.saved_tensors
        plan: Plan = ctx.plan
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g = plan.quantize_grad_output(grad_out.to(plan.dtype))
        if g.quantized:
            factors = None  # the decode factors include the gradient's scale: made by each GEMM
        g2 = g.flat()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # dgrad: g @ W, with W's decode scale
            w_op = plan.operand(w_saved, w_scale, plan.weight_max_val)
            with profiled(GEMM):
                grad_x = scaled_mm(g2, w_op, plan.dtype, fp8_tail=plan.tail,
                                   decode=None if factors is None else factors[2]).reshape(*g.values.shape[:-1], -1)
            if x_mask is not None:
                grad_x = grad_x * x_mask
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[1]:  # wgrad: g.T @ x, with x's decode scale
            x_op = plan.operand(x_saved, x_scale, plan.input_scaler.max_val)
            with profiled(GEMM):
                grad_w = scaled_mm(g2.t(), x_op.flat(), plan.dtype, fp8_tail=plan.tail,
                                   decode=None if factors is None else factors[1])
            if w_mask is not None:
                grad_w = grad_w * w_mask
            grad_w = grad_w.to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = column_sums(g2).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def set_health_measurement(model: nn.Module, on: bool) -> None:
    """Switch numeric-health measurement of every quantized matmul of ``model`` (a host-side flag, no sync):
    on before the forwards of a logging step, off after; forwards in training mode then measure their
    quantized input, weight and output gradient (:mod:`qat_app.hif8.health`)."""
    for module in model.modules():
        if isinstance(module, QuantizedMatmul):
            module.measure_health = on
