"""``main.py inspect``: per-layer HiF8-vs-high-precision SQNR on the same input, its ranking, files and suggestion."""

import csv
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

import main as cli
from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.formats import hif8_round_f32
from qat_app.hif8.layer_error import (EndToEnd, calibrate, end_to_end, exclusion_pattern, layer_comparison,
                                      suggest_high_precision_layers)
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.patch import convert_to_hif8_training, quantized_linears, set_quantization
from qat_app.hif8.recipe import DEFAULT_MODULE_PATTERN, LayerSelection
from tests._cli_runs import write_config

MAX_VAL = 15.0  # HiF8's default max_val


def batches(n: int, seed: int, vocab: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def logits_of(model):
    return lambda input_ids: model(input_ids=input_ids).logits


def plant_outlier(mlp: torch.nn.Module) -> None:
    """A down_proj weight 1e9 times the largest on an input channel that is always 0 (its up_proj row zeroed): the
    output is unchanged, but the per-tensor scale maps the outlier to max_val and flushes every other weight to zero."""
    with torch.no_grad():
        mlp.up_proj.weight[0].zero_()
        mlp.down_proj.weight[0, 0] = mlp.down_proj.weight.abs().max() * 1e9


def record_inputs(model) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Every quantized linear's input, per call (forward hooks)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [layer.register_forward_hook(lambda m, args, out, name=name: seen.setdefault(name, []).append(args[0].detach()))
             for name, layer in quantized_linears(model)]
    return seen, hooks


def test_per_layer_sqnr_equals_an_independent_computation(tiny_llama):
    """Calibrated delayed scales (max of the calibration batches' amax), then each layer's SQNR and cosine as
    the grid values' product with the decode scales gives them on the inputs the high-precision model feeds it."""
    model = tiny_llama
    quantize_model(model, QuantConfig(high_precision_layers=0, fused="off", history_len=8))
    calibration, compared = batches(2, seed=1), batches(2, seed=2)
    seen, hooks = record_inputs(model)
    calibrate(model, calibration, logits_of(model))
    input_amax = {name: torch.stack([x.abs().amax() for x in xs]).max() for name, xs in seen.items()}
    seen.clear()
    errors = {}
    with torch.no_grad(), layer_comparison(model, errors):
        for input_ids in compared:
            model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    assert set(errors) == {name for name, _ in quantized_linears(model)} and len(errors) == 12
    def grid(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # the HiF8 grid values of t * scale
        return hif8_round_f32((t.float() * scale).clamp(-MAX_VAL, MAX_VAL))

    for name, layer in quantized_linears(model):
        w = layer.weight.detach()
        s_w = MAX_VAL / w.abs().amax()
        signal = noise = dot = power = 0.0
        for x in seen[name]:
            y = F.linear(x, w).double()
            # the hardware's arithmetic (the default gemm): grid values, fp32 accumulator, 1 / (s_x s_w) on it
            s_x = MAX_VAL / input_amax[name]
            factor = torch.reciprocal(s_x.double() * s_w.double()).float()
            flat = grid(x, s_x).reshape(-1, x.shape[-1]) @ grid(w, s_w).t()
            y_q = (flat * factor).reshape(*x.shape[:-1], -1).double()
            signal, noise = signal + float(y.square().sum()), noise + float((y_q - y).square().sum())
            dot, power = dot + float((y * y_q).sum()), power + float(y_q.square().sum())
        assert errors[name].sqnr_db == pytest.approx(10 * math.log10(signal / noise), rel=1e-9), name
        assert errors[name].cosine == pytest.approx(dot / math.sqrt(signal * power), rel=1e-12), name
        assert errors[name].block == int(re.search(r"layers\.(\d+)\.", name).group(1))


def test_every_layer_sees_the_high_precision_input(tiny_llama):
    """The errors do not compound: under the comparison each layer gets exactly the unquantized model's input."""
    model = tiny_llama
    quantize_model(model, QuantConfig(high_precision_layers=0, fused="off", amax_algo="current"))
    model.eval()
    (input_ids,) = batches(1, seed=3)
    seen, hooks = record_inputs(model)
    with torch.no_grad():
        set_quantization(model, weights=False, activations=False)
        reference_logits = model(input_ids=input_ids).logits
        reference = {name: xs[0] for name, xs in seen.items()}
        seen.clear()
        with layer_comparison(model, {}):
            compared_logits = model(input_ids=input_ids).logits
    for hook in hooks:
        hook.remove()
    assert all(torch.equal(seen[name][0], reference[name]) for name in reference)
    assert torch.equal(compared_logits, reference_logits)
    totals = EndToEnd()
    end_to_end(model, input_ids, logits_of(model), totals)  # the whole quantized model: errors compound
    assert totals.tokens == input_ids.numel() and totals.kl_per_token > 0 and math.isfinite(totals.logits_sqnr_db)


@pytest.mark.parametrize("bad_block,expected_k", [(0, 1), (3, 2), (1, 3)])  # 4 blocks: first ceil(k/2), last floor(k/2)
def test_the_suggested_k_leaves_a_planted_bad_layer_in_high_precision(tiny_llama, bad_block, expected_k):
    model = tiny_llama
    bad = f"model.layers.{bad_block}.mlp.down_proj"
    plant_outlier(model.model.layers[bad_block].mlp)
    quantize_model(model, QuantConfig(high_precision_layers=0, fused="off", amax_algo="current"))
    model.eval()
    errors = {}
    with torch.no_grad(), layer_comparison(model, errors):
        for input_ids in batches(2, seed=4):
            model(input_ids=input_ids)
    floor = 20.0
    assert [name for name, e in errors.items() if e.sqnr_db < floor] == [bad]  # the plant worked, and only there
    assert suggest_high_precision_layers(errors.values(), 4, floor) == expected_k
    assert suggest_high_precision_layers(errors.values(), 4, floor, measured_k=expected_k + 1) == expected_k + 1
    assert suggest_high_precision_layers(errors.values(), 4, errors[bad].sqnr_db) == 0  # nothing below this floor


def test_the_exclusion_pattern_selects_all_but_the_named(tiny_llama):
    excluded = ["model.layers.1.mlp.up_proj", "model.layers.3.mlp.down_proj"]
    pattern = exclusion_pattern(DEFAULT_MODULE_PATTERN, excluded)
    report = convert_to_hif8_training(tiny_llama, selection=LayerSelection(module_pattern=pattern, high_precision_layers=0))
    every = {f"model.layers.{b}.mlp.{p}" for b in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(report.modules) == every - set(excluded)


# ------------------------------------------------------------------------------------------ the command
@pytest.fixture
def planted_model_dir(tmp_path, tiny_model_dir):
    """The tiny 3-block model with an outlier planted in the last block's down_proj."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plant_outlier(model.model.layers[2].mlp)
    model.save_pretrained(tmp_path / "planted")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "planted")
    return tmp_path / "planted"


def test_the_command_ranks_writes_and_suggests(tmp_path, planted_model_dir, tiny_corpus, capsys):
    config = write_config(tmp_path, planted_model_dir, tiny_corpus)  # quant.high_precision_layers 1
    out = tmp_path / "inspect"
    cli.main(["inspect", "--config", config, "--batches", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "scales:  delayed, calibrated on 2 other batches" in printed and "do not compound" in printed
    document = json.loads((out / "layer_sqnr.json").read_text())
    layers = document["layers"]
    every = {f"model.layers.{b}.mlp.{p}" for b in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    assert {row["layer"] for row in layers} == every  # every block measured, whatever the configured k
    sqnr = [row["sqnr_db"] for row in layers]
    assert sqnr == sorted(sqnr) and [row["rank"] for row in layers] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    bad = "model.layers.2.mlp.down_proj"
    assert layers[0]["layer"] == bad and document["below_floor_at_measured_layout"] == [bad]
    assert (document["measured_high_precision_layers"], document["configured_high_precision_layers"]) == (0, 1)
    assert document["suggested_high_precision_layers"] == 2  # the last block of 3: last floor(k/2) >= 1
    assert "--model.quant.high_precision_layers 2 (configured: 1)" in printed
    fresh = quantize_model(_fresh_tiny(), QuantConfig(module_pattern=document["suggested_module_pattern"],
                                                       high_precision_layers=0))
    assert set(fresh.modules) == every - {bad}
    assert document["end_to_end"]["tokens"] == 2 * 2 * 32 and document["end_to_end"]["kl_per_token"] > 0
    floor = document["end_to_end"]["noise_floor"]  # the end-to-end KL beside the arithmetic's floor
    assert floor["seeds"] == [0, 1, 2] and floor["kl"]["difference"] >= 0 and len(floor["perplexity_ratios"]) == 3
    assert "noise floor of the arithmetic" in printed
    with open(out / "layer_sqnr.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer"] for r in rows] == [row["layer"] for row in layers]
    assert [float(r["sqnr_db"]) for r in rows] == pytest.approx(sqnr, rel=1e-12)
    assert [r["below_floor"] for r in rows] == ["True"] + ["False"] * 8


def _fresh_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                        num_key_value_heads=2, vocab_size=64))


def test_a_checkpoint_brings_its_layout_and_scales(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    import lightning as L

    from qat_app.hif8.scaling import all_scalers
    from qat_app.module import QATModule

    module = QATModule(model_name=str(tiny_model_dir), quant=QuantConfig(high_precision_layers=1, fused="off", history_len=4))
    module.model.train()
    for input_ids in batches(2, seed=5, vocab=200):
        with torch.no_grad():
            module.model(input_ids=input_ids)
        for scaler in all_scalers(module.model):
            scaler.advance()
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "qat.ckpt")
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"model.quant.high_precision_layers": 0})
    cli.main(["inspect", "--config", config, "--ckpt_path", str(tmp_path / "qat.ckpt"), "--batches", "1",
              "--out", str(tmp_path / "inspect")])
    document = json.loads((tmp_path / "inspect" / "layer_sqnr.json").read_text())
    assert document["scales"].startswith("delayed, from the checkpoint's amax histories")
    assert document["measured_high_precision_layers"] == 1  # the checkpoint's layout, not the config's 0
    quantized = [name for name, layer in quantized_linears(module.model) if isinstance(layer, HiF8Linear)]
    assert sorted(row["layer"] for row in document["layers"]) == sorted(quantized) and len(quantized) == 6
    assert "(" + str(tmp_path / "qat.ckpt") + ")" in capsys.readouterr().out
