"""InitialEvaluationCallback: score the model *before* training, at global step 0, on the same documents.

Forgetting is measured against this: the report's *initial* column (initial -> baseline is forgetting,
baseline -> QAT is quantization). At the start of a new fit (not a resume) it runs one full validation
pass (the LM loss and every configured benchmark, logged at step 0 with per-example records) with
quantization switched off, so every run of a study scores the same pretrained model; the warmup's
switches are restored afterwards. Runs only when the datamodule has benchmarks.

It also keeps the initial model's top-k next-token log-probabilities on the first held-out LM blocks
(:mod:`qat_app.eval.kl_cache`, ``kl``: on by default, also when ``enabled`` is false, with or without
benchmarks), so every later validation of the fit logs ``forget/kl`` (KL(initial || now) per token, a lower
bound of the full-vocabulary KL) and ``forget/kl_low`` / ``forget/kl_high`` (its 95 % interval over
sequences), and its parts ``forget/kl_drift`` (training) and ``forget/kl_quantization`` (HiF8) with theirs.
The cache belongs to its run: a new fit writes it in its logger version's directory
(``<log_dir>/initial_topk.pt``), and its checkpoints name it, so a resumed fit reads back its own even when
another fit has since run in the same directory (a checkpoint of an earlier version: ``<default_root_dir>``).
"""

from __future__ import annotations

import logging
import os

import lightning as L

from qat_app.eval.kl_cache import DEFAULT_MAX_TOKENS, DEFAULT_TOPK, INITIAL_FILE, InitialKL, check_settings, held_out_blocks
from qat_app.hif8.patch import quantization_off

log = logging.getLogger(__name__)


class InitialEvaluationCallback(L.Callback):
    """The unquantized model's validation at step 0, and its top-k cache for the KL.

    Args:
        enabled: validate at step 0 when benchmarks are configured.
        kl: keep the initial model's top-k cache (``<log_dir>/initial_topk.pt``) and log ``forget/kl``
            at every later validation of the fit (needs held-out LM blocks, ``data.val_documents > 0``).
        topk: next tokens kept per position (k); the rest of the vocabulary is one bucket.
        max_kl_tokens: positions kept at most (whole sequences): 262144 = 256 sequences at seq 1024, 51.9 MB
            at k=32 (198 bytes a token).
        kl_parts: also log ``forget/kl`` in its parts, ``forget/kl_drift`` (KL(initial || now, quantization off):
            what training moved) and ``forget/kl_quantization`` (KL(now off || now on): what HiF8 changes), at
            the cost of one more forward over the cache's sequences per validation.
    """

    def __init__(self, enabled: bool = True, kl: bool = True, topk: int = DEFAULT_TOPK,
                 max_kl_tokens: int = DEFAULT_MAX_TOKENS, kl_parts: bool = True) -> None:
        check_settings(topk, max_kl_tokens)
        self.enabled = enabled
        self.kl, self.topk, self.max_kl_tokens, self.kl_parts = kl, topk, max_kl_tokens, kl_parts
        self._saved_cache: dict | None = None  # the checkpoint's record of the run's cache (a resumed fit)
        self._tracker: InitialKL | None = None  # the fit's cache in use (its state_dict names it)
        self._root: str = "."  # the run directory the cache's path is relative to

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.kl and stage == "fit" and hasattr(pl_module, "measure_forgetting"):
            model_name = getattr(pl_module, "hparams", {}).get("model_name", "")
            # the path is the run's own, decided in on_train_start (a new fit's log version, or the checkpoint's)
            pl_module.measure_forgetting(InitialKL(self.topk, self.max_kl_tokens, model_name, INITIAL_FILE,
                                                   parts=self.kl_parts))
            self._root = trainer.default_root_dir

    # ------------------------------------------------------------------------- whose cache (checkpointed)
    def state_dict(self) -> dict:
        """Which cache this run took: its path relative to the run directory (a copied run directory keeps
        finding its own) and its payload's sha256 (a replaced file is refused on resume)."""
        tracker, root = self._tracker, self._root
        if tracker is None or not tracker.enabled:
            return {}
        path = os.path.abspath(tracker.path)
        inside = path.startswith(os.path.abspath(root) + os.sep)
        return {"kl_cache": os.path.relpath(path, root) if inside else path,
                "kl_cache_sha256": tracker.header.get("payload_sha256")}

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved_cache = dict(state_dict) if state_dict.get("kl_cache") else None

    def cache_path(self, trainer: L.Trainer) -> tuple[str, str | None]:
        """-> (the run's cache file, the sha256 its payload must have or None). A new fit writes its own, in its
        logger version's directory (two fits in one run directory never share one); a resumed fit reads the one
        its checkpoint names; a checkpoint of an earlier version names none: ``<default_root_dir>/initial_topk.pt``."""
        root = trainer.default_root_dir
        if trainer.global_step == 0:
            return os.path.join(trainer.log_dir or root, INITIAL_FILE), None  # log_dir: a broadcast, every rank
        if self._saved_cache:
            path = self._saved_cache["kl_cache"]
            return (path if os.path.isabs(path) else os.path.join(root, path)), self._saved_cache.get("kl_cache_sha256")
        return os.path.join(root, INITIAL_FILE), None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._initial_kl(trainer, pl_module)
        datamodule = trainer.datamodule
        has_benchmarks = bool(getattr(datamodule, "task_names", None) or getattr(datamodule, "benchmarks", None))
        if not self.enabled or trainer.global_step != 0 or not has_benchmarks or trainer.limit_val_batches == 0:
            return
        log.info("scoring the initial model (step 0, unquantized) on the validation data")
        # what the training epoch loop does around its own validation runs (fit_loop.epoch_loop.on_advance_end)
        loop = trainer.fit_loop.epoch_loop
        first_loop_iter = trainer._logger_connector._first_loop_iter
        trainer.validating = True
        try:
            with quantization_off(pl_module):
                loop.val_loop.run()
        finally:
            trainer.training = True
            trainer._logger_connector._first_loop_iter = first_loop_iter

    def _initial_kl(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A new fit takes the initial model's top-k cache (unquantized); a resumed one reads it back."""
        tracker = getattr(pl_module, "forget_kl", None)
        held_out = held_out_blocks(trainer) if tracker is not None else None
        if held_out is None:
            if tracker is not None:
                log.info("forget/kl off: the data has no held-out LM blocks (data.val_documents) to validate on")
                pl_module.measure_forgetting(None)
            return
        blocks, batch_size, scored = held_out
        tracker.path, expected_sha = self.cache_path(trainer)
        self._tracker = tracker
        if trainer.global_step == 0:
            with quantization_off(pl_module):
                tracker.record(pl_module, blocks, batch_size, limit=scored)
        else:
            tracker.resume(pl_module, blocks, expected_sha)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tracker = getattr(pl_module, "forget_kl", None)
        if tracker is not None:
            tracker.begin(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tracker = getattr(pl_module, "forget_kl", None)
        if tracker is None or not tracker.active:
            return
        log_dir = trainer.log_dir  # a broadcast: read on every rank
        result = tracker.finish(pl_module, log_dir)
        if result is not None:
            for name, value in result.metrics().items():
                pl_module.log(name, value, sync_dist=False, add_dataloader_idx=False)
