"""The one export source: the model behind a QATModule, its tokenizer and run info, the dtypes, and every 8-bit
weight as the QAT forward pass quantizes it (codes and scales), quantized once. Each format writes from it: the
HiF8 checkpoint (:mod:`.writer`), the Hugging Face directory with quantized weights (:mod:`.hf`) and the
compressed-tensors FP8 / int8 checkpoints (:mod:`.compressed`, :mod:`.int8`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import nn

from ..hif8.experts import HiF8Experts
from ..hif8.linear import HiF8Linear
from ..hif8.operand import Operand
from ..hif8.fake_quant import dequantize_codes
from ..models import resolve_dtype
from .common import same
from .layout import ExportError


class QuantizedWeight(NamedTuple):
    """A weight as the QAT forward pass quantizes it."""

    codes: torch.Tensor  # uint8 (``[E, ...]`` for a fused experts parameter)
    scale: torch.Tensor  # float32, 0-d (``[E]``: one per expert)
    dequantized: torch.Tensor  # ``decode(codes) / scale`` in the compute dtype


class WeightCodes(NamedTuple):
    """A weight as an export stores it: ``decode(codes) / scale`` is the weight the QAT forward used."""

    codes: torch.Tensor  # uint8 (``[E, ...]`` for a fused experts parameter)
    scale: torch.Tensor  # float32, 0-d (``[E]``: one per expert)


@torch.no_grad()
def quantize_weight(layer: HiF8Linear, compute_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """The weight as the QAT forward pass quantizes it -> (uint8 codes, float32 scalar scale, dequantized).

    The scale is the weight scaler's choice (:meth:`AmaxScaler.quantize`, as in training). Plain torch
    (``fused="off"``), which is bit-identical to the compiled kernel. ``dequantized`` is in
    ``compute_dtype`` (default: the weight's dtype) and equals ``(decode(codes) / scale).to(compute_dtype)``.
    """
    return _quantize_tensor(layer.weight, layer, compute_dtype or layer.weight.dtype)


def _quantize_tensor(weight: torch.Tensor, owner, dtype: torch.dtype) -> QuantizedWeight:
    """``weight`` quantized by ``owner``'s weight scaler (a HiF8Linear or an expert's projection), in plain
    torch (dequantized in ``dtype``)."""
    result, scale = owner.weight_scaler.quantize(weight.detach().to(dtype), owner.format, want_codes=True, fused="off")
    return QuantizedWeight(result.codes, scale.detach().float().reshape(()).clone(), result.dequantized)


# a fused experts parameter and the per-expert projections that quantize its slices
EXPERT_PARAMS = HiF8Experts.PARAMS


@torch.no_grad()
def quantize_experts_param(experts: HiF8Experts, param: str, compute_dtype: torch.dtype | None = None
                           ) -> QuantizedWeight:
    """One fused parameter of an MoE experts module (``gate_up_proj`` or ``down_proj``) as the QAT forward
    pass quantizes it, expert by expert (each with its own weight scaler) -> (uint8 codes ``[E, ...]``,
    float32 scales ``[E]``, dequantized ``[E, ...]`` in ``compute_dtype``)."""
    dtype = compute_dtype or getattr(experts, param).dtype
    parts = [_quantize_tensor(weight, proj, dtype) for proj, weight in experts.projections(param)]
    return QuantizedWeight(*(torch.stack([getattr(p, field) for p in parts]) for field in QuantizedWeight._fields))


def stored_codes(key: str, weight: QuantizedWeight, fmt: str, dtype: torch.dtype) -> WeightCodes:
    """The codes and scale an export stores of ``weight`` (the dequantized copy is not kept: up to 4 bytes per
    parameter), once checked to reproduce it (cannot fail: decode is exact; guards format changes)."""
    codes, scale, dequantized = weight
    stacked = scale.dim() == 1  # an experts parameter: [E, ...] codes, one scale per expert
    pieces = zip(codes, scale, dequantized) if stacked else ((codes, scale, dequantized),)
    for e, (c, s, d) in enumerate(pieces):
        if not same(dequantize_codes(c, s, fmt, dtype), d):
            raise ExportError(f"{key}{f'[{e}]' if stacked else ''}: decode(codes)/scale does not reproduce the "
                              "fake-quantized weight")
    return WeightCodes(codes, scale)


def experts_param_quantized(experts: HiF8Experts, proj_name: str) -> bool:
    """Whether the QAT forward quantizes the fused parameter whose slices ``proj_name``'s projections own: every
    expert's weight switch on (else the parameter is stored dense)."""
    return all(proj.quantizes(Operand.WEIGHT) for proj in getattr(experts, proj_name))


@torch.no_grad()
def changed_codes(model: nn.Module, trained: torch.dtype, other: torch.dtype) -> tuple[int, int]:
    """(weight codes that differ when computed in ``other`` instead of ``trained``, all weight codes) over the
    quantized matmuls of ``model`` whose weights are quantized."""
    owners = []  # (weight, the module whose weight scaler quantizes it)
    for module in model.modules():
        if isinstance(module, HiF8Linear) and module.quantizes(Operand.WEIGHT):
            owners.append((module.weight, module))
        elif isinstance(module, HiF8Experts):
            owners += [(weight, proj) for param, _ in EXPERT_PARAMS for proj, weight in module.projections(param)
                       if proj.quantizes(Operand.WEIGHT)]
    changed = total = 0
    for weight, owner in owners:
        codes = _quantize_tensor(weight, owner, trained).codes
        changed += int((codes != _quantize_tensor(weight, owner, other).codes).sum())
        total += codes.numel()
    return changed, total


@dataclass(frozen=True)
class ExportSource:
    """What an export writes from: the HF model, the tokenizer saved with it, the run's info, the dtypes, and
    (:attr:`weights`) its 8-bit weights."""

    model: nn.Module
    tokenizer: Any = None
    info: dict | None = None  # the run's model_name and trust_remote_code, for a QATModule
    storage_dtype: torch.dtype | None = None  # of the unquantized tensors (None: unchanged)
    compute_dtype: torch.dtype | None = None  # None: each quantized layer's weight dtype
    selection: Any = None  # a QATModule's LayerSelection (the inventory's), None for a bare model

    @cached_property
    def weights(self) -> dict[str, WeightCodes]:
        """Every weight the QAT forward quantizes, as codes and scales, quantized once in :attr:`compute_dtype`
        (default: the weight's own): a quantized linear's by its module name, an MoE experts module's fused
        parameter by ``<module>.<parameter>``. A weight not here is stored dense (its switch off, or fallen back)."""
        out: dict[str, WeightCodes] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, HiF8Linear) and module.quantizes(Operand.WEIGHT):
                dtype = self.compute_dtype or module.weight.dtype
                out[name] = stored_codes(name, quantize_weight(module, dtype), module.recipe.format, dtype)
            elif isinstance(module, HiF8Experts):
                for param, proj_name in EXPERT_PARAMS:
                    if experts_param_quantized(module, proj_name):
                        dtype = self.compute_dtype or getattr(module, param).dtype
                        out[f"{name}.{param}"] = stored_codes(f"{name}.{param}",
                                                              quantize_experts_param(module, param, dtype),
                                                              module.gate_up[0].recipe.format, dtype)
        return out


def unwrap(module_or_model) -> ExportSource:
    """The HF model, its tokenizer (or None) and the run's info of a QATModule (anything with ``.model``) or of a
    bare model."""
    from transformers import PreTrainedModel

    if isinstance(module_or_model, PreTrainedModel):
        return ExportSource(module_or_model, None, {})
    inner = getattr(module_or_model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "config"):
        hparams = dict(getattr(module_or_model, "hparams", {}) or {})
        info = {k: hparams[k] for k in ("model_name", "trust_remote_code") if k in hparams}
        quant = getattr(module_or_model, "quant", None)
        return ExportSource(inner, getattr(module_or_model, "tokenizer", None), info,
                            selection=None if quant is None else quant.selection)
    if isinstance(module_or_model, nn.Module) and hasattr(module_or_model, "config"):
        return ExportSource(module_or_model, None, {})
    raise TypeError(
        f"expected a QATModule or a Hugging Face model, got {type(module_or_model).__name__}"
    )


def export_source(module_or_model, tokenizer, dtype: str | torch.dtype | None, compute_dtype: str | torch.dtype | None,
                  *, dtype_field: str = "model.dtype", compute_dtype_field: str = "model.dtype") -> ExportSource:
    """The arguments every export shares, checked: the model behind ``module_or_model``, ``tokenizer`` (default:
    the QATModule's own), ``dtype`` (None: unchanged) and ``compute_dtype`` resolved (an error names ``*_field``)."""
    source = unwrap(module_or_model)
    return replace(source, tokenizer=tokenizer if tokenizer is not None else source.tokenizer,
                   storage_dtype=resolve_dtype(dtype, field=dtype_field) if dtype is not None else None,
                   compute_dtype=resolve_dtype(compute_dtype, field=compute_dtype_field) if compute_dtype is not None
                   else None)
