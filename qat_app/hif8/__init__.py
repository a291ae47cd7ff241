"""HiF8 W8A8 quantization-aware training, framework-free (torch and transformers' modules only).

Layers: :mod:`.formats` (HiF8, E4M3, E5M2 rounding and codes) -> :mod:`.backends` (fake quantization:
reference, torch.compile, Triton) -> :mod:`.scaling` (a tensor's amax history and scale) and
:mod:`.scaler_bank` (all of them stacked, one batched update) -> :mod:`.quantized` (the quantized
matmul: a scaler and switch per :class:`~.operand.Operand`, plan, autograd function) -> :mod:`.linear` (HiF8Linear), :mod:`.experts` ->
:mod:`.patch` (which linears) -> :mod:`.training` (the per-step protocol). Configuration:
:mod:`.recipe` (frozen ``HiF8Recipe``, ``LayerSelection``, ``RuntimeOptions``). Around them: :mod:`.health`
(numeric health, what-if clipping), :mod:`.fallback` (the automatic fallback policy), :mod:`.inventory` (what
was quantized), :mod:`.layer_error` (per-layer output error against high precision).
"""

from .errors import FieldError, HiF8Error, RecipeError, SelectionError
from .fallback import FallbackMonitor, FallbackPolicy, fallback_step, fallen_back
from .linear import HiF8Linear
from .patch import QuantReport, convert_to_hif8_training, dequantize_model, quantized_linears, set_quantization
from .quantized import set_health_measurement
from .recipe import HiF8Recipe, LayerSelection, RuntimeOptions
from .scaling import keep_scalers_out_of_ddp_broadcast
from .operand import Operand, OperandPlan
from .training import end_warmup, release_weight_caches, resolve_gemms, start_warmup, sync_and_advance

__all__ = [
    "FallbackMonitor", "FallbackPolicy", "FieldError", "HiF8Error", "HiF8Linear", "HiF8Recipe", "LayerSelection",
    "Operand", "OperandPlan", "QuantReport", "RecipeError", "RuntimeOptions", "SelectionError", "convert_to_hif8_training", "dequantize_model",
    "end_warmup", "fallback_step", "fallen_back", "keep_scalers_out_of_ddp_broadcast", "quantized_linears",
    "release_weight_caches", "resolve_gemms", "set_health_measurement", "set_quantization", "start_warmup", "sync_and_advance",
]
