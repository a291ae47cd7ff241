"""Saturation forecast (qat_app.hif8.forecast): a planted drift forecast a window ahead, silence on a stationary
tensor, robustness, exact resume, bad input; through the scalers the training uses (real fake quantization)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from qat_app.hif8.errors import FieldError
from qat_app.hif8.forecast import SaturationForecast, robust_fits, steps_to_clip
from qat_app.hif8.formats import saturation_threshold
from qat_app.hif8.scaling import AmaxScaler

H_CLIP = 15.0 / saturation_threshold("hif8", 15.0)  # 15 / 15.5


def run_scaler(outlier, steps: int, window: int, seed: int = 0, forecast: SaturationForecast | None = None,
               start: int = 0):
    """A max-window scaler through a BF16 warmup of one window (observed only) then QAT, on randn(4096) with an
    optional planted outlier ``outlier(step)``; each step's headroom and clip fed to ``forecast``."""
    gen = torch.Generator().manual_seed(seed)
    scaler = AmaxScaler("max", window, max_val=15.0)
    forecast = forecast or SaturationForecast(window)
    first_clip = None
    for t in range(steps):
        x = torch.randn(4096, generator=gen)
        if outlier is not None:
            x[0] = outlier(t) * (1 + 0.002 * float(torch.randn(1, generator=gen)))
        if t < window:
            scaler.observe(x.abs().amax(), None, x.numel())
        else:
            result, _ = scaler.quantize(x, "hif8")
            scaler.observe(result.amax, result.clipped, x.numel())
        scaler.advance()
        clipped = int(scaler.last_clipped) > 0
        if clipped and first_clip is None:
            first_clip = t
        if t >= start:
            forecast.update(t, [("x", float(scaler.last_headroom), clipped, H_CLIP)])
    return forecast, first_clip


@pytest.mark.parametrize("window, growth", [(8, 2e-4), (64, 4e-5)])
def test_a_slowly_growing_outlier_is_forecast_at_least_a_window_before_its_first_clip(window, growth):
    # amax = 20 exp(c t^2): each step's amax is the window's new max, so the headroom a_hat / amax = exp(-c (2t - 1))
    # falls a little every step until it crosses 15 / 15.5
    forecast, first_clip = run_scaler(lambda t: 20 * math.exp(growth * t * t), 12 * window, window)
    assert first_clip is not None
    scored = forecast.scored()
    assert scored["hits"] == 1 and scored["misses"] == 0 and scored["false_alarms"] == 0
    warning = scored["hit_list"][0]
    assert warning["clipped_at"] == first_clip and warning["lead_steps"] >= window
    assert warning["slope_per_window"] < 0 and warning["headroom"] > H_CLIP


@pytest.mark.parametrize("seed", range(3))
def test_a_stationary_tensor_that_never_clips_is_never_warned_about(seed):
    """The paper's window (64) on a stationary tensor: where nothing clips, no forecast."""
    forecast, first_clip = run_scaler(lambda t: 6.0, 400, 64, seed=seed)  # a steady outlier: amax stationary
    scored = forecast.scored()
    assert first_clip is None and scored["tensors_clipped"] == 0
    assert scored["warnings"] == 0 and scored["false_alarms"] == 0


def reference_fit(values: list[float]) -> tuple[float, float, float]:
    """Theil-Sen and the residuals' 1.4826 MAD in plain Python, the few-line reference of robust_fits."""
    n = len(values)
    slope = statistics.median([(values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)])
    intercept = statistics.median(v - slope * k for k, v in enumerate(values))
    return slope, intercept, 1.4826 * statistics.median(abs(v - (intercept + slope * k)) for k, v in enumerate(values))


@pytest.mark.parametrize("n", [6, 7, 16, 64])  # odd and even numbers of pairs and of points
def test_the_batched_fit_is_the_plain_python_one_bit_for_bit(n):
    gen = torch.Generator().manual_seed(n)
    rows = torch.rand(40, n, generator=gen, dtype=torch.float64)
    rows[0] = 1.0  # ties everywhere
    fits = list(zip(*(v.tolist() for v in robust_fits(rows))))
    assert fits == [reference_fit(row) for row in rows.tolist()]


def test_the_trend_is_robust_to_one_outlying_step_and_the_extrapolation_is_linear():
    values = [1.10 - 0.01 * k for k in range(10)]
    values[4] = 0.2  # one step wildly off
    slopes, intercepts, _ = robust_fits(torch.tensor([values], dtype=torch.float64))
    assert float(slopes[0]) == pytest.approx(-0.01) and float(intercepts[0]) == pytest.approx(1.10)
    steps, _ = steps_to_clip([1.10 - 0.01 * k for k in range(10)], 0.96)
    assert steps == pytest.approx((1.01 - 0.96) / 0.01)
    assert steps_to_clip([1.0 + 0.01 * k for k in range(10)], 0.96)[0] == math.inf  # rising: never
    assert steps_to_clip([0.95 - 0.001 * k for k in range(8)], 0.96)[0] == 0.0  # falling, already under it
    # with the steps' scatter: the trend is forecast to come within two robust spreads of the clip line
    noisy = [1.10 - 0.01 * k + (0.004 if k % 2 else -0.004) for k in range(10)]
    assert steps_to_clip(noisy, 0.96, sigmas=2.0)[0] == pytest.approx((1.01 - 0.96 - 2 * 1.4826 * 0.004) / 0.01,
                                                                       rel=0.05)


def test_a_resumed_forecast_is_the_uninterrupted_one():
    def outlier(t):
        return 20 * math.exp(2e-4 * t * t)

    straight, _ = run_scaler(outlier, 96, 8)
    first, _ = run_scaler(outlier, 50, 8)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint carries, through a serialisation
    resumed = SaturationForecast(8)
    resumed.load_state_dict(state)
    run_scaler(outlier, 96, 8, forecast=resumed, start=50)  # the same scaler trajectory, fed from step 50 on
    assert resumed.scored() == straight.scored() and resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("horizon", [0, -3, 2.5])
def test_a_horizon_of_no_steps_names_the_setting(horizon):
    from callbacks.saturation import AmaxSaturationCallback
    from qat_app.errors import ConfigError

    with pytest.raises(FieldError, match="^forecast_horizon: must be a positive number of steps"):
        SaturationForecast(8, horizon)
    with pytest.raises(ConfigError, match=r"^saturation\.forecast_horizon: must be a positive number"):
        AmaxSaturationCallback(forecast_horizon=horizon)


def test_the_report_and_the_run_summary_say_how_the_forecast_did():
    from qat_app.hif8.forecast import summary_lines
    from qat_app.report.health import NOT_RECORDED, render_forecast

    forecast, _ = run_scaler(lambda t: 20 * math.exp(2e-4 * t * t), 96, 8)
    scored = json.loads(json.dumps(forecast.scored()))
    lines = render_forecast([{"label": "qat", "saturation": {"forecast": scored}}])
    lead = scored["lead_steps"][0]
    assert f"| `qat` | 8 | 1 | 1 | 0 | 0 | 1 | 0 | {lead} |" in lines
    assert summary_lines(scored) == [f"forecast      1 warning(s) within 8 steps: 1 hit(s), lead {lead} steps (median), "
                                     "0 false alarm(s); 0 of 1 clipped tensors not forecast"]
    assert NOT_RECORDED in render_forecast([{"label": "old", "saturation": {}}])[-1] and summary_lines(None) == []


@pytest.mark.slow
def test_a_killed_and_resumed_fit_forecasts_what_the_uninterrupted_one_does(tmp_path, tiny_model_dir, tiny_corpus):
    """Through Lightning: the forecast's state travels in the checkpoint (the saturation callback's state), so the
    resumed run's forecast state, scores and logged forecast/* values equal the straight run's."""
    import csv
    import os

    from callbacks.saturation import AmaxSaturationCallback
    from tests._cli_runs import SimulatedCrash, checkpointed_fit

    def fit(directory, *extra, crash_at=None):  # 12 steps, 3 of warmup: 9 quantized steps, enough for the trend (6)
        return checkpointed_fit(directory, tiny_model_dir, tiny_corpus, *extra, crash_at=crash_at,
                                **{"trainer.max_steps": 12})

    def forecast_of(trainer):
        return next(c for c in trainer.callbacks if isinstance(c, AmaxSaturationCallback)).forecast

    def logged(trainer):
        rows = csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv")))
        return {(int(r["step"]), k): float(v) for r in rows for k, v in r.items() if k.startswith("forecast/") and v}

    straight = fit(tmp_path / "straight")
    with pytest.raises(SimulatedCrash):
        fit(tmp_path / "run", crash_at=7)
    resumed = fit(tmp_path / "run", "--ckpt_path", "last")
    a, b = forecast_of(straight), forecast_of(resumed)
    assert a.state_dict() == b.state_dict() and a.scored() == b.scored()
    assert any(len(trail) >= 6 for trail in a.trails.values())  # it did forecast
    after = {key: v for key, v in logged(straight).items() if key[0] >= 6}
    assert after and logged(resumed) == {key: v for key, v in after.items() if key in logged(resumed)}
    assert {key for key in after if key[1] == "forecast/at_risk"} <= set(logged(resumed))


def test_the_callback_says_a_new_warning_once_on_one_rank_and_logs_the_risk(caplog):
    import logging

    from callbacks.forecast_log import forecast_metrics
    from callbacks.saturation import AmaxSaturationCallback
    from qat_app.hif8.step_record import StepRecord, StepRow

    # the planted outlier's headroom a_hat / amax = exp(-c (2t - 1)), a little scatter on it, steps 40 .. 79
    headrooms = [math.exp(-2e-4 * (2 * t - 1)) * (1 + (3e-4 if t % 2 else -3e-4)) for t in range(40, 80)]
    for say in (True, False):
        callback = AmaxSaturationCallback()
        callback.forecast, callback._clip_headroom = SaturationForecast(8), {"x": H_CLIP}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="callbacks.saturation"):
            for k, h in enumerate(headrooms):
                stats = StepRecord(40 + k, False, (("x", None),), (StepRow(1.0, h, h, 0, 4096),), {})
                metrics = forecast_metrics(callback.forecast, callback._clip_headroom, stats, True, say)
        lines = [r.getMessage() for r in caplog.records if "saturation forecast" in r.getMessage()]
        assert len(lines) == (1 if say else 0)
        assert callback.forecast.warnings and metrics["forecast/at_risk"] == 1.0 and "forecast/x/slope_per_window" in metrics
    assert lines == []
