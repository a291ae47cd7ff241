"""A first run's screen: the end-of-fit summary (real numbers), the step progress bar, no stray CLI warning."""

import csv
import json
import logging
import math
import os
import re
import sys

import pytest
import yaml
from lightning.pytorch.callbacks import TQDMProgressBar

import main as cli
from callbacks import RunSummaryCallback, StepProgressBar
from callbacks.progress_log import format_clipped
from callbacks.run_summary import stderr
from callbacks.step_progress import format_postfix

WARMUP, STEPS = 2, 6


def write_config(tmp_path, model_dir, corpus, benchmarks=True, **trainer) -> str:
    config = {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": STEPS,
            "log_every_n_steps": 1, "num_sanity_val_steps": 0, "val_check_interval": 2 * STEPS,
            "check_val_every_n_epoch": None, "default_root_dir": str(tmp_path / "runs" / "tiny"),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path / "runs" / "tiny"), "name": "logs"}}],
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(tmp_path / "runs" / "tiny" / "checkpoints"),
                                         "save_last": True, "every_n_train_steps": 3, "save_top_k": -1}}],
            **trainer,
        },
        "warmup": {"warmup_steps": WARMUP},
        "summary": {"baseline": "runs/bf16"},
        "model": {"model_name": str(model_dir), "lr": 1e-3, "lr_schedule": "constant",
                  "quant": {"amax_algo": "max", "history_len": 4, "high_precision_layers": 1, "fused": "off"}},
        "data": {"class_path": "qat_app.data.pretrain.PretrainDataModule",
                 "init_args": {"data_files": str(corpus), "dataset": None, "seq_len": 32, "micro_batch_size": 2,
                               "global_batch_size": 4, "val_documents": 4}},
    }
    if benchmarks:
        config["data"]["init_args"]["benchmarks"] = {
            "class_path": "qat_app.data.benchmarks.BenchmarkDataModule",
            "init_args": {"tasks": ["arc_challenge"], "limit": 6, "batch_size": 6, "source": "local"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_formatting():
    assert format_clipped(12, 3.1e-7) == "12 (3.1e-07)"
    assert format_clipped(None, 3.1e-7) == "3.1e-07"  # the count is not always logged
    assert format_postfix({"train/loss": 3.5, "train/lr": 1e-5, "sat/clipped": 12.0, "sat/clipped_frac": 3.1e-7,
                           "v_num": 0}) == {"loss": 3.5, "lr": "1.00e-05", "clipped": "12 (3.1e-07)", "v_num": 0}
    assert format_postfix({"train/lr": 2e-4, "sat/clipped_frac": 0.0}) == {"lr": "2.00e-04", "clipped": "0.0e+00"}
    assert stderr(0.25, 5) == pytest.approx(math.sqrt(0.25 * 0.75 / 4))


def test_fit_prints_summary_and_counts_steps(tmp_path, tiny_model_dir, tiny_corpus, capsys, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    with caplog.at_level(logging.INFO, logger="qat_app.progress"):
        run = cli.cli_main(["fit", "--config", config])
    out = capsys.readouterr().out
    trainer = run.trainer
    summary = next(c for c in trainer.callbacks if isinstance(c, RunSummaryCallback))
    assert summary.text and summary.text in out
    block = summary.text
    assert open(os.path.join(trainer.log_dir, "run_summary.txt")).read().strip() == block

    rows = list(csv.DictReader(open(os.path.join(trainer.log_dir, "metrics.csv"))))
    last = lambda key: float([r[key] for r in rows if r.get(key)][-1])  # noqa: E731
    assert f"train loss    {last('train/loss'):.4f} (last step)" in block
    assert f"val loss      {last('val/loss'):.4f}   perplexity {last('val/ppl'):.2f}" in block
    acc, acc_norm, n = last("val/arc_challenge/acc"), last("val/arc_challenge/acc_norm"), last("val/arc_challenge/count")
    assert n == 6
    assert (f"arc_challenge acc {acc:.4f} +- {math.sqrt(acc * (1 - acc) / (n - 1)):.4f}   "
            f"acc_norm {acc_norm:.4f} +- {math.sqrt(acc_norm * (1 - acc_norm) / (n - 1)):.4f}   n=6/6") in block
    # saturation from the file AmaxSaturationCallback wrote first (the summary callback runs after it)
    sat_file = os.path.join("runs", "tiny", "logs", "version_0", "saturation_summary.json")
    sat = json.load(open(sat_file))
    assert sat["seen"] > 0
    assert (f"saturation    {sat['clipped']} of {sat['seen']:.3g} quantized elements clipped ({sat['clipped_frac']:.1e}), "
            f"{sat['saturation_events']} saturation events [{sat_file}]") in block
    headroom = sat["headroom"]  # measured at the last logged step: its suggestion is in the block, with its verdict
    best = headroom["suggested"]["all"]
    assert (f"headroom      suggested max_val {best:g} (mean SQNR {headroom['sqnr_db'][headroom['grid'].index(best)]:.1f} "
            f"dB, no more clipping than the run; {headroom['gain_db']:+.2f} dB estimated over 15, ") in block
    assert ("beyond" if headroom["significant"] else "inside") + " the estimate's error (0.75 dB)" in block
    assert "logs          runs/tiny/logs/version_0" in block
    ckpt = os.path.join("runs", "tiny", "checkpoints", "last.ckpt")
    assert os.path.exists(ckpt)
    assert f"checkpoints   runs/tiny/checkpoints (last: {ckpt})" in block
    assert "python main.py report --baseline runs/bf16 --qat runs/tiny" in block
    assert f"python main.py export --ckpt_path {ckpt} --out exports/tiny" in block
    assert (f"python main.py export --ckpt_path {ckpt} --out exports/tiny-fp8 --format compressed-tensors --compare "
            f"--config {os.path.join('runs', 'tiny', 'logs', 'version_0', 'config.yaml')}") in block
    assert (f"python benchmarks/serve_vllm.py --ckpt_path {ckpt} --config "
            f"{os.path.join('runs', 'tiny', 'logs', 'version_0', 'config.yaml')} --out exports/tiny-fp8") in block

    # the progress bar counted optimizer steps out of max_steps, in the QAT phase at the end
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (STEPS, STEPS)
    assert bar.train_progress_bar.desc.startswith("QAT")
    assert re.search(rf"warmup: +\d+%.*\| 1/{STEPS} ", out) and re.search(rf"QAT: +100%.*\| {STEPS}/{STEPS} ", out)
    assert re.search(r"lr=1\.00e-03", out) and re.search(r"clipped=(\d+ \()?\d\.\de[-+]\d\d", out)
    assert "0.000%" not in caplog.text
    assert re.search(r"clipped (\d+ \()?\d\.\de[-+]\d\d", caplog.text)


def test_saturation_source_follows_callback_order(tmp_path):
    """The saturation file is read only when its writer ran first; otherwise the totals come from summary()."""
    from types import SimpleNamespace

    import torch

    from callbacks import AmaxSaturationCallback

    sat, summary = AmaxSaturationCallback(), RunSummaryCallback()
    module = SimpleNamespace(model=torch.nn.Linear(2, 2))
    sat.summary_path = str(tmp_path / "saturation_summary.json")
    (tmp_path / "saturation_summary.json").write_text(json.dumps({"clipped": 5, "quantized_tensors": 1}))
    first = SimpleNamespace(callbacks=[sat, summary], is_global_zero=True)
    assert summary.saturation(first, module) == ({"clipped": 5, "quantized_tensors": 1}, sat.summary_path)
    later = SimpleNamespace(callbacks=[summary, sat], is_global_zero=True)  # its file would be stale: recompute
    totals, path = summary.saturation(later, module)
    assert path is None and totals["quantized_tensors"] == 0 and totals["clipped"] == 0


@pytest.mark.parametrize("user_bar", ["own", "disabled"])
def test_user_progress_bar_wins(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch, user_bar):
    monkeypatch.setattr(sys, "argv", ["main.py"])
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, benchmarks=False)
    extra = (["--trainer.callbacks+=TQDMProgressBar", "--trainer.callbacks.refresh_rate=5"] if user_bar == "own"
             else ["--trainer.enable_progress_bar=false"])
    trainer = cli.cli_main(["--config", config, *extra], run=False).trainer
    bars = [c for c in trainer.callbacks if isinstance(c, TQDMProgressBar)]
    if user_bar == "own":
        assert [type(b) for b in bars] == [TQDMProgressBar] and bars[0].refresh_rate == 5
    else:
        assert bars == [] and trainer.progress_bar_callback is None


def test_command_line_run_has_no_args_warning(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch, recwarn):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, benchmarks=False)
    monkeypatch.setattr(sys, "argv", ["main.py", "fit", "--config", config, "--print_config"])
    with pytest.raises(SystemExit):
        cli.main()
    assert not [w for w in recwarn if "args parameter is intended" in str(w.message)]


def test_the_intervals_are_said_in_optimizer_steps():
    """val_check_interval counts micro-batches; the summary says what that is in optimizer steps."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from callbacks.run_summary import interval_lines

    trainer = L.Trainer(val_check_interval=48, check_val_every_n_epoch=None, accumulate_grad_batches=4,
                        callbacks=[ModelCheckpoint(every_n_train_steps=5)], logger=False, accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False)
    assert interval_lines(trainer) == ["intervals     validation every 12 optimizer steps (val_check_interval 48 "
                                       "micro-batches / 4 per step); checkpoints every 5 optimizer steps"]
