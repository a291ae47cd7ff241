"""The study's results: one ``main.py report`` per report of the study file, and ``study.md`` over all of them
(the command, the machine, each run's wall time and settings, every report's table and figures)."""

from __future__ import annotations

import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from .commands import RunCommand, all_commands
from .spec import INITIAL, Study

DOCUMENT = "study.md"


def machine_description() -> str:
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory = ""
    try:
        kib = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores{memory}, {gpus}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, lightning {lightning.__version__}")


def report_dir(study: Study, name: str) -> Path:
    return Path(study.out_dir) / "reports" / name


def build_reports(study: Study, finished: set[str], echo=print) -> dict[str, dict]:
    """Every report whose runs have all finished (the others are named as waiting)."""
    from qat_app.report import build_report

    initial = study.run_dir(INITIAL) if study.initial.enabled and INITIAL in finished else None
    built = {}
    for spec in study.reports:
        waiting = [n for n in [spec.baseline, *spec.qat] if n not in finished]
        if waiting:
            echo(f"report {spec.name}: waits for run(s) {', '.join(waiting)}")
            continue
        built[spec.name] = build_report(
            study.run_dir(spec.baseline), [study.run_dir(q) for q in spec.qat], report_dir(study, spec.name),
            labels=[spec.baseline, *spec.qat], benchmarks=spec.benchmarks, initial_dir=initial)
        echo(f"report {spec.name}: {report_dir(study, spec.name)}/results.md")
    return built


def _demoted(markdown: str, figure_prefix: str) -> str:
    markdown = re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", markdown, flags=re.M)  # under "## Report"
    return re.sub(r"\]\((?!https?:|/)([^)]+\.png)\)", lambda m: f"]({figure_prefix}/{m.group(1)})", markdown)


def _own_settings(study: Study, command: RunCommand) -> str:
    """What sets this run apart: its config (when not the base) and flags, as the study file gives them."""
    if command.name == INITIAL:
        return " ".join(filter(None, [study.initial.args, "--model.quant.enabled false"]))
    run = study.run(command.name)
    return " ".join(filter(None, [f"--config {run.config}" if run.config else "", run.args]))


def _run_line(study: Study, command: RunCommand, state: dict | None) -> str:
    wall = f"{state['wall_s']:.0f}" if state and state.get("finished") else "not finished"
    attempts = len(state.get("attempts", [])) if state else 0
    return f"| `{command.name}` | {command.subcommand} | {wall} | {attempts} | `{_own_settings(study, command)}` |"


def write_document(study: Study, study_file: str, states: dict[str, dict], reports: dict[str, dict]) -> Path:
    out = Path(study.out_dir) / DOCUMENT
    commands = all_commands(study)
    total = sum(s.get("wall_s") or 0 for s in states.values())
    lines = [f"# Study `{study.name}`", "",
             f"- command: `python main.py study --config {study_file}`",
             f"- machine: {machine_description()}",
             f"- written: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             f"- wall time of the runs: {total:.0f} s ({total / 60:.1f} min), summed over runs and attempts",
             f"- base config: `{study.base_config}`"
             + (f", and for every run `{study.common_args}`" if study.common_args else "")
             + f"; run NAME in `{study.out_dir}/NAME` (`python main.py study ... --dry_run` prints each command)", "",
             "## Runs", "", "| run | command | wall s | attempts | its settings (over the base config) |", "|---|---|---:|---:|---|"]
    lines += [_run_line(study, c, states.get(c.name)) for c in commands]
    for name, report in reports.items():
        prefix = os.path.relpath(report_dir(study, name), out.parent)
        lines += ["", f"## Report `{name}`", "", _demoted(report["markdown"], prefix).strip()]
        lines += [""] + [f"![{fig}]({prefix}/{fig})" for fig in report["figures"] if (report_dir(study, name) / fig).is_file()]
    out.write_text("\n".join(lines) + "\n")
    return out
