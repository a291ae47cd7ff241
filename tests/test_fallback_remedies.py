"""Fallback remedies that fit the symptom (qat_app.hif8.fallback, fallback_summary, sqnr_bound; callbacks.fallback).

Saturation -> current scaling, an SQNR under the floor -> high precision (current is refused for it: it changes the
scale, not the format); the floor checked against the best SQNR the format gives a Gaussian at any scale (checked
here against en_dtypes' own HiF8 on Monte-Carlo samples); each decision verified afterwards (a remedy that did not
work said so); a budget that stops a cascade with its diagnosis; the summary grouped in a few lines; fits through
main.py on the tiny model: the SQNR rule's operands leave the 8-bit figures, a killed run resumes bit for bit, the
export of a mixed run reloads to the same logits.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os

import numpy as np
import pytest
import torch

import main as cli
from callbacks import FallbackCallback
from callbacks.saturation import fallback_stopped
from qat_app.errors import ConfigError
from qat_app.export import export_hif8, load_hif8
from qat_app.hif8 import HiF8Recipe, RuntimeOptions
from qat_app.hif8.fallback import (LOW_SQNR, SATURATION, FallbackError, FallbackMonitor, FallbackPolicy,
                                   check_reachable_floor, fallen_back, pending_verification, verify_decisions)
from qat_app.hif8.fallback_summary import group_decisions, summary_lines
from qat_app.hif8.fallback_targets import Verdict
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.sqnr_bound import gaussian_sqnr_bound
from qat_app.hif8.training import sync_and_advance
from qat_app.report.health import health_stats, render_health
from qat_app.report.runs import load_run
from tests._cli_runs import SimulatedCrash, write_config


# ------------------------------------------------------------------------------------------- the bound
def _monte_carlo_sqnr(format_name: str, max_val: float, a_hat_sigmas: float, n: int = 1 << 20) -> tuple[float, float]:
    """SQNR of N(0, 1) samples quantized with the format's reference dtype (en_dtypes' hifloat8, torch's E4M3) at
    the scale that puts a_hat at ``a_hat_sigmas``, and the standard error of its dB value."""
    x = np.random.default_rng(0).standard_normal(n)
    scale = max_val / a_hat_sigmas
    clipped = np.clip((x * scale).astype(np.float32), -max_val, max_val)
    if format_name == "hif8":
        import en_dtypes

        q = clipped.astype(en_dtypes.hifloat8).astype(np.float64) / scale
    else:
        q = torch.from_numpy(clipped).to(torch.float8_e4m3fn).double().numpy() / scale
    err2 = (x - q) ** 2
    mean = float(err2.mean())
    se_db = 10 / math.log(10) * float(err2.std()) / math.sqrt(n) / mean  # delta method on 10 log10(mean)
    return 10 * math.log10(float((x * x).mean()) / mean), se_db


@pytest.mark.parametrize("format_name, max_val", [("hif8", 15.0), ("e4m3", 448.0)])
def test_the_gaussian_bound_equals_an_independent_quantization_and_no_scale_beats_it(format_name, max_val):
    bound, a_hat = gaussian_sqnr_bound(format_name, max_val)
    measured, se = _monte_carlo_sqnr(format_name, max_val, a_hat)
    # the sample's own power differs from 1 by ~1/sqrt(n): 0.006 dB; the error term's SE is computed
    assert abs(measured - bound) < 4 * se + 0.01, (measured, bound, se)
    for other in (a_hat / 2, a_hat * 0.8, a_hat * 1.25, a_hat * 2):
        assert _monte_carlo_sqnr(format_name, max_val, other)[0] < bound + 4 * se + 0.01
    assert 31.4 < bound < 31.7  # both have 3 mantissa bits where the Gaussian's mass lies


def test_a_floor_above_the_bound_is_named_and_one_below_passes():
    bound, _ = gaussian_sqnr_bound("hif8", 15.0)
    with pytest.raises(FallbackError, match=rf"sqnr_floor_db: 40 dB is above what hif8 can give: {bound:.2f} dB on a "
                                            r"Gaussian tensor at its best scale"):
        check_reachable_floor(FallbackPolicy(sqnr_floor_db=40.0), "hif8", 15.0)
    check_reachable_floor(FallbackPolicy(sqnr_floor_db=bound - 0.1), "hif8", 15.0)
    check_reachable_floor(FallbackPolicy(), "hif8", 15.0)  # no floor: nothing to check


# ------------------------------------------------------------------------------------------- the policy
@pytest.mark.parametrize("kwargs, pattern", [
    ({"on_saturation": "bf16"}, r"on_saturation: unknown target 'bf16'; allowed: current, high_precision"),
    ({"on_low_sqnr": "fp32", "sqnr_floor_db": 20.0}, r"on_low_sqnr: unknown target 'fp32'"),
    ({"on_low_sqnr": "current", "sqnr_floor_db": 20.0}, r"on_low_sqnr: current cannot cure a low SQNR: current scaling "
                                                         r"changes the scale, not the format"),
    ({"target": "bf16"}, r"target: unknown target 'bf16'"),
    ({"max_tensors": 0}, r"max_tensors: must be a fraction in \(0, 1\), an integer >= 1 or null, got 0"),
    ({"max_tensors": -3}, r"max_tensors: .* got -3"),
    ({"max_tensors": 2.5}, r"max_tensors: .* got 2\.5"),
    ({"max_tensors": True}, r"max_tensors: .* got True"),
])
def test_bad_remedies_and_budgets_name_their_field(kwargs, pattern):
    with pytest.raises(FallbackError, match=pattern):
        FallbackPolicy(**kwargs)
    with pytest.raises(ConfigError, match=r"fallback\.policy\." + pattern):
        FallbackCallback(enabled=True, policy=kwargs)


def test_the_remedy_fits_the_symptom_and_the_old_target_still_works(caplog):
    policy = FallbackPolicy(sqnr_floor_db=25.0)
    assert (policy.remedy(SATURATION), policy.remedy(LOW_SQNR)) == ("current", "high_precision")
    with caplog.at_level(logging.WARNING, logger="qat_app.hif8.fallback"):
        old = FallbackPolicy(target="current", sqnr_floor_db=25.0)
    assert (old.on_saturation, old.on_low_sqnr, old.target) == ("current", "high_precision", None)
    assert "fallback.policy.target is deprecated: use on_saturation and on_low_sqnr" in caplog.text
    both = FallbackPolicy(target="high_precision")
    assert (both.on_saturation, both.on_low_sqnr) == ("high_precision", "high_precision")
    assert FallbackPolicy(on_low_sqnr="current").on_low_sqnr == "current"  # no floor: never used, not refused


def test_the_budget_in_tensors_or_as_a_fraction():
    assert FallbackPolicy().budget(150) == 37 and FallbackPolicy(max_tensors=0.01).budget(50) == 1
    assert FallbackPolicy(max_tensors=10).budget(150) == 10 and FallbackPolicy(max_tensors=None).budget(150) is None
    with pytest.raises(FallbackError, match=r"max_tensors: 200 is more than the model's 150 quantized tensors"):
        FallbackPolicy(max_tensors=200).budget(150)


# ------------------------------------------------------------------------------------------- the budget
def test_a_cascade_past_the_budget_takes_no_decision_and_says_why():
    n = 12
    monitor = FallbackMonitor(FallbackPolicy(window=4, min_events=2, sqnr_floor_db=30.0, sqnr_patience=1),
                              [f"layers.{i}.mlp.up_proj.input" for i in range(n)])
    assert monitor.budget == 3
    zeros = torch.zeros(n, dtype=torch.int64)
    sqnr = torch.full((n,), 31.0)
    sqnr[0] = 29.0  # one tensor under the floor: within the budget
    first = monitor.update(zeros, zeros + 1, sqnr)
    assert [(d.index, d.reason) for d in first] == [(0, LOW_SQNR)] and monitor.stopped is None
    sqnr[:] = 29.5  # now every tensor: 11 more, past the budget of 3
    eligible = torch.arange(n) != 0
    assert monitor.update(zeros, zeros + 2, sqnr, eligible, already=1) == []
    assert monitor.stopped == {"qualified": 11, "already": 1, "budget": 3, "diagnosis":
                               "11 under the SQNR floor, median 29.5 dB against sqnr_floor_db 30: the floor is above "
                               "what the format gives these tensors (lower it)"}
    sqnr[:] = 31.0
    sqnr[5] = 20.0  # once stopped, the policy decides nothing more, whatever comes
    assert monitor.update(zeros, zeros + 3, sqnr, eligible, already=1) == []
    again = FallbackMonitor(monitor.policy, monitor.names)
    again.load_state_dict(monitor.state_dict())  # a resumed run stays stopped
    assert again.stopped == monitor.stopped
    older = monitor.state_dict()
    del older["stopped"]  # a checkpoint of an earlier version: not stopped
    again.load_state_dict(older)
    assert again.stopped is None


def test_a_saturation_cascade_blames_the_recipe():
    monitor = FallbackMonitor(FallbackPolicy(window=4, min_events=2, max_tensors=2), [f"t{i}" for i in range(6)])
    monitor.update(torch.tensor([2, 2, 2, 1, 0, 0]), torch.full((6,), 3))
    assert monitor.stopped["qualified"] == 3 and monitor.stopped["diagnosis"].startswith(
        "3 saturating, median 2 events in their last 4 quantized steps: the delayed scales cannot follow the tensors")


# ------------------------------------------------------------------------------------------- verification
def _layer() -> HiF8Linear:
    torch.manual_seed(0)
    layer = HiF8Linear(16, 8, recipe=HiF8Recipe(amax_algo="most_recent", history_len=4), runtime=RuntimeOptions(fused="off"))
    layer.train()
    layer(torch.randn(4, 16))
    sync_and_advance(layer)
    return layer


def counters(events: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(events), torch.tensor(steps)


def test_verification_says_when_a_remedy_worked_and_when_it_did_not():
    layer = _layer()
    policy = FallbackPolicy(window=3, min_events=2)
    tensors = [("m", layer, "input"), ("m", layer, "weight")]
    layer.fall_back("input", "current", step=5, reason=SATURATION, evidence="e", events_at=4, steps_at=6, sqnr_at=24.0)
    layer.fall_back("weight", "high_precision", step=5, reason=LOW_SQNR, evidence="f", events_at=0, steps_at=6)
    assert verify_decisions(tensors, policy, *counters([4, 0], [6, 6]), None, 5) == []  # the deciding step itself
    done = verify_decisions(tensors, policy, *counters([4, 0], [7, 6]), torch.tensor([30.5, math.nan]), 6)
    assert [d["operand"] for d in done] == ["weight"]  # high precision: at the next step
    assert layer.fallback["weight"].verified == Verdict(6, True, "unquantized since: no 8-bit error, nothing clipped")
    assert layer.fallback["weight"].as_dict()["verified"] == {"step": 6, "worked": True,
                                                              "text": "unquantized since: no 8-bit error, nothing clipped"}
    assert pending_verification(layer.fallback["input"].as_dict()) == "pending: fewer quantized steps since than the window"
    assert layer.fallback["input"].sqnr_after == 30.5  # measured while its window fills
    done = verify_decisions(tensors, policy, *counters([6, 0], [9, 6]), None, 8)  # 2 more events in 3 steps
    assert layer.fallback["input"].verified == Verdict(
        8, False, "2 saturation events in the 3 quantized steps since; SQNR 24.00 -> 30.50 dB")
    lines = summary_lines([{"tensor": "layers.1.mlp.up_proj." + d["operand"], **d} for d in fallen_back_of(layer)])
    assert "              1 persistent saturation -> current scaling (block 1; input 1; step 5): 1 DID NOT WORK" in lines
    assert pending_verification({"step": 3, "target": "current"}).startswith("not verified")  # an earlier version's record


def fallen_back_of(layer) -> list[dict]:
    return [{"module": "m", "operand": op, **decision.as_dict()} for op, decision in layer.fallback.items()]


def test_the_summary_groups_150_decisions_in_a_few_lines():
    entries = [{"tensor": f"layers.{b}.mlp.{m}.{op}", "target": "high_precision", "step": 4 + (b > 20),
                "reason": LOW_SQNR, "steps_at": 3, "verified": {"step": 5, "worked": True, "text": "x"}}
               for b in range(1, 26) for m in ("gate_proj", "up_proj", "down_proj") for op in ("input", "weight")]
    entries[0] = {**entries[0], "target": "current", "reason": SATURATION, "verified": None}
    stopped = {"step": 6, "qualified": 40, "already": 150, "budget": 150, "diagnosis": "d"}
    lines = summary_lines(entries, stopped)
    assert len(lines) <= 6
    assert lines[0] == "fallback      150 tensors fell back (2 kinds; every decision in saturation_summary.json)"
    assert lines[1] == ("              149 SQNR under the floor -> high precision (blocks 1-25; input 74, weight 75; "
                        "steps 4-5): 149 worked")
    assert lines[2].endswith("1 pending") and lines[3].startswith("              stopped at step 6: 40 more qualified")
    assert sum(g["count"] for g in group_decisions(entries)) == 150


# ------------------------------------------------------------------------------------------- fits
def _config(tmp_path, model_dir, corpus, steps=10, callbacks=(), **policy):
    tmp_path.mkdir(exist_ok=True)
    return write_config(tmp_path, model_dir, corpus, **{
        "trainer.max_steps": steps, "warmup.warmup_steps": 2, "model.lr": 1e-5,
        "trainer.callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True,
                                             "every_n_train_steps": 1, "save_top_k": -1}}, *callbacks],
        "fallback": {"enabled": True, "policy": {"window": 4, "min_events": 2, **policy}}})


def _sqnr_series(log_dir: str) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        for key, value in row.items():
            if key.startswith("health/") and key.endswith("/sqnr_db") and key != "health/min_sqnr_db" and value:
                series.setdefault(key[len("health/"):-len("/sqnr_db")], {})[int(row["step"])] = float(value)
    return series


@pytest.mark.slow
def test_low_sqnr_operands_leave_the_8bit_figures_and_a_killed_run_resumes_exactly(tmp_path, tiny_model_dir,
                                                                                   tiny_corpus, caplog):
    # the tiny model's tensors measure 31.2-31.7 dB: a floor of 31.5 catches some, not all (no budget here)
    policy = {"sqnr_floor_db": 31.5, "sqnr_patience": 2, "max_tensors": None}
    with caplog.at_level(logging.INFO, logger="callbacks.fallback"):
        straight = cli.cli_main(["fit", "--config", _config(tmp_path / "straight", tiny_model_dir, tiny_corpus,
                                                            **policy)]).trainer
    decisions = fallen_back(straight.lightning_module.model)
    low = [d for d in decisions if d["reason"] == LOW_SQNR]
    assert low and len(low) < 12  # the floor catches some tensors, not every one
    assert all(d["target"] == "high_precision" for d in low)  # never current scaling for a low SQNR
    assert all(d["target"] == "current" for d in decisions if d["reason"] == SATURATION)
    assert all(d["verified"]["worked"] and d["verified"]["step"] == d["step"] + 1 for d in low)
    assert "fallback verified at step" in caplog.text and "DID NOT WORK" not in caplog.text
    series = _sqnr_series(straight.log_dir)
    summary = json.load(open(os.path.join(straight.log_dir, "saturation_summary.json")))
    for d in low:
        tensor = f"{d['module'][len('model.'):]}.{d['operand']}"
        assert max(series[tensor]) <= d["step"]  # no 8-bit SQNR of it after the step that decided
        assert summary["tensors"][tensor]["health"]["unquantized_since"] == d["step"]
    # the report's health table says it: the last 8-bit SQNR, then high precision
    health = health_stats(load_run(straight.log_dir))
    rows = [line for line in render_health([{"label": "qat", "health": health}], top=len(health["tensors"]))
            if "(high precision after step" in line]
    assert sorted(rows) == sorted(line for line in rows for d in low
                                  if f"`{d['module'][len('model.'):]}.{d['operand']}`" in line
                                  and f"(high precision after step {d['step']})" in line)
    assert len(rows) == len(low)
    printed = open(os.path.join(straight.log_dir, "run_summary.txt")).read().splitlines()
    fallback_lines = [line for line in printed if line.startswith("fallback ") or (
        line.startswith("              ") and "-> high precision" in line)]
    assert fallback_lines[0].startswith(f"fallback      {len(decisions)} tensors fell back")
    assert f"{len(low)} SQNR under the floor -> high precision" in fallback_lines[1]
    assert fallback_lines[1].endswith(f"{len(low)} worked")

    first = min(d["step"] for d in decisions)
    config = _config(tmp_path / "killed", tiny_model_dir, tiny_corpus, callbacks=[
        {"class_path": "tests._cli_runs.CrashAt", "init_args": {"step": first + 2}}], **policy)
    with pytest.raises(SimulatedCrash):
        cli.cli_main(["fit", "--config", config])
    resumed = cli.cli_main(["fit", "--config", _config(tmp_path / "killed", tiny_model_dir, tiny_corpus, **policy),
                            "--ckpt_path", "last"]).trainer
    assert fallen_back(resumed.lightning_module.model) == decisions
    a, b = (dict(t.lightning_module.state_dict()) for t in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.slow
def test_the_default_budget_stops_a_cascade_with_its_diagnosis(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    with caplog.at_level(logging.WARNING, logger="callbacks.fallback"):
        trainer = cli.cli_main(["fit", "--config", _config(tmp_path, tiny_model_dir, tiny_corpus, sqnr_floor_db=31.5,
                                                           sqnr_patience=2)]).trainer
    stopped = fallback_stopped(trainer.lightning_module)
    assert stopped is not None and stopped["budget"] == 3 and stopped["qualified"] + stopped["already"] > 3
    assert len(fallen_back(trainer.lightning_module.model)) == stopped["already"] <= 3
    assert "the recipe, not a few tensors, is the problem" in caplog.text and "under the SQNR floor" in caplog.text
    summary = json.load(open(os.path.join(trainer.log_dir, "saturation_summary.json")))
    assert summary["fallback_stopped"] == stopped
    printed = open(os.path.join(trainer.log_dir, "run_summary.txt")).read()
    assert f"stopped at step {stopped['step']}: {stopped['qualified']} more qualified at once" in printed


def test_a_floor_above_the_format_and_a_budget_above_the_model_are_refused(tmp_path, tiny_model_dir, tiny_corpus):
    config = _config(tmp_path, tiny_model_dir, tiny_corpus)
    before = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    with pytest.raises(ConfigError, match=r"fallback\.policy\.sqnr_floor_db: 40 dB is above what hif8 can give: "
                                          r"31\.56 dB on a Gaussian tensor at its best scale"):
        cli.cli_main(["fit", "--config", config, "--fallback.policy.sqnr_floor_db", "40"])
    with pytest.raises(ConfigError, match=r"fallback\.policy\.max_tensors: 13 is more than the model's 12 quantized "
                                          r"tensors"):
        cli.cli_main(["fit", "--config", config, "--fallback.policy.max_tensors", "13"])
    with pytest.raises(ConfigError, match=r"fallback\.policy\.on_low_sqnr: current cannot cure a low SQNR"):
        cli.cli_main(["fit", "--config", config, "--fallback.policy.sqnr_floor_db", "20",
                      "--fallback.policy.on_low_sqnr", "current"])
    # each refused before the trainer wrote anything: no log, no checkpoint, no cache
    assert sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs) == before


def test_the_export_of_a_mixed_run_reloads_to_the_same_logits(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from qat_app.hif8 import LayerSelection, convert_to_hif8_training, quantized_linears

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    convert_to_hif8_training(model, HiF8Recipe(amax_algo="max", history_len=4), LayerSelection(high_precision_layers=1),
                             RuntimeOptions(fused="off"))
    ids = torch.randint(0, 300, (2, 16))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        sync_and_advance(model)
    (a, first), (b, second), *_ = quantized_linears(model)
    first.fall_back("input", "current", step=2, reason=SATURATION, evidence="planted", events_at=0, steps_at=2)
    first.fall_back("weight", "high_precision", step=2, reason=LOW_SQNR, evidence="planted", events_at=0, steps_at=2)
    second.fall_back("input", "high_precision", step=3, reason=LOW_SQNR, evidence="planted", events_at=0, steps_at=3)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_hif8(model, tmp_path / "h8", dtype="float32")
    reloaded = load_hif8(tmp_path / "h8")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)
    assert {(d["module"], d["operand"], d["target"]) for d in fallen_back(reloaded)} == {
        (a, "input", "current"), (a, "weight", "high_precision"), (b, "input", "high_precision")}


def test_the_report_groups_the_decisions_and_lists_each_with_its_verification():
    from qat_app.report.health import render_fallback

    entries = [{"tensor": "layers.1.mlp.up_proj.input", "target": "current", "step": 5, "reason": SATURATION,
                "evidence": "e", "steps_at": 4, "verified": {"step": 9, "worked": False, "text": "2 events"}},
               {"tensor": "layers.2.mlp.up_proj.weight", "target": "high_precision", "step": 6, "reason": LOW_SQNR,
                "evidence": "f", "steps_at": 5, "verified": None}]
    stopped = {"step": 7, "qualified": 9, "already": 2, "budget": 3, "diagnosis": "9 under the SQNR floor"}
    text = "\n".join(render_fallback([{"label": "qat", "saturation": {"fallback": entries, "fallback_stopped": stopped}}]))
    assert "- `qat`: 2 tensors fell back (2 kinds; every decision in saturation_summary.json)" in text
    assert "  - stopped at step 7: 9 more qualified at once, past the budget of 3" in text
    assert "| current | 5 | persistent saturation | e | **did not work** (step 9: 2 events) |" in text
    assert "| high_precision | 6 | SQNR under the floor | f | pending: fewer quantized steps since than the window |" in text
