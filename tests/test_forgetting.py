"""ForgettingMonitor: the decision rule and its false-alarm control, bad settings, and three tiny fits through
main.py (a destructive learning rate that alarms and stops, its resume from the stop checkpoint, and an
unchanged model that stays silent over 5 validations)."""

from __future__ import annotations

import csv
import logging
import math
import os
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pytest

import main as cli
from callbacks import ForgettingMonitor, InitialEvaluationCallback
from callbacks.forgetting import DEFAULT_MEASURES, INITIAL_FILE, is_alarm, look_alpha, planned_validations, sha256
from qat_app.stats import corrected, t_quantile
from qat_app import stats
from qat_app.errors import QATError
from tests._cli_runs import TINY_BENCHMARKS, write_config

BENCHMARKS = TINY_BENCHMARKS


# ------------------------------------------------------------------------------------------ the rule
def _trainer(**kw):
    base = dict(max_steps=10, accumulate_grad_batches=2, val_check_batch=4, check_val_every_n_epoch=None,
                num_training_batches=float("inf"), max_epochs=None)
    return SimpleNamespace(**{**base, **kw})


def test_planned_validations_counts_the_looks():
    assert planned_validations(_trainer()) == 5  # 20 batches / 4
    assert planned_validations(_trainer(val_check_batch=6)) == 4  # 20 / 6: a last partial interval counts
    assert planned_validations(_trainer(accumulate_grad_batches=1, val_check_batch=10)) == 1
    # epochs of 8 batches, 2 checks an epoch, every 2nd epoch: 20 batches = 3 epochs -> 1 epoch validates
    assert planned_validations(_trainer(check_val_every_n_epoch=2, num_training_batches=8, val_check_batch=4)) == 2
    assert planned_validations(_trainer(check_val_every_n_epoch=1, num_training_batches=8, val_check_batch=4)) == 6
    # unknowable: no max_steps over an unsized stream, time-based validation
    assert planned_validations(_trainer(max_steps=-1)) is None
    assert planned_validations(_trainer(val_check_batch=None)) is None


def test_bonferroni_level_arithmetic():
    # 5 planned validations x 2 tasks x 2 measures at a family-wise 0.05: each test one-sided at 0.0025
    alpha = look_alpha(0.05, look=3, planned=5, pairs=4)
    assert alpha == pytest.approx(0.0025)
    assert look_alpha(0.05, look=1, planned=5, pairs=4) == alpha  # the same at every look
    # the interval used: two-sided at 1 - 2 alpha, so the worse tail holds alpha
    # (Student-t at examples - 1 = 5 degrees of freedom; clusters - 1 with clusters)
    r = stats.clustered_mean([0.1, -0.3, 0.2, -0.4, 0.0, -0.2])
    c = corrected(r, alpha)
    q = t_quantile(1 - alpha, 5)
    assert c.low == pytest.approx(r.difference - q * r.se) and c.high == pytest.approx(r.difference + q * r.se)
    assert c.level == pytest.approx(0.995) and c.difference == r.difference
    clustered = corrected(stats.clustered_mean([0.1, -0.3, 0.2, -0.4, 0.0, -0.2], ["a", "a", "b", "b", "c", "c"]), alpha)
    assert clustered.high - clustered.difference == pytest.approx(t_quantile(1 - alpha, 2) * clustered.se)
    # no count (forget/kl, given as an interval): the normal quantile
    kl = corrected(stats.PairedResult(0.2, 0.01, 0.18, 0.22, 0, 0, math.nan), alpha)
    assert kl.low == pytest.approx(0.2 - NormalDist().inv_cdf(1 - alpha) * 0.01)


@pytest.mark.parametrize("p,df,expected", [  # scipy.stats.t.ppf
    (0.975, 1, 12.706204736174694), (0.975, 2, 4.302652729749462), (0.975, 5, 2.5705818356363146),
    (0.9999, 3, 22.203742273205), (0.999999, 8, 12.109834665510558), (0.9975, 59, 2.916439807123411),
    (0.9975, 299, 2.828018476308891)])
def test_t_quantile(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, rel=1e-9)
    # without a plan, alpha spending: level / (j (j+1) pairs) sums to at most level over any number of looks
    spent = sum(look_alpha(0.05, look=j, planned=None, pairs=4) * 4 for j in range(1, 10_000))
    assert spent <= 0.05 and spent == pytest.approx(0.05, rel=1e-3)


def _alarms(rng, looks, tasks, measures, n, shift=0.0, alpha=None):
    """Did any of ``looks`` x ``tasks`` x ``measures`` paired tests alarm, for paired noise (+ ``shift``)?"""
    alpha = look_alpha(0.05, 1, looks, tasks * measures) if alpha is None else alpha
    for _ in range(looks):
        for _ in range(tasks * measures):
            before = rng.normal(0.5, 0.2, n)
            after = before + rng.normal(shift, 0.1, n)
            if is_alarm("p_gold_norm", corrected(stats.paired_difference(before, after), alpha)):
                return True
    return False


def test_synthetic_null_keeps_the_family_wise_rate():
    """200 seeded runs of paired noise (no forgetting), 5 looks x 2 tasks x 2 measures: runs with any alarm
    <= level + 3 SE; an uncorrected 95 % interval at every look would alarm in far more; a real fall alarms."""
    runs, level = 200, 0.05
    rate = np.mean([_alarms(np.random.default_rng(seed), 5, 2, 2, 60) for seed in range(runs)])
    assert rate <= level + 3 * math.sqrt(level * (1 - level) / runs)
    naive = np.mean([_alarms(np.random.default_rng(seed), 5, 2, 2, 60, alpha=0.025) for seed in range(runs)])
    assert naive > 3 * level  # why the correction: 20 looks at 2.5 % each
    power = np.mean([_alarms(np.random.default_rng(seed), 5, 2, 2, 60, shift=-0.08) for seed in range(50)])
    assert power > 0.9


def test_decision_sides_and_budgets():
    worse = stats.paired_difference([0.6] * 4 + [0.5] * 4, [0.5] * 4 + [0.45] * 4)
    assert is_alarm("p_gold_norm", worse) and not is_alarm("brier", worse)  # brier: lower is better
    unchanged = stats.paired_difference([0.5, 0.4, 0.3], [0.5, 0.4, 0.3])
    assert not is_alarm("acc_norm", unchanged)  # an unchanged model: difference 0, never an alarm
    drift = stats.clustered_mean([0.2, 0.3, 0.25, 0.22])
    assert is_alarm("kl_choices", drift, budget=0.1) and not is_alarm("kl_choices", drift, budget=0.5)
    assert not is_alarm("kl_choices", drift)  # no budget, no alarm


# ------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("kwargs,pattern", [
    ({"measures": ["acc_nrom"]}, r"forgetting\.measures: unknown measure 'acc_nrom' \(did you mean acc_norm\?\)"),
    ({"level": 0}, r"forgetting\.level: .* must lie in \(0, 1\), got 0"),
    ({"level": 1.0}, r"forgetting\.level: .* must lie in \(0, 1\), got 1\.0"),
    ({"kl_budget": -0.1}, r"forgetting\.kl_budget: must be a number >= 0"),
    ({"kl_choices_budget": float("nan")}, r"forgetting\.kl_choices_budget: must be a number >= 0"),
    ({"action": "halt"}, r"forgetting\.action: unknown action 'halt'; allowed: warn, stop"),
    ({"kl_budget_part": "drfit"}, r"forgetting\.kl_budget_part: unknown part 'drfit' \(did you mean drift\?\); "
                                  r"allowed: drift, total"),
])
def test_bad_settings_name_the_field(kwargs, pattern):
    with pytest.raises(QATError, match=pattern):
        ForgettingMonitor(**kwargs)


def test_the_kl_budget_bounds_the_drift_by_default_and_the_total_when_asked(caplog):
    """forget/kl also holds what HiF8 changes (there from the first QAT step at any lr): the budget bounds the
    drift; without the parts it falls back to forget/kl, said once."""
    parts = {"forget/kl": 0.05, "forget/kl_low": 0.04, "forget/kl_high": 0.06, "forget/kl_drift": 0.01,
             "forget/kl_drift_low": 0.008, "forget/kl_drift_high": 0.012}
    monitor = ForgettingMonitor(kl_budget=0.03)
    assert monitor.kl_budget_part == "drift" and monitor.budgeted_kl(parts) == (0.01, 0.008, 0.012)
    assert ForgettingMonitor(kl_budget=0.03, kl_budget_part="total").budgeted_kl(parts) == (0.05, 0.04, 0.06)
    total_only = {k: v for k, v in parts.items() if "drift" not in k}
    with caplog.at_level(logging.INFO, logger="callbacks.forgetting"):
        assert monitor.budgeted_kl(total_only) == (0.05, 0.04, 0.06)
        assert monitor.budgeted_kl(total_only) == (0.05, 0.04, 0.06)
    assert sum("initial_eval.kl_parts false" in r.getMessage() for r in caplog.records) == 1
    assert monitor.budgeted_kl({}) is None


def test_defaults_and_when_it_runs():
    monitor = ForgettingMonitor()
    assert monitor.measures == list(DEFAULT_MEASURES) == ["acc_norm", "p_gold_norm"] and monitor.level == 0.05
    assert ForgettingMonitor(kl_choices_budget=0.05).measures == ["acc_norm", "p_gold_norm", "kl_choices"]
    bench = SimpleNamespace(benchmarks=SimpleNamespace(task_names=["arc_challenge", "mmlu"]))
    none = SimpleNamespace(benchmarks=None)
    on, off = InitialEvaluationCallback(enabled=True), InitialEvaluationCallback(enabled=False)
    assert monitor.check(on, bench) is True
    assert monitor.check(off, bench) is False and monitor.check(on, none) is False  # by default: silently off
    assert monitor.check(on, bench, limit_val_batches=0) is False
    assert ForgettingMonitor(enabled=False).check(on, bench) is False
    with pytest.raises(QATError, match=r"forgetting\.enabled: true compares with the initial evaluation, but "
                                       r"initial_eval\.enabled is false"):
        ForgettingMonitor(enabled=True).check(off, bench)
    with pytest.raises(QATError, match=r"forgetting\.enabled: true needs benchmarks"):
        ForgettingMonitor(enabled=True).check(on, none)
    with pytest.raises(QATError, match=r"forgetting\.tasks: unknown task 'arc_challeng' \(did you mean "
                                       r"arc_challenge\?\); evaluated tasks: arc_challenge, mmlu"):
        ForgettingMonitor(tasks=["arc_challeng"]).check(on, bench)


def test_resume_without_the_initial_records_turns_the_monitor_off(tmp_path, caplog):
    trainer = _trainer(loggers=[SimpleNamespace(root_dir=str(tmp_path / "logs"))],
                       log_dir=str(tmp_path / "logs" / "version_1"))
    gone = str(tmp_path / "logs" / "version_0" / "benchmark_samples" / INITIAL_FILE)
    monitor = ForgettingMonitor()
    monitor.load_state_dict({"initial_records": gone, "initial_sha256": "0" * 64, "looks": 2})
    with caplog.at_level(logging.WARNING):
        assert monitor._load_initial(trainer, trainer.log_dir) is False
    assert f"the initial records {gone} are missing" in caplog.text and monitor.looks == 2
    # found under the logger root (the run moved), but changed since step 0: named, and off
    moved = tmp_path / "logs" / "version_0" / "benchmark_samples" / INITIAL_FILE
    moved.parent.mkdir(parents=True)
    moved.write_text('{"task": "arc_challenge", "doc_id": 0}\n')
    monitor.load_state_dict({"initial_records": str(tmp_path / "elsewhere.jsonl"), "initial_sha256": sha256(moved)})
    assert monitor._load_initial(trainer, trainer.log_dir) is True and monitor.initial_path == str(moved)
    moved.write_text('{"task": "arc_challenge", "doc_id": 1}\n')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert monitor._load_initial(trainer, trainer.log_dir) is False
    assert str(moved) in caplog.text and "changed" in caplog.text


# ------------------------------------------------------------------------------------------ tiny fits
def _metrics(log_dir: str) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))):
        by_step.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return by_step


def _fit(tmp_path, model_dir, corpus, *args, **overrides):
    config = write_config(tmp_path, model_dir, corpus, **{"data.init_args.benchmarks": BENCHMARKS,
                                                          "warmup.warmup_steps": 0, **overrides})
    return cli.cli_main(["fit", "--config", config, *args]).trainer


def _monitor(trainer) -> ForgettingMonitor:
    return next(c for c in trainer.callbacks if isinstance(c, ForgettingMonitor))


@pytest.mark.slow
def test_destructive_learning_rate_alarms_stops_and_resumes(tmp_path, tiny_model_dir, tiny_corpus, caplog, capsys):
    """lr 0.1 with a validation every 2 of 6 steps: the first look alarms, the stop checkpoint resumes, and the
    resumed run (a new logger version) keeps comparing with the original step-0 records."""
    with caplog.at_level(logging.WARNING, logger="callbacks.forgetting"):
        trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, **{
            "model.lr": 0.1, "trainer.val_check_interval": 4, "trainer.max_steps": 6,
            "forgetting": {"action": "stop", "kl_choices_budget": 0.001}})
    monitor = _monitor(trainer)
    assert monitor.planned == 3 and monitor.looks == 1 and trainer.global_step == 2
    assert monitor.alarms and {a["step"] for a in monitor.alarms} == {2}
    alarm = next(r.getMessage() for r in caplog.records if "forgetting:" in r.getMessage() and " at step 2:" in r.getMessage())
    assert "learning rate" in alarm and "family-wise false-alarm rate 0.05" in alarm and "forget/" in alarm
    stop = os.path.join(str(tmp_path / "ckpt"), "forgetting-stop-step=2.ckpt")
    assert monitor.stop_checkpoint == stop and os.path.exists(stop)
    config = os.path.join(trainer.log_dir, "config.yaml")
    assert f"python main.py fit --config {config} --ckpt_path {stop}" in capsys.readouterr().out
    first = _metrics(trainer.log_dir)
    logged = {k for row in first.values() for k in row if k.startswith("forget/")}
    for task in ("arc_challenge", "mmlu"):
        for measure in ("acc_norm", "p_gold_norm", "kl_choices"):
            assert {f"forget/{task}/{measure}", f"forget/{task}/{measure}_low", f"forget/{task}/{measure}_high"} <= logged
    row = next(r for r in first.values() if "forget/mmlu/acc_norm" in r)
    assert row["forget/mmlu/acc_norm_low"] <= row["forget/mmlu/acc_norm"] <= row["forget/mmlu/acc_norm_high"]
    initial = monitor.initial_path
    assert initial == os.path.join(trainer.log_dir, "benchmark_samples", INITIAL_FILE)

    resumed = cli.cli_main(["fit", "--config", config, "--ckpt_path", stop, "--forgetting.action", "warn"]).trainer
    again = _monitor(resumed)
    assert resumed.global_step == 6 and resumed.log_dir != trainer.log_dir  # a new logger version
    assert not os.path.exists(os.path.join(resumed.log_dir, "benchmark_samples", INITIAL_FILE))  # no step-0 pass
    assert again.initial_path == initial and again.looks == 3 and again.planned == 3
    later = _metrics(resumed.log_dir)
    assert sum("forget/arc_challenge/acc_norm" in r for r in later.values()) == 2
    summary = next(c for c in resumed.callbacks if type(c).__name__ == "RunSummaryCallback").text
    assert "forgetting    initial -> final (step 6)" in summary and "p_gold_norm" in summary


@pytest.mark.slow
def test_an_unchanged_model_stays_silent_over_many_validations(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    """lr 1e-30 without quantization leaves every weight as it was (float32 absorbs the update): 5 looks, every
    difference exactly 0, no alarm, also with a zero KL budget."""
    with caplog.at_level(logging.WARNING, logger="callbacks.forgetting"):
        trainer = _fit(tmp_path, tiny_model_dir, tiny_corpus, **{
            "model.lr": 1e-30, "model.quant.enabled": False, "trainer.val_check_interval": 2,
            "trainer.max_steps": 5, "trainer.callbacks": [],  # (the shared config's PhaseRecorder needs quantization)
            "forgetting": {"kl_choices_budget": 0.0, "action": "stop"}})
    monitor = _monitor(trainer)
    assert trainer.global_step == 5 and monitor.planned == 5 and monitor.looks == 5
    assert monitor.alarms == [] and "forgetting:" not in caplog.text
    rows = [r for r in _metrics(trainer.log_dir).values() if "forget/arc_challenge/acc_norm" in r]
    assert len(rows) == 5
    for r in rows:
        assert all(v == 0.0 for k, v in r.items() if k.startswith("forget/") and not k.startswith("forget/kl"))
    summary = next(c for c in trainer.callbacks if type(c).__name__ == "RunSummaryCallback").text
    assert "within noise" in summary and "worse" not in summary
