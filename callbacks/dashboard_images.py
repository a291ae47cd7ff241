"""The dashboard's pictures: a per-tensor figure as a block x operand heatmap, one per logging step, so a person sees
which block and which operand at a glance (TensorBoard's Images tab) where a chart of 150 lines shows nothing."""

from __future__ import annotations

import math
import re

import numpy as np
from matplotlib.figure import Figure

# the pictures: (image tag, the per-tensor figure it shows: a StepRecord method, colour map, best at the high end)
HEATMAPS = (("dashboard/sqnr_db", "sqnr_db", "viridis", True),
            ("dashboard/clipped_frac", "clipped_frac", "magma_r", False))


def block_grid(values: dict[str, float], block_pattern: str) -> tuple[list[int], list[str], np.ndarray]:
    """Per-tensor ``values`` (``layers.7.mlp.up_proj.input`` -> value) as (blocks, columns, matrix [blocks,
    columns]): the block index from ``block_pattern``'s group, the column the name after the block; NaN where a
    block has no such tensor. Tensors outside any block are left out."""
    pattern = re.compile(block_pattern)
    cells: dict[tuple[int, str], float] = {}
    for name, value in values.items():
        match = pattern.search(name)
        if match is None:
            continue
        cells[(int(match.group(1)), name[match.end():].lstrip("."))] = value
    blocks = sorted({b for b, _ in cells})
    columns = sorted({c for _, c in cells})
    matrix = np.full((len(blocks), len(columns)), np.nan)
    for (block, column), value in cells.items():
        matrix[blocks.index(block), columns.index(column)] = value
    return blocks, columns, matrix


def heatmap(title: str, blocks: list[int], columns: list[str], matrix: np.ndarray, cmap: str) -> Figure:
    """The figure: blocks down, operands across, each cell's value written in it."""
    figure = Figure(figsize=(1.2 + 1.1 * len(columns), 1.0 + 0.28 * len(blocks)), dpi=80)
    axes = figure.add_subplot()
    finite = matrix[np.isfinite(matrix)]
    image = axes.imshow(np.ma.masked_invalid(matrix), aspect="auto", cmap=cmap,
                        vmin=finite.min() if finite.size else None, vmax=finite.max() if finite.size else None)
    axes.set_xticks(range(len(columns)), [c.replace("mlp.", "").replace("_proj", "") for c in columns],
                    rotation=30, ha="right", fontsize=8)
    axes.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize=7)
    axes.set_ylabel("block")
    axes.set_title(title, fontsize=9)
    for (row, column), value in np.ndenumerate(matrix):
        if math.isfinite(value):
            axes.text(column, row, f"{value:.3g}", ha="center", va="center", fontsize=6, color="white")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    return figure
