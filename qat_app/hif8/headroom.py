"""What-if headroom: the SQNR and clipping a quantized tensor would have had at other ``max_val`` settings.

From the magnitude histogram the health measurement keeps (:mod:`.health`, 8 bins per binade) and the tensor's
a_hat, every ``max_val`` of a grid gets an estimate (elements spread uniformly within a bin, the squared error
integrated over the format's true grid) and a bound (:class:`HeadroomEstimate`). Contract: the bound holds for any
tensor, whatever the distribution inside the bins (``sqnr_db_low`` .. ``sqnr_db_high``, ``clipped_low`` ..
``clipped_high``); the estimate is first-order (on the trajectory the run trained) and assumes rounding to
nearest. Host-side float64 arithmetic on health vectors already read: no device work.

See ``docs/diagnostics/saturation.md`` ("What-if headroom") for the logged figures and the suggested ``max_val``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

from .backends.reference import current_scale
from .errors import FieldError
from .formats import get_format, saturation_threshold
from .health import HIST_BINS, HIST_OFFSET, bin_lower_edge, sqnr_from_powers
from .recipe import DEFAULT_BLOCK_PATTERN

# the max_val settings evaluated by default: from 2 to HiF8's largest finite value, the paper's 15 included
DEFAULT_GRID = (2.0, 3.0, 4.0, 6.0, 7.5, 8.0, 12.0, 15.0, 16.0, 24.0, 32.0, 64.0, 256.0, 1024.0, 32768.0)
_FP32_SLACK = 2.0**-24  # |fl(|x| s) - |x| s| <= 2^-24 |x| s (round to nearest)


def validate_grid(max_vals, fmt_name: str = "hif8", field: str = "headroom_grid") -> tuple[float, ...]:
    """The ``max_val`` grid as floats, sorted; a value the format cannot hold (not finite, not above its smallest
    positive value, above its largest finite value) or an empty grid is a :class:`FieldError` naming ``field``."""
    fmt = get_format(fmt_name)
    values = sorted({float(v) for v in max_vals})
    if not values:
        raise FieldError(field, "empty: give at least one max_val")
    smallest = float(_grid(fmt_name)[1])
    for v in values:
        if not math.isfinite(v) or v < smallest or v > fmt.max_finite:
            raise FieldError(field, f"{v:g} is outside what {fmt_name} can hold as a max_val "
                                    f"([{smallest:.3g}, {fmt.max_finite:g}])")
    return tuple(values)


@functools.lru_cache(maxsize=None)
def _grid(fmt_name: str) -> torch.Tensor:
    """The format's non-negative finite values, ascending, float64 (from its own decode table)."""
    values = get_format(fmt_name).decode(torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float32).double()
    values = values[torch.isfinite(values) & (values >= 0)]
    return torch.unique(values)  # sorted


def _segment(grid: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Index i of the grid segment [g_i, g_{i+1}] holding y (clamped to the last segment)."""
    return (torch.searchsorted(grid, y, right=True) - 1).clamp(0, grid.numel() - 2)


def _partial(y: torch.Tensor, lo: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Integral of the squared distance to the nearest of {lo, lo + h} over [lo, y], y in [lo, lo + h]."""
    t = (y - lo).clamp(min=0.0)
    half = h / 2
    inside = t <= half
    return torch.where(inside, t**3 / 3, half**3 / 3 + (half**3 - (h - t).clamp(min=0.0) ** 3) / 3)


def _distance(y: torch.Tensor, lo: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.minimum((y - lo).abs(), (lo + h - y).abs())


def _grid_error(grid: torch.Tensor, a: torch.Tensor, c: torch.Tensor):
    """Over [a, c] (c >= a, both within the grid's range), rounding to the nearest grid value: (integral of the
    squared error, its smallest, its largest squared error)."""
    h_all = grid[1:] - grid[:-1]
    cumulative = torch.cat([torch.zeros(1, dtype=grid.dtype), torch.cumsum(h_all**3 / 12, 0)])
    ia, ic = _segment(grid, a), _segment(grid, c)
    ga, ha, gc, hc = grid[ia], h_all[ia], grid[ic], h_all[ic]
    integral = (cumulative[ic] - cumulative[ia]) + _partial(c, gc, hc) - _partial(a, ga, ha)

    def segment_max(lo_y, hi_y, g, h):
        mid = g + h / 2
        return torch.where((lo_y <= mid) & (mid <= hi_y), h / 2, torch.maximum(_distance(lo_y, g, h), _distance(hi_y, g, h)))

    same = ia == ic
    first = segment_max(a, torch.where(same, c, ga + ha), ga, ha)
    last = segment_max(torch.where(same, a, gc), c, gc, hc)
    # the spacing grows with the magnitude (tapered and IEEE-like formats alike): the widest interior segment is ic-1
    interior = torch.where(ic - 1 > ia, h_all[(ic - 1).clamp(min=0)] / 2, 0.0)
    largest = torch.maximum(torch.maximum(first, last), interior)
    contains_grid_point = ~same | (a == ga) | (c == ga + ha)
    smallest = torch.where(contains_grid_point, 0.0, torch.minimum(_distance(a, ga, ha), _distance(c, ga, ha)))
    return integral.clamp(min=0.0), smallest**2, largest**2


@dataclass(frozen=True)
class HeadroomEstimate:
    """Per tensor (rows) and ``max_val`` (columns), float64: the estimated SQNR (dB) with its guaranteed interval, and
    the estimated clipped elements with theirs. ``sqnr_db`` is +inf for an error-free tensor, NaN without signal."""

    max_vals: tuple[float, ...]
    sqnr_db: torch.Tensor
    sqnr_db_low: torch.Tensor
    sqnr_db_high: torch.Tensor
    clipped: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def _occupied_bins(health: torch.Tensor, amax: torch.Tensor):
    """The |x| histogram's finite bins that any tensor occupies -> (counts [m, bins], lower and upper edges [m, bins]
    capped at each tensor's amax, the count of inf / NaN elements [m])."""
    counts = health[:, HIST_OFFSET + 1:]  # bin 0 holds the zeros: no error, never clipped
    bins = torch.arange(1, HIST_BINS, dtype=torch.int64)
    lower = bin_lower_edge(bins).double()
    upper = bin_lower_edge(bins + 1).double()
    finite = torch.isfinite(upper) & (bins < HIST_BINS - 1)
    occupied = counts.sum(dim=0) > 0  # a tensor spans ~30 of the 255 binades: only occupied bins are evaluated
    nonfinite_counts = counts[:, ~finite].sum(dim=1)  # inf / NaN elements: the error is not finite
    counts = counts[:, finite & occupied]
    amax = amax.double().reshape(-1, 1)
    lower, upper = lower[finite & occupied], upper[finite & occupied]
    lower, upper = torch.minimum(lower, amax), torch.minimum(upper, amax)  # [m, bins]
    return counts, lower, upper, nonfinite_counts


def _bin_squared_errors(grid: torch.Tensor, a, b, a_lo, b_hi, max_val: float, clamp_value: float):
    """The squared quantization error of an element of each bin [a, b] of the scaled axis -> (mean: elements uniform
    within the bin, smallest, largest: bounds for any element in [a_lo, b_hi]); the part of a bin above ``max_val``
    is clamped to ``clamp_value``."""
    top = torch.full_like(a, max_val)
    # the part of a bin rounded on the grid, [a, min(b, max_val)], and the part clamped to round(max_val)
    on_grid = a < max_val
    start, stop = torch.where(on_grid, a, top), torch.minimum(b, top)
    integral, _, _ = _grid_error(grid, start, torch.maximum(stop, start))
    wide_start = torch.where(on_grid, a_lo, top)
    _, smallest, largest = _grid_error(grid, wide_start, torch.maximum(torch.minimum(b_hi, top), wide_start))
    clamped = b > max_val
    clamp_start = torch.maximum(a, top)
    integral = integral + torch.where(clamped, ((b - clamp_value) ** 3 - (clamp_start - clamp_value) ** 3) / 3, 0.0)
    e_lo, e_hi = torch.maximum(a_lo, top) - clamp_value, b_hi - clamp_value
    clamp_max = torch.maximum(e_lo**2, e_hi**2)
    clamp_min = torch.where((e_lo <= 0) & (e_hi >= 0), 0.0, torch.minimum(e_lo**2, e_hi**2))
    largest = torch.where(clamped, torch.maximum(largest, clamp_max), largest)
    smallest = torch.where(clamped, torch.where(on_grid, torch.minimum(smallest, clamp_min), clamp_min), smallest)
    width = b - a  # 0: a bin whose elements all equal amax (a bin edge): the error of that point
    mean = torch.where(width > 0, integral / torch.where(width > 0, width, 1.0), largest)
    return mean, smallest, largest


def _clipped_fraction(a: torch.Tensor, b: torch.Tensor, threshold: float) -> torch.Tensor:
    """The fraction of each bin [a, b] of the scaled axis at or above the clipping ``threshold`` (elements uniform
    within the bin; a zero-width bin: all or nothing)."""
    width = b - a
    return torch.where(width > 0, (b - torch.maximum(a, torch.full_like(a, threshold))) / torch.where(
        width > 0, width, 1.0), (a >= threshold).double()).clamp(0.0, 1.0)


def estimate_headroom(health: torch.Tensor, a_hat: torch.Tensor, amax: torch.Tensor, max_vals, fmt_name: str = "hif8",
                      margin: float = 0.0, power_2: bool = False) -> HeadroomEstimate:
    """The what-if headroom of tensors from their summed health vectors ``health`` [m, HEALTH_LEN] (:mod:`.health`),
    the ``a_hat`` [m] they were quantized with and their ``amax`` [m] (which bounds the top occupied bin: its largest
    element is known exactly), at each ``max_val`` of ``max_vals`` (docs/diagnostics/saturation.md)."""
    health = health.double().reshape(-1, health.shape[-1])
    m = health.shape[0]
    max_vals = tuple(float(v) for v in max_vals)
    grid = _grid(fmt_name)
    counts, lower, upper, nonfinite_counts = _occupied_bins(health, amax)
    signal = health[:, 1]  # sum x^2 (FIELDS order: numel, sum_x2, ...)
    a_hat = a_hat.reshape(-1).float()  # the scale is computed as the scaler computes it, in float32
    shape = (m, len(max_vals))
    out = {k: torch.zeros(shape, dtype=torch.float64) for k in ("mean", "low", "high", "clip", "clip_low", "clip_high")}
    for j, max_val in enumerate(max_vals):
        scale = current_scale(a_hat, max_val, margin, torch.ones_like(a_hat), power_2).double()[:, None]  # [m, 1]
        threshold = saturation_threshold(fmt_name, max_val)
        clamp_value = float(get_format(fmt_name).round_f32(torch.tensor([max_val], dtype=torch.float32)))
        a, b = lower * scale, upper * scale  # [m, bins]: each bin on the scaled axis
        a_lo, b_hi = a * (1 - _FP32_SLACK), b * (1 + _FP32_SLACK)  # fl(|x| s) moves y by at most 2^-24
        mean, smallest, largest = _bin_squared_errors(grid, a, b, a_lo, b_hi, max_val, clamp_value)
        to_x = 1.0 / scale[:, 0] ** 2  # errors on the scaled axis, back to x's units
        out["mean"][:, j] = (counts * mean).sum(dim=1) * to_x
        out["low"][:, j] = (counts * smallest).sum(dim=1) * to_x
        out["high"][:, j] = (counts * largest).sum(dim=1) * to_x
        out["clip"][:, j] = (counts * _clipped_fraction(a, b, threshold)).sum(dim=1)
        out["clip_low"][:, j] = (counts * (a_lo >= threshold)).sum(dim=1)
        out["clip_high"][:, j] = (counts * (b_hi >= threshold)).sum(dim=1)
    bad = (nonfinite_counts > 0)[:, None]
    signal = signal[:, None]

    def sqnr(noise):
        return torch.where(bad, math.nan, sqnr_from_powers(signal.expand(shape), noise))

    return HeadroomEstimate(max_vals, sqnr(out["mean"]), sqnr(out["high"]), sqnr(out["low"]), out["clip"],
                            out["clip_low"], out["clip_high"])


def finite_mean(sqnr_db: torch.Tensor) -> torch.Tensor:
    """The mean over tensors (dim 0) of their finite SQNRs (an error-free tensor's inf, an empty one's NaN left out)."""
    return torch.nanmean(torch.where(torch.isfinite(sqnr_db), sqnr_db, torch.nan), dim=0)


def suggest(estimate: HeadroomEstimate, rows: list[int], clipped_allowed: float) -> dict:
    """The ``max_val`` of the grid that maximises the mean estimated SQNR (dB) over the tensors ``rows`` with at most
    ``clipped_allowed`` elements clipped for certain-or-possibly (the bound's upper end), and the figures at each
    ``max_val``: ``{"max_val", "sqnr_db": [...], "clipped_high": [...]}`` (max_val None when none qualifies)."""
    if not rows:
        return {"max_val": None, "sqnr_db": [], "clipped_high": []}
    mean_db = finite_mean(estimate.sqnr_db[rows])
    clipped = estimate.clipped_high[rows].sum(dim=0)
    allowed = (clipped <= clipped_allowed) & torch.isfinite(mean_db)
    best = None
    if bool(allowed.any()):
        best = estimate.max_vals[int(torch.where(allowed, mean_db, -math.inf).argmax())]
    return {"max_val": best, "sqnr_db": [float(v) for v in mean_db], "clipped_high": [float(v) for v in clipped]}


# the largest |estimated - exact| SQNR (dB) tests/test_headroom.py allows on its tensors (Gaussian, Student-t, sparse
# outliers, 4096 elements; measured worst 0.52 dB): a gain under it is inside the estimate's own error
ACCURACY_DB = 0.75
# a per-operand max_val is suggested beside the global one when it gains at least this much (dB, estimated) on its
# operand's tensors over the global suggestion
PAYS_DB = 1.0


def block_of(name: str, block_pattern: str = DEFAULT_BLOCK_PATTERN) -> int | None:
    """The decoder-block index of a tensor's name by the selection's ``block_pattern`` (None outside any block)."""
    match = re.search(block_pattern, name + ".")
    return int(match.group(1)) if match else None


def _jsonable(values) -> list:
    return [float(v) if math.isfinite(float(v)) else None for v in values]


def _gain(value: float | None) -> dict:
    """The estimated SQNR gain of a suggestion over the run's own max_val, and whether it exceeds the estimate's error."""
    return {"gain_db": value, "significant": value is not None and value >= ACCURACY_DB}


def digest(names: list[str], operands: list[str], estimate: HeadroomEstimate, run_max_val: dict[str, float],
           block_pattern: str = DEFAULT_BLOCK_PATTERN) -> dict:
    """What a run's summary keeps of one estimate of ``names``' tensors: the grid, the suggested ``max_val``
    (global; per operand where it pays, :data:`PAYS_DB`), the mean estimated SQNR and the possibly-clipped elements
    per operand and per block at each ``max_val``, and every tensor's own figures. ``operands``: each tensor's
    role (:class:`~.operand.Operand`). ``run_max_val``: operand -> the
    run's ``max_val`` (in the grid), whose possibly-clipped count is the most a suggestion may have ("no more
    clipping than the run had")."""
    columns = [estimate.max_vals.index(float(run_max_val[operand])) for operand in operands]
    rows = list(range(len(names)))

    def at_run(subset, table) -> torch.Tensor:
        return torch.stack([table[i, columns[i]] for i in subset]) if subset else torch.zeros(0, dtype=torch.float64)

    def suggestion(subset):
        return suggest(estimate, subset, float(at_run(subset, estimate.clipped_high).sum()))

    def gain(own, subset):
        if own["max_val"] is None:
            return None
        sqnr = at_run(subset, estimate.sqnr_db)
        value = own["sqnr_db"][estimate.max_vals.index(own["max_val"])] - float(finite_mean(sqnr))
        return value if math.isfinite(value) else None

    overall = suggestion(rows)
    by_operand, suggested = {}, {"all": overall["max_val"]}
    for operand in dict.fromkeys(operands):
        subset = [i for i, own in enumerate(operands) if own == operand]
        own = suggestion(subset)
        by_operand[operand] = {"run_max_val": float(run_max_val[operand]), "sqnr_db": _jsonable(own["sqnr_db"]),
                               "clipped_high": own["clipped_high"], "suggested": own["max_val"],
                               **_gain(gain(own, subset))}
        if own["max_val"] is not None and overall["max_val"] is not None and own["max_val"] != overall["max_val"]:
            over_global = (own["sqnr_db"][estimate.max_vals.index(own["max_val"])]
                           - own["sqnr_db"][estimate.max_vals.index(overall["max_val"])])
            if over_global >= PAYS_DB:
                suggested[operand] = own["max_val"]
    by_block = {}
    blocks = [block_of(n, block_pattern) for n in names]
    for block in sorted({b for b in blocks if b is not None}):
        subset = [i for i, b in enumerate(blocks) if b == block]
        by_block[str(block)] = {"sqnr_db": _jsonable(suggest(estimate, subset, math.inf)["sqnr_db"])}
    return {
        "grid": list(estimate.max_vals), "run_max_val": {k: float(v) for k, v in run_max_val.items()},
        "suggested": suggested, "sqnr_db": _jsonable(overall["sqnr_db"]), "clipped_high": overall["clipped_high"],
        **_gain(gain(overall, rows)), "by_operand": by_operand, "by_block": by_block,
        "tensors": {name: {"sqnr_db": _jsonable(estimate.sqnr_db[i]), "sqnr_db_low": _jsonable(estimate.sqnr_db_low[i]),
                           "sqnr_db_high": _jsonable(estimate.sqnr_db_high[i]),
                           "clipped": [float(v) for v in estimate.clipped[i]],
                           "clipped_low": [float(v) for v in estimate.clipped_low[i]],
                           "clipped_high": [float(v) for v in estimate.clipped_high[i]]}
                    for i, name in enumerate(names)},
    }


def summary_lines(entry: dict | None) -> list[str]:
    """The run summary's lines for a :func:`digest` (none without one): the suggested max_val and its estimated gain,
    said to be inside the estimate's error where it is."""
    if not entry or entry.get("suggested", {}).get("all") is None:
        return []
    grid, best = entry["grid"], entry["suggested"]["all"]
    runs = sorted(set(entry["run_max_val"].values()))
    own = ", ".join(f"{v:g}" for v in runs)
    gain = entry.get("gain_db")
    verdict = ("" if gain is None else f"{gain:+.2f} dB estimated over {own}, "
               + ("beyond" if entry.get("significant") else "inside") + f" the estimate's error ({ACCURACY_DB} dB)")
    sqnr = entry["sqnr_db"][grid.index(best)]
    lines = [f"headroom      suggested max_val {best:g} (mean SQNR {sqnr:.1f} dB, no more clipping than the run; "
             f"{verdict}) at step {entry.get('step')}"]
    for operand, value in entry["suggested"].items():
        if operand != "all":
            lines.append(f"              {operand}: max_val {value:g} (+{entry['by_operand'][operand]['gain_db']:.2f} dB)")
    return lines
