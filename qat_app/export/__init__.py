"""Export a HiF8 QAT model: a real 8-bit checkpoint, a plain Hugging Face directory, an FP8 checkpoint for serving.

8-bit HiF8 checkpoint (:func:`export_hif8` / :func:`load_hif8`), one directory::

    hif8_layout.json          what is where (format, QuantConfig, every tensor's role/dtype/shape)
    model.hif8.safetensors    the tensors
    config.json (+ generation_config.json, tokenizer files, remote code if any)
    quantized_modules.json    what is quantized and why the rest is not (:mod:`qat_app.hif8.inventory`; also in
                              the plain HF export; written for a QATModule, whose layer selection is known)

* every quantized weight (a ``HiF8Linear`` with weight quantization on) is stored as its uint8
  HiF8 codes (``<layer>.weight.codes``, 1 byte per parameter) plus its per-tensor scale
  (``<layer>.weight.scale``, float32 scalar): the codes are those of ``W * scale`` exactly as the
  QAT forward pass computes them (same scaler branch: the delayed scale, or the current scale when
  the scaler has no history / uses CTS), so ``decode(codes) / scale`` cast to the compute dtype *is*
  the fake-quantized weight of the QAT forward pass, bit for bit;
* every quantized MoE experts module (``HiF8Experts``, listed under ``quantized_experts``) stores each
  fused parameter as one uint8 codes tensor (``<experts>.gate_up_proj.codes`` ``[E, 2I, H]``,
  ``<experts>.down_proj.codes`` ``[E, H, I]``, 1 byte per weight) plus float32 scales ``[E]``
  (``<experts>.<param>.scales``): expert ``e``'s slice quantized by its own projection's weight scaler,
  exactly as in training; the per-expert scaler state is stored like a dense layer's
  (``<experts>.gate_up.<e>.input_scaler.amax_history`` ...), and the layout records the model's
  ``experts_implementation`` so the unquantized experts of the boundary blocks run as they did;
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
weight already holds the dequantized 8-bit values; in eval mode, while the weight is unchanged, its forward
uses the stored codes and scale (re-quantizing the weight would need the exact scale again, which current
scaling would recompute differently). In training mode, or once the weight has been changed, it is a plain
``HiF8Linear`` (restored scalers included), so QAT can continue. Quantized experts are rebuilt as
``HiF8Experts`` whose fused parameters hold ``decode(codes[e]) / scale[e]``; their projections are marked
the same way, each with its own codes and scale.

Plain HF export (:func:`export_hf`): a copy of the model with every ``HiF8Linear`` replaced by its
plain module (``dequantize_model``) and ``save_pretrained`` + tokenizer, loadable by lm-eval and any
HF tool. ``weights="master"`` (default) keeps the trained high-precision weights;
``weights="quantized"`` writes the fake-quantized (8-bit grid) weights instead, i.e. the W8 part of
the QAT model (activations are not quantized by plain HF code).

FP8 serving export (:func:`export_compressed_tensors`, :mod:`.compressed`): a ``compressed-tensors`` checkpoint
(E4M3 weights with per-channel scales, static input scales from the trained amax histories, the rest in BF16 and
in the ``ignore`` list) that vLLM serves on NVIDIA GPUs and transformers loads; the trained HiF8 weights are held
exactly above E4M3's floor, and :mod:`.served` measures what serving changes (KL, perplexity, benchmarks).

No export overwrites an existing non-empty directory unless ``overwrite=True``; both write to a
temporary sibling directory and rename it into place.

CLI (a Lightning checkpoint of ``QATModule``; ``python main.py export`` is the same)::

    python -m qat_app.export --ckpt_path runs/quickstart/checkpoints/last.ckpt --out exports/qs-hif8
    python -m qat_app.export --ckpt_path ... --out exports/qs-hf --format hf [--hf_weights quantized]
    python -m qat_app.export --ckpt_path ... --out exports/qs-fp8 --format compressed-tensors [--compare --config RUN.yaml]

Modules: :mod:`.layout` (file names, tensor roles, reading and checking a layout), :mod:`.writer`
(:func:`export_hif8`), :mod:`.reader` (:func:`load_hif8`, :class:`HiF8ExportedLinear`), :mod:`.hf`
(:func:`export_hf`), :mod:`.compressed` (:func:`export_compressed_tensors`), :mod:`.served` (the served forward
against the trained one), :mod:`.common` (what both exports share), :mod:`.qat_checkpoint`
(:func:`load_qat_checkpoint`), :mod:`.cli` (:func:`main`).
"""

from .cli import main
from .compressed import export_compressed_tensors
from .hf import export_hf
from .layout import (HF_EXPORT_INFO, LAYOUT_FILE, LAYOUT_FORMAT, LAYOUT_VERSION, ROLE_BUFFER, ROLE_CODES, ROLE_DENSE,
                     ROLE_OTHER, ROLE_SCALE, ROLE_SCALER, SCALER_NAMES, WEIGHTS_FILE, ExportError, checkpoint_bytes,
                     read_layout)
from .qat_checkpoint import load_qat_checkpoint
from .reader import HiF8ExportedLinear, load_hif8
from .writer import export_hif8, quantize_experts_param, quantize_weight

__all__ = [
    "HF_EXPORT_INFO", "LAYOUT_FILE", "LAYOUT_FORMAT", "LAYOUT_VERSION", "ROLE_BUFFER", "ROLE_CODES", "ROLE_DENSE",
    "ROLE_OTHER", "ROLE_SCALE", "ROLE_SCALER", "SCALER_NAMES", "WEIGHTS_FILE", "ExportError", "HiF8ExportedLinear",
    "checkpoint_bytes", "export_compressed_tensors", "export_hf", "export_hif8", "load_hif8", "load_qat_checkpoint", "main", "quantize_experts_param", "quantize_weight",
    "read_layout",
]
