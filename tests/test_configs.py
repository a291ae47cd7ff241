"""Every shipped config starts: built through the real CLI (model, data, trainer, loggers, callbacks), on this CPU.

Only what cannot exist here is swapped: a tiny local model for the hub one, a local text file for FineWeb,
one CPU in 32-bit for 8 GPUs under DDP in bf16. Everything else (loggers, checkpointing, quantization,
warmup, batch sizes, benchmark settings) is the config's own, so a logger whose package is missing (the
TensorBoardLogger without ``tensorboard``) or a setting the CLI refuses fails here, not on the cluster.
"""

import glob
import os
import sys

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

import main as cli
from callbacks import (AmaxSaturationCallback, BF16WarmupCallback, QuantizedModulesCallback, RNGStateCallback,
                       RunSummaryCallback, StepLogCallback, StepProgressBar, TokenThroughputMonitor)
from qat_app.module import QATModule
from qat_app.preflight import check_fit_settings

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(cli.__file__)), "configs", "*.yaml")))


@pytest.fixture(scope="module")
def deep_tiny_model_dir(module_tmp, embedded_tokenizer):
    """A tiny Llama with 8 blocks, so the configs' ``high_precision_layers: 5`` still leaves blocks to quantize."""
    from tests._tiny_models import save_tiny_llama

    return save_tiny_llama(module_tmp("deep_tiny_model"), embedded_tokenizer, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=8, max_position_embeddings=64)


def test_configs_are_found():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"quickstart.yaml", "eval.yaml", "bf16_baseline.yaml"} | {f"exp{i}.yaml" for i in range(1, 9)} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_config_instantiates(config, tmp_path, monkeypatch, deep_tiny_model_dir):
    spec = yaml.safe_load(open(config))
    trainer_spec, data_spec = spec.get("trainer", {}), spec["data"]
    monkeypatch.chdir(tmp_path)  # the configs' relative output dirs (runs/<name>/...) land in tmp_path
    monkeypatch.setattr(sys, "argv", ["main.py"])  # args given as a list only (no LightningCLI warning)
    text = tmp_path / "docs.txt"
    text.write_text("\n\n".join(f"Document {i}: the amax of the window sets the scale." for i in range(20)))
    args = ["--config", config, "--model.model_name", str(deep_tiny_model_dir),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
            "--trainer.strategy", "auto", "--trainer.precision", "32-true"]
    pretrain = data_spec["class_path"].endswith("PretrainDataModule")
    if pretrain:  # a local file for the hub stream
        args += ["--data.init_args.dataset", "null", "--data.init_args.data_files", str(text)]
    run = cli.cli_main(args, run=False)

    # model and data, with the config's own quantization and batch settings
    assert isinstance(run.model, QATModule)
    quantized = spec.get("model", {}).get("quant", {}).get("enabled", True)
    assert (run.model.quant_report is not None) == quantized
    assert not quantized or run.model.quant_report.num_linears > 0
    assert type(run.datamodule).__name__ == data_spec["class_path"].rsplit(".", 1)[1]
    trainer = run.trainer
    init = data_spec.get("init_args", {})
    if init.get("global_batch_size"):  # 8 GPUs' global batch, now on one device: more accumulation
        assert trainer.accumulate_grad_batches == init["global_batch_size"] // init["micro_batch_size"]
    if pretrain:
        check_fit_settings(run.config)  # what `fit` checks before loading the model
        assert trainer.max_steps == trainer_spec["max_steps"]
        # the cadence is stated in optimizer steps: the same on one device as on the config's 8 GPUs
        assert "val_check_interval" not in trainer_spec, "state val_every_n_steps (optimizer steps) instead"
        assert trainer.val_check_interval == spec["val_every_n_steps"] * trainer.accumulate_grad_batches

    # every configured logger really built: TensorBoard's SummaryWriter needs the tensorboard package
    configured = [entry["class_path"].rsplit(".", 1)[1] for entry in trainer_spec.get("logger", [])]
    assert [type(lg).__name__ for lg in trainer.loggers] == configured
    for logger in trainer.loggers:
        assert logger.experiment is not None
        assert os.path.realpath(logger.log_dir).startswith(os.path.realpath(tmp_path))

    # the always-on callbacks, the default step progress bar, the configured checkpointing (under tmp_path)
    kinds = {type(c) for c in trainer.callbacks}
    assert {BF16WarmupCallback, AmaxSaturationCallback, TokenThroughputMonitor, StepLogCallback, RunSummaryCallback,
            RNGStateCallback, QuantizedModulesCallback, StepProgressBar} <= kinds
    assert isinstance(trainer.progress_bar_callback, StepProgressBar)
    checkpoints = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    configured_ckpt = [c for c in trainer_spec.get("callbacks", []) if c["class_path"].endswith("ModelCheckpoint")]
    assert len(checkpoints) == max(1, len(configured_ckpt))  # Lightning adds one when none is configured
    for c in checkpoints:
        if c.dirpath:
            assert c.dirpath.startswith(os.path.realpath(tmp_path))
