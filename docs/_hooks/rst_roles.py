"""Griffe extension for the API reference: the docstrings' reStructuredText roles (:class:`~a.B`, :func:`f`) become
Markdown code spans (`B`, `f`), and an rst literal-block marker ``::`` a colon; ``double backticks`` are already
code in Markdown."""

from __future__ import annotations

import re

from griffe import Extension

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`(~?)([^`]+)`")


def markdown_of(text: str) -> str:
    text = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.M)


class RstRoles(Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
