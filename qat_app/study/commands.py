"""The ``main.py`` command of every study run, and checking each one parses before anything runs."""

from __future__ import annotations

import contextlib
import io
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from .spec import INITIAL, Study, StudyError, split_args

MAIN_PY = Path(__file__).resolve().parents[2] / "main.py"


@dataclass(frozen=True)
class RunCommand:
    """``main.py <subcommand> <args>`` of one study run (``args`` as a user would type them)."""

    name: str
    subcommand: str  # fit, or validate for the initial evaluation
    args: tuple[str, ...]
    run_dir: Path

    @property
    def argv(self) -> list[str]:
        return [self.subcommand, *self.args]

    def shell(self) -> str:
        """The command line as printed by ``--dry_run`` (run from the working directory of the study)."""
        return shlex.join(["python", "main.py", *self.argv])

    def executable(self) -> list[str]:
        """What the study runs: this interpreter, the project's main.py (or the installed module)."""
        entry = [str(MAIN_PY)] if MAIN_PY.is_file() else ["-m", "qat_app.cli"]
        return [sys.executable, *entry, *self.argv]


def initial_command(study: Study) -> RunCommand | None:
    if not study.initial.enabled:
        return None
    run_dir = study.run_dir(INITIAL)
    args = ["--config", study.base_config, *split_args(study.common_args, f"{study.source}: common_args"),
            *split_args(study.initial.args, f"{study.source}: initial.args"),
            "--model.quant.enabled", "false", "--run_dir", str(run_dir)]
    return RunCommand(INITIAL, "validate", tuple(args), run_dir)


def run_commands(study: Study) -> list[RunCommand]:
    commands = []
    for run in study.runs:
        run_dir = study.run_dir(run.name)
        args = ["--config", run.config or study.base_config,
                *split_args(study.common_args, f"{study.source}: common_args"),
                *split_args(run.args, f"{study.source}: run {run.name!r} args")]
        if study.initial.enabled:  # evaluated once, by the initial command
            args += ["--initial_eval.enabled", "false"]
        args += ["--run_dir", str(run_dir), "--ckpt_path", "last"]
        commands.append(RunCommand(run.name, "fit", tuple(args), run_dir))
    return commands


def all_commands(study: Study) -> list[RunCommand]:
    initial = initial_command(study)
    return ([initial] if initial else []) + run_commands(study)


class _Parsed(Exception):
    """Raised by :class:`_ParseOnly` once the settings are parsed and checked: stop before any model is built."""


def _parse_only_cli():
    from qat_app.cli import QATCLI

    class _ParseOnly(QATCLI):
        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()  # --run_dir relocation, batch and warmup checks
            raise _Parsed()

    return _ParseOnly


def check_command(study: Study, command: RunCommand) -> None:
    """Parse ``command`` with the real LightningCLI parser and the fit-time checks, building nothing:
    a misspelled flag or an impossible value fails here, naming the run, not hours later."""
    from qat_app.cli import cli_kwargs
    from qat_app.errors import QATError

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level, seed_log.level = seed_log.level, logging.WARNING  # no "Seed set to" per checked run
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            _parse_only_cli()(**cli_kwargs(), args=command.argv, run=True)
    except _Parsed:
        return
    except QATError as err:
        raise StudyError(f"{study.source}: run {command.name!r}: {err}") from None
    except SystemExit:  # parse errors arrive as QATError (QATCLI.parse_arguments); this is --help / --print_config
        raise StudyError(f"{study.source}: run {command.name!r}: its flags stop main.py before it trains "
                         f"(--help or --print_config?)\n  command: {command.shell()}") from None
    finally:
        seed_log.level = level
    raise StudyError(f"{study.source}: run {command.name!r}: the settings did not parse as a {command.subcommand} run")
