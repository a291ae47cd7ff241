"""Non-finite guard through main.py: a NaN injected into one HiF8Linear input in a chosen step.

* one bad step (NaN in the *first* of two accumulated micro-batches): the optimizer step is skipped (weights
  and AdamW moments untouched), the step's amax observations are discarded (every history, a_hat and
  scale stays finite; the step is not recorded), the skip is logged and counted, training continues;
* ``model.max_consecutive_nonfinite`` bad steps in a row stop the run with NonFiniteStepError before the
  bad state is checkpointed: the last.ckpt on disk (ModelCheckpoint every step) is finite.
"""

from __future__ import annotations

import csv
import logging
import math
import os

import lightning as L
import pytest
import torch

import main as cli
from qat_app.module import NonFiniteStepError
from qat_app.hif8.patch import quantized_linears
from tests._cli_runs import write_config

STEPS, WARMUP = 6, 2


class InjectNaN(L.Callback):
    """Multiplies the input of the first HiF8Linear by NaN in micro-batch ``micro_batch`` (None: every one)
    of each optimizer step in ``steps``; records the weights around the steps and the micro-batch losses."""

    def __init__(self, steps: list[int], micro_batch: int | None = None) -> None:
        self.steps, self.micro_batch = set(steps), micro_batch
        self._handle = None
        self.weights_at_step_start: dict[int, torch.Tensor] = {}
        self.losses: dict[tuple[int, int], float] = {}
        self._step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = step = trainer.global_step
        layer = quantized_linears(pl_module.model)[0][1]
        self.weights_at_step_start.setdefault(step, layer.weight.detach().clone())
        micro = batch_idx % trainer.accumulate_grad_batches
        if step in self.steps and (self.micro_batch is None or micro == self.micro_batch):
            self._handle = layer.register_forward_pre_hook(lambda module, args: (args[0] * float("nan"),))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[(self._step, batch_idx)] = float(outputs["loss"])
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _config(tmp_path, model_dir, corpus, *, steps, micro_batch, limit, every_n=2):
    return write_config(
        tmp_path, model_dir, corpus,
        **{
            "trainer.max_steps": STEPS,
            "trainer.callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": every_n,
                               "save_top_k": -1}},
                {"class_path": "tests.test_nonfinite.InjectNaN", "init_args": {"steps": steps, "micro_batch": micro_batch}},
            ],
            "warmup.warmup_steps": WARMUP,
            "model.max_consecutive_nonfinite": limit,
        },
    )


def _all_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_nan_in_one_step_is_skipped_and_training_continues(tmp_path, tiny_model_dir, tiny_corpus, caplog):
    bad = 3  # a quantized step (after the 2-step warmup); NaN in micro-batch 0 of 2, not the last one
    config = _config(tmp_path, tiny_model_dir, tiny_corpus, steps=[bad], micro_batch=0, limit=3)
    with caplog.at_level(logging.WARNING, logger="qat_app.module"):
        run = cli.cli_main(["fit", "--config", config])
    module, trainer = run.model, run.trainer
    inject = next(c for c in trainer.callbacks if isinstance(c, InjectNaN))
    assert trainer.global_step == STEPS  # training went on to the end
    # the bad step's losses: NaN in the injected micro-batch only; all other steps finite
    assert math.isnan(inject.losses[(bad, 2 * bad)]) and math.isfinite(inject.losses[(bad, 2 * bad + 1)])
    assert all(math.isfinite(v) for (s, _), v in inject.losses.items() if s != bad)
    # skipped: the weights did not move in the bad step, but did in every other one
    w = inject.weights_at_step_start
    assert torch.equal(w[bad], w[bad + 1])
    assert not torch.equal(w[bad - 1], w[bad]) and not torch.equal(w[bad + 1], w[bad + 2])
    # AdamW's step counter: one optimizer step fewer than trainer steps
    steps = {int(s["step"]) for s in trainer.optimizers[0].state_dict()["state"].values()}
    assert steps == {STEPS - 1}
    # the histories never saw the NaN and did not record the skipped step
    scalers = [s for _, layer in quantized_linears(module.model) for s in layer.scalers()]
    assert scalers and _all_finite(t for s in scalers for t in s.buffers())
    assert {int(s.steps_recorded) for s in scalers} == {STEPS - 1}
    assert all((s.amax_history[: min(STEPS - 1, s.history_len)] > 0).all() for s in scalers)
    # counted, logged and warned about
    assert int(module.skipped_steps) == 1 and module.consecutive_nonfinite == 0
    rows = list(csv.DictReader(open(os.path.join(trainer.logger.log_dir, "metrics.csv"))))
    skipped = {int(r["step"]): float(r["train/skipped_steps"]) for r in rows if r.get("train/skipped_steps")}
    assert skipped[bad - 1] == 0.0 and skipped[bad] == 1.0 and skipped[STEPS - 1] == 1.0
    assert any(f"non-finite loss or gradient at optimizer step {bad}" in r.message for r in caplog.records)


def test_consecutive_nonfinite_steps_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, tiny_model_dir, tiny_corpus):
    # NaN in the last micro-batch of every step from 3 on; the run stops at the 2nd bad step in a row (step 4)
    config = _config(tmp_path, tiny_model_dir, tiny_corpus, steps=[3, 4, 5], micro_batch=1, limit=2, every_n=1)
    with pytest.raises(NonFiniteStepError, match=r"2 consecutive optimizer steps .*model\.max_consecutive_nonfinite=2"):
        cli.cli_main(["fit", "--config", config])
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    # the newest checkpoint is the one after step 3 (skipped: the weights of step 2's update), nothing of step 4
    assert last["global_step"] == 4
    assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == "last.ckpt"
    assert not (tmp_path / "ckpt" / "epoch=0-step=5.ckpt").exists()
    state = last["state_dict"]
    assert _all_finite(state.values())
    assert _all_finite(t for s in last["optimizer_states"][0]["state"].values() for t in s.values())
    assert any(k.endswith("amax_history") for k in state)
    assert int(state["skipped_steps"]) == 1 and last["qat_app"]["consecutive_nonfinite"] == 1
    step3 = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=True)["state_dict"]
    for key, value in step3.items():  # the skipped step 3 left weights and histories exactly as they were
        if isinstance(value, torch.Tensor) and key != "skipped_steps":
            assert torch.equal(value, state[key]), key
