"""``main.py study``: a study of three tiny runs end to end, killed mid-run and restarted, its ``--dry_run``
commands run by hand, and bad study files refused before any run starts.

Every run is a real ``main.py`` process (the study launches them as subprocesses), so these tests take
tens of seconds each on a 2-core CPU.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import yaml

from tests._cli_runs import write_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
RUNS = ("base", "qat_max", "qat_recent")


class PauseAtStep(L.Callback):
    """In the run named ``run``, at optimizer step ``step`` (after the step-2 checkpoint), write ``flag`` and
    wait to be killed -- unless ``flag`` exists already (the restarted study must run through)."""

    def __init__(self, run: str, step: int, flag: str) -> None:
        self.run, self.step, self.flag = run, step, flag

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (Path(trainer.default_root_dir).name == self.run and trainer.global_step == self.step
                and not os.path.exists(self.flag)):
            Path(self.flag).write_text(str(os.getpid()))
            time.sleep(600)


def _base_config(tmp_path, model_dir, corpus, pause_flag: Path) -> str:
    root = tmp_path / "base_root"
    return write_config(
        tmp_path, model_dir, corpus,
        **{
            "trainer.max_steps": STEPS,
            "trainer.default_root_dir": str(root),
            "trainer.logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                "init_args": {"save_dir": str(root), "name": "logs"}}],
            "trainer.callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(root / "checkpoints"), "save_last": True, "every_n_train_steps": 2,
                               "save_top_k": -1}},
                {"class_path": "tests.test_study.PauseAtStep",
                 "init_args": {"run": "qat_max", "step": 3, "flag": str(pause_flag)}},
            ],
            "warmup.warmup_steps": 2,
            "data.init_args.benchmarks": {
                "class_path": "qat_app.data.benchmarks.BenchmarkDataModule",
                "init_args": {"tasks": ["arc_challenge"], "limit": 8, "batch_size": 8, "source": "local"}},
        },
    )


def _study_file(tmp_path, base: str, out_dir: Path, name="study.yaml", **changes) -> Path:
    study = {
        "name": "tiny",
        "base_config": base,
        "out_dir": str(out_dir),
        "runs": [
            {"name": "base", "args": "--model.quant.enabled false --warmup.warmup_steps 0"},
            {"name": "qat_max", "args": ""},
            {"name": "qat_recent", "args": "--model.quant.amax_algo most_recent --warmup.warmup_steps 0"},
        ],
        "reports": [{"name": "main", "baseline": "base", "qat": ["qat_max", "qat_recent"]}],
    }
    study.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def _study(*args, timeout=900, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "main.py"), "study", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, **popen)


def _losses(run_dir: Path) -> dict[int, str]:
    rows = [r for f in sorted(run_dir.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    return {int(r["step"]): r["train/loss"] for r in rows if r.get("train/loss")}


def _report_numbers(out_dir: Path) -> dict:
    """The report's numbers, without the paths (the studies live in different directories)."""
    report = json.loads((out_dir / "reports" / "main" / "results.json").read_text())
    qat = [{k: v for k, v in r.items() if k not in ("path", "config")} for r in report["qat"]]
    for run in qat:
        run["saturation"] = {k: v for k, v in run["saturation"].items() if k != "source"}  # a file path
        if run.get("kl_baseline_qat"):
            run["kl_baseline_qat"] = {k: v for k, v in run["kl_baseline_qat"].items() if k != "files"}  # paths
        floor = run.get("noise_floor")
        if floor and "text" in floor:  # its file's path and the seconds it took are not the run's numbers
            run["noise_floor"] = {**{k: v for k, v in floor.items() if k not in ("file", "seconds")},
                                  "text": {k: v for k, v in floor["text"].items() if k != "seconds"},
                                  "benchmarks": {k: v for k, v in (floor.get("benchmarks") or {}).items()
                                                 if k != "seconds"}}
    return {"baseline": report["baseline"]["benchmarks"], "initial": report["initial"]["benchmarks"], "qat": qat}


@pytest.fixture(scope="module")
def finished_study(module_tmp, tiny_model_dir, tiny_corpus):
    tmp = module_tmp("study")
    flag = tmp / "paused"
    flag.write_text("never pause")  # the uninterrupted study
    base = _base_config(tmp, tiny_model_dir, tiny_corpus, flag)
    out = tmp / "runs"
    study = _study_file(tmp, base, out)
    done = _study("--config", study)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"tmp": tmp, "base": base, "out": out, "study": study, "stdout": done.stdout,
            "model_dir": tiny_model_dir, "corpus": tiny_corpus}


def test_study_runs_every_run_and_writes_the_report(finished_study):
    out = finished_study["out"]
    for name in ("initial", *RUNS):
        assert json.loads((out / "_study" / f"{name}.json").read_text())["finished"] is True
    for name in RUNS:
        assert sorted(_losses(out / name)) == list(range(STEPS)), name
        assert (out / name / "checkpoints" / "last.ckpt").is_file()
        assert not (out / name / "initial").exists()
    # the initial evaluation ran once, unquantized, as a validate run; the fits did not repeat it
    initial_cfg = yaml.safe_load(next((out / "initial").glob("logs/version_0/config.yaml")).read_text())
    assert initial_cfg["model"]["quant"]["enabled"] is False
    assert list((out / "initial").glob("logs/version_0/benchmark_samples/val_step*.jsonl"))
    for name in RUNS:
        assert not list((out / name).glob("logs/version_*/benchmark_samples/val_step0000000.jsonl"))
    report = json.loads((out / "reports" / "main" / "results.json").read_text())
    assert [r["label"] for r in report["qat"]] == ["qat_max", "qat_recent"]
    assert report["initial"]["source"].startswith(f"--initial {out / 'initial'}")
    document = (out / "study.md").read_text()
    for name in ("initial", *RUNS):
        assert f"| `{name}` |" in document
    assert "## Report `main`" in document and "reports/main/loss_curves.png" in document


def test_killed_study_resumes_and_ends_with_the_same_report(finished_study, tmp_path):
    flag = tmp_path / "paused"
    base = _base_config(tmp_path, finished_study["model_dir"], finished_study["corpus"], flag)
    out = tmp_path / "runs"
    study = _study_file(tmp_path, base, out)
    proc = subprocess.Popen([sys.executable, str(REPO / "main.py"), "study", "--config", str(study)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while not flag.exists():  # the second run reached step 3 (its step-2 checkpoint is written)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the study and its run die at once, as on a lost node
    proc.wait()
    assert json.loads((out / "_study" / "base.json").read_text())["finished"] is True
    assert json.loads((out / "_study" / "qat_max.json").read_text())["finished"] is False
    assert not (out / "qat_recent").exists()
    before = sorted(p.name for p in (out / "qat_max" / "checkpoints").iterdir())
    assert "last.ckpt" in before

    again = _study("--config", study)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "base: finished earlier" in again.stdout and "qat_max: running (resuming)" in again.stdout
    log = (out / "_study" / "qat_max.log").read_text()
    assert "--ckpt_path last: resuming from" in log
    state = json.loads((out / "_study" / "qat_max.json").read_text())
    assert len(state["attempts"]) == 2 and state["attempts"][0]["exit_code"] != 0
    assert len(list((out / "qat_max").glob("logs/version_*"))) == 2  # the resumed attempt logged on
    for name in RUNS:
        assert _losses(out / name) == _losses(finished_study["out"] / name), name
    assert _report_numbers(out) == _report_numbers(finished_study["out"])


def test_dry_run_commands_by_hand_make_the_same_runs(finished_study, tmp_path):
    out = tmp_path / "runs"
    study = _study_file(tmp_path, finished_study["base"], out)
    dry = _study("--config", study, "--dry_run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.strip().splitlines()
    assert len(lines) == 1 + len(RUNS) and lines[0].startswith("python main.py validate ")
    assert not out.exists()  # a dry run writes nothing
    for line in lines:
        argv = shlex.split(line)
        assert argv[:2] == ["python", "main.py"]
        done = subprocess.run([sys.executable, str(REPO / "main.py"), *argv[2:]], cwd=REPO, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    for name in ("initial", *RUNS):
        made = sorted(str(p.relative_to(out / name)) for p in (out / name).rglob("*") if p.is_file())
        ref = sorted(str(p.relative_to(finished_study["out"] / name))
                     for p in (finished_study["out"] / name).rglob("*") if p.is_file())
        assert made == ref, name
    for name in RUNS:
        assert _losses(out / name) == _losses(finished_study["out"] / name), name
    assert not (out / "_study").exists()  # the study's bookkeeping is not part of a run


@pytest.mark.parametrize("change, message", [
    ({"runs": [{"name": "a", "args": "--model.quant.amax_algo mostrecent"}]}, "run 'a': model.quant.amax_algo=mostrecent: expected one of most_recent"),
    ({"runs": [{"name": "a", "args": "--model.lrr 1e-4"}]}, "run 'a': unknown flag --model.lrr (did you mean --model.lr?)"),
    ({"runs": [{"name": "a", "args": "--warmup.warmup_steps 50"}]}, "run 'a': warmup.warmup_steps (50) must be smaller"),
    ({"runs": [{"name": "a", "args": "--run_dir elsewhere"}]}, "run 'a' args: --run_dir is set by the study itself"),
    ({"runs": [{"name": "a"}, {"name": "a"}]}, "runs[1].name='a' is given twice"),
    ({"runs": [{"name": "initial"}]}, "runs[0].name='initial'"),
    ({"reports": [{"name": "r", "baseline": "base", "qat": ["nope"]}]}, "reports[0] ('r').qat='nope' is not a run"),
    ({"base_config": "configs/no_such.yaml"}, "base_config=configs/no_such.yaml: no such file"),
    ({"runs": [{"name": "a", "args": "--model.lr '1e-4"}]}, "cannot split"),
    ({"runs": [{"name": "a", "argz": "--model.lr 1e-4"}]}, "argz"),
])
def test_bad_study_file_fails_before_any_run(finished_study, tmp_path, change, message, capsys, monkeypatch):
    from qat_app.study import main as study_main

    monkeypatch.chdir(REPO)
    out = tmp_path / "runs"
    if "runs" in change and "reports" not in change:
        change = {**change, "reports": []}
    study = _study_file(tmp_path, finished_study["base"], out, **change)
    code = study_main(["--config", str(study)])  # in-process: an uncaught exception fails the test
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert error and message in stderr, stderr
    assert str(study) in error[0]
    assert not out.exists()  # nothing ran, nothing was written


def test_only_runs_the_named_run_and_reports_wait(finished_study, tmp_path):
    out = tmp_path / "runs"
    study = _study_file(tmp_path, finished_study["base"], out, initial={"enabled": False})
    done = _study("--config", study, "--only", "qat_recent")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["_study", "qat_recent", "study.md"]
    assert "report main: waits for run(s) base, qat_max" in done.stdout
    assert _losses(out / "qat_recent") == _losses(finished_study["out"] / "qat_recent")
    bad = _study("--config", study, "--only", "nope", timeout=120)
    assert bad.returncode == 2 and "--only nope: not a run" in bad.stderr
