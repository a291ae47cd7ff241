"""Every setting and flag of the command line, read from the parsers themselves (never a second list).

The documentation's settings reference is generated from :func:`settings` (``docs/_hooks/settings_reference.py``),
and the docs test checks every flag and config key a page names against :func:`command_flags`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from dataclasses import dataclass

# The datamodules a config names as data.class_path, and where their settings sit: data.X is jsonargparse's
# short form of data.init_args.X; the benchmarks are a datamodule inside the pretraining one.
DATA_CLASSES = {"data": "qat_app.data.pretrain.PretrainDataModule",
                "data.benchmarks": "qat_app.data.benchmarks.BenchmarkDataModule"}
_LONG_FORM = {"data": "data.init_args", "data.benchmarks": "data.init_args.benchmarks.init_args"}


@dataclass(frozen=True)
class Setting:
    """One config key (``saturation.headroom_grid``; the flag is ``--`` + key) with its type, default and help."""

    key: str
    type: str
    default: str
    help: str


class _Parsed(Exception):
    """Carries the parser out of LightningCLI before it parses anything."""


@functools.lru_cache(maxsize=None)
def lightning_parser():
    """The LightningCLI parser of ``main.py`` (every subcommand), built as the CLI builds it; nothing is parsed."""
    from qat_app.cli import QATCLI, cli_kwargs

    class _Capture(QATCLI):
        def parse_arguments(self, parser, args) -> None:
            raise _Parsed(parser)

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            _Capture(**cli_kwargs(), args=["fit"], run=True)
    except _Parsed as parsed:
        return parsed.args[0]
    raise RuntimeError("LightningCLI parsed its arguments without calling parse_arguments")


def _subcommand_parser(subcommand: str):
    return lightning_parser()._subcommands_action._name_parser_map[subcommand]


@functools.lru_cache(maxsize=None)
def _data_parser():
    """A parser of the datamodules' constructor arguments (data.X and data.benchmarks.X)."""
    import importlib

    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    for key, path in DATA_CLASSES.items():
        module, name = path.rsplit(".", 1)
        parser.add_class_arguments(getattr(importlib.import_module(module), name), key, skip={"benchmarks"})
    return parser


def _type_name(action) -> str:
    hint = getattr(action, "_typehint", None)
    if hint is None:
        return "bool" if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) else ""
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


def _settings_of(parser, skip_sections: tuple[str, ...] = ()) -> list[Setting]:
    out = []
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--") and not s.endswith("+")]
        if not flags or action.default == argparse.SUPPRESS or action.dest in ("help", "config", "print_config"):
            continue
        key = flags[0][2:]
        if key.endswith(".help") or key.split(".")[0] in skip_sections or type(action).__name__ == "_ActionConfigLoad":
            continue
        out.append(Setting(key, _type_name(action), repr(action.default) if action.default is not None else "null",
                           " ".join((action.help or "").split())))
    return out


def settings(subcommand: str = "fit") -> list[Setting]:
    """The settings of a LightningCLI subcommand, ``trainer.*`` aside (Lightning documents its Trainer), and the
    datamodules' (``data.X``), in the parser's order."""
    return [s for s in _settings_of(_subcommand_parser(subcommand), ("trainer",)) if s.key != "data"] \
        + _settings_of(_data_parser())


def _flags(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("-")}


def _lightning_flags(subcommand: str) -> set[str]:
    data = {flag for flag in _flags(_data_parser()) if flag.startswith("--data")}
    long_form = set()
    for flag in data:  # data.X is also written data.init_args.X
        for short in sorted(_LONG_FORM, key=len, reverse=True):
            if flag.startswith(f"--{short}."):
                long_form.add(f"--{_LONG_FORM[short]}." + flag[len(short) + 3:])
                break
    return _flags(_subcommand_parser(subcommand)) | data | long_form


def _extra_parser(command: str, prog: str):
    """The argparse parser of one of ``main.py``'s other commands (:data:`qat_app.cli.EXTRA_COMMANDS`)."""
    from qat_app.evaluate import evaluate_parser
    from qat_app.export.cli import export_parser
    from qat_app.inspection import inspect_parser
    from qat_app.report.cli import report_parser
    from qat_app.study.cli import study_parser

    parsers = {"export": export_parser, "report": report_parser, "study": study_parser, "inspect": inspect_parser,
               "evaluate": evaluate_parser}
    return parsers[command](prog)


def command_flags(command: str) -> set[str]:
    """Every flag ``python main.py COMMAND`` accepts (``inspect`` passes the rest to ``validate``)."""
    from qat_app.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS

    if command in LIGHTNING_COMMANDS:
        return _lightning_flags(command)
    if command not in EXTRA_COMMANDS:
        raise KeyError(f"unknown command {command!r}")
    own = _flags(_extra_parser(command, command))
    # export --compare and inspect read the run's data as validate does
    return own | _lightning_flags("validate") if command in ("inspect", "export") else own


class CommandLineError(ValueError):
    """A command line its command's parsers refuse (the parser's message)."""


def _refused(parse, args) -> str | None:
    """The parser's error message when ``parse(args)`` exits, else None (its output swallowed)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(args)
    except argparse.ArgumentError as refused:  # LightningCLI's parser raises instead of exiting
        return str(refused)
    except SystemExit as exit_:
        if exit_.code:
            lines = [line for line in err.getvalue().splitlines() if line.strip()]
            return lines[-1] if lines else f"exit {exit_.code}"
    return None


def check_command_line(command: str, argv: list[str]) -> None:
    """``python main.py COMMAND ARGV`` parsed by the command's own parsers as ``main.py`` parses it before running
    (a ``--config`` file is read and checked, paths relative to the working directory); nothing runs. Raises
    :class:`CommandLineError` with the parser's message."""
    from qat_app.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS

    if command in LIGHTNING_COMMANDS:
        message = _refused(lightning_parser().parse_args, [command, *argv])
    elif command in EXTRA_COMMANDS:
        parser = _extra_parser(command, f"main.py {command}")
        if command in ("inspect", "export"):  # the rest goes to validate's parser
            rest: list[str] = []
            message = _refused(lambda a: rest.extend(parser.parse_known_args(a)[1]), argv)
            if message is None and rest:
                message = _refused(lightning_parser().parse_args, ["validate", *rest])
        else:
            message = _refused(parser.parse_args, argv)
    else:
        message = f"unknown command {command!r}"
    if message:
        raise CommandLineError(message)
