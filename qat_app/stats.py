"""Paired statistics for comparing two evaluations of the same benchmark examples.

* :func:`paired_bootstrap_ci`: percentile interval of the difference of means, resampling the
  examples (pairs) with replacement; fixed seed, so a report is reproducible.
* :func:`mcnemar_exact_p`: McNemar's exact two-sided test for paired 0/1 outcomes (binomial test on
  the discordant pairs), in exact integer arithmetic.
* :func:`verdict`: ``worse`` / ``within noise`` / ``better`` from an interval of (after - before).
* :func:`paired_difference` / :func:`clustered_mean`: the mean difference with its standard error (clustered,
  CR1: E. Miller, "Adding Error Bars to Evals", arXiv 2411.00640) and a normal interval, as a :class:`PairedResult`.
* :func:`minimum_detectable_difference` / :func:`examples_needed`: what a test at a given standard error can
  detect, and the sample size an effect needs (80 % power).
* :func:`corrected`: a result's interval at another (e.g. Bonferroni-corrected) level, with Student's t quantile
  (:func:`t_quantile`, no scipy) at clusters - 1 degrees of freedom.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist
from typing import NamedTuple

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


def verdict(ci: tuple[float, float] | None, higher_is_better: bool = True) -> str:
    """``worse`` (whole interval of after - before on the worse side of 0: below it when ``higher_is_better``,
    above it otherwise), ``better`` (on the other side), else ``within noise``; ``n/a`` without an interval."""
    if ci is None or not all(math.isfinite(v) for v in ci):
        return "n/a"
    if ci[1] < 0:
        return "worse" if higher_is_better else "better"
    if ci[0] > 0:
        return "better" if higher_is_better else "worse"
    return "within noise"


def floor_verdict(low: float, high: float, floor_high: float | None) -> str:
    """Words for a KL interval ``[low, high]`` read against a noise floor whose interval ends at ``floor_high``
    (None: a model that rounds nothing onto a grid, whose floor is 0)."""
    if floor_high is None:
        return "above 0" if low > 0 else "inside the noise"
    if high <= floor_high:
        return "within the noise of the arithmetic"
    return "above the noise of the arithmetic" if low > floor_high else "overlaps the noise of the arithmetic"


class Ratio(NamedTuple):
    """A ratio and its interval (:attr:`PairedResult.ratio`)."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class PairedResult:
    """A paired comparison of two evaluations over the same examples (or the mean of a per-pair drift).

    ``difference``: mean of the per-example (after - before); ``se`` its standard error (clustered when clusters
    were given, see :func:`clustered_mean`); ``low`` / ``high``: the normal interval ``difference -/+ z_level * se``;
    ``n`` examples in ``n_clusters`` clusters; ``z = difference / se``. ``before`` / ``after``: the two means (None
    for a drift measure, which is one value per pair). For 0/1 outcomes ``right_to_wrong`` / ``wrong_to_right`` are
    McNemar's discordant pairs and ``mcnemar_p`` its exact two-sided p. ``note``: what was left out, if anything.
    """

    difference: float
    se: float
    low: float
    high: float
    n: int
    n_clusters: int
    z: float
    level: float = CONFIDENCE
    before: float | None = None
    after: float | None = None
    right_to_wrong: int | None = None
    wrong_to_right: int | None = None
    mcnemar_p: float | None = None
    note: str | None = None

    @property
    def interval(self) -> tuple[float, float]:
        return self.low, self.high

    @property
    def ratio(self) -> Ratio:
        """``exp`` of the difference and of its interval: for a difference of log values (of mean NLLs per token,
        the perplexity ratio after / before)."""
        return Ratio(math.exp(self.difference), math.exp(self.low), math.exp(self.high))


def jsonable(result: "PairedResult | None") -> dict | None:
    """A result as strict-JSON values (a non-finite number, e.g. the z of an exact 0, becomes null)."""
    return None if result is None else {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                        for k, v in asdict(result).items()}


def normal_quantile(level: float) -> float:
    """z such that a standard normal lies within -/+ z with probability ``level`` (1.959964 at 0.95)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def minimum_detectable_difference(se: float, level: float = CONFIDENCE, power: float = 0.8) -> float:
    """The smallest true difference a two-sided test at ``level`` detects with probability ``power``, given the
    standard error ``se`` of the estimate: (z_{1-alpha/2} + z_power) * se (2.80 se at 0.95 / 0.8)."""
    return (normal_quantile(level) + NormalDist().inv_cdf(power)) * se


def examples_needed(effect: float, se: float, n: int, level: float = CONFIDENCE, power: float = 0.8) -> float:
    """How many examples (or clusters, for a clustered ``se``) make ``effect`` detectable at ``level`` / ``power``,
    from the ``se`` measured over ``n``: the standard error shrinks as 1 / sqrt(n)."""
    if effect == 0 or not math.isfinite(se):
        return math.inf
    return n * (minimum_detectable_difference(se, level, power) / abs(effect)) ** 2


def clustered_mean(values, clusters=None, level: float = CONFIDENCE) -> PairedResult:
    """Mean of ``values`` with its standard error and a normal ``level`` interval.

    Without ``clusters``: the sample standard error s / sqrt(n) (s with ddof = 1). With ``clusters`` (one label
    per value; ``None`` labels are singletons: that item is its own cluster), the cluster-robust CR1 sandwich
    (Cameron & Miller, "A Practitioner's Guide to Cluster-Robust Inference", 2015), as E. Miller recommends for
    evals whose questions share a passage or source ("Adding Error Bars to Evals", arXiv 2411.00640, eq. 4):
    with dbar the mean and G the number of clusters,

        se^2 = G / (G - 1) * sum_g (sum_{i in g} (x_i - dbar))^2 / n^2

    which equals s^2 / n when every cluster holds one item. With fewer than 2 clusters the clustered SE is
    undefined: the unclustered one is used and ``note`` says so. One item: se is NaN (no interval).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n == 0:
        raise ValueError("mean of an empty sample")
    z_level = normal_quantile(level)
    mean = float(x.mean())
    note = None
    groups = n
    if clusters is not None:
        labels = list(clusters)
        if len(labels) != n:
            raise ValueError(f"{len(labels)} cluster labels for {n} values")
        ids = {}
        codes = np.array([ids.setdefault(label, len(ids)) if label is not None else -1 - i
                          for i, label in enumerate(labels)])
        _, codes = np.unique(codes, return_inverse=True)
        groups = int(codes.max()) + 1
        if groups >= 2:
            sums = np.bincount(codes, weights=x - mean, minlength=groups)
            se = math.sqrt(groups / (groups - 1) * float(np.sum(sums ** 2)) / n ** 2)
        else:
            note = "one cluster: the clustered SE is undefined, the unclustered SE is used"
            clusters = None
    if clusters is None:
        se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    if math.isnan(se):
        z = math.nan
    else:
        z = mean / se if se > 0 else 0.0 if mean == 0 else math.copysign(math.inf, mean)
    return PairedResult(mean, se, mean - z_level * se, mean + z_level * se, n, groups, z, level, note=note)


def paired_difference(before, after, clusters=None, level: float = CONFIDENCE) -> PairedResult:
    """Mean of the per-example differences ``after - before`` over paired examples, its standard error
    (clustered when ``clusters`` gives each example's cluster: CR1, see :func:`clustered_mean`), the normal
    ``level`` interval and z; with McNemar's discordant pairs and exact p when both samples are 0/1."""
    before, after = np.asarray(before, dtype=np.float64).ravel(), np.asarray(after, dtype=np.float64).ravel()
    if before.shape != after.shape:
        raise ValueError(f"paired samples of different sizes: {before.shape} vs {after.shape}")
    result = clustered_mean(after - before, clusters, level)
    pairs = discordant_pairs(before, after)
    flips = {} if pairs is None else {"right_to_wrong": pairs[0], "wrong_to_right": pairs[1],
                                      "mcnemar_p": mcnemar_exact_p(*pairs)}
    return replace(result, before=float(before.mean()), after=float(after.mean()), **flips)


def _t_central_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3-4: a finite sum in cos(theta))."""
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    term = total = c if df % 2 else 1.0
    for k in range(3 if df % 2 else 2, df - 1, 2):
        term *= (k - 1) / k * c * c
        total += term
    if df % 2:
        return 2 / math.pi * (theta + (s * total if df > 1 else 0.0))
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom, without scipy: bisection on the
    exact integer-df CDF below 100 df, the Cornish-Fisher expansion in 1/df above (relative error < 1e-6 there)."""
    z = NormalDist().inv_cdf(p)
    if df >= 100:
        return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
                + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
                + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))
    target, low, high = 2 * p - 1, 0.0, max(1.0, z)
    while _t_central_mass(high, df) < target:
        low, high = high, 2 * high
    while high - low > 1e-12 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central_mass(mid, df) < target else (low, mid)
    return (low + high) / 2


def corrected(result: PairedResult, alpha: float) -> PairedResult:
    """``result`` with its interval widened to confidence 1 - 2 alpha (each tail alpha): ``difference -/+ q se``
    with q the Student-t quantile at (clusters - 1) degrees of freedom (examples - 1 without clusters), the normal
    one without a count. At Bonferroni's small alphas the normal quantile would understate the tail of a
    studentised mean over a few dozen examples or clusters (at 60 examples and alpha 0.0025 the rate is 0.0035)."""
    df = (result.n_clusters if result.n_clusters >= 2 else result.n) - 1
    q = t_quantile(1.0 - alpha, df) if df >= 1 else NormalDist().inv_cdf(1.0 - alpha)
    return replace(result, low=result.difference - q * result.se, high=result.difference + q * result.se,
                   level=1.0 - 2.0 * alpha)
