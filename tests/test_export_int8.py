"""The CPU serve target (``--serve_target cpu``): int8 weights on a power-of-two step per row, per-token int8
inputs; against en_dtypes' HiF8 values, compressed-tensors' schema, transformers' loader and a few-line reference."""

import json

import numpy as np
import pytest
import torch

from qat_app.export import export_compressed_tensors
from qat_app.export.formats import FORMATS
from qat_app.export.int8 import row_shifts
from qat_app.export.served import compare_served, load_served
from qat_app.hif8.patch import quantized_linears
from tests._tiny_models import batch, logits, tiny_qat

en_dtypes = pytest.importorskip("en_dtypes")


def test_a_row_of_every_hif8_value_is_int8_on_an_eighth_exact_from_one_up():
    values = np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float64)
    row = values[np.isfinite(values) & (np.abs(values) <= 15)]  # what a scaled tensor holds (en_dtypes decodes)
    grid = torch.from_numpy(row).float()[None]
    (k,) = row_shifts(grid).tolist()
    assert k == 3  # 15 x 8 = 120 <= 127 < 15 x 16
    q = np.clip(np.round(row * 8), -127, 127)
    exact = q == row * 8
    assert exact[np.abs(row) >= 1].all()  # every value from 1 up is a multiple of 1/8
    assert not exact[(np.abs(row) < 1) & (row != 0)].all()  # finer ones below are rounded ...
    assert np.abs(q / 8 - row).max() <= 1 / 16  # ... by at most half the step
    assert row_shifts(torch.zeros(1, 4)).tolist() == [30.0]  # an all-zero row: a normal float32 scale
    assert row_shifts(torch.tensor([[0.5, -7.0], [100.0, 1.0]])).tolist() == [4.0, 0.0]  # 7 x 16 = 112; 100 x 1


def test_cpu_target_writes_int8_that_compressed_tensors_and_transformers_read_as_the_rounded_hif8_weights(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    model = tiny_qat(dtype=torch.float32)
    report = export_compressed_tensors(model, tmp_path / "int8", dtype="float32", serve_target="cpu")
    config = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert config["format"] == "int-quantized"
    (group,) = parsed.config_groups.values()
    assert (group.weights.type, group.weights.strategy, group.weights.dynamic) == ("int", "channel", False)
    assert (group.input_activations.type, group.input_activations.strategy) == ("int", "token")
    assert group.input_activations.dynamic is True
    assert report["serve_target"]["name"] == "cpu" and "any" in report["serve_target"]["alternatives"]
    assert set(report["layers"]) == {f"model.layers.{b}.mlp.{p}" for b in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    line = FORMATS["compressed-tensors"].summary(tmp_path / "int8", report)  # the CLI's line
    assert "in int8 (serve target cpu" in line and "FP8" not in line

    tensors = load_file(str(tmp_path / "int8" / "model.safetensors"))
    served = load_served(tmp_path / "int8")
    logits(served, batch())  # compressed-tensors decompresses on the first forward
    qat = dict(quantized_linears(model))
    for name, record in report["layers"].items():
        q, step = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        assert q.dtype == torch.int8 and step.shape == (q.shape[0], 1)
        layer = qat[name]
        result, scale = layer.weight_scaler.quantize(layer.weight.detach(), layer.format, want_codes=True)
        hif8 = result.dequantized
        exponent = torch.log2(step.double() * scale.double())  # each row's step: 2^-k grid units
        assert torch.allclose(exponent, exponent.round(), atol=1e-6)
        amax = q.abs().amax(1)
        assert ((amax >= 64) & (amax <= 127)).all()  # the largest step that fits: twice as fine would not
        loaded = served.get_submodule(name).weight.detach()
        torch.testing.assert_close(loaded, q.float() * step, rtol=0, atol=0)
        # half a step at most; float32 products of values up to 127 steps: a few 2^-24 of them on top
        assert ((loaded - hif8).abs() <= step * (0.5 + 127 * 2.0**-22)).all()
        grid = torch.from_numpy(result.codes.numpy().view(en_dtypes.hifloat8).astype(np.float64))  # en_dtypes decodes
        shifted = grid * torch.exp2(-exponent.round())
        on_step = shifted == shifted.round()
        assert torch.equal(q[on_step].double(), shifted[on_step])  # on the row's step: the grid value itself
        assert int((~on_step).sum()) == record["rounded"] and record["rounded"] > 0


def test_cpu_target_forward_equals_a_few_line_int8_reference_and_stays_close_to_the_trained_model(tmp_path):
    """Per-token symmetric int8 inputs (amax / 127, round half to even, as torch.round) times the int8 weights:
    what vLLM's oneDNN kernel computes, in float32."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = tiny_qat(dtype=torch.float32)
    report = export_compressed_tensors(model, tmp_path / "int8", dtype="float32", serve_target="cpu")
    tensors = load_file(str(tmp_path / "int8" / "model.safetensors"))
    reference = LlamaForCausalLM(model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})).eval()
    plain = {k: v for k, v in tensors.items() if not k.endswith("weight_scale")}

    def qdq(x):
        step = x.abs().amax(-1, keepdim=True) / 127.5
        return torch.round(x / step).clamp(-128, 127) * step

    for name in report["layers"]:
        plain[f"{name}.weight"] = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
        reference.get_submodule(name).register_forward_pre_hook(lambda m, args: (qdq(args[0]),))
    missing, unexpected = reference.load_state_dict(plain, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    served = load_served(tmp_path / "int8")
    for seed in (1, 2):
        torch.testing.assert_close(logits(served, batch(seed)), logits(reference, batch(seed)), rtol=1e-5, atol=1e-5)
    comparison = compare_served(model, served, [batch(1), batch(2)])
    assert 0 < comparison.text.kl.difference < 0.05
