"""Log-likelihood scoring of multiple-choice benchmark batches, with DDP-correct torchmetrics.

Batches come from :class:`qat_app.data.benchmarks.BenchmarkDataModule` (layout: :mod:`qat_app.eval.layout`). Each choice is scored by the
summed log-probability of its continuation tokens, as lm-evaluation-harness does; ``acc`` takes the
argmax of that sum, ``acc_norm`` of the sum divided by the choice's length in characters. MMLU's
overall ``acc`` is the mean over all its examples, i.e. subjects weighted by size, as lm-eval's
``mmlu`` group reports it (``weight_by_size: True``).

Usage inside a LightningModule::

    self.benchmarks = BenchmarkEvaluator(datamodule.task_names)
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if "benchmark" in batch:
            self.benchmarks.update(self.model, batch)
    def on_validation_epoch_end(self):
        self.log_dict(self.benchmarks.compute())  # already synced across ranks: sync_dist not needed
        self.benchmarks.reset()
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning
import torch
from torch import nn

from qat_app.eval.layout import choice_logliks, packed_attention_mask, target_logprobs
from qat_app.eval.metric import MultipleChoiceMetric, ScoredBatch
from qat_app.eval.mmlu import MMLU_CATEGORIES, MMLU_SUBJECT_CATEGORIES, MMLU_SUBJECTS


@dataclass(frozen=True)
class _ForwardSupport:
    position_ids: bool
    logits_to_keep: bool
    use_cache: bool
    cache_argument: str | None  # "cache" (transformers >= 5.2x) or "past_key_values"; None: no KV reuse


def _forward_support(model: nn.Module) -> _ForwardSupport:
    parameters = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    # the rest only when named: a **kwargs wrapper may forward them somewhere that rejects them
    cache_argument = next((name for name in ("cache", "past_key_values") if name in parameters), None)
    if _sharded(model):
        # every forward of an FSDP2 model is a collective (its blocks all-gather their weights): a prefix forward
        # that one rank's batch shares and another's does not would leave the ranks waiting on each other, so a
        # sharded model puts the prefix back in front of every row (the same scores, one forward a batch)
        cache_argument = None
    return _ForwardSupport(
        position_ids="position_ids" in parameters or takes_any,
        logits_to_keep="logits_to_keep" in parameters,
        use_cache="use_cache" in parameters,
        cache_argument=cache_argument if "use_cache" in parameters else None,
    )


def _sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2-sharded blocks (``fully_shard``) in a process group of several ranks."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def forward_logits(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """Run the model on a benchmark batch; returns logits and the row position of logits[:, 0]."""
    input_ids = batch["input_ids"]
    support = _forward_support(model)
    kwargs: dict[str, Any] = {}
    if batch["layout"] == "packed":
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
        if "flash" in attention or "flex" in attention:
            # these kernels take no arbitrary 4-D mask: score with SDPA (same maths), then switch back
            if not hasattr(model, "set_attn_implementation"):
                raise ValueError(
                    f"{type(model).__name__} uses {attention!r} attention, which cannot take the packed 4-D "
                    "attention mask; build BenchmarkDataModule(pack_choices=False)"
                )
            model.set_attn_implementation("sdpa")
            try:
                return forward_logits(model, batch)
            finally:
                model.set_attn_implementation(attention)
        if not support.position_ids:
            raise ValueError(
                f"{type(model).__name__}.forward takes no position_ids, so it cannot score packed rows; "
                "build BenchmarkDataModule(pack_choices=False)"
            )
        # SDPA takes a boolean mask; eager attention adds the mask to its scores
        mask_dtype = None if attention == "sdpa" else _model_dtype(model)
        segment_ids, position_ids = batch["segment_ids"], batch["position_ids"]
        prefix = batch.get("prefix_ids")
        prefix_length = 0 if prefix is None else prefix.numel()
        prefix_cache = _run_prefix(model, prefix, input_ids.shape[0], support) if prefix_length else None
        if prefix_length and prefix_cache is None:
            # no KV-cache reuse possible: put the prefix back in front of every row (same result, no saving)
            rows = input_ids.shape[0]
            input_ids = torch.cat([prefix.expand(rows, -1), input_ids], dim=1)
            segment_ids = torch.cat([segment_ids.new_zeros(rows, prefix_length), segment_ids], dim=1)
            prefix_positions = torch.arange(prefix_length, device=position_ids.device).expand(rows, -1)
            position_ids = torch.cat([prefix_positions, position_ids], dim=1)
            prefix_length = 0
        if prefix_cache is not None:
            kwargs[support.cache_argument] = prefix_cache
            kwargs["use_cache"] = True  # some models only read a given cache when asked to use one
        kwargs["attention_mask"] = packed_attention_mask(segment_ids, mask_dtype, prefix_length)
        kwargs["position_ids"] = position_ids
        if support.logits_to_keep:
            kwargs["logits_to_keep"] = int(batch["logits_to_keep"])
    else:
        kwargs["attention_mask"] = batch["attention_mask"]
    if support.use_cache and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    output = model(input_ids=input_ids, **kwargs)
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, (tuple, list)) else output
    return logits, batch["input_ids"].shape[1] - logits.shape[1]


def _run_prefix(model: nn.Module, prefix: torch.Tensor, rows: int, support: _ForwardSupport):
    """KV cache of the shared prefix, repeated for every row; None if the model offers no usable cache."""
    if support.cache_argument is None:
        return None
    kwargs = {"logits_to_keep": 1} if support.logits_to_keep else {}
    output = model(input_ids=prefix[None], use_cache=True, **kwargs)
    cache = getattr(output, "cache", None)  # transformers >= 5.2x; "past_key_values" is its deprecated alias
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        return None
    cache.batch_repeat_interleave(rows)
    return cache


@torch.no_grad()
def score_batch(model: nn.Module, batch: Mapping[str, Any]) -> ScoredBatch:
    """Summed continuation log-likelihood of every choice in the batch, and the predictions."""
    logits, offset = forward_logits(model, batch)
    token_logprobs = target_logprobs(logits, batch, offset)
    choice_loglik, loglik, char_length = choice_logliks(batch, token_logprobs)
    pred = loglik.argmax(1)  # first maximum on ties, like numpy's argmax in lm-eval
    pred_norm = (loglik / char_length).argmax(1)
    gold = batch["gold"]
    return ScoredBatch(choice_loglik, loglik, pred, pred_norm, pred == gold, pred_norm == gold)


class BenchmarkEvaluator(nn.Module):
    """Scores benchmark batches and keeps one :class:`MultipleChoiceMetric` per task.

    A ``nn.Module`` so the metrics follow the LightningModule to its device.
    """

    def __init__(self, task_names: list[str]):
        super().__init__()
        self.task_names = list(task_names)
        self.metrics = nn.ModuleDict(
            {task: MultipleChoiceMetric(num_subjects=len(MMLU_SUBJECTS) if task == "mmlu" else 0) for task in task_names}
        )

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        task = batch["benchmark"]
        if task not in self.metrics:
            raise ValueError(f"batch of task {task!r}, but this evaluator tracks {self.task_names}")
        scored = score_batch(model, batch)
        self.metrics[task].update(batch["example_id"], scored.correct, scored.correct_norm, batch["subject_index"],
                                  scored=scored, gold=batch["gold"])

    def compute(self) -> dict[str, torch.Tensor]:
        """``<task>/acc``, ``<task>/acc_norm``, ``<task>/count``; for MMLU also ``mmlu/<subject>/acc`` and
        lm-eval's category groups ``mmlu_<category>/acc`` (both weighted by size). Tasks without any
        update since the last reset are left out."""
        return self.compute_with_records()[0]

    def compute_with_records(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """:meth:`compute` and, per task, the per-example records of all ranks (each example once)."""
        results: dict[str, torch.Tensor] = {}
        records: dict[str, dict[str, torch.Tensor]] = {}
        for task, metric in self.metrics.items():
            if metric.update_count == 0:
                continue
            values = metric.compute()
            for name in ("acc", "acc_norm", "count"):
                results[f"{task}/{name}"] = values[name]
            if task == "mmlu":
                results.update(_mmlu_breakdown(values))
            if "records" in values:
                records[task] = values["records"]
        return results, records

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()


def _mmlu_breakdown(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    counts, correct = values["subject_count"], values["subject_correct"]
    results = {}
    present = counts > 0
    for index in torch.nonzero(present).flatten().tolist():
        results[f"mmlu/{MMLU_SUBJECTS[index]}/acc"] = correct[index] / counts[index]
    for category in MMLU_CATEGORIES:
        members = torch.tensor(
            [MMLU_SUBJECT_CATEGORIES[subject] == category for subject in MMLU_SUBJECTS], device=counts.device
        )
        total = counts[members].sum()
        if total > 0:
            results[f"mmlu_{category}/acc"] = correct[members].sum() / total
    return results


def move_batch(batch: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def evaluate(
    model: nn.Module,
    datamodule,
    stage: str = "validate",
    evaluator: BenchmarkEvaluator | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Plain loop (no Trainer) over the datamodule's val or test loaders, every example in this one process;
    returns metrics as floats."""
    datamodule.setup(stage)
    if callable(getattr(datamodule, "loaders", None)):  # a BenchmarkDataModule: unsharded, whatever trainer it has
        loaders = datamodule.loaders()
    else:
        loaders = datamodule.val_dataloader() if stage == "validate" else datamodule.test_dataloader()
    evaluator = evaluator or BenchmarkEvaluator(datamodule.task_names)
    device = next(model.parameters()).device
    evaluator.to(device)
    evaluator.reset()
    was_training = model.training
    model.eval()  # dropout would corrupt the likelihoods
    try:
        for loader in loaders:
            batches: Iterable = loader
            if progress:
                from tqdm.auto import tqdm

                batches = tqdm(loader, desc=loader.dataset.task)
            for batch in batches:
                evaluator.update(model, move_batch(batch, device))
    finally:
        model.train(was_training)
    return {key: float(value) for key, value in evaluator.compute().items()}


class BenchmarkValidationModule(lightning.LightningModule):
    """Minimal LightningModule that only runs benchmarks on a given model (e.g. a plain HF model),
    so ``Trainer.validate``/``test`` score it exactly as a QAT run is scored during fit."""

    def __init__(self, model: nn.Module, task_names: list[str], log_prefix: str = "val/"):
        super().__init__()
        self.model = model
        self.benchmarks = BenchmarkEvaluator(task_names)
        self.log_prefix = log_prefix

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.benchmarks.update(self.model, batch)

    test_step = validation_step

    def _log_and_reset(self, prefix: str) -> None:
        values = self.benchmarks.compute()  # synced across ranks by torchmetrics
        self.log_dict({f"{prefix}{key}": value for key, value in values.items()}, sync_dist=False)
        self.benchmarks.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_and_reset(self.log_prefix)

    def on_test_epoch_end(self) -> None:
        self._log_and_reset(self.log_prefix.replace("val", "test"))
