"""A short fit of an OpenPangu-Embedded-1B-shaped model through ``main.py`` on every device, FSDP2 or DDP, timed.

Builds a random Llama with openPangu-Embedded-1B's shape (26 blocks, 1536 / 6144, 12 heads, vocab
153,376) with the GPU bundle's tokenizer (``--assets``) or the embedded one in a temporary directory, then runs
``python main.py fit`` with ``ModelParallelStrategy`` (FSDP2: fully_shard per block) or DDP on ``--devices``
devices (default: every visible GPU; NCCL on GPUs, gloo on the CPU) for ``--steps`` optimizer steps of the exp8
recipe (max window 64, warmup, QAT), and prints one line of JSON: steps, seconds per step after the first two, peak
GPU memory, the final loss, the world size and process-group backend, whether every rank ended with the same
scaler state (the per-step MAX all-reduce), whether the checkpoint is sharded, the run directory.
``--tiny`` uses a 3-block model instead (the CPU mode, 2 gloo processes in tests/test_gpu_validation.py).

    python benchmarks/fsdp_fit.py --device cuda --steps 20                 # FSDP2 on every GPU
    python benchmarks/fsdp_fit.py --device cuda --steps 20 --strategy ddp
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import int_options  # noqa: E402
from benchmarks.gpu_fit_check import base_config, build_model_dir, bundled_assets  # noqa: E402


# the scaler state every rank must hold alike after each step's MAX all-reduce (what decides the next scale, and
# the saturation events); the element counters (clipped, quantized) stay per rank and are summed when logged
REPLICATED = ("amax_history", "a_hat", "scale", "steps_recorded", "smoothed_a_hat", "last_amax", "last_a_hat",
              "saturation_events")


class PeakMemory(L.Callback):
    """Writes the device's peak allocated memory at the end of training (``peak_memory.json``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps({"peak_memory_gib": None if peak is None else peak / 2**30}))


class RankAgreement(L.Callback):
    """At the end of training, whether every rank holds the same scaler buffers (a digest of each rank's,
    gathered), with the world size and the process group's backend (``ranks.json``, written by rank 0)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        digest = hashlib.sha1()
        for name, value in sorted(pl_module.state_dict().items()):
            if "_scaler." in name and name.rsplit(".", 1)[-1] in REPLICATED:
                digest.update(name.encode())
                digest.update(value.detach().float().cpu().numpy().tobytes())
        digests = [digest.hexdigest()]
        backend = None
        if dist.is_available() and dist.is_initialized():
            digests = [None] * dist.get_world_size()
            dist.all_gather_object(digests, digest.hexdigest())
            backend = dist.get_backend()
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps({
                "world_size": trainer.world_size, "backend": backend, "scalers_equal": len(set(digests)) == 1,
                "devices": [str(torch.device(pl_module.device))]}))


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    int_options(p, steps=20, seq_len=1024, micro_batch=4)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--strategy", default="fsdp2", choices=("fsdp2", "ddp"))
    p.add_argument("--devices", type=int, default=None,
                   help="processes (default: every visible GPU on cuda, 1 on the CPU)")
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--assets", default=None, help="the GPU bundle's assets/ (tokenizer, corpus.jsonl); default: embedded")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="fsdp_fit_"))
    run = work / "run"
    tokenizer_dir, corpus = bundled_assets(args.assets)
    model_dir = build_model_dir(work / "model", args.tiny, tokenizer_dir, args.device)
    warmup = max(1, args.steps // 4)
    devices = args.devices or (max(1, visible_gpus()) if args.device == "cuda" else 1)
    strategy = ({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                 "init_args": {"data_parallel_size": devices, "tensor_parallel_size": 1}}
                if args.strategy == "fsdp2" else "ddp" if devices > 1 else "auto")
    callbacks = [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(run / "checkpoints"), "save_last": True, "every_n_train_steps": args.steps}},
                 {"class_path": "benchmarks.fsdp_fit.PeakMemory", "init_args": {"path": str(work / "peak.json")}},
                 {"class_path": "benchmarks.fsdp_fit.RankAgreement", "init_args": {"path": str(work / "ranks.json")}}]
    config = base_config(args, run, devices, model_dir, corpus, warmup, 64, args.micro_batch * devices, callbacks)
    config["trainer"].update(log_every_n_steps=1, limit_val_batches=0, strategy=strategy)
    config["initial_eval"] = {"enabled": False}
    config_file = work / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if args.device == "cpu" else "4"))
    subprocess.run([sys.executable, str(ROOT / "main.py"), "fit", "--config", str(config_file)], cwd=ROOT, check=True,
                   env=env)
    rows = [r for f in sorted(run.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    times = {int(r["step"]): float(r["train/time"]) for r in rows if r.get("train/time")}
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    steps = sorted(times)
    per_step = ((times[steps[-1]] - times[steps[1]]) / (steps[-1] - steps[1])) if len(steps) > 2 else float("nan")
    peak = json.loads((work / "peak.json").read_text())["peak_memory_gib"] if (work / "peak.json").is_file() else None
    ranks = json.loads((work / "ranks.json").read_text()) if (work / "ranks.json").is_file() else {}
    print(json.dumps({"strategy": args.strategy, "steps": args.steps, "seconds_per_step": round(per_step, 4),
                      "final_loss": losses[-1] if losses else None, "peak_memory_gib": peak,
                      "quantized_from_step": warmup, "world_size": ranks.get("world_size"),
                      "backend": ranks.get("backend"), "scalers_equal": ranks.get("scalers_equal"),
                      "sharded_checkpoint": (run / "checkpoints" / "last.ckpt" / ".metadata").is_file(),
                      "checkpoint": str(run / "checkpoints" / "last.ckpt"), "run_dir": str(run)}))
    if ranks.get("scalers_equal") is False:
        sys.exit("error: the ranks ended with different scaler states (the per-step MAX all-reduce did not hold)")


if __name__ == "__main__":
    main()
