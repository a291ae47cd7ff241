"""One clear line for a command-line mistake, whatever library found it.

jsonargparse reports a bad value as a page (``Parser key "x": Does not validate against any of the Union
subtypes ... Given value: Namespace(...)``), YAML errors without the file, an empty file as "Unexpected
config". :func:`explain_argument_error` turns such a message into ``<field or file>: <what is wrong>;
<what is expected> (did you mean ...?)``, the line ``python main.py`` prints after ``error:``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import sys
from pathlib import Path

from .errors import did_you_mean, nearest

_KEY_RE = re.compile(r'Parser key "([^"]+)":?')
_LITERAL_RE = re.compile(r"Literal\[([^\]]*)\]")
_GIVEN_RE = re.compile(r"(?:Given|Got) value:\s*(.+?)\s*$", re.M)
_CLASS_PATH_RE = re.compile(r"Problem with given class_path '([^']+)'|Expected a dot import path string: (\S+)")
_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
          "Expected a <class 'NoneType'>", "Expected a <class 'bool'>")
# where a short class name given as class_path is looked up for a suggestion
_CLASS_MODULES = ("lightning.pytorch.loggers", "lightning.pytorch.callbacks", "lightning.pytorch.strategies",
                  "qat_app.data.pretrain", "qat_app.data.benchmarks", "torch.optim", "torch.optim.lr_scheduler")


def config_files(argv: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _yaml_problem(files: list[str]) -> str | None:
    import yaml

    for name in files:
        try:
            text = Path(name).read_text()
        except OSError as err:
            return f"--config {name}: cannot be read ({err.strerror or err})"
        if not text.strip():
            return f"--config {name}: the config file is empty; it must hold the settings (see configs/*.yaml)"
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            return f"--config {name}: not valid YAML{where}: {getattr(err, 'problem', None) or err}"
        if value is None:
            return f"--config {name}: the config file is empty (only comments); it must hold the settings"
        if not isinstance(value, dict):
            return f"--config {name}: expected a mapping of settings (trainer:, model:, data:), got a {type(value).__name__}"
    return None


def _flag_names(parser) -> list[str]:
    return [s for action in getattr(parser, "_actions", []) for s in getattr(action, "option_strings", [])
            if s.startswith("--")]


def _class_suggestion(given: str) -> str:
    module_name, _, short = given.rpartition(".")
    candidates: dict[str, str] = {}
    for name in ([module_name] if module_name else []) + list(_CLASS_MODULES):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a wrong module path is what we are explaining
            continue
        for attr in dir(module):
            if attr[:1].isupper():
                candidates.setdefault(attr, f"{module.__name__}.{attr}")
    close = nearest(short, candidates)
    return f" (did you mean {candidates[close[0]]}?)" if close else ""


def _init_arg_names(class_path: str) -> list[str]:
    import inspect

    try:
        module, name = class_path.rsplit(".", 1)
        return [p for p in inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
                if p not in ("self", "args", "kwargs")]
    except Exception:  # noqa: BLE001 - only for a suggestion
        return []


def _value_problem(key: str, text: str) -> str:
    given = _GIVEN_RE.findall(text)
    value = given[0] if given else None
    cls = _CLASS_PATH_RE.search(text)
    option = re.search(r"(?:Option|Key) '([^']+)' is not (?:accepted|expected)", text)
    if cls and cls.group(1) and option:  # a known class, an unknown init argument
        names = _init_arg_names(cls.group(1))
        close = nearest(option.group(1), names)
        return (f"{key}.init_args.{option.group(1)}: {cls.group(1).rsplit('.', 1)[-1]} has no such setting"
                + (f" (did you mean {key}.init_args.{close[0]}?)" if close else f"; it takes {', '.join(names)}"))
    if cls:
        path = cls.group(1) or cls.group(2)
        return f"{key}.class_path={path}: no such class{_class_suggestion(path)}"
    allowed = list(dict.fromkeys(v.strip().strip("'\"") for group in _LITERAL_RE.findall(text)
                                 for v in group.split(",") if v.strip()))
    if allowed:
        shown = value if value is not None else "?"
        return f"{key}={shown}: expected one of {', '.join(allowed)}{did_you_mean(shown, allowed)}"
    lines = [line.strip(" -") for line in text.splitlines()[1:] if line.strip()]
    useful = [line for line in lines if not line.startswith(_NOISE)]
    reason = useful[0] if useful else (lines[0] if lines else "invalid value")
    reason = re.sub(r"\s*Got value:.*$", "", reason)
    expected = re.match(r"Expected an? <class '(\w+)'>", reason)
    if expected:
        reason = f"expected {'an' if expected.group(1)[0] in 'aeiou' else 'a'} {expected.group(1)}"
    return f"{key}{'=' + value if value is not None and 'Namespace(' not in value and 'NestedArg(' not in value else ''}: {reason}"


def _missing_settings(names: str) -> str:
    """jsonargparse's ``required: validate.data``, said with the flag that gives it (a run's config holds them all)."""
    keys = [re.sub(r"^(fit|validate|test)\.", "", name.strip()) for name in names.split(",")]
    return (f"missing {', '.join('--' + key for key in keys)}: give the run's --config FILE (e.g. configs/quickstart.yaml "
            "or runs/NAME/logs/version_0/config.yaml), which holds its model and data sections, or the flags")


def explain_argument_error(message: str, argv: list[str], parser=None) -> str:
    """The one-line explanation of a jsonargparse / argparse error message."""
    text = str(message).strip()
    if text.startswith(("Problems parsing config", "Unexpected config")) or "<unicode string>" in text:
        problem = _yaml_problem(config_files(argv))
        if problem:
            return problem
    key = _KEY_RE.search(text)
    if key and key.group(1) == "config":
        missing = re.search(r"File does not exist: '?([^']+)'?", text)
        return f"--config {missing.group(1)}: no such file" if missing else f"--config: {text.split(':', 1)[-1].strip()}"
    required = re.match(r"the following arguments are required: (.+)$", text)
    if required:
        return _missing_settings(required.group(1))
    unknown = re.match(r"unrecognized arguments: (\S+)", text, re.I)
    if unknown:
        flag = unknown.group(1).split("=", 1)[0]
        return f"unknown flag {flag}{did_you_mean(flag, _flag_names(parser)) if parser is not None else ''}"
    unexpected = re.search(r"Key \"([^\"]+)\" is not expected|No action for key \"([^\"]+)\""
                           r"|does not accept (?:option|nested key) '([^']+)'", text)
    if unexpected:
        bad = next(g for g in unexpected.groups() if g)
        flags = [f[2:] for f in _flag_names(parser)] if parser is not None else []
        return f"{bad}: unknown setting{did_you_mean(bad, flags)}"
    keys = list(_KEY_RE.finditer(text))
    if len(keys) > 1:  # a setting inside a class inside a class: data.init_args.benchmarks.init_args.limit_mode
        parts = [keys[0].group(1)]
        for outer, inner in zip(keys, keys[1:]):
            nested = "Problem with given class_path" in text[outer.end():inner.start()]
            parts.append(("init_args." if nested else "") + inner.group(1))
        return _value_problem(".".join(parts), text[keys[-1].start():])
    if key:
        return _value_problem(key.group(1), text)
    return " ".join(text.split())


# One spelling of the checkpoint flag in every command (Lightning's); the old spellings still work, with one line.
CHECKPOINT_FLAG = "--ckpt_path"
DEPRECATED_FLAGS = {"--ckpt": CHECKPOINT_FLAG}


def replace_deprecated_flags(argv: list[str], warn=None) -> list[str]:
    """``argv`` with each deprecated flag (``--ckpt X``, ``--ckpt=X``) spelled as its replacement; ``warn`` (default:
    print to stderr) gets one deprecation line per flag used."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    out, said = [], set()
    for arg in argv:
        flag, sep, value = arg.partition("=")
        if flag in DEPRECATED_FLAGS:
            if flag not in said:
                warn(f"warning: {flag} is deprecated; use {DEPRECATED_FLAGS[flag]} (the same flag in every command)")
                said.add(flag)
            arg = DEPRECATED_FLAGS[flag] + sep + value
        out.append(arg)
    return out


def unknown_flags_line(unknown: list[str], parser) -> str:
    """``unknown flag --ovewrite (did you mean --overwrite?)``: each unrecognized flag named, with the nearest one."""
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")] or list(unknown)
    known = _flag_names(parser)
    return "; ".join(f"unknown flag {flag}{did_you_mean(flag, known)}" for flag in flags)


def flag_spellings(flags: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the flags as shown: each long flag spelled with underscores, as LightningCLI spells ``fit``'s; the other
    spellings, with dashes, accepted as aliases) of one ``add_argument``'s option strings."""
    shown, aliases = [], []
    for flag in flags:
        if flag.startswith("--") and ("-" in flag[2:] or "_" in flag[2:]):
            for spelling, into in (("--" + flag[2:].replace("-", "_"), shown), ("--" + flag[2:].replace("_", "-"), aliases)):
                if spelling not in shown and spelling not in aliases:
                    into.append(spelling)
        elif flag not in shown:
            shown.append(flag)
    return shown, aliases


class BothSpellings:
    """Parser mixin: every long flag accepted in both spellings (``--compute_dtype`` and ``--compute-dtype``), help
    showing the underscore one (:class:`OneSpellingHelp`)."""

    def add_argument(self, *flags, **kwargs):
        shown, aliases = flag_spellings(flags)
        action = super().add_argument(*shown, *aliases, **kwargs)  # dest: from the first, underscored spelling
        action.aliases = frozenset(aliases)
        return action


class OneSpellingHelpMixin:
    """Help that shows each flag once: the aliases :class:`BothSpellings` added are left out."""

    def _format_action_invocation(self, action):
        aliases = getattr(action, "aliases", ())
        if not aliases:
            return super()._format_action_invocation(action)
        shown = copy.copy(action)
        shown.option_strings = [s for s in action.option_strings if s not in aliases]
        return super()._format_action_invocation(shown)


class OneSpellingHelp(OneSpellingHelpMixin, argparse.HelpFormatter):
    pass


class ProgramParser(BothSpellings, argparse.ArgumentParser):
    """The parser of the plain-argparse commands (``export``, ``report``, ``inspect``): no abbreviated flags
    (``--ckpt`` must not silently mean ``--ckpt_path``), deprecated spellings replaced with a warning, every flag in
    both spellings (help shows LightningCLI's), and an unknown flag named with the nearest known one, as the
    LightningCLI commands do."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", OneSpellingHelp)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = replace_deprecated_flags(list(sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.+)$", message)
        if unknown:
            message = unknown_flags_line(unknown.group(1).split(), self)
        super().error(message)
