"""The documentation: the site builds with warnings as errors (broken links and anchors included), every flag and
config key a page or the README names exists in the command line's own parsers, the README's links resolve, and
the README stays a five-minute read."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from qat_app.cli import EXTRA_COMMANDS, LIGHTNING_COMMANDS
from qat_app.cli_reference import command_flags, settings
from tests._doc_commands import COMMAND, DOCS, FENCE, INLINE, README, ROOT, pages

PAGES = pages()[1:]  # the README aside
README_LIMIT = 12 * 1024
# flags a page misspells on purpose, to show the error a typo gets
DELIBERATE_TYPOS = {"--model.lrr"}

FLAG = re.compile(r"(?<![\w-])(--[a-z][\w.+-]*)")
KEY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?:[= ].*)?$")


def _texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in [README, *PAGES]]


def _code(text: str) -> tuple[list[str], list[str]]:
    """(fenced blocks, inline code spans outside them)."""
    blocks = FENCE.findall(text)
    return blocks, INLINE.findall(FENCE.sub("", text))


def _command_lines(code: str) -> list[tuple[str, str]]:
    """(command, its flags text) of every ``main.py CMD ...`` in ``code`` (continued lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0]
        for match in COMMAND.finditer(line):
            command = match.group(1) or match.group(2)
            if command in (*LIGHTNING_COMMANDS, *EXTRA_COMMANDS):
                rest = line[match.end():]
                out.append((command, COMMAND.split(rest, maxsplit=1)[0] if COMMAND.search(rest) else rest))
    return out


def _all_flags() -> set[str]:
    return set().union(*(command_flags(c) for c in (*LIGHTNING_COMMANDS, *EXTRA_COMMANDS)))


def _sections() -> set[str]:
    return {s.key.split(".")[0] for s in settings("fit")} | {"trainer"}


def _known_key(key: str, flags: set[str]) -> bool:
    """A setting (``--key`` is a flag) or a section of settings (``model.quant``)."""
    return f"--{key}" in flags or any(flag.startswith(f"--{key}.") for flag in flags)


def test_the_readme_is_a_five_minute_read():
    assert README.stat().st_size < README_LIMIT, README.stat().st_size
    text = README.read_text()
    assert "make quickstart" in text and "make test" in text  # the two commands


def test_every_flag_of_a_command_line_exists():
    unknown = []
    for name, text in _texts():
        blocks, spans = _code(text)
        for code in [*blocks, *spans]:
            for command, rest in _command_lines(code):
                flags = command_flags(command)
                for token in shlex.split(rest, posix=True, comments=False) if "'" not in rest else rest.split():
                    flag = token.split("=", 1)[0]
                    if FLAG.fullmatch(flag) and flag not in flags:
                        unknown.append(f"{name}: {command} {flag}")
    assert not unknown, unknown


def test_every_flag_named_alone_exists():
    """A settings flag in the prose (`--model.quant.history_len 30`) exists in some command (undotted flags in prose
    may be another tool's: pip's --no-deps, lm-eval's --limit)."""
    flags, unknown = _all_flags(), []
    for name, text in _texts():
        _, spans = _code(text)
        for span in spans:
            if COMMAND.search(span):
                continue  # a whole command line: checked against its own command above
            for flag in FLAG.findall(span):
                flag = flag.split("=", 1)[0].rstrip(".+")
                if "." in flag and flag not in flags and flag not in DELIBERATE_TYPOS:
                    unknown.append(f"{name}: {flag}")
    assert not unknown, unknown


def test_every_config_key_a_page_names_exists():
    """Inline keys (`saturation.headroom_grid`, `model.quant.enabled=false`) and the YAML blocks' keys."""
    flags, sections, unknown = command_flags("fit") | command_flags("validate"), _sections(), []
    for name, text in _texts():
        blocks, spans = _code(text)
        for span in spans:
            key = KEY.match(span.strip())
            if key and key.group(1).split(".")[0] in sections and not key.group(1).endswith((".yaml", ".json", ".py")):
                if not _known_key(key.group(1).removesuffix(".*"), flags):
                    unknown.append(f"{name}: {key.group(1)}")
        for block in blocks:
            unknown += [f"{name}: {k}" for k in _yaml_keys(block, sections) if not _known_key(k, flags)]
    assert not unknown, unknown


def _yaml_keys(block: str, sections: set[str]) -> list[str]:
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError:
        return []
    if not isinstance(data, dict) or not set(data) & sections - {"trainer"}:
        return []  # not a LightningCLI config
    keys: list[str] = []

    def walk(value, prefix):
        if isinstance(value, dict) and "class_path" in value and prefix != "data":
            return  # a class of a library (a logger, a callback): its own arguments
        if isinstance(value, dict):
            for k, v in value.items():
                if k in ("class_path", "init_args") and prefix == "data":
                    walk(v, f"{prefix}.init_args" if k == "init_args" else prefix)
                    continue
                keys.append(f"{prefix}.{k}" if prefix else str(k))
                walk(v, keys[-1])

    walk(data, "")
    return [k for k in keys if k.split(".")[0] in sections and not k.endswith(".class_path")]


def _anchors(markdown: str) -> set[str]:
    """The heading ids MkDocs' toc extension gives (lower case, punctuation dropped, spaces to hyphens)."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
        ids.add(re.sub(r"[\s]+", "-", slug).strip("-"))
    return ids


def test_the_readme_links_resolve():
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(target)
    assert not broken, broken


def test_every_module_of_the_core_has_an_api_section():
    api = (DOCS / "api.md").read_text()
    missing = [p.stem for p in (ROOT / "qat_app" / "hif8").glob("*.py")
               if p.stem != "__init__" and f"::: qat_app.hif8.{p.stem}\n" not in api]
    assert not missing, missing


def test_the_check_finds_a_misspelled_flag_and_key(tmp_path):
    """The checks above can fail: a misspelled flag, key and YAML key are each caught."""
    flags = command_flags("fit")
    assert "--saturation.headroom_grid" in flags and "--saturation.headroom_gird" not in flags
    assert not _known_key("fallback.policy.windw", flags) and _known_key("fallback.policy.window", flags)
    assert _yaml_keys("saturation:\n  per_layr: true\ndata:\n  init_args:\n    seq_len: 8\n", _sections()) == \
        ["saturation", "saturation.per_layr", "data", "data.init_args.seq_len"]
    assert [c for c, _ in _command_lines("python main.py export --ckpt_path x \\\n  --ovewrite")] == ["export"]
    assert "--ovewrite" not in command_flags("export") and "--data.init_args.seq_len" in command_flags("fit")


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a missing page or a docstring griffe cannot read fails."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (site / "configuration" / "index.html").read_text()
    assert "saturation.headroom_grid" in reference and "model.quant.amax_algo" in reference  # generated
    api = (site / "api" / "index.html").read_text()
    assert "fake_quantize" in api and ":class:" not in api  # from the docstrings, rst roles converted


PAGE_LIMIT = 12 * 1024
GENERATED = {"configuration.md", "api.md"}  # references generated from the code at build time
# wording about how the project was developed, not about the tool: a manual has none
NOTEBOOK = re.compile(r"\b(issue|issues) #?\d+|\bthis session\b|\bformer path\b|\b(previous|older) mains?\b|"
                      r"\bnot met\b|\bno (GPU|device) (was )?lent\b", re.I)


def test_no_page_is_over_12_kib_but_the_generated_references():
    large = [(p.name, p.stat().st_size) for p in PAGES if p.name not in GENERATED and p.stat().st_size > PAGE_LIMIT]
    assert not large, large


def test_the_pages_speak_of_the_tool_not_of_its_development():
    found = [f"{name}: {m.group(0)}" for name, text in _texts() for m in NOTEBOOK.finditer(text)]
    assert not found, found


# what a reader of the configs, tests and benchmarks meets too: no issue numbers, commits or "older mains"
DEVELOPMENT = re.compile(NOTEBOOK.pattern + r"|\bcommit [0-9a-f]{7,}\b|\b(older|earlier) mains?'?s?\b", re.I)


def test_configs_tests_and_benchmarks_speak_of_the_tool_not_of_its_development():
    files = [*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("benchmarks/*.sh"), ROOT / "Makefile"]
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in files if p.name != "test_docs.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in DEVELOPMENT.finditer(line)]
    assert len(files) > 100 and not found, found


def test_the_layout_page_names_every_module_and_config():
    text = (DOCS / "layout.md").read_text()
    files = [*ROOT.glob("qat_app/**/*.py"), *ROOT.glob("callbacks/*.py"), *ROOT.glob("configs/**/*.yaml")]
    missing = [str(p.relative_to(ROOT)) for p in files if p.name not in ("__init__.py", "__main__.py")
               and not re.search(rf"(?<![\w.]){re.escape(p.stem)}\b", text)]
    assert len(files) > 150 and not missing, missing
