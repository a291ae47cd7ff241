"""The error of this package: bad training data."""

from __future__ import annotations

from qat_app.errors import QATError


class DataError(QATError, ValueError):
    """A problem with the training data (names the file / dataset it concerns)."""
