"""Every command a reader is given runs or parses: each ``main.py`` command line of the README, the pages and the
config comments is parsed by the command's own parsers (its ``--config`` files read and checked), each benchmark
script's flags are among those its ``--help`` lists, each ``make`` target dry-runs; a planted wrong flag is found
in a page and in a config comment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qat_app.cli_reference import CommandLineError, check_command_line
from tests._doc_commands import ROOT, all_command_lines, make_lines, script_lines

# a run's own config (written by its fit) stands for the config that fit ran: runs/exp8/... -> configs/exp8.yaml
RUN_CONFIG = re.compile(r"^runs/([^/]+)/(?:logs/version_\d+/)?config\.yaml$")
# flags that change what a fit trains: such a fit names its own --run_dir, or it writes into the config's
RECIPE_FLAGS = re.compile(r"^--(model\.(?!model_name\b)|warmup\.|fallback\.|seed_everything)")


def _stand_in(args: tuple[str, ...]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--config":
            run = RUN_CONFIG.match(out[i + 1])
            if run and not (ROOT / out[i + 1]).exists() and (ROOT / "configs" / f"{run.group(1)}.yaml").exists():
                out[i + 1] = f"configs/{run.group(1)}.yaml"
    return out


def _refusal(command: str, args: tuple[str, ...]) -> str | None:
    try:
        check_command_line(command, _stand_in(args))
    except CommandLineError as err:
        return str(err).splitlines()[0]
    return None


@pytest.fixture(scope="module")
def checked():
    """(command line, the parser's refusal or None) of every command line given (repeats parsed once)."""
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        lines = all_command_lines()
        verdicts = {(line.command, line.args): None for line in lines}
        for key in verdicts:
            verdicts[key] = _refusal(*key)
        return [(line, verdicts[(line.command, line.args)]) for line in lines]
    finally:
        os.chdir(previous)


def test_every_main_py_command_of_the_pages_and_config_comments_parses(checked):
    assert len(checked) >= 70  # the README's, the pages' and the configs' (each occurrence)
    assert {line.where.split("/")[0] for line, _ in checked} == {"README.md", "docs", "configs"}
    refused = [f"{line.where}: {line.text}: {why}" for line, why in checked if why and line.args]
    assert not refused, "\n".join(refused)


def test_a_fit_that_changes_the_recipe_names_its_own_run_directory(checked):
    """Two runs of one config in one directory share its checkpoints: a fit given with a setting of another recipe
    (an estimator, a teacher, a fallback) says where it writes."""
    shared = [f"{line.where}: {line.text}" for line, _ in checked if line.command == "fit"
              and any(RECIPE_FLAGS.match(a) for a in line.args) and "--run_dir" not in line.args]
    assert not shared, "\n".join(shared)


def test_a_planted_wrong_flag_is_found_in_a_page_and_in_a_config_comment(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run:\n\n```bash\nT=arc_easy\npython main.py fit --config configs/quickstart.yaml \\\n"
                    "    --model.quant.amax_algoo max\npython main.py evaluate --model m --tasks $T --output_path o "
                    "--limitt 5\n```\n")
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "configs" / "quickstart.yaml").read_text().replace(
        "#   python main.py fit --config configs/quickstart.yaml",
        "#   python main.py report --baseline runs/a --qat runs/b --outt reports/x"))
    lines = all_command_lines([page], [config])
    assert [(line.command, line.where) for line in lines] == [("fit", str(page)), ("evaluate", str(page)),
                                                              ("report", str(config))]
    assert lines[1].args[3] == "arc_easy"  # the block's variable, expanded
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        refusals = [_refusal(line.command, line.args) for line in lines]
    finally:
        os.chdir(previous)
    assert "--model.quant.amax_algoo" in refusals[0]
    assert "--limitt" in refusals[1] and "--outt" in refusals[2]


def _script_flags(script: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", shown.stdout))


@pytest.mark.slow
def test_every_benchmark_command_of_the_pages_uses_flags_its_script_has():
    lines = script_lines()
    assert len(lines) >= 8
    flags = {script: _script_flags(script) for script in {line.command for line in lines}}
    unknown = [f"{line.where}: {line.text}: {arg}" for line in lines for arg in line.args
               if arg.startswith("-") and arg.split("=", 1)[0] not in flags[line.command]]
    assert not unknown, "\n".join(unknown)


def test_every_make_target_the_pages_name_dry_runs():
    lines = make_lines()
    assert {"quickstart", "test", "install", "vllm-env"} <= {line.command for line in lines}
    for command, args in sorted({(line.command, line.args) for line in lines}):
        done = subprocess.run(["make", "-n", command, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (command, args, done.stderr)
    missing = subprocess.run(["make", "-n", "no-such-target"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0  # the check can fail


def _make(*args, env_extra=None, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(env_extra or {})
    return subprocess.run(["make", "-f", str(ROOT / "Makefile"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_make_installs_into_the_active_virtual_environment_else_into_the_projects_own(tmp_path):
    venv = tmp_path / ".venv"  # not made yet (this checkout's own may be)
    own = _make("-n", "install", f"VENV={venv}").stdout
    assert f"python3 -m venv {venv}" in own  # made from BASE_PYTHON first
    assert all(line.startswith(f"{venv}/bin/python -m pip") for line in own.splitlines() if " pip install" in line)
    active = _make("-n", "install", env_extra={"VIRTUAL_ENV": "/opt/some-env"}).stdout
    assert "-m venv" not in active and "/opt/some-env/bin/python -m pip install -q -r requirements.txt" in active


@pytest.mark.slow
def test_the_projects_environment_is_made_with_pip_even_where_ensurepip_is_missing(tmp_path):
    """A real venv from this Python; and from one whose ``-m venv`` fails without ``--without-pip`` (Debian's
    python3 without python3-venv), where the base Python's pip installs pip into it."""
    made = _make(f"{tmp_path}/a/bin/python", f"VENV={tmp_path}/a", f"BASE_PYTHON={sys.executable}", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert f"the project's Python is {tmp_path}/a/bin/python" in made.stdout
    no_ensurepip = tmp_path / "python-without-ensurepip"
    no_ensurepip.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m venv" ] && [ "$3" != "--without-pip" ]; then\n'
                            f'  echo "ensurepip is not available" >&2; exit 1\nfi\nexec {sys.executable} "$@"\n')
    no_ensurepip.chmod(0o755)
    made = _make(f"{tmp_path}/b/bin/python", f"VENV={tmp_path}/b", f"BASE_PYTHON={no_ensurepip}", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    pip = subprocess.run([f"{tmp_path}/b/bin/python", "-m", "pip", "--version"], capture_output=True, text=True)
    assert pip.returncode == 0 and str(tmp_path / "b") in pip.stdout
