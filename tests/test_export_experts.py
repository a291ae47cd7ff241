"""The 8-bit export of quantized MoE experts: per-expert uint8 codes + scales, an exact reload, and the plain
HF export of a MoE model."""

from __future__ import annotations

import torch
from safetensors import safe_open

from qat_app.config import QuantConfig, quantize_model
from qat_app.export import WEIGHTS_FILE, checkpoint_bytes, export_hf, export_hif8, load_hif8
from qat_app.hif8.experts import HiF8Experts
from qat_app.hif8.patch import quantized_linears, set_quantization
from qat_app.hif8.scaler_bank import advance_all
from qat_app.hif8.scaling import all_scalers
from qat_app.hif8.operand import Operand
from tests._tiny_models import moe_model

QUANT = QuantConfig(high_precision_layers=2, fused="off", history_len=2)


def ids(seed=1):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def qat_mixtral(steps=2):
    model = moe_model("mixtral")  # 4 blocks: blocks 1-2 quantized (experts only)
    quantize_model(model, QUANT)
    model.train()
    for step in range(steps):
        with torch.no_grad():
            model(input_ids=ids(10 + step))
        advance_all(all_scalers(model))
    model.eval()
    return model


def experts_modules(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, HiF8Experts)}


def scaler_states(model):
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_scaler." in k}


def test_experts_export_reloads_exactly(tmp_path):
    model = qat_mixtral()
    experts = experts_modules(model)
    assert set(experts) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert int(model.get_submodule("model.layers.1.mlp.experts.gate_up.0.weight_scaler").steps_recorded) == 2
    expected = logits(model, ids())
    layout = export_hif8(model, tmp_path / "exp", dtype="float32")
    assert set(layout["quantized_experts"]) == set(experts) and layout["quantized_layers"] == {}

    # storage: one uint8 codes tensor per fused parameter (1 byte per weight), float32 scales [E]
    expert_params = 0
    with safe_open(str(tmp_path / "exp" / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
        for name, module in experts.items():
            for param in ("gate_up_proj", "down_proj"):
                weight = getattr(module, param)
                codes, scales = f.get_tensor(f"{name}.{param}.codes"), f.get_tensor(f"{name}.{param}.scales")
                assert codes.dtype == torch.uint8 and codes.element_size() == 1 and codes.shape == weight.shape
                assert scales.dtype == torch.float32 and scales.shape == (module.num_experts,)
                assert f"{name}.{param}" not in keys
                assert layout["tensors"][f"{name}.{param}.codes"]["role"] == "codes"
                assert layout["tensors"][f"{name}.{param}.scales"]["role"] == "scale"
                expert_params += weight.numel()
        key = "model.layers.1.mlp.experts.gate_up.3.input_scaler.amax_history"
        assert key in keys and layout["tensors"][key]["role"] == "scaler_state"
        assert "model.layers.0.mlp.experts.gate_up_proj" in keys  # a boundary block: dense, float32
    assert layout["bytes"]["codes"] == expert_params
    assert layout["bytes"]["scales"] == 4 * 2 * sum(m.num_experts for m in experts.values())
    # the file: the header, then the codes at 1 byte per expert weight and everything else at its own size
    with open(tmp_path / "exp" / WEIGHTS_FILE, "rb") as fh:
        header = 8 + int.from_bytes(fh.read(8), "little")
    assert checkpoint_bytes(tmp_path / "exp") == header + sum(layout["bytes"].values())
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    buffers = sum(4 * torch.Size(e["shape"]).numel() for e in layout["tensors"].values()
                  if e["role"] == "nonpersistent_buffer")
    data = checkpoint_bytes(tmp_path / "exp") - header
    assert data == full - 3 * expert_params + layout["bytes"]["scales"] + buffers  # 4 -> 1 byte per expert weight

    loaded = load_hif8(tmp_path / "exp")
    assert set(experts_modules(loaded)) == set(experts)
    assert torch.equal(logits(loaded, ids()), expected)
    assert torch.equal(logits(loaded, ids(5)), logits(model, ids(5)))
    ours, theirs = scaler_states(model), scaler_states(loaded)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for (name, a), (_, b) in zip(quantized_linears(model), quantized_linears(loaded)):
        assert [s.has_history for s in a.scalers()] == [s.has_history for s in b.scalers()], name
        assert a.get_extra_state() == b.get_extra_state()
    loaded_experts = loaded.get_submodule("model.layers.1.mlp.experts")
    assert loaded_experts.gate_up[0].weight_source.holds(loaded_experts.gate_up_proj[0])


def test_exported_flag_falls_back_on_change_and_training(tmp_path):
    model = qat_mixtral()
    export_hif8(model, tmp_path / "exp", dtype="float32")
    loaded = load_hif8(tmp_path / "exp")
    experts = loaded.get_submodule("model.layers.1.mlp.experts")
    proj, weight = experts.gate_up[0], experts.gate_up_proj
    stored = proj.weight_source.codes

    def uses_stored_codes() -> bool:
        return proj.quantized_weight(weight[0], torch.float32).saved.data_ptr() == stored.data_ptr()

    assert uses_stored_codes()  # the exported codes and scale, used as they are
    loaded.train()
    assert not uses_stored_codes()  # training: quantized as usual
    loaded.eval()
    assert uses_stored_codes()
    with torch.no_grad():
        weight.mul_(1.0)  # any in-place change
    assert not uses_stored_codes()
    # a loaded model can continue QAT
    loaded.train()
    out = loaded(input_ids=ids(), labels=ids())
    out.loss.backward()
    assert torch.isfinite(out.loss) and experts.gate_up_proj.grad.abs().sum() > 0


def test_experts_with_weight_quantization_off_are_stored_dense(tmp_path):
    model = qat_mixtral()
    set_quantization(model, weights=False, activations=True)
    expected = logits(model, ids())
    layout = export_hif8(model, tmp_path / "exp", dtype="float32")
    record = layout["quantized_experts"]["model.layers.1.mlp.experts"]
    assert record["params"]["gate_up_proj"]["weight"] == "dense"
    assert layout["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]["role"] == "dense"
    loaded = load_hif8(tmp_path / "exp")
    assert loaded.get_submodule("model.layers.1.mlp.experts.gate_up.0").quantizes(Operand.WEIGHT) is False
    assert torch.equal(logits(loaded, ids()), expected)


def test_export_hf_of_a_moe_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = qat_mixtral()
    set_quantization(model, weights=False, activations=False)
    reference = logits(model, ids())  # quantization off: the original model's logits
    set_quantization(model, weights=True, activations=True)
    export_hf(model, tmp_path / "hf")
    assert experts_modules(model)  # the given model is untouched
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    plain.config._experts_implementation = "eager"
    assert not any("scaler" in k for k in plain.state_dict())
    assert type(plain.model.layers[1].mlp.experts).__name__ == "MixtralExperts"
    assert torch.equal(logits(plain.eval(), ids()), reference)
    # quantized weights: the experts' 8-bit grid, as in the 8-bit export
    export_hf(model, tmp_path / "hfq", weights="quantized")
    plain_q = AutoModelForCausalLM.from_pretrained(tmp_path / "hfq")
    export_hif8(model, tmp_path / "exp", dtype="float32")
    loaded = load_hif8(tmp_path / "exp")
    name = "model.layers.2.mlp.experts"
    for param in ("gate_up_proj", "down_proj"):
        q = getattr(plain_q.get_submodule(name), param)
        assert torch.equal(q, getattr(loaded.get_submodule(name), param))
        assert not torch.equal(q, getattr(model.get_submodule(name), param))
