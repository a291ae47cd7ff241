"""The 8-bit HiF8 checkpoint writer: :func:`export_hif8`, the source's codes and scales (:mod:`.source`) with the
rest of the state."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import QuantConfig
from ..hif8.experts import HiF8Experts
from ..hif8.fallback_targets import unquantized_by
from ..hif8.linear import HiF8Linear
from ..hif8.operand import Operand
from ..hif8.patch import quantized_linears
from .common import quant_of, same, save_model_files
from .layout import (LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, ROLE_BUFFER, ROLE_CODES, ROLE_DENSE, ROLE_OTHER,
                     ROLE_SCALE, ROLE_SCALER, WEIGHTS_FILE, ExportError, dtype_name)
from .source import EXPERT_PARAMS, ExportSource, WeightCodes
from .writing import ExportFormat, write_export

log = logging.getLogger("qat_app.export")


class _Tensors:
    """The tensors of the safetensors file and their layout entries, in the order they were added."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: dict[str, dict] = {}
        self.rounded: list[str] = []  # the floating tensors their storage dtype does not hold exactly

    def add(self, key: str, tensor: torch.Tensor, role: str, source: torch.Tensor | None = None) -> None:
        self.tensors[key] = tensor.detach().contiguous().cpu()
        entry = {"role": role, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        if source is not None:
            entry["source_dtype"] = dtype_name(source.dtype)
        self.entries[key] = entry

    def add_stored(self, key: str, value: torch.Tensor, storage_dtype: torch.dtype) -> None:
        """A floating tensor in ``storage_dtype`` (role dense), noted in :attr:`rounded` where that is not exact."""
        stored = value.detach().to(storage_dtype)
        self.add(key, stored, ROLE_DENSE, value)
        if not same(stored.to(value.dtype), value.detach()):
            self.rounded.append(key)

    @property
    def lossless(self) -> bool:
        """Every tensor is stored exactly (codes and scales always are)."""
        return not self.rounded

    def _bytes(self, *roles: str, per_element: int | None = None) -> int:
        return sum(self.tensors[k].numel() * (per_element or self.tensors[k].element_size())
                   for k, e in self.entries.items() if e["role"] in roles)

    def bytes_by_role(self) -> dict[str, int]:
        return {
            "codes": sum(self.tensors[k].numel() for k, e in self.entries.items() if e["role"] == ROLE_CODES),
            "scales": self._bytes(ROLE_SCALE, per_element=4),
            "dense": self._bytes(ROLE_DENSE),
            "scaler_state": self._bytes(ROLE_SCALER),
            "other": self._bytes(ROLE_OTHER, ROLE_BUFFER),
        }


def why_dense(layer) -> str:
    """Why a quantized matmul's weight is not stored as codes: it fell back to high precision, or its switch is off."""
    decision = layer.fallback.get(Operand.WEIGHT)
    if unquantized_by(decision):
        return f"the weight fell back to high precision at step {decision.step} ({decision.reason})"
    return "weight quantization is off (exported inside the BF16 warmup?)"


def _add_layer(out: _Tensors, name: str, layer: HiF8Linear, layer_dtype: torch.dtype, storage_dtype: torch.dtype,
               weight: WeightCodes | None) -> dict[str, Any]:
    """One quantized linear: its ``weight`` as codes + scale (None: dense, weight quantization off) -> its record."""
    record: dict[str, Any] = {
        "format": layer.recipe.format,
        "shape": list(layer.weight.shape),
        "source_type": layer.source_type,
        "weight_dtype": dtype_name(layer.weight.dtype),
        "compute_dtype": dtype_name(layer_dtype),
        "extra_state": layer.get_extra_state(),
        "has_history": {s: scaler.has_history for s, scaler in layer.named_scalers()},
    }
    if weight is None:
        log.warning("%s: %s: stored in %s", name, why_dense(layer), storage_dtype)
        out.add_stored(f"{name}.weight", layer.weight, storage_dtype)
        record.update(weight="dense")
        return record
    codes, scale = weight  # checked to reproduce the fake-quantized weight (source.stored_codes)
    out.add(f"{name}.weight.codes", codes, ROLE_CODES, layer.weight)
    out.add(f"{name}.weight.scale", scale, ROLE_SCALE)
    record.update(weight="codes", codes=f"{name}.weight.codes", scale=f"{name}.weight.scale")
    return record


def _add_experts(out: _Tensors, name: str, experts: HiF8Experts, layer_dtype: torch.dtype,
                 storage_dtype: torch.dtype, weights: dict[str, WeightCodes]) -> dict[str, Any]:
    """One quantized MoE experts module: each fused parameter as uint8 codes ``[E, ...]`` + float32 scales
    ``[E]`` (from the source's ``weights``; dense where weight quantization is off) -> its record
    (:func:`_experts_keys`: the state keys it stored)."""
    first = experts.gate_up[0]
    record: dict[str, Any] = {
        "format": first.recipe.format,
        "num_experts": experts.num_experts,
        "weight_dtype": dtype_name(experts.gate_up_proj.dtype),
        "compute_dtype": dtype_name(layer_dtype),
        "params": {},
        "projections": {},
    }
    for param, proj_name in EXPERT_PARAMS:
        weight = getattr(experts, param)
        projections = getattr(experts, proj_name)
        for e, proj in enumerate(projections):
            if proj.recipe.format != first.recipe.format:
                raise ExportError(f"{name}.{proj_name}.{e}: another format than {name}.gate_up.0")
            record["projections"][f"{proj_name}.{e}"] = {
                "extra_state": proj.get_extra_state(),
                "has_history": {s: scaler.has_history for s, scaler in proj.named_scalers()},
            }
        entry: dict[str, Any] = {"shape": list(weight.shape)}
        if f"{name}.{param}" not in weights:
            off = next(proj for proj in projections if not proj.quantizes(Operand.WEIGHT))
            log.warning("%s.%s: for some experts, %s: stored in %s", name, param, why_dense(off), storage_dtype)
            out.add_stored(f"{name}.{param}", weight, storage_dtype)
            entry["weight"] = "dense"
        else:
            codes, scales = weights[f"{name}.{param}"]  # checked per expert (source.stored_codes)
            out.add(f"{name}.{param}.codes", codes, ROLE_CODES, weight)
            out.add(f"{name}.{param}.scales", scales, ROLE_SCALE)
            entry.update(weight="codes", codes=f"{name}.{param}.codes", scales=f"{name}.{param}.scales")
        record["params"][param] = entry
    return record


def _experts_keys(name: str, record: dict[str, Any]) -> set[str]:
    """The state keys an experts module's record stored: its parameters kept as codes, its projections' extra state."""
    return ({f"{name}.{param}" for param, entry in record["params"].items() if entry["weight"] == "codes"}
            | {f"{name}.{proj}._extra_state" for proj in record["projections"]})


def _add_state(out: _Tensors, state: dict, layer_keys: set[str], scalers: set[str],
               storage_dtype: torch.dtype) -> dict[str, str]:
    """Every other state-dict tensor (the state of the ``scalers``, named as modules, unchanged; floats in
    ``storage_dtype``; shared storage once) -> the aliases (key -> the key stored with the same storage)."""
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, value in state.items():
        if key in layer_keys or not isinstance(value, torch.Tensor):
            continue
        identity = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype) if value.numel() else None
        if identity is not None and identity in seen:
            aliases[key] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = key
        owner = key.rpartition(".")[0]  # the module holding the tensor
        if owner in scalers:
            out.add(key, value, ROLE_SCALER)
        elif value.is_floating_point():
            out.add_stored(key, value, storage_dtype)
        else:
            out.add(key, value, ROLE_OTHER)
    return aliases


def _add_nonpersistent_buffers(out: _Tensors, model: nn.Module, state: dict) -> None:
    """Rotary inv_freq & co: tiny; stored as the model used them (dtype included), so the rebuilt model does
    not depend on how its constructor or weight init computes them."""
    for key, buf in model.named_buffers():
        if key not in state and key not in out.entries:
            out.add(key, buf, ROLE_BUFFER)


@dataclass(frozen=True)
class ModelTensors:
    """What :func:`_add_model_tensors` stored besides the tensors themselves: the layout's records."""

    quantized: dict[str, dict]  # quantized linear -> its record
    experts: dict[str, dict]  # quantized experts module -> its record
    aliases: dict[str, str]  # state key -> the key stored with the same storage


def _layout(model: nn.Module, info: dict, quant: QuantConfig, out: _Tensors, stored: ModelTensors, *,
            weights_bytes: int, model_dtype: torch.dtype, storage_dtype: torch.dtype) -> dict:
    return {
        "format": LAYOUT_FORMAT,
        "version": LAYOUT_VERSION,
        "weights_file": WEIGHTS_FILE,
        "weights_file_bytes": weights_bytes,
        "model_class": type(model).__name__,
        "model_dtype": dtype_name(model_dtype),
        "storage_dtype": dtype_name(storage_dtype),
        "lossless": out.lossless,
        "trust_remote_code": bool(info.get("trust_remote_code", False) or getattr(model, "_auto_class", None)),
        "source": info.get("model_name"),
        "quant": quant.to_dict(),
        "quantized_layers": stored.quantized,
        "quantized_experts": stored.experts,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "aliases": stored.aliases,
        "tensors": out.entries,
        "bytes": out.bytes_by_role(),
    }


def _add_model_tensors(out: _Tensors, source: ExportSource, layers: list, state: dict) -> ModelTensors:
    """Every tensor of the source's model into ``out``: the quantized linears and experts modules as their codes,
    then the rest of the state and the non-persistent buffers."""
    model, cdtype, storage_dtype = source.model, source.compute_dtype, source.storage_dtype
    quantized: dict[str, dict] = {}
    layer_keys: set[str] = set()
    for name, layer in layers:
        if not isinstance(layer, HiF8Linear):  # an MoE expert's projection: stored with its experts module below
            continue
        layer_keys.update((f"{name}.weight", f"{name}._extra_state"))
        quantized[name] = _add_layer(out, name, layer, cdtype or layer.weight.dtype, storage_dtype,
                                     source.weights.get(name))
    experts: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, HiF8Experts):
            experts[name] = _add_experts(out, name, module, cdtype or module.gate_up_proj.dtype, storage_dtype,
                                         source.weights)
            layer_keys |= _experts_keys(name, experts[name])
    scalers = {f"{name}.{attribute}" for name, layer in layers for attribute, _ in layer.named_scalers()}
    aliases = _add_state(out, state, layer_keys, scalers, storage_dtype)
    _add_nonpersistent_buffers(out, model, state)
    return ModelTensors(quantized, experts, aliases)


def export_hif8(
    module_or_model,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "bfloat16",
    compute_dtype: str | torch.dtype | None = None,
    tokenizer=None,
    overwrite: bool = False,
) -> dict:
    """Save a HiF8 QAT model (QATModule or patched HF model) as an 8-bit checkpoint; returns the layout.

    Args:
        dtype: storage dtype of every unquantized floating tensor (BF16 by default; ``"float32"`` for a
            lossless copy of a float32 model).
        compute_dtype: dtype the QAT forward pass ran the quantized linears in (default: the weight's
            dtype; ``"bfloat16"`` for bf16-mixed autocast with fp32 weights). The codes are those of
            the weight cast to it.
        tokenizer: saved with the model (default: the QATModule's tokenizer, if any).
        overwrite: replace an existing non-empty ``out_dir``.
    """
    return write_export(HIF8, module_or_model, out_dir, dtype=dtype, compute_dtype=compute_dtype, tokenizer=tokenizer,
                        overwrite=overwrite)


def _prepare(source: ExportSource):
    """The HiF8 checkpoint's tensors and layout entries (refusing a model without HiF8 layers) -> its ``save``."""
    from safetensors.torch import save_file

    model, storage_dtype = source.model, source.storage_dtype
    layers = quantized_linears(model)
    if not layers:
        raise ExportError(
            f"{type(model).__name__} has no HiF8Linear layer (quant.enabled=false?): nothing to store in 8 bits; "
            "use export_hf (--format hf) for an unquantized model"
        )
    quant = quant_of(model, layers)
    out = _Tensors()
    stored = _add_model_tensors(out, source, layers, model.state_dict())
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if not out.lossless:
        log.warning(
            "unquantized tensors of the %s model are not exactly representable in %s: the reloaded model will differ "
            "from this one by that rounding (export with dtype=float32 for an exact copy)",
            dtype_name(model_dtype), dtype_name(storage_dtype),
        )

    def save(directory: Path) -> dict:
        weights_path = Path(directory) / WEIGHTS_FILE
        # one metadata entry: safetensors writes its entries in a hash map's order, random per map (two made
        # the same export differ from one run to the next in its header)
        save_file(out.tensors, str(weights_path), metadata={"format": "pt"})
        save_model_files(model, source.tokenizer, directory)
        layout = _layout(model, source.info, quant, out, stored, weights_bytes=weights_path.stat().st_size,
                         model_dtype=model_dtype, storage_dtype=storage_dtype)
        (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
        log.info("HiF8 export: %d quantized linears, %d quantized experts modules (%d bytes of codes), the rest in %s",
                 len(stored.quantized), len(stored.experts), layout["bytes"]["codes"], dtype_name(storage_dtype))
        return layout

    return save


def hif8_summary(out_dir, layout: dict) -> str:
    """One line of what a HiF8 export holds (the CLI prints it)."""
    return (f"wrote {out_dir}: {len(layout['quantized_layers'])} HiF8 layers, "
            f"{layout['weights_file_bytes'] / 2**20:.1f} MiB ({layout['bytes']['codes'] / 2**20:.1f} MiB of codes)")


HIF8 = ExportFormat("hif8", LAYOUT_FILE, _prepare, hif8_summary)
