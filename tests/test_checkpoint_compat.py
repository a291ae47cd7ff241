"""Checkpoints written by earlier versions resume on today's code: the losses after the resume, the final weights
and the optimizer-driven scaler state (amax histories, a_hat, scales, steps recorded) are those of the
uninterrupted run of that code. Three fixtures, all made by tests/fixtures/checkpoint_v1/make.py:

* checkpoint_v1: per-layer scaler buffers, before the exact saturation counters;
* checkpoint_v2: stacked scaler state, exact counters, the hand-written QuantConfig (its MADE_WITH names the
  version that wrote it).
* checkpoint_v3: a GEMM that dequantized first; what-if state and fallback decisions in the state: it resumes under the emulated GEMM, whose fp32 products differ from the
  former ones by roundings only, within the tolerances below.

Each holds the tiny model, corpus and config, the step-2 checkpoint, and the losses and final state of the
uninterrupted 4-step run -- recorded on the machine that made it. Two checks, so that the test holds on any
x86-64 CPU:

* against the recorded run: with tolerances derived from the arithmetic (below). Another CPU runs other
  vectorised float32 kernels (AVX2 vs AVX-512 matmuls, AdamW's fused loops), which sum in another order
  and round the last bits differently; bit-identity to numbers recorded elsewhere is not a property of
  the code. Integer state (steps recorded) is compared exactly.
* bit for bit, within this process: the checkpoint resumed a second time, after scrambling every global
  RNG, continues identically -- the continuation is a function of the checkpoint alone (every RNG state,
  data position, optimizer and scaler buffer comes from it; nothing from the process).
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
import yaml

import main as cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
# fixture -> the directory it was made in (its checkpoint names paths there)
MADE_IN = {"checkpoint_v1": "/tmp/ckv1", "checkpoint_v2": "/tmp/ckv2", "checkpoint_v3": "/tmp/ckv3"}
# telemetry that did not exist (or counted differently) in that code: not part of the exact state
NEW_TELEMETRY = ("quantized_steps", "last_headroom", "min_headroom", "total_clipped", "last_clipped",
                 "saturation_events", "total_numel", "last_numel", "last_a_hat")


def comparable_state(module) -> dict[str, torch.Tensor]:
    """Weights and scaler state by their per-layer names (``...mlp.up_proj.input_scaler.amax_history``)."""
    return {k: v for k, v in module.state_dict().items()
            if isinstance(v, torch.Tensor) and k.rsplit(".", 1)[-1] not in NEW_TELEMETRY}


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


# ---------------------------------------------------------------------------------------- tolerances
# What the recorded run did after the checkpoint: 2 AdamW steps (steps 2 and 3) at lr 1e-3, constant.
RESUMED_STEPS, LR = 2, 1e-3
EPS = torch.finfo(torch.float32).eps  # 1.19e-7: one float32 ulp, relative
# Losses: each is a float32 mean over the step's tokens of a log-softmax over the 303-token vocabulary.
# Summed in another order, n such terms carry ~sqrt(n) eps of relative error (n*eps ~ 5e-5 at worst, all
# roundings one way); 2e-5 (~170 ulps) covers that with room, and is 500x below what the loss moves in one
# step here (~1e-2 relative) -- another batch, scale or optimizer state after the resume would show.
LOSS_RTOL = 2e-5
# Weights: per AdamW step a weight moves by lr * m_hat / (sqrt(v_hat) + eps), an O(lr) step. Other rounding
# changes it by (a) one rounding of the new weight, <= eps * |w|, and (b) the step's sensitivity to the
# gradient's last bits: a relative gradient error d (float32 sums of <= ~100 terms: d <= 100 eps ~ 1e-5)
# moves m_hat / sqrt(v_hat) by <= (1 - beta1) / sqrt(1 - beta2) / sqrt(1 - beta2) * d ~ 100 d ~ 1e-3, i.e.
# <= 1e-3 * lr per step. Summed over the resumed steps: about 2e-6 absolute, while a wrong resume (another
# batch or optimizer state) moves a weight by O(lr) = 1e-3.
WEIGHT_ATOL_PER_UNIT = RESUMED_STEPS * EPS  # times max|w| of the tensor: (a)
WEIGHT_ATOL_LR = RESUMED_STEPS * 1e-3 * LR  # (b)
# Scaler state (float buffers: amax histories, a_hat, scale, last amax): an activation's or gradient's amax
# is the max |x| of float32 matmul outputs; each product of <= 64 terms (hidden 32, MLP 64) may round
# differently by <= 64 eps ~ 8e-6 relative, through <= 3 blocks ~ 2.3e-5; a weight's amax moves with the
# weight by <= the weight tolerance (~2e-6 on |w| >= 0.07: ~3e-5). The scale (max_val / a_hat) inherits
# a_hat's relative error. 5e-5 covers both; a scaler that lost its history or recorded another step differs
# by far more (amax moves by ~1e-2 relative from step to step).
SCALER_RTOL = 5e-5


def assert_close_to_recorded(key: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not want.is_floating_point():
        assert torch.equal(got, want), key  # counters: exact on any machine
    elif "_scaler." in key:
        torch.testing.assert_close(got, want, rtol=SCALER_RTOL, atol=0, msg=key)
    else:
        atol = WEIGHT_ATOL_PER_UNIT * float(want.abs().max()) + WEIGHT_ATOL_LR
        torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=key)


def resume(tmp_path, fixture: str, name: str):
    """Resume ``fixture``'s step-2 checkpoint to step 4 with today's code, in ``tmp_path/name``:
    -> (logged per-step losses, comparable final state)."""
    root = tmp_path / name
    work = root / "fixture"
    shutil.copytree(os.path.join(FIXTURES, fixture), work)
    # the checkpoint names the paths it was made in (/tmp/ckvN): point them at this copy, nothing else changes
    checkpoint = relocate(torch.load(work / "step2.ckpt", weights_only=False), MADE_IN[fixture], str(work))
    torch.save(checkpoint, work / "step2.ckpt")
    text = (work / "config.yaml").read_text().replace("MODEL_DIR", str(work / "model"))
    config = yaml.safe_load(text.replace("CORPUS", str(work / "corpus.jsonl")))
    config["trainer"]["default_root_dir"] = str(root / "run")
    config["trainer"]["logger"][0]["init_args"]["save_dir"] = str(root / "run")
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(root / "run" / "ckpt")
    (root / "config.yaml").write_text(yaml.safe_dump(config))

    trainer = cli.cli_main(["fit", "--config", str(root / "config.yaml"), "--ckpt_path", str(work / "step2.ckpt")]).trainer
    assert trainer.global_step == 4
    rows = list(csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv"))))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    return losses, {k: v.detach().clone() for k, v in comparable_state(trainer.lightning_module).items()}


@pytest.mark.slow
@pytest.mark.parametrize("fixture", sorted(MADE_IN))
def test_checkpoint_of_an_earlier_main_resumes_exactly(tmp_path, fixture):
    losses, got = resume(tmp_path, fixture, "first")

    # 1. the recorded run of the old code, within the tolerances above
    recorded = os.path.join(FIXTURES, fixture)
    expected = {int(k): v for k, v in json.load(open(recorded + "/losses.json")).items() if int(k) >= 2}
    assert sorted(losses) == sorted(expected) == [2, 3]
    assert losses == pytest.approx(expected, rel=LOSS_RTOL, abs=0)
    final = {k: v for k, v in torch.load(os.path.join(recorded, "final_state.pt"), weights_only=True).items()
             if k.rsplit(".", 1)[-1] not in NEW_TELEMETRY}
    assert final.keys() <= got.keys()
    assert any(k.endswith("input_scaler.amax_history") for k in final)
    assert any(k.endswith("grad_scaler.amax_history") for k in final)
    assert "model.model.embed_tokens.weight" in final
    for key, value in final.items():
        assert_close_to_recorded(key, got[key], value)

    # 2. bit for bit in this process: the same checkpoint again, after every global RNG was scrambled
    torch.manual_seed(12345), random.seed(12345), np.random.seed(12345)
    losses_again, got_again = resume(tmp_path, fixture, "again")
    assert losses_again == losses
    assert got_again.keys() == got.keys()
    for key, value in got.items():
        assert torch.equal(got_again[key], value), key
