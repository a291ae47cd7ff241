"""End to end through main.py: fit a tiny model across the BF16-warmup switch."""

import csv
import json
import os

import lightning as L
import pytest
import torch
import yaml

import main as cli
from qat_app.hif8.patch import quantized_linears

WARMUP, STEPS, HISTORY = 3, 6, 5


class PhaseRecorder(L.Callback):
    """Records, per optimizer step, whether quantization was on and the history fill at the switch."""

    def __init__(self) -> None:
        self.phases: dict[int, tuple[bool, bool]] = {}
        self.history_at_switch = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        layers = [m for _, m in quantized_linears(pl_module.model)]
        self.phases[trainer.global_step] = (
            all(m.quantize_weights for m in layers), all(m.quantize_activations for m in layers))
        if trainer.global_step == WARMUP:  # the first QAT step, before its own amax is pushed
            self.history_at_switch = layers[0].input_scaler.amax_history.clone()


def write_config(tmp_path, model_dir, corpus, **overrides) -> str:
    config = {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": STEPS,
            "log_every_n_steps": 1, "num_sanity_val_steps": 0, "val_check_interval": 2 * STEPS,
            "check_val_every_n_epoch": None, "enable_progress_bar": False, "default_root_dir": str(tmp_path),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path), "name": "logs"}}],
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 2,
                               "save_top_k": -1}},
                {"class_path": "tests.test_cli_fit.PhaseRecorder"},
            ],
        },
        "warmup": {"warmup_steps": WARMUP},
        "model": {"model_name": str(model_dir), "lr": 1e-3, "lr_schedule": "constant",
                  "quant": {"amax_algo": "max", "history_len": HISTORY, "high_precision_layers": 1, "fused": "off"}},
        "data": {"class_path": "qat_app.data.pretrain.PretrainDataModule",
                 "init_args": {"data_files": str(corpus), "dataset": None, "seq_len": 32, "micro_batch_size": 2,
                               "global_batch_size": 4, "val_documents": 4}},
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_fit_crosses_the_warmup_switch(tmp_path, tiny_model_dir, tiny_corpus):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    run = cli.cli_main(["fit", "--config", config])
    trainer = run.trainer
    assert trainer.global_step == STEPS
    assert trainer.accumulate_grad_batches == 2  # global 4 / (micro 2 x 1 device)
    assert trainer.datamodule.tokenizer_spec == str(tiny_model_dir)  # linked from model.model_name
    recorder = next(c for c in trainer.callbacks if type(c).__name__ == "PhaseRecorder")
    # off for exactly the warmup steps, on from the switch on
    assert recorder.phases == {s: (s >= WARMUP, s >= WARMUP) for s in range(STEPS)}
    # at the switch the window was seeded: the warmup recorded 3 steps, all 5 slots hold values
    assert recorder.history_at_switch is not None and (recorder.history_at_switch > 0).all()
    assert torch.equal(recorder.history_at_switch[WARMUP:],
                       recorder.history_at_switch[:WARMUP].max().expand(HISTORY - WARMUP))
    # saturation metrics reached the logger on every step
    metrics_file = os.path.join(trainer.logger.log_dir, "metrics.csv")
    rows = list(csv.DictReader(open(metrics_file)))
    sat_steps = {int(r["step"]) for r in rows if r.get("sat/clipped_frac")}
    assert sat_steps >= set(range(STEPS))
    assert any(k.startswith("a_hat/") for k in rows[0]) and any(k.startswith("amax/") for k in rows[0])
    summary = json.load(open(os.path.join(trainer.logger.log_dir, "saturation_summary.json")))
    assert summary["global_step"] == STEPS and summary["quantized_tensors"] > 0
    # checkpoints were written and carry the amax histories
    assert os.path.exists(tmp_path / "ckpt" / "last.ckpt")
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert any(k.endswith("input_scaler.amax_history") for k in state)


def test_print_config_and_flags(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    with pytest.raises(SystemExit):
        cli.cli_main(["fit", "--config", config, "--model.quant.amax_algo", "most_recent", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["quant"]["amax_algo"] == "most_recent"
    assert printed["model"]["quant"]["history_len"] == HISTORY
    assert printed["warmup"]["warmup_steps"] == WARMUP
