"""Synthetic run directories for tests/test_report.py: metrics.csv, config.yaml, per-example jsonl, summary."""

from __future__ import annotations

import copy
import csv
import json
import os
from pathlib import Path

import yaml


def write_csv(path, rows):
    """Rows as dicts -> a CSVLogger-like file (union of keys as the header, empty cells for missing)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def config(root: Path, quantized: bool, **overrides) -> dict:
    """A LightningCLI config.yaml as a dict; ``overrides`` are dotted keys (``model.lr=1e-4``)."""
    cfg = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu", "precision": "32-true", "max_steps": 4, "default_root_dir": str(root),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(root), "name": "logs", "version": None}}],
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(root / "checkpoints"), "save_last": True}}],
        },
        "model": {"model_name": "embedded:smollm2-135m-instruct", "lr": 1e-5,
                  "quant": {"enabled": quantized, "format": "hif8", "amax_algo": "max", "history_len": 8}},
        "warmup": {"warmup_steps": 2 if quantized else 0},
        "saturation": {"per_layer": True},
        "ckpt_path": None,
    }
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[last] = value
    return copy.deepcopy(cfg)


def records(task: str, correct: list[int], step: int, subject: str | None = None, start: int = 0) -> list[dict]:
    """One record per example; acc_norm equals acc."""
    return [{"task": task, "doc_id": start + i, "subject": subject, "gold": 0, "loglik": [-1.0, -2.0],
             "pred": 0 if c else 1, "pred_norm": 0 if c else 1, "acc": int(c), "acc_norm": int(c), "step": step}
            for i, c in enumerate(correct)]


def write_samples(version_dir: Path, stage: str, step: int, rows: list[dict]) -> Path:
    path = Path(version_dir) / "benchmark_samples" / f"{stage}_step{step:07d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def benchmark_row(step: int, rows: list[dict], stage: str = "val") -> dict:
    """The metrics.csv row a validation with these records logs (acc, acc_norm, count per task)."""
    out = {"step": step}
    for task in sorted({r["task"] for r in rows}):
        mine = [r for r in rows if r["task"] == task]
        out[f"{stage}/{task}/acc"] = sum(r["acc"] for r in mine) / len(mine)
        out[f"{stage}/{task}/acc_norm"] = sum(r["acc_norm"] for r in mine) / len(mine)
        out[f"{stage}/{task}/count"] = len(mine)
    return out


def make_run(root: Path, quantized: bool, final: list[dict] | None, initial: list[dict] | None = None,
             last_step: int = 4, cfg: dict | None = None, losses=None, samples: bool = True) -> Path:
    """A run dir with train/loss on steps 0..last_step-1, a step-0 validation (``initial``) and a final one."""
    version = root / "logs" / "version_0"
    losses = losses or [3.0 - 0.1 * s for s in range(last_step)]
    rows = [{"step": s, "train/loss": v} for s, v in enumerate(losses)]
    for step, recs in ((0, initial), (last_step - 1, final)):
        if recs:
            rows.append(benchmark_row(step, recs))
            if samples:
                write_samples(version, "val", step, recs)
    write_csv(version / "metrics.csv", rows)
    if cfg is not False:
        (version / "config.yaml").write_text("# lightning.pytorch==2.6.6\n" + yaml.safe_dump(cfg or config(root, quantized)))
    return root
