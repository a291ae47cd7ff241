"""Studies: the paper's experiment matrix (or any other) as one resumable command.

``python main.py study --config configs/studies/paper_cpu.yaml`` evaluates the starting model once
(``validate``, quantization off), runs each run of the study file as an ordinary ``main.py fit`` in
``out_dir/<name>`` (:mod:`.commands`), skipping finished runs and resuming interrupted ones with
``--ckpt_path last`` (:mod:`.runner`), then writes one report per baseline/QAT group and ``study.md``
(:mod:`.document`). ``--dry_run`` prints every run's command, ``--only NAME`` runs one. The file format:
:mod:`.spec`.
"""

from .cli import load_study, main
from .commands import RunCommand, all_commands, check_command
from .runner import StudyRunner
from .spec import INITIAL, InitialSpec, ReportSpec, RunSpec, Study, StudyError, check_study

__all__ = ["INITIAL", "InitialSpec", "ReportSpec", "RunCommand", "RunSpec", "Study", "StudyError", "StudyRunner",
           "all_commands", "check_command", "check_study", "load_study", "main"]
