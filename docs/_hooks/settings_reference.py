"""MkDocs hook: the page marker ``<!-- settings-reference -->`` becomes the table of every ``main.py fit`` setting
(trainer.* aside), generated from the parser (:func:`qat_app.cli_reference.settings`): never a second list."""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARKER = "<!-- settings-reference -->"
ROOT = Path(__file__).resolve().parents[2]


def _first_sentence(text: str) -> str:
    text = text.replace("|", "\\|")
    match = re.match(r"(.+?[.;])(\s|$)", text)
    return match.group(1) if match else text


def _table() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from qat_app.cli_reference import settings

    sections: dict[str, list] = {}
    for setting in settings("fit"):
        section = setting.key.split(".")[0] if "." in setting.key else "(top level)"
        if setting.key.startswith("data.benchmarks."):
            section = "data.benchmarks"
        sections.setdefault(section, []).append(setting)
    out = []
    for section, rows in sections.items():
        out += [f"### {section}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{s.key}` | `{s.type}` | `{s.default}` | {_first_sentence(s.help)} |".replace("``", "`")
                for s in rows]
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, _table()) if MARKER in markdown else markdown
