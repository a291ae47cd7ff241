"""The first screen shows what the run does: library notices that say nothing about it are dropped here,
each for a stated reason, by message (anything else those libraries say still shows)."""

from __future__ import annotations

import logging
import warnings

# (message regex, why it does not apply to our runs)
IGNORED_WARNINGS = (
    # Lightning 2.6's pytree helper uses torch's LeafSpec, deprecated in torch 2.10+: Lightning's code, not ours
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning's own use of a torch API"),
    # our training stream has a length (the epoch Lightning counts in) and is sharded per rank AND per worker
    # (qat_app.data.loader.PackedBlockStream), so the duplicate-data risk the warning describes cannot occur
    (r"Your `IterableDataset` has `__len__` defined", "every worker reads its own shard"),
)
IGNORED_INFO_PREFIXES = (
    "💡 Tip: For seamless cloud",  # Lightning's adverts for litlogger and litmodels
    # the CLI adds its QATModelSummary where Lightning would add its own: nothing for the user to act on
    "Trainer already configured with model summary callbacks",
)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(IGNORED_INFO_PREFIXES)


def quiet_library_notices() -> None:
    """Install the filters (idempotent: warnings.filterwarnings and addFilter ignore repeats)."""
    for message, _why in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in log.filters):
            log.addFilter(_DropAdverts())
