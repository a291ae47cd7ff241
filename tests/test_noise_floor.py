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


# ------------------------------------------------------------------------------------------ at the end of a fit
def _fit(tmp_path, model_dir, corpus, *extra):
    import main as cli
    from tests._cli_runs import TINY_BENCHMARKS, write_config

    config = write_config(tmp_path, model_dir, corpus, **{"data.init_args.benchmarks": TINY_BENCHMARKS})
    return cli.cli_main(["fit", "--config", config, *extra]).trainer


def _callback(trainer, name):
    return next(c for c in trainer.callbacks if type(c).__name__ == name)


@pytest.mark.slow
def test_a_fit_ends_with_its_floor_measured_written_logged_and_in_the_summary(tmp_path, tiny_model_dir, tiny_corpus):
    """The floor at the end of the fit is what noise_floor() gives the final model on the same held-out blocks
    (bit for bit: the same forwards), its benchmark answers changed are counted per seed, and the summary says
    both with the time taken."""
    import csv
    import json
    import os

    from qat_app.eval.kl_cache import held_out_blocks

    trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, "--noise_floor.relative", "1e-3",
                   "--noise_floor.sequences", "3")
    callback = _callback(trainer, "NoiseFloorCallback")
    floor = callback.floor
    assert floor.quantized and floor.kl.n_clusters == 3 and floor.kl.difference > 0 and callback.seconds > 0
    blocks, batch_size, _ = held_out_blocks(trainer)
    again = noise_floor(trainer.lightning_module.model, [blocks[:2], blocks[2:3]], relative=1e-3)
    assert (again.kl.difference, again.kl.low, again.kl.high) == (floor.kl.difference, floor.kl.low, floor.kl.high)
    assert batch_size == 2
    flips = callback.flips
    assert flips.examples == {"arc_challenge": 12, "mmlu": 12} and flips.seeds == (0, 1, 2)
    for task, counts in flips.flips_norm.items():
        assert len(counts) == 3 and all(0 <= c <= 12 for c in counts)
    document = json.load(open(os.path.join(trainer.log_dir, "noise_floor.json")))
    assert document["text"]["kl"]["difference"] == floor.kl.difference
    assert document["benchmarks"]["tasks"]["mmlu"]["flips_acc_norm"] == flips.flips_norm["mmlu"]
    logged = {k: v for row in csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv")))
              for k, v in row.items() if k.startswith("noise_floor/") and v}
    assert float(logged["noise_floor/kl"]) == pytest.approx(floor.kl.difference, rel=1e-6)
    assert {"noise_floor/kl_low", "noise_floor/kl_high", "noise_floor/seconds",
            "noise_floor/mmlu/answers_changed"} <= logged.keys()
    summary = _callback(trainer, "RunSummaryCallback").text
    assert f"noise floor   KL {floor.kl.difference:.5f}" in summary and "benchmark answers (acc_norm) changed" in summary
    assert "of the arithmetic" in summary  # forget/kl and its quantization part read against it


@pytest.mark.slow
def test_an_unquantized_fit_has_a_floor_of_0_said_not_failed(tmp_path, tiny_model_dir, tiny_corpus):
    trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, "--model.quant.enabled", "false",
                   "--trainer.callbacks", "[]")
    callback = _callback(trainer, "NoiseFloorCallback")
    assert not callback.floor.quantized and callback.floor.kl.difference == 0 and callback.flips is None
    assert "noise floor   0 (an unquantized model rounds nothing onto a grid" in _callback(trainer, "RunSummaryCallback").text


@pytest.mark.parametrize("flag,value,pattern", [
    ("--noise_floor.relative", "0.01", r"noise_floor\.relative: must lie in \(0, 0\.001\], got 0\.01"),
    ("--noise_floor.seeds", "[4]", r"noise_floor\.seeds: at least 2 distinct seeds"),
    ("--noise_floor.sequences", "0", r"noise_floor\.sequences: must be an integer >= 1, got 0"),
])
def test_bad_floor_settings_are_one_line_naming_the_setting(tmp_path, tiny_model_dir, tiny_corpus, flag, value,
                                                            pattern):
    from qat_app.errors import QATError

    with pytest.raises(QATError, match=pattern):
        _fit(tmp_path, tiny_model_dir, tiny_corpus, flag, value)
