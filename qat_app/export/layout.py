"""The 8-bit checkpoint's layout: file names, tensor roles, ``hif8_layout.json`` reading and its checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import QATError
from ..hif8.operand import SCALER_NAMES  # noqa: F401  (the scalers' state keys, as the export names them)

LAYOUT_FILE = "hif8_layout.json"
WEIGHTS_FILE = "model.hif8.safetensors"
LAYOUT_FORMAT = "qat_app/hif8-checkpoint"
LAYOUT_VERSION = 1
HF_EXPORT_INFO = "qat_app_export.json"
# entries every layout has
LAYOUT_KEYS = ("weights_file", "quant", "quantized_layers", "tensors", "aliases", "model_dtype")

# roles of the tensors in the safetensors file
ROLE_CODES, ROLE_SCALE, ROLE_DENSE, ROLE_SCALER, ROLE_OTHER = "codes", "scale", "dense", "scaler_state", "other"
ROLE_BUFFER = "nonpersistent_buffer"  # rotary inv_freq & co: derived from the config, stored as they were used


class ExportError(QATError, ValueError):
    """Bad input to an export / load: the message names the offending file."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    for key in LAYOUT_KEYS:
        if key not in layout:
            raise ExportError(f"{path}: the layout has no {key!r} entry")
    return layout


def read_weights(out_dir: Path, layout: dict) -> dict[str, torch.Tensor]:
    """The tensors of the weights file the layout names, checked against it (size, names, dtypes, shapes)."""
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
        if dtype_name(t.dtype) != entry.get("dtype") or list(t.shape) != entry.get("shape"):
            raise ExportError(
                f"{layout_path} does not match {path}: {key} is {dtype_name(t.dtype)}{list(t.shape)} in the file, "
                f"{entry.get('dtype')}{entry.get('shape')} in the layout"
            )
    return tensors


def checkpoint_bytes(out_dir: str | os.PathLike) -> int:
    """Size of the weight files (``*.safetensors``) in a directory."""
    return sum(p.stat().st_size for p in Path(out_dir).glob("*.safetensors"))
