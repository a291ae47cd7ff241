"""AmaxSaturationCallback: per-step saturation and a_hat-vs-amax logging, plus a JSON summary.

Once per optimizer step (the first ``on_train_batch_end`` after ``global_step`` moved, i.e. after
the scalers advanced) it reads the last completed step of every scaler in ONE device->host copy,
the element counts summed over the data-parallel ranks first (one SUM all-reduce), and logs to
every Lightning logger:
  sat/clipped, sat/clipped_frac, sat/events    totals over all quantized tensors (every step)
  sat/min_headroom                             min over tensors of a_hat / amax (quantized steps)
  sat/<layer>.<tensor>/clipped_frac            per layer and tensor (input, weight, grad)
  amax/<layer>.<tensor>, a_hat/<layer>.<tensor> true amax vs the estimate it was quantized with
(per-layer keys every ``log_every_n_steps``; a_hat only once the tensor is quantized). "Clipped"
means the clamp changed the quantized value (:mod:`qat_app.hif8.fake_quant`); fractions are of the
elements of quantized forwards only (the BF16 warmup quantizes nothing). At the end of fit it writes
``saturation_summary.json`` (run totals, per tensor and overall) into the logger's directory.
"""

from __future__ import annotations

import json
import logging
import math
import os

import lightning as L
import torch
import torch.distributed as dist

from qat_app.hif8.patch import quantized_linears
from qat_app.hif8.scaling import sum_over_ranks

log = logging.getLogger(__name__)
# per step: (amax, a_hat, headroom) are identical on every rank; the element counts are summed
FIELDS = ("last_amax", "last_a_hat", "last_headroom")
COUNT_FIELDS = ("last_clipped", "last_numel")
TOTAL_FIELDS = ("saturation_events", "quantized_steps", "min_headroom", "a_hat", "scale", "steps_recorded")
TOTAL_COUNT_FIELDS = ("total_clipped", "total_numel")


def _short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def named_scalers(model) -> list[tuple[str, object]]:
    pairs = []
    for name, layer in quantized_linears(model):
        for tensor, scaler in (("input", layer.input_scaler), ("weight", layer.weight_scaler), ("grad", layer.grad_scaler)):
            if scaler is not None:
                pairs.append((f"{_short(name)}.{tensor}", scaler))
    return pairs


def gather(pairs, fields, count_fields=()) -> list[list[float]]:
    """All requested buffers of all scalers in one host transfer; ``count_fields`` (appended after
    ``fields``) summed over the data-parallel ranks first. A collective when ``count_fields`` is given:
    call it on every rank.

    Each rank quantizes its own share of the activations and gradients, so theirs are summed; the
    weight is the same tensor on every rank (replicated, or unsharded for the forward under FSDP), so
    its counts are rank 0's alone, as one process would count them.
    """
    if not pairs:
        return []
    stacked = torch.stack([torch.stack([getattr(s, f).double() for f in fields]) for _, s in pairs])
    if count_fields:
        counts = torch.stack([torch.stack([getattr(s, f).double() for f in count_fields]) for _, s in pairs])
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            replicated = torch.tensor([name.endswith(".weight") for name, _ in pairs], device=counts.device)
            counts = counts.masked_fill(replicated[:, None], 0.0)
        stacked = torch.cat([stacked, sum_over_ranks(counts)], dim=1)
    return stacked.cpu().tolist()


class AmaxSaturationCallback(L.Callback):
    """Args:
        per_layer: log the per-layer keys (every ``trainer.log_every_n_steps``).
        summary_file: name of the JSON summary written at the end of fit (None: none).
    """

    def __init__(self, per_layer: bool = True, summary_file: str | None = "saturation_summary.json") -> None:
        self.per_layer = per_layer
        self.summary_file = summary_file
        self._logged_step = -1
        self.summary_path: str | None = None
        self.first_clipped_step: dict[str, int] = {}  # tensor -> first optimizer step that clipped

    def state_dict(self) -> dict:
        return {"first_clipped_step": dict(self.first_clipped_step)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.first_clipped_step = dict(state_dict.get("first_clipped_step", {}))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a resumed run logged the step before the checkpoint already: start with the next one
        self._logged_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._logged_step or step == 0:
            return
        self._logged_step = step
        pairs = named_scalers(pl_module.model)
        if not pairs:
            return
        rows = gather(pairs, FIELDS, COUNT_FIELDS)
        clipped = sum(r[3] for r in rows)
        numel = sum(r[4] for r in rows)
        for (name, _), row in zip(pairs, rows):
            if row[3] > 0:
                self.first_clipped_step.setdefault(name, step - 1)  # the step the counts describe
        headrooms = [r[2] for r in rows if r[4] > 0 and math.isfinite(r[2])]
        metrics = {
            "sat/clipped": clipped,
            "sat/clipped_frac": clipped / numel if numel else 0.0,
            "sat/events": float(sum(r[3] > 0 for r in rows)),
        }
        if headrooms:
            metrics["sat/min_headroom"] = min(headrooms)
        if self.per_layer and step % max(1, trainer.log_every_n_steps) == 0:
            for (name, _), (amax, a_hat, _headroom, n_clipped, n_seen) in zip(pairs, rows):
                metrics[f"amax/{name}"] = amax
                if n_seen:  # quantized this step: the estimate it used, and what it clipped
                    metrics[f"a_hat/{name}"] = a_hat
                    metrics[f"sat/{name}/clipped_frac"] = n_clipped / n_seen
        # logged directly (not via self.log) so they land on the step they describe, once per step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        pl_module.log("sat/clipped", clipped, on_step=True, prog_bar=True, logger=False)
        pl_module.log("sat/clipped_frac", metrics["sat/clipped_frac"], on_step=True, prog_bar=True, logger=False)

    def summary(self, pl_module: L.LightningModule) -> dict:
        """Run totals over all ranks (a collective: call it on every rank)."""
        pairs = named_scalers(pl_module.model)
        rows = gather(pairs, TOTAL_FIELDS, TOTAL_COUNT_FIELDS)

        def finite_or_none(value: float) -> float | None:
            return value if math.isfinite(value) else None

        tensors = {
            name: {
                "clipped": int(r[6]), "seen": int(r[7]), "clipped_frac": r[6] / r[7] if r[7] else 0.0,
                "saturation_events": int(r[0]), "quantized_steps": int(r[1]), "min_headroom": finite_or_none(r[2]),
                "first_clipped_step": self.first_clipped_step.get(name),
                "a_hat": r[3], "scale": r[4], "steps_recorded": int(r[5]),
            }
            for (name, _), r in zip(pairs, rows)
        }
        clipped = sum(t["clipped"] for t in tensors.values())
        seen = sum(t["seen"] for t in tensors.values())
        headrooms = [t["min_headroom"] for t in tensors.values() if t["min_headroom"] is not None]
        return {
            "quantized_tensors": len(tensors),
            "clipped": clipped,
            "seen": seen,
            "clipped_frac": clipped / seen if seen else 0.0,
            "saturation_events": sum(t["saturation_events"] for t in tensors.values()),
            "quantized_steps": max((t["quantized_steps"] for t in tensors.values()), default=0),
            "first_clipped_step": min(self.first_clipped_step.values(), default=None),
            "min_headroom": min(headrooms, default=None),
            "tensors_clipped": [name for name, t in tensors.items() if t["clipped"] > 0],
            "definition": "clipped: the clamp to +-max_val changed the element's quantized value; seen: elements of "
                          "quantized forwards, summed over data-parallel ranks; headroom: a_hat / amax of a quantized step",
            "tensors": tensors,
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.summary_file:
            return
        directory = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): on every rank
        summary = self.summary(pl_module)  # a collective too
        if not trainer.is_global_zero:
            return
        summary["global_step"] = trainer.global_step
        os.makedirs(directory, exist_ok=True)
        self.summary_path = os.path.join(directory, self.summary_file)
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        log.info(
            "saturation: %d of %d quantized elements clipped (%.3g%%), %d saturation events; summary in %s",
            summary["clipped"], summary["seen"], 100 * summary["clipped_frac"], summary["saturation_events"],
            self.summary_path,
        )
