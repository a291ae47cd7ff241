"""The sizes the pages give (``qat_app.sizing``, the ``<!-- model-sizes -->`` table) against the model itself: the
parameters and quantized linears of real transformers models as converted, openPangu-Embedded-1B's counted by an
independent formula, and every size of the 1B a page states equal to the derived one."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qat_app import sizing
from qat_app.config import QuantConfig, quantize_model

ROOT = Path(__file__).resolve().parent.parent


def test_sizes_of_a_real_model_are_what_the_conversion_quantizes():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=96, tie_word_embeddings=True))
    sizes = sizing.model_sizes(model, "tiny", high_precision_layers=5)
    assert sizes.parameters == sum(p.numel() for p in set(model.parameters()))
    report = quantize_model(model, QuantConfig(high_precision_layers=5))
    assert (sizes.quantized_linears, sizes.quantized_parameters) == (report.num_linears, report.num_params)
    assert sizes.blocks == 8 and sizes.quantized_linears == 3 * 3  # blocks 3-5 of 0-7


def test_openpangu_1b_sizes_by_an_independent_count():
    d, f, layers, vocab, kv = 1536, 6144, 26, 153376, 6 * 128
    attention = (d * d + d) * 2 + (d * kv + kv) * 2  # q, o; k, v (openPangu's attention has biases)
    expected = 2 * vocab * d + layers * (3 * d * f + attention + 2 * d) + d  # untied head, two norms a block, final norm
    sizes = sizing.openpangu_1b()
    assert sizes.parameters == expected == 1_391_497_728
    assert (sizes.quantized_linears, sizes.quantized_parameters, sizes.blocks) == (63, 594_542_592, 26)  # the paper's
    assert round(sizes.training_state_gib, 1) == round(expected * 16 / 2**30, 1) == 20.7
    with torch.device("meta"):
        from qat_app.openpangu import OPENPANGU_EMBEDDED_1B, model_from_config

        report = quantize_model(model_from_config(OPENPANGU_EMBEDDED_1B), QuantConfig(high_precision_layers=5))
    assert report.num_params == sizes.quantized_parameters


def test_every_size_of_the_1b_a_page_states_is_the_derived_one():
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    import model_sizes

    sizes = sizing.openpangu_1b()
    derived = {f"{sizes.teacher_gib:.2f}", f"{sizes.training_state_gib:.1f}"}
    texts = [p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").rglob("*.yaml")]]
    stated = [m.group(1) for t in texts for m in re.finditer(
        r"(\d+(?:\.\d+)?) GiB for (?:the 1B model|openPangu-Embedded-1B)", t)]
    assert len(stated) >= 2 and set(stated) <= derived, stated
    table = model_sizes.table()
    assert f"| {sizes.parameters:,} |" in table and f"{sizes.teacher_gib:.2f} GiB" in table
    assert "<!-- model-sizes -->" in (ROOT / "docs" / "cluster.md").read_text()
