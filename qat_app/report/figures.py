"""The report's figures: loss curves with the APE, a_hat vs true amax, the clipped-fraction heat map."""

from __future__ import annotations

import math
import re
from pathlib import Path

from .runs import ReportError, Run, natural_key, precision_name, warmup_switch_step


FIGURES = ("loss_curves.png", "amax_vs_ahat.png", "saturation_heatmap.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _grid(plt, n: int, width: float, height: float):
    """Panels for ``n`` plots (at least one), two a row from two on; the unused ones hidden."""
    cols = 2 if n > 1 else 1
    rows = math.ceil(max(1, n) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[max(1, n):]:
        ax.set_visible(False)
    return fig, axes


def _step_matrix(series: dict[str, dict[int, float]]):
    """(the steps any series logged, ``[series, step]`` values with NaN where a series did not log the step)."""
    import numpy as np

    steps = sorted({s for values in series.values() for s in values})
    index = {s: j for j, s in enumerate(steps)}
    matrix = np.full((len(series), len(steps)), np.nan)
    for i, values in enumerate(series.values()):
        for s, v in values.items():
            matrix[i, index[s]] = v
    return steps, matrix


def _step_ticks(ax, steps: list[int]) -> None:
    """At most 10 x ticks over the heat map's columns, labelled with their steps."""
    import numpy as np

    ticks = np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(steps[j]) for j in ticks], fontsize=7)


def _warmup_line(ax, x: float, step: int, run: Run, color: str = "grey", label: bool = True) -> None:
    """The switch to quantization, labelled with the warmup's real precision (fp32 on CPU configs)."""
    text = f"quantization on (end of {precision_name(run) or 'unquantized'} warmup, step {step})"
    ax.axvline(x, color=color, ls="--", lw=1, label=text if label else None)


def plot_loss_curves(path: Path, baseline: Run, qats: list[Run], results: list[dict]) -> dict:
    plt = _plt()
    fig, (ax, ax_err) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    base = baseline.train_loss()
    for i, run in enumerate([baseline] + qats):
        color = "black" if i == 0 else f"C{i - 1}"
        loss = run.train_loss()
        if loss:
            ax.plot(list(loss), list(loss.values()), color=color, lw=1.2, label=f"{run.label} train")
        val = run.series("val/loss")
        if val:
            ax.plot(list(val), list(val.values()), color=color, ls="none", marker="o", label=f"{run.label} val")
        steps = sorted(s for s in set(base) & set(loss) if base[s] and math.isfinite(base[s]) and math.isfinite(loss[s]))
        if i > 0 and steps:
            ax_err.plot(steps, [abs(loss[s] - base[s]) / abs(base[s]) * 100 for s in steps], color=color, lw=1,
                        label=f"{run.label}: APE {results[i - 1]['train_loss_ape_pct']:.3f} %")
            ax_err.axhline(results[i - 1]["train_loss_ape_pct"], color=color, ls="--", lw=0.8)
    switches = {}  # step -> the first run switching then
    for run in qats:
        if warmup_switch_step(run) is not None:
            switches.setdefault(warmup_switch_step(run), run)
    for step, run in sorted(switches.items()):
        for a in (ax, ax_err):
            _warmup_line(a, step, step, run, label=a is ax)
    ax.set_ylabel("loss")
    ax.set_title(f"Training loss: {', '.join(r.label for r in qats)} vs {baseline.label}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_err.set_xlabel("optimizer step")
    ax_err.set_ylabel("|Δloss| / loss_base (%)")
    if ax_err.lines:
        ax_err.legend(fontsize=8)
    ax_err.grid(alpha=0.3)
    _save(fig, plt, path)
    return {"warmup_lines": sorted(switches)}


def select_tensors(qats: list[Run], layers: list[str] | None, limit: int = 6) -> list[str]:
    """Tensors for the a_hat-vs-amax figure.

    Each ``--layers`` item is a tensor name (``layers.10.mlp.down_proj.input``), a layer name (its
    ``.input`` tensor) or a regular expression searched in the tensor names; a leading ``model.`` is
    ignored. Default: the input tensors of the first, middle and last quantized layer plus the most
    clipped tensor.
    """
    available = sorted({t for run in qats for t in run.tensors()}, key=natural_key)
    if layers:
        chosen: list[str] = []
        for item in layers:
            item = item.removeprefix("model.")
            if item in available:
                matches = [item]
            elif item + ".input" in available:
                matches = [item + ".input"]
            else:
                try:
                    regex = re.compile(item)
                except re.error as err:
                    raise ReportError(f"--layers {item!r}: not a tensor name nor a valid regex ({err})") from None
                matches = [t for t in available if regex.search(t)]
            if not matches:
                raise ReportError(f"--layers {item!r} matches no logged tensor; logged tensors look like {available[:3] or 'none'}")
            chosen += [m for m in matches if m not in chosen]
        return chosen[: max(limit, len(layers))]
    inputs = [t for t in available if t.endswith(".input")] or available
    if not inputs:
        return []
    picks = [inputs[0], inputs[len(inputs) // 2], inputs[-1]]
    worst, worst_value = None, 0
    for run in qats:
        for name, t in ((run.summary or {}).get("tensors") or {}).items():
            if (t.get("clipped") or 0) > worst_value and name in available:
                worst, worst_value = name, t["clipped"]
    return list(dict.fromkeys(picks + ([worst] if worst else [])))


def a_hat_points(run: Run, tensor: str) -> dict[int, float]:
    """step -> a_hat from the first quantized step on, positive estimates only (no ramp from 0)."""
    switch = warmup_switch_step(run)
    return {s: v for s, v in run.series(f"a_hat/{tensor}").items() if v > 0 and (switch is None or s >= switch)}


def clipped_steps(run: Run, tensor: str) -> list[int]:
    """Steps whose logged per-tensor clipped fraction is > 0 (the exact counter; nothing inferred)."""
    return [s for s, v in run.series(f"sat/{tensor}/clipped_frac").items() if v > 0]


def plot_amax(path: Path, qats: list[Run], tensors: list[str]) -> dict:
    """True amax vs a_hat (from the first quantized step, only positive estimates); red x = clipped > 0."""
    plt = _plt()
    fig, axes = _grid(plt, len(tensors), 6, 3.2)
    if not tensors:
        axes[0][0].text(0.5, 0.5, "no per-layer amax / a_hat logged\n(saturation.per_layer=false, or no QAT run)",
                        ha="center", va="center", transform=axes[0][0].transAxes)
        axes[0][0].set_axis_off()
    lines = set()
    for ax, tensor in zip(axes.flat, tensors):
        for i, run in enumerate(qats):
            color, switch = f"C{i}", warmup_switch_step(run)
            amax, a_hat = run.series(f"amax/{tensor}"), a_hat_points(run, tensor)
            if amax:
                ax.plot(list(amax), list(amax.values()), color=color, lw=1.2, label=f"{run.label} amax")
            if a_hat:
                ax.plot(list(a_hat), list(a_hat.values()), color=color, lw=1.2, ls="--", label=f"{run.label} a_hat")
            over = [s for s in clipped_steps(run, tensor) if s in amax or s in a_hat]
            if over:
                ax.plot(over, [amax.get(s, a_hat.get(s)) for s in over], "x", color="red", ms=6,
                        label="clipped fraction > 0" if i == 0 else None)
            if switch is not None:
                _warmup_line(ax, switch, switch, run)
                lines.add(switch)
        ax.set_title(tensor, fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("|x| max")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("a_hat (the estimate each step was quantized with) vs true amax")
    _save(fig, plt, path)
    return {"warmup_lines": sorted(lines)}


def plot_heatmap(path: Path, qats: list[Run]) -> dict:
    """Clipped fraction per tensor (every row labelled) and logged step; input / weight / grad panels."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _plt()
    kinds = [k for k in ("input", "weight", "grad")
             if any(t.endswith("." + k) and f"sat/{t}/clipped_frac" in r.columns for r in qats for t in r.tensors())]
    panels = []  # (run, kind, tensors, steps, matrix)
    for run in qats:
        for kind in kinds or ["input"]:
            tensors = [t for t in run.tensors() if t.endswith("." + kind) and f"sat/{t}/clipped_frac" in run.columns]
            steps, matrix = _step_matrix({t: run.series(f"sat/{t}/clipped_frac") for t in tensors})
            panels.append((run, kind, tensors, steps, matrix))
    ncols = max(1, len(kinds))
    heights = [2.2 + 0.13 * max([len(p[2]) for p in panels if p[0] is run] or [1]) for run in qats] or [3]
    fig, axes = plt.subplots(max(1, len(qats)), ncols, figsize=(7.5 * ncols, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    positive = np.concatenate([m[m > 0] for *_, m in panels] or [np.array([])])
    norm = LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 10)) if positive.size else None
    lines = set()
    for ax, (run, kind, tensors, steps, matrix) in zip(axes.flat, panels):
        if not tensors:
            ax.text(0.5, 0.5, f"{run.label}: no per-layer {kind} saturation logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        shown = np.ma.masked_where(~(matrix > 0), matrix)
        im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=plt.get_cmap("magma_r").with_extremes(bad="#f2f2f2"),
                       norm=norm, extent=(-0.5, len(steps) - 0.5, len(tensors) - 0.5, -0.5))
        _step_ticks(ax, steps)
        ax.set_yticks(range(len(tensors)))
        ax.set_yticklabels([t.removesuffix("." + kind) for t in tensors], fontsize=6)  # 0.13 in per row
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"quantized {kind} tensor")
        switch = warmup_switch_step(run)
        if switch is not None:
            after = [j for j, s in enumerate(steps) if s >= switch]
            _warmup_line(ax, (after[0] if after else len(steps)) - 0.5, switch, run, color="tab:blue")
            ax.legend(fontsize=7, loc="upper right")
            lines.add(switch)
        ax.set_title(f"{run.label}: {kind} clipped fraction" + ("" if norm else " (no element clipped)"), fontsize=9)
        if norm is not None:
            fig.colorbar(im, ax=ax, label="clipped fraction (log)")
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    _save(fig, plt, path)
    return {"warmup_lines": sorted(lines)}
