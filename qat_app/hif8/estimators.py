"""The amax estimators (``quant.amax_algo``): how each takes ``a_hat``, declared once.

A delayed estimator takes ``a_hat`` from the amax history of earlier optimizer steps (the window ``[..., H]``,
newest first) and exp_smooth's running estimate; ``current`` takes the tensor's own amax in the forward, and keeps
the most recent amax as the ``a_hat`` it logs. Every scaler keeps every delayed estimator's scale (the what-if:
what each would have clipped with the same history), so adding an estimator is one entry of :data:`ESTIMATORS`
(and its line in ``docs/glossary.md``); the recipe's choices, the what-if columns, the scalers' advance and the
report's line styles all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# (amax history [..., H] newest first, exp_smooth's estimate [...]) -> a_hat [...]
Estimate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Estimator:
    """One ``quant.amax_algo``."""

    name: str
    a_hat: Optional[Estimate]  # a delayed estimator's a_hat (None: current scaling, from the tensor itself)
    logs_as: str  # the delayed estimate kept as the scaler's a_hat (its own, or current's most recent amax)
    windowed: bool  # its a_hat is read off the window (re-read when the warmup's end seeds the window)
    style: tuple[str, str]  # the report's colour and line style for its what-if curve


ESTIMATORS = (
    Estimator("most_recent", lambda history, smoothed: history[..., 0], "most_recent", True, ("tab:blue", "-")),
    Estimator("exp_smooth", lambda history, smoothed: smoothed, "exp_smooth", False, ("tab:orange", "--")),
    Estimator("max", lambda history, smoothed: history.amax(dim=-1), "max", True, ("tab:green", "-.")),
    Estimator("current", None, "most_recent", True, ("tab:purple", ":")),
)
BY_NAME = {estimator.name: estimator for estimator in ESTIMATORS}

AMAX_ALGOS = tuple(estimator.name for estimator in ESTIMATORS)
WHATIF_ALGOS = AMAX_ALGOS  # one what-if count per estimator, in this order
DELAYED_ALGOS = tuple(e.name for e in ESTIMATORS if e.a_hat is not None)  # the ones whose scale a scaler keeps


def delayed_estimates(history: torch.Tensor, smoothed: torch.Tensor) -> torch.Tensor:
    """a_hat of every delayed estimator (``[..., len(DELAYED_ALGOS)]``) from an amax history ``[..., H]`` and
    exp_smooth's estimate ``[...]`` (already updated): the one definition, for a scaler's own a_hat and its what-if."""
    return torch.stack([e.a_hat(history, smoothed) for e in ESTIMATORS if e.a_hat is not None], dim=-1)


def own_estimate(algo: str) -> int:
    """The column of :func:`delayed_estimates` that is an ``algo`` scaler's a_hat."""
    return DELAYED_ALGOS.index(BY_NAME[algo].logs_as)
