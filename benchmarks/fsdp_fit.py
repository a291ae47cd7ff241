"""A short bf16-mixed FSDP2 fit of an OpenPangu-Embedded-1B-shaped model through ``main.py``, timed.

Builds a random Llama with openPangu-Embedded-1B's shape (26 blocks, 1536 / 6144, 12 heads, vocab
153,376) with the GPU bundle's tokenizer (``--assets``) or the embedded one in a temporary directory, then runs
``python main.py fit`` with ``ModelParallelStrategy`` (fully_shard per block) on one device for
``--steps`` optimizer steps of the exp8 recipe (max window 64, warmup, QAT), and prints one line of
JSON: steps, seconds per step after the first two, peak GPU memory, the final loss, the run directory.
``--tiny`` uses a 3-block model instead (the CPU check in tests/test_gpu_validation.py).

    python benchmarks/fsdp_fit.py --device cuda --steps 20
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_fit_check import build_model_dir, bundled_assets  # noqa: E402


try:
    import lightning as L

    class PeakMemory(L.Callback):
        """Writes the device's peak allocated memory at the end of training (``peak_memory.json``)."""

        def __init__(self, path: str) -> None:
            self.path = path

        def on_train_end(self, trainer, pl_module) -> None:
            import torch

            peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
            if trainer.global_rank == 0:
                Path(self.path).write_text(json.dumps({"peak_memory_gib": None if peak is None else peak / 2**30}))
except ImportError:  # pragma: no cover
    pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--assets", default=None, help="the GPU bundle's assets/ (tokenizer, corpus.jsonl); default: embedded")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="fsdp_fit_"))
    tokenizer_dir, corpus = bundled_assets(args.assets)
    model_dir = build_model_dir(work / "model", args.tiny, tokenizer_dir, args.device)
    warmup = max(1, args.steps // 4)
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if args.device == "cuda" else "cpu", "devices": 1, "max_steps": args.steps,
            "precision": "bf16-mixed" if args.device == "cuda" else "32-true", "log_every_n_steps": 1,
            "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                         "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1}},
            "default_root_dir": str(work / "run"),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(work / "run"), "name": "logs"}}],
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(work / "run" / "checkpoints"), "save_last": True,
                                         "every_n_train_steps": args.steps}},
                          {"class_path": "benchmarks.fsdp_fit.PeakMemory", "init_args": {"path": str(work / "peak.json")}}],
        },
        "warmup": {"warmup_steps": warmup},
        "initial_eval": {"enabled": False},
        "model": {"model_name": str(model_dir), "lr": 1e-5, "lr_schedule": "constant",
                  "quant": {"amax_algo": "max", "history_len": 64, "high_precision_layers": 5 if not args.tiny else 1}},
        "data": {"class_path": "qat_app.data.pretrain.PretrainDataModule",
                 "init_args": {"data_files": corpus, "dataset": None, "seq_len": args.seq_len,
                               "micro_batch_size": args.micro_batch, "global_batch_size": args.micro_batch}},
    }
    config_file = work / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    subprocess.run([sys.executable, str(ROOT / "main.py"), "fit", "--config", str(config_file)], cwd=ROOT, check=True)
    rows = [r for f in sorted((work / "run").glob("logs/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    times = {int(r["step"]): float(r["train/time"]) for r in rows if r.get("train/time")}
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    steps = sorted(times)
    per_step = ((times[steps[-1]] - times[steps[1]]) / (steps[-1] - steps[1])) if len(steps) > 2 else float("nan")
    peak = json.loads((work / "peak.json").read_text())["peak_memory_gib"] if (work / "peak.json").is_file() else None
    print(json.dumps({"steps": args.steps, "seconds_per_step": round(per_step, 4), "final_loss": losses[-1] if losses else None,
                      "peak_memory_gib": peak, "quantized_from_step": warmup,
                      "sharded_checkpoint": (work / "run" / "checkpoints" / "last.ckpt" / ".metadata").is_file(),
                      "run_dir": str(work / "run")}))


if __name__ == "__main__":
    main()
