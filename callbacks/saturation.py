"""AmaxSaturationCallback: per-step saturation and a_hat-vs-amax logging, plus a JSON summary.

Once per optimizer step (the first ``on_train_batch_end`` after ``global_step`` moved, i.e. after
the scalers advanced) it reads the last completed step of every scaler in ONE device->host copy
and logs, to every Lightning logger:
  sat/clipped_frac, sat/clipped, sat/events    totals over all quantized tensors (every step)
  sat/<layer>.<tensor>/clipped_frac            per layer and tensor (input, weight, grad)
  amax/<layer>.<tensor>, a_hat/<layer>.<tensor> true amax vs the estimate it was quantized with
(per-layer keys every ``log_every_n_steps``). At the end of fit it writes
``saturation_summary.json`` (run totals per tensor) into the logger's directory.
"""

from __future__ import annotations

import json
import logging
import os

import lightning as L
import torch

from qat_app.patch import quantized_linears

log = logging.getLogger(__name__)
FIELDS = ("last_amax", "last_a_hat", "last_clipped", "last_numel")
TOTAL_FIELDS = ("total_clipped", "total_numel", "saturation_events", "a_hat", "scale", "steps_recorded")


def _short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def named_scalers(model) -> list[tuple[str, object]]:
    pairs = []
    for name, layer in quantized_linears(model):
        for tensor, scaler in (("input", layer.input_scaler), ("weight", layer.weight_scaler), ("grad", layer.grad_scaler)):
            if scaler is not None:
                pairs.append((f"{_short(name)}.{tensor}", scaler))
    return pairs


def gather(pairs, fields) -> list[list[float]]:
    """All requested buffers of all scalers in one host transfer."""
    if not pairs:
        return []
    stacked = torch.stack([torch.stack([getattr(s, f).double() for f in fields]) for _, s in pairs])
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
        rows = gather(pairs, FIELDS)
        clipped = sum(r[2] for r in rows)
        numel = sum(r[3] for r in rows)
        metrics = {
            "sat/clipped": clipped,
            "sat/clipped_frac": clipped / numel if numel else 0.0,
            "sat/events": float(sum(r[2] > 0 for r in rows)),
        }
        if self.per_layer and step % max(1, trainer.log_every_n_steps) == 0:
            for (name, _), (amax, a_hat, n_clipped, n_seen) in zip(pairs, rows):
                metrics[f"sat/{name}/clipped_frac"] = n_clipped / n_seen if n_seen else 0.0
                metrics[f"amax/{name}"] = amax
                metrics[f"a_hat/{name}"] = a_hat
        # logged directly (not via self.log) so they land on the step they describe, once per step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)
        pl_module.log("sat/clipped_frac", metrics["sat/clipped_frac"], on_step=True, prog_bar=True, logger=False)

    def summary(self, pl_module: L.LightningModule) -> dict:
        pairs = named_scalers(pl_module.model)
        rows = gather(pairs, TOTAL_FIELDS)
        tensors = {
            name: {
                "clipped": int(r[0]), "seen": int(r[1]), "clipped_frac": r[0] / r[1] if r[1] else 0.0,
                "saturation_events": int(r[2]), "a_hat": r[3], "scale": r[4], "steps_recorded": int(r[5]),
            }
            for (name, _), r in zip(pairs, rows)
        }
        clipped = sum(t["clipped"] for t in tensors.values())
        seen = sum(t["seen"] for t in tensors.values())
        return {
            "quantized_tensors": len(tensors),
            "clipped": clipped,
            "seen": seen,
            "clipped_frac": clipped / seen if seen else 0.0,
            "saturation_events": sum(t["saturation_events"] for t in tensors.values()),
            "tensors": tensors,
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.summary_file:
            return
        directory = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): on every rank
        if not trainer.is_global_zero:
            return
        summary = self.summary(pl_module)
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
