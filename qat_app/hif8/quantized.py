"""QuantizedMatmul: the one quantized-matmul concept of the core, shared by the dense linear and the MoE experts.

``x @ W.T (+ b)`` with the input and the weight each fake-quantized by its own per-tensor scaler; the backward is
the straight-through estimator (``ste="identity"``, the paper's, or ``"clipped"``: no gradient where an element
saturated). :class:`QuantizedMatmul`, the base of :class:`~qat_app.hif8.linear.HiF8Linear` and
:class:`~qat_app.hif8.experts.QuantizedProjection`, owns a scaler and a switch per :class:`~.operand.Operand`
(the switches in the extra state: a checkpoint restores the warmup phase), the weight operand (quantized once per
optimizer step: :class:`WeightQuantization`) and the :class:`Plan` handed to :class:`QuantizedMatmulFunction`
with the quantized input and weight. An operand has one name, its :class:`~.operand.Operand`: ``scaler_of``,
``switches`` (as set), ``quantizes`` (as run: a fallback to high precision reads as off). The module quantizes
and observes the input and the weight before autograd; the function multiplies, and in backward quantizes the
output gradient, which its scaler observes there (the one operand that exists only in backward). Contract: amax is
observed only in training mode, quantized or not, so evaluation never moves a history; saved 8-bit inputs decode
exactly. A source of stored weights (the 8-bit export's reader) is
plugged in as :attr:`QuantizedMatmul.weight_source`; the core knows only its one method.

See ``docs/gemm.md`` for the product and its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import nn

from .fake_quant import dequantize_codes, saturated_mask
from .fallback_targets import BY_NAME, FallbackDecision, unquantized_by
from .formats import Float8Format, get_format
from .fp8_gemm import e4m3_parts_of_codes
from .gemm import (GEMM_DEQUANTIZE_FIRST, GEMM_EMULATED, GEMM_FP8, GemmOperand, column_sums, decode_factors,
                   resolve_gemm, scaled_linear, scaled_mm)
from .operand import SCALER_NAMES, Operand, OperandPlan
from .profiling import GEMM, QUANTIZE, profiled
from .recipe import HiF8Recipe, RuntimeOptions
from .scaling import AmaxScaler


class Observation(NamedTuple):
    """What a scaler records of one quantization (:meth:`~.scaling.AmaxScaler.observe`'s arguments)."""

    amax: torch.Tensor
    clipped: torch.Tensor | None  # None: not quantized (its amax enters the history, its elements are not counted)
    numel: int
    whatif: torch.Tensor | None = None  # the other estimators' clipping
    health: torch.Tensor | None = None  # its health vector (a logging step)


class QuantizedInput(NamedTuple):
    """The input as a quantized matmul's forward takes it (:meth:`Plan.quantize_input`)."""

    operand: GemmOperand  # what the GEMM multiplies
    saved: torch.Tensor  # what backward keeps: 8-bit codes, or a tensor
    scale: torch.Tensor | None  # the codes' scale; None: ``saved`` is used as it is
    mask: torch.Tensor | None  # ste="clipped": where the gradient passes
    observation: Observation | None  # None: not observed (evaluation)


class WeightQuantization(NamedTuple):
    """The weight as a quantized matmul's forward and backward take it (:meth:`QuantizedMatmul.quantized_weight`),
    and what its scaler observes of it."""

    saved: torch.Tensor  # uint8 codes, the 16-bit grid values, or the weight itself (not quantized)
    scale: torch.Tensor | None  # None: ``saved`` is used as it is
    mask: torch.Tensor | None = None  # ste="clipped": where the gradient passes
    values: torch.Tensor | None = None  # on the call that quantized it: what the quantization wrote (no decode)
    fp8: tuple | None = None  # gemm fp8: (tail, E4M3 parts) of the grid values, made once per optimizer step
    observation: Observation | None = None  # None: a stored weight, nothing to observe


class WeightCacheKey(NamedTuple):
    """What a cached :class:`WeightQuantization` depends on: a new one is made when any of it changes."""

    version: int  # the parameter's in-place version
    data_ptr: int  # the parameter's storage
    scale_version: int  # the weight scaler's (bumped whenever its scale may change)
    dtype: torch.dtype
    quantized: bool  # the weight's switch
    ste: str
    health: bool  # measured (a cache made without health is remade)
    fp8_tail: str | None


class WeightSource(Protocol):
    """Stored weights a matmul runs on in evaluation (the 8-bit export's reader: :mod:`qat_app.export.stored_weight`)."""

    def weight_operand(self, weight: torch.Tensor, dtype: torch.dtype) -> WeightQuantization | None:
        """The stored operand for ``weight`` (None: ``weight`` is not the one stored, or changed since)."""


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


class QuantizedMatmul(nn.Module):
    """The quantization state and behaviour of one W8A8 matmul (docs/gemm.md).

    A subclass calls :meth:`init_quantization` in its constructor and :meth:`quantized_matmul` in its
    forward; it defines no ``__init__`` here, so it combines with ``nn.Linear`` (``HiF8Linear``).
    """

    weight_source: WeightSource | None = None  # stored weights for evaluation (the 8-bit export's reader)
    measure_health = False  # host-side switch (set_health_measurement): training forwards measure numeric health

    def init_quantization(self, recipe: HiF8Recipe | None, runtime: RuntimeOptions | None, device) -> None:
        """Recipe, runtime options, format, scalers (built on ``device``), switches, weight cache."""
        self.recipe = recipe = recipe if recipe is not None else HiF8Recipe()
        self.runtime = runtime = runtime if runtime is not None else RuntimeOptions()
        self.format = get_format(recipe.format)
        max_vals = {Operand.INPUT: recipe.resolved_max_val, Operand.WEIGHT: recipe.resolved_max_val,
                    Operand.GRAD: recipe.grad_max_val if recipe.quantize_grads else None}
        for operand, max_val in max_vals.items():
            setattr(self, operand.scaler_name, None if max_val is None else AmaxScaler(
                recipe.amax_algo, recipe.history_len, recipe.alpha, max_val, recipe.margin, device=device,
                power_2=recipe.power_2_scales, operand=operand.value))
        # operand -> its fallback decision; set by fall_back, in the extra state
        self.fallback: dict[str, FallbackDecision] = {}
        # operand -> its switch as set (the BF16 warmup, set_quantization, the extra state): switch, quantizes
        self.switches: dict[Operand, bool] = {}
        for operand, on in ((Operand.INPUT, runtime.quantize_activations), (Operand.WEIGHT, runtime.quantize_weights),
                            (Operand.GRAD, recipe.quantize_grads)):
            self.switch(operand, on)
        self._weight_cache: tuple[WeightCacheKey, WeightQuantization] | None = None
        self._gemm: tuple[torch.device, str] | None = None  # (device, the GEMM resolved for it): gemm_for

    def switch(self, operand: Operand | str, on: bool) -> None:
        """Set ``operand``'s quantization switch (an operand without a scaler stays off)."""
        operand = Operand(operand)
        self.switches[operand] = bool(on) and self.scaler_of(operand) is not None

    def quantizes(self, operand: Operand | str) -> bool:
        """``operand`` is quantized: its switch is on and it did not fall back to high precision."""
        operand = Operand(operand)
        return self.switches[operand] and not unquantized_by(self.fallback.get(operand))

    def quantizes_forward(self) -> bool:
        """The forward is quantized (its input or its weight): QAT, not the BF16 warmup."""
        return self.quantizes(Operand.INPUT) or self.quantizes(Operand.WEIGHT)

    def scaler_of(self, operand: Operand | str) -> AmaxScaler | None:
        return getattr(self, Operand(operand).scaler_name, None)

    def operand_plan(self, operand: Operand) -> OperandPlan:
        """What this forward does with ``operand``: its scaler, switch and ``max_val``."""
        scaler = self.scaler_of(operand)
        return OperandPlan(scaler, self.quantizes(operand), None if scaler is None else scaler.max_val)

    def fall_back(self, operand: Operand | str, target: str, **record) -> None:
        """Switch ``operand`` for the rest of the run to ``target`` (:mod:`.fallback_targets`): ``current`` scaling
        (its scaler becomes a CTS scaler: never clips) or ``high_precision`` (no longer quantized). ``record``
        (the :class:`FallbackDecision`'s other fields: step, reason, evidence, ...) is kept with it, in the extra
        state, so a checkpoint or an export carries it."""
        self.take_decision(operand, FallbackDecision(target, **record))

    def take_decision(self, operand: Operand | str, decision: FallbackDecision) -> None:
        """Apply a :class:`FallbackDecision` to ``operand`` and keep it (:meth:`fall_back`, a checkpoint's)."""
        operand = Operand(operand)
        scaler = self.scaler_of(operand)
        if scaler is None:
            raise ValueError(f"{operand}: this matmul has no {operand.scaler_name} to fall back")
        self.fallback[operand.value] = decision
        if BY_NAME[decision.target].apply is not None:
            BY_NAME[decision.target].apply(scaler)
        self._weight_cache = None

    def named_scalers(self) -> list[tuple[str, AmaxScaler]]:
        return [(name, s) for name in SCALER_NAMES if (s := getattr(self, name, None)) is not None]

    def scalers(self) -> list[AmaxScaler]:
        return [s for _, s in self.named_scalers()]

    # The switches are part of the state so a checkpoint restores the warmup phase with the weights.
    # The fallback decisions too (a checkpoint before them has none).
    def get_extra_state(self) -> dict:
        return {  # the switches as set: a fallback to high precision is restored from its own record
            **{operand.switch_name: self.switches[operand]  # the checkpoint's keys, in the order earlier exports hold
               for operand in (Operand.WEIGHT, Operand.INPUT, Operand.GRAD)},
            "fallback": {operand: decision.as_dict() for operand, decision in self.fallback.items()},
        }

    def set_extra_state(self, state: dict) -> None:
        for operand in Operand:  # checkpoints from before gradient quantization have no grad switch
            self.switch(operand, state.get(operand.switch_name, False))
        self.fallback = {}
        for operand, record in state.get("fallback", {}).items():
            self.take_decision(operand, FallbackDecision.from_dict(record))

    def quantization_repr(self) -> str:
        return (f"format={self.recipe.format}, amax_algo={self.recipe.amax_algo}, "
                f"w={self.quantizes(Operand.WEIGHT)}, a={self.quantizes(Operand.INPUT)}, ste={self.recipe.ste}")

    # ------------------------------------------------------------------------------- the weight
    def quantized_weight(self, weight: torch.Tensor, dtype: torch.dtype, grid: bool = False,
                         fp8_tail: str | None = None) -> WeightQuantization:
        """The weight operand of the forward and backward (:class:`WeightQuantization`; ``saved`` is decoded when a
        scale is given, used as it is when not; ``values``: on the call that quantized it, what the quantization
        wrote, so that this forward needs no decode): the stored one in evaluation (:attr:`weight_source`), else
        the cached quantization (:meth:`_cached_weight`), observed once per optimizer step in training mode."""
        stored = self._stored_weight(weight, dtype)
        if stored is not None:
            return stored
        quantization, fresh = self._cached_weight(weight, dtype, grid, fp8_tail)
        scaler = self.scaler_of(Operand.WEIGHT)
        if self.training and (fresh or not scaler.observed_this_step):
            scaler.observe(*quantization.observation)
        return quantization

    def _stored_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> WeightQuantization | None:
        """In evaluation, the operand a :attr:`weight_source` holds for ``weight`` (None: none, or not this one)."""
        if self.weight_source is None or not self.quantizes(Operand.WEIGHT) or self.training:
            return None
        return self.weight_source.weight_operand(weight, dtype)

    def _cached_weight(self, weight: torch.Tensor, dtype: torch.dtype, grid: bool,
                       fp8_tail: str | None) -> tuple[WeightQuantization, bool]:
        """-> (the weight quantized once per optimizer step, whether it was quantized by this call).

        Cached until the parameter changes (``_version``) or the scale does: with ``grid`` (the emulated and FP8
        GEMMs), the grid values themselves in 16 bits (:func:`grid_dtype`: exact, 2 bytes per parameter; the GEMM
        takes them as they are, or widens them exactly), so that neither an encode nor a decode pass is paid for the
        weight; else (``dequantize_first``) the uint8 codes, decoded with the scale by forward and backward.
        ``fp8_tail`` (the FP8 GEMM): the E4M3 parts of the grid values too, made with the cache (once per optimizer
        step, not once per micro-batch)."""
        health = self.measure_health and self.training
        key = WeightCacheKey(weight._version, weight.data_ptr(), self.scaler_of(Operand.WEIGHT).version, dtype,
                             self.quantizes(Operand.WEIGHT), self.recipe.ste, health, fp8_tail)
        if self._weight_cache is not None and self._weight_cache[0] == key:
            return self._weight_cache[1], False
        self._weight_cache = None  # free the old codes before making new ones
        quantization = self._quantize_weight(weight.detach().to(dtype), grid, fp8_tail, health)
        self._weight_cache = (key, quantization._replace(values=None))
        return quantization, True

    def _quantize_weight(self, w: torch.Tensor, grid: bool, fp8_tail: str | None, health: bool) -> WeightQuantization:
        """``w`` (detached, in the compute dtype) quantized with the weight scaler and measured."""
        if not self.quantizes(Operand.WEIGHT):
            return WeightQuantization(w, None, observation=Observation(w.abs().amax(), None, w.numel()))
        scaler, fused = self.scaler_of(Operand.WEIGHT), self.runtime.fused
        result, scale = scaler.quantize(w, self.format, want_codes=not grid or bool(fp8_tail), fused=fused, grid=grid,
                                        whatif=True)
        mask = passes_gradient(self.recipe.ste == "clipped", w, scale, scaler, self.format)
        observation = Observation(result.amax, result.clipped, w.numel(),
                                  *scaler.measure(w, result, scale, self.format, fused=fused, health=health))
        values = result.grid if grid else result.dequantized
        fp8 = None
        if grid and fp8_tail:  # from the codes the quantization wrote: a byte read, a byte written
            fp8 = (fp8_tail, e4m3_parts_of_codes(result.codes, self.format.name, scaler.max_val, fp8_tail))
        return WeightQuantization(values.to(grid_dtype(w.dtype)) if grid else result.codes, scale.clone(), mask,
                                  values, fp8, observation)

    def release_weight_cache(self) -> None:
        """Drop the cached weight codes: stale once the optimizer steps, so not held through its peak."""
        self._weight_cache = None

    # ------------------------------------------------------------------------------- the forward
    def gemm_for(self, device: torch.device) -> str:
        """The GEMM this matmul runs on ``device`` (``gemm: auto`` resolved once per device: at setup by
        :func:`~qat_app.hif8.training.resolve_gemms`, else at the first forward there)."""
        if self._gemm is None or self._gemm[0] != device:
            self._gemm = (device, resolve_gemm(self.runtime.gemm, device))
        return self._gemm[1]

    def plan(self, dtype: torch.dtype, device: torch.device) -> "Plan":
        """This forward's operands and settings, for the autograd function."""
        return Plan(
            input=self.operand_plan(Operand.INPUT), weight=self.operand_plan(Operand.WEIGHT),
            grad=self.operand_plan(Operand.GRAD), record=self.training, fmt=self.format, fused=self.runtime.fused,
            ste_clipped=self.recipe.ste == "clipped", save_codes=self.runtime.save_8bit_activations,
            stochastic_grads=self.recipe.grad_stochastic_rounding, dtype=dtype,
            health=self.measure_health and self.training, gemm=self.gemm_for(device), fp8_tail=self.runtime.fp8_tail,
        )

    def quantized_matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, W8A8, with straight-through gradients for ``x``, ``weight`` and ``bias``."""
        dtype = compute_dtype(x)
        plan = self.plan(dtype, x.device)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            w = self.quantized_weight(weight, dtype, grid=plan.on_grid, fp8_tail=plan.tail)
            with profiled(QUANTIZE):  # the input's part of the step, as when the autograd function quantized it
                q = plan.quantize_input(x.to(dtype))
            if q.observation is not None:
                plan.input.scaler.observe(*q.observation)
        return QuantizedMatmulFunction.apply(x, weight, bias, q, w, plan)


@dataclass(frozen=True)
class Plan:
    """What one forward of a quantized matmul does: a plan per operand and the settings at call time (the autograd
    function gets this, not the module). It quantizes and never observes: what a scaler should record is handed
    back (:class:`Observation`) to the one who observes."""

    input: OperandPlan
    weight: OperandPlan
    grad: OperandPlan  # scaler None: the output gradient is not observed (no quantize_grads)
    record: bool  # training mode: observers record
    fmt: Float8Format
    fused: str
    ste_clipped: bool
    save_codes: bool
    stochastic_grads: bool
    dtype: torch.dtype  # compute dtype (the autocast dtype under autocast)
    health: bool = False  # measure numeric health (a logging step, training mode)

    gemm: str = GEMM_EMULATED  # how the products are computed (:mod:`.gemm`), resolved for the device
    fp8_tail: str = "drop"  # gemm fp8: the values E4M3 cannot hold (:mod:`.fp8_gemm`)

    @property
    def on_grid(self) -> bool:
        """The GEMMs take grid values and scales (emulated, fp8), not dequantized operands."""
        return self.gemm != GEMM_DEQUANTIZE_FIRST

    @property
    def tail(self) -> str | None:
        """The FP8 tail policy, for the GEMMs whose operands are both quantized (None: no FP8 GEMM)."""
        return self.fp8_tail if self.gemm == GEMM_FP8 else None

    def operand(self, saved: torch.Tensor, scale: torch.Tensor | None, max_val: float,
                values: torch.Tensor | None = None, fp8: tuple | None = None) -> GemmOperand:
        """A saved operand (uint8 codes + scale, or a tensor) as the GEMM takes it: the grid values with their
        scale (the codes decoded through the backend: exact; the codes kept for the FP8 GEMM), or dequantized
        (``dequantize_first``). ``values``: those values when the quantization just wrote them (nothing to decode);
        ``fp8``: their E4M3 parts, made already."""
        if scale is None:  # not quantized: the tensor itself
            return GemmOperand(saved)
        if self.on_grid:
            codes = None if saved.is_floating_point() else saved
            if values is None:  # kept as grid values (a weight), or as codes (a saved input)
                with profiled(QUANTIZE):
                    values = saved if codes is None else dequantize_codes(saved, None, self.fmt, self.dtype,
                                                                          fused=self.fused)
            return GemmOperand(values, scale, max_val, codes=codes if self.tail else None, fmt_name=self.fmt.name, fp8=fp8)
        if values is not None:
            return GemmOperand(values)
        with profiled(QUANTIZE):
            return GemmOperand(dequantize_codes(saved, scale, self.fmt, self.dtype, fused=self.fused))

    def quantize_input(self, x: torch.Tensor) -> QuantizedInput:
        """``x`` as the GEMM takes it and as backward keeps it, and what its scaler observes in training mode."""
        scaler = self.input.scaler
        if not self.input.on:
            observation = Observation(x.abs().amax(), None, x.numel()) if self.record else None
            return QuantizedInput(GemmOperand(x), x, None, None, observation)
        result, scale = scaler.quantize(x, self.fmt, want_codes=self.save_codes or self.on_grid, fused=self.fused,
                                        grid=self.on_grid, whatif=self.record)
        observation = None
        if self.record:
            observation = Observation(result.amax, result.clipped, x.numel(),
                                      *scaler.measure(x, result, scale, self.fmt, fused=self.fused, health=self.health))
        mask = passes_gradient(self.ste_clipped, x, scale, scaler, self.fmt)
        operand = (GemmOperand(result.grid, scale, scaler.max_val, codes=result.codes if self.tail else None,
                               fmt_name=self.fmt.name) if self.on_grid else GemmOperand(result.dequantized))
        if result.codes is not None:  # kept for backward as 8-bit codes + scale
            return QuantizedInput(operand, result.codes, scale, mask, observation)
        # dequantize_first without save_8bit_activations
        return QuantizedInput(operand, operand.values, None, mask, observation)

    def quantize_grad_output(self, g: torch.Tensor) -> tuple[GemmOperand, Observation | None]:
        """The output gradient as the backward GEMMs take it, and what its scaler observes (None: no scaler)."""
        scaler = self.grad.scaler
        if scaler is None:
            return GemmOperand(g), None
        if not self.grad.on:
            return GemmOperand(g), Observation(g.abs().amax(), None, g.numel())
        noise = torch.randint(0, 1 << 23, g.shape, device=g.device, dtype=torch.int32) if self.stochastic_grads else None
        result, scale = scaler.quantize(g, self.fmt, noise=noise, fused=self.fused, grid=self.on_grid, whatif=True)
        observation = Observation(result.amax, result.clipped, g.numel(), *scaler.measure(
            g, result, scale, self.fmt, fused=self.fused, health=self.health, noise=noise))
        operand = GemmOperand(result.grid, scale, scaler.max_val) if self.on_grid else GemmOperand(result.dequantized)
        return operand, observation


class QuantizedMatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, q: QuantizedInput, w: WeightQuantization, plan: Plan):
        dtype = plan.dtype
        x_op = q.operand
        with torch.autocast(x.device.type, enabled=False):
            b = bias.to(dtype) if bias is not None else None
            w_op = plan.operand(w.saved, w.scale, plan.weight.max_val, w.values, fp8=w.fp8)
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
        ctx.save_for_backward(q.saved, q.scale, w.saved, w.scale, q.mask, w.mask, factors)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x_saved, x_scale, w_saved, w_scale, x_mask, w_mask, factors = ctx.saved_tensors
        plan: Plan = ctx.plan
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        g, observation = plan.quantize_grad_output(grad_out.to(plan.dtype))
        if observation is not None:  # the gradient exists only here: its scaler observes it here
            plan.grad.scaler.observe(*observation)
        if g.quantized:
            factors = None  # the decode factors include the gradient's scale: made by each GEMM
        g2 = g.flat()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # dgrad: g @ W, with W's decode scale
            w_op = plan.operand(w_saved, w_scale, plan.weight.max_val)
            with profiled(GEMM):
                grad_x = scaled_mm(g2, w_op, plan.dtype, fp8_tail=plan.tail,
                                   decode=None if factors is None else factors[2]).reshape(*g.values.shape[:-1], -1)
            if x_mask is not None:
                grad_x = grad_x * x_mask
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[1]:  # wgrad: g.T @ x, with x's decode scale
            x_op = plan.operand(x_saved, x_scale, plan.input.max_val)
            with profiled(GEMM):
                grad_w = scaled_mm(g2.t(), x_op.flat(), plan.dtype, fp8_tail=plan.tail,
                                   decode=None if factors is None else factors[1])
            if w_mask is not None:
                grad_w = grad_w * w_mask
            grad_w = grad_w.to(w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = column_sums(g2).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def set_health_measurement(model: nn.Module, on: bool) -> None:
    """Switch numeric-health measurement of every quantized matmul of ``model`` (a host-side flag, no sync):
    on before the forwards of a logging step, off after; forwards in training mode then measure their
    quantized input, weight and output gradient (:mod:`qat_app.hif8.health`)."""
    for module in model.modules():
        if isinstance(module, QuantizedMatmul):
            module.measure_health = on
