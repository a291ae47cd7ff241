"""The noise floor of a W8A8 forward: how much a quantized model disagrees with itself when nothing changes but
float rounding.

A quantized forward is chaotic in its inputs' last bits: an input near the midpoint of two grid values rounds the
other way under any change of float rounding (another GEMM order, another dtype, another kernel), one grid step is
1/16 to 1/2 of the value, and the flips cascade through the blocks. So two implementations of the same W8A8
model (the trained forward and its served copy, an emulation and an engine) differ by this floor from arithmetic
alone, and a comparison is only evidence of a real difference above it.

The perturbation: the input embeddings' output multiplied by ``1 + relative x N(0, 1)`` (default ``relative``
1e-7: a float32 rounding's size; drawn from a CPU generator per ``seed``, so the same on every device), which
leaves an unquantized model's output unchanged to ~1e-14 nats and moves a quantized one by its floor.
:func:`noise_floor` measures, over ``seeds`` (at least 2) and the given token blocks, the mean per-token
full-vocabulary KL(model || perturbed model) with its interval (each sequence one cluster across the seeds) and
the perplexity ratio of each seed with its paired interval. An unquantized model's floor is 0 by definition
(nothing rounds onto a grid): it is returned as exactly 0 without a forward, with a note saying so.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import stats
from ..errors import QATError
from ..hif8.health import full_kl

DEFAULT_RELATIVE = 1e-7
DEFAULT_SEEDS = (0, 1, 2)
MAX_RELATIVE = 1e-3


class NoiseFloorError(QATError):
    """A noise-floor setting out of range (one line naming it)."""


def check_settings(relative: float, seeds) -> tuple[float, tuple[int, ...]]:
    if not (isinstance(relative, (int, float)) and 0.0 < relative <= MAX_RELATIVE):
        raise NoiseFloorError(f"noise_floor.relative: must lie in (0, {MAX_RELATIVE:g}], got {relative!r} (a float "
                              "rounding's size, 1e-7, is the default)")
    seeds = tuple(int(s) for s in seeds)
    if len(set(seeds)) < 2:
        raise NoiseFloorError(f"noise_floor.seeds: at least 2 distinct seeds for an interval, got {list(seeds)}")
    return float(relative), seeds


@dataclass
class NoiseFloor:
    """What a model's forward changes under the perturbation, per token (nats) and in perplexity."""

    quantized: bool
    relative: float
    seeds: tuple[int, ...]
    kl: stats.PairedResult  # mean per-token KL(model || perturbed), every (seed, sequence) a value, sequences clusters
    perplexity_ratios: list[tuple[float, float, float]] = field(default_factory=list)  # per seed: (ratio, low, high)
    seconds: float = 0.0
    note: str = ""

    def describe(self) -> str:
        if not self.quantized:
            return f"noise floor 0 ({self.note})"
        return (f"noise floor of the arithmetic (inputs x (1 + {self.relative:g} N(0,1)), seeds "
                f"{', '.join(map(str, self.seeds))}): KL {self.kl.difference:.5f} [{self.kl.low:.5f}, {self.kl.high:.5f}] "
                f"nats/token; perplexity ratios {self.ratios_text()}")

    def to_dict(self) -> dict:
        """The floor as JSON values (the files of ``export --compare``, the engine check and a fit)."""
        return {"quantized": self.quantized, "relative": self.relative, "seeds": list(self.seeds),
                "kl": stats.jsonable(self.kl),
                "perplexity_ratios": [list(r) for r in self.perplexity_ratios], "seconds": self.seconds,
                "note": self.note}

    def verdict(self, result: stats.PairedResult) -> str:
        """Words for a KL comparison read against this floor (:func:`qat_app.stats.floor_verdict`)."""
        return stats.floor_verdict(result.low, result.high, self.kl.high if self.quantized else None)

    def ratios_text(self) -> str:
        """Each seed's perplexity ratio with its interval."""
        return ", ".join(f"{r:.4f} [{lo:.4f}, {hi:.4f}]" for r, lo, hi in self.perplexity_ratios)


def _zero(relative: float, seeds: tuple[int, ...], note: str) -> NoiseFloor:
    zero = stats.PairedResult(difference=0.0, se=0.0, low=0.0, high=0.0, n=0, n_clusters=0, z=math.nan)
    return NoiseFloor(quantized=False, relative=relative, seeds=seeds, kl=zero, note=note)


def _quantizes(model: nn.Module) -> bool:
    from ..hif8.patch import quantized_linears

    return any(layer.quantizes_forward() for _, layer in quantized_linears(model))


@contextmanager
def perturbed_inputs(model: nn.Module, relative: float, seed: int):
    """The model with its input embeddings' output multiplied by ``1 + relative x N(0, 1)`` (seeded, CPU draw)."""
    generator = torch.Generator().manual_seed(seed)

    def hook(_module, _args, output):
        noise = torch.randn(output.shape, generator=generator, dtype=torch.float32).to(output.device)
        return output * (1 + relative * noise).to(output.dtype)

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def noise_floor(model: nn.Module, batches: list[torch.Tensor], seeds=DEFAULT_SEEDS, relative: float = DEFAULT_RELATIVE,
                quantized: bool | None = None, forward=None) -> NoiseFloor:
    """The floor of ``model`` on ``batches`` of token ids (module doc). ``quantized``: whether the model rounds
    onto a grid (default: it holds a HiF8 layer with quantization on; pass True for a served FP8 model).
    ``forward``: ids -> logits (default ``model(input_ids=ids).logits``; e.g. under a precision context)."""
    relative, seeds = check_settings(relative, seeds)
    if quantized is None:
        quantized = _quantizes(model)
    if not quantized:
        return _zero(relative, seeds, "an unquantized model rounds nothing onto a grid: its forward is unchanged")
    started = time.perf_counter()
    model.eval()
    forward = forward or (lambda ids: model(input_ids=ids).logits)
    references = [forward(ids).float()[:, :-1] for ids in batches]
    kl, clusters, ratios = [], [], []
    for seed in seeds:
        nll_ref, nll_perturbed = [], []
        with perturbed_inputs(model, relative, seed):
            first = 0
            for ids, reference in zip(batches, references):
                perturbed = forward(ids).float()[:, :-1]
                kl.extend(full_kl(reference, perturbed).mean(1).tolist())
                clusters.extend(range(first, first + len(ids)))
                first += len(ids)
                targets = ids[:, 1:, None]
                nll_ref.extend((-reference.double().log_softmax(-1).gather(-1, targets)).squeeze(-1).mean(1).tolist())
                nll_perturbed.extend((-perturbed.double().log_softmax(-1).gather(-1, targets)).squeeze(-1).mean(1).tolist())
        nll = stats.paired_difference(nll_ref, nll_perturbed)
        ratios.append(nll.ratio)
    return NoiseFloor(quantized=True, relative=relative, seeds=seeds, kl=stats.clustered_mean(kl, clusters),
                      perplexity_ratios=ratios, seconds=time.perf_counter() - started)


# ------------------------------------------------------------------------------------------ benchmark answers
@dataclass
class AnswerFlips:
    """Benchmark answers the perturbation changes. Per task: the examples scored and, per seed, how many answers
    differ from the unperturbed model's: ``acc_norm`` ones (argmax of the length-normalised log-likelihood,
    lm-eval's headline) and ``acc`` ones (argmax of the log-likelihood)."""

    seeds: tuple[int, ...]
    examples: dict[str, int]
    flips_norm: dict[str, list[int]]
    flips: dict[str, list[int]]
    seconds: float = 0.0

    def total(self, norm: bool = True) -> tuple[int, list[int]]:
        """-> (examples over all tasks, answers changed per seed)."""
        per_task = self.flips_norm if norm else self.flips
        return sum(self.examples.values()), [sum(per_task[t][i] for t in per_task) for i in range(len(self.seeds))]

    def changed_text(self) -> str:
        """``6/6/8 of 160 (arc_challenge 1/1/2 of 40; ...)``: acc_norm answers changed per seed, in all and by task."""
        n, changed = self.total()
        tasks = "; ".join(f"{t} {'/'.join(map(str, self.flips_norm[t]))} of {self.examples[t]}" for t in self.examples)
        return f"{'/'.join(map(str, changed))} of {n} ({tasks})"

    def describe(self) -> str:
        return (f"benchmark answers (acc_norm) changed by the perturbation, seeds {', '.join(map(str, self.seeds))}: "
                f"{self.changed_text()}")

    def to_dict(self) -> dict:
        return {"seeds": list(self.seeds), "seconds": self.seconds,
                "tasks": {t: {"examples": self.examples[t], "flips_acc_norm": self.flips_norm[t],
                              "flips_acc": self.flips[t]} for t in self.examples}}


def _answers(model: nn.Module, loaders, task_names: list[str]) -> dict[str, dict[int, tuple[int, int]]]:
    """{task: {example id: (acc answer, acc_norm answer)}} over every loader (all ranks' examples when distributed)."""
    from .evaluator import BenchmarkEvaluator, move_batch

    device = next(model.parameters()).device
    evaluator = BenchmarkEvaluator(task_names).to(device)
    for loader in loaders:
        for batch in loader:
            evaluator.update(model, move_batch(batch, device))
    _, records = evaluator.compute_with_records()
    return {task: {int(i): (int(a), int(b)) for i, a, b in zip(r["example_id"].tolist(), r["pred"].tolist(),
                                                               r["pred_norm"].tolist())}
            for task, r in records.items()}


@torch.no_grad()
def answer_flips(model: nn.Module, loaders, task_names: list[str], seeds=DEFAULT_SEEDS,
                 relative: float = DEFAULT_RELATIVE) -> AnswerFlips:
    """How many of the benchmark answers of ``model`` on ``loaders`` (benchmark batches, as
    :class:`qat_app.eval.evaluator.BenchmarkEvaluator` scores them) change under the perturbation, per seed."""
    relative, seeds = check_settings(relative, seeds)
    started = time.perf_counter()
    model.eval()
    reference = _answers(model, loaders, task_names)
    examples = {task: len(answers) for task, answers in reference.items()}
    flips_norm: dict[str, list[int]] = {task: [] for task in reference}
    flips: dict[str, list[int]] = {task: [] for task in reference}
    for seed in seeds:
        with perturbed_inputs(model, relative, seed):
            perturbed = _answers(model, loaders, task_names)
        for task, answers in reference.items():
            other = perturbed.get(task, {})
            flips[task].append(sum(other.get(i, (None, None))[0] != a for i, (a, _) in answers.items()))
            flips_norm[task].append(sum(other.get(i, (None, None))[1] != b for i, (_, b) in answers.items()))
    return AnswerFlips(seeds, examples, flips_norm, flips, time.perf_counter() - started)
