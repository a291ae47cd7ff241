"""QuantConfig: one validated dataclass holding every quantization choice (each field is a CLI flag)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Optional

from .errors import ConfigError
from .formats import FORMATS, get_format

AMAX_ALGOS = ("most_recent", "exp_smooth", "max", "current")
STE_MODES = ("identity", "clipped")

# MLP projections of Llama/Qwen2/Mistral/OpenPangu (gate/up/down), GPT-2 (c_fc/c_proj inside .mlp),
# OPT/Phi (fc1/fc2), GPT-NeoX (dense_h_to_4h/dense_4h_to_h). Matched against the module's full name.
DEFAULT_MODULE_PATTERN = r"\.mlp\.(gate_proj|up_proj|down_proj|c_fc|c_proj|fc1|fc2|dense_h_to_4h|dense_4h_to_h)$"
# The decoder-block index inside a module name: model.layers.7.mlp..., transformer.h.7.mlp..., blocks.7...
DEFAULT_BLOCK_PATTERN = r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\."


class QuantConfigError(ConfigError):
    """A quantization setting is invalid; the message names the field and the allowed values."""


@dataclass
class QuantConfig:
    """HiF8 W8A8 fake-quantization settings.

    Attributes:
        enabled: False gives the matched BF16 baseline (no module is swapped).
        format: 8-bit format of weights and activations: ``hif8``, ``e4m3`` or ``e5m2``.
        amax_algo: how a_hat is estimated: ``most_recent`` (a_hat(t)=amax(t-1)), ``exp_smooth``
            (alpha*amax(t-1)+(1-alpha)*a_hat(t-1)), ``max`` (max over the last ``history_len`` steps)
            or ``current`` (CTS: the current tensor's own amax).
        history_len: H, the amax-history length in optimizer steps (the window of ``max``).
        alpha: smoothing weight of the newest amax for ``exp_smooth``; the paper leaves it open, 0.1
            is our choice.
        max_val: where a_hat is mapped to: s = max_val / a_hat. None: the format's default (HiF8: 15,
            the top of the 3-bit-mantissa tier).
        margin: extra headroom, s = max_val / a_hat / 2**margin (TransformerEngine's margin).
        high_precision_layers: k; the first ceil(k/2) and last floor(k/2) blocks stay unquantized.
        module_pattern: regex on the full module name selecting the linears to quantize.
        block_pattern: regex whose first group is the decoder-block index in a module name.
        quantize_weights / quantize_activations: initial switches (the BF16 warmup callback drives
            them during fit; observers record amax either way).
        ste: ``identity`` (straight-through, the paper's) or ``clipped`` (zero gradient where the
            forward saturated).
        quantize_grads: also fake-quantize the output gradient in backward (own scaler).
        grad_max_val / grad_stochastic_rounding: gradient quantizer settings (224 as in MindSpeed).
        save_8bit_activations: keep the quantized input for backward as uint8 codes plus the scale
            instead of a full-precision tensor (same gradients, a quarter/half the memory).
        fused: ``auto`` compiles the fake-quant kernels with torch.compile where a compiler works,
            ``on`` requires it, ``off`` runs plain torch (identical results).
    """

    enabled: bool = True
    format: str = "hif8"
    amax_algo: Literal["most_recent", "exp_smooth", "max", "current"] = "max"
    history_len: int = 64
    alpha: float = 0.1
    max_val: Optional[float] = None
    margin: float = 0.0
    high_precision_layers: int = 5
    module_pattern: str = DEFAULT_MODULE_PATTERN
    block_pattern: str = DEFAULT_BLOCK_PATTERN
    quantize_weights: bool = True
    quantize_activations: bool = True
    ste: Literal["identity", "clipped"] = "identity"
    quantize_grads: bool = False
    grad_max_val: float = 224.0
    grad_stochastic_rounding: bool = True
    save_8bit_activations: bool = True
    fused: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        import re

        def fail(field_name: str, msg: str) -> None:
            raise QuantConfigError(f"quant.{field_name}: {msg}")

        if self.format not in FORMATS:
            fail("format", f"unknown format {self.format!r}; allowed: {', '.join(sorted(FORMATS))}")
        if self.amax_algo not in AMAX_ALGOS:
            fail("amax_algo", f"unknown algorithm {self.amax_algo!r}; allowed: {', '.join(AMAX_ALGOS)}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            fail("history_len", f"must be an integer >= 1, got {self.history_len!r}")
        if not (0.0 < self.alpha <= 1.0):
            fail("alpha", f"must be in (0, 1], got {self.alpha!r}")
        if self.max_val is not None:
            limit = get_format(self.format).max_finite
            if not (0.0 < self.max_val <= limit):
                fail("max_val", f"must be in (0, {limit:g}] for {self.format}, got {self.max_val!r}")
        if not (0.0 <= self.margin < 64):
            fail("margin", f"must be in [0, 64), got {self.margin!r}")
        if not isinstance(self.high_precision_layers, int) or self.high_precision_layers < 0:
            fail("high_precision_layers", f"must be an integer >= 0, got {self.high_precision_layers!r}")
        if self.ste not in STE_MODES:
            fail("ste", f"unknown mode {self.ste!r}; allowed: {', '.join(STE_MODES)}")
        if self.fused not in ("auto", "on", "off"):
            fail("fused", f"unknown value {self.fused!r}; allowed: auto, on, off")
        if not (0.0 < self.grad_max_val <= get_format(self.format).max_finite):
            fail("grad_max_val", f"must be in (0, {get_format(self.format).max_finite:g}], got {self.grad_max_val!r}")
        if self.grad_stochastic_rounding and self.quantize_grads and not get_format(self.format).supports_stochastic:
            fail("grad_stochastic_rounding", f"stochastic rounding is only implemented for hif8, not {self.format}")
        for name in ("module_pattern", "block_pattern"):
            try:
                compiled = re.compile(getattr(self, name))
            except re.error as err:
                fail(name, f"not a valid regular expression: {err}")
            if name == "block_pattern" and compiled.groups < 1:
                fail(name, "needs one capturing group for the block index")

    @property
    def resolved_max_val(self) -> float:
        return self.max_val if self.max_val is not None else get_format(self.format).default_max_val

    def to_dict(self) -> dict:
        return asdict(self)
