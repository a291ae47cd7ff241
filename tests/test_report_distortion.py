"""KL(baseline || QAT) in the report, from the two runs' final top-k files (qat_app.report.distortion)."""

import math

import pytest
import torch

from qat_app import report as rp
from qat_app.eval.kl_cache import save_topk
from qat_app.report.distortion import final_topk
from tests._report_fixtures import make_run, records


def _final_topk(run_dir, logits: torch.Tensor, partition: str = "p0") -> None:
    """A final_topk.pt of 3 sequences x 4 positions over a top-2 + rest partition, from ``logits`` [3, 4, 3]."""
    save_topk(str(run_dir / "logs" / "version_0" / "final_topk.pt"), {"partition": partition},
              torch.log_softmax(logits, -1).half())


def test_report_gives_kl_between_the_final_distributions(tmp_path):
    arc = records("arc_challenge", [1, 0] * 50, 3)
    base, qat = make_run(tmp_path / "base", False, final=arc), make_run(tmp_path / "qat", True, final=arc)
    torch.manual_seed(0)
    p_logits = torch.randn(3, 4, 3)
    q_logits = p_logits + 0.3 * torch.randn(3, 4, 3)
    _final_topk(base, p_logits)
    _final_topk(qat, q_logits)
    report = rp.build_report(base, [qat], tmp_path / "out")
    kl = report["qat"][0]["kl_baseline_qat"]
    # independent: sum p (log p - log q) per position over the stored (float16) distributions, mean per sequence
    logp, logq = (torch.log_softmax(x, -1).half().float() for x in (p_logits, q_logits))
    logp, logq = logp - logp.logsumexp(-1, keepdim=True), logq - logq.logsumexp(-1, keepdim=True)
    per_sequence = (logp.exp() * (logp - logq)).sum(-1).mean(-1).double()
    se = per_sequence.std(unbiased=True) / math.sqrt(3)
    assert kl["tokens"] == 12 and math.isclose(kl["mean"], float(per_sequence.mean()), rel_tol=1e-4)
    assert math.isclose(kl["high"] - kl["mean"], 1.96 * float(se), rel_tol=1e-3)
    assert f"{kl['mean']:.5f}" in (tmp_path / "out" / "results.md").read_text()


def test_report_names_why_when_the_files_do_not_pair(tmp_path):
    arc = records("arc_challenge", [1, 0] * 50, 3)
    base, qat = make_run(tmp_path / "base", False, final=arc), make_run(tmp_path / "qat", True, final=arc)
    assert rp.build_report(base, [qat], tmp_path / "o1")["qat"][0]["kl_baseline_qat"] is None  # no files: no row
    _final_topk(base, torch.zeros(3, 4, 3), "p0")
    _final_topk(qat, torch.zeros(3, 4, 3), "another")
    assert final_topk(rp.load_run(qat)) is not None
    note = rp.build_report(base, [qat], tmp_path / "o2")["qat"][0]["kl_baseline_qat"]["note"]
    assert "not of the same initial top-k cache" in note
    assert "not computed" in (tmp_path / "o2" / "results.md").read_text()


def test_report_reads_the_qat_run_against_its_noise_floor(tmp_path):
    """The QAT run's noise_floor.json (as callbacks.noise_floor writes it, from a real floor) beside its
    KL(baseline || QAT), its forget/kl parts and its answers changed baseline -> QAT."""
    import csv
    import json

    from qat_app.eval.noise_floor import AnswerFlips, noise_floor
    from tests._tiny_models import tiny_qat

    base_arc = records("arc_challenge", [1, 0] * 50, 3)
    qat_arc = records("arc_challenge", [0, 1] * 3 + [1, 0] * 47, 3)  # 6 answers changed
    base, qat = make_run(tmp_path / "base", False, final=base_arc), make_run(tmp_path / "qat", True, final=qat_arc)
    torch.manual_seed(0)
    p_logits = torch.randn(3, 4, 3)
    _final_topk(base, p_logits)
    _final_topk(qat, p_logits + 0.3 * torch.randn(3, 4, 3))
    g = torch.Generator().manual_seed(5)
    floor = noise_floor(tiny_qat(dtype=torch.float32), [torch.randint(0, 96, (4, 24), generator=g)], relative=1e-5)
    flips = AnswerFlips((0, 1, 2), {"arc_challenge": 100}, {"arc_challenge": [1, 0, 2]}, {"arc_challenge": [1, 1, 2]})
    version = qat / "logs" / "version_0"
    (version / "noise_floor.json").write_text(json.dumps({"step": 3, "seconds": 4.0, "text": floor.to_dict(),
                                                          "benchmarks": flips.to_dict()}))
    metrics = list(csv.DictReader(open(version / "metrics.csv")))
    parts = {"forget/kl": 0.05, "forget/kl_drift": 0.01, "forget/kl_quantization": 0.045,
             "forget/generation_kl": 0.07}
    last = {**{k: "" for k in metrics[0]}, "step": "3",
            **{f"{k}{s}": str(v * f) for k, v in parts.items() for s, f in (("", 1), ("_low", 0.9), ("_high", 1.1))}}
    with open(version / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(last))
        writer.writeheader()
        writer.writerows([{**{k: "" for k in last}, **row} for row in metrics] + [last])
    result = rp.build_report(base, [qat], tmp_path / "out")["qat"][0]
    assert result["noise_floor"]["text"]["kl"]["difference"] == floor.kl.difference
    assert result["forget_kl"]["forget/kl_drift"] == pytest.approx([0.01, 0.009, 0.011])
    text = (tmp_path / "out" / "results.md").read_text()
    section = text[text.index("## Against the noise floor of the arithmetic"):]
    assert f"floor KL {floor.kl.difference:.5f}" in section and "KL(baseline ‖ QAT)" in section
    kl = result["kl_baseline_qat"]
    expected = ("within" if kl["high"] <= floor.kl.high else "above" if kl["low"] > floor.kl.high else "overlaps")
    assert f"is {expected} the noise of the arithmetic" in section
    assert "arc_challenge: acc_norm answers changed by the floor's perturbation 1/0/2 of 100 (mean 1.0); " \
           "baseline → QAT changed 6 of 100" in section
    assert "`forget/kl_drift` (drift: KL(initial ‖ final, quantization off)) 0.01000 [0.00900, 0.01100]\n" in section
    assert "`forget/kl_quantization`" in section and section.count("of the arithmetic") >= 4
    assert ("`forget/generation_kl` (generation drift: KL(initial ‖ final) along the initial model's greedy "
            "continuations) 0.07000 [0.06300, 0.07700]") in section
