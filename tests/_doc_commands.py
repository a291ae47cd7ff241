"""The command lines the project's pages and config comments give a reader: found in the README, ``docs/`` and the
comments of ``configs/``, shell variables of the same block expanded, continued lines joined."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from qat_app.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIGS = ROOT / "configs"

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
# a command line: python main.py CMD / hif8-qat CMD / python -m qat_app.export|report
COMMAND = re.compile(r"(?:python3? main\.py|hif8-qat|python3? -m qat_app\.(export|report))\s+(\w[\w-]*)?")
# a benchmark script: python benchmarks/NAME.py ARGS; a make target: make TARGET [VAR=value]
SCRIPT = re.compile(r"python3? (benchmarks/\w+\.py)((?:\s+[^\s|;&#]+)*)")
MAKE = re.compile(r"(?:^|[;&|]\s*)make ([a-z][\w-]*)((?:\s+[A-Z_]+=\S+)*)")
ASSIGNMENT = re.compile(r"^\s*([A-Z_][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S*)\s*$")
# written for the reader to fill in: `python main.py fit ...`, `--ckpt_path <file>`
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]+>|…")


@dataclass(frozen=True)
class CommandLine:
    """``python main.py COMMAND ARGS`` as written at ``where`` (a file, and the line its block or comment starts)."""

    where: str
    command: str
    args: tuple[str, ...]
    text: str


def pages() -> list[Path]:
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)]


def configs() -> list[Path]:
    return sorted(CONFIGS.rglob("*.yaml"))


def code_of_page(text: str) -> list[str]:
    """Fenced blocks and the inline code spans outside them."""
    return [*FENCE.findall(text), *INLINE.findall(FENCE.sub("", text))]


def code_of_config(text: str) -> list[str]:
    """A YAML file's comments, one block (continued lines joined as in a shell)."""
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line and line.lstrip().startswith("#")]
    return ["\n".join(comments)]


def _expand(line: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):
        line = line.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return line


def command_lines(code: str, where: str) -> list[CommandLine]:
    """Every ``main.py COMMAND ...`` in ``code`` (continued lines joined, ``NAME=value`` lines of the same block
    expanded in later lines, a trailing ``# comment`` dropped); lines with a placeholder (``...``, ``<file>``) are
    left out."""
    out, variables = [], {}
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        line = line.split(" #", 1)[0].strip()
        assigned = ASSIGNMENT.match(line)
        if assigned:
            variables[assigned.group(1)] = _expand(assigned.group(2).strip("\"'"), variables)
            continue
        line = _expand(line, variables)
        for match in COMMAND.finditer(line):
            command = match.group(1) or match.group(2)
            if command not in (*LIGHTNING_COMMANDS, *EXTRA_COMMANDS):
                continue
            rest = line[match.end():]
            after = COMMAND.search(rest)
            rest = re.split(r"\s(?:&&|\|\||;|\|)\s", rest[:after.start()] if after else rest)[0]
            if PLACEHOLDER.search(rest):
                continue
            try:
                args = tuple(shlex.split(rest))
            except ValueError:  # prose quoting in an inline span
                args = tuple(rest.split())
            out.append(CommandLine(where, command, args, f"{match.group(0).strip()} {rest.strip()}".strip()))
    return out


def _codes(page_paths, config_paths):
    """(where, code) of every page's code and every config's comments (or of the files given)."""
    for paths, code_of in ((pages() if page_paths is None else page_paths, code_of_page),
                           (configs() if config_paths is None else config_paths, code_of_config)):
        for path in paths:
            where = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
            for code in code_of(path.read_text()):
                yield where, re.sub(r"\\\n\s*", " ", code)


def all_command_lines(page_paths=None, config_paths=None) -> list[CommandLine]:
    """The ``main.py`` command lines of every page and config comment (or of the files given)."""
    return [line for where, code in _codes(page_paths, config_paths) for line in command_lines(code, where)]


def script_lines(page_paths=None, config_paths=None) -> list[CommandLine]:
    """``python benchmarks/NAME.py ARGS`` lines (``command`` the script's path)."""
    out = []
    for where, code in _codes(page_paths, config_paths):
        for line in code.splitlines():
            for match in SCRIPT.finditer(line.split(" #", 1)[0]):
                if not PLACEHOLDER.search(match.group(2)):
                    out.append(CommandLine(where, match.group(1), tuple(shlex.split(match.group(2))), match.group(0)))
    return out


def make_lines(page_paths=None) -> list[CommandLine]:
    """``make TARGET [VAR=value ...]`` in the pages' code (``command`` the target)."""
    out = []
    for where, code in _codes(page_paths, []):
        for line in code.splitlines():
            for match in MAKE.finditer(line.split(" #", 1)[0].strip()):
                out.append(CommandLine(where, match.group(1), tuple(match.group(2).split()), match.group(0).strip()))
    return out
