"""Export a HiF8 QAT model: a real 8-bit checkpoint, and a plain Hugging Face directory.

8-bit HiF8 checkpoint (:func:`export_hif8` / :func:`load_hif8`), one directory::

    hif8_layout.json          what is where (format, QuantConfig, every tensor's role/dtype/shape)
    model.hif8.safetensors    the tensors
    config.json (+ generation_config.json, tokenizer files, remote code if any)

* every quantized weight (a ``HiF8Linear`` with weight quantization on) is stored as its uint8
  HiF8 codes (``<layer>.weight.codes``, 1 byte per parameter) plus its per-tensor scale
  (``<layer>.weight.scale``, float32 scalar): the codes are those of ``W * scale`` exactly as the
  QAT forward pass computes them (same scaler branch: the delayed scale, or the current scale when
  the scaler has no history / uses CTS), so ``decode(codes) / scale`` cast to the compute dtype *is*
  the fake-quantized weight of the QAT forward pass, bit for bit;
* every other floating tensor (attention, embeddings, norms, lm_head, boundary blocks, biases) is
  stored in ``dtype`` (BF16 by default);
* the amax-scaler state of every quantized layer (``amax_history``, ``a_hat``, ``scale``,
  ``steps_recorded``, counters) is stored unchanged (float32 / int64), together with the host-side
  ``has_history`` flag and the quantization switches, so activations are quantized exactly as in the
  QAT model (same delayed scale, or current scaling where the QAT model used it);
* tensors that share storage (tied ``lm_head``/``embed_tokens``) are stored once (``aliases``);
* non-persistent buffers (rotary ``inv_freq`` ...) are stored as the model used them (a few bytes), so
  the rebuilt model does not depend on how its constructor computes them.

:func:`load_hif8` rebuilds the model from ``config.json``, patches it with the saved QuantConfig
(checking that it selects exactly the layers in the layout), loads the weights (quantized weights
as ``decode(codes) / scale``) and the scaler state, and returns it in eval mode. Its logits equal
the QAT model's (``torch.equal``) provided the unquantized tensors were stored losslessly, i.e. the
model's unquantized parameters are representable in ``dtype``: a BF16 model exported in BF16, or any
model exported with ``dtype="float32"``. A float32 QAT model exported in BF16 differs only by the
BF16 rounding of its unquantized parameters (the layout records ``lossless: false``, and a warning
says so). The codes depend on the compute dtype of the QAT forward pass (``compute_dtype``, default:
the weight's dtype; pass ``"bfloat16"`` for a model run under bf16 autocast).

The quantized layers of the loaded model are :class:`HiF8ExportedLinear`: a ``HiF8Linear`` whose
weight already holds the dequantized 8-bit values; in eval mode, while the weight is unchanged, it
uses them as they are (re-quantizing them would need the exact scale again, which current scaling
would recompute differently). In training mode, or once the weight has been changed, it is a plain
``HiF8Linear`` (restored scalers included), so QAT can continue.

Plain HF export (:func:`export_hf`): a copy of the model with every ``HiF8Linear`` replaced by its
plain module (``dequantize_model``) and ``save_pretrained`` + tokenizer, loadable by lm-eval and any
HF tool. ``weights="master"`` (default) keeps the trained high-precision weights;
``weights="quantized"`` writes the fake-quantized (8-bit grid) weights instead, i.e. the W8 part of
the QAT model (activations are not quantized by plain HF code).

Neither export overwrites an existing non-empty directory unless ``overwrite=True``; both write to a
temporary sibling directory and rename it into place.

CLI (a Lightning checkpoint of ``QATModule``)::

    python -m qat_app.export --ckpt runs/quickstart/checkpoints/last.ckpt --out exports/qs-hif8
    python -m qat_app.export --ckpt ... --out exports/qs-hf --format hf [--hf-weights quantized]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import QuantConfig
from .errors import CheckpointError, QATError
from .hif8.fake_quant import dequantize_codes, fake_quantize, fake_quantize_current
from .hif8.linear import HiF8Linear
from .models import resolve_dtype
from .hif8.patch import _set_submodule, dequantize_model, quantized_linears
from .hif8.scaling import AmaxScaler

log = logging.getLogger(__name__)

LAYOUT_FILE = "hif8_layout.json"
WEIGHTS_FILE = "model.hif8.safetensors"
LAYOUT_FORMAT = "qat_app/hif8-checkpoint"
LAYOUT_VERSION = 1
HF_EXPORT_INFO = "qat_app_export.json"
SCALER_NAMES = ("input_scaler", "weight_scaler", "grad_scaler")

# roles of the tensors in the safetensors file
ROLE_CODES, ROLE_SCALE, ROLE_DENSE, ROLE_SCALER, ROLE_OTHER = "codes", "scale", "dense", "scaler_state", "other"
ROLE_BUFFER = "nonpersistent_buffer"  # rotary inv_freq & co: derived from the config, stored as they were used


class ExportError(QATError, ValueError):
    """Bad input to an export / load: the message names the offending file."""


# ------------------------------------------------------------------------------------------ helpers
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unwrap(module_or_model) -> tuple[nn.Module, Any, dict]:
    """-> (HF model, tokenizer or None, info) for a QATModule (anything with ``.model``) or a bare model."""
    from transformers import PreTrainedModel

    if isinstance(module_or_model, PreTrainedModel):
        return module_or_model, None, {}
    inner = getattr(module_or_model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "config"):
        hparams = dict(getattr(module_or_model, "hparams", {}) or {})
        info = {k: hparams[k] for k in ("model_name", "trust_remote_code") if k in hparams}
        return inner, getattr(module_or_model, "tokenizer", None), info
    if isinstance(module_or_model, nn.Module) and hasattr(module_or_model, "config"):
        return module_or_model, None, {}
    raise TypeError(
        f"expected a QATModule or a Hugging Face model, got {type(module_or_model).__name__}"
    )


def _quant_of(model: nn.Module, layers: list[tuple[str, HiF8Linear]]) -> QuantConfig:
    """The layers' common recipe and runtime options, as the flat QuantConfig the layout records."""
    first = layers[0][1]
    for name, layer in layers[1:]:
        if (layer.recipe, layer.runtime) != (first.recipe, first.runtime):
            raise ExportError(f"layer {name} has a different recipe than {layers[0][0]}: mixed recipes are not supported")
    return QuantConfig.from_layer_options(first.recipe, first.runtime)


def _scaler_pairs(layer: HiF8Linear) -> list[tuple[str, AmaxScaler]]:
    return [(n, getattr(layer, n)) for n in SCALER_NAMES if getattr(layer, n, None) is not None]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN == NaN, same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


@torch.no_grad()
def quantize_weight(layer: HiF8Linear, compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight as the QAT forward pass quantizes it -> (uint8 codes, float32 scalar scale, dequantized).

    Same branch as ``HiF8Linear._fake_quantize``: the scaler's delayed scale, or the current scale when
    it uses current scaling (``algo="current"`` or no history yet). Plain torch (``fused="off"``), which
    is bit-identical to the compiled kernel. ``dequantized`` is in ``compute_dtype`` (default: the
    weight's dtype) and equals ``(decode(codes) / scale).to(compute_dtype)``.
    """
    dtype = compute_dtype or layer.weight.dtype
    w = layer.weight.detach().to(dtype)
    scaler = layer.weight_scaler
    if scaler.uses_current_scaling:
        result, scale = fake_quantize_current(
            w, scaler.scale, scaler.max_val, scaler.margin, layer.format, want_codes=True, fused="off"
        )
    else:
        scale = scaler.scale
        result = fake_quantize(w, scale, scaler.max_val, layer.format, want_codes=True, fused="off")
    scale = scale.detach().float().reshape(()).clone()
    return result.codes, scale, result.dequantized




class _StagingDir:
    """Write into a temporary sibling of ``out_dir`` and rename it into place on success."""

    def __init__(self, out_dir: str | os.PathLike, overwrite: bool) -> None:
        self.target = Path(out_dir).expanduser().absolute()
        if self.target.exists():
            if not self.target.is_dir():
                raise FileExistsError(f"{self.target} exists and is not a directory")
            if any(self.target.iterdir()) and not overwrite:
                raise FileExistsError(f"{self.target} already exists and is not empty; pass --overwrite (overwrite=True) to replace it")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path: Path | None = None

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=str(self.target.parent)))
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.path is not None
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.path, 0o777 & ~umask)
        old = None
        if self.target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-", dir=str(self.target.parent)))
            os.rename(self.target, old / "x")
        os.rename(self.path, self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _save_model_files(model: nn.Module, tokenizer, directory: Path) -> None:
    """config.json, generation_config.json, remote code, tokenizer (no weights)."""
    model.config.save_pretrained(str(directory))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        try:
            generation_config.save_pretrained(str(directory))
        except Exception as err:  # pragma: no cover - an invalid generation config must not stop the export
            log.warning("generation_config not saved: %s", err)
    if getattr(model, "_auto_class", None) is not None:  # trust_remote_code models: copy their code
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, str(directory), config=model.config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))


# ----------------------------------------------------------------------------------- HiF8 export
_SAVED_SCALE_MASK = hasattr(HiF8Linear, "_dequantize")


class HiF8ExportedLinear(HiF8Linear):
    """A ``HiF8Linear`` loaded from an 8-bit export; its weight holds ``decode(codes) / scale``.

    In eval mode, while the weight is the loaded one (moving the model to another device or dtype keeps
    it; any in-place change or a new parameter does not), the forward pass uses it directly, cast to the
    compute dtype, which is exactly the fake-quantized weight of the exported QAT model. Otherwise
    (training mode, or a changed weight) it behaves as ``HiF8Linear``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._exported_key: tuple | None = None

    # (parameter identity, in-place version): survives .to(device/dtype), changes with any in-place update
    def mark_exported(self) -> None:
        self._exported_key = (id(self.weight), self.weight._version)

    @property
    def uses_exported_weight(self) -> bool:
        return self._exported_key == (id(self.weight), self.weight._version)

    def _quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype):
        if self.quantize_weights and not self.training and self._exported_key == (id(weight), weight._version):
            w = weight.detach().to(dtype)  # already decode(codes)/scale: used as it is
            # HiF8Linear returns (saved, scale, mask) and dequantizes ``saved`` when a scale is given
            # (no scale: the tensor itself); older versions returned (weight, mask)
            return (w, None, None) if _SAVED_SCALE_MASK else (w, None)
        return super()._quantize_weight(weight, dtype)


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
    from safetensors.torch import save_file

    model, module_tokenizer, info = _unwrap(module_or_model)
    tokenizer = tokenizer if tokenizer is not None else module_tokenizer
    storage_dtype = resolve_dtype(dtype)
    cdtype = resolve_dtype(compute_dtype) if compute_dtype is not None else None
    layers = quantized_linears(model)
    if not layers:
        raise ExportError(
            f"{type(model).__name__} has no HiF8Linear layer (quant.enabled=false?): nothing to store in 8 bits; "
            "use export_hf (--format hf) for an unquantized model"
        )
    quant = _quant_of(model, layers)
    staging = _StagingDir(out_dir, overwrite)  # refuse an existing export before any work
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    aliases: dict[str, str] = {}
    quantized: dict[str, dict] = {}
    layer_keys: set[str] = set()
    lossless = True

    def add(key: str, tensor: torch.Tensor, role: str, source: torch.Tensor | None = None) -> None:
        tensors[key] = tensor.detach().contiguous().cpu()
        entry = {"role": role, "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
        if source is not None:
            entry["source_dtype"] = _dtype_name(source.dtype)
        entries[key] = entry

    for name, layer in layers:
        layer_dtype = cdtype or layer.weight.dtype
        record: dict[str, Any] = {
            "format": layer.recipe.format,
            "shape": list(layer.weight.shape),
            "source_type": layer.source_type,
            "weight_dtype": _dtype_name(layer.weight.dtype),
            "compute_dtype": _dtype_name(layer_dtype),
            "extra_state": layer.get_extra_state(),
            "has_history": {s: scaler.has_history for s, scaler in _scaler_pairs(layer)},
        }
        layer_keys.add(f"{name}.weight")
        layer_keys.add(f"{name}._extra_state")
        if layer.quantize_weights:
            codes, scale, dequantized = quantize_weight(layer, layer_dtype)
            check = dequantize_codes(codes, scale, layer.recipe.format, layer_dtype)
            if not _same(check, dequantized):  # cannot happen: decode is exact; guards format changes
                raise ExportError(f"{name}: decode(codes)/scale does not reproduce the fake-quantized weight")
            add(f"{name}.weight.codes", codes, ROLE_CODES, layer.weight)
            add(f"{name}.weight.scale", scale, ROLE_SCALE)
            record.update(weight="codes", codes=f"{name}.weight.codes", scale=f"{name}.weight.scale")
        else:
            log.warning("%s: weight quantization is off (exported inside the BF16 warmup?): stored in %s", name, storage_dtype)
            stored = layer.weight.detach().to(storage_dtype)
            lossless &= _same(stored.to(layer.weight.dtype), layer.weight.detach())
            add(f"{name}.weight", stored, ROLE_DENSE, layer.weight)
            record.update(weight="dense")
        quantized[name] = record

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
        owner, _, buffer = key.rpartition(".")
        if owner.rpartition(".")[2] in SCALER_NAMES and owner.rpartition(".")[0] in quantized:
            add(key, value, ROLE_SCALER)
        elif value.is_floating_point():
            stored = value.detach().to(storage_dtype)
            lossless &= _same(stored.to(value.dtype), value.detach())
            add(key, stored, ROLE_DENSE, value)
        else:
            add(key, value, ROLE_OTHER)

    # non-persistent buffers (rotary inv_freq, ...): tiny; stored as the model used them (dtype included),
    # so the rebuilt model does not depend on how its constructor or weight init computes them
    for key, buf in model.named_buffers():
        if key not in state and key not in entries:
            add(key, buf, ROLE_BUFFER)

    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if not lossless:
        log.warning(
            "unquantized tensors of the %s model are not exactly representable in %s: the reloaded model will differ "
            "from this one by that rounding (export with dtype=float32 for an exact copy)",
            _dtype_name(model_dtype), _dtype_name(storage_dtype),
        )
    with staging as tmp:
        weights_path = tmp / WEIGHTS_FILE
        save_file(tensors, str(weights_path), metadata={"format": "pt", "qat_app_layout": LAYOUT_FILE})
        _save_model_files(model, tokenizer, tmp)
        layout = {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "weights_file": WEIGHTS_FILE,
            "weights_file_bytes": weights_path.stat().st_size,
            "model_class": type(model).__name__,
            "model_dtype": _dtype_name(model_dtype),
            "storage_dtype": _dtype_name(storage_dtype),
            "lossless": lossless,
            "trust_remote_code": bool(info.get("trust_remote_code", False) or getattr(model, "_auto_class", None)),
            "source": info.get("model_name"),
            "quant": quant.to_dict(),
            "quantized_layers": quantized,
            "aliases": aliases,
            "tensors": entries,
            "bytes": {
                "codes": sum(tensors[k].numel() for k, e in entries.items() if e["role"] == ROLE_CODES),
                "scales": sum(tensors[k].numel() * 4 for k, e in entries.items() if e["role"] == ROLE_SCALE),
                "dense": sum(tensors[k].numel() * tensors[k].element_size() for k, e in entries.items() if e["role"] == ROLE_DENSE),
                "scaler_state": sum(tensors[k].numel() * tensors[k].element_size() for k, e in entries.items() if e["role"] == ROLE_SCALER),
                "other": sum(tensors[k].numel() * tensors[k].element_size() for k, e in entries.items()
                             if e["role"] in (ROLE_OTHER, ROLE_BUFFER)),
            },
        }
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
    log.info(
        "HiF8 export: %d quantized linears (%d params in %d bytes of codes), %s in %s",
        len(quantized), layout["bytes"]["codes"], layout["bytes"]["codes"], _dtype_name(storage_dtype), out_dir,
    )
    return layout


def read_layout(out_dir: str | os.PathLike) -> dict:
    """Read and check ``hif8_layout.json`` of an export directory."""
    path = Path(out_dir) / LAYOUT_FILE
    if not Path(out_dir).is_dir():
        raise FileNotFoundError(f"{out_dir}: no such export directory")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {out_dir} is not a HiF8 export (written by qat_app.export.export_hif8)")
    try:
        layout = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT:
        raise ExportError(f"{path}: not a HiF8 layout file (format {layout.get('format') if isinstance(layout, dict) else None!r})")
    if layout.get("version") != LAYOUT_VERSION:
        raise ExportError(f"{path}: layout version {layout.get('version')!r} is not supported (expected {LAYOUT_VERSION})")
    for key in ("weights_file", "quant", "quantized_layers", "tensors", "aliases", "model_dtype"):
        if key not in layout:
            raise ExportError(f"{path}: the layout has no {key!r} entry")
    return layout


def _read_weights(out_dir: Path, layout: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = out_dir / layout["weights_file"]
    layout_path = out_dir / LAYOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (named by {layout_path})")
    size, expected = path.stat().st_size, layout.get("weights_file_bytes")
    if expected is not None and size != expected:
        raise ExportError(f"{path}: {size} bytes, but {layout_path} records {expected}: truncated or replaced file")
    try:
        tensors = load_file(str(path))
    except Exception as err:
        raise ExportError(f"{path}: not a readable safetensors file (truncated or corrupt?): {err}") from None
    listed = layout["tensors"]
    missing = sorted(set(listed) - set(tensors))
    extra = sorted(set(tensors) - set(listed))
    if missing or extra:
        raise ExportError(
            f"{layout_path} does not match {path}: tensors missing from the file {missing[:5]}, "
            f"tensors not in the layout {extra[:5]}"
        )
    for key, entry in listed.items():
        t = tensors[key]
        if _dtype_name(t.dtype) != entry.get("dtype") or list(t.shape) != entry.get("shape"):
            raise ExportError(
                f"{layout_path} does not match {path}: {key} is {_dtype_name(t.dtype)}{list(t.shape)} in the file, "
                f"{entry.get('dtype')}{entry.get('shape')} in the layout"
            )
    return tensors


def load_hif8(
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool | None = None,
) -> nn.Module:
    """Rebuild the QAT model of an :func:`export_hif8` directory (eval mode, quantized layers patched).

    ``dtype``: parameter dtype of the rebuilt model (default: the exported model's). The tokenizer, if
    one was exported, loads with ``AutoTokenizer.from_pretrained(out_dir)``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights

    out_dir = Path(out_dir)
    layout = read_layout(out_dir)
    layout_path = out_dir / LAYOUT_FILE
    tensors = _read_weights(out_dir, layout)
    remote = layout.get("trust_remote_code", False) if trust_remote_code is None else trust_remote_code
    if not (out_dir / "config.json").is_file():
        raise FileNotFoundError(f"{out_dir / 'config.json'}: missing (named by {layout_path})")
    config = AutoConfig.from_pretrained(str(out_dir), trust_remote_code=remote)
    model_dtype = resolve_dtype(dtype or layout["model_dtype"])
    # every parameter and buffer is overwritten below (strictly checked): skip the random init
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=model_dtype, trust_remote_code=remote)
    try:
        quant = QuantConfig(**layout["quant"])
    except (TypeError, ValueError) as err:
        raise ExportError(f"{layout_path}: invalid quant settings: {err}") from None

    # patch exactly the layers the layout lists, with the saved recipe
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
    for alias, target in layout["aliases"].items():
        if target not in state:
            raise ExportError(f"{layout_path}: alias {alias} -> {target}, but {target} is not stored")
        state[alias] = state[target]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ExportError(f"{layout_path} does not match the model built from {out_dir / 'config.json'}: {err}") from None

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
    for name, record in layout["quantized_layers"].items():
        layer = model.get_submodule(name)
        for scaler_name, has_history in record.get("has_history", {}).items():
            scaler = getattr(layer, scaler_name, None)
            if scaler is not None:
                scaler.has_history = bool(has_history)
                scaler.version += 1
    model.to(device)
    for _, layer in quantized_linears(model):
        if isinstance(layer, HiF8ExportedLinear):
            layer.mark_exported()
    model.eval()
    return model


def checkpoint_bytes(out_dir: str | os.PathLike) -> int:
    """Size of the weight files (``*.safetensors``) in a directory."""
    return sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))


# -------------------------------------------------------------------------------------- HF export
def export_hf(
    module_or_model,
    out_dir: str | os.PathLike,
    *,
    weights: str = "master",
    dtype: str | torch.dtype | None = None,
    compute_dtype: str | torch.dtype | None = None,
    tokenizer=None,
    overwrite: bool = False,
) -> Path:
    """Save a plain Hugging Face directory (quantizers removed) that lm-eval / ``from_pretrained`` load.

    Args:
        weights: ``master`` (the trained high-precision weights, as ``dequantize_model`` gives them) or
            ``quantized`` (each weight-quantized linear holds ``decode(codes) / scale``: the weights on
            the 8-bit grid the QAT forward pass used; activations are not quantized by plain HF code).
        dtype: parameter dtype of the saved model (default: unchanged).
        compute_dtype: as in :func:`export_hif8` (only for ``weights="quantized"``).
    The given model is not modified (a copy is dequantized).
    """
    if weights not in ("master", "quantized"):
        raise ValueError(f"weights must be 'master' or 'quantized', got {weights!r}")
    model, module_tokenizer, info = _unwrap(module_or_model)
    tokenizer = tokenizer if tokenizer is not None else module_tokenizer
    staging = _StagingDir(out_dir, overwrite)  # refuse an existing export before copying anything
    plain = copy.deepcopy(model)
    cdtype = resolve_dtype(compute_dtype) if compute_dtype is not None else None
    layers = quantized_linears(plain)
    if weights == "quantized":
        with torch.no_grad():
            for _, layer in layers:
                if layer.quantize_weights:
                    codes, scale, _ = quantize_weight(layer, cdtype or layer.weight.dtype)
                    layer.weight.copy_(dequantize_codes(codes, scale, layer.recipe.format, layer.weight.dtype))
    count = dequantize_model(plain)
    if dtype is not None:
        plain.to(resolve_dtype(dtype))
    plain.eval()
    with staging as tmp:
        plain.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / HF_EXPORT_INFO).write_text(json.dumps({
            "exported_by": "qat_app.export.export_hf",
            "source": info.get("model_name"),
            "dequantized_layers": count,
            "weights": weights,
            "quant": _quant_of(plain, layers).to_dict() if layers else None,
        }, indent=1))
    log.info("HF export: %d HiF8 linears replaced by plain ones (%s weights) in %s", count, weights, out_dir)
    return Path(out_dir)


# ------------------------------------------------------------------------------------ checkpoints
def load_qat_checkpoint(path: str | os.PathLike):
    """A ``QATModule`` restored from a Lightning checkpoint (hyper-parameters + state dict), in eval mode.

    Raises :class:`qat_app.errors.CheckpointError` naming the file when it is unreadable or truncated, or
    not a QATModule checkpoint.
    """
    from .checkpoint import load_checkpoint_file
    from .module import CHECKPOINT_KEY, QATModule

    path = str(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist (--ckpt)")
    # the hyper-parameters hold a QuantConfig object: a full (not weights-only) unpickling is needed
    ckpt = load_checkpoint_file(path, weights_only=False)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    hparams = ckpt.get("hyper_parameters") or {}
    state = ckpt["state_dict"]
    if "model_name" not in hparams or not any(k.startswith("model.") for k in state):
        marker = " (it has no qat_app entry either)" if CHECKPOINT_KEY not in ckpt else ""
        raise CheckpointError(
            f"{path} is not a QATModule checkpoint: it needs hyper-parameters with 'model_name' and a state dict "
            f"under 'model.' (found hyper-parameters {sorted(hparams)[:8]}){marker}"
        )
    accepted = set(inspect.signature(QATModule.__init__).parameters) - {"self"}
    kwargs = {k: v for k, v in dict(hparams).items() if k in accepted}
    quant = kwargs.get("quant")
    if quant is not None and not isinstance(quant, QuantConfig):
        kwargs["quant"] = QuantConfig(**(vars(quant) if hasattr(quant, "__dict__") else dict(quant)))
    module = QATModule(**kwargs)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path}: the state dict does not fit the QATModule its hyper-parameters describe: {err}") from None
    module.eval()
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qat_app.export",
        description="Export a QATModule Lightning checkpoint as an 8-bit HiF8 checkpoint or a plain HF directory.",
    )
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint (.ckpt) of a QATModule")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--format", choices=("hif8", "hf"), default="hif8")
    parser.add_argument("--dtype", default=None,
                        help="hif8: storage dtype of the unquantized tensors (default bfloat16); hf: parameter dtype (default unchanged)")
    parser.add_argument("--compute-dtype", default=None,
                        help="dtype the quantized linears ran in (default: the weights'; bfloat16 for bf16-mixed training)")
    parser.add_argument("--hf-weights", choices=("master", "quantized"), default="master",
                        help="hf: trained high-precision weights, or the fake-quantized 8-bit-grid weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if Path(args.out).exists() and Path(args.out).is_dir() and any(Path(args.out).iterdir()) and not args.overwrite:
            raise FileExistsError(f"{args.out} already exists and is not empty; pass --overwrite to replace it")
        module = load_qat_checkpoint(args.ckpt)
        if args.format == "hif8":
            layout = export_hif8(module, args.out, dtype=args.dtype or "bfloat16", compute_dtype=args.compute_dtype,
                                 overwrite=args.overwrite)
            print(f"wrote {args.out}: {len(layout['quantized_layers'])} HiF8 layers, "
                  f"{layout['weights_file_bytes'] / 2**20:.1f} MiB ({layout['bytes']['codes'] / 2**20:.1f} MiB of codes)")
        else:
            export_hf(module, args.out, weights=args.hf_weights, dtype=args.dtype, compute_dtype=args.compute_dtype,
                      overwrite=args.overwrite)
            print(f"wrote {args.out}: {checkpoint_bytes(args.out) / 2**20:.1f} MiB")
    except (QATError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
