"""Stacked scaler state: the buffers of many :class:`~qat_app.hif8.scaling.AmaxScaler` as rows of a few tensors, and
the per-optimizer-step protocol (sync, advance or discard, seed) as a few batched ops on them.

Each scaler's buffers are views into the bank's tensors, so the forward observes into them as before and
``state_dict`` and checkpoints keep the per-layer layout. Contract: this is the one implementation of the update;
:meth:`~qat_app.hif8.scaling.AmaxScaler.advance`, ``seed_history`` and ``discard_step`` run it on a bank of one,
so a scaler advanced alone and one advanced with the whole model get the same bits. A step costs the same few ops
whatever the number of scalers. ``model.to(...)`` replaces the buffers; the next batched call notices and stacks
again. At each step boundary the bank also closes the what-if counts and computes the delayed estimators' scales.

See ``docs/core.md`` for the per-step protocol.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .fake_quant import compute_scale
from .estimators import BY_NAME, WHATIF_ALGOS, delayed_estimates, own_estimate

# A scaler as the bank sees it: a module holding the buffers named in the rows below and the recipe's attributes
# (algo, history_len, alpha, margin, power_2, max_val). The bank never imports AmaxScaler: the import goes one way,
# scaling -> scaler_bank (a scaler's own advance is a bank of one).
Scaler = nn.Module

# Row order matters: the step accumulators come first in each matrix, so one slice zeroes them.
F32_ROWS = ("step_amax", "step_seen", "step_clipped_anywhere", "a_hat", "scale", "last_amax", "last_a_hat",
            "last_headroom", "min_headroom", "smoothed_a_hat")
I64_ROWS = ("step_clipped", "step_numel", "steps_recorded", "last_clipped", "last_numel", "total_clipped",
            "total_numel", "saturation_events", "quantized_steps")
_F = {name: i for i, name in enumerate(F32_ROWS)}
_I = {name: i for i, name in enumerate(I64_ROWS)}
# per-scaler vectors over WHATIF_ALGOS (int64 counts; the first is the step accumulator) and DELAYED_ALGOS (scales)
WHATIF_ROWS = ("step_whatif_clipped", "last_whatif_clipped", "total_whatif_clipped", "whatif_events")
WHATIF_ANYWHERE = "step_whatif_anywhere"  # 1.0 where any rank's what-if clipped this step (set by sync_step_amax)
WHATIF_SCALE = "whatif_scale"
# float entries per scaler in the step's MAX all-reduce: step_amax, step_seen, clipped > 0, what-if clipped > 0
SYNC_WIDTH = 3 + len(WHATIF_ALGOS)


def _data_parallel(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class ScalerBank:
    """The stacked state of ``scalers`` (same algorithm, window, alpha, max_val, margin and device).

    ``max_val`` is shared so the scale is computed exactly as one scaler computes it
    (``max_val / a_hat`` with a Python scalar is ``reciprocal(a_hat) * max_val`` in torch).
    """

    def __init__(self, scalers: list[Scaler]) -> None:
        first = scalers[0]
        self.algo, self.history_len, self.alpha, self.margin = first.algo, first.history_len, first.alpha, first.margin
        self.power_2 = first.power_2
        self.max_val = first.max_val
        # the column of delayed_estimates that is this bank's a_hat (current: what it saw last, for logging
        # and fallback)
        self.own_estimate = own_estimate(self.algo)
        self.scalers = list(scalers)
        with torch.no_grad():
            self.f32 = torch.stack([torch.stack([s._buffers[r] for s in scalers]) for r in F32_ROWS])
            self.i64 = torch.stack([torch.stack([s._buffers[r] for s in scalers]) for r in I64_ROWS])
            self.history = torch.stack([s._buffers["amax_history"] for s in scalers])
            self.whatif = torch.stack([torch.stack([s._buffers[r] for s in scalers]) for r in WHATIF_ROWS])
            self.whatif_anywhere = torch.stack([s._buffers[WHATIF_ANYWHERE] for s in scalers])
            self.whatif_scale = torch.stack([s._buffers[WHATIF_SCALE] for s in scalers])
        for i, scaler in enumerate(scalers):
            for name, row in _F.items():
                scaler._buffers[name] = self.f32[row, i]
            for name, row in _I.items():
                scaler._buffers[name] = self.i64[row, i]
            for row, name in enumerate(WHATIF_ROWS):
                scaler._buffers[name] = self.whatif[row, i]
            scaler._buffers[WHATIF_ANYWHERE] = self.whatif_anywhere[i]
            scaler._buffers[WHATIF_SCALE] = self.whatif_scale[i]
            scaler._buffers["amax_history"] = self.history[i]
            scaler._bank = self
        self._current_key: tuple | None = None
        self._current_mask: torch.Tensor | None = None

    def row(self, name: str) -> torch.Tensor:
        return self.f32[_F[name]] if name in _F else self.i64[_I[name]]

    def intact(self, scalers: list[Scaler]) -> bool:
        """Still the views of these scalers (no ``.to()`` / ``load`` replaced a buffer since)."""
        return len(scalers) == len(self.scalers) and all(
            a is b and a._buffers["amax_history"]._base is self.history for a, b in zip(scalers, self.scalers))

    def _uses_current_scaling(self) -> torch.Tensor:
        key = tuple(s.uses_current_scaling for s in self.scalers)
        if key != self._current_key:  # changes only while histories fill: a host->device copy then
            self._current_key = key
            self._current_mask = torch.tensor(key, device=self.history.device)
        return self._current_mask

    # ------------------------------------------------------------------------------- the step
    def sync_parts(self) -> torch.Tensor:
        """``[step_amax, step_seen, clipped > 0, what-if clipped > 0]`` of every row, flat (``SYNC_WIDTH * n``
        entries, for the one MAX all-reduce)."""
        return torch.cat([self.f32[:2].reshape(-1), (self.row("step_clipped") > 0).float(),
                          (self.whatif[0] > 0).float().reshape(-1)])

    def take_synced(self, flat: torch.Tensor) -> None:
        n = len(self.scalers)
        self.f32[:2].copy_(flat[: 2 * n].view(2, n))
        self.row("step_clipped_anywhere").copy_(flat[2 * n: 3 * n])
        self.whatif_anywhere.copy_(flat[3 * n: SYNC_WIDTH * n].view(n, len(WHATIF_ALGOS)))

    @torch.no_grad()
    def advance(self) -> None:
        """Close one optimizer step of every row: push its amax into the history (a valid one: finite, and the
        tensor was seen), record the step's telemetry, compute the next a_hat and scale (see :mod:`.scaling`)."""
        f, i, history = self.f32, self.i64, self.history
        amax, seen, anywhere = f[0], f[1], f[2]
        a_hat, scale = f[_F["a_hat"]], f[_F["scale"]]
        step_clipped, step_numel = i[0], i[1]
        valid = torch.isfinite(amax) & (seen > 0)
        first = i[_I["steps_recorded"]] == 0
        pushed = torch.cat([amax[:, None], history[:, :-1]], dim=1)
        history.copy_(torch.where(valid[:, None], pushed, history))
        f[_F["last_amax"]].copy_(amax)
        last_a_hat = f[_F["last_a_hat"]]
        last_a_hat.copy_(self._estimate_used(amax, a_hat, scale))
        i[3:5].copy_(i[0:2])  # last_clipped, last_numel
        i[5:7].add_(i[0:2])  # total_clipped, total_numel
        quantized = step_numel > 0
        i[_I["saturation_events"]].add_(((step_clipped > 0) | (anywhere > 0)).long())
        i[_I["quantized_steps"]].add_(quantized.long())
        headroom = torch.where(quantized & valid & (amax > 0), last_a_hat / amax, math.inf)
        f[_F["last_headroom"]].copy_(headroom)
        torch.minimum(f[_F["min_headroom"]], headroom, out=f[_F["min_headroom"]])
        # every delayed estimator's next a_hat from the same history: the own one, and the what-if ones
        smoothed = f[_F["smoothed_a_hat"]]  # exp_smooth's estimate (an exp_smooth scaler's a_hat is its copy)
        smoothed.copy_(torch.where(valid, self._smooth(amax, smoothed, first), smoothed))
        estimates = delayed_estimates(history, smoothed)
        a_hat.copy_(torch.where(valid, estimates[:, self.own_estimate], a_hat))
        i[_I["steps_recorded"]].add_(valid.long())
        scale.copy_(compute_scale(a_hat, self.max_val, self.margin, scale, self.power_2))
        # what-if scales by the same rule (a zero/NaN/inf estimate keeps that estimator's previous scale): the
        # own algorithm's column is the real scale, bit for bit
        self.whatif_scale.copy_(compute_scale(estimates, self.max_val, self.margin, self.whatif_scale, self.power_2))
        # what-if counts: close the step's (an event: >= 1 element clipped on any rank)
        whatif = self.whatif
        whatif[1].copy_(whatif[0])
        whatif[2].add_(whatif[0])
        whatif[3].add_(((whatif[0] > 0) | (self.whatif_anywhere > 0)).long())
        self._clear_step(closed=True)
        self._after_update()

    def _estimate_used(self, amax: torch.Tensor, a_hat: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The estimate the step was quantized with (for the headroom): its a_hat (the step's amax under current
        scaling); with power-of-two scales, the one the rounded scale stands for, max_val / (s 2^margin) >= a_hat."""
        current = self._uses_current_scaling()
        if not self.power_2:
            return torch.where(current, amax, a_hat)
        used = torch.where(current, compute_scale(amax, self.max_val, self.margin, scale, True), scale)
        return self.max_val / (used * 2.0**self.margin)

    def _smooth(self, amax, previous, first) -> torch.Tensor:
        """exp_smooth: alpha * amax(t-1) + (1 - alpha) * a_hat(t-1), a_hat(1) = amax(0)."""
        return torch.where(first, amax, self.alpha * amax + (1.0 - self.alpha) * previous)

    @torch.no_grad()
    def discard(self) -> None:
        """Forget this step's observations (a skipped step): a few ops for all rows."""
        self._clear_step(closed=False)

    def _clear_step(self, closed: bool) -> None:
        """Zero the step accumulators; the step's health vectors become the last step's (``closed``) or are dropped."""
        self.f32[:3].zero_()
        self.i64[:2].zero_()
        self.whatif[0].zero_()
        self.whatif_anywhere.zero_()
        for scaler in self.scalers:  # host state, set past nn.Module.__setattr__ (slow at thousands of scalers)
            state = scaler.__dict__
            state["observed_this_step"] = False
            state["health_last"] = state.get("health_step") if closed else None
            state["health_step"] = None

    @torch.no_grad()
    def seed_history(self) -> None:
        """End of the BF16 warmup: the window slots not yet recorded take the largest amax recorded so far
        (so the first quantized step sees a full window), then a_hat and the scale follow."""
        history, recorded_steps = self.history, self.row("steps_recorded")
        slots = torch.arange(self.history_len, device=history.device)
        recorded = slots[None, :] < recorded_steps[:, None]
        seen_max = torch.where(recorded, history, torch.zeros_like(history)).amax(dim=1, keepdim=True)
        history.copy_(torch.where(recorded, history, seen_max))
        a_hat, scale = self.row("a_hat"), self.row("scale")
        estimates = delayed_estimates(history, self.row("smoothed_a_hat"))
        if BY_NAME[self.algo].windowed:  # exp_smooth's estimate reads no window: it stays
            a_hat.copy_(estimates[:, self.own_estimate])
        scale.copy_(compute_scale(a_hat, self.max_val, self.margin, scale, self.power_2))
        self.whatif_scale.copy_(compute_scale(estimates, self.max_val, self.margin, self.whatif_scale, self.power_2))
        for scaler in self.scalers:
            scaler.__dict__["version"] += 1

    def _after_update(self) -> None:
        pending = [k for k, s in enumerate(self.scalers) if not s.has_history]
        if pending:  # one sync per step, only until every row has recorded a step
            recorded = (self.row("steps_recorded")[pending] > 0).tolist()
            for k, has in zip(pending, recorded):
                self.scalers[k].__dict__["has_history"] = has
        for scaler in self.scalers:
            scaler.__dict__["version"] += 1


def banks(scalers: list[Scaler]) -> list[ScalerBank]:
    """The stacked banks of ``scalers`` (one per algorithm/window/alpha/max_val/margin/device), reused while intact."""
    groups: dict[tuple, list[Scaler]] = {}
    for s in scalers:
        key = (s.algo, s.history_len, s.alpha, s.max_val, s.margin, s.power_2, s._buffers["amax_history"].device)
        groups.setdefault(key, []).append(s)
    out = []
    for members in groups.values():
        bank = getattr(members[0], "_bank", None)
        if bank is None or not bank.intact(members):
            bank = ScalerBank(members)
        out.append(bank)
    return out


@torch.no_grad()
def sync_step_amax(scalers: list[Scaler], group=None, bad_step: torch.Tensor | None = None) -> torch.Tensor | None:
    """Make every data-parallel rank hold the same step amax: one MAX all-reduce on one flat buffer.

    The buffer holds ``[step_amax, step_seen, step_clipped > 0, step_whatif_clipped > 0]`` of every scaler
    (and, when given, the rank's ``bad_step`` flag, 1.0 where its loss/gradient was non-finite). NaN is mapped
    to +inf first (a MAX reduction may drop NaN); inf then marks the step invalid on every rank alike, so every
    rank pushes the same value (or nothing) into its history and computes the same scale.

    The flag makes the skip decision collective: under a sharded strategy (FSDP) each rank sees only
    its own gradient shard, so one rank's NaN must skip the step everywhere. Returns the reduced flag
    (``bad_step`` itself on one process), or None when no flag was given.

    Uses ``torch.distributed`` on ``group`` (default: the world group, which DDP and FSDP both use);
    a no-op without an initialised process group of more than one rank. The third entry makes a
    saturation event (a step that clipped on any rank) count alike on every rank, and the what-if flags do the
    same for each estimator's what-if events; the element counts (clipped / quantized / what-if clipped) stay
    per rank and are summed when logged (``scaling.sum_over_ranks``).
    """
    if not _data_parallel(group):
        return bad_step
    stacks = banks(scalers) if scalers else []
    parts = [bank.sync_parts() for bank in stacks]
    if bad_step is not None:
        device = stacks[0].f32.device if stacks else bad_step.device
        parts.append(bad_step.detach().float().reshape(1).to(device))
    if not parts:
        return bad_step
    flat = torch.nan_to_num(torch.cat(parts).float(), nan=math.inf, posinf=math.inf)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for bank in stacks:
        size = SYNC_WIDTH * len(bank.scalers)
        bank.take_synced(flat[offset: offset + size])
        offset += size
    return None if bad_step is None else flat[-1].to(bad_step.device) > 0


def advance_all(scalers: list[Scaler]) -> None:
    """Close one optimizer step for every scaler (after :func:`sync_step_amax`): batched."""
    for bank in banks(scalers):
        bank.advance()


def discard_all(scalers: list[Scaler]) -> None:
    """Forget the step's observations of every scaler (a skipped step): batched."""
    for bank in banks(scalers):
        bank.discard()


def seed_all(scalers: list[Scaler]) -> None:
    """:meth:`AmaxScaler.seed_history` for every scaler: batched."""
    for bank in banks(scalers):
        bank.seed_history()
