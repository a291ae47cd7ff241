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
With ``generation_prompts`` it also keeps the initial model's greedy continuations of held-out prompts and its
full-vocabulary log-probabilities along them (:class:`qat_app.eval.generation_drift.InitialGenerations`), so
every later validation logs ``forget/generation_kl`` (with ``_low`` / ``_high``): what a user of the model
meets in its own generations, beside the teacher-forced ``forget/kl``.
The cache belongs to its run: a new fit writes it in its logger version's directory
(``<log_dir>/initial_topk.pt``), and its checkpoints name it, so a resumed fit reads back its own even when
another fit has since run in the same directory (a checkpoint of an earlier version: ``<default_root_dir>``).
"""

from __future__ import annotations

import logging
import os

import lightning as L

from qat_app.errors import ConfigError
from qat_app.eval.generation_drift import InitialGenerations
from qat_app.eval.kl_cache import (DEFAULT_MAX_TOKENS, DEFAULT_TOPK, INITIAL_FILE, InitialKL, check_settings,
                                   held_out_blocks, with_interval)
from qat_app.eval.records import FORGET_GENERATION_KL, INITIAL_GENERATIONS_FILE
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
        generation_prompts: held-out prompts the initial model continues for ``forget/generation_kl`` (0: off;
            split over the ranks), with ``kl``.
        generation_prompt_tokens: tokens of each prompt (the first of a held-out block).
        generation_tokens: tokens each continuation has (greedy; EOS suppressed until then).
    """

    def __init__(self, enabled: bool = True, kl: bool = True, topk: int = DEFAULT_TOPK,
                 max_kl_tokens: int = DEFAULT_MAX_TOKENS, kl_parts: bool = True, generation_prompts: int = 16,
                 generation_prompt_tokens: int = 64, generation_tokens: int = 32) -> None:
        check_settings(topk, max_kl_tokens)
        for name, value, least in (("generation_prompts", generation_prompts, 0),
                                   ("generation_prompt_tokens", generation_prompt_tokens, 1),
                                   ("generation_tokens", generation_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"initial_eval.{name}: must be an integer >= {least}, got {value!r}")
        self.enabled = enabled
        self.kl, self.topk, self.max_kl_tokens, self.kl_parts = kl, topk, max_kl_tokens, kl_parts
        self.generation = (generation_prompts, generation_prompt_tokens, generation_tokens)
        self._saved_cache: dict | None = None  # the checkpoint's record of the run's cache (a resumed fit)
        self._tracker: InitialKL | None = None  # the fit's cache in use (its state_dict names it)
        self._generations: InitialGenerations | None = None  # the fit's generations in use (named likewise)
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
        """Which cache (``kl_cache``) and generations (``generations``) this run took: each path relative to the
        run directory (a copied run directory keeps finding its own) and its payload's sha256 (a replaced file is
        refused on resume)."""
        out, root = {}, os.path.abspath(self._root)
        for key, tracker in (("kl_cache", self._tracker), ("generations", self._generations)):
            if tracker is None or not tracker.enabled:
                continue
            path = os.path.abspath(tracker.path)
            out[key] = os.path.relpath(path, root) if path.startswith(root + os.sep) else path
            out[f"{key}_sha256"] = tracker.header.get("payload_sha256")
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved_cache = dict(state_dict) if state_dict else None

    def cache_path(self, trainer: L.Trainer, key: str = "kl_cache", file_name: str = INITIAL_FILE) -> tuple[str, str | None]:
        """-> (the run's ``key`` file, the sha256 its payload must have or None). A new fit writes its own, in its
        logger version's directory (two fits in one run directory never share one); a resumed fit reads the one
        its checkpoint names; a checkpoint of an earlier version names none: ``<default_root_dir>/<file_name>``."""
        root = trainer.default_root_dir
        if trainer.global_step == 0:
            return os.path.join(trainer.log_dir or root, file_name), None  # log_dir: a broadcast, every rank
        saved = self._saved_cache or {}
        if saved.get(key):
            path = saved[key]
            return (path if os.path.isabs(path) else os.path.join(root, path)), saved.get(f"{key}_sha256")
        return os.path.join(root, file_name), None

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
        self._initial_generations(trainer, pl_module, blocks, batch_size, scored)

    def _initial_generations(self, trainer, pl_module, blocks, batch_size: int, scored: int) -> None:
        """A new fit's initial model continues the held-out prompts (unquantized); a resumed one reads them back."""
        prompts, prompt_tokens, new_tokens = self.generation
        if not prompts:
            return
        model_name = getattr(pl_module, "hparams", {}).get("model_name", "")
        path, expected_sha = self.cache_path(trainer, "generations", INITIAL_GENERATIONS_FILE)
        generations = InitialGenerations(prompts, prompt_tokens, new_tokens, model_name, path)
        self._generations = generations
        if trainer.global_step == 0:
            config = pl_module.model.generation_config
            eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
            with quantization_off(pl_module):
                generations.record(pl_module, blocks, scored, batch_size, config.pad_token_id or eos or 0)
        else:
            generations.resume(pl_module, blocks, batch_size, expected_sha)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tracker = getattr(pl_module, "forget_kl", None)
        if tracker is not None:
            tracker.begin(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tracker = getattr(pl_module, "forget_kl", None)
        if tracker is None or not tracker.active:
            return
        if self._generations is not None and self._generations.enabled:  # measured when forget/kl is
            drift = self._generations.measure(pl_module)
            for name, value in zip(with_interval(FORGET_GENERATION_KL), drift):
                pl_module.log(name, value, sync_dist=False, add_dataloader_idx=False)
        log_dir = trainer.log_dir  # a broadcast: read on every rank
        result = tracker.finish(pl_module, log_dir)
        if result is not None:
            for name, value in result.metrics().items():
                pl_module.log(name, value, sync_dist=False, add_dataloader_idx=False)
