"""The pre-flight checks on their own (the CLI's one-line errors are in test_bad_inputs.py)."""

from __future__ import annotations

import os

import pytest
from jsonargparse import Namespace

from qat_app.errors import ConfigError
from qat_app.module import check_lr_schedule
from qat_app.preflight import check_fit_settings, relocate_run, world_size

COSINE = r"model\.lr_schedule=cosine needs trainer\.max_steps > 0 \(the length of the decay\), got trainer\.max_steps=-1"


def fit_config(max_steps, lr_schedule="cosine", warmup_steps=0) -> Namespace:
    return Namespace(trainer=Namespace(max_steps=max_steps), warmup=Namespace(warmup_steps=warmup_steps),
                     model=Namespace(lr_schedule=lr_schedule))


def test_the_cosine_rule_is_one_rule_for_the_cli_and_the_module():
    with pytest.raises(ConfigError, match=COSINE):
        check_fit_settings(fit_config(None))
    with pytest.raises(ConfigError, match=COSINE):
        check_lr_schedule("cosine", -1)  # what configure_optimizers calls
    check_fit_settings(fit_config(None, "constant"))
    check_fit_settings(fit_config(10))
    check_lr_schedule("constant", None)


def test_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match="warmup"):
        check_fit_settings(fit_config(5, "constant", warmup_steps=10))


def test_world_size_counts_devices_times_nodes():
    assert world_size({"devices": "2", "num_nodes": 2, "accelerator": "cpu"}) == 4
    assert world_size({"devices": [0, 1, 2], "accelerator": "cpu"}) == 3
    assert world_size({"devices": "0,1", "accelerator": "cpu"}) == 2
    assert world_size({"devices": "auto", "accelerator": "cpu"}) == 1


def test_relocate_run_moves_every_path_under_the_root(tmp_path):
    new = str(tmp_path / "run")
    logger = Namespace(class_path="CSVLogger", init_args=Namespace(save_dir="out/logs"))
    ckpt = Namespace(class_path="ModelCheckpoint", init_args=Namespace(dirpath="out/ckpt"))
    trainer = Namespace(default_root_dir="out", logger=[logger], callbacks=[ckpt])
    relocate_run(trainer, new)
    assert trainer.default_root_dir == new
    assert logger.init_args.save_dir == os.path.join(new, "logs")
    assert ckpt.init_args.dirpath == os.path.join(new, "ckpt")
    outside = Namespace(default_root_dir="out", logger=Namespace(init_args=Namespace(save_dir="/elsewhere")))
    with pytest.raises(ConfigError, match=r"--run_dir .*save_dir=/elsewhere is not under trainer\.default_root_dir=out"):
        relocate_run(outside, new)


# ------------------------------------------------------------------------------------------ the torch range
def test_a_torch_outside_the_supported_range_is_one_line():
    from qat_app.preflight import torch_outside_range

    for inside in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.0a0+git1234"):
        assert torch_outside_range(inside) is None, inside
    assert torch_outside_range("2.9.0") == (
        "torch 2.9.0 is outside the supported range 2.11-2.13 (install one: pip install 'torch>=2.11,<2.14'; "
        "QAT_APP_ANY_TORCH=1 runs anyway, untested)")
    for outside in ("2.10.1", "2.14.0", "3.0.0", "nightly"):
        assert torch_outside_range(outside).startswith(f"torch {outside} is outside the supported range"), outside


def test_the_cli_stops_on_an_unsupported_torch_before_anything_runs(monkeypatch, capsys):
    import torch

    from qat_app import cli

    monkeypatch.setattr(torch, "__version__", "2.9.0")
    monkeypatch.delenv("QAT_APP_ANY_TORCH", raising=False)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["fit", "--config", "configs/quickstart.yaml"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: torch 2.9.0 is outside the supported range 2.11-2.13 (")
    monkeypatch.setenv("QAT_APP_ANY_TORCH", "1")
    with pytest.raises(SystemExit) as usage:
        cli.main(["--help"])  # goes on (said in the log) to the command
    assert usage.value.code == 0


def test_pyproject_declares_the_checked_torch_range_and_holds_the_lock():
    """pyproject.toml's torch requirement is :data:`TORCH_RANGE`, and every pin of requirements.txt (the
    quickstart's lock) lies inside pyproject's range for it, so `pip install .` and `make install` agree."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    from qat_app.preflight import TORCH_RANGE

    root = Path(__file__).resolve().parents[1]
    declared = {(r := Requirement(line)).name.lower(): r
                for line in tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]}
    (low_major, low_minor), (high_major, high_minor) = TORCH_RANGE
    assert str(declared["torch"].specifier) == ",".join(sorted([f">={low_major}.{low_minor}",
                                                                f"<{high_major}.{high_minor + 1}"]))
    locked = [Requirement(line.split("#")[0].strip()) for line in (root / "requirements.txt").read_text().splitlines()
              if line.split("#")[0].strip()]
    checked = 0
    for pin in locked:
        if pin.name.lower() in declared:
            version = next(iter(pin.specifier)).version
            assert declared[pin.name.lower()].specifier.contains(version), (pin, declared[pin.name.lower()])
            checked += 1
    assert checked >= 15
