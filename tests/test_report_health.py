"""The report's what-if and numeric-health parts on synthetic runs (tests/_health_fixtures.py): the totals against
the files' own numbers (summed here from metrics.csv and saturation_summary.json), the worst-first order, the tensor
order of the heat map, the tier means, the figures as PNGs, and runs without the new keys ("not recorded")."""

from __future__ import annotations

import csv
import json
import math
import struct

import pytest

from qat_app import report as rp
from qat_app.hif8.health import TIERS, WHATIF_ALGOS
from qat_app.report.health import NOT_RECORDED, TOP_TENSORS, health_stats, tensor_order, whatif_stats, worst_first
from qat_app.report.health_figures import HEALTH_FIGURES, sqnr_matrix, tier_fractions
from tests._health_fixtures import MODULES, OPERANDS, USED, make_health_run, tensor_names
from tests._report_fixtures import make_run

STEPS = 30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DPI = 120  # the report's figures are saved at this resolution, with their figure size as given (no tight bbox)


def metrics_rows(root) -> list[dict[str, str]]:
    with open(root / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def column_sum(rows, column: str) -> int:
    return int(sum(float(r[column]) for r in rows if r.get(column)))


def column_by_step(rows, column: str) -> dict[int, float]:
    return {int(r["step"]): float(r[column]) for r in rows if r.get(column)}


def summary_of(root) -> dict:
    return json.loads((root / "logs" / "version_0" / "saturation_summary.json").read_text())


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def csv_scalars(out) -> dict[tuple[str, str], str]:
    return {(r["run"], r["metric"]): r["value"] for r in csv.DictReader(open(out / "results.csv"))}


@pytest.fixture
def base(tmp_path):
    return make_run(tmp_path / "base", False, final=None, last_step=STEPS)


# --------------------------------------------------------------------------- what-if
def test_whatif_totals_are_the_summary_values_and_the_csv_sums(base, tmp_path):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=3)
    out = tmp_path / "out"
    (result,) = rp.build_report(base, [qat], out, labels=["BF16", "qat"])["qat"]
    summary, rows = summary_of(qat), metrics_rows(qat)
    whatif = result["whatif"]
    assert whatif["recorded"] and whatif["estimator_used"] == USED and whatif["source"].endswith("saturation_summary.json")
    md = (out / "results.md").read_text()
    scalars = csv_scalars(out)
    for algo in WHATIF_ALGOS:
        per_tensor = {count: sum(t["whatif"][algo][count] for t in summary["tensors"].values())
                      for count in ("clipped", "events")}
        from_csv = {count: column_sum(rows, f"whatif/{algo}/{count}") for count in ("clipped", "events")}
        assert whatif["estimators"][algo] == per_tensor == from_csv, algo
        used = " (used)" if algo == USED else ""
        assert f"| `qat` | `{algo}`{used} | {per_tensor['clipped']:,d} | {per_tensor['events']:,d} |" in md
        assert scalars["qat", f"whatif_{algo}_clipped"] == str(per_tensor["clipped"])
        assert scalars["qat", f"whatif_{algo}_events"] == str(per_tensor["events"])
    real = {"clipped": column_sum(rows, "sat/clipped"), "events": column_sum(rows, "sat/events")}
    assert whatif["real"] == real == {"clipped": summary["clipped"], "events": summary["saturation_events"]}
    assert whatif["used_matches_real"] is True and "**note:**" not in md
    assert whatif["estimators"]["current"]["clipped"] == 0  # current scaling clips nothing in a finite tensor
    assert json.loads((out / "results.json").read_text())["qat"][0]["whatif"]["estimators"] == whatif["estimators"]


@pytest.mark.parametrize("summary", ["none", "without the new keys"])
def test_whatif_totals_are_the_csv_sums_without_them_in_the_summary(base, tmp_path, summary):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=4, summary=summary != "none")
    if summary != "none":  # an older callback's summary: totals, no what-if
        path = qat / "logs" / "version_0" / "saturation_summary.json"
        old = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("whatif", "health_worst")}
        old["tensors"] = {name: {k: v for k, v in t.items() if k not in ("whatif", "health")} for name, t in old["tensors"].items()}
        path.write_text(json.dumps(old))
    whatif = whatif_stats(rp.load_run(qat))
    rows = metrics_rows(qat)
    assert whatif["source"].startswith("metrics.csv")
    assert whatif["estimators"] == {algo: {count: column_sum(rows, f"whatif/{algo}/{count}") for count in ("clipped", "events")}
                                    for algo in WHATIF_ALGOS}
    assert whatif["real"] == {"clipped": column_sum(rows, "sat/clipped"), "events": column_sum(rows, "sat/events")}
    assert whatif["used_matches_real"] is True


def test_a_used_estimator_disagreeing_with_the_real_counter_is_noted(base, tmp_path):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=5)
    path = qat / "logs" / "version_0" / "saturation_summary.json"
    summary = json.loads(path.read_text())
    summary["clipped"] += 1
    path.write_text(json.dumps(summary))
    (result,) = rp.build_report(base, [qat], tmp_path / "out", labels=["BF16", "qat"])["qat"]
    assert result["whatif"]["used_matches_real"] is False
    assert f"> **note:** `qat`: its own estimator `{USED}` gives" in (tmp_path / "out" / "results.md").read_text()


# --------------------------------------------------------------------------- health
def worst_from_csv(rows, tensors) -> list[tuple[str, float, int]]:
    """(tensor, its lowest logged SQNR, the step of it), lowest first: from the CSV columns, by hand."""
    worst = []
    for t in tensors:
        by_step = column_by_step(rows, f"health/{t}/sqnr_db")
        step = min(by_step, key=by_step.get)
        worst.append((t, by_step[step], step))
    return sorted(worst, key=lambda item: item[1])


@pytest.mark.parametrize("with_summary", [True, False])
def test_worst_tensors_first_with_their_step(tmp_path, with_summary):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=6, summary=with_summary)
    health = health_stats(rp.load_run(qat))
    expected = worst_from_csv(metrics_rows(qat), tensor_names())
    got = [(t["tensor"], t["worst_sqnr_db"], t["worst_sqnr_step"]) for t in health["tensors"]]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[2] for g in got] == [e[2] for e in expected]
    assert [g[1] for g in got] == pytest.approx([e[1] for e in expected])
    assert (health["min_sqnr_tensor"], health["min_sqnr_step"]) == (expected[0][0], expected[0][2])
    assert health["source"].endswith("saturation_summary.json" if with_summary else "columns)")


def test_worst_first_puts_tensors_without_a_finite_sqnr_last():
    entries = {name: {"worst_sqnr_db": db, "worst_sqnr_step": 1, "last": None}
               for name, db in (("exact", None), ("good", 30.0), ("bad", 12.5), ("inf", math.inf))}
    assert [t["tensor"] for t in worst_first(entries)][:2] == ["bad", "good"]
    assert sorted(t["tensor"] for t in worst_first(entries)[2:]) == ["exact", "inf"]


def test_run_level_health_figures_and_the_markdown_table(base, tmp_path):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=7)
    out = tmp_path / "out"
    (result,) = rp.build_report(base, [qat], out, labels=["BF16", "qat"])["qat"]
    rows, health, tensors = metrics_rows(qat), result["health"], tensor_names()
    sqnr = [v for t in tensors for v in column_by_step(rows, f"health/{t}/sqnr_db").values()]
    assert health["min_sqnr_db"] == pytest.approx(min(sqnr)) == pytest.approx(min(column_by_step(rows, "health/min_sqnr_db").values()))
    underflow = column_by_step(rows, "health/underflow_frac")
    assert health["underflow_frac"] == pytest.approx(underflow[max(underflow)])
    assert health["max_underflow_frac"] == pytest.approx(max(underflow.values()))
    last_step = max(column_by_step(rows, f"health/{tensors[0]}/outlier_factor"))
    outliers = {t: column_by_step(rows, f"health/{t}/outlier_factor")[last_step] for t in tensors}
    assert health["max_outlier_factor"] == pytest.approx(max(outliers.values()))
    assert health["max_outlier_tensor"] == max(outliers, key=outliers.get)
    md = (out / "results.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    expected = worst_from_csv(rows, tensors)[:TOP_TENSORS]
    assert [line.split(" | ")[1].strip("`") for line in table] == [e[0] for e in expected]
    assert f"| min SQNR (dB) | {min(sqnr):.2f} (step {expected[0][2]}, `{expected[0][0]}`) |" in md
    assert float(csv_scalars(out)["qat", "health_min_sqnr_db"]) == pytest.approx(min(sqnr))


def test_heatmap_rows_by_block_module_operand_and_its_values(tmp_path):
    names = tensor_names(blocks=(2, 10), modules=("self_attn.q_proj",) + MODULES)
    for with_summary in (True, False):  # model order from the summary; else the forward order of the names
        qat = make_health_run(tmp_path / f"qat_{with_summary}", steps=STEPS, seed=8, tensors=names, summary=with_summary)
        run = rp.load_run(qat)
        assert tensor_order(run, sorted(names)) == names
        tensors, steps, matrix = sqnr_matrix(run)
        rows = metrics_rows(qat)
        assert tensors == names
        for i, t in enumerate(tensors):
            by_step = column_by_step(rows, f"health/{t}/sqnr_db")
            assert steps == sorted(by_step)
            assert list(matrix[i]) == pytest.approx([by_step[s] for s in steps])


def test_tier_fractions_are_the_block_means_at_the_last_logged_step(tmp_path):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=9)
    run = rp.load_run(qat)
    fractions = tier_fractions(run, health_stats(run))
    rows = metrics_rows(qat)
    kinds = [f"{m}.{o}" for m in MODULES for o in OPERANDS]
    assert list(fractions) == kinds
    for kind in kinds:
        blocks = [t for t in tensor_names() if t.endswith("." + kind)]
        for tier in TIERS:
            values = [column_by_step(rows, f"health/{t}/tier/{tier}") for t in blocks]
            expected = sum(v[max(v)] for v in values) / len(values)
            assert fractions[kind][tier] == pytest.approx(expected), (kind, tier)
        assert sum(fractions[kind].values()) == pytest.approx(1.0)


# --------------------------------------------------------------------------- figures
def test_figures_are_pngs_of_the_expected_size(base, tmp_path):
    one = make_health_run(tmp_path / "one", steps=STEPS, seed=10)
    many = make_health_run(tmp_path / "many", steps=STEPS, seed=11, tensors=tensor_names(blocks=range(8)))
    report = rp.build_report(base, [one], tmp_path / "out1", labels=["BF16", "one"])
    assert set(HEALTH_FIGURES) <= set(report["files"]) and set(HEALTH_FIGURES) <= set(report["figures"])
    whatif, heatmap, tiers = (tmp_path / "out1" / name for name in HEALTH_FIGURES)
    assert png_size(whatif) == (7 * DPI, round(4.2 * DPI))  # one 7 x 4.2 in panel
    assert png_size(heatmap)[0] == 10 * DPI and png_size(tiers)[0] == 13 * DPI
    figures = report["figures"]
    assert figures["whatif_clipped.png"]["runs"] == ["one"] and figures["whatif_clipped.png"]["warmup_lines"] == [2]
    worst = report["qat"][0]["health"]
    assert figures["sqnr_heatmap.png"]["worst"]["one"]["tensor"] == worst["min_sqnr_tensor"]
    assert figures["sqnr_heatmap.png"]["worst"]["one"]["sqnr_db"] == pytest.approx(worst["min_sqnr_db"])

    rp.build_report(base, [one, many], tmp_path / "out2", labels=["BF16", "one", "many"])
    assert png_size(tmp_path / "out2" / HEALTH_FIGURES[0]) == (2 * 7 * DPI, round(4.2 * DPI))  # two panels side by side
    assert png_size(tmp_path / "out2" / HEALTH_FIGURES[1])[1] > png_size(heatmap)[1]  # a row per tensor
    assert png_size(tmp_path / "out2" / HEALTH_FIGURES[2])[1] > png_size(tiers)[1]


# --------------------------------------------------------------------------- older runs
def test_an_older_run_still_reports_and_says_not_recorded(base, tmp_path):
    new = make_health_run(tmp_path / "new", steps=STEPS, seed=12)
    old = make_run(tmp_path / "old", True, final=None, last_step=STEPS)
    old_summary = {"quantized_tensors": 2, "clipped": 3, "seen": 100, "saturation_events": 1,
                   "tensors": {"layers.2.mlp.up_proj.input": {"clipped": 3, "seen": 50}}}
    (old / "logs" / "version_0" / "saturation_summary.json").write_text(json.dumps(old_summary))
    out = tmp_path / "out"
    report = rp.build_report(base, [new, old], out, labels=["BF16", "new", "old"])
    by_label = {r["label"]: r for r in report["qat"]}
    assert not by_label["old"]["whatif"]["recorded"] and not by_label["old"]["health"]["recorded"]
    assert by_label["new"]["whatif"]["recorded"] and by_label["new"]["health"]["recorded"]
    md = (out / "results.md").read_text()
    assert f"| `old` | {NOT_RECORDED} (no whatif/* columns" in md
    assert f"| tensors measured | {len(tensor_names())} | {NOT_RECORDED} |" in md
    assert f"`old`: numeric health {NOT_RECORDED}" in md
    scalars = csv_scalars(out)
    assert ("old", "whatif_max_clipped") not in scalars and ("old", "health_min_sqnr_db") not in scalars
    assert ("new", "whatif_max_clipped") in scalars
    for name in HEALTH_FIGURES:
        assert png_size(out / name)[0] > 0
    assert json.loads((out / "results.json").read_text())["qat"][1]["whatif"]["recorded"] is False


def test_a_run_with_whatif_but_no_health(base, tmp_path):
    qat = make_health_run(tmp_path / "qat", steps=STEPS, seed=13, health=False)
    out = tmp_path / "out"
    (result,) = rp.build_report(base, [qat], out, labels=["BF16", "qat"])["qat"]
    rows = metrics_rows(qat)
    assert result["whatif"]["estimators"][USED]["clipped"] == column_sum(rows, f"whatif/{USED}/clipped")
    assert not result["health"]["recorded"] and NOT_RECORDED in result["health"]["note"]
    md = (out / "results.md").read_text()
    assert f"`qat`: numeric health {NOT_RECORDED}" in md and f"| `qat` | `{USED}` (used) |" in md
    assert tier_fractions(rp.load_run(qat), result["health"]) == {}
    for name in HEALTH_FIGURES:
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE


# --------------------------------------------------------------------------- fallback
def test_the_fallback_table_lists_each_runs_decisions_and_a_run_without_says_none(base, tmp_path):
    with_fallback = make_health_run(tmp_path / "fell", steps=STEPS, seed=14)
    without = make_health_run(tmp_path / "kept", steps=STEPS, seed=15)
    summary = summary_of(with_fallback)
    decisions = [{"tensor": "layers.2.mlp.down_proj.input", "target": "current", "step": 11,
                  "reason": "persistent saturation", "evidence": "saturation events in 9 of its last 16 quantized steps"},
                 {"tensor": "layers.3.mlp.up_proj.weight", "target": "high_precision", "step": 20,
                  "reason": "SQNR under the floor", "evidence": "SQNR 14.20 dB, under 20 dB on 3 consecutive measurements"}]
    summary["fallback"] = decisions
    (with_fallback / "logs" / "version_0" / "saturation_summary.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    report = rp.build_report(base, [with_fallback, without], out, labels=["BF16", "fell", "kept"])
    assert [r["saturation"]["fallback"] for r in report["qat"]] == [decisions, []]
    md = (out / "results.md").read_text()
    section = md[md.index("## Automatic fallback"):]
    for d in decisions:
        assert f"| `fell` | `{d['tensor']}` | {d['target']} | {d['step']} | {d['reason']} | {d['evidence']} |" in section
    assert "`kept`" not in section
    scalars = csv_scalars(out)
    assert scalars[("fell", "fallback_tensors")] == "2" and scalars[("kept", "fallback_tensors")] == "0"

    alone = rp.build_report(base, [without], tmp_path / "out2", labels=["BF16", "kept"])
    assert "No tensor fell back" in (tmp_path / "out2" / "results.md").read_text() and alone["qat"][0]["saturation"]
