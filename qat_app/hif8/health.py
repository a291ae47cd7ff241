"""Numeric health of a quantized tensor, and what the other amax estimators would have clipped on it.

Two device-side measurements of one fake quantization, accumulated per scaler. **Health**, on logging steps only
(:func:`qat_app.hif8.quantized.set_health_measurement`): one float64 vector per tensor, :data:`FIELDS`, then the
:data:`TIERS` counts, then a histogram of the magnitudes (:data:`HEALTH_LEN` entries in all), every entry additive
over micro-batches and ranks; :func:`summarize` turns it into SQNR, underflow, tiers and the outlier factor.
**What-if**, on every quantized step: the elements each estimator of :data:`WHATIF_ALGOS` would have clipped with
the same history, by the real counter's clipping rule, so the scaler's own estimator counts exactly what the real
counter counts. Neither adds a host sync to the forward or the backward.

See ``docs/diagnostics/health.md`` for the logged figures and ``docs/diagnostics/saturation.md`` for the what-if.
"""

from __future__ import annotations

import math

import torch

from .backends.compiled import compiles_exact_division, run_compiled
from .backends.reference import current_scale, dequantized, raw_current_scale, whatif_counts
from .formats import Float8Format, _f32_bits, _mantissa_bits
from .estimators import DELAYED_ALGOS, WHATIF_ALGOS  # noqa: F401  (the what-if's columns: part of this interface)

FIELDS = ("numel", "sum_x2", "sum_err2", "underflow")
TIERS = ("mant3", "mant2", "mant1", "denormal", "zero")
HIST_BINS = 1 + (0x7FFFFFFF >> 20) + 1  # zeros, then every (exponent, 3 mantissa bits) of a float32 magnitude
TIER_OFFSET = len(FIELDS)
HIST_OFFSET = TIER_OFFSET + len(TIERS)
HEALTH_LEN = HIST_OFFSET + HIST_BINS
OUTLIER_PERCENTILE = 0.999
_NO_TIER = len(TIERS)  # NaN
_ZERO, _DENORMAL = TIERS.index("zero"), TIERS.index("denormal")
# E4M3 / E5M2: (torch dtype, the tier of their normals)
_TORCH_FLOAT8 = {"e4m3": (torch.float8_e4m3fn, "mant3"), "e5m2": (torch.float8_e5m2, "mant2")}


# ----------------------------------------------------------------------------------------------- health
def precision_tier(q: torch.Tensor, fmt: Float8Format) -> torch.Tensor:
    """Index into :data:`TIERS` of every element of ``q`` (float32 on the format's grid); len(TIERS) for NaN."""
    magnitude = q.abs()
    if fmt.name == "hif8":
        exponent = (_f32_bits(magnitude) >> 23) - 127
        tier = 3 - _mantissa_bits(exponent)  # 3, 2, 1 mantissa bits -> mant3, mant2, mant1; 0 (denormal) -> 3
    else:
        dtype, normal_tier = _TORCH_FLOAT8[fmt.name]
        smallest_normal = torch.finfo(dtype).smallest_normal
        tier = torch.where(magnitude < smallest_normal, _DENORMAL, TIERS.index(normal_tier))
    tier = torch.where(magnitude == 0, _ZERO, tier)
    return torch.where(torch.isnan(q), _NO_TIER, tier)


def magnitude_bin(x: torch.Tensor) -> torch.Tensor:
    """Histogram bin of |x| (float32): 0 for zeros, else 1 + (its bit pattern >> 20)."""
    bits = _f32_bits(x) & 0x7FFFFFFF
    return (bits >> 20) + (bits != 0).int()


def bin_lower_edge(bins: torch.Tensor) -> torch.Tensor:
    """The smallest |x| of each histogram bin (float32; 0 for bin 0)."""
    bits = ((bins - 1).clamp(min=0) << 20).to(torch.int32)
    return torch.where(bins > 0, bits.view(torch.float32), 0.0)


@torch.no_grad()
def measure_health(x: torch.Tensor, scale: torch.Tensor, max_val: float, fmt: Float8Format,
                   noise: torch.Tensor | None = None, fused: str = "off", grid: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The float64 health vector (:data:`HEALTH_LEN`, layout: :data:`FIELDS`, :data:`TIERS`, then the histogram) of one quantization of
    ``x`` with ``scale``; ``noise``: the stochastic-rounding bits it used; ``grid``: its grid values ``q`` when the
    quantization wrote them (they are not rounded again). The error is against ``q / scale`` in ``x``'s dtype, bit
    for bit the fake quantization's output (the value the matmul's product stands for).
    ``fused``: see :func:`_run` (compiled, the counts are the same; the float64 sums may differ in the last bit,
    being summed in another order)."""
    x, scale = x.detach(), scale.detach()
    if _divides_exactly(fused, x):
        if grid is None:
            parts = _run(_rounded_parts, fused, x, scale, float(max_val), fmt, noise)
        else:
            parts = _run(_health_parts, fused, x, grid.detach(), scale, fmt)
    else:  # the division in plain torch (see :func:`_divides_exactly`), the rest compiled
        if grid is None:
            grid = _run(_rounded_grid, fused, x, scale, float(max_val), fmt, noise)
        grid = grid.detach()
        parts = _run(_dequantized_parts, fused, x, grid, dequantized(grid, scale, x.dtype), fmt)
    return _health_vector(*parts)


def _divides_exactly(fused: str, x: torch.Tensor) -> bool:
    """Whether a division may run inside the compiled functions for ``x`` (plain torch, or inductor's C++ on the
    CPU); inductor's Triton code divides approximately, so on CUDA the division runs in plain torch."""
    return fused == "off" or compiles_exact_division(x.device.type)


def _rounded_grid(x: torch.Tensor, scale: torch.Tensor, max_val: float, fmt: Float8Format,
                  noise: torch.Tensor | None) -> torch.Tensor:
    """The grid values of ``x`` (float32), rounded as the backends round them."""
    return fmt.round_f32((x.float() * scale).clamp(-max_val, max_val), noise)


def _rounded_parts(x: torch.Tensor, scale: torch.Tensor, max_val: float, fmt: Float8Format,
                   noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_health_parts` of ``x`` rounded here, as the backends round it."""
    return _health_parts(x, _rounded_grid(x, scale, max_val, fmt, noise), scale, fmt)


def _health_parts(x: torch.Tensor, grid: torch.Tensor, scale: torch.Tensor,
                  fmt: Float8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_dequantized_parts` with the dequantized tensor ``(q / scale)`` in ``x``'s dtype computed here."""
    return _dequantized_parts(x, grid, dequantized(grid, scale, x.dtype), fmt)


def _dequantized_parts(x: torch.Tensor, grid: torch.Tensor, dequantized: torch.Tensor,
                       fmt: Float8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """One elementwise pass: the joint (tier of q, bin of |x|) index of every element (int32) and the float64
    ``[sum x^2, sum (x - dequantized)^2]``."""
    xf, q = x.float(), grid.float()
    joint_index = (precision_tier(q, fmt) * HIST_BINS + magnitude_bin(xf)).reshape(-1).to(torch.int32)
    signal = xf.double().reshape(-1)
    error = signal - dequantized.double().reshape(-1)
    return joint_index, torch.stack([torch.dot(signal, signal), torch.dot(error, error)])


def _health_vector(joint_index: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """The health vector from :func:`_health_parts`'s: the counting pass is a ``bincount`` on a CPU (a plain loop:
    a third of the compiled scatter's time here) and an ``index_add_`` elsewhere (no host sync, unlike
    ``bincount`` on CUDA)."""
    bins = (len(TIERS) + 1) * HIST_BINS
    if joint_index.device.type == "cpu":
        joint = torch.bincount(joint_index, minlength=bins)
    else:
        joint = torch.zeros(bins, dtype=torch.int64, device=joint_index.device)
        joint.index_add_(0, joint_index, torch.ones((), dtype=torch.int64, device=joint_index.device)
                         .expand(joint_index.numel()))
    joint = joint.view(len(TIERS) + 1, HIST_BINS).double()
    fields = torch.stack([joint.sum(), sums[0], sums[1], joint[_ZERO, 1:].sum()])
    return torch.cat([fields, joint[: len(TIERS)].sum(dim=1), joint.sum(dim=0)])


def sqnr_from_powers(signal_power: torch.Tensor, noise_power: torch.Tensor) -> torch.Tensor:
    """SQNR in dB, 10 log10(signal / noise), elementwise: inf for an exact result (no noise), NaN without signal.
    The one definition, for the tensors' health here and the layers' outputs of ``inspect`` (:mod:`.layer_error`)."""
    sqnr = torch.where(noise_power > 0, 10.0 * torch.log10(signal_power / noise_power), math.inf)
    return torch.where(signal_power > 0, sqnr, math.nan)


def full_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Per-position full-vocabulary KL(p || q) from two models' logits, in float64: the one definition (the
    reference the top-k cache of :mod:`qat_app.eval.kl_cache` bounds, the end-to-end KL of ``inspect``, served vs
    trained). Between nearly equal models float32 log-normalizers alone err by ~1e-6 nats, more than the KL (and
    of either sign). One leading row at a time bounds the float64 copies."""
    def one(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.double().log_softmax(-1), b.double().log_softmax(-1)
        return (a.exp() * (a - b)).sum(-1)

    if logits_p.dim() < 3:
        return one(logits_p, logits_q)
    return torch.stack([one(a, b) for a, b in zip(logits_p, logits_q)])


def summarize(health: torch.Tensor, amax: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logged figures of summed health vectors ``health`` [m, HEALTH_LEN] with their tensors' amax [m]
    (host or device; float64): sqnr_db, underflow_frac, outlier_factor and tier/<name> fractions, each [m].
    NaN where a figure is undefined (nothing measured; amax 0; p99.9 of |x| is 0)."""
    health = health.double()
    numel = health[:, FIELDS.index("numel")]
    per_element = torch.where(numel > 0, 1.0 / numel, math.nan)
    sum_x2, sum_err2 = health[:, FIELDS.index("sum_x2")], health[:, FIELDS.index("sum_err2")]
    sqnr_db = torch.where(numel > 0, sqnr_from_powers(sum_x2, sum_err2), math.nan)
    histogram = health[:, HIST_OFFSET:]
    rank = torch.ceil(OUTLIER_PERCENTILE * numel)[:, None]  # the p99.9 element, counted from the smallest
    bins = torch.searchsorted(histogram.cumsum(dim=1), rank.clamp(min=1)).squeeze(1).clamp(max=HIST_BINS - 1)
    p999 = bin_lower_edge(bins).double()
    amax = amax.double().to(health.device)
    outlier = torch.where((p999 > 0) & (amax > 0) & (numel > 0), amax / p999, math.nan)
    out = {"sqnr_db": sqnr_db, "underflow_frac": health[:, FIELDS.index("underflow")] * per_element,
           "outlier_factor": outlier}
    for k, name in enumerate(TIERS):
        out[f"tier/{name}"] = health[:, TIER_OFFSET + k] * per_element
    return out


# ----------------------------------------------------------------------------------------------- what-if
def current_never_clips(max_val: float, margin: float, threshold: float) -> bool:
    """Whether current scaling provably clips nothing of a tensor whose amax gives it a usable scale, so that its
    what-if count needs no pass of its own: with ``margin >= 0`` the scale ``s <= fl(max_val / amax)`` (a division
    by ``2^margin >= 1`` rounds no higher), and every ``|x| <= amax``, so ``fl(|x| s) <= fl(amax fl(max_val / amax))
    <= max_val (1 + 2^-23)^2``, below any clipping threshold above ``max_val (1 + 2^-20)`` (HiF8 at 15: 15.5)."""
    return margin >= 0 and threshold > max_val * (1 + 2.0**-20)


def whatif_from_delayed(delayed_counts: torch.Tensor, amax: torch.Tensor, max_val: float, margin: float) -> torch.Tensor:
    """The what-if counts (int64 [len(WHATIF_ALGOS)]) from the delayed estimators' (counted in the quantize pass,
    :data:`DELAYED_ALGOS` order) and the tensor's amax, where :func:`current_never_clips` holds: current scaling
    clips nothing when its scale is usable, and where it is not (amax zero, NaN or inf, or a scale that
    overflows) it falls back to most_recent's scale, whose count is already there: the count
    :func:`whatif_clipped` makes, without reading the tensor again."""
    _, usable = raw_current_scale(amax.float(), max_val, margin)
    most_recent = delayed_counts[DELAYED_ALGOS.index("most_recent")]
    return torch.cat([delayed_counts, most_recent.masked_fill(usable, 0).reshape(1)])


def whatif_clipped(x: torch.Tensor, delayed_scales: torch.Tensor, amax: torch.Tensor, max_val: float, margin: float,
                   threshold: float, fused: str = "off", power_2: bool = False) -> torch.Tensor:
    """The what-if clipped counts of ``x`` (int64 [len(WHATIF_ALGOS)], device ops only): under the scales of the
    delayed estimators (:data:`DELAYED_ALGOS` order) and under current scaling from ``amax`` (``x``'s).

    ``fused``: see :func:`_run`. The scales travel in one new tensor, so that the compiled function does not see
    the scaler's buffer views (each view's offset would be another compilation).
    """
    most_recent = delayed_scales[DELAYED_ALGOS.index("most_recent")]
    # current scaling takes its scale as ``fake_quantize_current`` does, in plain torch (a compiled division on CUDA
    # is approximate), falling back to most_recent's scale
    current = current_scale(amax.float().reshape(()), max_val, margin, most_recent, power_2)
    scales = torch.cat([delayed_scales, current.reshape(1)])
    return _run(whatif_counts, fused, x.detach(), scales, float(threshold))


# ----------------------------------------------------------------------------------------------- how they run
def _run(fn, fused: str, *args):
    """``fn(*args)`` as the fake quantization runs (``fused``): "off" plain torch; "auto"/"on" compiled
    (torch.compile: a few fused passes over the tensor instead of dozens; also on the Triton path, whose kernel
    does not compute these), "auto" falling back to plain torch (same numbers) for a function that fails to compile
    (:func:`.backends.compiled.run_compiled`). Tensors come detached (``requires_grad`` would be one more
    compilation)."""
    if fused == "off":
        return fn(*args)
    return run_compiled(fn, *args, required=fused == "on")
