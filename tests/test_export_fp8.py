"""FP8 serving export (compressed-tensors): HiF8 -> E4M3 exactness, the schema, transformers loading, the served
forward against a few-line reference, fused gate/up, bad input, the CLI with --compare."""

import json

import numpy as np
import pytest
import torch

from qat_app.config import QuantConfig
from qat_app.export import ExportError, export_compressed_tensors, export_hif8, main as export_main
from qat_app.export.compressed import DEQUANT_TOLERANCE, REPORT_FILE, plan_layers
from qat_app.export.served import CHECK_JSON, compare_served, load_served
from qat_app.hif8.fake_quant import dequantize_codes, fake_quantize
from qat_app.hif8.formats import hif8_decode
from qat_app.hif8.fp8_gemm import e4m3_decode_scale, grid_to_e4m3
from qat_app.hif8.patch import quantized_linears, set_quantization
from qat_app.hif8.scaling import all_scalers
from tests._cli_runs import TINY_BENCHMARKS, write_config
from tests._tiny_models import batch, logits, tiny_qat

en_dtypes = pytest.importorskip("en_dtypes")
E4M3 = torch.float8_e4m3fn


def e4m3_values() -> set[float]:
    """Every finite E4M3 value, from the 256 bit patterns (torch's float8_e4m3fn, not our code)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    return {float(v) for v in values if torch.isfinite(v)}


def hif8_values() -> np.ndarray:
    """Every finite HiF8 value, decoded by en_dtypes (the reference, not our decoder)."""
    values = np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float32)
    return values[np.isfinite(values)]


def test_all_256_hif8_codes_map_onto_e4m3_exactly_above_the_floor():
    e4m3 = e4m3_values()
    values = hif8_values()
    in_range = values[np.abs(values) <= 15]  # max_val 15: what a scaled tensor holds
    mapped, exact = grid_to_e4m3(torch.from_numpy(in_range), 15.0)
    independent = np.array([float(v) * 16 in e4m3 for v in in_range])
    np.testing.assert_array_equal(exact.numpy(), independent)
    above = np.abs(in_range) >= 2.0**-12
    assert independent[above].all()  # every value above the floor is an E4M3 value after x16
    np.testing.assert_array_equal(mapped.float().numpy()[above], in_range[above] * 16)
    below = ~independent
    assert below.any() and (np.abs(in_range[below]) < 2.0**-12).all()
    # the rounded tail: to the nearest E4M3 value (ties to even), never further than half a subnormal step (2^-10)
    assert (np.abs(mapped.float().numpy()[below] - in_range[below] * 16) <= 2.0**-10).all()
    assert mapped.float().abs().max() == 240  # 15 x 16, under E4M3's 448


@pytest.mark.parametrize("power_2", [False, True])
def test_e4m3_weights_equal_the_hif8_weights_across_scales(power_2):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(64, 96, generator=g) * float(torch.empty(()).uniform_(-6, 6, generator=g).exp())
        scale = torch.tensor(15.0) / x.abs().amax() * float(torch.empty(()).uniform_(0.5, 2.0, generator=g))
        if power_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        result = fake_quantize(x, scale, 15.0, "hif8", want_codes=True)
        grid = hif8_decode(result.codes)
        e4m3, exact = grid_to_e4m3(grid, 15.0)
        served = e4m3.float() * e4m3_decode_scale(scale, 15.0)  # what compressed-tensors / vLLM multiply
        hif8 = result.dequantized
        relative = ((served - hif8).abs() / hif8.abs().clamp_min(1e-38))[exact]
        assert float(relative.max()) <= DEQUANT_TOLERANCE
        if power_2:
            assert torch.equal(served[exact], hif8[exact])


def _fp8_names(report):
    return set(report["layers"])


def test_export_validates_and_loads_with_transformers_giving_the_qat_weights(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_named_modules
    from transformers import AutoModelForCausalLM

    model = tiny_qat(dtype=torch.float32, power_2_scales=True)
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)  # the schema, as a reader parses it
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    (group,) = parsed.config_groups.values()
    assert group.weights.strategy == "channel" and group.weights.type == "float" and not group.weights.dynamic
    # the default serve target: dynamic per-token inputs (what vLLM's CPU kernel for per-channel weights takes)
    assert group.input_activations.strategy == "token" and group.input_activations.dynamic is True
    assert report["serve_target"]["name"] == "any" and "cuda" in report["serve_target"]["alternatives"]
    fp8 = _fp8_names(report)
    assert fp8 == {f"model.layers.{b}.mlp.{p}" for b in (1, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    assert "lm_head" in parsed.ignore and "model.layers.0.mlp.gate_proj" in parsed.ignore
    assert "model.layers.1.self_attn.q_proj" in parsed.ignore

    served = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    logits(served, batch())  # compressed-tensors decompresses on the first forward
    # vLLM's rule: every linear layer is matched by a group or ignored; compressed-tensors' matcher agrees
    matched = {name for name, _ in match_named_modules(served, group.targets, parsed.ignore)}
    assert matched == fp8
    linears = {n for n, m in served.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == fp8 | (set(parsed.ignore) & linears)
    # vLLM's fused GEMMs (gate_up_proj, qkv_proj) need one scheme for all their shards: all FP8 or all ignored
    for block in range(3):
        for parent, shards in (("mlp", ("gate_proj", "up_proj")), ("self_attn", ("q_proj", "k_proj", "v_proj"))):
            names = [f"model.layers.{block}.{parent}.{shard}" for shard in shards]
            states = {"fp8" if n in fp8 else "ignored" if n in parsed.ignore else "unmatched" for n in names}
            assert len(states) == 1 and "unmatched" not in states
    qat = dict(quantized_linears(model))
    for name in fp8:
        layer = qat[name]
        result, scale = layer.weight_scaler.quantize(layer.weight.detach(), layer.format, want_codes=True)
        loaded = served.get_submodule(name).weight.detach()
        exact = grid_to_e4m3(hif8_decode(result.codes), 15.0)[1]
        assert torch.equal(loaded[exact], result.dequantized[exact])  # power-of-two scales: bit for bit
        assert int((~exact).sum()) == report["layers"][name]["below_floor"]
        assert report["layers"][name]["bitwise_equal_above_floor"]
    # everything else as the QAT model holds it (float32 storage: exactly)
    for name in ("model.layers.1.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.embed_tokens"):
        assert torch.equal(served.get_submodule(name).weight, model.get_submodule(name).weight)
    assert (tmp_path / "fp8" / "quantized_modules.json").is_file() is False  # a bare model: selection unknown
    assert report["bytes"]["weights"] > 0


@pytest.mark.parametrize("target", ["any", "cuda"])
def test_served_forward_equals_a_few_line_reference(tmp_path, target):
    """The transformers-loaded export against an independent reference: E4M3 inputs (clamp +-448, round to nearest
    even) at the static scale (``cuda``) or at each token's amax / 448 (``any``), E4M3 weights times their
    per-channel scales, a plain linear."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model = tiny_qat(dtype=torch.float32)
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32", serve_target=target)
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    reference = LlamaForCausalLM(model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})).eval()
    plain = {k: v for k, v in tensors.items() if not k.endswith(("weight_scale", "input_scale"))}
    fp8 = _fp8_names(report)

    def qdq(x, scale):
        return (x / scale).clamp(-448, 448).to(E4M3).float() * scale

    for name in fp8:
        plain[f"{name}.weight"] = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"]
        if target == "cuda":
            input_scale = tensors[f"{name}.input_scale"]
            hook = (lambda m, args, s=input_scale: (qdq(args[0], s),))
        else:
            assert f"{name}.input_scale" not in tensors
            hook = (lambda m, args: (qdq(args[0], args[0].abs().amax(-1, keepdim=True) / 448),))
        reference.get_submodule(name).register_forward_pre_hook(hook)
    missing, unexpected = reference.load_state_dict(plain, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    served = load_served(tmp_path / "fp8")
    for seed in (1, 2):
        torch.testing.assert_close(logits(served, batch(seed)), logits(reference, batch(seed)), rtol=1e-5, atol=1e-5)
    # the served model is close to, not equal to, the trained one
    comparison = compare_served(model, served, [batch(1), batch(2)])
    assert 0 < comparison.text.kl.difference < 0.05
    assert not torch.equal(logits(served, batch()), logits(model, batch()))


def test_fused_gate_up_keeps_each_weight_exact_under_per_channel_scales(tmp_path):
    """vLLM concatenates gate and up into one weight with their scales: per channel, each row keeps its own; the
    per-tensor alternative re-quantizes to the group's largest scale and re-rounds the HiF8 values."""
    from safetensors.torch import load_file

    model = tiny_qat(dtype=torch.float32)
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    gate, up = "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"
    assert report["layers"][gate]["hif8_weight_scale"] != report["layers"][up]["hif8_weight_scale"]
    fused = torch.cat([tensors[f"{gate}.weight"], tensors[f"{up}.weight"]]).float() * \
        torch.cat([tensors[f"{gate}.weight_scale"], tensors[f"{up}.weight_scale"]])
    qat = dict(quantized_linears(model))
    expected, masks = [], []
    for name in (gate, up):
        layer = qat[name]
        result, _ = layer.weight_scaler.quantize(layer.weight.detach(), layer.format, want_codes=True)
        expected.append(result.dequantized)
        masks.append(grid_to_e4m3(hif8_decode(result.codes), 15.0)[1])
    expected, mask = torch.cat(expected), torch.cat(masks)
    relative = ((fused - expected).abs() / expected.abs().clamp_min(1e-38))[mask]
    assert float(relative.max()) <= DEQUANT_TOLERANCE
    # per-tensor scales, fused as vLLM does (dequantize each shard, re-quantize at the largest scale): re-rounded
    scales = [tensors[f"{n}.weight_scale"][0, 0] for n in (gate, up)]
    largest = max(scales)
    shards = [tensors[f"{n}.weight"].float() * s for n, s in zip((gate, up), scales)]
    requantized = torch.cat([(w / largest).to(E4M3).float() * largest for w in shards])
    assert int(((requantized - expected).abs() > expected.abs() * 2 * DEQUANT_TOLERANCE)[mask].sum()) > 0


def test_fallbacks_and_input_schemes(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model = tiny_qat(dtype=torch.float32)
    layers = dict(quantized_linears(model))
    layers["model.layers.1.mlp.down_proj"].fall_back("weight", "high_precision", step=5, reason="test")
    layers["model.layers.2.mlp.gate_proj"].fall_back("input", "current", step=6, reason="test")  # up_proj does not
    layers["model.layers.1.mlp.gate_proj"].fall_back("input", "current", step=6, reason="test")
    layers["model.layers.1.mlp.up_proj"].fall_back("input", "current", step=6, reason="test")
    layers["model.layers.2.mlp.down_proj"].fall_back("input", "high_precision", step=7, reason="test")
    # the default target has no weight-only group (vLLM's CPU platform has no FP8 W8A16 kernel): dense instead
    # (block 2's gate (CTS) and up (delayed) are both dynamic there, so they fuse)
    schemes, ignored = plan_layers(model)
    assert schemes == {f"model.layers.{b}.mlp.{p}": "w8a8_dynamic" for b in (1, 2) for p in ("gate_proj", "up_proj")}
    assert "no 8-bit weight-only (W8A16) kernel" in ignored["model.layers.2.mlp.down_proj"]
    schemes, ignored = plan_layers(model, "cuda")
    assert schemes == {"model.layers.1.mlp.gate_proj": "w8a8_dynamic", "model.layers.1.mlp.up_proj": "w8a8_dynamic",
                       "model.layers.2.mlp.down_proj": "w8a16"}
    assert "fell back to high precision at step 5" in ignored["model.layers.1.mlp.down_proj"]
    assert "vLLM fuses gate_proj/up_proj" in ignored["model.layers.2.mlp.up_proj"]
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32", serve_target="cuda")
    config = QuantizationConfig.model_validate(json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"])
    kinds = {tuple(sorted(g.targets)): (g.input_activations.dynamic if g.input_activations else None)
             for g in config.config_groups.values()}
    assert kinds == {("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"): True,
                     ("model.layers.2.mlp.down_proj",): None}
    assert {"model.layers.1.mlp.down_proj", "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"} <= set(config.ignore)
    served = load_served(tmp_path / "fp8")
    assert torch.isfinite(logits(served, batch())).all()
    # an ignored layer whose weight was quantized holds the weight the QAT forward used
    up = layers["model.layers.2.mlp.up_proj"]
    result, _ = up.weight_scaler.quantize(up.weight.detach(), up.format)
    assert torch.equal(served.get_submodule("model.layers.2.mlp.up_proj").weight, result.dequantized)
    assert report["totals"]["schemes"] == {"w8a8_static": 0, "w8a8_dynamic": 2, "w8a16": 1}


def test_bad_input_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ExportError, match="input scaler has no amax history"):
        export_compressed_tensors(tiny_qat(dtype=torch.float32, steps=0), tmp_path / "a", serve_target="cuda")
    with pytest.raises(ExportError, match="--serve_target 'tpu'"):
        export_compressed_tensors(tiny_qat(dtype=torch.float32), tmp_path / "a", serve_target="tpu")
    inputs_off = tiny_qat(dtype=torch.float32)
    set_quantization(inputs_off, weights=True, activations=False)  # weight-only everywhere: no CPU kernel
    with pytest.raises(ExportError, match="--serve_target any: no layer of this checkpoint can be served in FP8"):
        export_compressed_tensors(inputs_off, tmp_path / "a")
    with pytest.raises(ExportError, match="model.quant.format 'e5m2'"):
        export_compressed_tensors(tiny_qat(dtype=torch.float32, format="e5m2"), tmp_path / "b")
    warm = tiny_qat(dtype=torch.float32)
    set_quantization(warm, weights=False, activations=False)  # inside the BF16 warmup
    with pytest.raises(ExportError, match="BF16 warmup"):
        export_compressed_tensors(warm, tmp_path / "c")
    assert not any(tmp_path.iterdir())  # nothing written by a refusal
    model = tiny_qat(dtype=torch.float32)
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.ckpt").write_bytes(b"checkpoint")
    with pytest.raises(FileExistsError, match="not empty"):
        export_compressed_tensors(model, run)
    with pytest.raises(FileExistsError, match="holds files of a run"):
        export_compressed_tensors(model, run, overwrite=True)
    assert (run / "last.ckpt").read_bytes() == b"checkpoint"
    export_hif8(model, tmp_path / "h8")
    with pytest.raises(FileExistsError, match=f"no {REPORT_FILE}"):
        export_compressed_tensors(model, tmp_path / "h8", overwrite=True)
    export_compressed_tensors(model, tmp_path / "fp8")
    export_compressed_tensors(model, tmp_path / "fp8", overwrite=True)  # an earlier FP8 export is replaced


@pytest.mark.slow
def test_cli_exports_and_compares_on_the_runs_data(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    from tests._tiny_models import save_qat_checkpoint

    ckpt = save_qat_checkpoint(tmp_path / "m.ckpt", tiny_model_dir)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"data.init_args.benchmarks": TINY_BENCHMARKS})
    out = tmp_path / "fp8"
    # bad flags: a LightningCLI flag without --compare, --compare without the run's config
    with pytest.raises(SystemExit):
        export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--format", "compressed-tensors", "--config", config])
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--format", "compressed-tensors", "--compare"]) == 2
    assert "--config" in capsys.readouterr().err and not out.exists()
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--format", "compressed-tensors", "--compare",
                        "--compare_device", "gpu0", "--config", config]) == 2
    assert "--compare_device 'gpu0'" in capsys.readouterr().err and not out.exists()
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--format", "compressed-tensors", "--compare",
                        "--compare_dtype", "int8", "--config", config]) == 2
    assert "--compare_dtype" in capsys.readouterr().err and not out.exists()
    # the run's noise floor beside its config (as a fit writes it): its answers changed go beside the served flips
    from qat_app.eval.noise_floor import AnswerFlips

    flips = AnswerFlips((0, 1, 2), {"arc_challenge": 12, "mmlu": 12}, {"arc_challenge": [0, 1, 0], "mmlu": [1, 1, 1]},
                        {"arc_challenge": [2, 0, 1], "mmlu": [0, 0, 3]})
    floor_file = tmp_path / "noise_floor.json"
    floor_file.write_text(json.dumps({"text": {"kl": {"difference": 0.01}}, "benchmarks": flips.to_dict()}))
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--format", "compressed-tensors", "--compare",
                        "--compare_batches", "2", "--config", config]) == 0
    printed = capsys.readouterr().out
    assert "| 2/0/1 of 12 |" in printed and "| 0/0/3 of 12 |" in printed and str(floor_file) in printed
    assert json.loads((out / CHECK_JSON).read_text())["run_noise_floor"]["file"] == str(floor_file)
    assert "6 linears in FP8 E4M3 (6 w8a8_dynamic)" in printed and "perplexity" in printed
    check = json.loads((out / CHECK_JSON).read_text())
    assert check["text"]["sequences"] == 4 and check["text"]["kl"]["difference"] > 0
    floor = check["text"]["noise_floor"]  # the served-vs-trained KL is read against the arithmetic's floor
    assert floor["seeds"] == [0, 1, 2] and floor["kl"]["difference"] >= 0 and "noise of the arithmetic" in floor["verdict"]
    assert set(check["benchmarks"]) == {"arc_challenge", "mmlu"}
    assert check["benchmarks"]["arc_challenge"]["acc"]["n"] == 12
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(out)
    assert (out / "quantized_modules.json").is_file()
    # the served side in BF16, as vLLM serves activations: a larger drift than in float32, on the same sequences
    # (the KLs are exact in float64; their intervals do not overlap)
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out), "--overwrite", "--format", "compressed-tensors",
                        "--compare", "--compare_batches", "2", "--compare_dtype", "bfloat16", "--config", config]) == 0
    bf16 = json.loads((out / CHECK_JSON).read_text())
    assert "transformers in bfloat16" in bf16["notes"][0]
    assert bf16["text"]["sequences"] == 4 and bf16["text"]["kl"]["low"] > check["text"]["kl"]["high"]


def test_moe_experts_stay_in_bf16_and_the_dense_mlps_go_fp8(tmp_path):
    from qat_app.config import quantize_model
    from qat_app.hif8.experts import HiF8Experts
    from tests._tiny_models import moe_model

    def qat(model_type):
        model = moe_model(model_type)
        quantize_model(model, QuantConfig(high_precision_layers=2, fused="off", history_len=2))
        model.train()
        for seed in (3, 4):
            with torch.no_grad():
                model(input_ids=torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed)))
            for s in all_scalers(model):
                s.advance()
        return model.eval()

    with pytest.raises(ExportError, match="only quantized modules are MoE experts"):
        export_compressed_tensors(qat("mixtral"), tmp_path / "mixtral")  # experts only
    model = qat("qwen2_moe")  # experts + a dense shared expert per block
    report = export_compressed_tensors(model, tmp_path / "qwen2", dtype="float32")
    experts = [name for name, m in model.named_modules() if isinstance(m, HiF8Experts)]
    assert experts and all("MoE experts" in report["ignored"][name] for name in experts)
    assert _fp8_names(report) == {f"model.layers.{b}.mlp.shared_expert.{p}" for b in (1, 2)
                                  for p in ("gate_proj", "up_proj", "down_proj")}
    served = load_served(tmp_path / "qwen2")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(9))
    assert torch.isfinite(logits(served, ids)).all()
    # the experts hold the fake-quantized weights the QAT forward used
    module = model.get_submodule(experts[0])
    from qat_app.export.source import quantize_experts_param

    _, _, expected = quantize_experts_param(module, "down_proj")
    assert torch.equal(served.get_submodule(experts[0]).down_proj, expected)
    assert experts[0] in json.loads((tmp_path / "qwen2" / "config.json").read_text())["quantization_config"]["ignore"]


def test_the_yardstick_leaves_the_qat_model_as_it_was():
    from qat_app.export.served import compare_on_text
    from qat_app.hif8.patch import quantization_off

    model = tiny_qat(dtype=torch.float32)
    layers = dict(quantized_linears(model))
    layers["model.layers.1.mlp.down_proj"].fall_back("input", "current", step=3, reason="test")
    before = logits(model, batch())
    states = {name: layer.get_extra_state() for name, layer in layers.items()}
    with quantization_off(model):
        off = logits(model, batch())
        assert not any(layer.quantizes_forward() for layer in layers.values())
    assert torch.equal(logits(model, batch()), before) and not torch.equal(off, before)
    assert {name: layer.get_extra_state() for name, layer in layers.items()} == states
    result = compare_on_text(model, model, [batch(1), batch(2)])
    assert result.kl.difference == 0 and result.nll.difference == 0  # a model against itself
    assert result.quantization_kl.difference > 0


def test_an_e4m3_run_exports_without_any_rounding(tmp_path):
    """An E4M3 QAT run (max_val 448: shift 1): its grid values are the served values, none below a floor."""
    model = tiny_qat(dtype=torch.float32, format="e4m3")
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32")
    assert report["qat_format"] == "e4m3" and report["totals"]["below_floor"] == 0
    served = load_served(tmp_path / "fp8")
    logits(served, batch())  # compressed-tensors decompresses on the first forward
    qat = dict(quantized_linears(model))
    for name in report["layers"]:
        layer = qat[name]
        result, _ = layer.weight_scaler.quantize(layer.weight.detach(), layer.format)
        relative = (served.get_submodule(name).weight - result.dequantized).abs() / result.dequantized.abs().clamp_min(1e-38)
        assert float(relative.max()) <= DEQUANT_TOLERANCE


def test_fused_gate_up_inputs_are_served_at_the_larger_scale(tmp_path):
    """vLLM quantizes a fused gate/up input once, at the larger of the two static scales: the export writes that
    one to both (and says so) so transformers' emulation serves what vLLM serves."""
    from safetensors.torch import load_file

    model = tiny_qat(dtype=torch.float32)
    gate, up = "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"
    up_scaler = model.get_submodule(up).input_scaler
    with torch.no_grad():
        up_scaler.scale.mul_(0.5)  # a larger input_scale (1 / (16 s)) for up_proj
    report = export_compressed_tensors(model, tmp_path / "fp8", dtype="float32", serve_target="cuda")
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    (changed,) = report["fused_input_scales_equalized"]
    assert changed["layers"] == [gate, up]
    expected = float(e4m3_decode_scale(up_scaler.scale, 15.0))
    assert changed["served"] == expected and changed["input_scales"][up] == expected
    assert float(tensors[f"{gate}.input_scale"]) == float(tensors[f"{up}.input_scale"]) == expected
    assert report["layers"][gate]["input"]["served_clip"] == pytest.approx(448 * expected)
    assert float(tensors["model.layers.1.mlp.gate_proj.input_scale"]) != expected  # other blocks untouched
