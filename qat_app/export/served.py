"""What serving changes: the FP8 export's forward, emulated on the CPU, against the QAT model it came from.

The served forward is the export loaded by transformers (:func:`load_served`): compressed-tensors decompresses the
E4M3 weights (``e4m3 x weight_scale``) and quantizes every FP8 layer's input to E4M3 (clamp to +-448, round to
nearest even) before the matmul, per token at ``amax / 448`` (``--serve_target any``) or at its static
``input_scale`` (``cuda``), as vLLM's FP8 GEMM does (checked against vLLM itself by :mod:`.engine_check`); the rest runs
in the dtype it is loaded in: float32 (the default: the stored tensors and the FP8 numerics alone) or bfloat16
(vLLM's activations; the dequantized FP8 operands are then rounded to BF16 too, which vLLM does not do). vLLM's
fp32 accumulation of the E4M3 products on its tensor cores is not reproduced. The trained side is the QAT
model's eval forward (HiF8 at its delayed scales).

:func:`compare_served` measures on the same inputs:

* **text** (``batches`` of token ids; the run's held-out documents): the mean per-token full-vocabulary
  KL(trained || served) in nats, read against the trained model's noise floor on the same text
  (:mod:`qat_app.eval.noise_floor`: what float rounding alone changes), and both perplexities with the paired interval of their ratio (from the
  per-sequence mean NLL differences; each sequence one unit, since its tokens are not independent); for scale,
  KL(the trained weights unquantized || the trained HiF8 forward): what HiF8 itself changes;
* **benchmarks** (a :class:`~qat_app.data.benchmarks.BenchmarkDataModule`): per task, acc and acc_norm of both
  with the paired difference, its interval (clustered as the report clusters), the answer flips with McNemar's
  p, and the KL between the two models' choice distributions (:func:`qat_app.eval.measures.compare_records`).

:func:`render` writes it as Markdown; :func:`write_comparison` saves ``serving_check.md`` / ``.json``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import stats

CHECK_JSON, CHECK_MARKDOWN = "serving_check.json", "serving_check.md"
BENCHMARK_MEASURES = ("acc", "acc_norm", "kl_choices", "flips_acc")


def load_served(out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    """The FP8 export as transformers loads it (its compressed-tensors integration), in eval mode. Its FP8 layers
    hold E4M3 weights until the first forward, which decompresses them (``e4m3 x weight_scale``) and from then on
    quantizes their inputs to E4M3 at the export's scales (per token, or static)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()


@dataclass
class TextComparison:
    """The two models on the same token blocks: KL(trained || served) per token and the perplexities."""

    what: str
    sequences: int
    tokens: int  # predicted tokens
    kl: stats.PairedResult  # mean per-token KL in nats (a per-sequence mean, each sequence one unit)
    nll: stats.PairedResult  # served - trained mean NLL per token (before: trained, after: served)
    # for scale: KL(the trained weights unquantized || the trained HiF8 forward), what HiF8 itself changes
    quantization_kl: stats.PairedResult | None = None
    floor: Any = None  # qat_app.eval.noise_floor.NoiseFloor of the trained model on the same text

    @property
    def perplexities(self) -> tuple[float, float]:
        return math.exp(self.nll.before), math.exp(self.nll.after)

    @property
    def perplexity_ratio(self) -> stats.Ratio:
        """served / trained perplexity, and its interval."""
        return self.nll.ratio


@dataclass
class ServedComparison:
    text: TextComparison | None = None
    accuracies: dict[str, dict[str, float]] = field(default_factory=dict)  # {side: {metric: value}}
    # the run's noise_floor.json (qat_app.eval.records.read_noise_floor): benchmark answers the arithmetic changes
    run_floor: dict | None = None
    benchmarks: Any = None  # MeasureComparison: {task: {measure: PairedResult}}
    notes: list[str] = field(default_factory=list)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


@torch.no_grad()
def compare_on_text(trained: nn.Module, served: nn.Module, batches: list[torch.Tensor], what: str = "",
                    yardstick: bool = True) -> TextComparison:
    """Per sequence: the mean per-token KL(trained || served) and both mean next-token NLLs; with ``yardstick``
    also KL(trained weights unquantized || trained), for scale."""
    from ..hif8.health import full_kl
    from ..hif8.patch import quantization_off

    kl, nll_trained, nll_served, quantization_kl = [], [], [], []
    for ids in batches:
        a, b = _logits(trained, ids)[:, :-1], _logits(served, ids)[:, :-1]
        targets = ids[:, 1:, None]
        kl.append(full_kl(a, b).mean(1))
        nll_trained.append(-a.log_softmax(-1).gather(-1, targets).squeeze(-1).mean(1))
        nll_served.append(-b.log_softmax(-1).gather(-1, targets).squeeze(-1).mean(1))
        if yardstick:
            with quantization_off(trained):
                quantization_kl.append(full_kl(_logits(trained, ids)[:, :-1], a).mean(1))
    per_sequence = torch.cat(kl).double().numpy()
    return TextComparison(
        what=what, sequences=len(per_sequence), tokens=sum(ids[:, 1:].numel() for ids in batches),
        kl=stats.clustered_mean(per_sequence),
        nll=stats.paired_difference(torch.cat(nll_trained).double().numpy(), torch.cat(nll_served).double().numpy()),
        quantization_kl=stats.clustered_mean(torch.cat(quantization_kl).double().numpy()) if yardstick else None)


def benchmark_rows(model: nn.Module, benchmarks) -> tuple[dict[str, float], list[dict]]:
    from ..eval.evaluator import BenchmarkEvaluator, evaluate
    from ..eval.records import record_rows

    evaluator = BenchmarkEvaluator(benchmarks.task_names)
    with torch.no_grad():
        evaluate(model, benchmarks, evaluator=evaluator)  # the evaluator follows the model to its device
    results, records = evaluator.compute_with_records()
    rows = [row for task, columns in records.items()
            for row in record_rows(task, columns, benchmarks.examples(task), step=0)]
    return {key: float(value) for key, value in results.items()}, rows


def compare_on_benchmarks(trained: nn.Module, served: nn.Module, benchmarks):
    """-> ({"trained": metrics, "served": metrics}, the paired MeasureComparison served vs trained)."""
    from ..eval.measures import compare_records

    trained_metrics, trained_rows = benchmark_rows(trained, benchmarks)
    served_metrics, served_rows = benchmark_rows(served, benchmarks)
    return ({"trained": trained_metrics, "served": served_metrics},
            compare_records(trained_rows, served_rows, BENCHMARK_MEASURES))


def compare_served(trained: nn.Module, served: nn.Module, batches: list[torch.Tensor] | None = None,
                   benchmarks=None, text_what: str = "") -> ServedComparison:
    """Both comparisons (either may be left out: no batches, no benchmark datamodule)."""
    trained.eval()
    served.eval()
    comparison = ServedComparison()
    if batches:
        from ..eval.noise_floor import noise_floor

        comparison.text = compare_on_text(trained, served, batches, text_what)
        comparison.text.floor = noise_floor(trained, batches)
    if benchmarks is not None:
        comparison.accuracies, comparison.benchmarks = compare_on_benchmarks(trained, served, benchmarks)
    return comparison


def _interval(result: stats.PairedResult, spec: str = "+.4f") -> str:
    return f"{result.difference:{spec}} [{result.low:{spec}}, {result.high:{spec}}]"


def render(comparison: ServedComparison, title: str = "Served (FP8 E4M3, compressed-tensors) vs trained (HiF8 QAT)") -> str:
    """Markdown: the text measures and the per-task benchmark differences, each with its 95% interval and
    whether it is inside the noise."""
    from ..eval.measures import verdict

    lines = [f"## {title}", ""]
    text = comparison.text
    if text is not None:
        ppl_trained, ppl_served = text.perplexities
        ratio, low, high = text.perplexity_ratio
        lines += [
            f"Text: {text.what}; {text.sequences} sequences, {text.tokens} predicted tokens; intervals 95%, each "
            "sequence one unit.",
            "",
            "| measure | trained | served | served vs trained (95% CI) | verdict |",
            "|---|---|---|---|---|",
            f"| mean per-token KL(trained ‖ served), nats | | | {_interval(text.kl, '.5f')} | "
            f"{text.floor.verdict(text.kl) if text.floor is not None else ('> 0' if text.kl.low > 0 else 'inside the noise')} |",
            *([f"| noise floor: KL(trained ‖ trained, inputs x (1 + {text.floor.relative:g} N(0,1))), nats | | | "
               f"{_interval(text.floor.kl, '.5f')} | {len(text.floor.seeds)} seeds, {text.floor.seconds:.0f} s |"]
              if text.floor is not None and text.floor.quantized else []),
            *([f"| for scale: KL(trained weights unquantized ‖ trained HiF8), nats | | | "
               f"{_interval(text.quantization_kl, '.5f')} | what HiF8 itself changes |"] if text.quantization_kl else []),
            f"| perplexity | {ppl_trained:.4f} | {ppl_served:.4f} | ratio {ratio:.5f} [{low:.5f}, {high:.5f}] | "
            f"{stats.verdict((text.nll.low, text.nll.high), higher_is_better=False)} |",
            f"| mean NLL per token, nats | {text.nll.before:.5f} | {text.nll.after:.5f} | {_interval(text.nll, '+.5f')} | |",
            "",
        ]
    if comparison.benchmarks is not None:
        lines += ["Benchmarks (the same examples; served - trained, 95% CI clustered as the report clusters):", "",
                  "| task | n | acc trained | acc served | acc difference | flips right->wrong / wrong->right (McNemar p) "
                  "| acc_norm difference | KL of choices, nats | verdict (acc) | acc answers changed by the floor's "
                  "perturbation, per seed |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        floor_tasks = floor_tasks_of(comparison.run_floor)
        for task, results in comparison.benchmarks.items():
            acc, norm, kl = results.get("acc"), results.get("acc_norm"), results.get("kl_choices")
            lines.append(
                f"| {task} | {acc.n if acc else ''} | {acc.before:.4f} | {acc.after:.4f} | {_interval(acc)} | "
                f"{flips_text(results.get('flips_acc'))} | {_interval(norm) if norm else ''} | "
                f"{_interval(kl, '.5f') if kl else ''} | {verdict('acc', acc)} | {floor_flips(floor_tasks.get(task))} |")
        lines += floor_note(comparison.run_floor, "serving")
        lines.append("")
    lines += [f"- {note}" for note in comparison.notes]
    return "\n".join(lines).rstrip() + "\n"


def floor_note(run_floor: dict | None, what: str) -> list[str]:
    """The line under a benchmark table that names where the floor's answers come from."""
    if run_floor is None:
        return []
    return ["", f"The floor's answers: {run_floor.get('note') or run_floor['file']} (the trained model against itself "
                f"under a float-rounding-sized perturbation, at the end of its fit): flips of that order are the "
                f"arithmetic's, not the {what}'s."]


def floor_tasks_of(run_floor: dict | None) -> dict[str, dict]:
    """The run's floor entries per benchmark task (empty: no floor measured on the benchmarks)."""
    return ((run_floor or {}).get("benchmarks") or {}).get("tasks") or {}


def flips_text(flips) -> str:
    """A task's answers flipped right -> wrong / wrong -> right with McNemar's p (``3 / 1 (p 0.62)``), or ''."""
    if flips is None or flips.right_to_wrong is None:
        return ""
    return f"{flips.right_to_wrong} / {flips.wrong_to_right} (p {flips.mcnemar_p:.2f})"


def floor_flips(entry: dict | None) -> str:
    """A task's acc answers changed by the run's floor perturbation, per seed (`2/0/1 of 40`), or ''."""
    return "" if not entry else f"{'/'.join(map(str, entry['flips_acc']))} of {entry['examples']}"


def write_comparison(comparison: ServedComparison, out_dir: str | os.PathLike) -> list[str]:
    """``serving_check.md`` and ``serving_check.json`` in ``out_dir`` -> their paths."""
    out = Path(out_dir)
    document: dict[str, Any] = {"notes": comparison.notes, "accuracies": comparison.accuracies,
                                "run_noise_floor": comparison.run_floor}
    if comparison.text is not None:
        text = comparison.text
        document["text"] = {"what": text.what, "sequences": text.sequences, "tokens": text.tokens,
                            "kl": stats.jsonable(text.kl), "nll": stats.jsonable(text.nll),
                            "quantization_kl": stats.jsonable(text.quantization_kl),
                            "noise_floor": None if text.floor is None else {
                                **text.floor.to_dict(), "verdict": text.floor.verdict(text.kl)},
                            "perplexity": dict(zip(("trained", "served"), text.perplexities)),
                            "perplexity_ratio": dict(zip(("value", "low", "high"), text.perplexity_ratio))}
    if comparison.benchmarks is not None:
        document["benchmarks"] = {task: {name: stats.jsonable(r) for name, r in results.items()}
                                  for task, results in comparison.benchmarks.items()}
    (out / CHECK_JSON).write_text(json.dumps(document, indent=1))
    (out / CHECK_MARKDOWN).write_text(render(comparison))
    return [str(out / CHECK_MARKDOWN), str(out / CHECK_JSON)]
