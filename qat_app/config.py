"""QuantConfig: every quantization choice as one flat dataclass, so each field is a CLI flag.

It is the command line's view of the core's three frozen configs (:mod:`qat_app.hif8.recipe`):
``recipe`` (numerics), ``selection`` (which layers) and ``runtime`` (backend, saved activations,
initial switches), plus ``enabled`` (false: the matched BF16 baseline). Validation is theirs; a bad
value is reported as ``quant.<field>: ...``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional

from .errors import ConfigError
from .hif8.errors import FieldError
from .hif8.formats import get_format
from .hif8.recipe import (  # noqa: F401  (AMAX_ALGOS, STE_MODES: part of this module's interface)
    AMAX_ALGOS,
    DEFAULT_BLOCK_PATTERN,
    DEFAULT_MODULE_PATTERN,
    STE_MODES,
    HiF8Recipe,
    LayerSelection,
    RuntimeOptions,
)


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
        try:
            self.recipe, self.selection, self.runtime  # noqa: B018  (built to validate)
        except FieldError as err:
            raise as_quant_config_error(err) from None

    def _part(self, cls):
        """The core config ``cls`` with this config's values of its fields (they share the names)."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls) if f.init and hasattr(self, f.name)})

    @property
    def recipe(self) -> HiF8Recipe:
        return self._part(HiF8Recipe)

    @property
    def selection(self) -> LayerSelection:
        return self._part(LayerSelection)

    @property
    def runtime(self) -> RuntimeOptions:
        return self._part(RuntimeOptions)

    @classmethod
    def from_layer_options(cls, recipe: HiF8Recipe, runtime: RuntimeOptions) -> "QuantConfig":
        """The flat settings of a layer built with ``recipe`` and ``runtime`` (selection fields at their defaults)."""
        return cls(**asdict(recipe), **asdict(runtime))

    def layer_options(self) -> dict:
        """``recipe`` and ``runtime``: the keyword arguments of ``HiF8Linear`` / ``HiF8Linear.from_linear``."""
        return {"recipe": self.recipe, "runtime": self.runtime}

    def parts(self) -> dict:
        """``recipe``, ``selection`` and ``runtime``, as keyword arguments of ``convert_to_hif8_training``."""
        return {"recipe": self.recipe, "selection": self.selection, "runtime": self.runtime}

    @property
    def resolved_max_val(self) -> float:
        return self.max_val if self.max_val is not None else get_format(self.format).default_max_val

    def to_dict(self) -> dict:
        return asdict(self)


def as_quant_config_error(err: FieldError) -> QuantConfigError:
    """A core setting error as the command line names it: ``quant.<field>: ...``."""
    return QuantConfigError(f"quant.{err.field}{err.sep}{err.message}")


def quantize_model(model, quant: QuantConfig):
    """The core's ``convert_to_hif8_training`` with the command line's settings; its errors named ``quant.*``."""
    from .hif8.patch import convert_to_hif8_training

    try:
        return convert_to_hif8_training(model, **quant.parts())
    except FieldError as err:
        raise as_quant_config_error(err) from None
