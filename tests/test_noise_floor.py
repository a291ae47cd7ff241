"""The noise floor of a W8A8 forward (qat_app/eval/noise_floor.py): zero for an unquantized model, above what the
perturbation does to the same model unquantized for a quantized one, bad settings named."""

from __future__ import annotations

import pytest
import torch

from qat_app.eval.noise_floor import NoiseFloorError, noise_floor, perturbed_inputs
from qat_app.hif8.patch import set_quantization
from qat_app.stats import PairedResult
from tests._tiny_models import tiny_qat


def _batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 96, (4, 24), generator=g) for _ in range(3)]


def test_unquantized_floor_is_exactly_zero_and_the_perturbation_changes_only_rounding():
    model = tiny_qat(dtype=torch.float32)
    set_quantization(model, weights=False, activations=False)
    floor = noise_floor(model, _batches())
    assert not floor.quantized and floor.kl.difference == 0.0 and floor.kl.high == 0.0
    assert "unquantized" in floor.describe()
    # measured all the same: the unquantized forward moves by float rounding only (KL ~ (1e-7)^2)
    forced = noise_floor(model, _batches(), quantized=True)
    assert 0 <= forced.kl.difference < 1e-10


def test_quantized_floor_is_positive_and_far_above_the_rounding_alone():
    """A quantized forward flips grid points under the perturbation (at 1e-5 on this tiny model's 288 tokens; a
    135M model flips at 1e-7), moving its output >1000x more than the same model unquantized."""
    model = tiny_qat(dtype=torch.float32)
    floor = noise_floor(model, _batches(), seeds=(0, 1, 2), relative=1e-5)
    set_quantization(model, weights=False, activations=False)
    rounding = noise_floor(model, _batches(), quantized=True, relative=1e-5)
    assert floor.quantized and floor.kl.difference > 0 and floor.kl.n == 3 * 12 and floor.kl.n_clusters == 12
    assert floor.kl.difference > 1e3 * max(rounding.kl.difference, 1e-30)
    assert len(floor.perplexity_ratios) == 3 and all(lo <= r <= hi for r, lo, hi in floor.perplexity_ratios)
    # the same seeds give the same floor (a CPU draw); the hook is gone afterwards
    again = tiny_qat(dtype=torch.float32)
    assert noise_floor(again, _batches(), seeds=(0, 1, 2), relative=1e-5).kl == floor.kl
    assert not again.get_input_embeddings()._forward_hooks


def test_verdicts_against_the_floor():
    floor = noise_floor(tiny_qat(dtype=torch.float32), _batches(), relative=1e-5)
    high = floor.kl.high

    def kl(low, hi):
        return PairedResult(difference=(low + hi) / 2, se=0.0, low=low, high=hi, n=1, n_clusters=1, z=0.0)

    assert floor.verdict(kl(0.0, high * 0.9)) == "within the noise of the arithmetic"
    assert floor.verdict(kl(high * 1.1, high * 2)) == "above the noise of the arithmetic"
    assert floor.verdict(kl(high * 0.5, high * 2)) == "overlaps the noise of the arithmetic"


def test_bad_settings_name_the_setting():
    model = tiny_qat(dtype=torch.float32)
    for relative in (0.0, -1e-7, 2e-3):
        with pytest.raises(NoiseFloorError, match="noise_floor.relative"):
            noise_floor(model, _batches(), relative=relative)
    with pytest.raises(NoiseFloorError, match="noise_floor.seeds: at least 2"):
        noise_floor(model, _batches(), seeds=(3, 3))
    with perturbed_inputs(model, 1e-7, 0):
        assert model.get_input_embeddings()._forward_hooks
