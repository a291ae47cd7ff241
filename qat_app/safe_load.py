"""Loading a checkpoint's files as data: weights-only ``torch.load`` everywhere, one line for a refused pickle.

The one allowlist is the classes earlier versions pickled into checkpoints; ``--weights_only false`` loads a
trusted file whole.
"""

from __future__ import annotations

import pickle
import re

import torch

from .config import QuantConfig
from .errors import UnsafeFileError

# What a file may hold is data: every load here is weights-only (torch's default since 2.6), and so is
# Lightning's own. The one allowlist: the classes earlier versions pickled into checkpoints (a hand-written
# QuantConfig in the hyper-parameters; today's store a plain dict). For every load of the process, Lightning's too.
LEGACY_PICKLED_CLASSES = (QuantConfig,)
torch.serialization.add_safe_globals(list(LEGACY_PICKLED_CLASSES))
UNSAFE_FLAG = "--weights_only false"


def unsafe_file_error(path: str, err: BaseException, flag: str = UNSAFE_FLAG) -> UnsafeFileError:
    """The one line for a file a weights-only load refused: the file, the first global it names, the flag."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    what = f"a pickled reference to {found.group(1)}" if found else "pickled objects"
    return UnsafeFileError(f"{path} holds {what}, which a weights-only load refuses: loading it could run code the "
                           f"file carries. Load it only if you trust where it came from, with {flag}")


def torch_load(path: str, weights_only: bool | None = None, flag: str = UNSAFE_FLAG, **kwargs):
    """``torch.load`` on CPU, weights-only unless ``weights_only is False``; a refused pickle is
    :class:`UnsafeFileError` (one line naming the file, the global and ``flag``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only is not False, **kwargs)
    except pickle.UnpicklingError as err:
        if weights_only is not False and "Weights only load failed" in str(err):
            raise unsafe_file_error(path, err, flag) from None
        raise


MAX_LISTED = 6


def listed(items: list[str]) -> str:
    """The first few of ``items``, joined, and how many more."""
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f", ... ({len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else "")
