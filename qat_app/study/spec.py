"""A study file: a base config, named runs (LightningCLI overrides each), and which run is whose baseline.

Parsed by jsonargparse like any config (``--config FILE``, every field also a flag, e.g. ``--out_dir``)::

    name: paper_cpu
    base_config: configs/cpu_study.yaml   # relative to the working directory, like main.py's --config
    out_dir: runs/paper_cpu               # run NAME lives in out_dir/NAME (main.py --run_dir)
    common_args: ""                       # overrides for every run and the initial evaluation
    initial: {enabled: true, args: ""}    # one `validate` of the unquantized starting model
    runs:
      - {name: bf16_lr1e-4, args: "--model.quant.enabled false --warmup.warmup_steps 0 --model.lr 1e-4"}
      - {name: exp8, args: ""}
      - {name: exp2, config: configs/exp2.yaml}   # a run may start from its own config
    reports:
      - {name: exp8, baseline: bf16_lr1e-5, qat: [exp8]}
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QATError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
INITIAL = "initial"  # the reserved name of the initial-model evaluation
# flags the study sets itself on every run (a run's args may not)
RESERVED_FLAGS = ("--run_dir", "--ckpt_path", "--config", "-c")


class StudyError(QATError, ValueError):
    """A bad study file or study run; the message names the file, the run and the field or flag."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class RunSpec:
    """One run: ``python main.py fit --config <config or base_config> <common_args> <args>``."""

    name: str
    args: str = ""
    config: str | None = None


@dataclass
class InitialSpec:
    """The initial-model evaluation: ``validate`` of the starting model, quantization off."""

    enabled: bool = True
    args: str = ""


@dataclass
class ReportSpec:
    """One report (``main.py report``): a baseline run and the QAT runs compared with it."""

    name: str
    baseline: str
    qat: list[str] = field(default_factory=list)
    benchmarks: str | None = None


@dataclass
class Study:
    name: str
    base_config: str
    out_dir: str
    runs: list[RunSpec]
    source: str = "<study>"
    common_args: str = ""
    initial: InitialSpec = field(default_factory=InitialSpec)
    reports: list[ReportSpec] = field(default_factory=list)

    def run(self, name: str) -> RunSpec:
        for run in self.runs:
            if run.name == name:
                return run
        raise StudyError(f"{self.source}: no run named {name!r} (runs: {', '.join(r.name for r in self.runs)})")

    def run_dir(self, name: str) -> Path:
        return Path(self.out_dir) / name


def split_args(text: str, where: str) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as err:
        raise StudyError(f"{where}: cannot split {text!r} into flags: {err}") from None


def check_study(study: Study) -> Study:
    """Names unique and well formed, reports naming existing runs, no flag the study sets itself."""
    src = study.source
    if not study.runs:
        raise StudyError(f"{src}: runs is empty; give at least one run")
    seen: set[str] = set()
    for i, run in enumerate(study.runs):
        if not NAME_RE.match(run.name or "") or run.name == INITIAL:
            raise StudyError(f"{src}: runs[{i}].name={run.name!r}: use letters, digits, '.', '_', '-' "
                             f"(not starting with a symbol), and not the reserved name {INITIAL!r}")
        if run.name in seen:
            raise StudyError(f"{src}: runs[{i}].name={run.name!r} is given twice")
        seen.add(run.name)
    for where, text in [("common_args", study.common_args), ("initial.args", study.initial.args),
                        *[(f"run {r.name!r} args", r.args) for r in study.runs]]:
        for flag in split_args(text, f"{src}: {where}"):
            if flag.split("=", 1)[0] in RESERVED_FLAGS:
                raise StudyError(f"{src}: {where}: {flag.split('=', 1)[0]} is set by the study itself "
                                 "(out_dir/NAME, --ckpt_path last, base_config or the run's config)")
    for i, report in enumerate(study.reports):
        for role, name in [("baseline", report.baseline), *[("qat", q) for q in report.qat]]:
            if name not in seen:
                raise StudyError(f"{src}: reports[{i}] ({report.name!r}).{role}={name!r} is not a run "
                                 f"(runs: {', '.join(r.name for r in study.runs)})")
        if not report.qat:
            raise StudyError(f"{src}: reports[{i}] ({report.name!r}).qat is empty")
    for where, path in [("base_config", study.base_config),
                        *[(f"run {r.name!r} config", r.config) for r in study.runs if r.config]]:
        if not Path(path).is_file():
            raise StudyError(f"{src}: {where}={path}: no such file (paths are relative to the working directory)")
    return study
