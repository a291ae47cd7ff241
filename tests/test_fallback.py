"""Automatic fallback (qat_app.hif8.fallback, callbacks.fallback).

The rule against an independent count (a deque of each tensor's last W quantized steps, written here); the SQNR
streak; the settings' errors; a fallen-back matmul (current scaling never clips, high precision computes the
unquantized product, the BF16 warmup's switches cannot undo it, a checkpoint carries it, an older one loads);
fits through main.py on the tiny model: a planted persistently saturating layer falls back and nothing else does,
a quickstart-shaped run takes no decision, a run killed after a fallback and resumed ends exactly as an
uninterrupted one; the 8-bit export of fallen-back layers reloads to the same logits.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
from collections import deque

import lightning as L
import pytest
import torch

import main as cli
from callbacks import FallbackCallback
from callbacks.fallback import FALLBACK_METRIC
from qat_app.errors import ConfigError
from qat_app.export import export_hif8, load_hif8
from qat_app.hif8 import HiF8Recipe, LayerSelection, RuntimeOptions, convert_to_hif8_training, quantized_linears
from qat_app.hif8.fallback import (LOW_SQNR, SATURATION, FallbackError, FallbackMonitor, FallbackPolicy,
                                   fallen_back)
from qat_app.hif8.inventory import inventory_lines, quantization_inventory
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.patch import set_quantization
from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance
from qat_app.hif8.operand import Operand
from tests._cli_runs import SimulatedCrash, write_config


# ------------------------------------------------------------------------------------------- the rule
def reference_decisions(histories: list[list[int | None]], window: int, k: int) -> dict[int, int]:
    """Tensor -> the first step its events fill k of its last W quantized steps. ``histories[t][step]``: 1 an
    event, 0 a quantized step without one, None a step the tensor was not quantized in."""
    fired = {}
    for tensor, steps in enumerate(histories):
        recent: deque[int] = deque(maxlen=window)
        for step, value in enumerate(steps):
            if value is None:
                continue
            recent.append(value)
            if sum(recent) >= k:
                fired[tensor] = step
                break
    return fired


def run_monitor(monitor: FallbackMonitor, histories, start: int = 0, stop: int | None = None, counters=None,
                fired: dict[int, int] | None = None) -> tuple[dict[int, int], tuple[list, list]]:
    """Feed the histories' run counters step by step -> (tensor -> the step it fell back at, the counters);
    a tensor that fell back (here or in ``fired``) is no longer eligible."""
    n = len(histories)
    events, steps = counters if counters is not None else ([0] * n, [0] * n)
    fired = dict(fired or {})
    for step in range(start, stop if stop is not None else len(histories[0])):
        for t in range(n):
            value = histories[t][step]
            if value is not None:
                steps[t] += 1
                events[t] += value
        eligible = torch.tensor([t not in fired for t in range(n)])
        for decision in monitor.update(torch.tensor(events), torch.tensor(steps), eligible=eligible):
            fired[decision.index] = step
    return fired, (events, steps)


def random_histories(n: int, steps: int, seed: int) -> list[list[int | None]]:
    rng = random.Random(seed)
    rates = [rng.choice([0.0, 0.05, 0.2, 0.4, 0.6, 0.9]) for _ in range(n)]
    return [[None if rng.random() < 0.15 else int(rng.random() < rate) for _ in range(steps)] for rate in rates]


@pytest.mark.parametrize("window, k", [(1, 1), (4, 2), (8, 8), (16, 5)])
def test_the_saturation_rule_equals_an_independent_count(window, k):
    histories = random_histories(40, 60, seed=window * 100 + k)
    monitor = FallbackMonitor(FallbackPolicy(window=window, min_events=k, max_tensors=None), [f"t{i}" for i in range(40)])
    fired, _ = run_monitor(monitor, histories)
    expected = reference_decisions(histories, window, k)
    assert fired == expected
    assert 0 < len(expected) < 40  # some tensors fire, some do not


def test_the_evidence_names_the_count_and_the_window():
    monitor = FallbackMonitor(FallbackPolicy(window=4, min_events=3, max_tensors=None), ["a", "b"])
    histories = [[1, 0, 1, 1], [0, 0, 0, 1]]
    events, steps = [0, 0], [0, 0]
    decisions = []
    for step in range(4):
        for t in range(2):
            steps[t] += 1
            events[t] += histories[t][step]
        decisions += monitor.update(torch.tensor(events), torch.tensor(steps))
    assert [(d.index, d.reason) for d in decisions] == [(0, SATURATION)]
    assert decisions[0].evidence == "saturation events in 3 of its last 4 quantized steps (k=3, W=4)"


def test_the_sqnr_rule_needs_consecutive_measurements_under_the_floor():
    monitor = FallbackMonitor(FallbackPolicy(min_events=0, sqnr_floor_db=20.0, sqnr_patience=3, max_tensors=None), ["a", "b", "c"])
    nan = float("nan")
    zeros = torch.zeros(3, dtype=torch.int64)
    # a: 15, (not measured), 15, 25, 15, 15, 15 -> fires at the 7th; b: always 19 -> fires at the 3rd; c: inf (exact)
    series = [[15, 19, float("inf")], [nan, 19, nan], [15, 19, float("inf")], [25, nan, nan], [15, nan, nan],
              [15, nan, nan], [15, nan, nan]]
    fired = {}
    for step, sqnrs in enumerate(series):
        eligible = torch.tensor([i not in fired for i in range(3)])
        for d in monitor.update(zeros, zeros, torch.tensor(sqnrs, dtype=torch.float64), eligible):
            fired[d.index] = (step, d.reason, d.evidence)
    assert {i: s for i, (s, _, _) in fired.items()} == {1: 2, 0: 6}
    assert fired[1][1] == LOW_SQNR and fired[1][2] == "SQNR 19.00 dB, under 20 dB on 3 consecutive measurements"


def test_state_round_trips_through_a_checkpoint_and_a_foreign_one_is_refused():
    histories = random_histories(12, 50, seed=5)
    policy = FallbackPolicy(window=6, min_events=3, max_tensors=None)
    straight = FallbackMonitor(policy, [f"t{i}" for i in range(12)])
    fired_straight, _ = run_monitor(straight, histories)

    first = FallbackMonitor(policy, [f"t{i}" for i in range(12)])
    fired_first, counters = run_monitor(first, histories, stop=20)
    buffer = io.BytesIO()
    torch.save({"fallback": first.state_dict()}, buffer)
    buffer.seek(0)
    second = FallbackMonitor(policy, [f"t{i}" for i in range(12)])
    second.load_state_dict(torch.load(buffer, weights_only=True)["fallback"])
    fired_both, _ = run_monitor(second, histories, start=20, counters=counters, fired=fired_first)
    assert fired_both == fired_straight and set(fired_both) - set(fired_first)  # decisions after the resume, too

    with pytest.raises(FallbackError, match=r"the saved evidence is for 12 other tensors"):
        FallbackMonitor(policy, [f"u{i}" for i in range(12)]).load_state_dict(first.state_dict())
    with pytest.raises(FallbackError, match=r"t0: its counters went from"):
        second.update(torch.zeros(12, dtype=torch.int64), torch.zeros(12, dtype=torch.int64))


@pytest.mark.parametrize("kwargs, pattern", [
    ({"target": "bf16"}, r"target: unknown target 'bf16'; allowed: current, high_precision"),
    ({"window": 0}, r"window: must be an integer >= 1, got 0"),
    ({"window": 4, "min_events": 5}, r"min_events: must be an integer in \[0, window=4\]"),
    ({"min_events": -1}, r"min_events: must be an integer in \[0, window=16\]"),
    ({"sqnr_floor_db": float("inf")}, r"sqnr_floor_db: must be a finite number of dB or null, got inf"),
    ({"sqnr_patience": 0}, r"sqnr_patience: must be an integer >= 1, got 0"),
    ({"min_events": 0}, r"min_events: is 0 and sqnr_floor_db is null: no rule is left"),
])
def test_bad_policies_name_their_field(kwargs, pattern):
    with pytest.raises(FallbackError, match=pattern):
        FallbackPolicy(**kwargs)
    with pytest.raises(ConfigError, match=r"fallback\.policy\." + pattern):
        FallbackCallback(enabled=True, policy=kwargs)


# ------------------------------------------------------------------------------------------- a matmul
def delayed_layer(algo: str = "most_recent") -> HiF8Linear:
    torch.manual_seed(0)
    layer = HiF8Linear(16, 8, recipe=HiF8Recipe(amax_algo=algo, history_len=4), runtime=RuntimeOptions(fused="off"))
    layer.train()
    layer(torch.randn(4, 16))  # one recorded step: the scale now follows amax ~3
    sync_and_advance(layer)
    return layer


def test_current_fallback_stops_the_clipping_high_precision_computes_the_unquantized_product():
    x = 10.0 * torch.randn(4, 16)  # ~10x the recorded amax: the delayed scale clips it
    layer = delayed_layer()
    layer(x)
    assert int(layer.input_scaler.step_clipped) > 0
    sync_and_advance(layer)
    layer.fall_back("input", "current", step=1, reason=SATURATION, evidence="planted")
    assert layer.input_scaler.algo == "current" and layer.input_scaler.uses_current_scaling
    layer(x)
    assert int(layer.input_scaler.step_clipped) == 0  # CTS maps this tensor's own amax to max_val
    sync_and_advance(layer)

    layer.fall_back("weight", "high_precision", step=2, reason=SATURATION, evidence="planted")
    set_quantization(layer, weights=True, activations=True)  # the warmup's switch cannot undo it
    assert not layer.quantizes(Operand.WEIGHT) and layer.quantizes(Operand.INPUT)
    with torch.no_grad():
        result, scale = layer.input_scaler.quantize(x, layer.format, want_codes=True)  # current scaling
        grid = layer.format.decode(result.codes)  # the input's grid values; the weight as it is (high precision)
        factor = torch.reciprocal(scale.double()).float()
        expected = (grid @ layer.weight.t()) * factor + layer.bias
        assert torch.equal(layer(x), expected)
    with pytest.raises(ValueError, match=r"fallback target: unknown 'bf16'"):
        layer.fall_back("input", "bf16")


def test_a_checkpoint_carries_the_fallback_and_an_older_one_loads():
    layer = delayed_layer()
    layer.fall_back("input", "current", step=5, reason=SATURATION, evidence="e")
    layer.fall_back("weight", "high_precision", step=6, reason=LOW_SQNR, evidence="f")
    state = layer.state_dict()
    fresh = delayed_layer()
    fresh.load_state_dict(state)
    assert fresh.fallback == layer.fallback and fresh.input_scaler.algo == "current" and not fresh.quantizes(Operand.WEIGHT)
    x = 10.0 * torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), layer.eval()(x))
    older = dict(state)
    older["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "fallback"}  # before fallback
    again = delayed_layer()
    again.load_state_dict(older)
    assert again.fallback == {} and again.input_scaler.algo == "most_recent" and again.quantizes(Operand.WEIGHT)


# ------------------------------------------------------------------------------------------- a model
def tiny_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    convert_to_hif8_training(model, recipe=HiF8Recipe(amax_algo="max", history_len=4),
                             selection=LayerSelection(high_precision_layers=1), runtime=RuntimeOptions(fused="off"))
    return model


def grow_input(layer, factor: float):
    """A forward pre-hook multiplying the layer's input by ``factor`` per call: its amax outgrows any delayed scale."""
    state = {"scale": 1.0}

    def hook(module, args):
        state["scale"] *= factor
        return (args[0] * state["scale"],)
    return layer.register_forward_pre_hook(hook)


def test_a_planted_saturating_layer_falls_back_and_nothing_else_does(tiny_model_dir):
    model = tiny_model(tiny_model_dir).train()
    layers = dict(quantized_linears(model))
    planted = "model.layers.1.mlp.down_proj"
    grow_input(layers[planted], 2.0)
    monitor = FallbackMonitor(FallbackPolicy(window=4, min_events=3),
                              [f"{n}.{op}" for n, layer in quantized_linears(model) for op in ("input", "weight")])
    start_warmup(model)
    ids = torch.randint(0, 300, (2, 16))
    new = []
    for step in range(10):
        if step == 2:
            end_warmup(model)
        model(input_ids=ids, labels=ids).loss.backward()
        new += sync_and_advance(model, step=step, fallback=monitor).fallback  # decided on the step's record
    assert [(d["module"], d["operand"], d["step"]) for d in new] == [(planted, "input", 4)]  # 3 events: steps 2-4
    assert new[0]["evidence"] == "saturation events in 3 of its last 3 quantized steps (k=3, W=4)"
    assert [{k: v for k, v in d.items() if k != "verified"} for d in fallen_back(model)] == new
    assert layers[planted].input_scaler.algo == "current"
    # verified over the W=4 quantized steps after it: current scaling stopped the clipping
    assert fallen_back(model)[0]["verified"] == {"step": 8, "worked": True,
                                                 "text": "0 saturation events in the 4 quantized steps since"}
    entry = next(m for m in quantization_inventory(model, LayerSelection(high_precision_layers=1))["modules"]
                 if m["name"] == planted)
    assert entry["fallback"]["input"]["target"] == "current" and entry["quantized"]["input"]
    assert any("fell back" in line and planted in line for line in
               inventory_lines(quantization_inventory(model, LayerSelection(high_precision_layers=1))))


@pytest.mark.parametrize("target", ["current", "high_precision"])
def test_the_export_of_fallen_back_layers_reloads_to_the_same_logits(tmp_path, tiny_model_dir, target):
    model = tiny_model(tiny_model_dir).train()
    ids = torch.randint(0, 300, (2, 16))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        sync_and_advance(model)
    (name, layer), (other, other_layer) = quantized_linears(model)[:2]
    layer.fall_back("input", target, step=2, reason=SATURATION, evidence="planted")
    other_layer.fall_back("weight", target, step=2, reason=LOW_SQNR, evidence="planted")
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_hif8(model, tmp_path / "export", dtype="float32")
    layout = json.loads((tmp_path / "export" / "hif8_layout.json").read_text())
    assert layout["quantized_layers"][other]["weight"] == ("dense" if target == "high_precision" else "codes")
    assert layout["quantized_layers"][name]["extra_state"]["fallback"]["input"]["target"] == target
    reloaded = load_hif8(tmp_path / "export")
    assert fallen_back(reloaded) == fallen_back(model)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


# ------------------------------------------------------------------------------------------- fits
class GrowInput(L.Callback):
    """From optimizer step ``start``, multiplies the input of quantized layer ``layer`` (a name) by ``factor`` more
    per step and divides its output by as much: a persistently saturating activation whose layer still computes
    about the same product, so the layers after it see what they saw."""

    def __init__(self, layer: str, start: int, factor: float = 2.0) -> None:
        self.layer, self.start, self.factor = layer, start, factor
        self._handles = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if trainer.global_step >= self.start:
            scale = self.factor ** (trainer.global_step - self.start + 1)
            layer = pl_module.model.get_submodule(self.layer)
            self._handles = [layer.register_forward_pre_hook(lambda module, args: (args[0] * scale,)),
                             layer.register_forward_hook(lambda module, args, out: out / scale)]


def events_from_log(log_dir: str, steps: int) -> dict[str, list[int | None]]:
    """Tensor -> per step: 1 it clipped, 0 it was quantized without clipping, None not quantized (metrics.csv's
    sat/<tensor>/clipped_frac, logged every step here)."""
    import csv

    fracs: dict[str, dict[int, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        for key, value in row.items():
            if key.startswith("sat/") and key.endswith("/clipped_frac") and key != "sat/clipped_frac" and value:
                fracs.setdefault(key[len("sat/"):-len("/clipped_frac")], {})[int(row["step"])] = float(value)
    return {name: [None if s not in by_step else int(by_step[s] > 0) for s in range(steps)]
            for name, by_step in fracs.items()}


PLANTED_A, PLANTED_B = "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"
STEPS = 14


def _fit_config(tmp_path, model_dir, corpus, extra_callbacks=(), **overrides):
    tmp_path.mkdir(exist_ok=True)
    return write_config(tmp_path, model_dir, corpus, **{
        "trainer.max_steps": STEPS,
        "trainer.callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 1,
                           "save_top_k": -1}},
            {"class_path": "tests.test_fallback.GrowInput", "init_args": {"layer": PLANTED_A, "start": 4}},
            {"class_path": "tests.test_fallback.GrowInput", "init_args": {"layer": PLANTED_B, "start": 9}},
            *extra_callbacks],
        "fallback": {"enabled": True, "policy": {"window": 4, "min_events": 3}},
        "model.lr": 1e-5,  # at the config's 1e-3 the tiny model's own activations soon saturate persistently too
        **overrides})


def _fallback(trainer) -> FallbackCallback:
    return next(c for c in trainer.callbacks if isinstance(c, FallbackCallback))


def _state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_planted_layers_fall_back_and_a_killed_run_resumes_exactly(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    with caplog.at_level(logging.WARNING, logger="callbacks.fallback"):
        straight = cli.cli_main(["fit", "--config", _fit_config(tmp_path / "straight", tiny_model_dir, tiny_corpus)]).trainer
    decisions = _fallback(straight).decisions
    # the decisions equal the rule applied independently to the logged per-tensor clipping: A (growing from step
    # 4) and B (from step 9), nothing else
    logged_events = events_from_log(straight.log_dir, STEPS)
    names = sorted(logged_events)
    expected = reference_decisions([logged_events[n] for n in names], window=4, k=3)
    assert sorted((f"model.{names[t]}", step) for t, step in expected.items()) == sorted(
        (f"{d['module']}.{d['operand']}", d["step"]) for d in decisions)
    assert [(d["module"], d["operand"], d["target"]) for d in decisions] == [
        (PLANTED_A, "input", "current"), (PLANTED_B, "input", "current")]
    step_a, step_b = decisions[0]["step"], decisions[1]["step"]
    assert 4 < step_a <= 6 and 9 < step_b <= 11  # 3 of 4: the planted events of 2-3 steps, perhaps a natural one
    assert f"fallback at step {step_a}: {PLANTED_A}.input -> current scaling" in caplog.text
    summary = json.load(open(os.path.join(straight.log_dir, "saturation_summary.json")))
    assert [(f["tensor"], f["step"]) for f in summary["fallback"]] == [
        (PLANTED_A[len("model."):] + ".input", step_a), (PLANTED_B[len("model."):] + ".input", step_b)]
    assert summary["tensors"][PLANTED_A[len("model."):] + ".input"]["fallback"]["reason"] == SATURATION
    printed = open(os.path.join(straight.log_dir, "run_summary.txt")).read()
    assert "fallback      2 tensors fell back (1 kind; every decision in saturation_summary.json)" in printed
    assert (f"              2 {SATURATION} -> current scaling (block 1; input 2; steps {step_a}-{step_b}): "
            f"{1 + (step_b + 4 <= STEPS - 1)} worked") in printed  # B verified if W=4 steps remained after it
    rows = list(__import__("csv").DictReader(open(os.path.join(straight.log_dir, "metrics.csv"))))
    logged = {int(r["step"]): float(r[FALLBACK_METRIC]) for r in rows if r.get(FALLBACK_METRIC)}
    assert logged[step_a - 1] == 0.0 and logged[step_a] == 1.0 and logged[step_b] == 2.0 and logged[STEPS - 1] == 2.0
    # after the fallback A clips nothing more (current scaling), while its input keeps growing
    a_events = logged_events[PLANTED_A[len("model."):] + ".input"]
    assert a_events[step_a] == 1 and not any(a_events[step_a + 1:])
    assert int(straight.lightning_module.model.get_submodule(PLANTED_A).input_scaler.saturation_events) == sum(
        v or 0 for v in a_events)

    # killed at step 8 (after A's fallback, before B's), resumed from the last checkpoint
    config = _fit_config(tmp_path / "killed", tiny_model_dir, tiny_corpus,
                         extra_callbacks=[{"class_path": "tests._cli_runs.CrashAt", "init_args": {"step": 8}}])
    with pytest.raises(SimulatedCrash):
        cli.cli_main(["fit", "--config", config])
    resumed_config = _fit_config(tmp_path / "killed", tiny_model_dir, tiny_corpus)
    resumed = cli.cli_main(["fit", "--config", resumed_config, "--ckpt_path", "last"]).trainer
    assert _fallback(resumed).decisions == decisions[1:]  # B decided after the resume, at the same step
    assert fallen_back(resumed.lightning_module.model) == fallen_back(straight.lightning_module.model)
    a, b = _state(straight), _state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_quickstart_like_run_takes_no_decision(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    """The quickstart's shape on the tiny model (24 steps, 8 of BF16 warmup, window 8, its learning rate, schedule
    and clipping) with the default policy: nothing falls back."""
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "trainer.max_steps": 24, "trainer.gradient_clip_val": 1.0, "trainer.callbacks": [],
        "warmup.warmup_steps": 8, "model.lr": 1e-5, "model.lr_schedule": "cosine", "model.lr_warmup_steps": 2,
        "model.quant.history_len": 8, "fallback": {"enabled": True}})
    with caplog.at_level(logging.WARNING, logger="callbacks.fallback"):
        trainer = cli.cli_main(["fit", "--config", config]).trainer
    assert _fallback(trainer).decisions == [] and "fallback at step" not in caplog.text
    assert _fallback(trainer).monitor.steps_seen.max() == 16  # it watched every quantized step
    summary = json.load(open(os.path.join(trainer.log_dir, "saturation_summary.json")))
    assert summary["fallback"] == []


def test_window_longer_than_the_run_and_sqnr_without_health_are_refused(tmp_path, tiny_model_dir, tiny_corpus):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"fallback": {"enabled": True, "policy": {"window": 4,
                                                                                                             "min_events": 2}}})
    with pytest.raises(ConfigError, match=r"fallback\.policy\.window \(4\) is longer than the run's 3 quantized steps "
                                          r"\(trainer\.max_steps 6 - warmup\.warmup_steps 3\)"):
        cli.cli_main(["fit", "--config", config])
    with pytest.raises(ConfigError, match=r"fallback\.policy\.sqnr_floor_db needs the SQNR measured"):
        cli.cli_main(["fit", "--config", config, "--fallback.policy.window", "2", "--fallback.policy.sqnr_floor_db",
                      "20", "--saturation.health", "false"])
