"""The 8-bit HiF8 checkpoint reader: :func:`load_hif8` and its quantized layers, :class:`HiF8ExportedLinear`."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import QuantConfig
from ..hif8.experts import HiF8Experts, is_fused_experts
from ..hif8.fake_quant import dequantize_codes
from ..hif8.linear import HiF8Linear
from ..hif8.patch import _set_submodule
from ..hif8.quantized import QuantizedMatmul
from ..models import resolve_dtype
from .layout import LAYOUT_FILE, ROLE_BUFFER, ROLE_CODES, ROLE_SCALE, ExportError, read_layout, read_weights
from .stored_weight import StoredWeight

log = logging.getLogger(__name__)


class HiF8ExportedLinear(HiF8Linear):
    """A ``HiF8Linear`` loaded from an 8-bit export; its weight holds ``decode(codes) / scale``.

    :func:`load_hif8` gives it (and every quantized matmul, MoE experts' projections included) a
    :class:`~qat_app.export.stored_weight.StoredWeight`: in eval mode, while the weight is the loaded one, the
    forward's GEMM runs over the stored codes and scale, exactly the fake-quantized weight of the exported QAT model.
    Otherwise (training mode, or a changed weight) it behaves as ``HiF8Linear``.
    """

    @property
    def uses_exported_weight(self) -> bool:
        """The weight is the one :func:`load_hif8` loaded, unchanged since."""
        return self.weight_source is not None and self.weight_source.holds(self.weight)


def _build_model(out_dir: Path, layout: dict, dtype, trust_remote_code: bool) -> nn.Module:
    """The model of ``config.json``, uninitialized (every tensor is loaded afterwards, strictly checked)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights

    remote = bool(trust_remote_code)  # the caller's choice: never what the export's layout says
    if layout.get("trust_remote_code") and not remote:
        log.info("%s: the exported model names its own code (trust_remote_code); not run without "
                 "trust_remote_code=True from the caller", out_dir)
    if not (out_dir / "config.json").is_file():
        raise FileNotFoundError(f"{out_dir / 'config.json'}: missing (named by {out_dir / LAYOUT_FILE})")
    config = AutoConfig.from_pretrained(str(out_dir), trust_remote_code=remote)
    model_dtype = resolve_dtype(dtype or layout["model_dtype"])
    # every parameter and buffer is overwritten below (strictly checked): skip the random init
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=model_dtype, trust_remote_code=remote)


def _patch_layers(model: nn.Module, layout: dict, layout_path: Path) -> None:
    """Patch exactly the layers the layout lists, with the saved recipe."""
    try:
        quant = QuantConfig(**layout["quant"])
    except (TypeError, ValueError) as err:
        raise ExportError(f"{layout_path}: invalid quant settings: {err}") from None
    recorded = list(layout["quantized_layers"])
    modules = dict(model.named_modules())
    missing = [name for name in recorded if name not in modules]
    if missing:
        raise ExportError(
            f"{layout_path} does not match the model built from config.json: {len(missing)} of the "
            f"{len(recorded)} quantized layers it lists are not in the model (e.g. {missing[:3]})"
        )
    for name in recorded:
        _set_submodule(model, name, HiF8ExportedLinear.from_linear(modules[name], **quant.layer_options()))
    experts = layout.get("quantized_experts", {})
    wrong = [name for name in experts if name not in modules or not is_fused_experts(modules[name])
             or modules[name].gate_up_proj.shape[0] != experts[name].get("num_experts")]
    if wrong:
        raise ExportError(
            f"{layout_path} does not match the model built from config.json: {len(wrong)} of the {len(experts)} "
            f"quantized MoE experts modules it lists are not fused experts modules of that size in the model "
            f"(e.g. {wrong[:3]})"
        )
    options = quant.layer_options()
    for name in experts:
        _set_submodule(model, name, HiF8Experts(modules[name], options["recipe"], options["runtime"]))


def _state_dict(model: nn.Module, layout: dict, tensors: dict[str, torch.Tensor], layout_path: Path) -> dict[str, Any]:
    """The model's full state dict from the stored tensors: quantized weights as ``decode(codes) / scale``."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state: dict[str, Any] = {}
    for key, entry in layout["tensors"].items():
        if entry["role"] in (ROLE_CODES, ROLE_SCALE, ROLE_BUFFER):
            continue
        target = params.get(key, buffers.get(key))
        value = tensors[key]
        if target is not None and value.is_floating_point() and target.is_floating_point():
            value = value.to(target.dtype)
        state[key] = value
    for name, record in layout["quantized_layers"].items():
        layer = model.get_submodule(name)
        if record.get("weight") == "codes":
            codes, scale = tensors[record["codes"]], tensors[record["scale"]]
            if codes.dtype != torch.uint8 or list(codes.shape) != list(layer.weight.shape) or scale.numel() != 1:
                raise ExportError(
                    f"{layout_path} does not match the model: {name} codes {codes.dtype}{list(codes.shape)} / scale "
                    f"{list(scale.shape)} for a weight of shape {list(layer.weight.shape)}"
                )
            # float32 decode(codes)/scale, then the parameter dtype: the QAT forward casts the same
            # float32 value to its compute dtype, so the forward sees identical weights
            state[f"{name}.weight"] = dequantize_codes(codes, scale.reshape(()), record["format"], layer.weight.dtype)
        state[f"{name}._extra_state"] = record["extra_state"]
    for name, record in layout.get("quantized_experts", {}).items():
        experts = model.get_submodule(name)
        for param, entry in record["params"].items():
            if entry.get("weight") != "codes":
                continue  # stored dense under its state key
            weight = getattr(experts, param)
            codes, scales = tensors[entry["codes"]], tensors[entry["scales"]]
            if (codes.dtype != torch.uint8 or list(codes.shape) != list(weight.shape)
                    or list(scales.shape) != [weight.shape[0]]):
                raise ExportError(
                    f"{layout_path} does not match the model: {name}.{param} codes {codes.dtype}{list(codes.shape)} / "
                    f"scales {list(scales.shape)} for a parameter of shape {list(weight.shape)}"
                )
            # per expert, as for a dense layer: float32 decode(codes[e])/scale[e], then the parameter dtype
            state[f"{name}.{param}"] = torch.stack([
                dequantize_codes(codes[e], scales[e].reshape(()), record["format"], weight.dtype)
                for e in range(weight.shape[0])
            ])
        for proj, proj_record in record["projections"].items():
            state[f"{name}.{proj}._extra_state"] = proj_record["extra_state"]
    for alias, target in layout["aliases"].items():
        if target not in state:
            raise ExportError(f"{layout_path}: alias {alias} -> {target}, but {target} is not stored")
        state[alias] = state[target]
    return state


def _restore_buffers(model: nn.Module, layout: dict, tensors: dict[str, torch.Tensor], layout_path: Path) -> None:
    """The non-persistent buffers as the exported model used them."""
    for key, entry in layout["tensors"].items():
        if entry["role"] != ROLE_BUFFER:
            continue
        owner, _, buffer = key.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:
            module = None
        if module is None or buffer not in module._buffers:
            raise ExportError(f"{layout_path} does not match the model built from config.json: it has no buffer {key}")
        module._buffers[buffer] = tensors[key]


def _exported_weights(model: nn.Module, layout: dict, tensors: dict[str, torch.Tensor]
                      ) -> list[tuple[QuantizedMatmul, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(quantized matmul, the weight its forward passes, its uint8 codes, its scale) for every weight stored as
    codes: dense linears and every expert's slice of a fused parameter (a weight stored dense is quantized as
    usual)."""
    found = []
    for name, record in layout["quantized_layers"].items():
        if record.get("weight") == "codes":
            layer = model.get_submodule(name)
            found.append((layer, layer.weight, tensors[record["codes"]], tensors[record["scale"]]))
    for name, record in layout.get("quantized_experts", {}).items():
        experts = model.get_submodule(name)
        for param, entry in record["params"].items():
            if entry.get("weight") == "codes":
                codes, scales = tensors[entry["codes"]], tensors[entry["scales"]]
                found.extend((projection, weight, codes[e], scales[e])
                             for e, (projection, weight) in enumerate(experts.projections(param)))
    return found


def _restore_scaler_flags(model: nn.Module, layout: dict) -> None:
    """The host-side ``has_history`` flag of every scaler (not in the state dict)."""
    records = dict(layout["quantized_layers"])
    for name, experts in layout.get("quantized_experts", {}).items():
        records.update((f"{name}.{proj}", record) for proj, record in experts["projections"].items())
    for name, record in records.items():
        layer = model.get_submodule(name)
        for scaler_name, has_history in record.get("has_history", {}).items():
            scaler = getattr(layer, scaler_name, None)
            if scaler is not None:
                scaler.has_history = bool(has_history)
                scaler.version += 1


def load_hif8(
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> nn.Module:
    """Rebuild the QAT model of an :func:`export_hif8` directory (eval mode, quantized layers patched).
    ``trust_remote_code``: let transformers run a model's own code (the caller's choice; the export's
    ``hif8_layout.json`` records whether the model needs it, but is not obeyed).

    ``dtype``: parameter dtype of the rebuilt model (default: the exported model's). The tokenizer, if
    one was exported, loads with ``AutoTokenizer.from_pretrained(out_dir)``.
    """
    out_dir = Path(out_dir)
    layout = read_layout(out_dir)
    layout_path = out_dir / LAYOUT_FILE
    tensors = read_weights(out_dir, layout)
    model = _build_model(out_dir, layout, dtype, trust_remote_code)
    if layout.get("experts_implementation") is not None:  # the unquantized experts run as they were exported
        model.config._experts_implementation = layout["experts_implementation"]
    _patch_layers(model, layout, layout_path)
    state = _state_dict(model, layout, tensors, layout_path)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ExportError(f"{layout_path} does not match the model built from {out_dir / 'config.json'}: {err}") from None
    _restore_buffers(model, layout, tensors, layout_path)
    _restore_scaler_flags(model, layout)
    model.to(device)
    for layer, weight, codes, scale in _exported_weights(model, layout, tensors):
        layer.weight_source = StoredWeight(weight, codes.to(weight.device), scale.to(weight.device))
    model.eval()
    return model
