"""The GPU validation's FSDP2 fit (benchmarks/fsdp_fit.py), run on the CPU with a tiny model: the script the
GPU session runs once must work before a GPU is lent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_the_multi_device_fit_trains_on_every_process_and_reports(tmp_path, strategy):
    """The validation's fsdp and ddp stages in the CPU mode: 2 gloo processes (every GPU with NCCL on a GPU
    machine), one world, the same scaler state on every rank after the per-step MAX all-reduce."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_fit.py"), "--device", "cpu", "--tiny",
                           "--steps", "4", "--seq-len", "64", "--micro-batch", "2", "--devices", "2",
                           "--strategy", strategy, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 4 and result["sharded_checkpoint"] is (strategy == "fsdp2")
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["scalers_equal"] is True
    assert result["seconds_per_step"] > 0 and result["final_loss"] > 0
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_validation.sh")]).returncode == 0


def test_the_multi_device_stages_use_every_gpu_and_ddp_waits_for_two():
    validation = _validation()
    on_gpus = {s.name: s for s in validation.stages(True, Path("/o"), None, gpus=8)}
    on_cpu = {s.name: s for s in validation.stages(False, Path("/o"), None)}
    for name, strategy in (("fsdp", "fsdp2"), ("ddp", "ddp")):
        for built, devices in ((on_gpus, "8"), (on_cpu, "2")):
            command = built[name].command
            assert command[command.index("--devices") + 1] == devices
            assert command[command.index("--strategy") + 1] == strategy
    assert validation.waiting_for(on_gpus["ddp"], gpu=True, gpus=1) == "needs 2 GPUs, this machine has 1"
    assert validation.waiting_for(on_gpus["ddp"], gpu=True, gpus=8) is None
    assert validation.waiting_for(on_cpu["ddp"], gpu=False, gpus=0) is None  # 2 gloo processes
    assert validation.waiting_for(on_gpus["fsdp"], gpu=True, gpus=1) is None


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


def _benchmarks(*names: str):
    """The scripts ``benchmarks/<name>.py`` as modules (they import each other by bare name)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _validation():
    return _benchmarks("gpu_validation")[0]


def test_a_missing_or_foreign_bundle_is_one_line_and_nothing_is_installed(tmp_path):
    validation = _validation()
    status, what = validation.install_bundle(tmp_path / "none", tmp_path / "site")
    assert status == "MISSING" and "make gpu-bundle" in what
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text(json.dumps({"python": "3.99", "wheels": []}))
    status, what = validation.install_bundle(tmp_path / "b", tmp_path / "site")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert status == "WRONG PYTHON" and what.endswith(f"is for Python 3.99, this is {here}: not installed")
    assert not (tmp_path / "site").exists()


def test_a_stage_over_its_limit_is_stopped_and_named(tmp_path):
    validation = _validation()
    stage = validation.Stage("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                             limit_s=6, figure=lambda text: text.strip())
    validation.run_stage(stage, tmp_path, dict(os.environ), deadline=__import__("time").monotonic() + 100)
    assert stage.status == "TIMEOUT" and stage.shown == "over its limit of 6 s; started" and stage.seconds < 30
    spent = validation.Stage("late", [sys.executable, "-c", "pass"], limit_s=60)
    validation.run_stage(spent, tmp_path, dict(os.environ), deadline=__import__("time").monotonic() + 1)
    assert spent.status == "NOT RUN" and "budget is spent" in spent.shown


def test_the_cpu_mode_runs_what_needs_no_gpu_and_ends_with_one_table(tmp_path):
    """No GPU: one line says so, the GPU-only stages wait for one, the others run; a failing stage does not stop the
    rest (the missing modules of a stage's environment make it fail, named)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_validation.py"), "--cpu", "--out", str(tmp_path),
                           "--bundle", str(tmp_path / "no-bundle"), "--only", "environment", "step", "fp8_check"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    table = (tmp_path / "table.md").read_text()
    assert done.stdout.rstrip().endswith(table.strip())  # the table printed last is the one saved
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[2:]}
    assert rows["bundle"][0] == "MISSING" and rows["gpu"][0] == "NONE"
    assert rows["step"][:1] == ["WAITS"] and rows["step"][2] == "needs a GPU"
    assert rows["fp8_check"][0] == "ok" and rows["fp8_check"][2].startswith("fp8 vs emulated")
    assert rows["environment"][0] in ("ok", "FAILED") and "Python" in (tmp_path / "environment.log").read_text()
    assert done.returncode == (0 if rows["environment"][0] == "ok" else 1)


@pytest.mark.slow
def test_the_fit_stage_resumes_exactly_and_the_export_holds_the_trained_codes(tmp_path):
    """The validation's fit and export stages at tiny sizes on the CPU (fp32: deterministic, so exactly)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_fit_check.py"), "--device", "cpu", "--tiny",
                           "--steps", "6", "--warmup", "2", "--seq-len", "64", "--micro-batch", "2", "--seed", "1",
                           "--out", str(tmp_path / "fit")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    fit = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert done.returncode == 0 and fit["resume_ok"], fit
    assert fit["killed"] and fit["return_codes"]["c"] == -9 and 2 <= fit["killed_at"] <= 4
    assert fit["exact"] and fit["loss_diff_resumed"] == 0 and fit["scaler_diff_resumed"] == 0
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_export_check.py"), "--ckpt_path",
                           fit["checkpoint"], "--device", "cpu", "--out", str(tmp_path / "export")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    export = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert done.returncode == 0 and export["codes"] > 0 and export["differ_hif8"] == export["differ_fp8"] == 0, export


def test_the_bundle_holds_wheels_for_the_gpu_python_and_the_assets(tmp_path):
    """``make gpu-bundle`` (one small wheel here, from PyPI): wheels for Python 3.12, the tokenizer, the corpus,
    a manifest with the size, under the limit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bundle.py"), "--out", str(tmp_path / "b"),
                           "--packages", "docstring-parser"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["python"] == "3.12" and [w["name"] for w in manifest["wheels"]] == ["docstring-parser"]
    assert (tmp_path / "b" / "wheels" / manifest["wheels"][0]["file"]).is_file()
    assert (tmp_path / "b" / "assets" / "tokenizer" / "tokenizer.json").is_file()
    assert manifest["assets"]["corpus_documents"] > 100 and 0 < manifest["bytes"] < 60 * 2**20


def _rehearsal():
    return _benchmarks("gpu_rehearsal", "gpu_bundle")


def test_the_image_list_is_the_image_at_the_low_end_of_the_torch_range():
    """``make gpu-rehearsal``'s list (benchmarks/gpu_image.txt): none of the packages the bundle carries because
    the image lacks them; the ones the bundle pins at the image's other version; torch at the oldest supported."""
    from importlib.metadata import version

    from qat_app.preflight import TORCH_RANGE

    rehearsal, bundle = _rehearsal()
    listed = rehearsal.image_packages(rehearsal.IMAGE_LIST.read_text())
    assert listed["torch"] == "2.11.0" and listed["transformers"] == "5.17.0" and listed["numpy"] == "2.5.2"
    assert not {rehearsal.normalized(n) for n in bundle.MISSING} & set(listed)
    for name in bundle.PINNED:  # there in another version (or not recorded), shadowed by the bundle's
        assert listed.get(rehearsal.normalized(name), "not listed") != version(name), name
    assert tuple(int(p) for p in listed["torch"].split(".")[:2]) == TORCH_RANGE[0]
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in listed.values()), listed  # every one pinned


def test_the_rehearsal_passes_only_when_the_bundle_and_every_cpu_stage_are_ok():
    rehearsal, _ = _rehearsal()
    rows = [("stage", "status", "seconds", "figure"), ("bundle", "ok", "", "21 wheels"), ("gpu", "NONE", "", "--cpu"),
            ("kernels", "ok", "90", "19 passed"), ("step", "WAITS", "", "needs a GPU")]
    table = _validation().table(rows)
    assert rehearsal.table_problems(table) == []
    rows[3] = ("kernels", "FAILED", "90", "10 failed, 9 passed")
    rows[1] = ("bundle", "MISSING", "", "no bundle")
    assert rehearsal.table_problems(_validation().table(rows)) == ["bundle MISSING", "kernels FAILED"]
    assert rehearsal.table_problems("") == ["no table"]


def test_without_a_python_312_the_rehearsal_stops_with_one_line(tmp_path, monkeypatch, capsys):
    rehearsal, _ = _rehearsal()
    monkeypatch.delenv("QAT_APP_PYTHON312", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no python3.12, no pyenv
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    assert rehearsal.find_python312() is None
    assert rehearsal.main(["--venv", str(tmp_path / "venv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: gpu-rehearsal needs a Python 3.12") and "pyenv install" in err
    assert not (tmp_path / "venv").exists()
