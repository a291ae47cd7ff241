"""The exports keep the run's precision: the unquantized tensors default to the dtype the run computed them in,
read from the checkpoint (32-true -> float32, bf16-mixed -> bfloat16; a checkpoint without it -> bfloat16)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qat_app.export.cli import main as export_main
from qat_app.export.qat_checkpoint import load_qat_checkpoint, run_dtype
from qat_app.module import CHECKPOINT_KEY
from qat_app.hif8.operand import Operand
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
    del state[CHECKPOINT_KEY]["precision"]  # as an earlier version wrote it
    torch.save(state, tmp_path / "old.ckpt")
    storage, why = run_dtype(load_qat_checkpoint(tmp_path / "old.ckpt"))
    assert storage == "bfloat16" and "does not record the run's precision" in why


@pytest.mark.slow
def test_a_bf16_mixed_fits_export_holds_the_codes_it_trained_with(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    """A bf16-mixed fit quantizes bf16(w) * s: with the defaults, every exported code (HiF8 and FP8) is en_dtypes'
    code of exactly that, and the float32 codes the export used to default to differ (counted by an override)."""
    en_dtypes = pytest.importorskip("en_dtypes")
    from safetensors.torch import load_file

    from qat_app.export.layout import WEIGHTS_FILE
    from qat_app.export.source import changed_codes
    from qat_app.hif8.linear import HiF8Linear
    from tests._cli_runs import checkpointed_fit

    checkpointed_fit(tmp_path / "run", tiny_model_dir, tiny_corpus, **{"trainer.precision": "bf16-mixed"})
    ckpt = str(tmp_path / "run" / "ckpt" / "last.ckpt")
    module = load_qat_checkpoint(ckpt)
    layers = {name.removeprefix("model."): m for name, m in module.named_modules() if isinstance(m, HiF8Linear)}
    assert layers and all(m.quantizes(Operand.WEIGHT) for m in layers.values())

    def trained_codes(layer) -> np.ndarray:  # en_dtypes' HiF8 of clamp(bf16(w) * s, +-15)
        scaled = (layer.weight.detach().bfloat16().float() * layer.weight_scaler.scale.float()).clamp(-15, 15)
        return scaled.numpy().astype(en_dtypes.hifloat8).view(np.uint8)

    assert export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "h8")]) == 0
    assert "weight codes computed in bfloat16 (the run's precision bf16-mixed" in capsys.readouterr().out
    exported = load_file(str(tmp_path / "h8" / WEIGHTS_FILE))
    assert export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "fp8"), "--format", "compressed-tensors"]) == 0
    fp8 = {k: v for f in (tmp_path / "fp8").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for name, layer in layers.items():
        expected = trained_codes(layer)
        assert np.array_equal(exported[f"{name}.weight.codes"].numpy(), expected), name
        served = fp8[f"{name}.weight"].float() / 16  # E4M3 holds the grid values x 16 (exactly, above the tail)
        grid = torch.from_numpy(expected.view(en_dtypes.hifloat8).astype(np.float32))
        exact = grid.abs() >= 2.0**-12
        assert torch.equal(served[exact], grid[exact]), name
    trained, total = changed_codes(module.model, torch.bfloat16, torch.float32)
    assert 0 < trained < total  # what the float32 default wrote: codes that were never trained
    assert export_main(["--ckpt_path", ckpt, "--out", str(tmp_path / "h8f"), "--compute_dtype", "float32"]) == 0
    assert (f"--compute_dtype float32: {trained:,} of {total:,} weight codes differ from the ones the run trained "
            "with (bfloat16, the run's precision bf16-mixed)") in capsys.readouterr().out
