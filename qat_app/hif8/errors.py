"""The core's own exception types (the app maps them to its command-line errors, adding its prefix)."""

from __future__ import annotations


class HiF8Error(Exception):
    """Base class of the errors the core raises for input a caller can fix."""


class FieldError(HiF8Error, ValueError):
    """A setting that is wrong; ``field`` names it (``amax_algo``, ``module_pattern``, ...)."""

    def __init__(self, field: str, message: str, sep: str = ": ") -> None:
        super().__init__(f"{field}{sep}{message}")
        self.field, self.message, self.sep = field, message, sep


class RecipeError(FieldError):
    """An invalid recipe, selection or runtime setting."""


class SelectionError(FieldError):
    """The layer selection matches nothing, or does not fit the model."""
