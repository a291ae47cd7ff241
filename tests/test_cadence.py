"""Validation and checkpoint cadence in optimizer steps: the same steps on 1 process and on 2 (``val_every_n_steps``
converted to Lightning's micro-batch ``val_check_interval`` at start, for the gradient accumulation of the devices)."""

import json
import logging
import os

import lightning as L
import pytest
from jsonargparse import Namespace

from qat_app.errors import ConfigError
from qat_app.preflight import derive_validation_interval
from tests._cli_runs import write_config
from tests._ddp_runs import run_main


def _cfg(every, accumulate, interval=None, devices=1):
    return Namespace(val_every_n_steps=every,
                     trainer=Namespace(accumulate_grad_batches=accumulate, val_check_interval=interval,
                                       check_val_every_n_epoch=1, devices=devices, num_nodes=1))


@pytest.mark.parametrize("accumulate", [1, 8, 64])
def test_optimizer_steps_become_micro_batches(accumulate):
    cfg = _cfg(1000, accumulate)
    derive_validation_interval(cfg)
    assert cfg.trainer.val_check_interval == 1000 * accumulate
    assert cfg.trainer.check_val_every_n_epoch is None


def test_a_saved_config_from_other_devices_is_rederived(caplog):
    """A saved config holds the interval derived for its own device count: the steps win, with a warning when the
    micro-batch value differs."""
    cfg = _cfg(1000, 64, interval=8000)  # saved on 8 GPUs (accumulation 8), run on 1 (accumulation 64)
    with caplog.at_level(logging.WARNING, logger="qat_app.preflight"):
        derive_validation_interval(cfg)
    assert cfg.trainer.val_check_interval == 64000
    assert "trainer.val_check_interval=8000 replaced by val_every_n_steps=1000 x 64" in caplog.text
    same = _cfg(1000, 8, interval=8000)
    with caplog.at_level(logging.WARNING, logger="qat_app.preflight"):
        caplog.clear()
        derive_validation_interval(same)
    assert same.trainer.val_check_interval == 8000 and "replaced" not in caplog.text


def test_without_steps_the_micro_batch_interval_stays_and_is_explained(caplog):
    cfg = _cfg(None, 8, interval=8000)
    with caplog.at_level(logging.INFO, logger="qat_app.preflight"):
        derive_validation_interval(cfg)
    assert cfg.trainer.val_check_interval == 8000 and cfg.trainer.check_val_every_n_epoch == 1
    assert "validation every 1000 optimizer steps with 8 micro-batches a step" in caplog.text


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_a_bad_step_count_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"^val_every_n_steps must be a positive integer \(optimizer steps\)"):
        derive_validation_interval(_cfg(bad, 4))


class ValidatedSteps(L.Callback):
    """Rank 0 writes the optimizer steps at which the LM validation ran (``out``, JSON)."""

    def __init__(self, out: str) -> None:
        self.out, self.steps = out, []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                json.dump(self.steps, f)


def _fit(tmp_path, model_dir, corpus, devices: int) -> dict:
    tmp_path.mkdir(parents=True)
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": False, "every_n_train_steps": 3,
                                "save_top_k": -1}},
                 {"class_path": "tests.test_cadence.ValidatedSteps",
                  "init_args": {"out": str(tmp_path / "validated.json")}}]
    overrides = {"val_every_n_steps": 2, "trainer.val_check_interval": None, "trainer.max_steps": 6,
                 "trainer.devices": devices, "trainer.callbacks": callbacks, "warmup.warmup_steps": 2,
                 "data.init_args.micro_batch_size": 1, "data.init_args.global_batch_size": 4,
                 "model.quant.history_len": 2}
    if devices > 1:
        overrides["trainer.strategy"] = "ddp"
    run_main(["fit", "--config", write_config(tmp_path, model_dir, corpus, **overrides)], timeout=600)
    summary = (tmp_path / "logs" / "version_0" / "run_summary.txt").read_text()
    return {"validated": json.loads((tmp_path / "validated.json").read_text()),
            "checkpoints": sorted(os.listdir(tmp_path / "ckpt")),
            "intervals": next(line for line in summary.splitlines() if line.startswith("intervals"))}


@pytest.mark.slow
def test_one_config_validates_at_the_same_optimizer_steps_on_1_and_2_processes(tmp_path, tiny_model_dir, tiny_corpus):
    one = _fit(tmp_path / "one", tiny_model_dir, tiny_corpus, devices=1)  # 4 micro-batches a step
    two = _fit(tmp_path / "two", tiny_model_dir, tiny_corpus, devices=2)  # 2 micro-batches a step on each rank
    assert one["validated"] == two["validated"] == [2, 4, 6]
    assert one["checkpoints"] == two["checkpoints"] == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    assert one["intervals"] == ("intervals     validation every 2 optimizer steps (val_check_interval 8 "
                                "micro-batches / 4 per step); checkpoints every 3 optimizer steps")
    assert two["intervals"] == ("intervals     validation every 2 optimizer steps (val_check_interval 4 "
                                "micro-batches / 2 per step); checkpoints every 3 optimizer steps")
