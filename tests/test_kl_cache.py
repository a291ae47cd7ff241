"""``forget/kl``: the initial model's top-k cache (:mod:`qat_app.eval.kl_cache`) against independent
full-vocabulary computations, its files, and end to end through main.py (logged at every validation after
step 0; a run killed after step 0 and resumed keeps its cache and logs what an uninterrupted run logs).

Measured (this file's tiny Llama, vocab 400, output layer sharpened x20 so its top-32 hold 93 % of the mass
as a trained LM's do, every weight perturbed by 2 % of its mean size): full KL 0.00544, top-32 estimate
0.00496 (ratio 0.912; 0.70 at k=8, 0.99 at k=128), float16 storage changes the mean by 6e-5 relative and a
single token's value by at most ~1e-4 nats. On the embedded SmolLM2-135M
(BoolQ passages, 8 x 256 tokens, top-32 mass 0.84) against its HiF8-quantized self the ratio is 0.75 at
k=32 (0.59 at k=8, 0.87 at k=128): the bound is as tight as the top-k mass is large.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import shutil
import statistics

import pytest
import torch

import main as cli
from qat_app.errors import ConfigError
from qat_app.eval.kl_cache import (FINAL_FILE, INITIAL_FILE, InitialKL, TopKCacheError, check_settings, coarse_kl,
                                   interval, kl_between, load_topk, logprobs_at, save_topk, topk_logprobs)
from qat_app.hif8.health import full_kl
from tests._cli_runs import TINY_BENCHMARKS, checkpointed_fit, write_config


def _sharp_llama(vocab: int = 400, sharpen: float = 20.0, seed: int = 0):
    """A tiny random Llama whose output layer is scaled up: peaked next-token distributions, like a trained LM's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def _perturbed(model, relative: float = 0.02, seed: int = 1):
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * relative * p.abs().mean())
    return other


@pytest.fixture(scope="module")
def two_models_logits():
    a = _sharp_llama()
    b = _perturbed(a)
    ids = torch.randint(0, 400, (8, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return a(input_ids=ids).logits, b(input_ids=ids).logits


def test_full_kl_of_nearly_equal_models_is_exact_not_rounding_noise(two_models_logits):
    # logits 1e-4 apart: KL = Var_p(delta) / 2 up to O(delta^3), ~1e-9 nats, far below float32's ~1e-6 noise
    a = two_models_logits[0][:2].double()
    delta = 1e-4 * torch.randn(a.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = a.softmax(-1)
    second_order = 0.5 * ((p * delta ** 2).sum(-1) - (p * delta).sum(-1) ** 2)
    full = full_kl(a.float(), (a + delta).float())
    # the float32 inputs round the logits: compare with the same rounding, in float64
    rounded = (a + delta).float().double() - a.float().double()
    expected = 0.5 * ((p * rounded ** 2).sum(-1) - (p * rounded).sum(-1) ** 2)
    assert (full > 0).all() and torch.allclose(full, expected, rtol=1e-3, atol=0)
    assert torch.allclose(second_order, expected, rtol=0.2)


def test_topk_kl_is_a_lower_bound_close_to_the_full_vocabulary_kl(two_models_logits):
    a, b = two_models_logits
    full = full_kl(a, b)
    reference = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                           reduction="none").sum(-1)
    assert full.dtype == torch.float64 and torch.allclose(full.float(), reference, atol=1e-6)
    indices, logp = topk_logprobs(a, 32)
    logq = logprobs_at(b, indices)
    # an independent coarse-graining: the top-32 probabilities one by one, the rest summed, in float64
    pa, pb = a.double().softmax(-1), b.double().softmax(-1)
    top_a, top_b = pa.gather(-1, indices.long()), pb.gather(-1, indices.long())
    buckets_a = torch.cat([top_a, 1 - top_a.sum(-1, keepdim=True)], -1)
    buckets_b = torch.cat([top_b, 1 - top_b.sum(-1, keepdim=True)], -1)
    expected = (buckets_a * (buckets_a.log() - buckets_b.log())).sum(-1)
    estimate = coarse_kl(logp, logq)
    assert torch.allclose(estimate.double(), expected, atol=1e-6)
    # the data-processing inequality, per token: float32 exactly, float16 storage within its rounding noise
    stored = coarse_kl(logp.half(), logq.half())
    assert (estimate <= full + 1e-6).all() and (stored <= full + 2e-4).all()
    assert abs(float(stored.mean() / estimate.mean()) - 1) < 1e-3
    ratio = float(estimate.mean() / full.mean())
    assert 0.88 <= ratio <= 1.0, ratio  # measured 0.913 (top-32 mass 0.93)
    # tighter with more of the vocabulary, exact with all of it
    ratios = [float(coarse_kl(lp, logprobs_at(b, idx)).mean() / full.mean())
              for idx, lp in (topk_logprobs(a, k) for k in (8, 32, 128, 400))]
    assert ratios == sorted(ratios) and ratios[-1] == pytest.approx(1.0, abs=1e-4)


def test_kl_of_a_model_with_itself_is_exactly_zero(two_models_logits):
    a, _ = two_models_logits
    indices, logp = topk_logprobs(a, 32)
    again = logprobs_at(a.clone(), indices)
    assert torch.equal(coarse_kl(logp.half(), again.half()), torch.zeros(a.shape[:-1]))
    assert torch.equal(coarse_kl(logp, again), torch.zeros(a.shape[:-1]))


def test_rest_bucket_is_stable_when_the_top_k_hold_nearly_everything():
    logits = torch.tensor([[40.0, 0.0, -1.0, -2.0, -3.0]])  # the rest holds ~e-40: 1 - sum rounds to 0 in float32
    indices, logp = topk_logprobs(logits, 2)
    rest = torch.logsumexp(logits.double()[0, 2:], 0) - torch.logsumexp(logits.double()[0], 0)
    assert torch.isfinite(logp).all() and float(logp[0, -1]) == pytest.approx(float(rest), rel=1e-6)
    _, everything = topk_logprobs(logits, 9)  # k >= vocabulary: no rest
    assert everything.shape[-1] == 6 and torch.isneginf(everything[0, -1])
    assert float(coarse_kl(everything, everything)[0]) == 0.0


def _write_pair(tmp_path, logp, logq, **header):
    tokens = torch.arange(logp.shape[0] * logp.shape[1], dtype=torch.int32).view(logp.shape[:2])
    indices = torch.zeros(*logp.shape[:2], logp.shape[-1] - 1, dtype=torch.int32)
    base = {"kind": "initial", "model": "m", "partition": "p1", "world_size": 1, "k": logp.shape[-1] - 1,
            "sequences": logp.shape[0], "positions": logp.shape[1], "tokens": logp.shape[0] * logp.shape[1],
            "data_fingerprint": "d", **header}
    save_topk(str(tmp_path / INITIAL_FILE), base, logp.half(), tokens=tokens, indices=indices)
    save_topk(str(tmp_path / FINAL_FILE), {**base, "kind": "final"}, logq.half())
    return str(tmp_path / INITIAL_FILE), str(tmp_path / FINAL_FILE)


def test_files_round_trip_and_kl_between_gives_the_interval_over_sequences(tmp_path, two_models_logits):
    a, b = two_models_logits
    indices, logp = topk_logprobs(a, 32)
    logq = logprobs_at(b, indices)
    first, last = _write_pair(tmp_path, logp, logq)
    cache = load_topk(first)
    assert cache.header["k"] == 32 and cache.logprobs.dtype == torch.float16 and torch.equal(cache.logprobs,
                                                                                              logp.half())
    mean, low, high, n = kl_between(first, last)
    per_sequence = [float(x) for x in coarse_kl(logp.half(), logq.half()).double().mean(-1)]
    half = 1.96 * statistics.stdev(per_sequence) / len(per_sequence) ** 0.5
    expected = statistics.fmean(per_sequence)
    assert n == 8 * 64 and mean == pytest.approx(expected, rel=1e-9)
    assert (low, high) == pytest.approx((expected - half, expected + half), rel=1e-9)
    assert kl_between(first, first)[0] == 0.0
    assert interval(torch.tensor([0.5]))[0] == 0.5  # one sequence: no interval
    assert not os.path.exists(first + f".tmp{os.getpid()}")  # written atomically: nothing left over


def test_damaged_or_foreign_files_are_refused(tmp_path, two_models_logits):
    a, b = two_models_logits
    indices, logp = topk_logprobs(a, 8)
    first, last = _write_pair(tmp_path, logp, logprobs_at(b, indices))
    with pytest.raises(TopKCacheError, match="no such file"):
        load_topk(str(tmp_path / "missing.pt"))
    data = open(first, "rb").read()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(TopKCacheError, match="damaged"):
        load_topk(str(tmp_path / "truncated.pt"))
    raw = torch.load(first, weights_only=True)
    raw["logprobs"][0, 0, 0] += 1  # one value changed: the checksum no longer matches
    torch.save(raw, tmp_path / "changed.pt")
    with pytest.raises(TopKCacheError, match="checksum"):
        load_topk(str(tmp_path / "changed.pt"))
    other = tmp_path / "other"
    other.mkdir()
    _, foreign = _write_pair(other, logp, logp, partition="p2")  # another model or data: another partition
    with pytest.raises(TopKCacheError, match="same initial top-k cache"):
        kl_between(last, foreign)


class _Trainer:
    world_size, global_rank = 1, 0


class _Module:
    trainer, device = _Trainer(), torch.device("cpu")


def test_a_foreign_cache_is_named_and_turns_forget_kl_off(tmp_path, caplog, two_models_logits):
    a, b = two_models_logits
    indices, logp = topk_logprobs(a, 8)
    path, _ = _write_pair(tmp_path, logp, logprobs_at(b, indices))
    blocks = load_topk(path).tokens.long()
    ok = InitialKL(8, 10_000, "m", path)
    ok.resume(_Module(), blocks)
    assert ok.enabled and torch.equal(ok.logprobs, logp.half())
    for why, tracker, data in (("model 'm', this run 'other'", InitialKL(8, 10_000, "other", path), blocks),
                               ("other validation data", InitialKL(8, 10_000, "m", path), blocks + 1),
                               ("no such file", InitialKL(8, 10_000, "m", str(tmp_path / "none.pt")), blocks)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qat_app.eval.kl_cache"):
            tracker.resume(_Module(), data)
        assert not tracker.enabled
        assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()


def test_bad_settings_name_the_field(tmp_path, tiny_model_dir, tiny_corpus):
    from callbacks import InitialEvaluationCallback

    with pytest.raises(ConfigError, match=r"^initial_eval\.topk: must be >= 1, got 0$"):
        check_settings(0, 10)
    with pytest.raises(ConfigError, match=r"^initial_eval\.max_kl_tokens: must be >= 1, got -5$"):
        InitialEvaluationCallback(max_kl_tokens=-5)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    with pytest.raises(ConfigError, match=r"initial_eval\.topk: must be >= 1, got 0"):
        cli.cli_main(["fit", "--config", config, "--initial_eval.topk", "0"])


# ------------------------------------------------------------------------------------------ end to end
KL_RUN = {"trainer.val_check_interval": 4,  # micro-batches: validates after optimizer steps 2, 4 and 6
          "initial_eval.topk": 16, "initial_eval.max_kl_tokens": 96,  # 3 blocks of 32: straddles a val batch
          "data.init_args.benchmarks": TINY_BENCHMARKS}  # so the forgetting monitor's forget/<task>/* run too


def _fit(tmp_path, model_dir, corpus, *extra, crash_at=None):
    return checkpointed_fit(tmp_path, model_dir, corpus, *extra, crash_at=crash_at, **KL_RUN)


def _logged_kl(log_dir) -> list[tuple[float, float, float]]:
    rows = csv.DictReader(open(os.path.join(log_dir, "metrics.csv")))
    return [tuple(float(r[k]) for k in ("forget/kl", "forget/kl_low", "forget/kl_high")) for r in rows
            if r.get("forget/kl")]


def _logged_forget(log_dir) -> dict[int, dict[str, float]]:
    """step -> every forget/* value logged at that step (the KL and the monitor's per-task measures)."""
    out: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        values = {k: float(v) for k, v in row.items() if k.startswith("forget/") and v not in ("", None)}
        if values:
            out.setdefault(int(row["step"]), {}).update(values)
    return out


def _logged_generation_kl(log_dir) -> dict[int, tuple[float, float, float]]:
    """optimizer step -> forget/generation_kl (mean, low, high) as logged."""
    names = ("forget/generation_kl", "forget/generation_kl_low", "forget/generation_kl_high")
    return {step + 1: tuple(values[n] for n in names)
            for step, values in _logged_forget(log_dir).items() if names[0] in values}


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def straight(module_tmp, tiny_model_dir, tiny_corpus):
    tmp = module_tmp("kl_straight")
    return tmp, _fit(tmp, tiny_model_dir, tiny_corpus)


@pytest.mark.slow
def test_fit_logs_forget_kl_at_every_validation_after_step_0(straight):
    tmp, trainer = straight
    logged = _logged_kl(trainer.log_dir)
    assert len(logged) == 3  # steps 2, 4, 6; none at step 0
    for mean, low, high in logged:
        assert 0 < mean and low < mean < high
    own = os.path.join(trainer.log_dir, INITIAL_FILE)  # the fit's own, in its logger version
    assert not (tmp / INITIAL_FILE).exists()
    cache = load_topk(own)
    assert cache.header["sequences"] == 3 and cache.header["positions"] == 32 and cache.header["k"] == 16
    assert cache.indices.shape == (3, 32, 16) and cache.logprobs.shape == (3, 32, 17)
    final = str(os.path.join(trainer.log_dir, FINAL_FILE))
    assert load_topk(final).header["global_step"] == 6
    mean, low, high, n = kl_between(own, final)  # what a report computes
    assert n == 96 and (mean, low, high) == pytest.approx(logged[-1], rel=1e-5)
    assert trainer.lightning_module.forget_kl.last.step == 6


@pytest.mark.slow
def test_the_cache_does_not_change_training_and_can_be_turned_off(straight, tmp_path, tiny_model_dir, tiny_corpus):
    """Same losses and weights without the cache (its pass draws no RNG and moves no amax history)."""
    _, with_kl = straight
    without = _fit(tmp_path, tiny_model_dir, tiny_corpus, "--initial_eval.kl", "false")
    assert not os.path.exists(os.path.join(without.log_dir, INITIAL_FILE)) and _logged_kl(without.log_dir) == []
    assert not os.path.exists(os.path.join(without.log_dir, FINAL_FILE))
    losses = [[r["train/loss"] for r in csv.DictReader(open(os.path.join(t.log_dir, "metrics.csv"))) if r["train/loss"]]
              for t in (with_kl, without)]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    states = [t.lightning_module.state_dict() for t in (with_kl, without)]
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        other = states[1][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.slow
def test_resume_keeps_the_cache_and_logs_what_an_uninterrupted_run_logs(straight, tmp_path, caplog, tiny_model_dir,
                                                                        tiny_corpus):
    from tests._cli_runs import SimulatedCrash

    _, straight_trainer = straight
    expected = _logged_kl(straight_trainer.log_dir)
    crashed = tmp_path / "run"
    with pytest.raises(SimulatedCrash):
        _fit(crashed, tiny_model_dir, tiny_corpus, crash_at=3)
    cache = crashed / "logs" / "version_0" / INITIAL_FILE
    assert _sha(cache) == _sha(os.path.join(straight_trainer.log_dir, INITIAL_FILE))  # same model, data, settings
    damaged = tmp_path / "damaged"
    shutil.copytree(crashed, damaged)
    before = _sha(cache)
    resumed = _fit(crashed, tiny_model_dir, tiny_corpus, "--ckpt_path", "last")
    assert _sha(cache) == before  # read back, not taken again
    assert _logged_kl(resumed.log_dir) == expected[-2:]  # steps 4 and 6, exactly
    expected_generation = _logged_generation_kl(straight_trainer.log_dir)  # and the generation drift, read back
    assert _logged_generation_kl(resumed.log_dir) == {s: expected_generation[s] for s in (4, 6)}
    # the forgetting monitor compares with the same step-0 records: every forget/* value equals the straight run's
    straight_forget, resumed_forget = _logged_forget(straight_trainer.log_dir), _logged_forget(resumed.log_dir)
    assert any(k.startswith("forget/arc_challenge/") for k in straight_forget[max(straight_forget)])
    assert resumed_forget == {s: straight_forget[s] for s in sorted(straight_forget)[-2:]}  # the last two looks
    # a damaged cache: one warning naming it, and the run finishes without forget/kl
    (damaged / "logs" / "version_0" / INITIAL_FILE).write_bytes(b"not a cache")
    with caplog.at_level(logging.WARNING, logger="qat_app.eval.kl_cache"):
        run = _fit(damaged, tiny_model_dir, tiny_corpus, "--ckpt_path", "last")
    warnings = [r.getMessage() for r in caplog.records if r.name == "qat_app.eval.kl_cache"]
    assert len(warnings) == 1 and str(damaged / "logs" / "version_0" / INITIAL_FILE) in warnings[0]
    assert "damaged" in warnings[0]
    assert run.global_step == 6 and _logged_kl(run.log_dir) == []


# ------------------------------------------------------------------------------------------ in parts
def _logged_parts(log_dir) -> dict[int, dict[str, float]]:
    """optimizer step -> forget/kl and its parts (mean, low, high each) as logged (the CSV's step column counts
    the batches that stepped before the validation: one less)."""
    names = [n for base in ("forget/kl", "forget/kl_drift", "forget/kl_quantization")
             for n in (base, f"{base}_low", f"{base}_high")]
    return {step + 1: {n: values[n] for n in names if n in values}
            for step, values in _logged_forget(log_dir).items() if "forget/kl" in values}


@pytest.mark.slow
def test_forget_kl_is_logged_in_its_parts_and_the_quantization_part_follows_the_switches(straight):
    """WARMUP 3: at step 2 quantization is still off (its part exactly 0, the drift the whole forget/kl); at
    steps 4 and 6 it is on (its part > 0); the drift grows with training (lr 1e-3)."""
    _, trainer = straight
    parts = _logged_parts(trainer.log_dir)
    assert sorted(parts) == [2, 4, 6]
    for step, p in parts.items():
        assert len(p) == 9
        for base in ("forget/kl", "forget/kl_drift", "forget/kl_quantization"):
            assert p[f"{base}_low"] <= p[base] <= p[f"{base}_high"], (step, base)
    assert p_at(parts, 2, "forget/kl_quantization") == 0.0
    assert p_at(parts, 2, "forget/kl_drift") == p_at(parts, 2, "forget/kl") > 0  # off: the same forward
    for step in (4, 6):
        assert p_at(parts, step, "forget/kl_quantization") > 0
        assert p_at(parts, step, "forget/kl_drift") > 0
    result = trainer.lightning_module.forget_kl.last
    assert result.drift[0] == pytest.approx(parts[6]["forget/kl_drift"], rel=1e-6)
    summary = next(c for c in trainer.callbacks if type(c).__name__ == "RunSummaryCallback").text
    assert "forget/kl_drift" in summary and "forget/kl_quantization" in summary


def p_at(parts, step, name) -> float:
    return parts[step][name]


@pytest.mark.slow
def test_a_run_that_does_not_move_has_drift_exactly_0_and_quantization_above_0(tmp_path, tiny_model_dir, tiny_corpus):
    """lr 1e-30 (model.lr must be > 0; float32 absorbs the updates, so no weight moves by more than 1e-28):
    the drift part is exactly 0 at every validation, the quantization part > 0 once QAT is on."""
    from transformers import AutoModelForCausalLM

    trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, "--model.lr", "1e-30")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    trained = trainer.lightning_module.model.state_dict()
    shared = [k for k in initial if k in trained]
    # (an update of 1e-30 is absorbed by every weight but the few embedding entries within ~1e-22 of 0)
    assert len(shared) > 10 and all(torch.allclose(initial[k], trained[k], rtol=0, atol=1e-28) for k in shared)
    parts = _logged_parts(trainer.log_dir)
    assert sorted(parts) == [2, 4, 6]
    for step, p in parts.items():
        assert p["forget/kl_drift"] == p["forget/kl_drift_low"] == p["forget/kl_drift_high"] == 0.0, step
    assert parts[2]["forget/kl_quantization"] == 0.0 and parts[2]["forget/kl"] == 0.0  # warmup: nothing changed
    assert parts[4]["forget/kl_quantization"] > 0 and parts[6]["forget/kl_quantization"] > 0
    assert parts[6]["forget/kl"] > 0  # the total holds the quantization
    generation = _logged_generation_kl(trainer.log_dir)  # the initial model's own continuations: exactly 0 too
    assert generation[2] == (0.0, 0.0, 0.0) and generation[4][0] > 0 and generation[6][0] > 0


@pytest.mark.slow
def test_a_run_with_quantization_off_has_a_quantization_part_of_exactly_0(tmp_path, tiny_model_dir, tiny_corpus):
    """HiF8 layers in place, the warmup switching neither weights nor activations on: the second forward runs and
    gives the same logits, so the quantization part is exactly 0 and the drift is forget/kl itself."""
    trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, "--warmup.quantize_weights", "false",
                   "--warmup.quantize_activations", "false")
    assert trainer.lightning_module.quantized_linears()  # the layers are there
    parts = _logged_parts(trainer.log_dir)
    assert sorted(parts) == [2, 4, 6]
    for step, p in parts.items():
        assert p["forget/kl_quantization"] == p["forget/kl_quantization_high"] == 0.0, step
        assert p["forget/kl_drift"] == p["forget/kl"] > 0, step


@pytest.mark.slow
def test_two_fits_in_one_run_directory_keep_their_own_caches_and_the_first_resumes_with_its_own(
        straight, tmp_path, tiny_model_dir, tiny_corpus):
    """Fit A dies at step 3; fit B (other data: seq 16) runs in the same directory; A resumed from its own
    checkpoint reads its own cache (named in the checkpoint) and logs what the uninterrupted run logs."""
    from tests._cli_runs import SimulatedCrash

    _, straight_trainer = straight
    run = tmp_path / "run"
    with pytest.raises(SimulatedCrash):
        _fit(run, tiny_model_dir, tiny_corpus, crash_at=3)
    first = run / "logs" / "version_0" / INITIAL_FILE
    first_sha = _sha(first)
    other = _fit(run, tiny_model_dir, tiny_corpus, "--data.init_args.seq_len", "16")
    second = os.path.join(other.log_dir, INITIAL_FILE)
    assert other.log_dir.endswith("version_1") and os.path.isfile(second) and _sha(second) != first_sha
    assert _sha(first) == first_sha and not (run / INITIAL_FILE).exists()  # nothing of A's replaced
    second_sha = _sha(second)
    resumed = _fit(run, tiny_model_dir, tiny_corpus, "--ckpt_path", str(run / "ckpt" / "last.ckpt"))
    assert resumed.global_step == 6 and _sha(first) == first_sha and _sha(second) == second_sha
    assert resumed.lightning_module.forget_kl.path == str(first)
    assert _logged_kl(resumed.log_dir) == _logged_kl(straight_trainer.log_dir)[-2:]  # steps 4 and 6, exactly


# ------------------------------------------------------------------------------------------ generation drift
@pytest.mark.slow
def test_generation_kl_follows_the_initial_models_own_greedy_continuations(straight, tiny_model_dir):
    """forget/generation_kl at every validation after step 0; its file holds what transformers' greedy decoding of
    the initial model gives, and the last value is the float64 full-vocabulary KL of an independent computation
    (float16 storage aside) between the initial model and the trained W8A8 model along those continuations."""
    from transformers import AutoModelForCausalLM

    from qat_app.eval.records import INITIAL_GENERATIONS_FILE

    _, trainer = straight
    logged = _logged_generation_kl(trainer.log_dir)
    assert sorted(logged) == [2, 4, 6]
    for mean, low, high in logged.values():
        assert 0 < mean and low < mean < high
    saved = load_topk(os.path.join(trainer.log_dir, INITIAL_GENERATIONS_FILE))
    prompts, prompt_tokens = saved.header["prompts"], saved.header["prompt_tokens"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    vocab = initial.config.vocab_size
    assert saved.tokens.shape == (prompts, prompt_tokens + 32) and saved.logprobs.shape == (prompts, 32, vocab)
    sequences = saved.tokens
    with torch.no_grad():
        for row in sequences:  # greedy, one prompt at a time, by transformers itself
            out = initial.generate(row[None, :prompt_tokens], do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                   pad_token_id=0)
            assert torch.equal(out[0], row)
        model = trainer.lightning_module.model.eval()
        kl = full_kl(initial(input_ids=sequences).logits[:, prompt_tokens - 1:-1],
                     model(input_ids=sequences).logits[:, prompt_tokens - 1:-1])
    # float16 log-probs change a token's KL by ~1e-4 nats at most (the top-k cache's measurement above)
    assert logged[6][0] == pytest.approx(float(kl.mean()), abs=2e-4)


def test_generation_settings_are_checked():
    from callbacks.initial_eval import InitialEvaluationCallback

    for name, value in (("generation_prompts", -1), ("generation_tokens", 0), ("generation_prompt_tokens", 1.5)):
        with pytest.raises(ConfigError, match=f"initial_eval.{name}"):
            InitialEvaluationCallback(**{name: value})
