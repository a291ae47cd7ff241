"""The pre-flight checks on their own (the CLI's one-line errors are in test_bad_inputs.py)."""

from __future__ import annotations

import os

import pytest
from jsonargparse import Namespace

from qat_app.errors import ConfigError
from qat_app.module import check_lr_schedule
from qat_app.preflight import check_fit_settings, relocate_run, world_size

COSINE = r"model\.lr_schedule=cosine needs trainer\.max_steps > 0 \(the length of the decay\), got trainer\.max_steps=-1"


def fit_config(max_steps, lr_schedule="cosine", warmup_steps=0) -> Namespace:
    return Namespace(trainer=Namespace(max_steps=max_steps), warmup=Namespace(warmup_steps=warmup_steps),
                     model=Namespace(lr_schedule=lr_schedule))


def test_the_cosine_rule_is_one_rule_for_the_cli_and_the_module():
    with pytest.raises(ConfigError, match=COSINE):
        check_fit_settings(fit_config(None))
    with pytest.raises(ConfigError, match=COSINE):
        check_lr_schedule("cosine", -1)  # what configure_optimizers calls
    check_fit_settings(fit_config(None, "constant"))
    check_fit_settings(fit_config(10))
    check_lr_schedule("constant", None)


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match="warmup"):
        check_fit_settings(fit_config(5, "constant", warmup_steps=10))


def test_world_size_counts_devices_times_nodes():
    assert world_size({"devices": "2", "num_nodes": 2, "accelerator": "cpu"}) == 4
    assert world_size({"devices": [0, 1, 2], "accelerator": "cpu"}) == 3
    assert world_size({"devices": "0,1", "accelerator": "cpu"}) == 2
    assert world_size({"devices": "auto", "accelerator": "cpu"}) == 1


def test_relocate_run_moves_every_path_under_the_root(tmp_path):
    new = str(tmp_path / "run")
    logger = Namespace(class_path="CSVLogger", init_args=Namespace(save_dir="out/logs"))
    ckpt = Namespace(class_path="ModelCheckpoint", init_args=Namespace(dirpath="out/ckpt"))
    trainer = Namespace(default_root_dir="out", logger=[logger], callbacks=[ckpt])
    relocate_run(trainer, new)
    assert trainer.default_root_dir == new
    assert logger.init_args.save_dir == os.path.join(new, "logs")
    assert ckpt.init_args.dirpath == os.path.join(new, "ckpt")
    outside = Namespace(default_root_dir="out", logger=Namespace(init_args=Namespace(save_dir="/elsewhere")))
    with pytest.raises(ConfigError, match=r"--run_dir .*save_dir=/elsewhere is not under trainer\.default_root_dir=out"):
        relocate_run(outside, new)
