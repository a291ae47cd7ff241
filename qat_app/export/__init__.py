"""Export a HiF8 QAT model: an 8-bit HiF8 checkpoint, a plain Hugging Face directory, or an FP8 checkpoint for serving.

:func:`export_hif8` writes every quantized weight as uint8 HiF8 codes plus float32 scales, the scaler state, and
the rest in ``dtype``; :func:`load_hif8` rebuilds the model in eval mode. Contract: the reloaded model's logits
equal the QAT model's (``torch.equal``) when the unquantized tensors were stored losslessly (the layout's
``lossless``). :func:`export_hf` writes a plain HF directory (master or fake-quantized weights, no quantizers);
:func:`export_compressed_tensors` an E4M3 ``compressed-tensors`` checkpoint that vLLM serves. Every export is
written to a temporary directory and renamed into place, and replaces only an earlier export of the same kind.
The command line is :func:`main` (``python main.py export``).

See ``docs/serving.md`` for the commands, what each export holds and who loads it.
"""

from .cli import main
from .compressed import export_compressed_tensors
from .hf import export_hf
from .layout import (HF_EXPORT_INFO, LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, ROLE_BUFFER, ROLE_CODES, ROLE_DENSE,
                     ROLE_OTHER, ROLE_SCALE, ROLE_SCALER, SCALER_NAMES, WEIGHTS_FILE, ExportError, checkpoint_bytes,
                     read_layout)
from .qat_checkpoint import load_qat_checkpoint
from .reader import HiF8ExportedLinear, load_hif8
from .source import ExportSource, export_source, quantize_experts_param, quantize_weight
from .writer import export_hif8

__all__ = [
    "ExportSource", "HF_EXPORT_INFO", "LAYOUT_FILE", "LAYOUT_FORMAT", "LAYOUT_VERSION", "ROLE_BUFFER", "ROLE_CODES", "ROLE_DENSE",
    "ROLE_OTHER", "ROLE_SCALE", "ROLE_SCALER", "SCALER_NAMES", "WEIGHTS_FILE", "ExportError", "HiF8ExportedLinear",
    "checkpoint_bytes", "export_compressed_tensors", "export_hf", "export_hif8", "export_source", "load_hif8", "load_qat_checkpoint", "main", "quantize_experts_param", "quantize_weight",
    "read_layout",
]
