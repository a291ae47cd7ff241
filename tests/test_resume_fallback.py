"""A run killed while Lightning writes a checkpoint: ``--ckpt_path last`` falls back to the newest intact
checkpoint of the run, says which it took and why, and the run ends exactly as an uninterrupted one."""

from __future__ import annotations

import logging

import pytest
import torch

import main as cli
from tests._cli_runs import write_config


def final_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()
            if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_truncated_last_checkpoint_falls_back_and_resumes_exactly(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    common = {"warmup.warmup_steps": 1}
    (tmp_path / "a").mkdir()
    straight = cli.cli_main(["fit", "--config", write_config(tmp_path / "a", tiny_model_dir, tiny_corpus,
                                                             **{"trainer.max_steps": 6, **common})]).trainer
    run = tmp_path / "b"
    run.mkdir()
    cli.cli_main(["fit", "--config", write_config(run, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 4, **common})])
    ckpt = run / "ckpt"
    assert {p.name for p in ckpt.glob("*.ckpt")} >= {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"}
    # the kill: the step-4 save left both its files truncated
    for name in ("epoch=0-step=4.ckpt", "last.ckpt"):
        raw = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(raw[: len(raw) // 3])
    config = write_config(run, tiny_model_dir, tiny_corpus, **{"trainer.max_steps": 6, **common})
    with caplog.at_level(logging.INFO):
        resumed = cli.cli_main(["fit", "--config", config, "--ckpt_path", "last"]).trainer
    log = caplog.text
    assert "skipping" in log and "last.ckpt" in log and "epoch=0-step=4.ckpt" in log and "truncated" in log
    assert "resuming from" in log and "epoch=0-step=2.ckpt" in log
    assert resumed.global_step == straight.global_step == 6
    want, got = final_state(straight), final_state(resumed)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(value, got[key]), key
