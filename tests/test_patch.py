"""Model patching: the paper's layout, other architectures, unpatching, clear errors."""

import pytest
import torch
from torch import nn

from qat_app.config import QuantConfig, QuantConfigError
from qat_app.hif8.linear import HiF8Linear
from qat_app.config import quantize_model
from qat_app.hif8.patch import dequantize_model, quantized_block_range, set_quantization
from tests._paper_layout import assert_paper_layout


def test_openpangu_layout_on_meta_device():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=1536, intermediate_size=6144, num_hidden_layers=26, num_attention_heads=12,
                         num_key_value_heads=12, vocab_size=153376)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert_paper_layout(model)


@pytest.mark.parametrize("k,expected", [(0, range(0, 26)), (1, range(1, 26)), (5, range(3, 24)), (26, range(13, 13))])
def test_high_precision_boundary_blocks(k, expected):
    assert quantized_block_range(26, k) == expected


def test_high_precision_larger_than_model_is_refused(tiny_llama):
    with pytest.raises(QuantConfigError, match="high_precision_layers"):
        quantize_model(tiny_llama, QuantConfig(high_precision_layers=9))


def test_pattern_matching_nothing_is_refused(tiny_llama):
    with pytest.raises(QuantConfigError, match="module_pattern.*matches no linear"):
        quantize_model(tiny_llama, QuantConfig(module_pattern=r"mlp\.w_nonexistent$", high_precision_layers=1))


def _tiny(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(config_cls(vocab_size=64, **kw))


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2"])
def test_other_architectures(family):
    import transformers as tf

    if family == "qwen2":
        model = _tiny(tf.Qwen2Config, tf.Qwen2ForCausalLM, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=2)
    elif family == "mistral":
        model = _tiny(tf.MistralConfig, tf.MistralForCausalLM, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2)
    else:
        model = _tiny(tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=32, n_layer=3, n_head=2)
    ids = torch.randint(0, 64, (2, 8))
    model.eval()
    before = model(input_ids=ids).logits
    report = quantize_model(model, QuantConfig(high_precision_layers=1, quantize_weights=False,
                                               quantize_activations=False, fused="off"))
    assert report.quantized_blocks == [1, 2]
    assert report.num_linears == (4 if family == "gpt2" else 6)  # GPT-2: c_fc + c_proj per block
    # switched off, the patched model computes exactly what the original did
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)
    set_quantization(model, weights=True, activations=True)
    assert not torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)
    assert dequantize_model(model) == report.num_linears
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-6)


def test_unpatch_restores_plain_linears_with_trained_weights(tiny_llama):
    report = quantize_model(tiny_llama, QuantConfig(high_precision_layers=2, fused="off"))
    layer = tiny_llama.get_submodule(report.modules[0])
    with torch.no_grad():
        layer.weight.add_(1.0)
    trained = layer.weight.detach().clone()
    assert dequantize_model(tiny_llama) == report.num_linears
    restored = tiny_llama.get_submodule(report.modules[0])
    assert type(restored) is nn.Linear and torch.equal(restored.weight, trained)
    assert not any(isinstance(m, HiF8Linear) for m in tiny_llama.modules())


def test_patch_twice_is_refused(tiny_llama):
    quantize_model(tiny_llama, QuantConfig(high_precision_layers=0))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(tiny_llama, QuantConfig())


def test_patched_model_parameters_are_shared_not_copied(tiny_llama):
    before = {n: p.data_ptr() for n, p in tiny_llama.named_parameters()}
    quantize_model(tiny_llama, QuantConfig(high_precision_layers=0))
    after = {n: p.data_ptr() for n, p in tiny_llama.named_parameters()}
    assert before == after


class _MyLinear(nn.Linear):  # like Falcon's FalconLinear: an nn.Linear subclass with its own forward
    def forward(self, x):
        return x @ self.weight.T + self.bias


class _OddLinear(nn.Linear):  # a constructor that is not nn.Linear's
    def __init__(self, size: int, *, flag: bool):
        super().__init__(size, size)
        self.flag = flag


def test_unpatch_restores_linear_subclasses():
    from qat_app.hif8.recipe import RuntimeOptions

    torch.manual_seed(0)
    plain = _MyLinear(8, 4)
    layer = HiF8Linear.from_linear(plain, runtime=RuntimeOptions(fused="off"))
    restored = layer.to_float()
    assert type(restored) is _MyLinear
    assert restored.weight is plain.weight and restored.bias is plain.bias
    x = torch.randn(3, 8)
    assert torch.equal(restored(x), plain(x))

    odd = HiF8Linear.from_linear(_OddLinear(4, flag=True), runtime=RuntimeOptions(fused="off"))
    with pytest.warns(UserWarning, match="cannot rebuild _OddLinear"):
        fallback = odd.to_float()
    assert type(fallback) is nn.Linear and fallback.weight is odd.weight
    # built directly (not from a module): a plain nn.Linear as before
    assert type(HiF8Linear(4, 2).to_float()) is nn.Linear
