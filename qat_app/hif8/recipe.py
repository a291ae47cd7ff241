"""What to quantize and how, split by concern (frozen, validated on construction, like torchao's configs).

* :class:`HiF8Recipe` -- the numerics of the paper's recipe: format, a_hat estimator (``amax_algo``,
  window ``history_len``, ``alpha``), ``max_val`` and ``margin`` of the scale, the STE, gradient
  quantization. Two runs with the same recipe quantize alike.
* :class:`LayerSelection` -- which linears: a name regex inside decoder blocks minus the
  ``high_precision_layers`` boundary blocks (the paper's layout), or any ``filter_fn(module, fqn)``.
* :class:`RuntimeOptions` -- how it runs, not what it computes: the backend (``fused``), 8-bit saved
  activations, and the initial weight / activation switches (the BF16 warmup drives them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from torch import nn

from .errors import RecipeError
from .estimators import AMAX_ALGOS
from .formats import FORMATS, get_format
from .gemm import FP8_TAILS, GEMM_EMULATED, GEMM_MODES, TAIL_DROP

STE_MODES = ("identity", "clipped")
FUSED_MODES = ("auto", "on", "off")

# The MLP projections (matched against the module's full name), never attention, embeddings, norms,
# lm_head or routers:
# * gate_proj/up_proj/down_proj under ``.mlp``: Llama, Qwen2/3, Mistral, Gemma 1-3, OLMo2, Granite,
#   StableLM, SmolLM3, OpenPangu;
# * gate_up_proj under ``.mlp``: Phi-3's fused gate+up projection. It is one linear, so it becomes one
#   HiF8Linear: ONE per-tensor weight scale for the whole fused [2*intermediate, hidden] weight (gate
#   and up rows share it) and one input scale (gate and up read the same input anyway);
# * c_fc/c_proj under ``.mlp``: GPT-2 (Conv1D; the attention's ``attn.c_proj`` is not matched);
# * fc1/fc2 under ``.mlp`` (Phi) or directly under the decoder block (OPT: ``decoder.layers.N.fc1``);
# * dense_h_to_4h/dense_4h_to_h under ``.mlp``: GPT-NeoX, Falcon;
# * the same under ``.mlp.shared_expert(s)``: the dense shared expert of an MoE block (Qwen2-MoE, DeepSeek).
# MoE experts (fused 3-D parameters) are converted apart, per expert (:mod:`qat_app.hif8.experts`).
DEFAULT_MODULE_PATTERN = (
    r"(?:\.mlp\.(?:shared_experts?\.)?(?:gate_proj|up_proj|gate_up_proj|down_proj|c_fc|c_proj|fc1|fc2|dense_h_to_4h|dense_4h_to_h)"
    r"|(?:^|\.)(?:layers|h|blocks|block)\.\d+\.(?:fc1|fc2))$"
)
# The decoder-block index inside a module name: model.layers.7.mlp..., transformer.h.7.mlp..., blocks.7...
DEFAULT_BLOCK_PATTERN = r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\."


def _fail(field: str, message: str) -> None:
    raise RecipeError(field, message)


@dataclass(frozen=True)
class HiF8Recipe:
    """The numerics: how weights and activations are scaled and rounded.

    Attributes:
        format: 8-bit format of weights and activations: ``hif8``, ``e4m3`` or ``e5m2``.
        amax_algo: how a_hat is estimated: ``most_recent`` (a_hat(t)=amax(t-1)), ``exp_smooth``
            (alpha*amax(t-1)+(1-alpha)*a_hat(t-1)), ``max`` (max over the last ``history_len`` steps) or
            ``current`` (CTS: the current tensor's own amax).
        history_len: H, the amax-history length in optimizer steps (the window of ``max``).
        alpha: weight of the newest amax for ``exp_smooth``; the paper leaves it open, 0.1 is our choice.
        max_val: where a_hat is mapped to, s = max_val / a_hat; None: the format's default (HiF8: 15, the top
            of the 3-bit-mantissa tier).
        margin: extra headroom, s = max_val / a_hat / 2**margin (TransformerEngine's margin).
        power_2_scales: round every scale down to a power of two (TransformerEngine's ``use_power_2_scales``,
            torchao's ``round_scales_to_power_of_2``): dequantizing is then exact in any dtype; the headroom and
            the saturation counts follow the scale actually used.
        ste: ``identity`` (straight-through, the paper's) or ``clipped`` (zero gradient where the forward
            saturated).
        quantize_grads: also fake-quantize the output gradient in backward (own scaler).
        grad_max_val: max_val of the gradient quantizer (224, as in MindSpeed).
        grad_stochastic_rounding: round gradients stochastically (hif8 only).
    """

    format: str = "hif8"
    amax_algo: Literal[AMAX_ALGOS] = "max"
    history_len: int = 64
    alpha: float = 0.1
    max_val: Optional[float] = None
    margin: float = 0.0
    power_2_scales: bool = False
    ste: Literal[STE_MODES] = "identity"
    quantize_grads: bool = False
    grad_max_val: float = 224.0
    grad_stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            _fail("format", f"unknown format {self.format!r}; allowed: {', '.join(sorted(FORMATS))}")
        if self.amax_algo not in AMAX_ALGOS:
            _fail("amax_algo", f"unknown algorithm {self.amax_algo!r}; allowed: {', '.join(AMAX_ALGOS)}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            _fail("history_len", f"must be an integer >= 1, got {self.history_len!r}")
        if not (0.0 < self.alpha <= 1.0):
            _fail("alpha", f"must be in (0, 1], got {self.alpha!r}")
        limit = get_format(self.format).max_finite
        if self.max_val is not None and not (0.0 < self.max_val <= limit):
            _fail("max_val", f"must be in (0, {limit:g}] for {self.format}, got {self.max_val!r}")
        if not (0.0 <= self.margin < 64):
            _fail("margin", f"must be in [0, 64), got {self.margin!r}")
        if self.ste not in STE_MODES:
            _fail("ste", f"unknown mode {self.ste!r}; allowed: {', '.join(STE_MODES)}")
        if not (0.0 < self.grad_max_val <= limit):
            _fail("grad_max_val", f"must be in (0, {limit:g}], got {self.grad_max_val!r}")
        if self.grad_stochastic_rounding and self.quantize_grads and not get_format(self.format).supports_stochastic:
            _fail("grad_stochastic_rounding", f"stochastic rounding is only implemented for hif8, not {self.format}")

    @property
    def resolved_max_val(self) -> float:
        return self.max_val if self.max_val is not None else get_format(self.format).default_max_val


@dataclass(frozen=True)
class LayerSelection:
    """Which linears are quantized.

    Attributes:
        module_pattern: regex on the full module name selecting the linears to quantize.
        block_pattern: regex whose first group is the decoder-block index in a module name.
        high_precision_layers: k; the first ceil(k/2) and last floor(k/2) blocks stay unquantized.
        filter_fn: ``(module, fqn) -> bool``; when given it alone decides (patterns and k are ignored).
    """

    module_pattern: str = DEFAULT_MODULE_PATTERN
    block_pattern: str = DEFAULT_BLOCK_PATTERN
    high_precision_layers: int = 5
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.high_precision_layers, int) or self.high_precision_layers < 0:
            _fail("high_precision_layers", f"must be an integer >= 0, got {self.high_precision_layers!r}")
        for name in ("module_pattern", "block_pattern"):
            try:
                compiled = re.compile(getattr(self, name))
            except re.error as err:
                _fail(name, f"not a valid regular expression: {err}")
            if name == "block_pattern" and compiled.groups < 1:
                _fail(name, "needs one capturing group for the block index")


@dataclass(frozen=True)
class RuntimeOptions:
    """How it runs, not what it computes.

    Attributes:
        fused: ``auto`` compiles the fake-quant kernels (torch.compile, or Triton on a GPU) where a compiler
            works, ``on`` requires it, ``off`` runs plain torch; identical results.
        save_8bit_activations: keep the quantized input for backward as uint8 codes plus the scale instead
            of a full-precision tensor (same gradients, a quarter/half the memory). The GEMMs over the grid
            (``gemm`` emulated, fp8, auto) always keep the codes: they are the operand.
        quantize_weights: the weight switch a converted layer starts with (the BF16 warmup drives it during
            fit; observers record amax either way).
        quantize_activations: the activation switch a converted layer starts with (likewise).
        gemm: how the products are computed: ``emulated`` (the hardware's arithmetic: the 8-bit grid values
            multiplied with an fp32 accumulator, the two decode scales applied to it before the one rounding to
            the output dtype; what an HiF8 NPU or an FP8 tensor core does) or ``dequantize_first`` (each operand
            dequantized to the compute dtype first, then multiplied: an extra rounding under bf16; kept to
            compare); ``fp8``: the same product on FP8 tensor cores (``torch._scaled_mm`` on the grid
            values cast exactly to E4M3; CUDA sm89+, or the CPU in torch >= 2.13); ``auto``: fp8 on GPUs with FP8
            tensor cores where it is the faster (timed once at the first forward), emulated elsewhere.
        fp8_tail: with ``gemm: fp8``, the grid values under 2^-12 of the scale, which E4M3 cannot hold: ``drop``
            (left out of the product; relative error ~1e-7 on normal data) or ``exact`` (carried by extra FP8
            GEMMs, up to 4x the GEMM work).
    """

    fused: Literal[FUSED_MODES] = "auto"
    save_8bit_activations: bool = True
    quantize_weights: bool = True
    quantize_activations: bool = True
    gemm: Literal[GEMM_MODES] = GEMM_EMULATED
    fp8_tail: Literal[FP8_TAILS] = TAIL_DROP

    def __post_init__(self) -> None:
        if self.fused not in FUSED_MODES:
            _fail("fused", f"unknown value {self.fused!r}; allowed: {', '.join(FUSED_MODES)}")
        if self.gemm not in GEMM_MODES:
            _fail("gemm", f"unknown value {self.gemm!r}; allowed: {', '.join(GEMM_MODES)}")
        if self.fp8_tail not in FP8_TAILS:
            _fail("fp8_tail", f"unknown value {self.fp8_tail!r}; allowed: {', '.join(FP8_TAILS)}")
