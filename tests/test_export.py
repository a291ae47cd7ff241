"""HiF8 8-bit export: exact reload, storage layout, plain-HF export, errors."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from qat_app.config import QuantConfig
from qat_app.errors import CheckpointError
from qat_app.export import (
    LAYOUT_FILE,
    WEIGHTS_FILE,
    ExportError,
    HiF8ExportedLinear,
    export_hf,
    export_hif8,
    load_hif8,
    load_qat_checkpoint,
    main as export_main,
)
from qat_app.hif8.patch import quantized_linears
from qat_app.hif8.scaling import all_scalers
from qat_app.hif8.operand import Operand

from tests._tiny_models import batch, logits, tiny_qat


@pytest.mark.parametrize("algo", ["max", "most_recent", "current"])
def test_reload_reproduces_qat_logits_exactly(tmp_path, algo):
    model = tiny_qat(amax_algo=algo)
    expected = logits(model, batch())
    export_hif8(model, tmp_path / "exp")
    loaded = load_hif8(tmp_path / "exp")
    assert not loaded.training
    assert torch.equal(logits(loaded, batch()), expected)
    assert torch.equal(logits(loaded, batch(seed=5)), logits(model, batch(seed=5)))
    layers = quantized_linears(loaded)
    assert layers and all(isinstance(m, HiF8ExportedLinear) and m.uses_exported_weight for _, m in layers)
    # scaler state restored (history, scale, host-side flag)
    for (name, a), (_, b) in zip(quantized_linears(model), layers):
        for s in ("input_scaler", "weight_scaler"):
            sa, sb = getattr(a, s), getattr(b, s)
            assert torch.equal(sa.amax_history, sb.amax_history) and torch.equal(sa.scale, sb.scale)
            assert sa.has_history == sb.has_history


def test_reload_exact_without_history_and_in_float32(tmp_path):
    # no advance(): every scaler falls back to current scaling; float32 model stored losslessly
    model = tiny_qat(dtype=torch.float32, steps=0)
    assert all(not s.has_history for s in all_scalers(model))
    layout = export_hif8(model, tmp_path / "exp", dtype="float32")
    assert layout["lossless"] is True
    loaded = load_hif8(tmp_path / "exp")
    assert next(loaded.parameters()).dtype == torch.float32
    assert torch.equal(logits(loaded, batch()), logits(model, batch()))
    # a dtype round trip (what a device move does too) keeps the loaded weights in use;
    # an in-place change of a weight drops back to re-quantizing it
    layers = [m for _, m in quantized_linears(loaded)]
    loaded.to(torch.float64).to(torch.float32)
    assert all(m.uses_exported_weight for m in layers)
    assert torch.equal(logits(loaded, batch()), logits(model, batch()))
    with torch.no_grad():
        layers[0].weight.mul_(1.0)
    assert not layers[0].uses_exported_weight and layers[1].uses_exported_weight


def test_float32_model_with_bf16_storage_is_flagged_lossy(tmp_path):
    model = tiny_qat(dtype=torch.float32)
    layout = export_hif8(model, tmp_path / "exp")  # default: BF16 storage of a float32 model
    assert layout["lossless"] is False and layout["storage_dtype"] == "bfloat16"
    # rounding the float32 model's unquantized parameters to bf16 makes the export exact again
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    for _, layer in quantized_linears(model):
        layer._weight_cache = None
    layout = export_hif8(model, tmp_path / "exp2")
    assert layout["lossless"] is True
    assert torch.equal(logits(load_hif8(tmp_path / "exp2"), batch()), logits(model, batch()))


def test_storage_layout(tmp_path):
    model = tiny_qat()
    layout = export_hif8(model, tmp_path / "exp")
    files = sorted(os.listdir(tmp_path / "exp"))
    assert LAYOUT_FILE in files and WEIGHTS_FILE in files and "config.json" in files
    quantized = {name: layer for name, layer in quantized_linears(model)}
    assert set(layout["quantized_layers"]) == set(quantized) and len(quantized) == 6  # blocks 1-2 x 3
    with safe_open(str(tmp_path / "exp" / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
        for name, layer in quantized.items():
            codes, scale = f.get_tensor(f"{name}.weight.codes"), f.get_tensor(f"{name}.weight.scale")
            assert codes.dtype == torch.uint8 and codes.element_size() == 1
            assert codes.shape == layer.weight.shape  # 1 byte per parameter
            assert scale.dtype == torch.float32 and scale.shape == torch.Size([])  # one scalar scale
            assert f"{name}.weight" not in keys
            assert f.get_tensor(f"{name}.input_scaler.amax_history").dtype == torch.float32
        # the unquantized parts in BF16: attention, embeddings, norms, block 0's MLP
        dense = [k for k, e in layout["tensors"].items() if e["role"] == "dense"]
        assert "model.embed_tokens.weight" in dense and "model.layers.0.mlp.up_proj.weight" in dense
        assert "model.layers.1.self_attn.q_proj.weight" in dense
        for key in dense:
            assert f.get_tensor(key).dtype == torch.bfloat16
    # the tied lm_head is stored once
    assert layout["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    codes_bytes = sum(layer.weight.numel() for layer in quantized.values())
    assert layout["bytes"]["codes"] == codes_bytes
    assert layout["bytes"]["scales"] == 4 * len(quantized)


def test_the_same_model_exports_to_the_same_bytes(tmp_path):
    """Every file of a HiF8 export, byte for byte, export after export (the weights file's header included)."""
    import hashlib

    model = tiny_qat()

    def digest(directory):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}

    for i in range(8):  # the header's order came out random once in two exports
        export_hif8(model, tmp_path / f"exp{i}")
    digests = [digest(tmp_path / f"exp{i}") for i in range(8)]
    assert WEIGHTS_FILE in digests[0] and all(d == digests[0] for d in digests[1:])


def test_untied_model_and_weight_quantization_off(tmp_path):
    model = tiny_qat(tie=False)
    name, layer = quantized_linears(model)[0]
    layer.switch(Operand.WEIGHT, False)  # e.g. exported during the BF16 warmup
    expected = logits(model, batch())
    layout = export_hif8(model, tmp_path / "exp")
    assert layout["aliases"] == {}
    assert layout["quantized_layers"][name]["weight"] == "dense"
    loaded = load_hif8(tmp_path / "exp")
    assert loaded.get_submodule(name).quantizes(Operand.WEIGHT) is False
    assert torch.equal(logits(loaded, batch()), expected)


def test_loaded_model_can_continue_training(tmp_path):
    model = tiny_qat()
    export_hif8(model, tmp_path / "exp")
    loaded = load_hif8(tmp_path / "exp")
    loaded.train()
    ids = batch()
    out = loaded(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [m.weight.grad for _, m in quantized_linears(loaded)]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_export_hf_roundtrip(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_qat(dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    export_hf(model, tmp_path / "hf")
    assert quantized_linears(model)  # the given model is untouched
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not any("scaler" in k for k in plain.state_dict())
    name, layer = quantized_linears(model)[0]
    assert torch.equal(plain.get_submodule(name).weight, layer.weight)  # master weights
    # quantized weights: the 8-bit grid the QAT forward used
    export_hf(model, tmp_path / "hfq", weights="quantized")
    plain_q = AutoModelForCausalLM.from_pretrained(tmp_path / "hfq")
    export_hif8(model, tmp_path / "exp", dtype="float32")
    loaded = load_hif8(tmp_path / "exp")
    assert torch.equal(plain_q.get_submodule(name).weight, loaded.get_submodule(name).weight)
    assert not torch.equal(plain_q.get_submodule(name).weight, layer.weight)


def test_never_overwrites_without_flag(tmp_path):
    model = tiny_qat()
    export_hif8(model, tmp_path / "exp")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_hif8(model, tmp_path / "exp")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_hf(model, tmp_path / "exp")
    export_hif8(model, tmp_path / "exp", overwrite=True)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []  # no staging leftovers
    load_hif8(tmp_path / "exp")


def test_overwrite_never_replaces_a_run_or_another_kind_of_export(tmp_path):
    model = tiny_qat()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"precious")
    (run / "logs").mkdir()
    (run / "logs" / "metrics.csv").write_text("step\n")
    before = sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file())
    for export in (export_hif8, export_hf):
        with pytest.raises(FileExistsError, match=r"only replaces an earlier export.*checkpoints/last\.ckpt"):
            export(model, run, overwrite=True)
    assert sorted((p.relative_to(run), p.read_bytes()) for p in run.rglob("*") if p.is_file()) == before
    export_hif8(model, tmp_path / "h8")
    with pytest.raises(FileExistsError, match="not an export of this kind"):
        export_hf(model, tmp_path / "h8", overwrite=True)  # an 8-bit export is not replaced by an HF one
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an export of this kind"):
        export_hif8(model, other, overwrite=True)
    assert (other / "todo.txt").read_text() == "x"


def test_unquantized_model_is_refused(tmp_path, tiny_llama):
    with pytest.raises(ExportError, match="no HiF8Linear"):
        export_hif8(tiny_llama, tmp_path / "exp")


def test_truncated_and_mismatched_files(tmp_path):
    model = tiny_qat()
    out = tmp_path / "exp"
    export_hif8(model, out)
    weights = out / WEIGHTS_FILE
    data = weights.read_bytes()
    # truncated
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=WEIGHTS_FILE + ".*truncated"):
        load_hif8(out)
    # truncated and the layout's size edited to match: safetensors itself refuses, message names the file
    layout = json.loads((out / LAYOUT_FILE).read_text())
    layout["weights_file_bytes"] = len(data) // 2
    (out / LAYOUT_FILE).write_text(json.dumps(layout))
    with pytest.raises(ExportError, match=WEIGHTS_FILE):
        load_hif8(out)
    weights.write_bytes(data)
    layout["weights_file_bytes"] = len(data)
    # a layout that lists a tensor the file lacks
    bad = json.loads(json.dumps(layout))
    bad["tensors"]["model.extra.weight"] = {"role": "dense", "dtype": "bfloat16", "shape": [2]}
    (out / LAYOUT_FILE).write_text(json.dumps(bad))
    with pytest.raises(ExportError, match=f"{LAYOUT_FILE} does not match"):
        load_hif8(out)
    # a layout listing a quantized layer the model built from config.json does not have
    bad = json.loads(json.dumps(layout))
    bad["quantized_layers"][0] = "model.layers.9.mlp.up_proj"
    (out / LAYOUT_FILE).write_text(json.dumps(bad))
    with pytest.raises(ExportError, match=f"{LAYOUT_FILE} does not match the model"):
        load_hif8(out)
    # a wrong dtype in the layout
    bad = json.loads(json.dumps(layout))
    key = next(k for k, e in bad["tensors"].items() if e["role"] == "codes")
    bad["tensors"][key]["dtype"] = "bfloat16"
    (out / LAYOUT_FILE).write_text(json.dumps(bad))
    with pytest.raises(ExportError, match=key):
        load_hif8(out)
    (out / LAYOUT_FILE).write_text("{not json")
    with pytest.raises(ExportError, match=LAYOUT_FILE):
        load_hif8(out)
    os.remove(out / LAYOUT_FILE)
    with pytest.raises(FileNotFoundError, match=LAYOUT_FILE):
        load_hif8(out)


def test_checkpoint_errors(tmp_path, capsys):
    not_ckpt = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "hyper_parameters": {"lr": 1.0}}, not_ckpt)
    with pytest.raises(CheckpointError, match="x.ckpt is not a QATModule checkpoint"):
        load_qat_checkpoint(not_ckpt)
    garbage = tmp_path / "g.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="g.ckpt"):
        load_qat_checkpoint(garbage)
    with pytest.raises(CheckpointError, match="missing.ckpt"):
        load_qat_checkpoint(tmp_path / "missing.ckpt")
    assert export_main(["--ckpt_path", str(not_ckpt), "--out", str(tmp_path / "o")]) == 2
    assert "not a QATModule checkpoint" in capsys.readouterr().err


def test_cli_from_lightning_checkpoint(tmp_path, tiny_model_dir, capsys):
    """A QATModule checkpoint -> hif8 and hf exports via the CLI; the hif8 reload equals the module's forward."""
    import lightning as L

    from qat_app.module import QATModule

    module = QATModule(model_name=str(tiny_model_dir), quant=QuantConfig(high_precision_layers=1, fused="off", history_len=4))
    module.model.train()
    ids = torch.randint(0, 200, (2, 12))
    for _ in range(2):
        with torch.no_grad():
            module.model(input_ids=ids)
        for s in all_scalers(module.model):
            s.advance()
    module.model.eval()
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "h8"), "--dtype", "float32"]) == 0
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "h8")]) == 2  # exists, no --overwrite
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    loaded = load_hif8(tmp_path / "h8")
    assert torch.equal(logits(loaded, ids), logits(module.model, ids))
    assert os.path.isfile(tmp_path / "h8" / "tokenizer_config.json")
    for export in ("h8", "hf"):  # what the QAT model quantized, in both exports
        inventory = json.loads((tmp_path / export / "quantized_modules.json").read_text())
        assert [m["name"] for m in inventory["modules"]] == [n for n, _ in quantized_linears(module.model)]
        assert inventory["high_precision_blocks"] == [0]
    assert "6 quantized modules in blocks 1-2 of 3" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    AutoTokenizer.from_pretrained(tmp_path / "hf")
