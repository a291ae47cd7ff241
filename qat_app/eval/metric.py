"""DDP-correct multiple-choice accuracy: :class:`MultipleChoiceMetric` (torchmetrics), each example once.

``acc`` takes the argmax of each example's summed choice log-likelihoods, ``acc_norm`` of the sums divided
by the choices' lengths in characters (computed by :func:`qat_app.eval.evaluator.score_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

# Width of the per-example log-likelihood state (a fixed width so ranks can concatenate it).
MAX_RECORDED_CHOICES = 8


@dataclass
class ScoredBatch:
    """The result of :func:`qat_app.eval.evaluator.score_batch`, what :class:`MultipleChoiceMetric` records."""

    choice_loglik: torch.Tensor  # [M] summed log-prob of each choice's continuation
    loglik: torch.Tensor  # [E, max_choices], -inf where an example has fewer choices
    pred: torch.Tensor  # [E] argmax of loglik
    pred_norm: torch.Tensor  # [E] argmax of loglik / choice length in characters
    correct: torch.Tensor  # [E] bool
    correct_norm: torch.Tensor  # [E] bool


class MultipleChoiceMetric(Metric):
    """acc / acc_norm over examples, each counted once however often it was seen.

    Lightning's DistributedSampler pads the last batch with repeats of earlier examples; states are
    concatenated across ranks and de-duplicated by ``example_id`` in :meth:`compute`.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, num_subjects: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.num_subjects = num_subjects
        # float/long states: gloo cannot all-gather bool tensors; after the four of the accuracy, the per-example
        # records (lm-eval's --log_samples): gold, both predictions, every choice's loglik
        for name in ("example_ids", "correct", "correct_norm", "subject_ids", "gold", "pred", "pred_norm", "loglik"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self,
        example_ids: torch.Tensor,
        correct: torch.Tensor,
        correct_norm: torch.Tensor,
        subject_ids: torch.Tensor | None = None,
        scored: "ScoredBatch | None" = None,
        gold: torch.Tensor | None = None,
    ) -> None:
        self.example_ids.append(example_ids.long())
        self.correct.append(correct.float())
        self.correct_norm.append(correct_norm.float())
        self.subject_ids.append(torch.zeros_like(example_ids) if subject_ids is None else subject_ids.long())
        if scored is not None and gold is not None:
            width = scored.loglik.shape[1]
            if width > MAX_RECORDED_CHOICES:
                raise ValueError(f"{width} choices per example; per-example records hold at most {MAX_RECORDED_CHOICES}")
            loglik = torch.full((scored.loglik.shape[0], MAX_RECORDED_CHOICES), float("-inf"),
                                device=scored.loglik.device)
            loglik[:, :width] = scored.loglik.float()
            self.gold.append(gold.long())
            self.pred.append(scored.pred.long())
            self.pred_norm.append(scored.pred_norm.long())
            self.loglik.append(loglik)

    def compute(self) -> dict[str, torch.Tensor]:
        """Aggregates, plus ``records``: per distinct example (sorted by id) its id, gold, predictions,
        correctness and log-likelihoods, when they were given to :meth:`update`."""
        example_ids = dim_zero_cat(self.example_ids)
        first = first_occurrences(example_ids)
        correct = dim_zero_cat(self.correct)[first]
        correct_norm = dim_zero_cat(self.correct_norm)[first]
        result = {
            "acc": correct.mean(),
            "acc_norm": correct_norm.mean(),
            "count": torch.tensor(float(first.numel()), device=correct.device),
        }
        if len(self.gold) > 0:  # a list of batches, or one tensor once synced across ranks
            result["records"] = {
                "example_id": example_ids[first], "gold": dim_zero_cat(self.gold)[first],
                "pred": dim_zero_cat(self.pred)[first], "pred_norm": dim_zero_cat(self.pred_norm)[first],
                "acc": correct, "acc_norm": correct_norm, "loglik": dim_zero_cat(self.loglik)[first],
            }
        if self.num_subjects:
            subjects = dim_zero_cat(self.subject_ids)[first]
            result["subject_count"] = torch.bincount(subjects, minlength=self.num_subjects).float()
            result["subject_correct"] = torch.bincount(subjects, weights=correct, minlength=self.num_subjects)
            result["subject_correct_norm"] = torch.bincount(subjects, weights=correct_norm, minlength=self.num_subjects)
        return result


def first_occurrences(ids: torch.Tensor) -> torch.Tensor:
    """Index of the first occurrence of every distinct value of ``ids`` (sorted by value)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    positions = torch.arange(ids.numel(), device=ids.device)
    first = torch.full((unique.numel(),), ids.numel(), dtype=torch.long, device=ids.device)
    return first.scatter_reduce(0, inverse, positions, reduce="amin")
