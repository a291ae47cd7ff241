"""The GPU validation's FSDP2 fit (benchmarks/fsdp_fit.py), run on the CPU with a tiny model: the script the
GPU session runs once must work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fsdp_fit_script_runs_and_reports(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_fit.py"), "--device", "cpu", "--tiny",
                           "--steps", "4", "--seq-len", "64", "--micro-batch", "2", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["sharded_checkpoint"] is True
    assert result["seconds_per_step"] > 0 and result["final_loss"] > 0
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_validation.sh")]).returncode == 0


def test_fp8_check_script_runs_on_the_cpu_and_reports_agreement():
    """benchmarks/fp8_check.py (the GPU validation's FP8-vs-emulated check) at a tiny shape on the CPU, where
    torch._scaled_mm also runs: the exact tail agrees with the emulation up to the accumulation order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_check.py"), "--device", "cpu", "--hidden", "64",
                           "--intermediate", "96", "--batch", "2", "--seq-len", "16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    errors = [float(e) for e in line.split(": ", 1)[1].split()]
    assert len(errors) == 3 and all(0 <= e < 1e-6 for e in errors), line  # fp32 on the CPU: accumulation order only
