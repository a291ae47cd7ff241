"""``main.py fit`` on 2 CPU processes (gloo): the DDP config, the per-rank dump callback, running main.py
in a subprocess and reading its dumps (shared by the DDP and FSDP2 tests)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import lightning as L
import torch

from tests._cli_runs import write_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WARMUP = 4, 2
# identical on every rank; the saturation counters (clipped / seen elements) stay per rank
SYNCED = ("amax_history", "a_hat", "scale", "steps_recorded", "last_amax", "last_a_hat")


class RankDump(L.Callback):
    """Writes, per rank, the batches and losses it trained on and its scaler states at the end of fit."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: dict[str, list] = {}
        self._step = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        digest = hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12]
        self.records[f"{self._step}/{batch_idx}"] = [float(outputs["loss"]), digest]

    def on_train_end(self, trainer, pl_module) -> None:
        scalers = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items() if "_scaler." in k}
        os.makedirs(self.out_dir, exist_ok=True)
        torch.save({"records": self.records, "scalers": scalers, "world_size": trainer.world_size,
                    "global_step": trainer.global_step, "skipped_steps": int(pl_module.skipped_steps)},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class WeightCodes(L.Callback):
    """At the end of training, every quantized weight's codes as the training forward computes them from the live
    (under FSDP2: sharded, gathered) weights and scales (``benchmarks.gpu_export_check.training_codes``), written
    by rank 0 to ``path``: what an export of the run's last checkpoint must hold."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        from benchmarks.gpu_export_check import training_codes
        from qat_app.precision import COMPUTE_DTYPES

        codes = training_codes(pl_module, compute=getattr(torch, COMPUTE_DTYPES[str(trainer.precision)]))
        if trainer.global_rank == 0:
            torch.save(codes, self.path)


def ddp_config(tmp_path, model_dir, corpus) -> str:
    return write_config(
        tmp_path, model_dir, corpus,
        **{
            "trainer.strategy": "ddp",
            "trainer.devices": 2,
            "trainer.max_steps": STEPS,
            "trainer.callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 2,
                               "save_top_k": -1}},
                {"class_path": "tests._ddp_runs.RankDump", "init_args": {"out_dir": str(tmp_path / "dump")}},
            ],
            "warmup.warmup_steps": WARMUP,
            "model.quant.quantize_grads": True,  # per-rank RNG draws (stochastic rounding)
            "data.init_args.global_batch_size": 8,  # 2 ranks x micro-batch 2 x accumulation 2
        },
    )


def run_main(args: list[str], timeout: int = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def dumps(directory) -> list[dict]:
    return [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=True) for r in range(2)]
