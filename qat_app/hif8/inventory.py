"""What was quantized, and why the rest was not: the inventory of a converted model (``quantized_modules.json``).

:func:`quantization_inventory` is a pure function of a converted model and the
:class:`~qat_app.hif8.recipe.LayerSelection` it was converted with. Its JSON-ready dict holds ``format``,
``version``, ``model_class``, ``selection``, ``num_blocks``, ``quantized_blocks``, ``high_precision_blocks`` with
``high_precision_reason``, ``totals``, ``modules`` (one entry per quantized matmul, in model order: its numerics,
its quantized operands, any ``fallback`` decision) and ``excluded`` (every linear left in high precision, with
its reason). Contract: every quantized matmul is in ``modules`` and every other linear in ``excluded``.
:func:`inventory_lines` renders it in a few lines, :func:`inventory_summary` in one.

See ``docs/diagnostics/inspect.md`` for the fields and the printed summary.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Mapping

from torch import nn

from .experts import HiF8Experts, is_fused_experts
from .linear import HiF8Linear
from .patch import _is_linear, block_index, count_blocks, quantized_block_range, quantized_linears
from .operand import Operand
from .fallback_targets import unquantized_by
from .recipe import LayerSelection

INVENTORY_FILE = "quantized_modules.json"
INVENTORY_FORMAT = "qat_app/quantized-modules"
INVENTORY_VERSION = 1

# why a linear stayed in high precision
BOUNDARY = "high-precision boundary block"
NOT_MATCHED = "not matched by module_pattern"
OUTSIDE_BLOCKS = "outside the decoder blocks"
FILTERED = "excluded by the module filter (filter_fn)"
NOT_CONVERTED = "selected but not converted"
FALLBACK_LINES = 8  # fallback decisions listed one per line by inventory_lines


def _expert_weight_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The weight slice of every MoE expert projection (``...experts.gate_up.3``), by the projection's name."""
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, HiF8Experts):
            for param, projections in HiF8Experts.PARAMS:
                for e, (_, weight) in enumerate(module.projections(param)):
                    shapes[f"{name}.{projections}.{e}"] = tuple(weight.shape)
    return shapes


def _kind(name: str, block_regex: re.Pattern, expert: bool) -> str:
    """The module's name inside its block (``mlp.up_proj``; an expert's index becomes ``*``)."""
    found = block_regex.search(name + ".")
    kind = name[found.end():] if found is not None and found.end() <= len(name) else name
    return re.sub(r"\.\d+$", ".*", kind) if expert else kind


def operands_quantized(layer, switched_on: Mapping[str, bool] | None = None) -> dict[str, bool]:
    """Which operands of a quantized matmul are fake-quantized: its switches now, or ``switched_on`` (what a BF16
    warmup turns on at its end) where given; the output gradient only when the layer has a gradient scaler."""
    now = {operand.value: layer.switches[operand] for operand in Operand}
    now.update(switched_on or {})
    now[Operand.GRAD.value] = bool(now[Operand.GRAD]) and layer.grad_scaler is not None
    return {operand.value: bool(now[operand]) and not unquantized_by(layer.fallback.get(operand))
            for operand in Operand}


def _module_entry(name, layer, block, kind, shape, switched_on) -> dict:
    recipe = layer.recipe
    return {
        "name": name, "kind": kind, "block": block, "weight_shape": list(shape), "parameters": math.prod(shape),
        "format": recipe.format, "amax_algo": recipe.amax_algo, "history_len": recipe.history_len,
        "alpha": recipe.alpha if recipe.amax_algo == "exp_smooth" else None,
        "max_val": recipe.resolved_max_val, "margin": recipe.margin,
        "quantized": operands_quantized(layer, switched_on),
        "fallback": {operand: decision.as_dict() for operand, decision in layer.fallback.items()},
    }


def _exclusion(name: str, block: int | None, selection: LayerSelection, module_regex: re.Pattern,
               blocks: range | None, dense: bool) -> str:
    if selection.filter_fn is not None:
        return FILTERED
    if dense and not module_regex.search(name):
        return NOT_MATCHED
    if block is None:
        return OUTSIDE_BLOCKS
    return BOUNDARY if blocks is not None and block not in blocks else NOT_CONVERTED


def _excluded_modules(model: nn.Module, quantized_names: set[str], selection: LayerSelection,
                      block_regex: re.Pattern, module_regex: re.Pattern, boundary) -> tuple[list[dict], int]:
    """The linears (and fused experts modules) left in high precision, each with why -> (excluded, the number of
    linears in the model)."""
    excluded, linears = [], 0
    for name, module in model.named_modules():
        dense = _is_linear(module)
        linears += dense
        if (dense and name not in quantized_names) or is_fused_experts(module):
            block = block_index(name, block_regex)
            excluded.append({"name": name, "block": block,
                             "reason": _exclusion(name, block, selection, module_regex, boundary, dense)})
    return excluded, linears


def _high_precision_blocks(selection: LayerSelection, num_blocks: int, quantized_blocks: list[int],
                           boundary) -> tuple[list[int], str]:
    """The decoder blocks kept in high precision and why: those a module filter left without a quantized module,
    else the boundary blocks ``high_precision_layers`` names."""
    k = selection.high_precision_layers
    if selection.filter_fn is not None:
        high_precision = sorted(set(range(num_blocks)) - set(quantized_blocks))
        reason = ("a module filter (filter_fn) chose the modules; these blocks hold none of them "
                  "(high_precision_layers and the patterns were not used)")
    else:
        high_precision = sorted(set(range(num_blocks)) - set(boundary or range(num_blocks)))
        reason = (f"high_precision_layers={k}: the first ceil({k}/2)={math.ceil(k / 2)} and the last "
                  f"floor({k}/2)={k // 2} of {num_blocks} blocks stay in high precision")
    return high_precision, reason


def quantization_inventory(model: nn.Module, selection: LayerSelection | None = None,
                           switched_on: Mapping[str, bool] | None = None) -> dict:
    """The inventory of ``model``, converted by ``convert_to_hif8_training`` with ``selection`` (see the module doc).

    ``switched_on``: which operands the run quantizes once QAT is on (``input`` / ``weight`` / ``grad``, as a BF16
    warmup switches them); default: each layer's switches as they are now.
    """
    selection = selection or LayerSelection()
    block_regex = re.compile(selection.block_pattern)
    module_regex = re.compile(selection.module_pattern)
    num_blocks = count_blocks(model, selection.block_pattern)
    uses_filter = selection.filter_fn is not None
    k = selection.high_precision_layers
    boundary = None if uses_filter or k > num_blocks else quantized_block_range(num_blocks, k)

    expert_shapes = _expert_weight_shapes(model)
    modules = []
    for name, layer in quantized_linears(model):
        block = block_index(name, block_regex)
        dense = isinstance(layer, HiF8Linear)
        shape = tuple(layer.weight.shape) if dense else expert_shapes[name]
        modules.append(_module_entry(name, layer, block, _kind(name, block_regex, not dense), shape, switched_on))
    quantized_names = {m["name"] for m in modules}

    excluded, linears = _excluded_modules(model, quantized_names, selection, block_regex, module_regex, boundary)

    quantized_blocks = sorted({m["block"] for m in modules if m["block"] is not None})
    high_precision, reason = _high_precision_blocks(selection, num_blocks, quantized_blocks, boundary)
    filter_name = getattr(selection.filter_fn, "__qualname__", repr(selection.filter_fn)) if uses_filter else None
    return {
        "format": INVENTORY_FORMAT,
        "version": INVENTORY_VERSION,
        "model_class": type(model).__name__,
        "selection": {"module_pattern": selection.module_pattern, "block_pattern": selection.block_pattern,
                      "high_precision_layers": k, "filter_fn": filter_name},
        "num_blocks": num_blocks,
        "quantized_blocks": quantized_blocks,
        "high_precision_blocks": high_precision,
        "high_precision_reason": reason,
        "totals": {
            "quantized_modules": len(modules),
            "quantized_linears": sum(isinstance(layer, HiF8Linear) for _, layer in quantized_linears(model)),
            "quantized_parameters": sum(m["parameters"] for m in modules),
            "linears": linears,
        },
        "modules": modules,
        "excluded": excluded,
    }


def block_ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 24, 25] -> ``"0-2, 24-25"``; ``"none"`` for no block."""
    spans: list[list[int]] = []
    for b in sorted(blocks):
        if spans and b == spans[-1][1] + 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans) or "none"


def inventory_summary(inventory: dict) -> str:
    """One line: how many matmuls, where, how many parameters, which blocks stayed in high precision."""
    totals = inventory["totals"]
    return (f"{totals['quantized_modules']} quantized modules in blocks {block_ranges(inventory['quantized_blocks'])} "
            f"of {inventory['num_blocks']} ({totals['quantized_parameters'] / 1e6:.1f}M parameters); high precision: "
            f"blocks {block_ranges(inventory['high_precision_blocks'])}")


def _numerics(modules: list[dict]) -> str:
    described = Counter()
    for m in modules:
        estimator = m["amax_algo"] + (f" alpha={m['alpha']:g}" if m["alpha"] is not None else "")
        operands = "+".join(op for op in Operand if m["quantized"][op]) or "nothing"
        described[f"{m['format']}, {estimator} H={m['history_len']}, max_val {m['max_val']:g}, quantized {operands}"] += 1
    return "; ".join(text if len(described) == 1 else f"{text} ({n})" for text, n in described.items())


def inventory_lines(inventory: dict) -> list[str]:
    """A few lines: consecutive blocks with the same module kinds as one row, the high-precision blocks and why,
    what else was left out (by reason), the numerics and the totals."""
    modules, totals = inventory["modules"], inventory["totals"]
    lines = [f"HiF8 W8A8: {totals['quantized_modules']} quantized modules ({totals['quantized_linears']} of "
             f"{totals['linears']} linears), {totals['quantized_parameters']:,} parameters"]
    kinds: dict[int | None, list[str]] = {}
    for m in modules:
        kinds.setdefault(m["block"], [])
        if m["kind"] not in kinds[m["block"]]:
            kinds[m["block"]].append(m["kind"])
    rows: list[tuple[list[int], list[str]]] = []
    for block in sorted(b for b in kinds if b is not None):
        if rows and rows[-1][1] == kinds[block] and rows[-1][0][-1] == block - 1:
            rows[-1][0].append(block)
        else:
            rows.append(([block], kinds[block]))
    for blocks, block_kinds in rows:
        per_block = sum(1 for m in modules if m["block"] == blocks[0])
        lines.append(f"  blocks {block_ranges(blocks):<10} {', '.join(block_kinds)} ({per_block} per block)")
    if None in kinds:
        lines.append(f"  outside blocks    {', '.join(kinds[None])}")
    lines.append(f"  high precision    blocks {block_ranges(inventory['high_precision_blocks'])} "
                 f"({inventory['high_precision_reason']})")
    reasons = Counter(e["reason"] for e in inventory["excluded"])
    if reasons:
        lines.append("  left out          " + ", ".join(f"{n} ({reason})" for reason, n in reasons.items()))
    if modules:
        lines.append(f"  numerics          {_numerics(modules)}")
    fell_back = [(m["name"], operand, record) for m in modules for operand, record in m.get("fallback", {}).items()]
    for name, operand, record in fell_back[:FALLBACK_LINES]:
        lines.append(f"  fell back         {name}.{operand} -> {record['target']} at step {record.get('step')} "
                     f"({record.get('reason')})")
    if len(fell_back) > FALLBACK_LINES:
        lines.append(f"  fell back         ... {len(fell_back) - FALLBACK_LINES} more (the modules' fallback entries)")
    return lines
