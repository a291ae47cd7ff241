"""KL(baseline || QAT) in the report, from the two runs' final top-k files (qat_app.report.distortion)."""

import math

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
