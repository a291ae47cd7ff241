"""Error types for problems the user can fix: a bad setting, bad data, a bad checkpoint, a run that diverged.

``python main.py`` prints such an error as one ``error: ...`` line naming the setting / file (no traceback;
set ``QAT_APP_TRACEBACK=1`` to get one) and exits with status 2 (input) or 1 (run). Every other exception
is a bug and keeps its traceback. All input errors are also ``ValueError`` subclasses, so code catching
``ValueError`` keeps working.
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager


def nearest(word, choices, n: int = 1) -> list[str]:
    """The closest of ``choices`` to a mistyped ``word`` (difflib, cutoff 0.6): the hint of an error message."""
    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)


def did_you_mean(word, choices) -> str:
    """``" (did you mean X?)"`` for the nearest choice, or ``""``."""
    close = nearest(word, choices)
    return f" (did you mean {close[0]}?)" if close else ""


class QATError(Exception):
    """Base class: the message says what is wrong and names the setting or file."""

    exit_code = 2


class ConfigError(QATError, ValueError):
    """A setting is invalid; the message names the field (``model.lr``, ``data.global_batch_size``, ...)."""


@contextmanager
def settings_of(section: str):
    """Raise a core :class:`~qat_app.hif8.errors.FieldError` inside as a :class:`ConfigError` naming
    ``<section>.<field>``: the core names its own fields, the command line adds where they live."""
    from .hif8.errors import FieldError  # here, not at the top: importing the core imports torch

    try:
        yield
    except FieldError as err:
        raise ConfigError(f"{section}.{err.field}{err.sep}{err.message}") from None


class CheckpointError(QATError, ValueError):
    """A checkpoint cannot be resumed from (unreadable, truncated, not a QATModule checkpoint, other model)."""


class UnsafeFileError(CheckpointError):
    """A file that holds pickled objects a weights-only load refuses (loading it could run code it carries)."""
