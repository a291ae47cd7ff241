"""The report's what-if and numeric-health figures (numbers from :mod:`.health`): cumulative what-if clipping per
estimator, the SQNR heat map (tensor x logged step) and the precision-tier fractions per tensor kind.

One panel (or row of panels) per QAT run; a run without the data says so in its panel. Colours are fixed per
estimator and per tier across every panel and figure.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from ..hif8.estimators import ESTIMATORS
from ..hif8.health import TIERS
from .figures import _grid, _plt, _save, _step_matrix, _step_ticks, _warmup_line
from .health import (REAL_CLIPPED, TIER_FIGURES, WHATIF_CAVEAT, cumulative, estimator_used, health_column,
                     health_tensors_in_csv, module_kind, tensor_order, whatif_column)
from .runs import Run, warmup_switch_step

HEALTH_FIGURES = ("whatif_clipped.png", "sqnr_heatmap.png", "precision_tiers.png")
# colour and line style per estimator: overlapping lines (equal counts) stay distinguishable
ESTIMATOR_STYLE = {estimator.name: estimator.style for estimator in ESTIMATORS}
# most precise (dark blue) to least (orange), zeros grey
TIER_COLORS = dict(zip(TIERS, ("#08519c", "#4292c6", "#9ecae1", "#fd8d3c", "#bdbdbd")))
SQNR_CMAP = "RdYlGn"  # red: low SQNR (imprecise), green: high
NOT_LOGGED_COLOR = "#e6e6e6"
LABEL_EVERY_ROW = 80  # up to this many tensors every heat-map row is named; beyond, the blocks are


def _empty(ax, text: str, width: int = 70) -> None:
    ax.text(0.5, 0.5, textwrap.fill(text, width), ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


# ----------------------------------------------------------------------------------------------- what-if
def plot_whatif(path: Path, qats: list[Run], whatifs: list[dict]) -> dict:
    """Per QAT run (``whatifs``: its :func:`.health.whatif_stats`): the cumulative clipped elements of every
    estimator over the steps, what the run really clipped as a wide grey line (the run's own estimator lies on it);
    symmetric-log y once a count passes 10."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, axes = _grid(plt, len(qats), 7.0, 4.2)
    lines, drawn = set(), []
    for ax, run, stats in zip(axes.flat, qats, whatifs):
        used = estimator_used(run)
        trained_with = f" (trained with {used})" if used else ""
        ax.set_title(f"{run.label}: cumulative clipped elements per estimator{trained_with}", fontsize=10)
        if not stats["recorded"]:
            _empty(ax, f"{run.label}: what-if {stats['note']}")
            continue
        per_step = {algo: run.series(whatif_column(algo, "clipped")) for algo in stats["estimators"]}
        if not any(per_step.values()):
            _empty(ax, f"{run.label}: what-if totals only in its summary (no per-step whatif/* columns)")
            continue
        real = cumulative(run.series(REAL_CLIPPED))
        if real:
            ax.plot(list(real), list(real.values()), color="black", lw=3.5, alpha=0.25,
                    label=f"real (what the run clipped): {stats['real']['clipped']:,} clipped, "
                          f"{stats['real']['events']:,} events")
        top = max(real.values(), default=0.0)
        for algo, series in per_step.items():
            if not series:
                continue
            color, style = ESTIMATOR_STYLE[algo]
            totals = cumulative(series)
            counts = stats["estimators"][algo]
            ax.plot(list(totals), list(totals.values()), color=color, ls=style, lw=1.6,
                    marker="o" if len(totals) <= 20 else None, ms=3,
                    label=f"{algo}{' (used)' if algo == used else ''}: {counts['clipped']:,} clipped, "
                          f"{counts['events']:,} events")
            top = max(top, max(totals.values()))
        if top > 10:  # counts spread over decades; symlog keeps the zeros of a clean start
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=0)
        switch = warmup_switch_step(run)
        if switch is not None:
            _warmup_line(ax, switch, switch, run)
            lines.add(switch)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("clipped elements, cumulative" + (" (symlog)" if top > 10 else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)  # the curves rise early and stay high
        drawn.append(run.label)
    if not qats:
        _empty(axes[0][0], "no QAT run")
    caveat = f"What-if clipping of the amax estimators ({WHATIF_CAVEAT})"
    fig.suptitle(textwrap.fill(caveat, 110 if len(qats) > 1 else 90), fontsize=9)
    _save(fig, plt, path)
    return {"runs": drawn, "warmup_lines": sorted(lines)}


# ----------------------------------------------------------------------------------------------- SQNR heat map
def sqnr_matrix(run: Run):
    """(tensors in block / module / operand order, logged steps, [tensor, step] SQNR dB with NaN where not logged)."""
    import numpy as np

    tensors = tensor_order(run, [t for t in health_tensors_in_csv(run) if health_column(t, "sqnr_db") in run.columns])
    steps, matrix = _step_matrix({t: run.series(health_column(t, "sqnr_db")) for t in tensors})
    matrix[~np.isfinite(matrix)] = np.nan
    return tensors, steps, matrix


def _label_rows(ax, run: Run, tensors: list[str]) -> None:
    """Every row by its tensor name; with many rows, the first row of each block by its block. Lines between blocks."""
    blocks = [module_kind(run, t)[0] for t in tensors]
    starts = [i for i, b in enumerate(blocks) if i == 0 or b != blocks[i - 1]]
    for i in starts[1:]:
        ax.axhline(i - 0.5, color="black", lw=0.6)
    if len(tensors) <= LABEL_EVERY_ROW:
        ax.set_yticks(range(len(tensors)))
        ax.set_yticklabels(tensors, fontsize=6)
    else:
        ax.set_yticks(starts)
        ax.set_yticklabels([f"block {blocks[i]}" if blocks[i] is not None else "other" for i in starts], fontsize=6)


def plot_sqnr_heatmap(path: Path, qats: list[Run], healths: list[dict]) -> dict:
    """SQNR (dB) per quantized tensor (rows by block, module, operand) and logged step, one panel per QAT run, one
    colour scale for all (red: imprecise); grey: not logged; a black square on each run's worst cell."""
    import numpy as np

    plt = _plt()
    panels = [(run, *sqnr_matrix(run)) for run in qats]
    notes = {run.label: health.get("note") for run, health in zip(qats, healths)}
    finite = np.concatenate([m[np.isfinite(m)] for *_, m in panels] or [np.array([])])
    low, high = (math.floor(finite.min()), math.ceil(finite.max())) if finite.size else (0, 1)
    high = max(high, low + 1)

    def rows_height(n: int) -> float:
        return 1.6 + (0.13 * n if n <= LABEL_EVERY_ROW else min(0.05 * n, 14.0))

    heights = [rows_height(len(tensors)) for _, tensors, _, _ in panels] or [3.0]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    cmap = plt.get_cmap(SQNR_CMAP).with_extremes(bad=NOT_LOGGED_COLOR)
    worst_cells, lines = {}, set()
    for ax, (run, tensors, steps, matrix) in zip(axes[:, 0], panels):
        if not np.isfinite(matrix).any():
            note = notes[run.label] or "no finite SQNR logged"
            _empty(ax, f"{run.label}: SQNR per tensor {note}")
            ax.set_title(f"{run.label}: SQNR per quantized tensor", fontsize=10)
            continue
        im = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest", cmap=cmap, vmin=low,
                       vmax=high, extent=(-0.5, len(steps) - 0.5, len(tensors) - 0.5, -0.5))
        i, j = np.unravel_index(np.nanargmin(matrix), matrix.shape)
        ax.plot(j, i, "s", ms=7, mfc="none", mec="black", mew=1.5)
        worst_cells[run.label] = {"tensor": tensors[i], "step": steps[j], "sqnr_db": float(matrix[i, j])}
        _step_ticks(ax, steps)
        _label_rows(ax, run, tensors)
        switch = warmup_switch_step(run)
        before = [k for k, s in enumerate(steps) if s < switch] if switch is not None else []
        if before:  # health is measured on quantized steps only; a line only where logged steps precede the switch
            _warmup_line(ax, before[-1] + 0.5, switch, run, color="tab:blue")
            lines.add(switch)
        ax.set_xlabel("logged optimizer step")
        ax.set_ylabel("quantized tensor (by block)")
        ax.set_title(f"{run.label}: SQNR per quantized tensor ({len(tensors)} tensors x {len(steps)} logged steps)\n"
                     f"worst (black square): {matrix[i, j]:.1f} dB, {tensors[i]} at step {steps[j]}", fontsize=10)
        fig.colorbar(im, ax=ax, label="SQNR (dB), higher = more precise", pad=0.01)
    if not panels:
        _empty(axes[0][0], "no QAT run")
    _save(fig, plt, path)
    return {"worst": worst_cells, "sqnr_range_db": [low, high] if finite.size else None, "warmup_lines": sorted(lines)}


# ----------------------------------------------------------------------------------------------- tiers
def tier_fractions(run: Run, stats: dict) -> dict[str, dict[str, float]]:
    """tensor kind (``mlp.down_proj.input``) -> tier -> the mean over its blocks of the fraction at each tensor's
    last logged step (``stats``: the run's :func:`.health.health_stats`); kinds in block / module / operand order."""
    if not stats["recorded"]:
        return {}
    last = {t["tensor"]: t["last"] for t in stats["tensors"] if t["last"]}
    groups: dict[str, list[dict]] = {}
    for tensor in tensor_order(run, list(last)):
        groups.setdefault(module_kind(run, tensor)[1], []).append(last[tensor])
    out = {}
    for kind, figures in groups.items():
        means = {}
        for tier, figure in zip(TIERS, TIER_FIGURES):
            values = [f[figure] for f in figures if isinstance(f.get(figure), (int, float)) and math.isfinite(f[figure])]
            means[tier] = sum(values) / len(values) if values else 0.0
        out[kind] = means
    return out


def _stacked(ax, kinds: list[str], fractions: dict[str, dict[str, float]], tiers: list[str]) -> None:
    """Horizontal bars, one per tensor kind, of these tiers' shares in %, stacked in the order given."""
    left = [0.0] * len(kinds)
    for tier in tiers:
        widths = [100 * fractions[k][tier] for k in kinds]
        ax.barh(range(len(kinds)), widths, left=left, color=TIER_COLORS[tier], label=tier, edgecolor="white", lw=0.4)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(kinds, fontsize=7)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)


def plot_tiers(path: Path, qats: list[Run], healths: list[dict]) -> dict:
    """Per QAT run, per tensor kind: the tier fractions stacked to 100 %, and beside them the tiers below the
    dominant one on their own scale (a 2 % mant2 share is invisible next to 98 % mant3)."""
    plt = _plt()
    tables = [(run, tier_fractions(run, health), health) for run, health in zip(qats, healths)]
    heights = [1.6 + 0.32 * max(1, len(fractions)) for _, fractions, _ in tables] or [3.0]
    fig, axes = plt.subplots(len(heights), 2, figsize=(13, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights, "width_ratios": [1.2, 1]})
    shown = {}
    for (ax_all, ax_rest), (run, fractions, health) in zip(axes, tables):
        if not fractions:
            _empty(ax_all, f"{run.label}: precision tiers {health.get('note') or 'not logged'}")
            ax_all.set_title(f"{run.label}: precision tiers", fontsize=10)
            ax_rest.set_visible(False)
            continue
        kinds = list(fractions)
        dominant = max(TIERS, key=lambda tier: sum(f[tier] for f in fractions.values()))
        rest = [tier for tier in TIERS if tier != dominant]
        _stacked(ax_all, kinds, fractions, list(TIERS))
        for row, kind in enumerate(kinds):  # the dominant tier's share, inside its bar
            ax_all.text(1, row, f"{dominant} {100 * fractions[kind][dominant]:.1f} %", va="center", fontsize=7,
                        color="white" if dominant != "zero" else "black")
        ax_all.set_xlim(0, 100)
        ax_all.set_xlabel("% of elements (mean over blocks)")
        ax_all.set_title(f"{run.label}: precision tiers at the last logged step, per tensor kind", fontsize=10)
        _stacked(ax_rest, kinds, fractions, rest)
        below = [100 * sum(fractions[kind][t] for t in rest) for kind in kinds]
        for row, total in enumerate(below):
            ax_rest.text(total, row, f" {total:.2g} %", va="center", fontsize=7)
        ax_rest.set_xlim(0, max(below + [1e-3]) * 1.15)
        ax_rest.set_xlabel("% of elements")
        ax_rest.set_title(f"{run.label}: zoom on the tiers below {dominant}", fontsize=10)
        if not any(fractions[k][t] for k in kinds for t in rest):
            ax_rest.text(0.5, 0.5, f"every element in {dominant}", ha="center", va="center", transform=ax_rest.transAxes)
        shown[run.label] = fractions
    if not tables:
        _empty(axes[0][0], "no QAT run")
        axes[0][1].set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=TIER_COLORS[tier]) for tier in TIERS]
    fig.legend(handles, TIERS, loc="lower center", ncol=len(TIERS), fontsize=8, frameon=False,
               title="tier: mantissa bits of the quantized value (HiF8: mant3 |e| ≤ 3, mant2 4..7, mant1 8..15)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.55 / sum(heights), 1, 1))  # 0.55 in for the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"fractions": shown}
