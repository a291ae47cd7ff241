"""Report arithmetic on hand-made logs, run-directory discovery, and the CLI outputs."""

import csv
import json
import math
import os

import pytest

from qat_app import report as rp

TENSOR = "layers.1.mlp.up_proj.input"


def write_csv(path, rows):
    """Rows as dicts -> a CSVLogger-like file (union of keys as the header, empty cells for missing)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


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
         "val/mmlu/anatomy/acc": 0.30},
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
         "val/mmlu/anatomy/acc": 0.27},
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
    assert result["train_loss_ape_pct"] == pytest.approx(15.0) and result["ape_common_steps"] == 3
    drops = {b["metric"]: b for b in result["benchmarks"]}
    assert drops["val/arc_challenge/acc"]["baseline"] == 0.5  # the last evaluation, not step 1's
    assert drops["val/arc_challenge/acc"]["relative_drop_pct"] == pytest.approx(10.0)
    assert drops["val/hellaswag/acc_norm"]["relative_drop_pct"] == pytest.approx(-5.0)
    assert drops["val/mmlu/anatomy/acc"]["relative_drop_pct"] == pytest.approx(10.0)
    # the mean over the main-table metrics (per-subject keys are CSV-only)
    assert result["mean_relative_drop_pct"] == pytest.approx(2.5)
    assert result["final_train_loss"] == 1.0 and result["final_val_loss"] == 2.4
    assert result["saturation"]["events"] == 7 and result["saturation"]["clipped_frac"] == pytest.approx(0.03)

    md = (tmp_path / "out" / "results.md").read_text()
    assert "| val/arc_challenge/acc | 0.5000 | 0.4500 | 10.00 |" in md
    assert "| val/hellaswag/acc_norm | 0.4000 | 0.4200 | -5.00 |" in md
    assert "15.000 (3)" in md and "| saturation events | – | 7 |" in md and "3.000e-02" in md
    assert "val/mmlu/anatomy/acc |" not in md
    rows = list(csv.DictReader(open(tmp_path / "out" / "results.csv")))
    by_metric = {r["metric"]: r for r in rows}
    assert float(by_metric["train_loss_ape_pct"]["qat"]) == pytest.approx(15.0)
    assert by_metric["train_loss_ape_pct"]["n"] == "3"
    assert float(by_metric["val/arc_challenge/acc"]["relative_drop_pct"]) == pytest.approx(10.0)
    assert float(by_metric["saturation_events"]["qat"]) == 7
    saved = json.load(open(tmp_path / "out" / "results.json"))
    assert saved["qat"][0]["train_loss_ape_pct"] == pytest.approx(15.0)


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
    assert "| Metric | BF16 baseline | a | Δ % | b | Δ % |" in md


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


def test_bad_inputs_name_the_file(tmp_path):
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
    with pytest.raises(SystemExit, match="empty_run"):
        rp.main(["--baseline", str(empty), "--qat", str(good), "--out", str(tmp_path / "o")])
    with pytest.raises(rp.ReportError, match="--labels"):
        rp.build_report(good, [good], tmp_path / "o", labels=["a", "b", "c"])
