"""Paired statistics for comparing two evaluations of the same benchmark examples.

* :func:`paired_bootstrap_ci`: percentile interval of the difference of means, resampling the
  examples (pairs) with replacement; fixed seed, so a report is reproducible.
* :func:`mcnemar_exact_p`: McNemar's exact two-sided test for paired 0/1 outcomes (binomial test on
  the discordant pairs), in exact integer arithmetic.
* :func:`verdict`: ``worse`` / ``within noise`` / ``better`` from an interval of (after - before).
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
CONFIDENCE = 0.95
# Above this many distinct per-example differences, resample indices (in row chunks of at most
# INDEX_CHUNK_ELEMENTS indices); at or below it, draw the multinomial counts of the distinct values.
MAX_DISCRETE_VALUES = 16
INDEX_CHUNK_ELEMENTS = 4_000_000


def bootstrap_means(differences, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> np.ndarray:
    """``resamples`` bootstrap replicates of the mean of ``differences`` (one per resample).

    Resampling n items with replacement gives each distinct value a Multinomial(n, frequencies)
    count, so for discrete differences (0/1 accuracies give -1, 0, 1) the counts are drawn directly:
    the same distribution as resampling indices, in O(resamples) memory. Otherwise indices are drawn
    with ``rng.integers(0, n, (rows, n))`` in chunks of ``INDEX_CHUNK_ELEMENTS // n`` rows.
    """
    d = np.asarray(differences, dtype=np.float64).ravel()
    n = d.size
    if n == 0:
        raise ValueError("bootstrap of an empty sample")
    rng = np.random.default_rng(seed)
    values, counts = np.unique(d, return_counts=True)
    if values.size <= MAX_DISCRETE_VALUES:
        draws = rng.multinomial(n, counts / n, size=resamples)
        return draws @ values / n
    means = np.empty(resamples)
    rows = max(1, INDEX_CHUNK_ELEMENTS // n)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        means[start:stop] = d[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return means


def paired_bootstrap_ci(
    before, after, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED, level: float = CONFIDENCE
) -> tuple[float, float]:
    """Percentile ``level`` interval of mean(after - before) over paired examples."""
    before, after = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if before.shape != after.shape:
        raise ValueError(f"paired samples of different sizes: {before.shape} vs {after.shape}")
    means = bootstrap_means(after - before, resamples, seed)
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return float(low), float(high)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: ``b`` pairs went 1 -> 0, ``c`` went 0 -> 1.

    p = min(1, 2 * P[X <= min(b, c)]) with X ~ Binomial(b + c, 1/2), summed exactly in integers
    (C(m, k+1) = C(m, k) * (m - k) / (k + 1)), so it holds for any number of examples.
    """
    if b < 0 or c < 0:
        raise ValueError(f"negative discordant counts: b={b}, c={c}")
    m, k_max = b + c, min(b, c)
    if m == 0:
        return 1.0
    term = total = 1  # C(m, 0)
    for k in range(k_max):
        term = term * (m - k) // (k + 1)
        total += term
    return min(1.0, 2 * total / 2**m)


def discordant_pairs(before, after) -> tuple[int, int] | None:
    """(b, c) = (#1->0, #0->1) for paired 0/1 outcomes; None when the values are not all 0/1."""
    before, after = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if not (np.isin(before, (0.0, 1.0)).all() and np.isin(after, (0.0, 1.0)).all()):
        return None
    return int(((before == 1) & (after == 0)).sum()), int(((before == 0) & (after == 1)).sum())


def verdict(ci: tuple[float, float] | None) -> str:
    """``worse`` (whole interval of after - before below 0), ``better`` (above 0), else ``within noise``;
    ``n/a`` without an interval."""
    if ci is None or not all(math.isfinite(v) for v in ci):
        return "n/a"
    if ci[1] < 0:
        return "worse"
    if ci[0] > 0:
        return "better"
    return "within noise"
