"""The operands of a quantized matmul: a role (:class:`Operand`) and what one forward does with it (:class:`OperandPlan`).

A W8A8 matmul quantizes up to three tensors, each with its own per-tensor scaler: its ``input`` (the activations),
its ``weight`` and, with ``quantize_grads``, the output gradient (``grad``). The role is declared here once: the
scaler's attribute (``input_scaler``: the checkpoint's key), its switch's key in the checkpoint's extra state
(``quantize_activations``; the matmul itself keys its switches by the role), the name the logs give its tensor (``layers.7.mlp.up_proj.input``) and how that name is read back. Everything else
(health, the dashboard, the inventory, the fallback, the export) takes the role, never a parsed name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scaling import AmaxScaler


class Operand(StrEnum):
    """An operand's role; its value is the name the logs, summaries and fallback records give it."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD = "grad"

    @property
    def scaler_name(self) -> str:
        """The matmul's attribute holding this operand's scaler (the checkpoint's key)."""
        return f"{self.value}_scaler"

    @property
    def switch_name(self) -> str:
        """The key of this operand's switch in a matmul's extra state (the checkpoint's; earlier checkpoints hold it)."""
        return _SWITCHES[self]

    def tensor_name(self, layer: str) -> str:
        """The name of this operand's tensor of ``layer``: ``layers.7.mlp.up_proj.input``."""
        return f"{layer}.{self.value}"

    @staticmethod
    def of_tensor(name: str) -> tuple[str, "Operand | None"]:
        """``(layer, operand)`` of a tensor name made by :meth:`tensor_name` (operand None: not such a name); the one
        place a name is read back, for files written before (a report reads names, not modules)."""
        layer, _, last = name.rpartition(".")
        return (layer, Operand(last)) if last in _BY_VALUE else (name, None)


_SWITCHES = {Operand.INPUT: "quantize_activations", Operand.WEIGHT: "quantize_weights", Operand.GRAD: "quantize_grads"}
_BY_VALUE = {operand.value for operand in Operand}
# the scalers' attributes in registration (and state-dict) order
SCALER_NAMES = tuple(operand.scaler_name for operand in Operand)


@dataclass(frozen=True)
class OperandPlan:
    """What one forward does with one operand: its scaler (None: the matmul has none for it), whether it is
    quantized (its switch, and no fallback to high precision) and its grid's ``max_val``."""

    scaler: "AmaxScaler | None"
    on: bool
    max_val: float | None
