"""The plain Hugging Face export: :func:`export_hf` (quantizers removed; lm-eval / ``from_pretrained`` load it)."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch

from ..hif8.linear import HiF8Linear
from ..hif8.fake_quant import dequantize_codes
from ..hif8.patch import dequantize_model, quantized_linears
from .common import quant_of
from .layout import HF_EXPORT_INFO, checkpoint_bytes
from .source import ExportSource, WeightCodes
from .writing import ExportFormat, write_export

log = logging.getLogger("qat_app.export")


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
    write_export(HF, module_or_model, out_dir, dtype=dtype, compute_dtype=compute_dtype, tokenizer=tokenizer,
                 overwrite=overwrite, weights=weights)
    return Path(out_dir)


def _prepare(source: ExportSource, weights: str = "master"):
    """A plain copy of the source's model (its quantized weights on the 8-bit grid with ``weights="quantized"``)
    -> its ``save``."""
    if weights not in ("master", "quantized"):
        raise ValueError(f"weights must be 'master' or 'quantized', got {weights!r}")
    plain = copy.deepcopy(source.model)
    layers = quantized_linears(plain)
    if weights == "quantized":
        set_quantized_weights(plain, source.weights)
    count = dequantize_model(plain)
    if source.storage_dtype is not None:
        plain.to(source.storage_dtype)
    plain.eval()

    def save(directory: Path) -> dict:
        plain.save_pretrained(str(directory), safe_serialization=True)
        if source.tokenizer is not None:
            source.tokenizer.save_pretrained(str(directory))
        info = {"exported_by": "qat_app.export.export_hf", "source": source.info.get("model_name"),
                "dequantized_layers": count, "weights": weights,
                "quant": quant_of(plain, layers).to_dict() if layers else None}
        (directory / HF_EXPORT_INFO).write_text(json.dumps(info, indent=1))
        log.info("HF export: %d HiF8 linears replaced by plain ones (%s weights)", count, weights)
        return info

    return save


def hf_summary(out_dir, info: dict) -> str:
    """One line of what a plain HF export holds (the CLI prints it)."""
    return f"wrote {out_dir}: {checkpoint_bytes(out_dir) / 2**20:.1f} MiB"


HF = ExportFormat("hf", HF_EXPORT_INFO, _prepare, hf_summary, run_dtype=False,
                  options=lambda args: {"weights": args.hf_weights},
                  computes_codes=lambda options: options.get("weights") == "quantized")


@torch.no_grad()
def set_quantized_weights(model, weights: dict[str, WeightCodes]) -> None:
    """Every weight of ``model`` in ``weights`` (an :class:`~.source.ExportSource`'s, of this model or of the one it
    was copied from) replaced, in place, by its fake-quantized value ``decode(codes) / scale``: the weights the
    forward pass used (a fallen-back or switched-off weight is not there and keeps its master value, as the
    forward does)."""
    modules = dict(model.named_modules())
    for key, (codes, scale) in weights.items():
        owner, _, param = key.rpartition(".")
        if isinstance(modules.get(key), HiF8Linear):
            layer = modules[key]
            layer.weight.copy_(dequantize_codes(codes, scale, layer.recipe.format, layer.weight.dtype))
        else:  # an experts module's fused parameter, expert by expert
            experts = modules[owner]
            weight = getattr(experts, param)
            for e in range(weight.shape[0]):
                weight[e].copy_(dequantize_codes(codes[e], scale[e], experts.gate_up[0].recipe.format, weight.dtype))
