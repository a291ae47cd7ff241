"""SpikeAlarm: the robust z against an independent numpy computation, a planted spike that fires and a smooth
noisy run that does not, the checkpointed state, bad settings; tiny fits through main.py: a planted loss /
gradient spike and a NaN step are events, ``action: stop`` leaves a checkpoint whose resume raises exactly the
events of the uninterrupted run, and a quickstart-like run stays silent."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os

import lightning as L
import numpy as np
import pytest
import torch

import main as cli
from callbacks import SpikeAlarm
from callbacks.alarms import (EVENTS, EVENTS_FILE, GRAD_NORM_SPIKE, GRAD_NORM_Z, LOSS_SPIKE, LOSS_Z, NONFINITE,
                              NONFINITE_STEP, RELATIVE_FLOOR, STOP_FILE)
from callbacks.saturation import MAX_CLIPPED_FRAC, MIN_HEADROOM
from qat_app.errors import ConfigError
from tests._cli_runs import write_config


def numpy_z(value: float, history) -> float:
    """The definition, independently: (value - median) / max(1.4826 MAD, 0.1 % of |median|)."""
    history = np.asarray(history, dtype=np.float64)
    median = np.median(history)
    mad = np.median(np.abs(history - median))
    return (value - median) / max(1.4826 * mad, 0.001 * abs(median))


def smooth_noisy_run(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A decreasing loss (3 + 5 e^(-t/400)) with 2 % noise, and a slowly rising gradient norm with 15 % noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    loss = (3.0 + 5.0 * np.exp(-t / 400.0)) * (1 + 0.02 * rng.standard_normal(steps))
    grad_norm = (1.0 + t / steps) * np.exp(0.15 * rng.standard_normal(steps))
    return loss, grad_norm


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (a non-finite step's event holds the NaN loss)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def feed(alarm: SpikeAlarm, loss, grad_norm, start: int = 0) -> list[dict]:
    events = []
    for i, (l, g) in enumerate(zip(loss, grad_norm)):
        events += alarm.observe(start + i, float(l), float(g), nonfinite=False)
    return events


# ------------------------------------------------------------------------------------------- the rule
def test_z_equals_the_numpy_computation():
    rng = np.random.default_rng(1)
    values = 2.0 + 0.3 * rng.standard_normal(60)
    alarm = SpikeAlarm(window=16, min_history=5, z_threshold=1e9)
    mad_bound = 0
    for i, value in enumerate(values):
        alarm.observe(i, float(value), None, nonfinite=False)
        history = values[max(0, i - 16):i]
        if i < 5:
            assert LOSS_Z not in alarm.last_z  # not armed yet
            continue
        assert alarm.last_z[LOSS_Z] == pytest.approx(numpy_z(value, history), rel=1e-12, abs=1e-12)
        median = np.median(history)
        mad_bound += 1.4826 * np.median(np.abs(history - median)) > 0.001 * abs(median)
    assert mad_bound > 40  # the MAD, not the floor, set the spread on (nearly) every step


def test_flat_window_uses_the_relative_floor():
    alarm = SpikeAlarm(window=8, min_history=4, z_threshold=6.0)
    feed(alarm, [2.0] * 8, [1.0] * 8)
    below, above = 2.0 * (1 + 5 * RELATIVE_FLOOR), 2.0 * (1 + 7 * RELATIVE_FLOOR)
    assert alarm.observe(8, below, 1.0, nonfinite=False) == []  # z 5 against the floor
    assert alarm.last_z[LOSS_Z] == pytest.approx(numpy_z(below, [2.0] * 8)) == pytest.approx(5.0)
    new = alarm.observe(9, above, 1.0, nonfinite=False)  # z 7 (the window: seven 2.0 and one `below`)
    assert [e["kind"] for e in new] == [LOSS_SPIKE] and new[0]["z"] == pytest.approx(7.0)


def test_a_smooth_decreasing_noisy_run_is_silent_and_a_planted_spike_fires():
    loss, grad_norm = smooth_noisy_run(3000)
    assert feed(SpikeAlarm(), loss, grad_norm) == []

    spiked_loss, spiked_norm = loss.copy(), grad_norm.copy()
    spiked_loss[1500] *= 1.5  # +50 %: about 25 noise sigmas
    spiked_norm[2200] *= 4.0
    alarm = SpikeAlarm()
    events = feed(alarm, spiked_loss, spiked_norm)
    assert [(e["step"], e["kind"]) for e in events] == [(1500, LOSS_SPIKE), (2200, GRAD_NORM_SPIKE)]
    spike = events[0]
    history = spiked_loss[1500 - alarm.window:1500]
    assert spike["value"] == spiked_loss[1500] and spike["median"] == pytest.approx(np.median(history))
    assert spike["z"] == pytest.approx(numpy_z(spiked_loss[1500], history)) and spike["z"] > alarm.z_threshold


def test_nothing_fires_before_min_history():
    alarm = SpikeAlarm(window=10, min_history=6)
    assert feed(alarm, [1.0, 1.01, 0.99, 1.0, 1.02, 50.0], [1.0] * 6) == []  # the 6th value is scored against 5
    assert alarm.last_z == {}
    # armed: the 50 in the window does not move the median or the MAD; a jump of the gradient norm fires
    assert [e["kind"] for e in feed(alarm, [1.0], [40.0], start=6)] == [GRAD_NORM_SPIKE]
    assert abs(alarm.last_z[LOSS_Z]) < 1


def test_a_non_finite_step_is_an_event_and_stays_out_of_the_windows():
    alarm = SpikeAlarm(window=8, min_history=3)
    feed(alarm, [2.0, 2.1, 1.9], [1.0, 1.1, 0.9])
    new = alarm.observe(3, math.nan, math.inf, nonfinite=True)
    assert [(e["step"], e["kind"]) for e in new] == [(3, NONFINITE_STEP)] and alarm.nonfinite == 1
    assert list(alarm.loss.values) == [2.0, 2.1, 1.9] and list(alarm.grad_norm.values) == [1.0, 1.1, 0.9]
    assert "skipped" in alarm.describe(new[0]) and "at step 3" in alarm.describe(new[0])


def test_state_round_trips_through_a_checkpoint():
    loss, grad_norm = smooth_noisy_run(400, seed=3)
    loss[150] *= 2
    first = SpikeAlarm(window=32, min_history=8)
    feed(first, loss[:200], grad_norm[:200])
    first.observe(200, math.nan, math.nan, nonfinite=True)
    buffer = io.BytesIO()
    torch.save({"alarm": first.state_dict()}, buffer)  # what a Lightning checkpoint holds, loaded as on resume
    buffer.seek(0)
    second = SpikeAlarm(window=32, min_history=8)
    second.load_state_dict(torch.load(buffer, weights_only=True)["alarm"])
    assert same(second.state_dict(), first.state_dict()) and first.events and first.nonfinite == 1
    a = feed(first, loss[201:], grad_norm[201:], start=201)
    b = feed(second, loss[201:], grad_norm[201:], start=201)
    assert a == b and same(first.state_dict(), second.state_dict())


@pytest.mark.parametrize("kwargs, pattern", [
    ({"window": 2}, r"alarms\.window: must be an integer >= 3 \(steps\), got 2"),
    ({"z_threshold": 0}, r"alarms\.z_threshold: must be a number > 0, got 0"),
    ({"z_threshold": -1.5}, r"alarms\.z_threshold: must be a number > 0, got -1\.5"),
    ({"min_history": 2}, r"alarms\.min_history: must be an integer from 3 to alarms\.window \(64\), got 2"),
    ({"window": 10, "min_history": 11}, r"alarms\.min_history: .* \(10\), got 11"),
    ({"action": "halt"}, r"alarms\.action: unknown action 'halt'; allowed: warn, stop"),
    ({"action": "stpo"}, r"alarms\.action: unknown action 'stpo' \(did you mean stop\?\)"),
])
def test_bad_settings_name_the_field(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SpikeAlarm(**kwargs)


# ------------------------------------------------------------------------------------ tiny fits via main.py
class PlantAt(L.Callback):
    """Multiplies the model's logits by ``factor`` in every micro-batch of optimizer step ``spike_step`` (a loss
    and gradient spike), and by NaN in step ``nan_step`` (a skipped step)."""

    def __init__(self, spike_step: int = -1, factor: float = 1000.0, nan_step: int = -1) -> None:
        self.spike_step, self.factor, self.nan_step = spike_step, factor, nan_step
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        factor = {self.spike_step: self.factor, self.nan_step: math.nan}.get(trainer.global_step)
        if factor is not None:
            head = pl_module.model.get_output_embeddings()
            self._handle = head.register_forward_hook(lambda module, args, out: out * factor)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


SPIKE_STEP, NAN_STEP, STEPS = 7, 9, 11


def _config(tmp_path, model_dir, corpus, **overrides):
    tmp_path.mkdir(exist_ok=True)
    return write_config(tmp_path, model_dir, corpus, **{
        "trainer.max_steps": STEPS,
        "trainer.callbacks": [
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 4,
                           "save_top_k": -1}},
            {"class_path": "tests.test_alarms.PlantAt",
             "init_args": {"spike_step": SPIKE_STEP, "nan_step": NAN_STEP}}],
        "alarms": {"window": 16, "min_history": 4},
        **overrides})


def _alarm(trainer) -> SpikeAlarm:
    return next(c for c in trainer.callbacks if isinstance(c, SpikeAlarm))


def _logged(log_dir) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        by_step.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return by_step


@pytest.mark.slow
def test_planted_spike_and_nan_are_events_and_stop_resumes_to_the_same_events(tmp_path, tiny_model_dir, tiny_corpus,
                                                                             caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="callbacks.alarms"):
        straight = cli.cli_main(["fit", "--config", _config(tmp_path / "straight", tiny_model_dir, tiny_corpus)]).trainer
    alarm = _alarm(straight)
    kinds = {(e["step"], e["kind"]) for e in alarm.events}
    assert {(SPIKE_STEP, LOSS_SPIKE), (SPIKE_STEP, GRAD_NORM_SPIKE), (NAN_STEP, NONFINITE_STEP)} <= kinds
    assert min(e["step"] for e in alarm.events) == SPIKE_STEP  # silent before the plant
    assert alarm.nonfinite == 1 and len(alarm.loss.values) == STEPS - 1  # the NaN step is in no window
    line = next(r.getMessage() for r in caplog.records if f"loss spike at step {SPIKE_STEP}:" in r.getMessage())
    assert "robust z" in line and "median" in line and "learning rate" in line
    # the logged metrics: z at the step train/loss describes, cumulative counts
    logged = _logged(straight.log_dir)
    assert logged[SPIKE_STEP][LOSS_Z] > alarm.z_threshold and logged[SPIKE_STEP][GRAD_NORM_Z] > alarm.z_threshold
    assert "train/loss" in logged[SPIKE_STEP] and logged[NAN_STEP][NONFINITE] == 1.0
    assert logged[STEPS - 1][EVENTS] == len(alarm.events) and logged[SPIKE_STEP - 1][EVENTS] == 0
    written = json.load(open(os.path.join(straight.log_dir, EVENTS_FILE)))
    assert [(e["step"], e["kind"]) for e in written["events"]] == [(e["step"], e["kind"]) for e in alarm.events]
    assert written["counts"][NONFINITE_STEP] == 1 and written["global_step"] == STEPS
    # beside each event, the step's clipping: the saturation callback's record of that step, as it logged it
    for event in alarm.events:
        at = logged[event["step"]]
        assert event["clipping"]["clipped_frac"] == pytest.approx(at["sat/clipped_frac"], rel=1e-12)
        assert event["clipping"]["max_clipped_frac"] == pytest.approx(at.get(MAX_CLIPPED_FRAC, 0.0), rel=1e-12)
        assert event["clipping"]["min_headroom"] == (pytest.approx(at[MIN_HEADROOM], rel=1e-12)
                                                     if MIN_HEADROOM in at else None)
    assert any(e["clipping"]["min_headroom"] is not None for e in alarm.events)  # quantized steps among them
    assert "of its quantized elements (worst tensor" in line

    # action stop: a checkpoint after the spike's step, the resume command; resuming it ends as the straight run
    config = _config(tmp_path / "stopped", tiny_model_dir, tiny_corpus, **{"alarms.action": "stop"})
    stopped = cli.cli_main(["fit", "--config", config]).trainer
    stop = os.path.join(str(tmp_path / "stopped" / "ckpt"), STOP_FILE.format(step=SPIKE_STEP + 1))
    assert stopped.global_step == SPIKE_STEP + 1 and _alarm(stopped).stop_checkpoint == stop and os.path.exists(stop)
    printed = capsys.readouterr().out
    assert f"python main.py fit --config {os.path.join(stopped.log_dir, 'config.yaml')} --ckpt_path {stop}" in printed
    resumed = cli.cli_main(["fit", "--config", config, "--ckpt_path", stop, "--alarms.action", "warn"]).trainer
    again = _alarm(resumed)
    assert resumed.global_step == STEPS and resumed.log_dir != stopped.log_dir
    assert same(again.events, alarm.events) and again.nonfinite == alarm.nonfinite
    assert list(again.loss.values) == list(alarm.loss.values)  # every step's loss: an exact resume
    assert list(again.grad_norm.values) == list(alarm.grad_norm.values)


@pytest.mark.slow
def test_a_quickstart_like_run_is_silent(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    """The quickstart's shape on the tiny model (24 steps, 8 of BF16 warmup, its learning rate, schedule and
    clipping) with the default alarm settings: armed for the last 8 steps, no event, an empty events file."""
    steps = 24
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "trainer.max_steps": steps, "trainer.gradient_clip_val": 1.0, "trainer.callbacks": [],
        "warmup.warmup_steps": 8, "model.lr": 1e-5, "model.lr_schedule": "cosine", "model.lr_warmup_steps": 2})
    with caplog.at_level(logging.WARNING, logger="callbacks.alarms"):
        trainer = cli.cli_main(["fit", "--config", config]).trainer
    alarm = _alarm(trainer)
    assert alarm.events == [] and "alarm:" not in caplog.text
    assert len(alarm.loss.values) == len(alarm.grad_norm.values) == steps
    armed = range(alarm.min_history, steps)
    logged = _logged(trainer.log_dir)
    assert all(LOSS_Z in logged[s] and GRAD_NORM_Z in logged[s] for s in armed)
    assert not any(LOSS_Z in logged[s] for s in range(alarm.min_history))
    assert max(logged[s][GRAD_NORM_Z] for s in armed) < alarm.z_threshold
    assert json.load(open(os.path.join(trainer.log_dir, EVENTS_FILE)))["events"] == []
