"""End to end through main.py: fit a tiny model across the BF16-warmup switch."""

import csv
import json
import os

import pytest
import torch
import yaml

import main as cli
from qat_app.hif8.patch import quantized_linears
from tests._cli_runs import HISTORY, STEPS, WARMUP, write_config


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
    # quantized_modules.json lists exactly the quantized matmuls; the config's boundary block stays in high precision
    inventory = json.load(open(os.path.join(trainer.logger.log_dir, "quantized_modules.json")))
    assert [m["name"] for m in inventory["modules"]] == [n for n, _ in quantized_linears(run.model.model)]
    assert inventory["high_precision_blocks"] == [0] and inventory["quantized_blocks"] == [1, 2]
    # checkpoints were written and carry the amax histories
    assert os.path.exists(tmp_path / "ckpt" / "last.ckpt")
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert any(k.endswith("input_scaler.amax_history") for k in ckpt["state_dict"])
    # the settings are stored as plain values: no class of ours is pickled, so moving one cannot break a checkpoint
    quant = ckpt["hyper_parameters"]["quant"]
    assert type(quant) is dict and quant["history_len"] == HISTORY and quant["amax_algo"] == "max"
    ours = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "ckpt" / "last.ckpt")
            if g.split(".")[0] in ("qat_app", "callbacks", "tests")]
    assert ours == []


def test_print_config_and_flags(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    with pytest.raises(SystemExit):
        cli.cli_main(["fit", "--config", config, "--model.quant.amax_algo", "most_recent", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["quant"]["amax_algo"] == "most_recent"
    assert printed["model"]["quant"]["history_len"] == HISTORY
    assert printed["warmup"]["warmup_steps"] == WARMUP
