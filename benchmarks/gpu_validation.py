"""Validate a bare GPU machine in one command: ``bash benchmarks/gpu_validation.sh`` (this file does the work).

Needs nothing installed beyond the machine's torch: the bundle (``make gpu-bundle`` here, where PyPI is reachable:
``.gpu_bundle/``) is installed into a temporary directory first. Every stage runs under its own time limit (the
whole run under ``--budget`` seconds, default 480), writes its log under ``$OUT`` (or ``--out``), and can fail
without stopping the others; the run ends with one table. Without a GPU it runs in its CPU mode: every stage that
needs no GPU, at tiny sizes; the others say they wait for one.

Stages: bundle (install), environment (versions, imports), kernels (the backend and CUDA-exactness tests), fit
(``benchmarks/gpu_fit_check.py``: bf16-mixed fits, killed and resumed), export (``benchmarks/gpu_export_check.py``
on the resumed run), fsdp and ddp (``benchmarks/fsdp_fit.py``: FSDP2 and DDP on every GPU with NCCL; 2 gloo
processes in the CPU mode), export_fsdp (the FSDP2 run's sharded checkpoint exported and checked), step and step_fp8 (``benchmarks/step_overhead.py``: the QAT/BF16 step time and memory
ratios, emulated and FP8), profile (the step profile), fp8_check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = ("torch", "triton", "lightning", "transformers", "jsonargparse", "docstring_parser", "en_dtypes", "datasets",
           "torchdata", "gguf", "compressed_tensors", "safetensors", "torchmetrics", "pyarrow", "yaml")


@dataclass
class Stage:
    name: str
    command: list[str]
    limit_s: float
    figure: callable = None  # log text -> the table's figure
    needs_gpu: bool = False
    needs_gpus: int = 0  # on a GPU machine, the GPUs it needs (fewer: it waits for a machine with them)
    after: str | None = None  # a stage whose success this one needs
    status: str = "not run"
    seconds: float = 0.0
    shown: str = ""


def result_line(text: str) -> dict:
    """The last ``RESULT {json}`` line of a log ({} without one)."""
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {}


def pytest_summary(text: str) -> str:
    found = [line.strip("= ") for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return found[-1] if found else "no pytest summary"


def fit_figure(text: str) -> str:
    r = result_line(text)
    if not r:
        return "no RESULT line"
    return (f"killed at step {r['killed_at']} of {r['steps']}, resumed: data position "
            f"{'equal' if r['data_position_equal'] else 'DIFFERENT'}, loss diff {r['loss_diff_resumed']} "
            f"(A-B spread {r['loss_spread_ab']}), scaler diff {r.get('scaler_diff_resumed')} (spread "
            f"{r.get('scaler_spread_ab')}){', exact' if r['exact'] else ''}; {r['seconds_per_step']} s/step, "
            f"peak {r['peak_memory_gib']} GiB")


def export_figure(text: str) -> str:
    r = result_line(text)
    return (f"{r['codes']:,} codes ({r['compute_dtype']}): {r['differ_hif8']} differ in hif8, {r['differ_fp8']} in FP8"
            if r else "no RESULT line")


def pattern_figure(*patterns: tuple[str, str]):
    def figure(text: str) -> str:
        found = [f"{label} {m.group(1)}" for label, pattern in patterns if (m := re.search(pattern, text))]
        return ", ".join(found) or "no figure found"
    return figure


def multi_device_figure(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        return "no result line"
    r = json.loads(lines[-1])
    peak = f", peak {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None else ""
    return (f"{r.get('world_size')} processes ({r.get('backend')}), scalers "
            f"{'equal on every rank' if r.get('scalers_equal') else 'DIFFERENT across ranks'}, "
            f"{r.get('seconds_per_step')} s/step{peak}, final loss {r.get('final_loss')}"
            f"{', sharded checkpoint' if r.get('sharded_checkpoint') else ''}")


def stages(gpu: bool, out: Path, assets: Path | None, gpus: int = 0) -> list[Stage]:
    """The stages; ``gpus``: the GPUs the machine has (the DDP and FSDP2 fits train on all of them; in the CPU mode
    on 2 gloo processes)."""
    py = sys.executable
    device = "cuda" if gpu else "cpu"
    # every GPU of the machine (NCCL), or 2 processes in the CPU mode (gloo)
    spread = str(max(1, gpus)) if gpu else "2"
    asset_flag = ["--assets", str(assets)] if assets else []
    multi = [py, "benchmarks/fsdp_fit.py", "--device", device, "--devices", spread, "--steps", "8" if gpu else "4",
             *asset_flag, *([] if gpu else ["--tiny", "--seq-len", "64", "--micro-batch", "2"])]
    kernel_tests = (["tests/test_backends.py", "tests/test_cuda_exact.py", "tests/test_gemm.py", "tests/test_health.py",
                     "tests/test_whatif.py", "tests/test_saturation.py", "tests/test_linear.py"] if gpu
                    else ["tests/test_cuda_exact.py"])
    fit_size = (["--steps", "8", "--warmup", "3"] if gpu
                else ["--tiny", "--steps", "6", "--warmup", "2", "--seq-len", "64", "--micro-batch", "2"])
    step = [py, "benchmarks/step_overhead.py", "--openpangu", "--device", "cuda", "--seq-len", "1024", "--micro-batch", "8"]
    ratio = r"log_every_n_steps=50: QAT step / bf16 step ([\d.]+)"
    memory = r"peak memory .*ratio ([\d.]+)"
    return [
        Stage("environment", [py, "-c", ENVIRONMENT], 60, lambda t: t.strip().splitlines()[-1] if t.strip() else ""),
        Stage("kernels", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *kernel_tests], 90 if gpu else 240,
              pytest_summary),
        Stage("fit", [py, "benchmarks/gpu_fit_check.py", "--device", device, *asset_flag, "--seed", "0",
                      "--out", str(out / "fit"), *fit_size], 200 if gpu else 420, fit_figure),
        Stage("export", [py, "benchmarks/gpu_export_check.py", "--ckpt_path", str(out / "fit" / "c" / "checkpoints" / "last.ckpt"),
                         "--device", device, "--out", str(out / "export")], 60 if gpu else 120, export_figure, after="fit"),
        Stage("fsdp", [*multi, "--strategy", "fsdp2", "--out", str(out / "fsdp")], 90 if gpu else 300,
              multi_device_figure),
        Stage("export_fsdp", [py, "benchmarks/gpu_export_check.py", "--ckpt_path",
                              str(out / "fsdp" / "run" / "checkpoints" / "last.ckpt"), "--device", device,
                              "--out", str(out / "export_fsdp")], 60 if gpu else 120, export_figure, after="fsdp"),
        Stage("ddp", [*multi, "--strategy", "ddp", "--out", str(out / "ddp")], 90 if gpu else 240,
              multi_device_figure, needs_gpus=2),
        Stage("step", step, 50, pattern_figure(("QAT/BF16", ratio), ("memory", memory), ("health", r"health costs ([+-][\d.]+)")),
              needs_gpu=True),
        Stage("step_fp8", [*step, "--gemm", "fp8"], 40, pattern_figure(("QAT fp8/BF16", ratio), ("memory", memory)),
              needs_gpu=True),
        Stage("profile", [*step, "--profile", "--profile-health"], 30, lambda t: f"{len(t.splitlines())} lines (see log)",
              needs_gpu=True),
        Stage("fp8_check", [py, "benchmarks/fp8_check.py", "--device", device,
                            *([] if gpu else ["--hidden", "64", "--intermediate", "96", "--batch", "2", "--seq-len", "16"])],
              20 if gpu else 120, lambda t: (t.strip().splitlines() or ["no output"])[-1]),
    ]


ENVIRONMENT = """
import importlib, sys
found = []
for name in %r:
    try:
        module = importlib.import_module(name)
        found.append(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as err:
        found.append(f"{name} MISSING ({type(err).__name__})")
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"Python {sys.version.split()[0]}, {gpu}, CUDA {torch.version.cuda}")
print("; ".join(found))
sys.exit(1 if any("MISSING" in f for f in found) else 0)
""" % (IMPORTS,)


def install_bundle(bundle: Path, site: Path) -> tuple[str, str]:
    """(status, what) of installing ``bundle``'s wheels into ``site`` (one line on what is wrong, else installed)."""
    manifest = bundle / "manifest.json"
    if not manifest.is_file():
        return "MISSING", f"no bundle at {bundle} (run `make gpu-bundle` where PyPI is reachable); using what is installed"
    info = json.loads(manifest.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if info.get("python") != here:
        return "WRONG PYTHON", f"{bundle} is for Python {info.get('python')}, this is {here}: not installed"
    wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(site), *wheels], capture_output=True, text=True)
    if done.returncode != 0:
        return "FAILED", done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"pip exit {done.returncode}"
    return "ok", f"{len(wheels)} wheels ({info.get('bytes', 0) / 2**20:.1f} MiB) into {site}"


def waiting_for(stage: Stage, gpu: bool, gpus: int) -> str | None:
    """What ``stage`` waits for on this machine (None: it runs): a GPU, or more GPUs than a GPU machine has."""
    if stage.needs_gpu and not gpu:
        return "needs a GPU"
    if gpu and gpus < stage.needs_gpus:
        return f"needs {stage.needs_gpus} GPUs, this machine has {gpus}"
    return None


def run_stage(stage: Stage, out: Path, env: dict, deadline: float) -> None:
    limit = min(stage.limit_s, deadline - time.monotonic())
    if limit < 5:
        stage.status, stage.shown = "NOT RUN", "the validation's time budget is spent"
        return
    log = out / f"{stage.name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        process = subprocess.Popen(stage.command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            code = None
    stage.seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    try:
        stage.shown = stage.figure(text) if stage.figure else ""
    except (KeyError, ValueError, TypeError) as err:
        stage.shown = f"unreadable result ({err})"
    if code is None:
        stage.status = "TIMEOUT"
        stage.shown = f"over its limit of {limit:.0f} s; {stage.shown}"
    else:
        stage.status = "ok" if code == 0 else "FAILED"
        if code != 0:
            stage.shown = f"exit {code}, see {log}; {stage.shown}"


def table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"| {r[0]:<{widths[0]}} | {r[1]:<{widths[1]}} | {r[2]:>{widths[2]}} | {r[3]} |" for r in rows]
    lines.insert(1, f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 2)}|{'-' * (widths[2] + 2)}|---|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(ROOT / ".gpu_bundle"))
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path(tempfile.gettempdir()) / "gpu_validation"))
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all stages together (default 480)")
    p.add_argument("--cpu", action="store_true", help="the CPU mode even where a GPU is")
    p.add_argument("--only", nargs="*", default=None, help="run only these stages")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="qat_app_site_"))
    bundle_status, bundle_what = install_bundle(Path(args.bundle), site)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(site) if bundle_status == "ok" else "", str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")) if p))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available(), "
                            "torch.cuda.device_count())"], env=env, capture_output=True, text=True)
    found = probe.stdout.split()
    gpu = found[:1] == ["True"] and not args.cpu
    gpus = int(found[1]) if gpu and len(found) > 1 else 0
    rows = [("stage", "status", "seconds", "figure"), ("bundle", bundle_status, "", bundle_what)]
    if not gpu:
        rows.append(("gpu", "NONE", "", "no GPU found (torch.cuda.is_available() is False): the CPU mode, tiny sizes"
                     if not args.cpu else "--cpu: the CPU mode, tiny sizes"))
    assets = Path(args.bundle) / "assets" if (Path(args.bundle) / "assets").is_dir() else None
    done: dict[str, Stage] = {}
    for stage in stages(gpu, out, assets, gpus):
        if args.only is not None and stage.name not in args.only:
            continue
        waits = waiting_for(stage, gpu, gpus)
        if waits:
            stage.status, stage.shown = "WAITS", waits
        elif stage.after and done.get(stage.after) and done[stage.after].status != "ok":
            stage.status, stage.shown = "NOT RUN", f"needs the {stage.after} stage, which did not pass"
        else:
            run_stage(stage, out, env, deadline)
        done[stage.name] = stage
        rows.append((stage.name, stage.status, f"{stage.seconds:.0f}" if stage.seconds else "", stage.shown))
        print(f"{stage.name}: {stage.status} {stage.shown}", flush=True)
    shutil.rmtree(site, ignore_errors=True)
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    failed = [s for s in done.values() if s.status not in ("ok", "WAITS")]
    return 1 if failed or bundle_status not in ("ok", "MISSING", "WRONG PYTHON") else 0


if __name__ == "__main__":
    sys.exit(main())
