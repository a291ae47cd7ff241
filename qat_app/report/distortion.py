"""KL(baseline || QAT) on held-out text: the quantization's own distortion of the next-token distribution.

Every fit keeps its final validation's log-probabilities at the initial model's top-k tokens (plus the rest
of the vocabulary as one bucket) in ``<log_dir>/final_topk.pt`` (:mod:`qat_app.eval.kl_cache`); two runs that
started from the same model on the same validation text share that top-k partition, so the KL between their
coarse-grained distributions is a lower bound of the full-vocabulary KL(baseline || QAT), with an interval
over sequences like ``forget/kl``. torch is imported only when both runs have the file.

Both are read against the QAT run's noise floor (``<log_dir>/noise_floor.json``, :mod:`callbacks.noise_floor`):
what the W8A8 forward changes against itself under float rounding alone, in KL and in benchmark answers, so a
BF16-vs-QAT difference inside it is said to be within the noise of the arithmetic.
"""

from __future__ import annotations

from pathlib import Path

from .. import stats
from ..eval.records import (FINAL_TOPK_FILE, FORGET_GENERATION_KL, FORGET_KL, FORGET_KL_DRIFT, FORGET_KL_QUANTIZATION,
                            NOISE_FLOOR_FILE, read_noise_floor)
from .runs import Run


def newest_file(run: Run, name: str) -> Path | None:
    """The newest ``name`` among the run's logger versions (a resumed run's last version first)."""
    for metrics in reversed(run.files):
        candidate = Path(metrics).parent / name
        if candidate.is_file():
            return candidate
    return None


def final_topk(run: Run) -> Path | None:
    return newest_file(run, FINAL_TOPK_FILE)


def noise_floor_of(run: Run) -> dict | None:
    """The run's ``noise_floor.json`` (with its path), ``{note}`` when unreadable, None when it has none."""
    path = newest_file(run, NOISE_FLOOR_FILE)
    return None if path is None else read_noise_floor(path)


KL_PARTS = ((FORGET_KL, "KL(initial ‖ final)"), (FORGET_KL_DRIFT, "drift: KL(initial ‖ final, quantization off)"),
            (FORGET_KL_QUANTIZATION, "quantization: KL(final off ‖ final on)"),
            (FORGET_GENERATION_KL, "generation drift: KL(initial ‖ final) along the initial model's greedy continuations"))


def forget_kl_parts(run: Run) -> dict:
    """``{metric: (mean, low, high)}`` of ``forget/kl`` and its parts at the run's last validation (those logged)."""
    out = {}
    for name, _ in KL_PARTS:
        values = [run.last(k) for k in (name, f"{name}_low", f"{name}_high")]
        if None not in values:
            out[name] = values
    return out


def floor_verdict(floor: dict, low: float, high: float) -> str:
    """Words for a KL interval against a ``noise_floor.json``'s floor (:func:`qat_app.stats.floor_verdict`)."""
    text = floor["text"]
    return stats.floor_verdict(low, high, text["kl"]["high"] if text.get("quantized", True) else None)


def kl_baseline_qat(baseline: Run, qat: Run) -> dict | None:
    """``{mean, low, high, tokens}`` of KL(baseline || QAT) per token, or ``{note}`` when it cannot be had."""
    a, b = final_topk(baseline), final_topk(qat)
    if a is None or b is None:
        return None
    from qat_app.eval.kl_cache import TopKCacheError, kl_between

    try:
        mean, low, high, tokens = kl_between(str(a), str(b))
    except (TopKCacheError, OSError, ValueError) as err:
        return {"note": f"KL(baseline || QAT) not computed: {err}"}
    return {"mean": mean, "low": low, "high": high, "tokens": tokens, "files": [str(a), str(b)]}


def render_distortion(results: list[dict]) -> list[str]:
    """Markdown lines: one per QAT run that has the figure."""
    rows = [(r["label"], r["kl_baseline_qat"]) for r in results if r.get("kl_baseline_qat")]
    if not rows:
        return []
    lines = ["", "## KL(baseline || QAT) on held-out text", "",
             "Per token, nats, on the initial model's top-k tokens + the rest (a lower bound of the full-vocabulary "
             "KL); 95 % interval over sequences. 0 would be a QAT model that predicts exactly as its baseline.", ""]
    for label, kl in rows:
        if "note" in kl:
            lines.append(f"- `{label}`: {kl['note']}")
        else:
            lines.append(f"- `{label}`: {kl['mean']:.5f} [{kl['low']:.5f}, {kl['high']:.5f}] over {kl['tokens']} tokens")
    return lines


def _answers_changed(result: dict, task: str) -> tuple[int, int] | None:
    """(acc_norm answers changed baseline -> QAT, examples) from the report's quantization measures."""
    for key, entry in (result.get("measures", {}).get("quantization") or {}).items():
        row = (entry.get("measures") or {}).get("acc_norm") if key.split("/")[-1] == task else None
        if row and row.get("right_to_wrong") is not None:
            return row["right_to_wrong"] + row["wrong_to_right"], row["n"]
    return None


def _kl_part_lines(result: dict, floor: dict | None) -> list[str]:
    """``forget/kl`` and its parts at the last validation, the W8A8 ones read against ``floor``."""
    lines = []
    for name, what in KL_PARTS:
        if name in (result.get("forget_kl") or {}):
            mean, low, high = result["forget_kl"][name]
            words = "" if floor is None or name == FORGET_KL_DRIFT else f": {floor_verdict(floor, low, high)}"
            lines.append(f"  - `{name}` ({what}) {mean:.5f} [{low:.5f}, {high:.5f}]{words}")
    return lines


def render_floor(results: list[dict]) -> list[str]:
    """Markdown lines: each QAT run's BF16-vs-QAT KL and answer changes beside its noise floor."""
    rows = [(r["label"], r.get("noise_floor") or {"note": f"no {NOISE_FLOOR_FILE} (noise_floor.enabled false, or a "
                                                          "run from before it)"}, r)
            for r in results if r.get("noise_floor") or r.get("forget_kl")]
    if not rows:
        return []
    lines = ["", "## Against the noise floor of the arithmetic", "",
             "The QAT model against itself with its input embeddings x (1 + ε N(0,1)), ε a float rounding's size "
             "(measured at the end of its fit): a W8A8 forward flips grid points under any change of float rounding, "
             "so a BF16-vs-QAT difference is evidence of what quantization did only above this floor.", ""]
    for label, floor, result in rows:
        if "note" in floor:
            lines.append(f"- `{label}`: {floor['note']}")
            lines += _kl_part_lines(result, None)
            continue
        f = floor["text"]
        if not f.get("quantized", True):
            lines.append(f"- `{label}`: floor 0 ({f.get('note', 'unquantized')})")
            continue
        kl = f["kl"]
        line = (f"- `{label}`: floor KL {kl['difference']:.5f} [{kl['low']:.5f}, {kl['high']:.5f}] nats/token "
                f"(seeds {', '.join(map(str, f['seeds']))}, ε = {f['relative']:g}, {floor.get('seconds', 0):.0f} s)")
        distortion = result.get("kl_baseline_qat") or {}
        if "mean" in distortion:
            line += (f"; KL(baseline ‖ QAT) {distortion['mean']:.5f} is "
                     f"{floor_verdict(floor, distortion['low'], distortion['high'])}")
        lines.append(line)
        lines += _kl_part_lines(result, floor)
        for task, entry in ((floor.get("benchmarks") or {}).get("tasks") or {}).items():
            counts = entry["flips_acc_norm"]
            changed = _answers_changed(result, task)
            against = (f"; baseline → QAT changed {changed[0]} of {changed[1]}" if changed else "")
            lines.append(f"  - {task}: acc_norm answers changed by the floor's perturbation "
                         f"{'/'.join(map(str, counts))} of {entry['examples']} (mean {sum(counts) / len(counts):.1f})"
                         f"{against}")
    return lines
