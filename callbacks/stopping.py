"""Stopping a fit on an alarm: a checkpoint to resume from, and the command that resumes it (the forgetting
monitor's and the spike alarm's ``action: stop``)."""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint

from .per_step import callback_of


def stop_with_checkpoint(trainer, log_dir: str | None, file_name: str) -> tuple[str, str]:
    """Save ``<ModelCheckpoint dirpath or log dir>/<file_name>`` (a collective: every rank) and stop the fit;
    returns (the checkpoint path, the command that resumes from it)."""
    checkpoint = callback_of(trainer, ModelCheckpoint)
    directory = (checkpoint.dirpath if checkpoint is not None and checkpoint.dirpath else None) or log_dir \
        or trainer.default_root_dir
    path = os.path.join(directory, file_name)
    trainer.save_checkpoint(path)
    trainer.should_stop = True
    config = os.path.join(log_dir, "config.yaml") if log_dir else None
    config = config if config and os.path.exists(config) else "<the run's config.yaml>"
    return path, f"python main.py fit --config {config} --ckpt_path {path}"
