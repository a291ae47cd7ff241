"""8-bit saved activations: what autograd keeps for backward, counted byte by byte.

A quantized linear keeps its input as uint8 HiF8 codes plus a 0-d scale, and its weight as codes
(cached once per step); the plain model keeps its inputs in the compute dtype (and, under
autocast, a bf16 copy of every weight). The difference over a whole Llama must be exactly that.
"""

import copy

import pytest
import torch

from qat_app.hif8.formats import get_format

from qat_app.config import QuantConfig
from qat_app.hif8.linear import HiF8Linear
from qat_app.config import quantize_model

HIGH_PRECISION = 2


def saved_for_backward(model, ids, bf16: bool) -> list[torch.Tensor]:
    """Every tensor autograd saves in one forward, each storage once; parameters themselves excluded."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=ids, labels=ids).loss.backward()
    return list(saved.values())


def nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_keeps_its_input_as_one_byte_codes_and_its_weight_as_16_bit_grid_values(dtype):
    layer = HiF8Linear(64, 128, **QuantConfig(fused="off").layer_options()).to(dtype)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    input_sized = [t for t in saved if t.numel() == x.numel()]
    weight_sized = [t for t in saved if t.numel() == layer.weight.numel()]
    assert [t.dtype for t in input_sized] == [torch.uint8]
    assert [t.dtype for t in weight_sized] == [torch.bfloat16]  # the weight's grid values, exact in bf16
    grid = weight_sized[0].float()  # the values of w * s on the HiF8 grid, amax at 15 (current scaling: no history)
    assert torch.equal(get_format("hif8").round_f32(grid), grid) and grid.abs().max() == 15
    # besides: the scales, and the three GEMMs' decode factors made at once
    assert all(t.numel() in (1, 3) for t in saved if t.numel() not in (x.numel(), layer.weight.numel()))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_quantized_model_saves_exactly_the_8bit_difference(tiny_llama, bf16):
    batch, seq = 2, 16
    config = tiny_llama.config
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(tiny_llama)
    plain = nbytes(saved_for_backward(tiny_llama, ids, bf16))
    report = quantize_model(model, QuantConfig(high_precision_layers=HIGH_PRECISION, fused="off"))
    quantized = nbytes(saved_for_backward(model, ids, bf16))

    compute_bytes = 2 if bf16 else 4
    tokens = batch * seq * len(report.quantized_blocks)
    # gate/up's shared input: 4 bytes per element in plain (kept once in fp32, or one bf16 cast per
    # linear under autocast) vs two 1-byte codes; down's input: compute_bytes vs 1 byte; weights:
    # 2-byte grid values vs nothing extra (fp32 keeps the parameter) or a 2-byte copy (autocast)
    input_saving = tokens * (config.hidden_size * (4 - 2) + config.intermediate_size * (compute_bytes - 1))
    weight_saving = report.num_params * ((2 - 2) if bf16 else -2)
    # one float32 scale saved per quantized input and weight, and each linear's three float32 decode factors
    scales = 2 * report.num_linears * 4 + 3 * report.num_linears * 4
    assert plain - quantized == input_saving + weight_saving - scales
