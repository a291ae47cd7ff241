"""Model patching: swap the selected linears of an HF decoder for HiF8Linear, and back.

Selection (the paper's layout by default): modules whose full name matches ``module_pattern``
(MLP gate/up/down projections, Phi-3's fused gate_up_proj, and their GPT-2/OPT/Phi/NeoX/Falcon
equivalents; see :data:`~qat_app.hif8.recipe.DEFAULT_MODULE_PATTERN`), inside decoder blocks found
by ``block_pattern``, except the ``high_precision_layers`` boundary blocks: the first ceil(k/2)
and the last floor(k/2) stay in high precision. Attention, embeddings, norms, lm_head and MoE
routers are never touched by the default pattern. :func:`dequantize_model` gives every layer back
as the class it was (nn.Linear, a subclass such as Falcon's ``FalconLinear``, or GPT-2's Conv1D).
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn

from .errors import SelectionError
from .experts import HiF8Experts, QuantizedProjection, is_fused_experts
from .linear import HiF8Linear
from .operand import Operand
from .recipe import HiF8Recipe, LayerSelection, RuntimeOptions


@dataclass
class QuantReport:
    num_blocks: int
    quantized_blocks: list[int]
    modules: list[str] = field(default_factory=list)
    num_params: int = 0

    @property
    def num_linears(self) -> int:
        return len(self.modules)

    def summary(self) -> str:
        blocks = self.quantized_blocks
        span = f"blocks {blocks[0]}-{blocks[-1]}" if blocks else "no blocks"
        return (
            f"HiF8 W8A8: {self.num_linears} linears in {span} of {self.num_blocks} "
            f"({self.num_params / 1e6:.1f}M parameters quantized)"
        )


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def count_blocks(model: nn.Module, block_pattern: str) -> int:
    config = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    regex = re.compile(block_pattern)
    indices = [int(m.group(1)) for name, _ in model.named_modules() if (m := regex.search(name + "."))]
    return max(indices) + 1 if indices else 0


def block_index(name: str, block_regex: re.Pattern) -> int | None:
    """The decoder-block index in a module's full name (``model.layers.7.mlp.up_proj`` -> 7), None outside the blocks."""
    found = block_regex.search(name + ".")
    return int(found.group(1)) if found is not None else None


def quantized_block_range(num_blocks: int, high_precision_layers: int) -> range:
    """Blocks that get quantized: all but the first ceil(k/2) and the last floor(k/2)."""
    if high_precision_layers > num_blocks:
        raise SelectionError(
            "high_precision_layers", f"{high_precision_layers} is larger than the model's {num_blocks} blocks"
        )
    first = math.ceil(high_precision_layers / 2)
    last = num_blocks - high_precision_layers // 2
    return range(first, last)


class SelectedModules(NamedTuple):
    """What a :class:`LayerSelection` picks out of a model."""

    modules: list[tuple[str, nn.Module]]  # the (name, linear) pairs to quantize
    num_blocks: int
    blocks: range  # the quantized block range


def select_modules(model: nn.Module, selection: LayerSelection) -> SelectedModules:
    """The linears ``selection`` quantizes in ``model``, its number of blocks and the quantized block range."""
    block_regex = re.compile(selection.block_pattern)
    num_blocks = count_blocks(model, selection.block_pattern)
    if selection.filter_fn is not None:
        chosen = [(name, m) for name, m in model.named_modules() if _is_linear(m) and selection.filter_fn(m, name)]
        return SelectedModules(chosen, num_blocks, range(num_blocks))
    module_regex = re.compile(selection.module_pattern)
    blocks = quantized_block_range(num_blocks, selection.high_precision_layers)
    matched, selected = [], []
    for name, module in model.named_modules():
        if not (_is_linear(module) and module_regex.search(name)):
            continue
        matched.append(name)
        block = block_regex.search(name)
        if block is not None and int(block.group(1)) in blocks:
            selected.append((name, module))
    if not matched:
        linears = [n for n, m in model.named_modules() if _is_linear(m)][:8]
        raise SelectionError(
            "module_pattern", f"{selection.module_pattern!r} matches no linear layer of {type(model).__name__}; "
            f"linear layers look like: {linears}", sep=" ",
        )
    return SelectedModules(selected, num_blocks, blocks)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def convert_to_hif8_training(
    model: nn.Module,
    recipe: HiF8Recipe | None = None,
    selection: LayerSelection | None = None,
    runtime: RuntimeOptions | None = None,
) -> QuantReport:
    """Swap the selected linears for HiF8Linear, and the fused MoE experts modules of the same blocks for
    HiF8Experts, in place (parameters are shared, not copied).

    Defaults: the paper's recipe (``max`` window of 64 steps, HiF8, max_val 15) on the MLP projections of
    all but the 5 boundary blocks. Afterwards call :func:`qat_app.hif8.training.sync_and_advance` once
    per optimizer step (and :func:`~qat_app.hif8.training.end_warmup` at the end of a BF16 warmup).
    """
    recipe, selection, runtime = recipe or HiF8Recipe(), selection or LayerSelection(), runtime or RuntimeOptions()
    if any(isinstance(m, (HiF8Linear, HiF8Experts)) for m in model.modules()):
        raise ValueError("model is already quantized; call dequantize_model first")
    experts = [(name, m) for name, m in model.named_modules() if is_fused_experts(m)]
    try:
        selected, num_blocks, blocks = select_modules(model, selection)
    except SelectionError:
        if not experts or selection.filter_fn is not None:
            raise
        selected, num_blocks = [], count_blocks(model, selection.block_pattern)  # an MoE model: experts only
        blocks = quantized_block_range(num_blocks, selection.high_precision_layers)
    block_regex = re.compile(selection.block_pattern)

    def block_of(name: str) -> int | None:
        return block_index(name, block_regex)

    if selection.filter_fn is not None:
        experts = [(name, m) for name, m in experts if selection.filter_fn(m, name)]
    else:
        experts = [(name, m) for name, m in experts if block_of(name) in blocks]
    report = QuantReport(num_blocks=num_blocks, quantized_blocks=[])
    for name, module in selected:
        _set_submodule(model, name, HiF8Linear.from_linear(module, recipe, runtime))
        report.modules.append(name)
        report.num_params += module.weight.numel()
    for name, module in experts:
        _set_submodule(model, name, HiF8Experts(module, recipe, runtime))
        report.modules.append(name)
        report.num_params += module.gate_up_proj.numel() + module.down_proj.numel()
    report.quantized_blocks = sorted({b for b in map(block_of, report.modules) if b is not None})
    return report


def dequantize_model(model: nn.Module) -> int:
    """Replace every HiF8Linear by its plain module (its original class) with the same weights; returns how many."""
    names = [name for name, m in model.named_modules() if isinstance(m, (HiF8Linear, HiF8Experts))]
    for name in names:
        _set_submodule(model, name, model.get_submodule(name).to_float())
    return len(names)


def quantized_linears(model: nn.Module) -> list[tuple[str, HiF8Linear | QuantizedProjection]]:
    """Every quantized matmul by name: the HiF8Linear layers and each MoE expert's projections
    (``...mlp.experts.gate_up.3``); all have the same scalers, switches and weight cache."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (HiF8Linear, QuantizedProjection))]


def set_quantization(
    model: nn.Module, *, weights: bool | None = None, activations: bool | None = None, grads: bool | None = None
) -> None:
    """Switch weight / activation / output-gradient fake quantization of every HiF8Linear.

    Observers keep recording either way; ``grads`` only applies to layers built with a gradient scaler.
    """
    for _, module in quantized_linears(model):
        for operand, on in ((Operand.GRAD, grads), (Operand.WEIGHT, weights), (Operand.INPUT, activations)):
            if on is not None:
                module.switch(operand, on)


@contextmanager
def quantization_off(model: nn.Module):
    """``model`` with weight, activation and gradient quantization off in every quantized layer (its master weights
    in high precision: the model as if never quantized); each layer's switches are restored on exit. Fallback
    decisions are untouched (they only choose a scaler)."""
    layers = [layer for _, layer in quantized_linears(model)]
    switches = [dict(layer.switches) for layer in layers]  # as set: a fallback's record is not a switch
    set_quantization(model, weights=False, activations=False, grads=False)
    try:
        yield model
    finally:
        for layer, switched in zip(layers, switches):
            layer.switches = switched
