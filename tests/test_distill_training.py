"""Quantization-aware distillation through main.py: what is logged, the teacher untouched by training, exact resume
with the teacher, another teacher refused on resume, bad settings refused before anything is written, and
2-process DDP / FSDP2 on gloo equal to one process."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from qat_app.distill.config import DISTILL_CE, DISTILL_KL
from qat_app.distill.teacher import fingerprint
from tests._cli_runs import STEPS, WARMUP, SimulatedCrash, checkpointed_fit

DISTILL = {"model.distill": {"enabled": True, "kl_weight": 1.0, "ce_weight": 0.5, "temperature": 2.0}}


def _rows(run_dir: Path) -> list[dict]:
    """Every logged row, the versions in order (a resumed run logs on in a new version)."""
    rows = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with open(path) as f:
            rows += list(csv.DictReader(f))
    return rows


def _logged(run_dir: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in _rows(run_dir) if r.get(key)}


def _same(a, b, what: str) -> None:
    """Exact equality of nested dicts / lists / tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for key in a:
            _same(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{what} differs"
    else:
        assert a == b, f"{what} differs"


def _main(argv, capsys) -> tuple[int, list[str]]:
    """-> (exit code, stderr lines) of ``python main.py ARGV``."""
    import main as cli

    capsys.readouterr()
    try:
        cli.main(list(map(str, argv)))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def distilled_run(module_tmp, tiny_model_dir, tiny_corpus):
    tmp = module_tmp("distilled")
    return tmp, checkpointed_fit(tmp, tiny_model_dir, tiny_corpus, **DISTILL)


@pytest.mark.slow
def test_a_distilled_fit_logs_kl_and_ce_and_leaves_its_teacher_bitwise_unchanged(distilled_run, tiny_model_dir):
    from qat_app.models import load_causal_lm

    tmp, trainer = distilled_run
    module = trainer.lightning_module
    teacher = module.teacher
    assert teacher is not None and teacher.source == "initial"
    initial, _ = load_causal_lm(str(tiny_model_dir))
    assert fingerprint(teacher.model) == fingerprint(initial) == teacher.fingerprint  # trained against, never changed
    assert not any(p.requires_grad for p in teacher.model.parameters())
    assert not any(name.startswith("teacher") for name in module.state_dict())  # never saved
    kl, ce, loss = (_logged(tmp, key) for key in (DISTILL_KL, DISTILL_CE, "train/loss"))
    assert sorted(kl) == sorted(ce) == list(range(STEPS)) and all(math.isfinite(v) for v in ce.values())
    assert kl[0] < 1e-6  # the warmup's first step: the student is the teacher
    assert max(kl[s] for s in range(WARMUP, STEPS)) > 1e-4  # quantized: the KL the student learns against
    for step in loss:  # train/loss is the mix: kl_weight x T^2 x KL + ce_weight x CE (the last micro-batch's)
        assert loss[step] == pytest.approx(4.0 * kl[step] + 0.5 * ce[step], rel=1e-4, abs=1e-6)
    summary = next(tmp.glob("logs/version_*/run_summary.txt")).read_text()
    assert "distillation  KL(teacher || student)" in summary


@pytest.mark.slow
def test_resume_with_the_teacher_is_exact(distilled_run, tmp_path, tiny_model_dir, tiny_corpus):
    straight_dir, straight = distilled_run
    with pytest.raises(SimulatedCrash):
        checkpointed_fit(tmp_path, tiny_model_dir, tiny_corpus, crash_at=2, **DISTILL)
    resumed = checkpointed_fit(tmp_path, tiny_model_dir, tiny_corpus, "--ckpt_path", "last", **DISTILL)
    for key in (DISTILL_KL, DISTILL_CE, "train/loss"):
        after = {s: v for s, v in _logged(straight_dir, key).items() if s >= 2}
        assert {s: v for s, v in _logged(tmp_path, key).items() if s >= 2} == after, key
    _same(straight.lightning_module.state_dict(), resumed.lightning_module.state_dict(), "module")
    _same(straight.optimizers[0].state_dict()["state"], resumed.optimizers[0].state_dict()["state"], "optimizer")
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["qat_app"]["distill_teacher"]["fingerprint"] == straight.lightning_module.teacher.fingerprint


@pytest.mark.slow
def test_resuming_with_another_teacher_is_refused_in_one_line(distilled_run, tmp_path, tiny_model_dir, tiny_corpus,
                                                               embedded_tokenizer, capsys):
    """Another source: the resume's settings check names the field. The same source holding other weights (a
    directory overwritten since): the teacher's fingerprint names it."""
    from tests._cli_runs import write_config
    from tests._tiny_models import save_tiny_llama

    run_dir, _ = distilled_run
    teacher_dir = save_tiny_llama(tmp_path / "teacher", embedded_tokenizer, seed=5)  # the same tokenizer
    other = {"model.distill": dict(DISTILL["model.distill"], teacher=str(teacher_dir))}
    code, err = _main(["fit", "--config", write_config(tmp_path, tiny_model_dir, tiny_corpus, **other),
                       "--ckpt_path", run_dir / "ckpt" / "last.ckpt"], capsys)
    assert code == 2 and err[-1].startswith("error: ") and "distill" in err[-1] and str(teacher_dir) in err[-1]

    first = checkpointed_fit(tmp_path / "a", tiny_model_dir, tiny_corpus, **other, **{"trainer.max_steps": 2,
                                                                                  "warmup.warmup_steps": 1})
    assert first.lightning_module.teacher.source == str(teacher_dir)
    save_tiny_llama(teacher_dir, embedded_tokenizer, seed=6)  # the directory now holds another model
    config = write_config(tmp_path / "a", tiny_model_dir, tiny_corpus, **other, **{"warmup.warmup_steps": 1})
    code, err = _main(["fit", "--config", config, "--ckpt_path", tmp_path / "a" / "ckpt" / "last.ckpt"], capsys)
    assert code == 2 and f"distill.teacher: the checkpoint was distilled from {str(teacher_dir)!r}" in err[-1]


def _refused_before_writing(tmp_path, tiny_model_dir, tiny_corpus, capsys, distill: dict, *flags) -> str:
    from tests._cli_runs import write_config

    (tmp_path / "run").mkdir()
    config = write_config(tmp_path / "run", tiny_model_dir, tiny_corpus, **{"model.distill": distill})
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    code, err = _main(["fit", "--config", config, *flags], capsys)
    assert code == 2 and sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    return err[-1]


@pytest.mark.parametrize("flag,message", [
    ("--model.distill.kl_weight=-1", "distill.kl_weight: must be >= 0"),
    ("--model.distill.temperature=0", "distill.temperature: must be > 0"),
])
def test_bad_settings_are_refused_before_anything_is_written(flag, message, tmp_path, tiny_model_dir, tiny_corpus,
                                                             capsys):
    assert message in _refused_before_writing(tmp_path, tiny_model_dir, tiny_corpus, capsys, DISTILL["model.distill"],
                                              flag)


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_refused_before_anything_is_written(tmp_path, tiny_model_dir, tiny_corpus,
                                                                                 capsys):
    from tests._tiny_models import byte_level_tokenizer, save_tiny_llama

    other = save_tiny_llama(tmp_path / "other", byte_level_tokenizer())
    line = _refused_before_writing(tmp_path, tiny_model_dir, tiny_corpus, capsys,
                                   dict(DISTILL["model.distill"], teacher=str(other)))
    assert "distill.teacher:" in line and "tokens" in line or "tokenizer" in line


@pytest.mark.slow
def test_two_gloo_processes_distill_as_one_under_ddp_and_fsdp2(tmp_path):
    import torch.multiprocessing as mp

    from tests._dist_workers import equivalence_worker

    equivalence_worker(0, 1, "single", "", str(tmp_path), 4, True)
    for mode in ("ddp", "fsdp"):
        mp.spawn(equivalence_worker, args=(2, mode, str(tmp_path / f"init_{mode}"), str(tmp_path), 4, True), nprocs=2,
                 join=True)
    single = torch.load(tmp_path / "single_rank0.pt", weights_only=True)
    assert single["kl"][0] < 1e-6 < max(single["kl"][1:])  # the warmup step, then quantized
    for mode in ("ddp", "fsdp"):
        r0, r1 = (torch.load(tmp_path / f"{mode}_rank{r}.pt", weights_only=True) for r in range(2))
        torch.testing.assert_close(r0["losses"], single["losses"], rtol=1e-5, atol=1e-7, msg=mode)
        torch.testing.assert_close(r0["kl"], single["kl"], rtol=1e-4, atol=1e-7, msg=mode)
        assert r0["teacher"] == r1["teacher"] == single["teacher"] == single["teacher_initial"]  # replicas untouched
