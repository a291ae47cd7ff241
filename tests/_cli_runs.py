"""Runs of ``main.py fit`` on the tiny model and corpus: the shared config, and the callbacks the tests
name by class path (they live here, not in a test file, so no test imports another)."""

from __future__ import annotations

import lightning as L
import yaml

from qat_app.hif8.patch import quantized_linears
from qat_app.hif8.operand import Operand

WARMUP, STEPS, HISTORY = 3, 6, 5
# a few offline benchmark questions for fits that need per-example records (seconds on the tiny model)
TINY_BENCHMARKS = {
    "class_path": "qat_app.data.benchmarks.BenchmarkDataModule",
    "init_args": {"tasks": ["arc_challenge", "mmlu"], "mmlu_subjects": ["anatomy"], "limit": 12, "batch_size": 12,
                  "source": "local"},
}


class PhaseRecorder(L.Callback):
    """Records, per optimizer step, whether quantization was on and the history fill at the switch."""

    def __init__(self) -> None:
        self.phases: dict[int, tuple[bool, bool]] = {}
        self.history_at_switch = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        layers = [m for _, m in quantized_linears(pl_module.model)]
        self.phases[trainer.global_step] = (
            all(m.quantizes(Operand.WEIGHT) for m in layers), all(m.quantizes(Operand.INPUT) for m in layers))
        if trainer.global_step == WARMUP:  # the first QAT step, before its own amax is pushed
            self.history_at_switch = layers[0].input_scaler.amax_history.clone()


class SimulatedCrash(RuntimeError):
    pass


class CrashAt(L.Callback):
    """Kills the run at the start of optimizer step ``step`` (after the checkpoint of step ``step`` was saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise SimulatedCrash(f"simulated node failure at step {self.step}")


def write_config(tmp_path, model_dir, corpus, **overrides) -> str:
    """``tmp_path/config.yaml``: a 6-step fit (3 warmup steps, history 5, checkpoints every 2 steps);
    ``overrides`` are dotted keys (``"trainer.max_steps": 4``) replacing single entries."""
    config = {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": STEPS,
            "log_every_n_steps": 1, "num_sanity_val_steps": 0, "val_check_interval": 2 * STEPS,
            "check_val_every_n_epoch": None, "enable_progress_bar": False, "default_root_dir": str(tmp_path),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(tmp_path), "name": "logs"}}],
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True, "every_n_train_steps": 2,
                               "save_top_k": -1}},
                {"class_path": "tests._cli_runs.PhaseRecorder"},
            ],
        },
        "warmup": {"warmup_steps": WARMUP},
        "model": {"model_name": str(model_dir), "lr": 1e-3, "lr_schedule": "constant",
                  "quant": {"amax_algo": "max", "history_len": HISTORY, "high_precision_layers": 1, "fused": "off"}},
        "data": {"class_path": "qat_app.data.pretrain.PretrainDataModule",
                 "init_args": {"data_files": str(corpus), "dataset": None, "seq_len": 32, "micro_batch_size": 2,
                               "global_batch_size": 4, "val_documents": 4}},
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def checkpointed_fit(directory, model_dir, corpus, *extra, crash_at: int | None = None, **overrides):
    """``main.py fit`` in ``directory`` with a checkpoint every 2 steps (``last`` kept), killed at the start of step
    ``crash_at`` when given (:class:`CrashAt`); ``extra``: command-line flags (``--ckpt_path last`` resumes)."""
    import main as cli

    directory.mkdir(parents=True, exist_ok=True)
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(directory / "ckpt"), "save_last": True, "every_n_train_steps": 2,
                                "save_top_k": -1}}]
    if crash_at is not None:
        callbacks.append({"class_path": "tests._cli_runs.CrashAt", "init_args": {"step": crash_at}})
    config = write_config(directory, model_dir, corpus, **overrides, **{"trainer.callbacks": callbacks})
    return cli.cli_main(["fit", "--config", config, *extra]).trainer
