"""benchmarks/serve_speed.py without the engine: a stalled export becomes one row naming its kernel and this CPU,
the table's ratios are against BF16, bad input is one line."""

import importlib.util
import stat
from pathlib import Path

import pytest

from qat_app.export import engine_check


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location(
        "serve_speed", Path(__file__).resolve().parents[1] / "benchmarks" / "serve_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stalled_export_is_one_row_naming_its_kernel_and_the_cpu(tmp_path, speed):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.32.0; exit 0; fi\n'
                      'echo "INFO Selected ChannelWiseTorchFP8ScaledMMLinearKernel for CompressedTensorsW8A8Fp8" >&2\n'
                      "exec sleep 60\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "fp8").mkdir()
    stalled = speed.serve_one(python, tmp_path / "fp8", prompts=1, max_tokens=4, timeout=2)
    served = {"kernels": {"CompressedTensorsW8A8Int8": "CPUInt8ScaledMMLinearKernel"}, "load": 9.0, "tokens": 96,
              "seconds": 1.0, "first": " Paris.", "mib": 170.0}
    baseline = {"kernels": {}, "load": 8.0, "tokens": 96, "seconds": 0.96, "first": " Paris.", "mib": 257.0}
    rows = speed.table({"fp8": stalled, "int8": served, "bf16": baseline}).splitlines()
    assert rows[2].startswith("| fp8 |") and "stopped" in rows[2] and "\n" not in stalled["error"]
    assert "ChannelWiseTorchFP8ScaledMMLinearKernel" in rows[2] and engine_check.cpu_features() in rows[2]
    assert "| 96.0 | 0.96 |" in rows[3] and "CPUInt8ScaledMMLinearKernel" in rows[3]  # 96 / 100 tokens/s
    assert "| 100.0 | 1.00 |" in rows[4] and "dense" in rows[4]


def test_bad_input_is_one_line(tmp_path, speed, capsys):
    assert speed.main(["--ckpt_path", str(tmp_path / "x.ckpt"), "--out", str(tmp_path / "o"),
                       "--vllm_venv", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --vllm_venv") and not (tmp_path / "o").exists()
