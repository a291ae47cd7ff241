"""Checking a checkpoint before a run resumes from it, and the resume policy (``--ckpt_path PATH|last``).

:class:`qat_app.cli.QATCLI` checks the checkpoint before the trainer starts: an explicit PATH on its own right
after parsing (:func:`check_given_checkpoint`), then ``last`` resolved and the file checked against the model
(:func:`resolve_ckpt_path`, :func:`validate_resume_checkpoint`). Contract: a checkpoint is accepted only when it
loads with ``torch.load`` as Lightning will load it, holds the full training state and holds exactly this model's
state (names and shapes); otherwise it is refused, naming it, before anything in the run directory is written.
What defines the run (the model, the data, ``warmup.warmup_steps``) may not change on resume
(:class:`ResumeSettingsError`, naming each setting and both values); optimisation settings may, with a warning.
Reading: :func:`read_checkpoint` gives any checkpoint, a file or a sharded (FSDP2) directory, whole on one process
(``export``, ``validate`` / ``test``, ``inspect``); an incomplete directory is refused in one line naming what is
missing (:mod:`qat_app.sharded_checkpoint`).

See ``docs/runs.md`` (exact resume, changed settings on resume) for what is checked and what may change.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, NamedTuple

import torch

from .errors import CheckpointError, UnsafeFileError
from .safe_load import listed, torch_load
from .sharded_checkpoint import looks_sharded, read_sharded_checkpoint, read_sharded_shapes, read_sharded_with

log = logging.getLogger(__name__)

# model hyperparameters a resume may change (the new value is used, with a warning); any other is refused
SOFT_MODEL_SETTINGS = ("lr", "weight_decay", "betas", "eps", "lr_schedule", "lr_warmup_steps", "min_lr_ratio",
                       "max_consecutive_nonfinite", "gradient_checkpointing")
SOFT_DATA_SETTINGS = ("val_batch_size", "benchmarks", "limit_val_batches")
# selection patterns: once the state check has passed, the same layers are quantized (an older default
# pattern that selects the same modules is no change); the GEMM path: the same state, products that differ by
# roundings (a run may move to FP8 tensor cores, or a checkpoint from before the emulated GEMM continue on it)
SAME_STATE_MODEL_SETTINGS = ("quant.module_pattern", "quant.block_pattern", "quant.gemm", "quant.fp8_tail")
_RESUME_KEYS = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "global_step")
_MAX_LISTED = 6


def find_last_checkpoint(trainer) -> str | None:
    """What Lightning's ``ckpt_path="last"`` resolves to: the newest ``last*.ckpt`` of the trainer's
    ModelCheckpoint callbacks (None when there is none)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    candidates: set[str] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    existing = [p for p in candidates if os.path.exists(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def run_checkpoints(trainer) -> list[str]:
    """Every checkpoint file of the trainer's ModelCheckpoint directories, newest first (``last*.ckpt``
    and the periodic ones): where ``--ckpt_path last`` falls back when the newest is not intact."""
    files = {find_last_checkpoint(trainer)} - {None}
    for directory in checkpoint_dirs(trainer):
        if os.path.isdir(directory):
            files |= {os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".ckpt")}
    existing = [f for f in files if os.path.isfile(f) or looks_sharded(f)]  # an incomplete one: refused, saying why
    return sorted(existing, key=lambda f: (os.path.getmtime(f), os.path.basename(f).startswith("last")), reverse=True)


class ResumeSettingsError(CheckpointError):
    """The checkpoint is intact but was saved with settings that a resume cannot change."""


def _find_value(obj: Any, key: str, depth: int = 0):
    if depth > 8:
        return None
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        values = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return None
    for value in values:
        found = _find_value(value, key, depth + 1)
        if found is not None:
            return found
    return None


def resume_setting_changes(ckpt: dict, module, datamodule=None, trainer=None, warmup=None):
    """-> (refused, allowed): ``"setting: saved -> now"`` lines for the settings given now that differ from
    the checkpoint's (docs/runs.md says which a resume may change). ``warmup``: the run's
    BF16WarmupCallback (its saved state, under its state key, holds the warmup length)."""
    refused, allowed = [], []
    for line in hparam_differences(ckpt.get("hyper_parameters"), getattr(module, "hparams", None)):
        key = line.split(":", 1)[0][len("model."):]
        soft = key.split(".")[0] in SOFT_MODEL_SETTINGS or key in SAME_STATE_MODEL_SETTINGS
        (allowed if soft else refused).append(line)
    saved_data = ckpt.get("datamodule_hyper_parameters")
    if datamodule is not None and isinstance(saved_data, dict):
        for line in hparam_differences(saved_data, getattr(datamodule, "hparams", None)):
            key = line.split(":", 1)[0][len("model."):]
            line = "data." + line[len("model."):]
            (allowed if key.split(".")[0] in SOFT_DATA_SETTINGS else refused).append(line)
    consumers = _find_value(ckpt.get("loops"), "num_consumers")
    workers = getattr(datamodule, "num_workers", None)
    if trainer is not None and isinstance(consumers, int) and isinstance(workers, int):
        now = trainer.world_size * max(1, workers)
        if consumers != now:
            refused.append(f"devices x data.num_workers (data stream consumers): {consumers} -> {now} "
                           f"({trainer.world_size} device(s) x {max(1, workers)})")
    saved_warmup = ((ckpt.get("callbacks") or {}).get(warmup.state_key) or {}).get("warmup_steps") if warmup else None
    if isinstance(saved_warmup, int) and saved_warmup != warmup.warmup_steps:
        refused.append(f"warmup.warmup_steps: {saved_warmup} -> {warmup.warmup_steps}")
    return refused, allowed


class IntactCheckpoint(NamedTuple):
    """The newest usable checkpoint of a run (:func:`newest_intact_checkpoint`)."""

    path: str | None  # None: none is usable
    summary: str | None
    refused: list[tuple[str, str]]  # the newer ones refused, with why


def newest_intact_checkpoint(trainer, module, weights_only=None, need_training_state=True, datamodule=None,
                             warmup=None) -> IntactCheckpoint:
    """The newest checkpoint of the run that :func:`validate_resume_checkpoint` accepts, and the newer ones it
    refused with why (a save killed midway leaves a truncated file)."""
    refused: list[tuple[str, str]] = []
    for path in run_checkpoints(trainer):
        try:
            return IntactCheckpoint(path, validate_resume_checkpoint(path, module, weights_only, need_training_state,
                                                                     datamodule, trainer, warmup), refused)
        except (ResumeSettingsError, UnsafeFileError):
            # intact, but not this run's settings: an older checkpoint would not be either; or a file that
            # carries code: said, not passed over for an older one
            raise
        except CheckpointError as err:
            refused.append((path, str(err)))
    return IntactCheckpoint(None, None, refused)


def read_checkpoint(path: str, weights_only: bool | None = None, optimizer: bool = False,
                    select=None) -> dict[str, Any]:
    """Any checkpoint -> its dict, whole, on this process: a file (:func:`load_checkpoint_file`, memory-mapped) or a
    sharded checkpoint directory (:func:`read_sharded_checkpoint`; ``optimizer``: its optimizer state too). What
    ``export``, ``validate`` / ``test`` (under a strategy that reads files) and ``inspect`` read. ``select``: only
    the state-dict entries whose key it accepts."""
    path = str(path)
    if looks_sharded(path):
        return read_sharded_checkpoint(path, weights_only, optimizer, select)
    ckpt = load_checkpoint_file(path, weights_only)
    if select is not None and isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict):
        ckpt["state_dict"] = {key: value for key, value in ckpt["state_dict"].items() if select(key)}
    return ckpt


def checkpoint_dirs(trainer) -> list[str]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [str(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]


def load_checkpoint_file(path: str, weights_only: bool | None = None) -> dict[str, Any] | None:
    """``torch.load`` (memory-mapped, on CPU) with a :class:`CheckpointError` naming the file on failure.

    A sharded (distributed) checkpoint directory gives its metadata and the saved tensor shapes
    (:func:`read_sharded_shapes`; :func:`read_checkpoint` reads it whole); any other directory is refused."""
    if looks_sharded(path):
        return read_sharded_shapes(path, weights_only)
    if os.path.isdir(path):
        inside = sorted(f for f in os.listdir(path) if f.endswith(".ckpt"))
        raise CheckpointError(
            f"--ckpt_path {path} is a directory, not a checkpoint file (nor a sharded checkpoint: no .metadata)"
            + (f"; it holds {listed(inside)}: give one of them, e.g. {os.path.join(path, inside[-1])}" if inside
               else "; it holds no .ckpt file"))
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist (--ckpt_path)")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): it was truncated while being written")
    try:
        try:
            ckpt = torch_load(path, weights_only, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            ckpt = torch_load(path, weights_only)  # legacy (non-zip) format
    except UnsafeFileError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(e).__name__}: {first}); it is truncated (e.g. the job died "
            "while writing it), corrupt or not a PyTorch file. Resume from an earlier checkpoint."
        ) from e
    return ckpt


def _looks_like_qat_checkpoint(ckpt: dict, module_class) -> tuple[bool, str]:
    from .module import CHECKPOINT_KEY

    if CHECKPOINT_KEY in ckpt:
        return True, ""
    hparams = ckpt.get("hyper_parameters")
    if module_class is None or not isinstance(hparams, dict) or not hparams:
        return True, ""  # nothing to go by here; the state check against the model decides
    import inspect

    allowed = set(inspect.signature(module_class.__init__).parameters) - {"self"}
    foreign = sorted(k for k in hparams if k not in allowed and not k.startswith("_"))
    if foreign:
        return False, f"hyperparameters {listed(foreign)} are not {module_class.__name__}'s"
    return True, ""


def check_checkpoint_file(
    path: str, weights_only: bool | None = None, need_training_state: bool = True, module_class=None
) -> dict[str, Any] | None:
    """Check a checkpoint file on its own (no model needed): readable, a Lightning checkpoint, with the
    training state when ``need_training_state``, written by ``module_class`` (when given). Returns it
    (a sharded checkpoint directory: its shapes and metadata, :func:`read_sharded_shapes`)."""
    ckpt = load_checkpoint_file(path, weights_only)
    if ckpt is None:
        return None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "pytorch-lightning_version" not in ckpt:
        keys = sorted(map(str, ckpt))[:10] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(
            f"checkpoint {path} is not a Lightning training checkpoint (it holds {keys}); a plain model state_dict "
            "or a file of another program cannot resume a run"
        )
    absent = [k for k in _RESUME_KEYS if k not in ckpt]
    if absent and need_training_state:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(absent)} (saved with save_weights_only=True?); it holds weights only "
            "and cannot resume a run exactly"
        )
    ours, why = _looks_like_qat_checkpoint(ckpt, module_class)
    if not ours:
        raise CheckpointError(f"checkpoint {path} was not written by this application's {module_class.__name__}: {why}")
    return ckpt


def validate_resume_checkpoint(
    path: str, module: torch.nn.Module, weights_only: bool | None = None, need_training_state: bool = True,
    datamodule=None, trainer=None, warmup=None,
) -> dict[str, Any]:
    """Raise :class:`CheckpointError` unless ``path`` is a checkpoint of ``module`` (with the complete training
    state when ``need_training_state``, i.e. for resuming a fit).

    Returns a short summary (``global_step``, differing hyperparameters)."""
    ckpt = check_checkpoint_file(path, weights_only, need_training_state, type(module))
    if ckpt is None:
        return {"global_step": None, "differences": []}
    name = ckpt.get("hyper_parameters", {}).get("model_name") if isinstance(ckpt.get("hyper_parameters"), dict) else None
    expected = module.state_dict()
    saved = ckpt["state_dict"]
    missing = [k for k in expected if k not in saved and not _filled_on_load(k, saved)]
    unexpected = [k for k in saved if k not in expected]
    mismatched = [
        f"{k} {tuple(saved[k].shape)} in the checkpoint vs {tuple(v.shape)} now"
        for k, v in expected.items()
        if k in saved and isinstance(v, torch.Tensor) and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape
    ]
    diffs = hparam_differences(ckpt.get("hyper_parameters"), getattr(module, "hparams", None))
    parts = [f"{what}: {listed(keys)}" for what, keys in
             (("missing", missing), ("unexpected", unexpected), ("other shape", mismatched)) if keys]
    if parts:
        hint = f"; settings that differ (checkpoint -> now): {listed(diffs)}" if diffs else ""
        raise CheckpointError(
            f"checkpoint {path} does not belong to this model"
            + (f" (it was written for model_name={name!r})" if name else "")
            + f": {'; '.join(parts)}{hint}"
        )
    if not need_training_state:  # evaluating a checkpoint: its model is what is evaluated
        return {"global_step": ckpt.get("global_step"), "differences": diffs}
    refused, allowed = resume_setting_changes(ckpt, module, datamodule, trainer, warmup)
    if refused:
        raise ResumeSettingsError(
            f"checkpoint {path} was saved with other settings, which a resume cannot change (saved -> now): "
            f"{'; '.join(refused)}. To continue that run, drop these changes; to train with them, start a new "
            "run (another --run_dir) instead of resuming")
    if allowed:
        log.warning("resuming from %s with changed settings (checkpoint -> now; the new values are used): %s",
                    path, listed(allowed))
    return {"global_step": ckpt.get("global_step"), "differences": allowed}


def _filled_on_load(key: str, saved: dict) -> bool:
    """A scaler buffer added after the checkpoint was written: the scaler fills it in on load."""
    from .hif8.scaling import AmaxScaler

    owner, _, name = key.rpartition(".")
    return name in dict(AmaxScaler.LATER_BUFFERS) and f"{owner}.amax_history" in saved


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    elif hasattr(value, "__dataclass_fields__"):
        value = dataclasses.asdict(value)
    if isinstance(value, dict) or (hasattr(value, "items") and not isinstance(value, (str, bytes))):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def _is_later_default(key: str, value: Any) -> bool:
    """``quant.<field>`` or ``distill.<field>`` at its default (a checkpoint written before the field existed
    lacks it, and behaved as the default does)."""
    from .config import QuantConfig
    from .distill import DistillConfig

    section, _, name = key.partition(".")
    settings = {"quant": QuantConfig, "distill": DistillConfig}.get(section)
    if settings is None:
        return False
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    return name in defaults and defaults[name] == value


def hparam_differences(saved: Any, now: Any) -> list[str]:
    """``["quant.history_len: 5 -> 8", ...]`` for the model hyperparameters that differ."""
    if not saved or now is None:
        return []
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten("", dict(saved), a)
    _flatten("", dict(now), b)
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if key not in a and _is_later_default(key, vb):
            continue  # a setting added since, at its default: the saved run behaved that way
        if isinstance(va, (list, tuple)) and isinstance(vb, (list, tuple)):
            va, vb = list(va), list(vb)
        if va != vb:
            out.append(f"model.{key}: {va!r} -> {vb!r}")
    return out


# ------------------------------------------------------------------------------------------ resume policy
def is_checkpoint_file_arg(ckpt_path) -> bool:
    """``--ckpt_path`` names a file (or sharded directory), not one of Lightning's keywords."""
    return bool(ckpt_path) and str(ckpt_path) not in ("last", "best", "hpc") and not str(ckpt_path).startswith("registry")


def check_given_checkpoint(ckpt_path, subcommand: str, weights_only: bool | None = None, module_class=None) -> bool:
    """Check an explicit ``--ckpt_path FILE`` on its own, right after parsing (before anything is built from it).

    -> whether the checkpoint's ``model.*`` settings replace the configured ones. ``fit`` resumes the saved
    run: no, the configured settings are kept and compared with the checkpoint's in :func:`resolve_ckpt_path`
    (a changed model, data or warmup setting is refused, as with ``--ckpt_path last``). ``validate`` /
    ``test`` evaluate the saved model: yes, as in Lightning 2.6 (see :func:`log_replaced_settings`).
    """
    check_checkpoint_file(str(ckpt_path), weights_only=weights_only, need_training_state=subcommand == "fit",
                          module_class=module_class)
    return subcommand != "fit"


def settings_dict(value) -> dict:
    """A parsed config section (a jsonargparse Namespace or a mapping) as a plain dict, a copy."""
    if value is None:
        return {}
    return value.as_dict() if hasattr(value, "as_dict") else dict(value)


def log_replaced_settings(ckpt_path, configured: dict, from_checkpoint: dict) -> None:
    """Log the configured model settings (:func:`settings_dict`) that the checkpoint's replaced (``validate`` /
    ``test``)."""
    changed = hparam_differences(configured, from_checkpoint)
    if changed:
        log.warning("--ckpt_path %s: the checkpoint's model settings replace the configured ones "
                    "(configured -> checkpoint): %s", ckpt_path, "; ".join(changed))


def resolve_ckpt_path(ckpt_path, trainer, module, need_training_state: bool, weights_only: bool | None = None,
                      datamodule=None, warmup=None):
    """-> the checkpoint to run from, checked against the built ``module`` (and, to resume a fit, the data and
    the ``warmup`` callback): ``last`` becomes the newest intact checkpoint of the run (newer ones that cannot
    be read are skipped with a warning; None, a new run, when there is none at all), a FILE is checked as it
    is; a sharded directory, once checked, is read as the trainer's strategy can (:func:`read_sharded_with`).
    Other values (None, ``best``, ...) are returned unchanged. Raises :class:`CheckpointError`."""
    if ckpt_path != "last" and not is_checkpoint_file_arg(ckpt_path):
        return ckpt_path
    run = dict(datamodule=datamodule, warmup=warmup)
    if str(ckpt_path) == "last":
        ckpt_path, summary, refused = newest_intact_checkpoint(trainer, module, weights_only, need_training_state, **run)
        for path, why in refused:
            log.warning("--ckpt_path last: skipping %s: %s", path, why)
        if ckpt_path is None:
            if refused:  # checkpoints exist but none can resume this run: say why, do not start over
                raise CheckpointError(
                    f"--ckpt_path last: no checkpoint in {checkpoint_dirs(trainer)} can resume this run; "
                    f"the newest: {refused[0][1]}")
            log.warning("--ckpt_path last: no last checkpoint in %s; starting a new run",
                        checkpoint_dirs(trainer) or "the ModelCheckpoint directory")
            return None
        log.info("--ckpt_path last: resuming from %s%s", ckpt_path,
                 f" (the newest intact checkpoint; {len(refused)} newer refused)" if refused else "")
    else:
        ckpt_path = str(ckpt_path)
        summary = validate_resume_checkpoint(ckpt_path, module, weights_only=weights_only,
                                             need_training_state=need_training_state, trainer=trainer, **run)
    if looks_sharded(ckpt_path):
        read_sharded_with(trainer, ckpt_path, need_training_state)
    if need_training_state:
        log.info("checkpoint %s (global step %s) checked: resuming", ckpt_path, summary["global_step"])
    return ckpt_path  # exactly the file that was checked
