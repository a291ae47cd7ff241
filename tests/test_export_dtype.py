"""The exports keep the run's precision: the unquantized tensors default to the dtype the run computed them in,
read from the checkpoint (32-true -> float32, bf16-mixed -> bfloat16; a checkpoint without it -> bfloat16)."""

from __future__ import annotations

import json

import pytest
import torch

from qat_app.export.cli import main as export_main
from qat_app.export.qat_checkpoint import load_qat_checkpoint, run_dtype
from qat_app.module import CHECKPOINT_KEY
from tests._tiny_models import save_qat_checkpoint


def _checkpoint(tmp_path, model_dir, precision):
    return save_qat_checkpoint(tmp_path / f"{precision}.ckpt", model_dir, precision)


@pytest.mark.parametrize("precision, expected", [("32-true", "float32"), ("bf16-mixed", "bfloat16")])
def test_export_default_dtype_follows_the_runs_precision(tmp_path, tiny_model_dir, capsys, precision, expected):
    ckpt = _checkpoint(tmp_path, tiny_model_dir, precision)
    assert torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]["precision"] == precision
    assert run_dtype(load_qat_checkpoint(ckpt)) == (expected, f"the run's precision {precision}")
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "fp8"), "--format", "compressed-tensors"]) == 0
    assert f"unquantized tensors stored in {expected} (the run's precision {precision}" in capsys.readouterr().out
    assert json.loads((tmp_path / "fp8" / "fp8_export.json").read_text())["storage_dtype"] == expected
    # an override below the run's precision says what it costs (none below a BF16 run's 2 bytes)
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "h8"), "--dtype", "bfloat16"]) == 0
    said = "--dtype bfloat16: the unquantized tensors are rounded from the run's float32"
    assert (said in capsys.readouterr().out) == (expected == "float32")


def test_a_checkpoint_without_the_precision_keeps_bfloat16(tmp_path, tiny_model_dir):
    ckpt = _checkpoint(tmp_path, tiny_model_dir, "32-true")
    state = torch.load(ckpt, weights_only=True)
    del state[CHECKPOINT_KEY]["precision"]  # as an older main wrote it
    torch.save(state, tmp_path / "old.ckpt")
    storage, why = run_dtype(load_qat_checkpoint(tmp_path / "old.ckpt"))
    assert storage == "bfloat16" and "does not record the run's precision" in why
