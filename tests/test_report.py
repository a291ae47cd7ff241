"""Report arithmetic on hand-made logs, paired statistics, input checks, run-directory discovery, the CLI outputs."""

import csv
import json
import math
import os
import re

import numpy as np

import pytest

from qat_app import report as rp
from qat_app import stats
from tests._report_fixtures import config, make_run, records, write_csv, write_samples

TENSOR = "layers.1.mlp.up_proj.input"


@pytest.fixture
def runs(tmp_path):
    base = tmp_path / "bf16" / "logs" / "version_0" / "metrics.csv"
    write_csv(base, [
        {"step": 0, "train/loss": 2.0},
        {"step": 1, "train/loss": 4.0},
        {"step": 1, "val/arc_challenge/acc": 0.1},  # an earlier evaluation: the last one counts
        {"step": 2, "train/loss": 5.0},
        {"step": 3, "train/loss": 2.5},  # the QAT run has no step 3: not a common step
        {"step": 3, "val/loss": 2.2, "val/arc_challenge/acc": 0.50, "val/hellaswag/acc_norm": 0.40,
         "val/mmlu/anatomy/acc": 0.30, "val/arc_challenge/count": 300},
        {"step": 5, "train/loss": 1.0},  # the last train step of both runs
    ])
    qat_dir = tmp_path / "qat" / "logs" / "version_0"
    per_layer = lambda step, amax, a_hat, frac: {  # noqa: E731
        "step": step, f"amax/{TENSOR}": amax, f"a_hat/{TENSOR}": a_hat, f"sat/{TENSOR}/clipped_frac": frac}
    write_csv(qat_dir / "metrics.csv", [
        {"step": 0, "sat/clipped": 0, "sat/clipped_frac": 0.1, "sat/events": 1},
        per_layer(0, 1.0, 1.0, 0.0),
        {"step": 0, "train/loss": 2.2},          # |2.2 - 2| / 2 = 10 %
        {"step": 1, "train/loss": 2.8},          # two rows of one step: mean 3.0 -> |3 - 4| / 4 = 25 %
        {"step": 1, "train/loss": 3.2},
        {"step": 1, "sat/clipped": 5, "sat/clipped_frac": 0.2, "sat/events": 2},
        per_layer(1, 1.5, 1.0, 0.01),
        {"step": 2, "train/loss": 5.5},          # 10 %
        {"step": 2, "sat/clipped": 0, "sat/clipped_frac": 0.0, "sat/events": 0},
        per_layer(2, 1.2, 1.5, 0.0),
        {"step": 4, "train/loss": 1.0},          # no baseline step 4
        {"step": 4, "val/loss": 2.4, "val/arc_challenge/acc": 0.45, "val/hellaswag/acc_norm": 0.42,
         "val/mmlu/anatomy/acc": 0.27, "val/arc_challenge/count": 100},
        {"step": 5, "train/loss": 1.0},          # 0 %
    ])
    summary = {"quantized_tensors": 2, "clipped": 30, "seen": 1000, "clipped_frac": 0.03, "saturation_events": 7,
               "tensors": {TENSOR: {"clipped": 30, "seen": 500}}}
    (qat_dir / "saturation_summary.json").write_text(json.dumps(summary))
    return tmp_path / "bf16", tmp_path / "qat"


def test_arithmetic_helpers():
    assert rp.relative_drop(0.5, 0.45) == pytest.approx(10.0)
    assert rp.relative_drop(0.4, 0.42) == pytest.approx(-5.0)  # QAT better: negative drop
    assert math.isnan(rp.relative_drop(0.0, 0.3)) and math.isnan(rp.relative_drop(None, 0.3))
    ape, n = rp.loss_ape({0: 2.0, 1: 4.0, 2: 5.0, 3: 1.0}, {0: 2.2, 1: 3.0, 2: 5.5, 5: 9.0})
    assert n == 3 and ape == pytest.approx((10 + 25 + 10) / 3)
    ape, n = rp.loss_ape({0: 2.0, 1: 4.0, 2: 5.0}, {0: 2.2, 1: 3.0, 2: 5.5}, from_step=1)
    assert n == 2 and ape == pytest.approx(17.5)
    ape, n = rp.loss_ape({0: 2.0, 1: float("nan")}, {0: 2.0, 1: 3.0})  # non-finite steps skipped
    assert (ape, n) == (0.0, 1)
    assert rp.loss_ape({0: 1.0}, {1: 1.0}) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_report_numbers(runs, tmp_path):
    base_dir, qat_dir = runs
    report = rp.build_report(base_dir, [qat_dir], tmp_path / "out", labels=["BF16", "HiF8"])
    (result,) = report["qat"]
    assert result["label"] == "HiF8"
    assert result["train_loss_ape_pct"] == pytest.approx(11.25) and result["ape_common_steps"] == 4
    drops = {b["metric"]: b for b in result["benchmarks"]}
    assert drops["val/arc_challenge/acc"]["baseline"] == 0.5  # the last evaluation, not step 1's
    assert drops["val/arc_challenge/acc"]["relative_drop_pct"] == pytest.approx(10.0)
    assert drops["val/hellaswag/acc_norm"]["relative_drop_pct"] == pytest.approx(-5.0)
    assert drops["val/mmlu/anatomy/acc"]["relative_drop_pct"] == pytest.approx(10.0)
    assert "val/arc_challenge/count" not in drops  # a count is not a metric
    # the mean over the main metrics (task acc / acc_norm; per-subject keys and counts are not in it)
    assert result["mean_relative_drop_pct"] == pytest.approx(2.5)
    assert result["final_train_loss"] == 1.0 and result["final_val_loss"] == 2.4
    assert result["saturation"]["events"] == 7 and result["saturation"]["clipped_frac"] == pytest.approx(0.03)
    # no per-example records and no initial evaluation: point values, CI n/a, only the quantization difference
    q = drops["val/arc_challenge/acc"]["comparisons"]["quantization"]
    assert q["difference"] == pytest.approx(-0.05) and q["ci_low"] is None and q["verdict"] == "n/a"
    assert set(drops["val/arc_challenge/acc"]["comparisons"]) == {"quantization"} and report["initial"] is None

    md = (tmp_path / "out" / "results.md").read_text()
    assert "| val/arc_challenge/acc | 0.5000 | 0.4500 | -0.0500 (CI n/a) | – | 10.00 |" in md
    assert "| val/hellaswag/acc_norm | 0.4000 | 0.4200 | +0.0200 (CI n/a) | – | -5.00 |" in md
    assert "initial model: **not available**" in md
    assert "CI n/a: no per-example records (benchmark_samples/val_step*.jsonl)" in md
    assert "no config.yaml" in md  # missing configs: a warning, not a refusal
    assert "11.250 (4)" in md and "| saturation events | 7 |" in md and "3.000e-02" in md
    assert "val/mmlu/anatomy/acc |" not in md and "count" not in md.split("## Training loss")[0].split("Δ = after")[1]
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    by_metric = {(r["metric"], r["comparison"]): r for r in rows}
    assert float(by_metric["train_loss_ape_pct", ""]["value"]) == pytest.approx(11.25)
    assert by_metric["train_loss_ape_pct", ""]["n"] == "4"
    assert float(by_metric["val/arc_challenge/acc", "quantization"]["relative_drop_pct"]) == pytest.approx(10.0)
    assert float(by_metric["saturation_events", ""]["value"]) == 7
    assert not any("count" in r["metric"] for r in rows)
    saved = json.load(open(tmp_path / "out" / "results.json"))
    assert saved["qat"][0]["train_loss_ape_pct"] == pytest.approx(11.25)


def test_saturation_from_csv_without_summary(runs, tmp_path):
    base_dir, qat_dir = runs
    os.remove(qat_dir / "logs" / "version_0" / "saturation_summary.json")
    (result,) = rp.build_report(base_dir, [qat_dir], tmp_path / "out")["qat"]
    assert result["saturation"]["events"] == 3  # 1 + 2 + 0
    assert result["saturation"]["clipped"] == 5
    assert result["saturation"]["clipped_frac"] == pytest.approx(0.1)  # mean of 0.1, 0.2, 0.0


def test_cli_writes_table_and_three_figures(runs, tmp_path, capsys):
    import main as cli

    base_dir, qat_dir = runs
    out = tmp_path / "report"
    cli.main(["report", "--baseline", str(base_dir), "--qat", str(qat_dir), str(qat_dir / "logs" / "version_0"),
              "--labels", "a", "b", "--out", str(out), "--layers", TENSOR])
    printed = capsys.readouterr().out
    assert "val/arc_challenge/acc" in printed
    for name in ("results.md", "results.csv", "results.json", *rp.FIGURES):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for name in rp.FIGURES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    assert "## `a`" in md and "## `b`" in md
    assert "| Metric | baseline | QAT | quantization (baseline → QAT) | n | rel. drop % |" in md


def test_default_layer_selection_and_regex(runs):
    _, qat_dir = runs
    run = rp.load_run(qat_dir)
    assert run.tensors() == [TENSOR]
    assert rp.select_tensors([run], None) == [TENSOR]
    assert rp.select_tensors([run], ["model.layers.1.mlp.up_proj"]) == [TENSOR]  # layer -> its input
    assert rp.select_tensors([run], [r"up_proj\.input$"]) == [TENSOR]
    with pytest.raises(rp.ReportError, match="matches no logged tensor"):
        rp.select_tensors([run], ["layers.99.mlp"])


def test_versions_are_merged_and_later_wins(tmp_path):
    root = tmp_path / "run"
    write_csv(root / "logs" / "version_0" / "metrics.csv", [{"step": 0, "train/loss": 1.0}, {"step": 1, "train/loss": 2.0}])
    write_csv(root / "logs" / "version_1" / "metrics.csv", [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/loss": 4.0}])
    write_csv(root / "logs" / "version_2" / "metrics.csv", [{"step": 2, "test/arc_easy/acc": 0.7}])  # main.py test
    run = rp.load_run(root)
    assert [f.parent.name for f in run.files] == ["version_0", "version_1", "version_2"]
    assert run.series("train/loss") == {0: 1.0, 1: 3.0, 2: 4.0}
    assert run.last("test/arc_easy/acc") == 0.7
    # a version directory alone
    assert rp.load_run(root / "logs" / "version_0").series("train/loss") == {0: 1.0, 1: 2.0}


def test_bad_inputs_name_the_file(tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty_run: no metrics.csv"):
        rp.load_run(empty)
    with pytest.raises(FileNotFoundError, match="nope"):
        rp.load_run(tmp_path / "nope")
    bad = tmp_path / "bad" / "metrics.csv"
    bad.parent.mkdir()
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(rp.ReportError, match=r"bad/metrics.csv: not a Lightning CSVLogger"):
        rp.load_run(bad.parent)
    bad.write_text("step,train/loss\n0,abc\n")
    with pytest.raises(rp.ReportError, match=r"metrics.csv, line 2: column 'train/loss'"):
        rp.load_run(bad.parent)
    two = tmp_path / "two"
    write_csv(two / "a" / "logs" / "version_0" / "metrics.csv", [{"step": 0, "train/loss": 1.0}])
    write_csv(two / "b" / "logs" / "version_0" / "metrics.csv", [{"step": 0, "train/loss": 1.0}])
    with pytest.raises(rp.ReportError, match="several runs"):
        rp.load_run(two)
    good = tmp_path / "good"
    write_csv(good / "metrics.csv", [{"step": 0, "train/loss": 1.0}])
    (good / "saturation_summary.json").write_text("{broken")
    with pytest.raises(rp.ReportError, match="saturation_summary.json"):
        rp.load_run(good)
    assert rp.main(["--baseline", str(empty), "--qat", str(good), "--out", str(tmp_path / "o")]) == 2
    assert "empty_run" in capsys.readouterr().err
    with pytest.raises(rp.ReportError, match="--labels"):
        rp.build_report(good, [good], tmp_path / "o", labels=["a", "b", "c"])


# ------------------------------------------------------------------------------- paired statistics
def _percentile(sorted_values, q):
    """numpy's default (linear) percentile, by hand."""
    pos = q / 100 * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def test_bootstrap_ci_matches_a_plain_loop_with_the_same_indices(monkeypatch):
    monkeypatch.setattr(stats, "INDEX_CHUNK_ELEMENTS", 50 * 300)  # several index chunks
    gen = np.random.default_rng(5)
    before, after = gen.normal(size=50), gen.normal(0.3, 1.0, size=50)  # continuous: the index path
    low, high = stats.paired_bootstrap_ci(before, after, resamples=2000, seed=11)

    rng = np.random.default_rng(11)
    d = [float(a - b) for a, b in zip(after, before)]
    means = []
    while len(means) < 2000:
        rows = rng.integers(0, 50, size=(min(300, 2000 - len(means)), 50))
        for row in rows.tolist():
            means.append(sum(d[i] for i in row) / 50)
    means.sort()
    assert low == pytest.approx(_percentile(means, 2.5), abs=1e-12)
    assert high == pytest.approx(_percentile(means, 97.5), abs=1e-12)


def test_bootstrap_ci_of_accuracies_matches_the_normal_approximation():
    gen = np.random.default_rng(0)
    before = (gen.random(1000) < 0.5).astype(float)
    after = np.where(gen.random(1000) < 0.3, 1 - before, before)  # ~30 % of the pairs flip
    low, high = stats.paired_bootstrap_ci(before, after)  # 0/1 data: the multinomial path
    d = after - before
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert low == pytest.approx(d.mean() - half, abs=3e-3)
    assert high == pytest.approx(d.mean() + half, abs=3e-3)
    assert stats.paired_bootstrap_ci(before, after) == (low, high)  # fixed seed: reproducible


def test_mcnemar_exact():
    assert stats.mcnemar_exact_p(2, 8) == pytest.approx(0.109375)  # 2 * (1 + 10 + 45) / 1024
    assert stats.mcnemar_exact_p(8, 2) == pytest.approx(0.109375)
    assert stats.mcnemar_exact_p(0, 0) == 1.0 and stats.mcnemar_exact_p(5, 5) == 1.0
    assert stats.mcnemar_exact_p(0, 1) == 1.0  # min(1, 2 * 1/2)
    b, c = 3000, 3200  # large n: exact integers against a log-space sum
    m = b + c
    terms = [math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) - m * math.log(2) for k in range(b + 1)]
    top = max(terms)
    expected = 2 * math.exp(top) * sum(math.exp(t - top) for t in terms)
    assert stats.mcnemar_exact_p(b, c) == pytest.approx(expected, rel=1e-9)
    assert stats.discordant_pairs([1, 1, 0, 0, 1], [0, 1, 1, 0, 0]) == (2, 1)
    assert stats.discordant_pairs([0.5], [1]) is None
    assert [stats.verdict(ci) for ci in ((-0.2, -0.01), (-0.01, 0.02), (0.01, 0.2), None)] == [
        "worse", "within noise", "better", "n/a"]


# ------------------------------------------------------------------- initial / baseline / QAT runs
def _correct(n, k):
    return [1] * k + [0] * (n - k)


@pytest.fixture
def paper_runs(tmp_path):
    """ARC 1000 examples: initial 500, baseline 520, QAT 420 correct (QAT clearly worse);
    HellaSwag 300 examples: baseline 150, QAT 149 (one example: within noise)."""
    arc = lambda k, step: records("arc_challenge", _correct(1000, k), step)  # noqa: E731
    hs = lambda k, step: records("hellaswag", _correct(300, k), step)  # noqa: E731
    base = make_run(tmp_path / "base", False, final=arc(520, 3) + hs(150, 3), initial=arc(500, 0) + hs(150, 0))
    qat = make_run(tmp_path / "qat", True, final=arc(420, 3) + hs(149, 3))
    return base, qat


def test_three_columns_and_verdicts(paper_runs, tmp_path):
    base, qat = paper_runs
    report = rp.build_report(base, [qat], tmp_path / "out")
    assert report["baseline"]["label"] == "fp32 baseline"  # named by trainer.precision 32-true
    (result,) = report["qat"]
    assert result["label"] == "qat (HiF8 W8A8, fp32)"
    rows = {b["metric"]: b for b in result["benchmarks"]}
    arc = rows["val/arc_challenge/acc"]
    assert (arc["initial"], arc["baseline"], arc["qat"]) == (0.5, 0.52, 0.42)
    f, q, t = (arc["comparisons"][c] for c in ("forgetting", "quantization", "total"))
    assert f["difference"] == pytest.approx(0.02) and f["verdict"] == "better"
    assert q["difference"] == pytest.approx(-0.10) and q["verdict"] == "worse" and q["n"] == 1000
    assert q["ci_high"] < 0 and q["mcnemar_p"] == pytest.approx(2 / 2**100)
    assert t["difference"] == pytest.approx(-0.08) and t["verdict"] == "worse"
    assert arc["relative_drop_pct"] == pytest.approx((0.52 - 0.42) / 0.52 * 100)
    hs = rows["val/hellaswag/acc_norm"]["comparisons"]["quantization"]
    assert hs["difference"] == pytest.approx(-1 / 300) and hs["verdict"] == "within noise"
    assert hs["ci_low"] < 0 <= hs["ci_high"] and hs["mcnemar_p"] == 1.0 and hs["n"] == 300
    assert rows["val/hellaswag/acc"]["comparisons"]["forgetting"]["verdict"] == "within noise"
    # the mean relative drop is over acc / acc_norm only (the logged counts are not metrics)
    assert not any("count" in k for k in rows)
    drops = [rows[k]["relative_drop_pct"] for k in rows]
    assert result["mean_relative_drop_pct"] == pytest.approx(sum(drops) / 4)
    check = {a["metric"]: a for a in result["arc_check"]}
    assert check["val/arc_challenge/acc_norm"]["drop_gt_1pct"] and check["val/arc_challenge/acc_norm"]["significant"]

    md = (tmp_path / "out" / "results.md").read_text()
    assert ("| Metric | initial | baseline | QAT | forgetting (initial → baseline) | quantization (baseline → QAT) "
            "| total (initial → QAT) | n | rel. drop % |") in md
    line = next(x for x in md.splitlines() if x.startswith("| val/arc_challenge/acc |"))
    assert line.count("**worse**") == 2 and "**better**" in line and "| 1000 |" in line
    line = next(x for x in md.splitlines() if x.startswith("| val/hellaswag/acc_norm |"))
    assert "-0.0033 [" in line and "**within noise**" in line
    assert "paired bootstrap 95% CI" in md and "10000 resamples, seed 0" in md and "within noise" in md
    assert "initial model: the baseline's step-0 validation" in md
    assert "count" not in md
    rows_csv = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    arc_rows = {r["comparison"]: r for r in rows_csv if r["metric"] == "val/arc_challenge/acc"}
    assert set(arc_rows) == {"forgetting", "quantization", "total"} and arc_rows["quantization"]["verdict"] == "worse"
    saved = json.load(open(tmp_path / "out" / "results.json"))
    assert saved["ci"]["resamples"] == 10000 and saved["initial"]["benchmarks"]["val/arc_challenge/acc"] == 0.5


def test_intersection_of_examples_and_missing_records(tmp_path):
    base = make_run(tmp_path / "base", False, final=records("arc_challenge", _correct(300, 150), 3))
    qat = make_run(tmp_path / "qat", True, final=records("arc_challenge", _correct(280, 140), 3))  # 20 fewer
    report = rp.build_report(base, [qat], tmp_path / "out")
    q = report["qat"][0]["benchmarks"][0]["comparisons"]["quantization"]
    assert (q["n"], q["n_from"], q["n_to"]) == (280, 300, 280)
    assert q["difference"] == pytest.approx(140 / 280 - 150 / 280)  # over the common 280 examples
    assert "280 (of 300 / 280)" in (tmp_path / "out" / "results.md").read_text()
    # per-example records missing for the QAT run: point values, CI n/a, and why
    qat2 = make_run(tmp_path / "qat2", True, final=records("arc_challenge", _correct(300, 140), 3), samples=False)
    report = rp.build_report(base, [qat2], tmp_path / "out2")
    q = report["qat"][0]["benchmarks"][0]["comparisons"]["quantization"]
    assert q["ci_low"] is None and q["verdict"] == "n/a" and q["difference"] == pytest.approx(-10 / 300)
    md = (tmp_path / "out2" / "results.md").read_text()
    assert f"CI n/a: no per-example records (benchmark_samples/val_step*.jsonl) in {tmp_path / 'qat2'}" in md
    assert "initial model: **not available**" in md and "forgetting" not in md


def test_initial_from_a_separate_run(paper_runs, tmp_path):
    base, qat = paper_runs
    initial = make_run(tmp_path / "pretrained", False, final=records("arc_challenge", _correct(1000, 480), 0)
                       + records("hellaswag", _correct(300, 150), 0), last_step=1)
    report = rp.build_report(base, [qat], tmp_path / "out", initial_dir=initial)
    arc = {b["metric"]: b for b in report["qat"][0]["benchmarks"]}["val/arc_challenge/acc"]
    assert arc["initial"] == 0.48 and arc["comparisons"]["forgetting"]["difference"] == pytest.approx(0.04)
    assert report["initial"]["source"].startswith(f"--initial {initial}")


def test_mmlu_subjects_and_categories_from_records():
    recs = {(r["task"], r["subject"] or "", r["doc_id"]): r
            for r in records("mmlu", [1, 0, 1], 0, subject="anatomy") + records("mmlu", [0, 0], 0, subject="marketing")
            + records("arc_challenge", [1], 0)}
    assert sorted(rp.example_values(recs, "val/mmlu/acc").values()) == [0, 0, 0, 1, 1]
    assert list(rp.example_values(recs, "val/mmlu/anatomy/acc").values()) == [1, 0, 1]
    assert list(rp.example_values(recs, "val/mmlu_stem/acc").values()) == [1, 0, 1]  # anatomy is STEM
    assert list(rp.example_values(recs, "val/mmlu_other/acc").values()) == [0, 0]  # marketing: other
    assert rp.is_main_metric("val/mmlu/acc") and not rp.is_main_metric("val/mmlu_stem/acc")
    assert not rp.is_main_metric("val/mmlu/anatomy/acc") and not rp.is_main_metric("val/arc_challenge/count")


# ---------------------------------------------------------------------------------------- checks
def test_only_what_changes_the_numbers_must_match(tmp_path):
    """A baseline without a checkpoint callback, with other loggers, progress and logging interval, pairs with a
    QAT run that has them; the seed, the precision or the steps' arithmetic do not."""
    arc = records("arc_challenge", _correct(100, 50), 3)
    bare = config(tmp_path / "base", False)
    bare["trainer"].update(callbacks=[], logger=False, enable_progress_bar=False, log_every_n_steps=1)
    bare["data"] = {"init_args": {"seq_len": 128, "benchmarks": {"init_args": {"limit": 20}}}}
    full = config(tmp_path / "qat", True)
    full["data"] = {"init_args": {"seq_len": 128, "benchmarks": {"init_args": {"limit": 40}}}}
    base = make_run(tmp_path / "base", False, final=arc, cfg=bare)
    qat = make_run(tmp_path / "qat", True, final=arc, cfg=full)
    assert rp.build_report(base, [qat], tmp_path / "out")["warnings"] == []
    for field, value in (("seed_everything", 7), ("trainer.precision", "bf16-mixed"),
                         ("trainer.accumulate_grad_batches", 4), ("model.dtype", "bfloat16")):
        other = make_run(tmp_path / field, True, final=arc, cfg=config(tmp_path / field, True, **{field: value}))
        with pytest.raises(rp.ReportError, match=re.escape(field)):
            rp.build_report(base, [other], tmp_path / "out")


def test_a_run_saved_with_the_lm_limit_on_the_trainer_pairs_with_one_saved_with_it_on_the_data(tmp_path):
    """Runs saved before the LM validation's limit moved to the data (``trainer.limit_val_batches: 50``) pair with
    runs saved after (``data.init_args.limit_val_batches: 50``); a different limit does not."""
    arc = records("arc_challenge", _correct(100, 50), 3)
    before = config(tmp_path / "base", False, **{"trainer.limit_val_batches": 50})
    base = make_run(tmp_path / "base", False, final=arc, cfg=before)
    for name, limit, pairs in (("same", 50, True), ("other", 20, False)):
        after = config(tmp_path / name, True, **{"trainer.limit_val_batches": None})
        after["data"] = {"init_args": {"limit_val_batches": limit}}
        qat = make_run(tmp_path / name, True, final=arc, cfg=after)
        if pairs:
            assert rp.build_report(base, [qat], tmp_path / "out")["warnings"] == []
        else:
            with pytest.raises(rp.ReportError, match=r"data\.init_args\.limit_val_batches: 50 vs 20"):
                rp.build_report(base, [qat], tmp_path / "out")


def test_config_mismatch_is_refused_and_force_warns(tmp_path, capsys):
    arc = records("arc_challenge", _correct(100, 50), 3)
    base = make_run(tmp_path / "base", False, final=arc)
    qat = make_run(tmp_path / "qat", True, final=arc, cfg=config(tmp_path / "qat", True, **{"model.lr": 1e-4}))
    with pytest.raises(rp.ReportError) as err:
        rp.build_report(base, [qat], tmp_path / "out")
    message = str(err.value)
    assert str(tmp_path / "base" / "logs" / "version_0" / "config.yaml") in message
    assert str(tmp_path / "qat" / "logs" / "version_0" / "config.yaml") in message
    assert "model.lr: 1e-05 vs 0.0001" in message and "--force" in message
    for allowed in ("model.quant", "warmup", "save_dir", "dirpath", "default_root_dir"):
        assert allowed not in message  # quantization settings and paths may differ
    report = rp.build_report(base, [qat], tmp_path / "out", force=True)
    assert any("model.lr" in w for w in report["warnings"])
    assert "> **warning:** forced (--force)" in (tmp_path / "out" / "results.md").read_text()
    assert rp.main(["--baseline", str(base), "--qat", str(qat), "--out", str(tmp_path / "o")]) == 2
    assert "model.lr" in capsys.readouterr().err
    assert rp.main(["--baseline", str(base), "--qat", str(qat), "--out", str(tmp_path / "o"), "--force"]) == 0


def test_seed_and_step_mismatches_are_refused(tmp_path):
    arc = records("arc_challenge", _correct(100, 50), 3)
    base = make_run(tmp_path / "base", False, final=arc)
    seeded = make_run(tmp_path / "seed", True, final=arc, cfg=config(tmp_path / "seed", True, seed_everything=1))
    with pytest.raises(rp.ReportError, match="seed_everything: 1234 vs 1"):
        rp.build_report(base, [seeded], tmp_path / "out")
    steps = make_run(tmp_path / "steps", True, final=arc, cfg=config(tmp_path / "steps", True, **{"trainer.max_steps": 8}))
    with pytest.raises(rp.ReportError, match="trainer.max_steps: 4 vs 8"):
        rp.build_report(base, [steps], tmp_path / "out")
    short = make_run(tmp_path / "short", True, final=records("arc_challenge", _correct(100, 50), 2), last_step=3)
    with pytest.raises(rp.ReportError, match="last logged train step: 3 vs 2"):
        rp.build_report(base, [short], tmp_path / "out")
    no_config = make_run(tmp_path / "nocfg", True, final=arc, cfg=False)
    report = rp.build_report(base, [no_config], tmp_path / "out")  # warned, not refused
    assert any("no config.yaml" in w for w in report["warnings"])


def test_flatten_and_labels(tmp_path):
    assert rp.flatten({"a": {"b": [1, {"c": 2}], "d": {}}, "e": None}) == {"a.b.0": 1, "a.b.1.c": 2, "a.d": {}, "e": None}
    run = rp.load_run(make_run(tmp_path / "bf", True, final=None, cfg=config(tmp_path / "bf", True, **{"trainer.precision": "bf16-mixed"})))
    assert rp.precision_name(run) == "BF16" and rp.warmup_switch_step(run) == 2
    off = rp.load_run(make_run(tmp_path / "off", False, final=None, cfg=config(tmp_path / "off", False, **{"warmup.warmup_steps": 5})))
    assert rp.precision_name(off) == "fp32" and rp.warmup_switch_step(off) is None  # unquantized: no switch


# --------------------------------------------------------------------------- saturation, figures
def test_saturation_with_the_new_summary_keys(runs, tmp_path):
    base_dir, qat_dir = runs
    path = qat_dir / "logs" / "version_0" / "saturation_summary.json"
    summary = json.loads(path.read_text())
    summary.update(first_clipped_step=1, min_headroom=0.8125, tensors_clipped=[TENSOR], quantized_steps=3)
    path.write_text(json.dumps(summary))
    (result,) = rp.build_report(base_dir, [qat_dir], tmp_path / "out")["qat"]
    s = result["saturation"]
    assert (s["clipped"], s["seen"], s["events"], s["first_clipped_step"], s["min_headroom"]) == (30, 1000, 7, 1, 0.8125)
    assert s["tensors_clipped"] == [TENSOR] and s["layers_clipped"] == 1 and s["quantized_steps"] == 3
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| min headroom (a_hat / amax) | 0.8125 |" in md and "| quantized steps | 3 |" in md
    assert f"tensors that clipped (1): `{TENSOR}`" in md


def test_figures_mark_the_warmup_and_start_a_hat_at_its_first_estimate(tmp_path):
    root = tmp_path / "qat"
    version = root / "logs" / "version_0"
    rows = [{"step": s, "train/loss": 3.0} for s in range(4)]
    for s, (amax, a_hat, frac) in enumerate([(1.0, 0.0, 0.0), (1.1, 0.0, 0.0), (1.2, 1.1, 0.01), (1.0, 1.2, 0.0)]):
        rows.append({"step": s, f"amax/{TENSOR}": amax, f"a_hat/{TENSOR}": a_hat, f"sat/{TENSOR}/clipped_frac": frac,
                     f"sat/{TENSOR.replace('input', 'weight')}/clipped_frac": 0.0})
    write_csv(version / "metrics.csv", rows)
    (version / "config.yaml").write_text(__import__("yaml").safe_dump(config(root, True)))  # warmup 2 steps
    base = make_run(tmp_path / "base", False, final=None)
    run = rp.load_run(root)
    assert rp.warmup_switch_step(run) == 2
    assert rp.a_hat_points(run, TENSOR) == {2: 1.1, 3: 1.2}  # no ramp from 0 during the warmup
    assert rp.clipped_steps(run, TENSOR) == [2]
    report = rp.build_report(base, [root], tmp_path / "out", layers=[TENSOR])
    for name in rp.FIGURES:
        assert report["figures"][name]["warmup_lines"] == [2], name
        assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_test_stage_records_of_a_later_version(tmp_path):
    """``main.py test`` after fit writes version_1 with test/* metrics and test_step*.jsonl: compared too."""
    dirs = []
    for name, k in (("base", 60), ("qat", 30)):
        root = make_run(tmp_path / name, name == "qat", final=None)
        version = root / "logs" / "version_1"
        recs = records("arc_challenge", _correct(100, k), 3)
        write_samples(version, "test", 3, recs)
        write_csv(version / "metrics.csv", [{"step": 3, "test/arc_challenge/acc": k / 100}])
        dirs.append(root)
    report = rp.build_report(dirs[0], [dirs[1]], tmp_path / "out")
    row = {b["metric"]: b for b in report["qat"][0]["benchmarks"]}["test/arc_challenge/acc"]
    q = row["comparisons"]["quantization"]
    assert (row["baseline"], row["qat"], q["n"], q["verdict"]) == (0.6, 0.3, 100, "worse")


def test_quantized_modules_per_run(paper_runs, tmp_path, tiny_llama):
    """Each QAT run's quantized_modules.json: the count and the high-precision blocks; an older run without it
    still reports, and says so."""
    from qat_app.config import QuantConfig, quantize_model
    from qat_app.hif8.inventory import INVENTORY_FILE, quantization_inventory

    base, qat = paper_runs
    quant = QuantConfig(high_precision_layers=3, fused="off")
    quantize_model(tiny_llama, quant)  # blocks 0-1 and 3 of 4 stay in high precision
    (qat / "logs" / "version_0" / INVENTORY_FILE).write_text(json.dumps(quantization_inventory(tiny_llama, quant.selection)))
    older = make_run(tmp_path / "older", True, final=records("arc_challenge", _correct(1000, 420), 3))
    report = rp.build_report(base, [qat, older], tmp_path / "out", labels=["new", "old"])
    new, old = report["qat"]
    assert new["quantized_modules"]["quantized_modules"] == 3 and new["quantized_modules"]["high_precision_blocks"] == [0, 1, 3]
    assert old["quantized_modules"] is None
    md = (tmp_path / "out" / "results.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("- QAT `new`"))
    assert "3 quantized modules, high-precision blocks 0-1, 3" in line
    line = next(x for x in md.splitlines() if x.startswith("- QAT `old`"))
    assert f"quantized modules not recorded (no {INVENTORY_FILE}" in line
    rows = {(r["run"], r["metric"]): r["value"] for r in csv.DictReader(open(tmp_path / "out" / "results.csv"))}
    assert rows["new", "quantized_modules"] == "3" and rows["new", "high_precision_blocks"] == "3"
    assert ("old", "quantized_modules") not in rows
