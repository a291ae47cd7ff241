"""``python main.py study --config configs/studies/<name>.yaml [--dry_run] [--only NAME ...]``."""

from __future__ import annotations

import logging
import sys
from typing import NamedTuple

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from ..cli_errors import BothSpellings, OneSpellingHelpMixin

from ..errors import QATError
from .commands import all_commands, check_command
from .document import build_reports, write_document
from .runner import StudyRunner
from .spec import INITIAL, InitialSpec, ReportSpec, RunSpec, Study, StudyError, check_study


class StudyHelp(OneSpellingHelpMixin, DefaultHelpFormatter):
    pass


class StudyParser(BothSpellings, ArgumentParser):
    """The study file's and the command line's parser: every flag in both spellings, help showing one."""


def study_parser(prog: str) -> ArgumentParser:
    parser = StudyParser(prog=prog, exit_on_error=False, formatter_class=StudyHelp, description=(
        "Run a study: the initial-model evaluation once, each run as its own `main.py fit` in out_dir/NAME "
        "(a finished run is skipped, an interrupted one resumes from its last checkpoint), then the reports "
        "and out_dir/study.md."))
    parser.add_argument("--config", action=ActionConfigFile, help="the study file (YAML)")
    parser.add_argument("--name", type=str, required=True, help="the study's name")
    parser.add_argument("--base_config", type=str, required=True, help="the LightningCLI config every run starts from")
    parser.add_argument("--out_dir", type=str, required=True, help="run NAME is written to out_dir/NAME")
    parser.add_argument("--common_args", type=str, default="", help="flags added to every run")
    parser.add_argument("--initial", type=InitialSpec, default=InitialSpec())
    parser.add_argument("--runs", type=list[RunSpec], required=True)
    parser.add_argument("--reports", type=list[ReportSpec], default=[])
    parser.add_argument("--dry_run", action="store_true",
                        help="print the `python main.py ...` command of every run, one per line, and stop")
    parser.add_argument("--only", type=str, default=[], nargs="+",
                        help=f"run only these runs ({INITIAL!r} is the initial evaluation)")
    return parser


class StudyRequest(NamedTuple):
    """A parsed and checked study command (:func:`load_study`)."""

    study: Study
    source: str  # the study file (or "<command line>")
    dry_run: bool
    only: list[str]  # the runs asked for (empty: all)


def load_study(argv: list[str], prog: str = "python main.py study") -> StudyRequest:
    """Parse and check a study (file + flags)."""
    parser = study_parser(prog)
    source = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), "<command line>")
    try:
        cfg = parser.parse_args(argv)
    except Exception as err:  # jsonargparse's ArgumentError / a YAML error: name the file, keep the cause short
        reason = str(err).strip().splitlines()
        raise StudyError(f"{source}: {reason[0] if reason else type(err).__name__}"
                         + ("".join(f"\n  {line}" for line in reason[1:6]) if len(reason) > 1 else "")) from None
    init = parser.instantiate_classes(cfg)
    study = Study(name=init.name, base_config=init.base_config, out_dir=init.out_dir, runs=list(init.runs),
                  source=source, common_args=init.common_args or "", initial=init.initial or InitialSpec(),
                  reports=list(init.reports or []))
    check_study(study)
    only = list(init.only or [])
    names = [c.name for c in all_commands(study)]
    for name in only:
        if name not in names:
            raise StudyError(f"--only {name}: not a run of {source} (runs: {', '.join(names)})")
    return StudyRequest(study, source, bool(init.dry_run), only)


def main(argv: list[str] | None = None, prog: str = "python main.py study") -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        study, source, dry_run, only = load_study(argv, prog)
        commands = [c for c in all_commands(study) if not only or c.name in only]
        if dry_run:
            for command in commands:
                print(command.shell())
            return 0
        for command in commands:  # every run's settings parse before the first run starts
            check_command(study, command)
        runner = StudyRunner(study)
        runner.run(only)
        states = {c.name: runner.state(c.name) for c in all_commands(study) if runner.state(c.name)}
        finished = {name for name, s in states.items() if s.get("finished")}
        reports = build_reports(study, finished)
        print(f"wrote {write_document(study, source, states, reports)}")
    except (QATError, FileNotFoundError) as err:  # a bad study, a failed run, a report that refuses its runs
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    return 0
