"""Gradient clipping by norm reuses the norm the module computes for logging and the non-finite guard.

Through main.py with ``trainer.gradient_clip_val``: the gradients the optimizer sees equal
``torch.nn.utils.clip_grad_norm_`` applied to the unclipped ones, and the logged norm is theirs, and
Lightning's own clipping (a second pass over every gradient) is not called.
"""

from __future__ import annotations

import lightning as L
import torch

import main as cli
from tests._cli_runs import write_config

CLIP = 0.05  # small: every step of the tiny model is clipped


class GradientRecorder(L.Callback):
    """The gradients before clipping (callback hooks run before the module's and before clipping)
    and after the optimizer step (gradients stay until the next step's zero_grad), per step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _grads(pl_module) -> list[torch.Tensor]:
        return [p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before[trainer.global_step] = self._grads(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stepped = trainer.global_step - 1
        if stepped in self.before and stepped not in self.after:
            self.after[stepped] = self._grads(pl_module)


def test_clipping_matches_clip_grad_norm_without_a_second_norm_pass(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch):
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    lightning_calls = []
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: lightning_calls.append(1) or clip_grad_norm(*a, **k))
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "trainer.max_steps": 3,
        "trainer.gradient_clip_val": CLIP,
        "trainer.callbacks": [{"class_path": "tests.test_grad_clipping.GradientRecorder"}],
        "warmup.warmup_steps": 1,
    })
    run = cli.cli_main(["fit", "--config", config])
    recorder = next(c for c in run.trainer.callbacks if isinstance(c, GradientRecorder))
    assert sorted(recorder.before) == sorted(recorder.after) == [0, 1, 2]
    assert lightning_calls == []  # the module clipped with its own norm
    for step, unclipped in recorder.before.items():
        # clip_grad_norm_ needs parameters: give each its gradient
        params = [torch.nn.Parameter(torch.empty_like(g)) for g in unclipped]
        for p, g in zip(params, unclipped):
            p.grad = g.clone()
        norm = clip_grad_norm(params, CLIP)
        assert norm > CLIP  # clipping did something
        for p, got in zip(params, recorder.after[step]):
            torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=0)
