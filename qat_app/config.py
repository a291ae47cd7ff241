"""QuantConfig: the command line's flat view of the core's frozen configs, derived from them, not re-declared.

The settings are declared once, in :mod:`qat_app.hif8.recipe`: :class:`HiF8Recipe` (numerics),
:class:`LayerSelection` (which layers) and :class:`RuntimeOptions` (backend, saved activations, initial
switches). ``QuantConfig`` is built from their fields -- names, types, defaults and the ``Attributes:``
documentation that jsonargparse shows as ``--help`` -- plus ``enabled`` (false: the matched BF16 baseline),
so every core field is a flag ``--model.quant.<field>`` and a field added to the core is one at once.
Validation is the core's; a bad value is reported as ``quant.<field>: ...``.

Checkpoints and exports store the settings as a plain dictionary (:meth:`QuantConfig.to_dict`), so no class
of ours is pickled; checkpoints of earlier versions, which pickled an earlier hand-written ``QuantConfig``, still
load: the class keeps its import path and fields.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, Iterator

import docstring_parser

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

QUANT_PARTS = {"recipe": HiF8Recipe, "selection": LayerSelection, "runtime": RuntimeOptions}
# core fields that are Python objects, not values a config file can hold: set from code, with the reason
CODE_ONLY_FIELDS = {
    "filter_fn": "a Python callable; from code pass LayerSelection(filter_fn=...) to convert_to_hif8_training",
}
ENABLED_DOC = "False gives the matched BF16 baseline (no module is swapped)."


class QuantConfigError(ConfigError):
    """A quantization setting is invalid; the message names the field and the allowed values."""


@dataclasses.dataclass(frozen=True)
class CoreField:
    """One field of a core config as the command line sees it."""

    part: type
    name: str
    type: Any
    default: Any
    doc: str


def core_fields() -> Iterator[CoreField]:
    """Every settable field of the core's configs, in declaration order (recipe, selection, runtime)."""
    seen: set[str] = set()
    for part in QUANT_PARTS.values():
        hints = typing.get_type_hints(part)
        docs = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(part.__doc__).params}
        for f in dataclasses.fields(part):
            if not f.init or f.name in CODE_ONLY_FIELDS:
                continue
            if f.name in seen or f.name == "enabled":
                raise TypeError(f"{part.__name__}.{f.name}: a field of that name is declared twice in the core")
            seen.add(f.name)
            yield CoreField(part, f.name, hints[f.name], f.default, docs.get(f.name, ""))


@dataclasses.dataclass
class _QuantConfigBase:
    """The behaviour of :class:`QuantConfig`; its fields are generated from the core (see the module doc).

    A dataclass without fields: jsonargparse expands a dataclass into flags only when every class of its MRO is one.
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            self.parts()  # built to validate
        except FieldError as err:
            raise as_quant_config_error(err) from None

    def _part(self, cls):
        """The core config ``cls`` with this config's values of its fields (they share the names)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)
                      if f.init and f.name not in CODE_ONLY_FIELDS})

    @property
    def recipe(self) -> HiF8Recipe:
        return self._part(HiF8Recipe)

    @property
    def selection(self) -> LayerSelection:
        return self._part(LayerSelection)

    @property
    def runtime(self) -> RuntimeOptions:
        return self._part(RuntimeOptions)

    def parts(self) -> dict:
        """``recipe``, ``selection`` and ``runtime``, as keyword arguments of ``convert_to_hif8_training``."""
        return {name: self._part(cls) for name, cls in QUANT_PARTS.items()}

    def layer_options(self) -> dict:
        """``recipe`` and ``runtime``: the keyword arguments of ``HiF8Linear`` / ``HiF8Linear.from_linear``."""
        return {"recipe": self.recipe, "runtime": self.runtime}

    @classmethod
    def from_layer_options(cls, recipe: HiF8Recipe, runtime: RuntimeOptions):
        """The flat settings of a layer built with ``recipe`` and ``runtime`` (selection fields at their defaults)."""
        return cls(**dataclasses.asdict(recipe), **dataclasses.asdict(runtime))

    @classmethod
    def coerce(cls, value):
        """A ``QuantConfig`` from what a caller holds: one already, a checkpoint's or an export's plain dict, or
        an object of an older ``QuantConfig`` (old checkpoints pickled it). A key the core does not know is
        refused by name; a field the source lacks takes the core's default."""
        return coerce_settings(cls, value, "quant", "quantization", QuantConfigError)

    @property
    def resolved_max_val(self) -> float:
        return self.max_val if self.max_val is not None else get_format(self.format).default_max_val

    def to_dict(self) -> dict:
        """Plain values only (what checkpoints, exports and loggers store)."""
        return dataclasses.asdict(self)


def coerce_settings(cls, value, section: str, noun: str, error: type[ConfigError] = ConfigError):
    """A settings dataclass ``cls`` from what a caller holds: one already, a plain dict (a checkpoint's
    hyper-parameters), an object with those attributes, or None (the defaults). A key ``cls`` does not know is
    refused by name (``<section>.<key>: not a <noun> setting``)."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    items = dict(value) if isinstance(value, Mapping) else dict(vars(value))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(items) - known)
    if unknown:
        raise error(f"{section}.{unknown[0]}: not a {noun} setting; known: {', '.join(sorted(known))}")
    return cls(**items)


def _docstring() -> str:
    lines = ["HiF8 W8A8 fake-quantization settings (the fields of the core's HiF8Recipe, LayerSelection and "
             "RuntimeOptions).", "", "Attributes:", f"    enabled: {ENABLED_DOC}"]
    lines += [f"    {f.name}: {f.doc}" for f in core_fields()]
    return "\n".join(lines)


def _build_quant_config() -> type:
    specs = [("enabled", bool, dataclasses.field(default=True))]
    specs += [(f.name, f.type, dataclasses.field(default=f.default)) for f in core_fields()]
    cls = dataclasses.make_dataclass("QuantConfig", specs, bases=(_QuantConfigBase,))
    # pickling (old checkpoints) and jsonargparse's class paths find it here, as before
    cls.__module__, cls.__qualname__, cls.__doc__ = __name__, "QuantConfig", _docstring()
    return cls


QuantConfig = _build_quant_config()


def as_quant_config_error(err: FieldError) -> QuantConfigError:
    """A core setting error as the command line names it: ``quant.<field>: ...``."""
    return QuantConfigError(f"quant.{err.field}{err.sep}{err.message}")


def quantize_model(model, quant):
    """The core's ``convert_to_hif8_training`` with the command line's settings; its errors named ``quant.*``."""
    from .hif8.patch import convert_to_hif8_training

    try:
        return convert_to_hif8_training(model, **QuantConfig.coerce(quant).parts())
    except FieldError as err:
        raise as_quant_config_error(err) from None
