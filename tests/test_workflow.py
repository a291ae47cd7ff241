"""The README's workflow can be followed as written: each step reads what an earlier one writes (the configs' own
run directories and checkpoints, the export's directory), the README and the docs' index give the same steps, and
each command line goes through the real parsers (flags: tests/test_docs.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from qat_app.cli_reference import command_flags

ROOT = Path(__file__).resolve().parent.parent


def workflow_blocks(page: Path) -> tuple[str, str]:
    """(the shell block, the Python block) under the page's '## The workflow'."""
    text = page.read_text()
    section = text[text.index("## The workflow"):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    shell = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return shell, python


def steps(shell: str) -> list[list[str]]:
    return [shlex.split(line.split(" #", 1)[0]) for line in shell.splitlines() if line.strip()]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def fit_outputs(config: str) -> dict[str, set[str]]:
    """What ``fit --config`` writes: its run directory, its loggers' directories, its checkpoint directories."""
    data = yaml.safe_load((ROOT / config).read_text())
    trainer = data["trainer"]
    loggers = {f"{lg['init_args']['save_dir']}/{lg['init_args'].get('name', 'lightning_logs')}"
               for lg in trainer["logger"]}
    checkpoints = {cb["init_args"]["dirpath"] for cb in trainer["callbacks"]
                   if cb["class_path"].endswith("ModelCheckpoint") and cb["init_args"].get("save_last")}
    return {"run": {trainer["default_root_dir"]}, "logs": loggers, "checkpoints": checkpoints}


def test_the_readme_and_the_index_give_the_same_workflow():
    assert workflow_blocks(ROOT / "README.md") == workflow_blocks(ROOT / "docs" / "index.md")


def test_each_step_of_the_workflow_reads_what_an_earlier_step_wrote():
    shell, python = workflow_blocks(ROOT / "README.md")
    runs, logs, checkpoints, exports = set(), set(), set(), {}
    commands = []
    for argv in steps(shell):
        if argv[:3] == ["python", "main.py", "fit"]:
            written = fit_outputs(flag(argv, "--config"))
            runs |= written["run"]
            logs |= written["logs"]
            checkpoints |= written["checkpoints"]
            commands.append("fit")
        elif argv[0] == "tensorboard":
            logdir = flag(argv, "--logdir")
            assert logs and all(Path(d).is_relative_to(logdir) for d in logs), (logdir, logs)
            commands.append("tensorboard")
        elif argv[:3] == ["python", "main.py", "report"]:
            assert {flag(argv, "--baseline"), flag(argv, "--qat")} <= runs, (argv, runs)
            commands.append("report")
        elif argv[:3] == ["python", "main.py", "export"]:
            ckpt = Path(flag(argv, "--ckpt_path"))
            assert ckpt.name == "last.ckpt" and str(ckpt.parent) in checkpoints, (ckpt, checkpoints)
            exports[flag(argv, "--out")] = flag(argv, "--format")
            commands.append("export")
        elif argv[:2] == ["vllm", "serve"]:
            assert exports.get(argv[2]) == "compressed-tensors", (argv, exports)
            commands.append("serve")
        else:
            raise AssertionError(f"a workflow step this test does not know: {argv}")
    assert commands == ["fit", "fit", "tensorboard", "report", "export", "serve"]
    # the baseline is the matched BF16 run: the QAT config with quantization off and the same recipe
    baseline, qat = (yaml.safe_load((ROOT / f"configs/{name}.yaml").read_text())
                     for name in ("bf16_baseline", "exp8"))
    assert baseline["model"]["quant"]["enabled"] is False and qat["model"]["quant"]["enabled"] is True
    assert baseline["model"]["lr"] == qat["model"]["lr"] and baseline["data"] == qat["data"]
    # the Python way serves the same export and prints the generated text, not the request objects
    served = re.search(r'LLM\("([^"]+)"\)', python).group(1)
    assert exports.get(served) == "compressed-tensors"
    assert ".outputs[0].text" in python


def test_the_workflows_flags_are_the_parsers_and_the_serve_targets_exist():
    shell, _ = workflow_blocks(ROOT / "README.md")
    for argv in steps(shell):
        if argv[:2] == ["python", "main.py"]:
            flags = command_flags(argv[2])
            assert all(a in flags for a in argv[3:] if a.startswith("--")), argv
    from qat_app.export.serve_targets import SERVE_TARGETS

    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("`--serve_target`"):].split("\n\n", 1)[0]
    assert set(SERVE_TARGETS) <= set(re.findall(r"`([a-z]+)`", paragraph))  # every target, and which engine
    assert "--serve_target" in command_flags("export")


def test_main_names_every_command():
    import main
    from qat_app.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS

    named = re.search(r"\{([\w,]+)\}", main.__doc__).group(1).split(",")
    assert named == [*LIGHTNING_COMMANDS, *EXTRA_COMMANDS]
