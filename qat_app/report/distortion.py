"""KL(baseline || QAT) on held-out text: the quantization's own distortion of the next-token distribution.

Every fit keeps its final validation's log-probabilities at the initial model's top-k tokens (plus the rest
of the vocabulary as one bucket) in ``<log_dir>/final_topk.pt`` (:mod:`qat_app.eval.kl_cache`); two runs that
started from the same model on the same validation text share that top-k partition, so the KL between their
coarse-grained distributions is a lower bound of the full-vocabulary KL(baseline || QAT), with an interval
over sequences like ``forget/kl``. torch is imported only when both runs have the file.
"""

from __future__ import annotations

from pathlib import Path

from ..eval.records import FINAL_TOPK_FILE
from .runs import Run


def final_topk(run: Run) -> Path | None:
    """The newest ``final_topk.pt`` among the run's logger versions (a resumed run's last version first)."""
    for metrics in reversed(run.files):
        candidate = Path(metrics).parent / FINAL_TOPK_FILE
        if candidate.is_file():
            return candidate
    return None


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
