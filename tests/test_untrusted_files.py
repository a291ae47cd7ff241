"""Files in, files out: nothing a file holds runs as code.

A planted checkpoint: a real QATModule checkpoint with one more hyper-parameter whose pickle runs ``touch MARKER``
(``__reduce__`` -> ``os.system``), as a shared or downloaded ``.ckpt`` can be. Every command that reads a
checkpoint refuses it with one line naming the file, the global and ``--weights_only false``, creates no marker
and changes nothing saved; today's checkpoints and an earlier version's (a pickled ``QuantConfig``) load weights-only.
"""

from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch

import main as cli
from qat_app.config import QuantConfig
from qat_app.export import main as export_main
from tests._cli_runs import write_config
from tests._tiny_models import save_qat_checkpoint


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _planted(tmp_path, model_dir, where: str = "hyper_parameters") -> tuple[str, str]:
    """-> (a real QAT checkpoint with a code-running pickle inside, the marker file it would create)."""
    good = save_qat_checkpoint(tmp_path / "good.ckpt", model_dir)
    ckpt = torch.load(good, weights_only=True)
    marker = str(tmp_path / "MARKER")
    if where == "hyper_parameters":
        ckpt["hyper_parameters"]["note"] = _Payload(marker)
    else:
        ckpt[where] = _Payload(marker)
    path = str(tmp_path / "evil.ckpt")
    torch.save(ckpt, path)
    return path, marker


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` with its sha256 (what 'nothing saved is changed' compares)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            out[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _one_line(text: str, path: str) -> None:
    lines = [line for line in text.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, text
    assert path in lines[0] and "posix.system" in lines[0] and "--weights_only false" in lines[0], lines[0]
    assert "Traceback" not in text and "WeightsUnpickler" not in text


def test_todays_checkpoints_and_an_older_mains_load_weights_only(tmp_path, tiny_model_dir):
    """Today's hold plain data; an earlier version pickled its QuantConfig: the one allowlisted class."""
    from qat_app.safe_load import LEGACY_PICKLED_CLASSES
    from qat_app.export.qat_checkpoint import load_qat_checkpoint

    good = save_qat_checkpoint(tmp_path / "good.ckpt", tiny_model_dir)
    torch.load(good, weights_only=True)  # nothing in it needs unpickling
    fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
    for version in ("checkpoint_v1", "checkpoint_v2", "checkpoint_v3"):
        torch.load(os.path.join(fixtures, version, "step2.ckpt"), weights_only=True)
    ckpt = torch.load(good, weights_only=True)
    ckpt["hyper_parameters"]["quant"] = QuantConfig(**ckpt["hyper_parameters"]["quant"])  # as earlier versions saved it
    old = str(tmp_path / "old.ckpt")
    torch.save(ckpt, old)
    assert LEGACY_PICKLED_CLASSES == (QuantConfig,)
    module = load_qat_checkpoint(old)
    assert module.hparams["quant"]["history_len"] == 4
    assert export_main(["--ckpt_path", old, "--out", str(tmp_path / "h8")]) == 0


@pytest.mark.parametrize("fmt", ["hif8", "hf", "compressed-tensors"])
def test_export_refuses_a_planted_checkpoint_in_one_line(tmp_path, tiny_model_dir, capsys, fmt):
    path, marker = _planted(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    assert export_main(["--ckpt_path", path, "--out", str(out), "--format", fmt]) == 2
    _one_line(capsys.readouterr().err, path)
    assert not os.path.exists(marker) and not out.exists()


def test_export_runs_a_trusted_pickle_only_when_told_to(tmp_path, tiny_model_dir):
    path, marker = _planted(tmp_path, tiny_model_dir)
    assert export_main(["--ckpt_path", path, "--out", str(tmp_path / "out"), "--weights_only", "false"]) == 0
    assert os.path.exists(marker)  # what the flag means: the file's code ran


@pytest.mark.parametrize("command", ["fit", "validate", "inspect"])
def test_lightning_commands_refuse_a_planted_checkpoint_in_one_line(tmp_path, tiny_model_dir, tiny_corpus, capsys,
                                                                    command):
    path, marker = _planted(tmp_path, tiny_model_dir)
    (tmp_path / "run").mkdir()
    config = write_config(tmp_path / "run", tiny_model_dir, tiny_corpus)
    before = _tree(tmp_path / "run")
    extra = ["--batches", "1", "--out", str(tmp_path / "inspect")] if command == "inspect" else []
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--config", config, "--ckpt_path", path, *extra])
    assert exit_info.value.code == 2
    _one_line(capsys.readouterr().err, path)
    assert not os.path.exists(marker) and _tree(tmp_path / "run") == before


@pytest.mark.slow
def test_resuming_last_stops_at_a_planted_newest_checkpoint(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    """``--ckpt_path last`` (also what ``main.py study`` resumes with) names the planted newest checkpoint and
    stops: it is not passed over for an older one as a truncated file is."""
    from tests._cli_runs import SimulatedCrash

    run = tmp_path / "run"
    run.mkdir()
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(run / "ckpt"), "save_last": True, "every_n_train_steps": 2}},
                 {"class_path": "tests._cli_runs.CrashAt", "init_args": {"step": 3}}]
    config = write_config(run, tiny_model_dir, tiny_corpus, **{"trainer.callbacks": callbacks})
    with pytest.raises(SimulatedCrash):
        cli.cli_main(["fit", "--config", config])
    last = str(run / "ckpt" / "last.ckpt")
    ckpt = torch.load(last, weights_only=True)
    marker = str(tmp_path / "MARKER")
    ckpt["hyper_parameters"]["note"] = _Payload(marker)
    torch.save(ckpt, last)
    before = _tree(run)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", config, "--ckpt_path", "last"])
    assert exit_info.value.code == 2
    _one_line(capsys.readouterr().err, last)
    assert not os.path.exists(marker) and _tree(run) == before


def test_the_report_and_the_kl_cache_read_a_planted_topk_file_as_damaged(tmp_path):
    """A crafted ``final_topk.pt`` in a run directory: the report names it and goes on; no marker."""
    from qat_app import report as rp
    from qat_app.eval.kl_cache import TopKCacheError, load_topk
    from tests._report_fixtures import make_run, records

    arc = records("arc_challenge", [1, 0] * 50, 3)
    base, qat = make_run(tmp_path / "base", False, final=arc), make_run(tmp_path / "qat", True, final=arc)
    marker = str(tmp_path / "MARKER")
    for run in (base, qat):
        torch.save({"header": _Payload(marker)}, run / "logs" / "version_0" / "final_topk.pt")
    with pytest.raises(TopKCacheError, match=re.escape(str(qat / "logs" / "version_0" / "final_topk.pt"))):
        load_topk(str(qat / "logs" / "version_0" / "final_topk.pt"))
    result = rp.build_report(base, [qat], tmp_path / "out")["qat"][0]
    assert "not computed" in result["kl_baseline_qat"]["note"] and not os.path.exists(marker)


def test_trust_remote_code_is_never_taken_from_a_file(tmp_path, tiny_model_dir):
    """A checkpoint whose hyper-parameters say trust_remote_code: the export's module does not turn it on; an
    export's layout that says so is recorded, not obeyed."""
    from qat_app.export.qat_checkpoint import load_qat_checkpoint

    good = save_qat_checkpoint(tmp_path / "good.ckpt", tiny_model_dir)
    ckpt = torch.load(good, weights_only=True)
    ckpt["hyper_parameters"]["trust_remote_code"] = True
    path = str(tmp_path / "remote.ckpt")
    torch.save(ckpt, path)
    assert load_qat_checkpoint(path).hparams["trust_remote_code"] is False
    assert load_qat_checkpoint(path, trust_remote_code=True).hparams["trust_remote_code"] is True
    import json

    from qat_app.export import load_hif8
    from qat_app.export.layout import LAYOUT_FILE

    out = tmp_path / "h8"
    assert export_main(["--ckpt_path", path, "--out", str(out)]) == 0
    layout = json.loads((out / LAYOUT_FILE).read_text())
    layout["trust_remote_code"] = True
    (out / LAYOUT_FILE).write_text(json.dumps(layout))
    seen = {}
    import transformers

    original = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen["trust_remote_code"] = kwargs.get("trust_remote_code")
        return original(*args, **kwargs)

    transformers.AutoConfig.from_pretrained = spy
    try:
        load_hif8(out)
    finally:
        transformers.AutoConfig.from_pretrained = original
    assert seen["trust_remote_code"] is False
