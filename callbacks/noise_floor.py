"""NoiseFloorCallback: the W8A8 forward's noise floor, measured once at the end of a fit.

A quantized forward disagrees with itself by a floor under any change of float rounding
(:mod:`qat_app.eval.noise_floor`); every W8A8 comparison of the run (``forget/kl`` and its quantization part,
the report's BF16-vs-QAT differences, an export's served-vs-trained KL) is only evidence above it. At the end of
a fit of a quantized model this callback measures it on the first held-out LM blocks (the KL: mean per token with
its interval, the perplexity ratio per seed) and, with benchmarks, how many benchmark answers the same
perturbation changes; writes ``<log_dir>/noise_floor.json``, logs ``noise_floor/*`` to the loggers and leaves
the result for the run summary. Its cost (one forward per seed over the blocks, one benchmark pass per seed plus
one) is paid once, not at every validation, and its time is in the summary.
"""

from __future__ import annotations

import json
import logging
import os
import time

import lightning as L
import torch

from qat_app.eval.kl_cache import held_out_blocks
from qat_app.eval.noise_floor import (DEFAULT_RELATIVE, DEFAULT_SEEDS, AnswerFlips, NoiseFloor, answer_flips,
                                      check_settings, noise_floor)
from qat_app.eval.records import NOISE_FLOOR_FILE
from qat_app.errors import ConfigError

from .per_step import validation_log_step

log = logging.getLogger(__name__)

METRIC = "noise_floor/kl"


class NoiseFloorCallback(L.Callback):
    """The W8A8 forward's noise floor, measured once at the end of a fit.

    Args:
        enabled: measure the floor at the end of a fit (of a quantized model: an unquantized one's is 0).
        seeds: the perturbation's seeds, at least 2 distinct (one forward each).
        relative: the perturbation's size, in (0, 1e-3]: the input embeddings x (1 + relative N(0, 1)); 1e-7 is a
            float32 rounding's size.
        sequences: held-out LM sequences scored at most (>= 1).
        benchmarks: also count the benchmark answers the perturbation changes (one pass per seed, plus one).
    """

    def __init__(self, enabled: bool = True, seeds: list[int] = list(DEFAULT_SEEDS), relative: float = DEFAULT_RELATIVE,
                 sequences: int = 32, benchmarks: bool = True) -> None:
        check_settings(relative, seeds)
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
            raise ConfigError(f"noise_floor.sequences: must be an integer >= 1, got {sequences!r}")
        self.enabled, self.seeds, self.relative = enabled, list(seeds), relative
        self.sequences, self.benchmarks = sequences, benchmarks
        self.floor: NoiseFloor | None = None  # the fit's floor (the summary reads it)
        self.flips: AnswerFlips | None = None
        self.seconds = 0.0
        self._last_validation_step: int | None = None  # where the last validation's metrics (its KL) were logged

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._last_validation_step = validation_log_step(trainer)
        self.path: str | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or getattr(pl_module, "model", None) is None:
            return
        log_dir = trainer.log_dir  # a broadcast: on every rank
        started = time.perf_counter()
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), trainer.precision_plugin.val_step_context():
                self.floor = self._text_floor(trainer, pl_module)
                if self.floor is not None and self.floor.quantized and self.benchmarks:
                    self.flips = self._answer_flips(trainer, model)
        finally:
            model.train(was_training)
        self.seconds = time.perf_counter() - started
        if self.floor is None:
            return
        if trainer.is_global_zero:
            self._write(trainer, log_dir)

    def _text_floor(self, trainer, pl_module) -> NoiseFloor | None:
        held_out = held_out_blocks(trainer)
        if held_out is None:
            log.info("noise floor not measured: the data has no held-out LM blocks (data.val_documents)")
            return None
        blocks, batch_size, scored = held_out
        n = min(scored, self.sequences)
        if trainer.world_size > 1:  # the same number of forwards on every rank (a sharded model's are collective)
            n = int(pl_module.all_gather(torch.tensor(n, device=pl_module.device)).min())
        batches = [blocks[i:min(i + batch_size, n)].to(pl_module.device) for i in range(0, n, batch_size)]
        return noise_floor(pl_module.model, batches, seeds=self.seeds, relative=self.relative)

    def _answer_flips(self, trainer, model) -> AnswerFlips | None:
        datamodule = trainer.datamodule
        bench = getattr(datamodule, "benchmarks", None) or datamodule
        tasks = list(getattr(bench, "task_names", None) or [])
        if not tasks or not callable(getattr(bench, "loaders", None)):
            return None
        if trainer.is_global_zero:  # the longest silent phase of a fit's end otherwise
            log.info("noise floor: scoring %s again under %d input perturbations (seeds %s), to count the answers "
                     "the arithmetic alone changes", ", ".join(tasks), len(self.seeds),
                     ", ".join(map(str, self.seeds)))
        # every example on every rank (the same forwards everywhere; rank 0 writes the counts)
        return answer_flips(model, bench.loaders(), tasks, seeds=self.seeds, relative=self.relative)

    def metrics(self) -> dict[str, float]:
        """``noise_floor/kl`` (+ ``_low`` / ``_high``), the perplexity ratio of each seed, the answers changed."""
        out: dict[str, float] = {}
        floor = self.floor
        if floor is None:
            return out
        out.update({METRIC: floor.kl.difference, f"{METRIC}_low": floor.kl.low, f"{METRIC}_high": floor.kl.high,
                    "noise_floor/seconds": self.seconds})
        for seed, (ratio, _, _) in zip(floor.seeds, floor.perplexity_ratios):
            out[f"noise_floor/ppl_ratio_seed{seed}"] = ratio
        if self.flips is not None:
            for task, counts in self.flips.flips_norm.items():
                out[f"noise_floor/{task}/answers_changed"] = sum(counts) / len(counts)
        return out

    def _write(self, trainer, log_dir: str | None) -> None:
        metrics = self.metrics()
        for logger in trainer.loggers:
            # beside the last validation's KL, the one it is the floor of
            step = self._last_validation_step if self._last_validation_step is not None else trainer.global_step
            logger.log_metrics(metrics, step=step)
            logger.save()
        if not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, NOISE_FLOOR_FILE)
        document = {"step": trainer.global_step, "seconds": self.seconds, "text": self.floor.to_dict(),
                    "benchmarks": self.flips.to_dict() if self.flips is not None else None}
        with open(self.path, "w") as f:
            json.dump(document, f, indent=1)
        log.info("noise floor (%.0f s): %s%s", self.seconds, self.floor.describe(),
                 f"; {self.flips.describe()}" if self.flips is not None else "")
