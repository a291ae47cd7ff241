"""Synthetic QAT runs with what-if counts and numeric health, as AmaxSaturationCallback writes them: per-step
``whatif/<algo>/clipped|events`` and ``sat/clipped|events`` columns, ``health/<tensor>/<figure>`` columns on the
logged steps, and a saturation_summary.json derived from the same numbers (for tests/test_report_health.py).

The values are pseudo-random (seeded), not chosen: the tests compute what they expect from the files written.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from qat_app.hif8.health import TIERS, WHATIF_ALGOS
from tests._report_fixtures import make_run, write_csv

# modules in the model's order (deliberately not alphabetical) in blocks whose natural order is not the text order
MODULES = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
OPERANDS = ("input", "weight")
BLOCKS = (2, 10)
USED = "max"  # the estimator of tests/_report_fixtures.config


def tensor_names(blocks=BLOCKS, modules=MODULES, operands=OPERANDS) -> list[str]:
    """In the model's order: block, module, operand (as the callback's summary lists them)."""
    return [f"layers.{b}.{m}.{o}" for b in blocks for m in modules for o in operands]


def _tier_fractions(rng: random.Random) -> dict[str, float]:
    weights = [rng.uniform(50, 100), rng.uniform(0, 10), rng.uniform(0, 2), rng.uniform(0, 0.5), rng.uniform(0, 0.5)]
    return {f"tier/{tier}": w / sum(weights) for tier, w in zip(TIERS, weights)}


def synthetic_counts(tensors: list[str], steps: int, warmup: int, seed: int) -> dict[int, dict[str, dict[str, int]]]:
    """step -> tensor -> estimator -> clipped elements (0 during the warmup: nothing is quantized)."""
    rng = random.Random(seed)
    out = {}
    for step in range(steps):
        out[step] = {t: {algo: 0 if step < warmup or algo == "current" else rng.choice((0, 0, 0, 1, 3, 40, 700))
                         for algo in WHATIF_ALGOS} for t in tensors}
    return out


def synthetic_health(tensors: list[str], logged: list[int], seed: int) -> dict[int, dict[str, dict[str, float]]]:
    """logged step -> tensor -> figures (sqnr_db, underflow_frac, outlier_factor, tier/<name>)."""
    rng = random.Random(seed + 1)
    return {step: {t: {"sqnr_db": rng.uniform(18, 34), "underflow_frac": rng.uniform(0, 1e-3),
                       "outlier_factor": rng.uniform(1, 40), **_tier_fractions(rng)} for t in tensors}
            for step in logged}


def make_health_run(root: Path, steps: int = 30, log_every: int = 5, tensors: list[str] | None = None,
                    whatif: bool = True, health: bool = True, summary: bool = True, seed: int = 0) -> Path:
    """A quantized run (tests/_report_fixtures.make_run: config with warmup 2 and amax_algo max, train/loss) with the
    callback's columns appended to its metrics.csv and, with ``summary``, its saturation_summary.json."""
    tensors = tensors or tensor_names()
    warmup = 2
    make_run(root, True, final=None, last_step=steps)
    version = root / "logs" / "version_0"
    with open(version / "metrics.csv", newline="") as f:
        rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    counts = synthetic_counts(tensors, steps, warmup, seed)
    logged = [s for s in range(warmup, steps) if (s + 1) % log_every == 0]
    figures = synthetic_health(tensors, logged, seed) if health else {}
    for step, per_tensor in counts.items():
        row = {"step": step, "sat/clipped": sum(c[USED] for c in per_tensor.values()),
               "sat/events": sum(c[USED] > 0 for c in per_tensor.values())}
        if whatif:
            for algo in WHATIF_ALGOS:
                row[f"whatif/{algo}/clipped"] = sum(c[algo] for c in per_tensor.values())
                row[f"whatif/{algo}/events"] = sum(c[algo] > 0 for c in per_tensor.values())
        rows.append(row)
    for step, per_tensor in figures.items():
        row = {"step": step, "health/min_sqnr_db": min(f["sqnr_db"] for f in per_tensor.values()),
               "health/underflow_frac": sum(f["underflow_frac"] for f in per_tensor.values()) / len(per_tensor)}
        for tensor, values in per_tensor.items():
            row.update({f"health/{tensor}/{key}": value for key, value in values.items()})
        rows.append(row)
    write_csv(version / "metrics.csv", rows)
    if summary:
        (version / "saturation_summary.json").write_text(json.dumps(
            summary_of(tensors, counts, figures, whatif=whatif)))
    return root


def summary_of(tensors, counts, figures, whatif: bool = True) -> dict:
    """saturation_summary.json as the callback writes it from these numbers (its keys; health only when measured)."""
    per_tensor = {}
    for t in tensors:
        entry = {"clipped": sum(c[t][USED] for c in counts.values()), "seen": 1000 * len(counts),
                 "saturation_events": sum(c[t][USED] > 0 for c in counts.values())}
        if whatif:
            entry["whatif"] = {algo: {"clipped": sum(c[t][algo] for c in counts.values()),
                                      "events": sum(c[t][algo] > 0 for c in counts.values())} for algo in WHATIF_ALGOS}
        if figures:
            last_step = max(figures)
            worst_step = min(figures, key=lambda s: figures[s][t]["sqnr_db"])
            entry["health"] = {"last": {"step": last_step, **figures[last_step][t]},
                               "worst_sqnr_db": figures[worst_step][t]["sqnr_db"], "worst_sqnr_step": worst_step}
        per_tensor[t] = entry
    out = {"quantized_tensors": len(tensors), "clipped": sum(e["clipped"] for e in per_tensor.values()),
           "seen": sum(e["seen"] for e in per_tensor.values()),
           "saturation_events": sum(e["saturation_events"] for e in per_tensor.values()), "tensors": per_tensor}
    if whatif:
        out["whatif"] = {algo: {key: sum(e["whatif"][algo][key] for e in per_tensor.values()) for key in ("clipped", "events")}
                         for algo in WHATIF_ALGOS}
    if figures:
        worst = sorted(per_tensor, key=lambda t: per_tensor[t]["health"]["worst_sqnr_db"])
        out["health_worst"] = [{"tensor": t, "worst_sqnr_db": per_tensor[t]["health"]["worst_sqnr_db"],
                                "step": per_tensor[t]["health"]["worst_sqnr_step"], "last": per_tensor[t]["health"]["last"]}
                               for t in worst]
    return out
