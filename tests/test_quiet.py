"""The first screen of a fit: no library notices that say nothing about the run, and real model FLOPs."""

import logging

from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

import main as cli
from qat_app.flops import FlopsModel
from tests._cli_runs import write_config

NOISE = ("litlogger", "litmodels", "already configured with model summary", "LeafSpec",
         "`IterableDataset` has `__len__`", "flops_per_batch")


def test_first_screen_is_quiet_and_counts_model_flops(tmp_path, tiny_model_dir, tiny_corpus, caplog, capfd, recwarn):
    caplog.set_level(logging.INFO)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 4, "warmup.warmup_steps": 2,
                                                                    "trainer.enable_progress_bar": True})
    trainer = cli.cli_main(["fit", "--config", config]).trainer
    out, err = capfd.readouterr()
    screen = "\n".join([out, err, *(r.getMessage() for r in caplog.records), *(str(w.message) for w in recwarn)])
    assert [n for n in NOISE if n in screen] == []
    # the summary: no FLOPs column of zeros; its total is the forward of one micro-batch (2 x 32 tokens)
    summary = next(r.getMessage() for r in caplog.records if "Total Flops" in r.getMessage())
    assert "FLOPs" not in summary  # Lightning's column header
    total_line = next(line for line in summary.splitlines() if "Total Flops" in line)
    forward = FlopsModel(trainer.lightning_module.model).batch(2, 32, training=False)
    assert forward > 0 and total_line.split()[:2] == get_human_readable_count(forward).split()
    # the throughput monitor gets the model FLOPs of the training batch it just saw (forward + backward)
    trainer.lightning_module.train()
    trainer.lightning_module._batch_shape = (2, 32)
    assert trainer.lightning_module.flops_per_batch == 3 * forward
