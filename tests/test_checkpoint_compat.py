"""A checkpoint written by an earlier main (commit ff1cdb1: per-layer scaler buffers, before the exact
saturation counters) resumes exactly on today's code: same losses after the resume, same final weights,
optimizer-driven state and amax histories as the uninterrupted run of that code.

The fixture (tests/fixtures/checkpoint_v1/, made by its make.py) holds the tiny model, corpus and
config, the step-2 checkpoint, and the losses and final state of the uninterrupted 4-step run.
"""

from __future__ import annotations

import csv
import json
import os
import shutil

import pytest
import torch
import yaml

import main as cli

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_v1")
# telemetry that did not exist (or counted differently) in that code: not part of the exact state
NEW_TELEMETRY = ("quantized_steps", "last_headroom", "min_headroom", "total_clipped", "last_clipped",
                 "saturation_events", "total_numel", "last_numel", "last_a_hat")


def comparable_state(module) -> dict[str, torch.Tensor]:
    """Weights and scaler state by their per-layer names (``...mlp.up_proj.input_scaler.amax_history``)."""
    return {k: v for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor) and k.rsplit(".", 1)[-1] not in NEW_TELEMETRY}


MADE_IN = "/tmp/ckv1"


def relocate(value, old: str, new: str):
    """``value`` with the path ``old`` replaced by ``new`` in every string (dicts, lists, hparams)."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return type(value)((k, relocate(v, old, new)) for k, v in value.items()) if type(value) is dict else \
            _relocate_mapping(value, old, new)
    if isinstance(value, (list, tuple)):
        return type(value)(relocate(v, old, new) for v in value)
    return value


def _relocate_mapping(value, old, new):
    for key in list(value.keys()):
        value[key] = relocate(value[key], old, new)
    return value


@pytest.mark.slow
def test_checkpoint_of_the_previous_main_resumes_exactly(tmp_path):
    work = tmp_path / "fixture"
    shutil.copytree(FIXTURE, work)
    # the checkpoint names the paths it was made in (/tmp/ckv1): point them at this copy, nothing else changes
    checkpoint = relocate(torch.load(work / "step2.ckpt", weights_only=False), MADE_IN, str(work))
    torch.save(checkpoint, work / "step2.ckpt")
    text = (work / "config.yaml").read_text().replace("MODEL_DIR", str(work / "model"))
    config = yaml.safe_load(text.replace("CORPUS", str(work / "corpus.jsonl")))
    config["trainer"]["default_root_dir"] = str(tmp_path / "run")
    config["trainer"]["logger"][0]["init_args"]["save_dir"] = str(tmp_path / "run")
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "run" / "ckpt")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))

    trainer = cli.cli_main(["fit", "--config", str(tmp_path / "config.yaml"), "--ckpt_path", str(work / "step2.ckpt")]).trainer
    assert trainer.global_step == 4
    rows = list(csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv"))))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    expected = {int(k): v for k, v in json.load(open(work / "losses.json")).items() if int(k) >= 2}
    assert losses == expected  # bit-identical losses after the resume

    final = {k: v for k, v in torch.load(work / "final_state.pt", weights_only=True).items()
             if k.rsplit(".", 1)[-1] not in NEW_TELEMETRY}
    got = comparable_state(trainer.lightning_module)
    assert final.keys() <= got.keys()
    assert any(k.endswith("input_scaler.amax_history") for k in final)
    for key, value in final.items():
        assert torch.equal(got[key], value), key
